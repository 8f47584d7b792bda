"""The split / grid policy: how many programs a launch gets, counted in whole waves of the CTAs
that really fit on the device (a partial wave leaves SMs idle for a whole wave's time).

Occupancy comes from the compiled kernel, not a constant: :class:`Occupancy` (registers per
thread, threads and shared memory per CTA) gives :meth:`Occupancy.ctas_per_sm` under Hopper's
per-SM limits; :func:`kernel_occupancy` reads it from the JIT's compiled variant on a GPU
(``n_regs``, ``num_warps``, ``shared``; compiled once, cached per variant) and, off a GPU,
from the table the sm_90 compile step writes (:mod:`mqnc.triton_kernels.sm90.table`, checked
in, compared with a fresh compile by the compile test).

The split-KV choice (:func:`choose_num_splits`) minimises a predicted time, in bytes at the
copy ceiling, for ``programs`` (token x head-block) programs over ``tiles`` KV tiles each::

    cost(S) = waves(programs * S) * slots * cta_bytes(S) + merge_cost(S) + launch(S)

    slots         = sms * ctas_per_sm            CTAs resident at once: one wave
    waves(n)      = ceil(n / slots)
    cta_bytes(S)  = in_bytes + ceil(tiles / S) * tile_bytes + out(S)
                    a CTA's query rows, its DRAM share of its KV tiles (a token's head blocks
                    run side by side and read each tile from DRAM once between them), then
                    its output: unsplit, or its fp32 partial (out(S) = split_out_bytes)
    merge_cost(S) = programs * S * split_out_bytes * sms / min(programs * merge_ctas, sms)
                    the combine reads the partials back; fewer CTAs than SMs stream at their
                    SMs' share only (0 for S = 1)
    launch(S)     = LAUNCH_US * CEILING_BYTES_PER_US, the combine's launch (0 for S = 1)

over ``1 <= S <= min(tiles // min_tiles, 512)`` (at least ``MIN_TOKENS_PER_SPLIT = 64``
entries per split), ties to the smaller S. A wave lasts as long as its slowest CTA, and a CTA
streams at its share ``ceiling / slots``, so a wave costs ``slots * cta_bytes``: a grid that
fills whole waves is the cheapest, a short context at B 1 spreads over as many SMs as its
64-entry splits allow, and splitting stops where the partials' traffic and the combine's launch
outweigh the SMs it adds. Worked examples (one CTA per SM, 132 SMs) are in docs/kernels.md.

A persistent grid is not used: for the uniform lengths of a holder's batch (one chunk) this
policy fills every wave to within one CTA per SM (>= 96% at the goal shapes, see
``correctness/test_grid.py``), and a persistent loop would pay only for ragged lengths, at the
price of a work queue and a loop-carried tile schedule that Triton cannot pipeline across.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

__all__ = [
    "SmLimits",
    "SM90",
    "Occupancy",
    "MIN_TOKENS_PER_SPLIT",
    "CEILING_BYTES_PER_US",
    "LAUNCH_US",
    "SplitCost",
    "split_cost",
    "choose_num_splits",
    "MAX_SPLITS",
    "waves",
    "sm_count",
    "device_limits",
    "kernel_occupancy",
]

MIN_TOKENS_PER_SPLIT = 64
# The H200 device copy ceiling the goal shapes were set against (~4.3 TB/s), bytes per us: the unit
# in which the policy and mqnc/measure/kernel_report.py predict (predictions, never measurements).
CEILING_BYTES_PER_US = 4.3e6
LAUNCH_US = 2.0  # a second, dependent kernel launch on the same stream (prediction)


@dataclasses.dataclass(frozen=True)
class SmLimits:
    """Per-SM resources that bound how many CTAs are resident at once (defaults: sm_90)."""

    sms: int = 132  # H100 / H200 SXM
    regs: int = 65536
    threads: int = 2048
    ctas: int = 32
    shared: int = 233472  # 228 KiB per SM
    shared_per_cta_reserved: int = 1024  # the driver's reservation per CTA
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of 256

    @property
    def shared_per_cta(self) -> int:
        """The most shared memory one CTA may have (a launch asking more fails)."""
        return self.shared - self.shared_per_cta_reserved


SM90 = SmLimits()


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """A compiled kernel's per-CTA resources: registers per thread, threads, shared bytes."""

    registers: int
    threads: int
    shared: int

    def ctas_per_sm(self, limits: SmLimits = SM90) -> int:
        """CTAs of this kernel resident on one SM (at least 1: a launch that fits at all)."""
        warps = math.ceil(self.threads / 32)
        regs_per_warp = math.ceil(max(self.registers, 1) * 32 / limits.reg_alloc_unit)
        regs_per_warp *= limits.reg_alloc_unit
        by_regs = limits.regs // (regs_per_warp * warps)
        by_threads = limits.threads // (warps * 32)
        by_shared = (
            limits.shared // (self.shared + limits.shared_per_cta_reserved)
            if self.shared
            else limits.ctas
        )
        return max(1, min(by_regs, by_threads, by_shared, limits.ctas))


