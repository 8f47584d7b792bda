"""Timing: percentiles of repeated calls, on the GPU's clock or the host's (§4.3's protocol:
warm-up first, p20/p50/p80 of the timed repetitions)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from mqnc.base.checks import check_int

__all__ = ["time_fn", "time_interleaved", "interleaved_samples", "one_intra_op_thread"]


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
