"""Host time of a kernel launch: what the package's Python costs between a caller and the GPU.

The holder's partial at the decode operating point (dense H 16, B 1, c_t 2048) takes ~12.5 us on
an H200; an eager call of its launcher once took 209 us of host time. This module times, at one
shape, the host time of each way to launch it (:func:`launch_cases`):

``eager``
    ``mla_decode_partial(..., check_inputs=False)``: the public function, the op dispatcher,
    the plan cache's lookup (one plan per call signature) and the plan's launches;
``plan.run``
    the plan's run path alone (:class:`~mqnc.triton_kernels.mla.plan.AttentionPlan`);
``graph.replay`` (GPU)
    the same run captured once in a CUDA graph, replayed;
``step.replay`` (GPU)
    a routed step (two holders' partials of one query batch, then the requester's merge of the
    two, ``check_lse=False``) captured in a CUDA graph, replayed: what a holder or a requester
    that replays its step pays per step.

``flashmla``
    FlashMLA's call, ``mla_decode_with_kvcache(..., check_inputs=False)`` (its own plan cache);
``checked``
    ``mla_decode_partial`` with its checks on (the default): the cached plan after the checks
    (compiled: one check kernel and one host sync);

``eager (stubbed)``, ``plan.run (stubbed)``, ``flashmla (stubbed)``, ``checked (stubbed)``: the
same with every kernel launch replaced by a no-op
(:class:`~mqnc.triton_kernels._core.launch.LaunchRunner`), on any machine: the package's own
Python, the part a CPU can measure (``correctness/test_host_path.py`` pins its call counts).

Host time is wall time from the call to its return with the device idle before it
(``torch.cuda.synchronize()`` first, outside the timed region): the launch cost, not the
kernel's.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["LaunchShape", "launch_cases", "host_times", "combine_pdl_times"]

SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2  # DeepSeek-V2-Lite with YaRN


class LaunchShape:
    """The timed shape: ``B`` query tokens x ``H`` heads over ``ct`` cache entries each (pages
    of 64, bf16)."""

    def __init__(self, B: int = 1, H: int = 16, ct: int = 2048) -> None:
        self.B, self.H, self.ct = B, H, ct

    @property
    def label(self) -> str:
        return f"H={self.H},B={self.B},ct={self.ct}"


def _inputs(shape: LaunchShape, device: str, gen: torch.Generator, offset: int = 0):
    dtype = torch.bfloat16
    pages = -(-shape.ct // 64)
    q = torch.randn(shape.B, shape.H, 576, generator=gen).to(device, dtype)
    pool = torch.randn(shape.B * pages + 1, 64, 576, generator=gen).to(device, dtype)
    table = (torch.arange(shape.B * pages, dtype=torch.int32) + offset).reshape(shape.B, pages)
    table = (table % (shape.B * pages + 1)).to(device)
    lens = torch.full((shape.B,), shape.ct, dtype=torch.int32, device=device)
    return q, pool, table, lens


@contextlib.contextmanager
def stubbed_launches():
    """Every plan launch a no-op inside the block (the package's Python alone)."""
    from mqnc.triton_kernels._core.launch import LaunchRunner

    real = LaunchRunner.__call__
    LaunchRunner.__call__ = lambda self, interpreted, *tensors: None
    try:
        yield
    finally:
        LaunchRunner.__call__ = real


def _captured(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (warmed off the capture stream first); its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def launch_cases(shape: LaunchShape, device: str) -> dict[str, tuple[Callable, bool]]:
    """``{case: (callable, stubbed)}`` at ``shape`` on ``device`` (module docstring)."""
    from mqnc.triton_kernels import merge_partials, mla_decode_partial, plan_mla_decode
    from mqnc.triton_kernels.adapters.flashmla import mla_decode_with_kvcache

    gen = torch.Generator().manual_seed(0)
    q, pool, table, lens = _inputs(shape, device, gen)
    kw = dict(softmax_scale=SCALE, check_inputs=False)
    plan = plan_mla_decode(q, pool, table, lens, **kw)

    def eager():
        return mla_decode_partial(q, pool, table, lens, **kw)

    def run():
        return plan.run(q, pool, table, lens)

    def checked():
        return mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE)

    q4, cache4 = q.view(shape.B, 1, shape.H, 576), pool[:, :, None]

    def flashmla():
        return mla_decode_with_kvcache(q4, cache4, table, lens, **kw)

    cases = {
        "eager (stubbed)": (eager, True),
        "plan.run (stubbed)": (run, True),
        "flashmla (stubbed)": (flashmla, True),
        "checked (stubbed)": (checked, True),
    }
    if device != "cuda":
        return cases
    cases.update({"eager": (eager, False), "plan.run": (run, False)})
    cases.update({"flashmla": (flashmla, False), "checked": (checked, False)})
    cases["graph.replay"] = (_captured(run), False)
    _, pool_b, table_b, lens_b = _inputs(shape, device, gen, offset=1)
    plan_b = plan_mla_decode(q, pool_b, table_b, lens_b, **kw)

    def step():
        o_a, l_a = plan.run(q, pool, table, lens)
        o_b, l_b = plan_b.run(q, pool_b, table_b, lens_b)
        return merge_partials(
            torch.stack([o_a, o_b]), torch.stack([l_a, l_b]), check_lse=False, layout="MBHD"
        )

    cases["step.replay"] = (_captured(step), False)
    return cases


def host_times(cases: dict, *, reps: int, warmup: int) -> dict[str, tuple[float, float, float]]:
    """p20 / p50 / p80 host microseconds of each case (device idle before each call)."""
    cuda = torch.cuda.is_available()
    out = {}
    for name, (fn, stub) in cases.items():
        with stubbed_launches() if stub else contextlib.nullcontext():
            for _ in range(warmup):
                fn()
            samples = []
            for _ in range(reps):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                fn()
                samples.append((time.perf_counter_ns() - t0) / 1e3)
        if cuda:
            torch.cuda.synchronize()
        p20, p50, p80 = np.percentile(np.asarray(samples), [20, 50, 80])
        out[name] = (float(p20), float(p50), float(p80))
    return out


def combine_pdl_times(shape: LaunchShape, *, reps: int, warmup: int) -> dict:
    """GPU only: the device time of the plan's run (attention, then the split-KV combine) at
    ``shape`` with the combine launched plainly and as a programmatic dependent launch
    (:func:`mqnc.triton_kernels.merge.partials.combine_pdl`), each over rotated input sets in
    CUDA-graph replays (:func:`mqnc.measure.time_kernel`): ``{"plain" | "pdl": Timed}``. Inputs
    as in :func:`launch_cases`, one set per plan so that no call finds its cache in L2."""
    from mqnc.measure.timing import input_sets, l2_bytes, time_kernel
    from mqnc.triton_kernels import plan_mla_decode
    from mqnc.triton_kernels.merge.partials import combine_pdl

    gen = torch.Generator().manual_seed(1)
    nbytes = shape.B * shape.ct * 576 * 2
    out = {}
    for name, on in (("plain", False), ("pdl", True)):
        calls = []
        for _ in range(input_sets(nbytes, l2_bytes())):
            q, pool, table, lens = _inputs(shape, "cuda", gen)
            with combine_pdl(on):
                plan = plan_mla_decode(
                    q, pool, table, lens, softmax_scale=SCALE, check_inputs=False
                )
            calls.append(lambda plan=plan, a=(q, pool, table, lens): plan.run(*a))
        out[name] = time_kernel(calls, working_set_bytes=nbytes, warmup=warmup, reps=reps)
    return out
