"""Timing: percentiles of repeated calls, on the GPU's clock or the host's (§4.3's protocol:
warm-up first, p20/p50/p80 of the timed repetitions).

Two timers, for two kinds of work:

- :func:`time_kernel` times GPU kernels as the GPU runs them: the calls (one per input set,
  the sets rotated so that one pass over them is at least twice the L2, see
  :func:`input_sets`) are captured once in a CUDA graph and the graph is replayed between
  CUDA events, so the time per call is device time with no Python in it and no input left in
  L2 by the previous call; the host cost of one call (what the Python launcher takes to
  return) is measured separately. If capture fails it falls back to
  ``triton.testing.do_bench`` (events around each call, L2 flushed before each). Off a GPU it
  times the calls on the host clock. Each result says how it was timed (:class:`Timed.how`,
  recorded as ``extra.timing``).
- :func:`time_fn` / :func:`time_interleaved` time host-side work (transport round trips).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from mqnc.base.checks import check_int, check_number

__all__ = [
    "time_fn",
    "time_interleaved",
    "interleaved_samples",
    "time_kernel",
    "Timed",
    "input_sets",
    "l2_bytes",
    "one_intra_op_thread",
]

MAX_INPUT_SETS = 64
"""At most this many rotated input sets (a working set of a few KB is not worth more)."""


def time_fn(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    reps: int = 20,
    min_time_s: float = 0.0,
    cuda: bool | None = None,
):
    """Time ``fn`` and return (p20, p50, p80) in microseconds.

    With ``cuda`` (default: whether a CUDA device exists) each repetition is bracketed by CUDA
    events; otherwise by ``time.perf_counter_ns`` (pass ``cuda=False`` for host-only work on a
    GPU machine). ``reps`` repetitions after ``warmup`` untimed ones (at least ``min_time_s`` of
    timed work when given).
    """
    check_int("warmup", warmup, minimum=0)
    check_int("reps", reps, minimum=1)
    check_number("min_time_s", min_time_s, nonnegative=True)
    if cuda is None:
        cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    samples: list[float] = []
    start_all = time.perf_counter()
    while len(samples) < reps or time.perf_counter() - start_all < min_time_s:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - t0) / 1e3)
    p20, p50, p80 = np.percentile(np.asarray(samples), [20, 50, 80])
    return float(p20), float(p50), float(p80)


@dataclasses.dataclass(frozen=True)
class Timed:
    """Percentiles of one timed quantity (microseconds per call) and how it was timed.

    ``how`` (recorded as ``extra.timing``): ``method`` (``"cuda-graph"``, ``"do_bench"`` or
    ``"host-clock"``), ``input_sets`` (the rotated sets), ``working_set_bytes``, ``l2_bytes``,
    ``host_us`` (p50 host time of one call until it returns: the launch cost), ``samples``,
    ``calls_per_sample``, and the caller's facts (e.g. ``checks: "off"``)."""

    p20: float
    p50: float
    p80: float
    how: dict

    @property
    def percentiles(self) -> tuple[float, float, float]:
        return (self.p20, self.p50, self.p80)


def l2_bytes(device: torch.device | str | None = None) -> int:
    """The L2 cache of a CUDA ``device`` in bytes (60 MB on an H200); 0 off a GPU."""
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def input_sets(working_set_bytes: int, l2: int, *, factor: float = 2.0) -> int:
    """How many input sets a kernel benchmark rotates through: enough that one pass over them
    moves ``factor`` times the L2 (``l2`` bytes; 0 off a GPU: one set), so that no call finds
    its inputs left in L2 by an earlier one; at most :data:`MAX_INPUT_SETS`."""
    check_int("working_set_bytes", working_set_bytes, minimum=1)
    if l2 <= 0:
        return 1
    return max(1, min(MAX_INPUT_SETS, math.ceil(factor * l2 / working_set_bytes)))


def _pct(samples) -> tuple[float, float, float]:
    p20, p50, p80 = np.percentile(np.asarray(samples, dtype=float), [20, 50, 80])
    return float(p20), float(p50), float(p80)


def _host_us(calls: Sequence[Callable[[], object]], n: int, cuda: bool) -> tuple:
    """Host time of each call until it returns (the device idle before each): launch cost."""
    samples = []
    for i in range(n):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        calls[i % len(calls)]()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    if cuda:
        torch.cuda.synchronize()
    return _pct(samples)