def waves(ctas: int, slots: int) -> int:
    """Waves of ``slots`` resident CTAs that ``ctas`` CTAs take."""
    return -(-ctas // slots)


@dataclasses.dataclass(frozen=True)
class SplitCost:
    """The policy's prediction for one split count (bytes; ``us`` at the copy ceiling)."""

    num_splits: int
    ctas: int
    waves: int
    cta_bytes: int
    kv_bytes: int
    merge_bytes: int
    cost_bytes: float
    slots: int

    @property
    def us(self) -> float:
        """Predicted time at the copy ceiling (a prediction, not a measurement)."""
        return self.cost_bytes / CEILING_BYTES_PER_US

    @property
    def fill(self) -> float:
        """Fraction of the resident CTA slots that the grid's waves use."""
        return self.ctas / (self.waves * self.slots)


def _cost(
    s, programs, tiles, tile_bytes, in_bytes, out_bytes, split_out_bytes, merge_ctas, slots, sms
):
    """``(ctas, waves, cta_bytes, merge_bytes, cost_bytes)`` of ``s`` splits."""
    out = out_bytes if s == 1 else split_out_bytes
    cta_bytes = in_bytes + (-(-tiles // s)) * tile_bytes + out
    ctas = programs * s
    w = -(-ctas // slots)
    merge = ctas * split_out_bytes if s > 1 else 0
    merge_cost = merge * sms / max(1, min(programs * merge_ctas, sms))
    launch = LAUNCH_US * CEILING_BYTES_PER_US if s > 1 else 0.0
    return ctas, w, cta_bytes, merge, w * slots * cta_bytes + merge_cost + launch


def split_cost(
    num_splits: int,
    *,
    programs: int,
    tiles: int,
    tile_bytes: int,
    in_bytes: int,
    out_bytes: int,
    split_out_bytes: int,
    merge_ctas: int,
    slots: int,
    sms: int = SM90.sms,
) -> SplitCost:
    """The policy's cost of ``num_splits`` (module docstring): ``programs`` programs of ``tiles``
    KV tiles of ``tile_bytes`` each; every CTA reads ``in_bytes`` (its query rows) and writes
    ``out_bytes`` unsplit, or ``split_out_bytes`` (its fp32 partial) per split; the combine
    runs ``merge_ctas`` CTAs per program."""
    ctas, w, cta_bytes, merge, cost = _cost(
        num_splits,
        programs,
        tiles,
        tile_bytes,
        in_bytes,
        out_bytes,
        split_out_bytes,
        merge_ctas,
        slots,
        sms,
    )
    return SplitCost(
        num_splits=num_splits,
        ctas=ctas,
        waves=w,
        cta_bytes=cta_bytes,
        kv_bytes=programs * tiles * tile_bytes,
        merge_bytes=merge,
        cost_bytes=cost,
        slots=slots,
    )


MAX_SPLITS = 512  # the search's upper end (a 64-entry split at 32k entries)


@functools.lru_cache(maxsize=4096)
def choose_num_splits(
    programs: int,
    tiles: int,
    *,
    min_tiles: int,
    tile_bytes: int,
    in_bytes: int,
    out_bytes: int,
    split_out_bytes: int,
    merge_ctas: int,
    slots: int,
    sms: int = SM90.sms,
) -> int:
    """The split count of least :func:`split_cost` (module docstring), ties to fewer splits.

    ``programs`` token x head-block programs, each over ``tiles`` KV tiles (the capacity, never
    the lengths: no host sync); at least ``min_tiles`` tiles per split, at most
    :data:`MAX_SPLITS` splits; ``slots`` CTAs resident per wave (``sms * ctas_per_sm``); the
    combine runs ``merge_ctas`` CTAs per program.
    Every candidate is priced (cached per argument set: one search per batch geometry).
    """
    if programs <= 0 or tiles <= 0:
        return 1
    s_max = max(1, min(tiles // max(min_tiles, 1), MAX_SPLITS))
    args = (programs, tiles, tile_bytes, in_bytes, out_bytes, split_out_bytes, merge_ctas)
    args += (slots, sms)
    best, best_cost = 1, math.inf
    for s in range(1, s_max + 1):
        c = _cost(s, *args)[4]
        if c < best_cost:
            best, best_cost = s, c
    return best


@functools.cache
def _device_limits(index: int) -> SmLimits:
    p = torch.cuda.get_device_properties(index)
    return SmLimits(
        sms=p.multi_processor_count,
        regs=getattr(p, "regs_per_multiprocessor", SM90.regs),
        threads=getattr(p, "max_threads_per_multi_processor", SM90.threads),
        shared=getattr(p, "shared_memory_per_multiprocessor", SM90.shared),
    )


def device_limits(device: torch.device) -> SmLimits:
    """The SM limits of ``device`` (queried once per GPU); :data:`SM90` (132 SMs) off a GPU, so
    the interpreter exercises the choices an H100 / H200 makes."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _device_limits(index)
    return SM90


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 off a GPU)."""
    return device_limits(device).sms


_GPU_OCCUPANCY: dict[tuple, Occupancy] = {}
# Off a GPU, a variant missing from the table (an fp32 or fp16 test variant) is taken to fit
# one CTA per SM, the production kernels' occupancy.
_ONE_PER_SM = Occupancy(registers=255, threads=256, shared=0)


def kernel_occupancy(name: str, device: torch.device, make_launch) -> Occupancy:
    """The occupancy of the compiled variant called ``name``.

    On a GPU: Triton's own compiled kernel for ``make_launch()`` (a :class:`~._launch.Launch`
    of that variant; ``JITFunction.warmup`` compiles it, and the real launch then finds it in
    the JIT cache): its ``n_regs``, ``num_warps`` and ``shared``, cached per (device, name).
    Off a GPU: the checked-in sm_90 table (:mod:`._sm90_table`), or one CTA per SM for a variant
    it does not list (``make_launch`` is not called).
    """
    if device.type == "cuda":
        key = (device.index, name)
        occ = _GPU_OCCUPANCY.get(key)
        if occ is None:
            launch = make_launch()
            compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
            compiled._init_handles()
            occ = Occupancy(
                registers=int(compiled.n_regs),
                threads=32 * int(compiled.metadata.num_warps),
                shared=int(compiled.metadata.shared),
            )
            _GPU_OCCUPANCY[key] = occ
        return occ
    from mqnc.triton_kernels.sm90.table import SM90_VARIANTS

    row = SM90_VARIANTS.get(name)
    if row is None:
        return _ONE_PER_SM
    return Occupancy(
        registers=row["registers"], threads=32 * row["num_warps"], shared=row["shared"]
    )
