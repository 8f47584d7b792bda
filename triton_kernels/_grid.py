"""The split / grid policy: how many programs a launch gets, counted in whole waves of the CTAs
that really fit on the device (issue 13).

Occupancy comes from the compiled kernel, not a constant: :class:`Occupancy` (registers per
thread, threads and shared memory per CTA) gives :meth:`Occupancy.ctas_per_sm` under Hopper's
per-SM limits; :func:`kernel_occupancy` reads it from the JIT's compiled variant on a GPU
(``n_regs``, ``num_warps``, ``shared``; compiled once, cached per variant) and, off a GPU,
from the table the sm_90 compile step writes (:mod:`mqnc.triton_kernels._sm90_table`, checked
in, compared with a fresh compile by the compile test).

The split-KV choice (:func:`choose_num_splits`) minimises a predicted time in bytes at the copy
ceiling, for ``programs`` (token x head-block) programs over ``tiles`` KV tiles each::

    cost(S) = waves(programs * S) * slots * cta_bytes(S) + merge_bytes(S) + launch_bytes(S)

    slots          = sms * ctas_per_sm                  (CTAs resident at once: one wave)
    waves(n)       = ceil(n / slots)
    cta_bytes(S)   = in_bytes + ceil(tiles / S) * tile_bytes + out_bytes(S)
                     (a CTA's query rows, its KV tiles, then its output: the fp32 partial
                     when S > 1)
    merge_bytes(S) = programs * S * out_bytes(S)  if S > 1 else 0   (the combine reads them back)
    launch_bytes(S)= LAUNCH_US * CEILING_BYTES_PER_US if S > 1 else 0   (the combine's launch)

over ``1 <= S <= tiles // min_tiles`` (at least ``MIN_TOKENS_PER_SPLIT = 64`` tokens per
split), ties to the smaller S. A wave's time is its slowest CTA's, and a CTA streams at its share
``ceiling / slots`` of the bandwidth, so a wave costs ``slots * cta_bytes`` bytes of ceiling time;
a grid that fills whole waves is the cheapest, a short context at B 1 spreads over as many SMs
as its 64-token splits allow, and splitting stops where the partials' extra traffic and the
combine's launch outweigh it. A persistent grid is not used: with this policy every wave is
full to within one CTA per SM for uniform lengths, and a persistent loop would only pay for
ragged lengths (the holder's batches are of one chunk), at the price of a work queue.
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
    "waves",
    "sm_count",
    "device_limits",
    "kernel_occupancy",
]

MIN_TOKENS_PER_SPLIT = 64
# The H200's measured device copy ceiling (issue 13: ~4.3 TB/s), bytes per microsecond: the unit
# in which the policy and perf/kernel_report.py predict (predictions, never measurements).
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


def split_cost(
    num_splits: int,
    *,
    programs: int,
    tiles: int,
    tile_bytes: int,
    in_bytes: int,
    out_bytes: int,
    split_out_bytes: int,
    slots: int,
) -> SplitCost:
    """The policy's cost of ``num_splits`` (module docstring): ``programs`` programs of ``tiles``
    KV tiles of ``tile_bytes`` each; every CTA reads ``in_bytes`` (its query rows) and writes
    ``out_bytes`` unsplit, or ``split_out_bytes`` (its fp32 partial) per split."""
    s = num_splits
    tiles_per_cta = -(-tiles // s) if tiles else 0
    out = out_bytes if s == 1 else split_out_bytes
    cta_bytes = in_bytes + tiles_per_cta * tile_bytes + out
    ctas = programs * s
    w = waves(ctas, slots)
    merge = programs * s * split_out_bytes if s > 1 else 0
    launch = LAUNCH_US * CEILING_BYTES_PER_US if s > 1 else 0.0
    return SplitCost(
        num_splits=s,
        ctas=ctas,
        waves=w,
        cta_bytes=cta_bytes,
        kv_bytes=programs * tiles * tile_bytes,
        merge_bytes=merge,
        cost_bytes=w * slots * cta_bytes + merge + launch,
        slots=slots,
    )


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
    slots: int,
) -> int:
    """The split count of least :func:`split_cost` (module docstring), ties to fewer splits.

    ``programs`` token x head-block programs, each over ``tiles`` KV tiles (the capacity, never
    the lengths: no host sync); at least ``min_tiles`` tiles per split; ``slots`` CTAs resident
    per wave (``sms * ctas_per_sm``). Only ``S <= 2 * ceil(slots / programs)`` is searched: past
    two waves of splits every extra wave adds its partials and no parallelism.
    """
    if programs <= 0 or tiles <= 0:
        return 1
    s_max = max(1, min(tiles // max(min_tiles, 1), 2 * waves(slots, programs)))
    best, best_cost = 1, math.inf
    for s in range(1, s_max + 1):
        c = split_cost(
            s,
            programs=programs,
            tiles=tiles,
            tile_bytes=tile_bytes,
            in_bytes=in_bytes,
            out_bytes=out_bytes,
            split_out_bytes=split_out_bytes,
            slots=slots,
        ).cost_bytes
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
    from mqnc.triton_kernels._sm90_table import SM90_VARIANTS

    row = SM90_VARIANTS.get(name)
    if row is None:
        return _ONE_PER_SM
    return Occupancy(
        registers=row["registers"], threads=32 * row["num_warps"], shared=row["shared"]
    )