def _graph_us(calls: Sequence[Callable[[], object]], reps: int, warmup: int) -> list[float]:
    """Device microseconds per call: all calls captured in one CUDA graph, replays timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first calls off the capture (allocator, lazy init)
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    return samples


def _do_bench_us(calls: Sequence[Callable[[], object]], reps: int) -> tuple:
    import triton.testing

    n = [0]

    def one():
        calls[n[0] % len(calls)]()
        n[0] += 1

    ms = triton.testing.do_bench(one, warmup=10, rep=max(reps, 20), quantiles=[0.2, 0.5, 0.8])
    return tuple(float(x) * 1e3 for x in ms)


def time_kernel(
    calls: Sequence[Callable[[], object]],
    *,
    working_set_bytes: int | None = None,
    warmup: int = 3,
    reps: int = 20,
    cuda: bool | None = None,
    graph: bool = True,
    **facts,
) -> Timed:
    """Time GPU kernel calls as the GPU runs them (module docstring): microseconds per call.

    Parameters
    ----------
    calls : sequence of callables
        The same call over each rotated input set (:func:`input_sets` of them); each must be
        capturable in a CUDA graph on a GPU: no host syncs (pass ``check_inputs=False`` and the
        like), no host reads of device values.
    working_set_bytes : int or None
        Bytes one call moves (recorded).
    warmup, reps : int
        Untimed and timed graph replays (or host-clock calls off a GPU).
    cuda : bool or None
        Default: whether a CUDA device exists.
    graph : bool
        Capture and replay a CUDA graph (False: ``do_bench`` at once, for calls known not to
        be capturable, e.g. ones that copy host data to the device).
    **facts
        Recorded in :attr:`Timed.how` as given (e.g. ``checks="off"``).
    """
    if not calls:
        raise ValueError("calls: expected at least one callable")
    check_int("reps", reps, minimum=1)
    if cuda is None:
        cuda = torch.cuda.is_available()
    how: dict = {
        "input_sets": len(calls),
        "working_set_bytes": working_set_bytes,
        "l2_bytes": l2_bytes() if cuda else 0,
        **facts,
    }
    if not cuda:
        for i in range(warmup):
            calls[i % len(calls)]()
        samples = []
        for i in range(reps):
            t0 = time.perf_counter_ns()
            calls[i % len(calls)]()
            samples.append((time.perf_counter_ns() - t0) / 1e3)
        pct = _pct(samples)
        how.update(method="host-clock", samples=reps, calls_per_sample=1, host_us=pct[1])
        return Timed(*pct, how=how)
    for call in calls:  # compile / load, outside every timed region
        call()
    torch.cuda.synchronize()
    how["host_us"] = _host_us(calls, max(reps, len(calls)), cuda)[1]
    if graph:
        try:
            pct = _pct(_graph_us(calls, reps, warmup))
            how.update(method="cuda-graph", samples=reps, calls_per_sample=len(calls))
            return Timed(*pct, how=how)
        except Exception as exc:  # noqa: BLE001 - not capturable after all: do_bench instead
            torch.cuda.synchronize()
            how["graph_error"] = repr(exc)[:200]
    pct = _do_bench_us(calls, reps)
    how.update(method="do_bench", l2="flushed before each call")
    return Timed(*pct, how=how)


def time_interleaved(fns: dict, *, warmup: int = 3, reps: int = 20, progress=None) -> dict:
    """Time several host-side callables round-robin: ``{key: (p20, p50, p80)}`` in us.

    Each repetition runs every callable once (``time.perf_counter_ns``), in a fresh random
    order (seeded), so that drift of a shared machine (other processes taking the cores for a
    while) lands on every point alike instead of biasing the points timed during it, which a
    point-after-point sweep does, and no point always follows the same neighbour (a probe
    timed right after the 4096-row round trip read ~60 us slower than one after small ones).
    ``progress`` is an optional tqdm-like callable wrapped around the repetitions.
    """
    out = {}
    for k, v in interleaved_samples(fns, warmup=warmup, reps=reps, progress=progress).items():
        p20, p50, p80 = np.percentile(np.asarray(v), [20, 50, 80])
        out[k] = (float(p20), float(p50), float(p80))
    return out


def interleaved_samples(fns: dict, *, warmup: int = 3, reps: int = 20, progress=None) -> dict:
    """The samples (us) behind :func:`time_interleaved`: ``{key: [reps floats]}``."""
    check_int("reps", reps, minimum=1)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict = {k: [] for k in fns}
    keys = list(fns)
    rng = np.random.default_rng(0)
    rounds = range(reps) if progress is None else progress(range(reps))
    for _ in rounds:
        for i in rng.permutation(len(keys)):
            k, fn = keys[i], fns[keys[i]]
            t0 = time.perf_counter_ns()
            fn()
            samples[k].append((time.perf_counter_ns() - t0) / 1e3)
    return samples


def one_intra_op_thread() -> None:
    """Run the requester's torch ops on one intra-op thread.

    On a small CPU box, OpenMP worker threads spin-wait after each parallel region and starve
    the transport's receiver threads (measured here: a gloo round trip plus a tiny torch merge
    took 3.9 ms with 2 threads, 1.4 ms with 1, the sum of the parts). Host-side transport
    benchmarks call this first; the echo holder processes do the same.
    """
    torch.set_num_threads(1)
