"""Host side shared by the dense paged and the sparse top-k partial-MLA launchers (§3.3, §6.3):
tile configurations, operand checks (a fused 576-wide query and cache, or FlashInfer's split
latent / rope tensors), the split-KV outputs, the plan of one call (the split choice, the
attention launch and the merge kernel's combine of split partials) and the reusable plan of a
batch shape (:class:`AttentionPlan`: checks and split choice once, launches per ``run``).

The device side they share is :mod:`mqnc.triton_kernels.mla.tile`; the public ops are
``mla.decode.mla_decode_partial`` and ``mla.sparse.mla_sparse_partial``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import torch
import triton

from mqnc.triton_kernels._core.execution import (
    bf16_rne_in_software,
    interpreted,
    new_output,
    poisoning,
)
from mqnc.triton_kernels._core.grid import (
    MIN_TOKENS_PER_SPLIT,
    Occupancy,
    choose_num_splits,
    device_limits,
    kernel_occupancy,
)
from mqnc.triton_kernels._core.launch import Launch, LaunchRunner
from mqnc.triton_kernels._core.op import (
    check_no_overlap,
    set_plan_context,
    written_into,  # noqa: F401  (re-exported)
)
from mqnc.triton_kernels._core.validate import (
    FLOAT_DTYPES,
    check_dtype_matches,
    check_tensor,
    dtype_name,
)
from mqnc.triton_kernels.fp8.cache import as_bytes, check_fp8_layout, fp8_rope_view, is_fp8_pool
from mqnc.triton_kernels.merge.partials import merge_launch

__all__ = [
    "TileConfig",
    "tile_config",
    "forced_tile",
    "FP8_SWEEP_TILES",
    "MlaOperands",
    "mla_operands",
    "check_block_size",
    "dot_precision",
    "fp8_entry_bytes",
    "fp8_flags",
    "variant_name",
    "split_outputs",
    "split_strides",
    "split_bytes",
    "MlaPlan",
    "plan_mla",
    "meta_output",
    "AttentionPlan",
    "written_into",
]


REGISTERS_PER_SM = 65536  # sm_90 (and every NVIDIA architecture since Kepler's GK110)


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """``BLOCK_H`` heads x ``BLOCK_N`` cache entries per tile, on ``num_warps`` warps, with
    ``num_stages`` software-pipeline stages and at most ``maxnreg`` registers per thread."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    # ptxas's own register target is not stable across versions: left to itself, the 3.9.0
    # toolchain caps the dense 16 x 64 kernel at 128 registers and spills 8 bytes of stack,
    # while 3.6.0 takes 200 without spilling. The KV ring needs more shared memory than two
    # CTAs per SM can have anyway, so a variant may take all the registers one CTA can have:
    # 65,536 per SM over its 32 * num_warps threads, at most 255 (``reg_cap``; None: that).
    # A 16-warp CTA above 128 cannot launch at all (triton: "out of resource: threads,
    # Required: 512, Hardware limit: 384", seen on an H200).
    maxnreg: int | None = None
    # The kernel the tile runs (``KERNELS``): "" the classic loop (every default), "pipe" the
    # restructured one (full tiles unmasked in a ``tl.range``-pipelined loop, the last tile
    # masked once, one page id per tile), "tma" that loop with TMA tensor-descriptor loads of
    # whole page boxes. Candidates of the sweep until a GPU run shows one faster.
    kernel: str = ""
    # A restructured kernel only: the split combine fused into the attention launch (the split
    # that finishes a row last merges its partials: one launch instead of two), when split.
    fused: bool = False

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {KERNELS}, got {self.kernel!r}")
        if self.fused and not self.kernel:
            raise ValueError("fused: expected a restructured kernel ('pipe' or 'tma'), got ''")

    @property
    def reg_cap(self) -> int:
        """Registers per thread the launch allows (``maxnreg``, or what one CTA can have)."""
        if self.maxnreg is not None:
            return self.maxnreg
        return min(255, REGISTERS_PER_SM // (32 * self.num_warps))

    @property
    def min_tiles(self) -> int:
        """Tiles per split so that a split holds at least ``MIN_TOKENS_PER_SPLIT`` entries."""
        return max(1, MIN_TOKENS_PER_SPLIT // self.block_n)

    @classmethod
    def of_launch(cls, launch) -> TileConfig:
        """The tile an MLA attention launch (a ``_core.launch.Launch``) was planned with."""
        kw = launch.kwargs
        kernel = "" if "RING" not in kw else ("tma" if kw.get("TMA") else "pipe")
        return cls(
            kw["BLOCK_H"],
            kw["BLOCK_N"],
            kw["num_warps"],
            kw["num_stages"],
            kernel=kernel,
            fused=bool(kw.get("FUSED", False)),
        )

    @property
    def label(self) -> str:
        """``"32x32w8s5"``: heads x entries, warps, stages, then ``-pipe`` / ``-tma`` for a
        restructured kernel (what :meth:`parse` reads)."""
        base = f"{self.block_h}x{self.block_n}w{self.num_warps}s{self.num_stages}"
        if self.kernel:
            base += f"-{self.kernel}"
        return base + "-fused" if self.fused else base

    @classmethod
    def parse(cls, text: str, name: str = "tile") -> TileConfig:
        """``"HxNwWsS"`` (e.g. ``"16x64w8s5"``): ``H`` heads x ``N`` entries per tile, both powers
        of two >= 16 (the MMA's smallest M and K), ``W`` warps (1..16, a power of two), ``S``
        pipeline stages (>= 1), optionally ``-pipe`` or ``-tma`` (the restructured kernel, see
        ``kernel``) then ``-fused`` (the combine fused, see ``fused``); ``name`` names the
        argument in the ``ValueError``."""
        if not isinstance(text, str):
            raise TypeError(
                f"{name}: expected a str such as '16x64w8s5', got {type(text).__name__}"
            )
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(?:-(pipe|tma)(-fused)?)?", text.strip())
        if m is None:
            raise ValueError(
                f"{name}: expected 'HxNwWsS[-pipe|-tma][-fused]' such as '16x64w8s5', got {text!r}"
            )
        h, n, w, st = (int(g) for g in m.groups()[:4])
        kernel, fused = m.group(5) or "", bool(m.group(6))
        if not (h >= 16 and n >= 16 and _pow2(h) and _pow2(n)):
            raise ValueError(
                f"{name}: expected heads and entries per tile powers of two >= 16, got {text!r}"
            )
        if not (1 <= w <= 16 and _pow2(w)) or st < 1:
            raise ValueError(
                f"{name}: expected 1..16 warps (a power of two) and >= 1 stage, got {text!r}"
            )
        return cls(h, n, w, st, kernel=kernel, fused=fused)


KERNELS = ("", "pipe", "tma")


# num_stages = 5 is what makes Triton double-buffer the KV tile behind one level of indirection
# (the page-table or index load feeds the KV addresses): the pipeliner gives the index load its
# own stage, and at 3 or 4 stages only one KV buffer is left (TTGIR: `1x64x512xbf16`,
# `async_wait {num = 0}` at the loop top, i.e. no overlap); at 5 it allocates `2x64x512xbf16`
# and waits with `num = 4` groups in flight (triton 3.6.0 and 3.9.0; test_compile_sm90 checks).
_DENSE = {16: TileConfig(16, 64, 8, 5), 32: TileConfig(32, 32, 8, 5)}
_SPARSE = {16: TileConfig(16, 32, 8, 5), 32: TileConfig(32, 16, 8, 5)}
# More than 32 heads (FlashMLA's 64 and 128), from a tile sweep on an H200 under triton 3.6.0
# (``perf/gpu_tiles.sh`` at 0054671; every tile's output checked against the default tile's;
# records in perf/results/results.jsonl, ``extra.tile``), p50 us:
#   dense, B 1 c_t 8192 / B 8 c_t 32768 / B 64 c_t 8192:
#     32x32w8s5 37.7 / 852.5 / 1695;  16x64w8s5 38.6 / 910 / 1814;  64x16w8s5 39.5 / 626 / 1218;
#     64x32w8s3 30.9 / 446 / 864;  64x16w16s5, 64x32w16s5 slower than 32x32w8s5
#   sparse top-2048, B 1 / B 8:
#     32x16w8s5 32.5 / 103.3;  16x32w8s5 20.8 / 90.2;  64x16w8s5 23.8 / 55.7;
#     64x16w16s5 33.3 / 84.4
# Only the 64-head tiles compile to HGMMA (wgmma: a warpgroup's M is 64), and at 128 heads the
# dense kernel is bound by its MMAs, not its loads (300-400 GB/s, 86-89 TFLOP/s at 32 x 32):
# 64x32w8s3 (3 stages: a 2-deep ring, but every wait is for all copy groups) is still the
# fastest. Under triton 3.9.0, where no GPU has run, the two fastest spill (104 B of stack dense,
# 24 B sparse), so there the dense tile stays 32 x 32 and the sparse one is 16 x 32, the fastest
# spill-free tiles measured. Every one of these tiles is checked against fp64 in the interpreter
# (test_mla_decode / test_mla_sparse, ``forced_tile``); test_compile_sm90 compiles each under the
# triton that chooses it (the 3.6 tiles in ``make compat``).
# The second H200 sweep (records at 933b242, triton 3.6.0, the restructured kernels, each checked
# against the default tile's output), p50 us: dense H 128, B 1 c_t 8192 / B 8 c_t 32768 / B 64
# c_t 8192 / B 128 c_t 4096: 64x32w8s3 30.4 / 453.8 / 874.8 / 868.9; 64x64w8s2-tma 25.8 / 268.6
# / 498.2 / 504.1 (293 TFLOP/s at B 64); 64x64w8s2-pipe 25.6 / 273.5 / 512.2 / 509.8. Sparse
# top-2048 H 128, B 1 / B 8: 64x16w8s5 24.0 / 55.5; 64x32w8s2-pipe 22.1 / 47.6; 16x32w8s5-pipe
# 19.8 / 84.1. So under triton 3.6 the tl defaults above 32 heads are 64x64w8s2-tma (dense, 1.7-
# 1.8x 64x32w8s3 from B 8) and 64x32w8s2-pipe (sparse, the fastest at B 8, second at B 1). On
# sm_90 the dense bf16 cases with fused 576-wide entries run the Gluon see-saw
# (``mqnc.triton_kernels.dispatch``); these tiles serve the rest there (fp16, split caches,
# pages under 64) and the sparse kernel.
_WIDE = {(3, 6): (TileConfig.parse("64x64w8s2-tma"), TileConfig.parse("64x32w8s2-pipe"))}
_WIDE_ELSE = (_DENSE[32], _SPARSE[16])
# The candidates of the next H200 sweep at 128 heads (``perf/gpu_tiles.sh``): every tile of the
# first sweep that compiles without spills for sm_90 under triton 3.6.0 (the GPU's), and 64 heads
# x 64 entries on 8 warps at 3 stages, dense: 255 registers, no spills, 221,696 B of shared
# memory (split and unsplit). Left out for their spills under 3.6.0: dense 64x32w16s5 (24 B of
# stack), 64x64w8s2 (8 B unsplit), sparse 64x16w16s5 (16 B) and sparse 64 x 64 (48-80 B at 2
# and 3 stages). test_compile_sm90 compiles each; test_tiles checks the 64 x 64 one against fp64
# in the interpreter at 40 and 128 heads. None becomes a default without GPU evidence.
# The restructured kernel (``kernel`` "pipe" / "tma": full tiles unmasked in a pipelined loop,
# the tail masked once, TMA page boxes) at 64 x 64 and 64 x 32 on 8 warps, 2 stages (a 2-deep
# ring): 254 / 242 / 227 registers, no spills under 3.6.0; at 3 stages they spill (112-184 B).
# ``dense16``: the 16-head (memory-bound) candidates whose CTAs fit TWO per SM, the classic loop
# on 4 warps: 16 x 32 at 5 stages (2-deep ring, 237 registers, 93,696 B shared) and 16 x 16 at
# 7 stages (3-deep ring, 198 registers, 74,624 B), against today's 16x64w8s5 (one CTA per SM,
# 168,960 B). The restructured loop at 16 heads spills under 3.6.0 (8-1032 B: 4 warps hold the
# query and two tile bodies in registers; 8 warps capped at 128 registers for two CTAs, 400 B),
# except 16 x 32 on 8 warps at 2 stages (255 registers, one CTA per SM): with the split combine
# fused (``-fused``: one launch, the last split of a row merges) it is a candidate for the
# one-row holder partial (H 16, B 1, c_t 2048), spill-free, its KV tile single-buffered; so is
# 16 x 16 on 8 warps at 5 stages, fused (255 registers, a 2-deep ring, 55,816 B).
# Sparse "pipe" (index loads of full tiles unmasked in a pipelined loop, the last tile's range
# masked once; no TMA: Hopper's has no row gather): 64x16w8s5 (220 registers, a 3-deep ring),
# 64x32w8s2 (246) and 16x32w8s5 (255), no spills under 3.6.0.
SWEEP_TILES = {
    "dense": tuple(
        TileConfig.parse(t)
        for t in (
            "32x32w8s5",
            "16x64w8s5",
            "64x16w16s5",
            "64x16w8s5",
            "64x32w8s3",
            "64x64w8s3",
            "64x64w8s2-pipe",
            "64x64w8s2-tma",
            "64x32w8s2-pipe",
        )
    ),
    "sparse": tuple(
        TileConfig.parse(t)
        for t in (
            "32x16w8s5",
            "16x32w8s5",
            "64x16w8s5",
            "64x16w8s5-pipe",
            "64x32w8s2-pipe",
            "16x32w8s5-pipe",
        )
    ),
    "dense16": tuple(
        TileConfig.parse(t)
        for t in (
            "16x64w8s5",
            "16x32w4s5",
            "16x16w4s7",
            "16x32w8s2-pipe-fused",
            "16x16w8s5-pipe-fused",
        )
    ),
}


def _triton_minor() -> tuple[int, int]:
    """(major, minor) of the triton in use (parsed once per version string: plans call it)."""
    return _major_minor(triton.__version__)


@functools.lru_cache(maxsize=4)
def _major_minor(version: str) -> tuple[int, int]:
    major, minor = re.findall(r"\d+", version)[:2]
    return int(major), int(minor)


# fp32 caches: the 2-deep KV ring holds twice the bytes and the fp32 query and accumulator twice
# the registers. At the 16-bit tiles the dense 16 x 64 kernel needs 336,960 B of shared memory
# (sm_90 gives a CTA at most 232,448: it cannot launch) and the 32-head tiles spill. 16 heads x
# 16 entries on 16 warps, 5 stages (still double-buffered), 111,936 B shared: at 16 warps a CTA
# may have 128 registers a thread (``reg_cap``); unbounded, it took 183-197 and could not launch
# at all. At 128 it spills nothing under triton 3.9.0 and 24 B (dense) / 16 B (sparse) of stack
# under 3.6.0, the least of every fp32 tile tried (16 x 16 and 16 x 32 on 4, 8 or 16 warps, 3
# to 5 stages: 8 to 200 B under 3.6.0).
_FP32 = TileConfig(16, 16, 16, 5)
# FP8 caches (16-bit queries): the entries are dequantized into a bf16 tile in registers, which
# the dots read through shared memory (``BLOCK_N x 512`` bf16 beside the uint8 ring), so the
# 16-bit tiles do not fit: dense 16 x 64 needs 234,496 B of shared memory (a CTA may have
# 232,448), 32 x 32 and 32 x 16 spill 440-528 B under triton 3.6.0 and 3.9.0. Launch-exact
# sm_90 compiles (no GPU has run them: no speed claimed) give, at 5 stages (a 2-deep uint8
# ring, copy groups in flight): 16 x 32 on 8 warps for every head count under 3.9.0 and up
# to 32 heads under 3.6.0 (dense 233 / sparse 244 registers under 3.6.0, 126,464 B shared, no
# spills); above 32 heads under 3.6.0, 64 x 16 on 8 warps (HGMMA; dense 242 / sparse 254
# registers, 131,072 B, no spills; under 3.9.0 it spills 264-280 B). 64 x 32 at 5 stages also
# compiles spill-free under 3.6.0 (255 registers, 153,088 B) and at 3-4 stages leaves its ring
# single-buffered: sweep candidates, not defaults, until a GPU measures them.
_FP8 = TileConfig(16, 32, 8, 5)
_FP8_WIDE = {(3, 6): TileConfig(64, 16, 8, 5)}
# The FP8 candidates of a GPU sweep (``forced_tile`` applies to FP8 launches too): the tiles
# above, and every other tile that compiles for sm_90 without spills under triton 3.6.0 at 128
# heads, split and unsplit (test_compile_sm90): 16 x 32 on 4 warps (255 registers), the
# restructured dense 64 x 16 at 5 stages (240 / 254) and 64 x 32 at 2 stages (254), sparse
# 64 x 16 at 5 stages (250 / 254). Left out for their spills under 3.6.0: the restructured
# loop at 16 heads (392-448 B: 16 x 32 at 2 and 5 stages, 16 x 16 fused), 16 x 16 on 4 warps
# (8 B split), 64 x 32 at 5 stages unsplit (8 B), 32-head tiles (440-528 B).
FP8_SWEEP_TILES = {
    "dense": tuple(
        TileConfig.parse(t)
        for t in ("16x32w8s5", "16x32w4s5", "64x16w8s5", "64x16w8s5-pipe", "64x32w8s2-pipe")
    ),
    "sparse": tuple(TileConfig.parse(t) for t in ("16x32w8s5", "64x16w8s5", "64x16w8s5-pipe")),
}


def tile_config(
    heads: int, *, sparse: bool = False, dtype: torch.dtype = torch.bfloat16, fp8: bool = False
) -> TileConfig:
    """The tile configuration for ``heads`` query heads per token.

    Chosen from launch-exact sm_90 compiles of the bf16 kernels (``sm90.variants``, registers and
    spills read with cuobjdump under triton 3.6.0 and 3.9.0; the figures of the launched
    variants are in ``sm90.table`` and docs/kernels.md, "Kernels on Hopper"):

    - dense: 16 heads x 64-entry tiles on 8 warps; 17..32 heads, 32 heads x 32-entry tiles;
    - sparse (the per-entry index arithmetic costs registers): 16 x 32 and 32 x 16;
    - more than 32 heads, from a tile sweep on an H200 (the table above ``_WIDE``): under
      triton 3.6 dense 64 x 32 on 8 warps at 3 stages (1.2x the 32 x 32 tile at B 1, c_t 8192,
      1.9-2.0x at B 8 and 64) and sparse 64 x 16 (1.4 / 1.9x the 32 x 16 tile at B 1 / 8); under
      any other triton, where those tiles spill, dense 32 x 32 and sparse 16 x 32 (1.6 / 1.1x).

    The head blocks of one token are scheduled together (grid axis 0) so that each of the
    token's tiles is read from DRAM once and from L2 by the others.

    An fp32 cache (``dtype``: the cache's; 4-byte elements) runs 16 heads x 16 entries on 16
    warps for every head count, dense and sparse: the 16-bit tiles exceed sm_90's shared memory
    or spill there.

    An FP8 cache (``fp8``; ``dtype`` the query's, the dequantized operands' type) runs its own
    tiles (``_FP8``, ``_FP8_WIDE``: dense and sparse alike), an fp32 query the fp32 tile.
    """
    if dtype.itemsize == 4:
        return _FP32
    forced = _FORCED.get("sparse" if sparse else "dense")
    if forced is not None:
        return forced
    if fp8:
        wide = _FP8_WIDE.get(_triton_minor()) if heads > 32 else None
        return _FP8 if wide is None else wide
    if heads > 32:
        return _WIDE.get(_triton_minor(), _WIDE_ELSE)[1 if sparse else 0]
    table = _SPARSE if sparse else _DENSE
    return table[16] if heads <= 16 else table[32]


_FORCED: dict[str, TileConfig] = {}


@contextlib.contextmanager
def forced_tile(tile: TileConfig | str, *, sparse: bool = False):
    """A tuning hook: inside the ``with`` block every 16-bit launch of the dense (``sparse``:
    the sparse) kernel plans with ``tile`` (a :class:`TileConfig` or its ``"HxNwWsS"`` label)
    for every head count, instead of :func:`tile_config`'s choice. Process-wide and not
    thread-safe: for benchmarks (``perf.bench_mla --tiles``), not for serving. Plans made
    inside keep the tile after the block ends; fp32 caches keep theirs."""
    cfg = TileConfig.parse(tile) if isinstance(tile, str) else tile
    if not isinstance(cfg, TileConfig):
        raise TypeError(f"tile: expected a TileConfig or its label, got {type(tile).__name__}")
    kind = "sparse" if sparse else "dense"
    before = _FORCED.get(kind)
    _FORCED[kind] = cfg
    set_plan_context(f"tile:{kind}", cfg)  # (a forced tile changes what a call plans to)
    try:
        yield cfg
    finally:
        if before is None:
            _FORCED.pop(kind, None)
        else:
            _FORCED[kind] = before
        set_plan_context(f"tile:{kind}", before)


@dataclasses.dataclass(frozen=True)
class MlaOperands:
    """The query rows and the cache as the kernels read them.

    ``q`` / ``kv`` hold the latent part (their first ``d_v`` dims); the rope part is the next
    ``d_pe`` dims of the same rows (fused: ``q_pe is q``, ``kv_pe is kv``) or separate tensors
    (``split``: FlashInfer's ``q_pe`` and ``kpe_cache``, or a view of a fused tensor when only
    the other one is split), each read in place through its own pointer and strides.
    """

    q: torch.Tensor
    q_pe: torch.Tensor
    kv: torch.Tensor
    kv_pe: torch.Tensor
    d_v: int
    d_pe: int
    split: bool
    # ``kv`` holds FP8 entries (uint8, ``fp8.cache``); ``kv_pe`` then the bf16 RoPE rows
    fp8: bool = False


def _check_width(name: str, width: int, d_qk: int, d_v: int) -> None:
    if width < 16 or width & (width - 1):
        raise ValueError(
            f"{name}: expected a power of two >= 16 (the latent and rope parts of a "
            f"{d_qk}-wide row are tiled separately), got {width} (d_qk = {d_qk}, d_v = {d_v})"
        )


def mla_operands(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    d_v: int,
    *,
    q_pe: torch.Tensor | None = None,
    kpe_pool: torch.Tensor | None = None,
) -> MlaOperands:
    """Validate absorbed-MLA query rows and cache, fused or split.

    Fused: ``q [R, H, d_qk]`` and ``kv_pool [num_blocks, block_size, d_qk]`` with
    ``d_qk = d_v + d_pe``. Split (either or both): ``q [R, H, d_v]`` with ``q_pe [R, H, d_pe]``;
    ``kv_pool [num_blocks, block_size, d_v]`` (the latent ``c_KV``, also the value) with
    ``kpe_pool [num_blocks, block_size, d_pe]``. One dtype throughout, unit stride on every last
    dim; ``d_v`` and ``d_pe`` powers of two >= 16.

    An FP8 ``kv_pool`` (uint8 or float8_e4m3fn, ``fp8.cache``): DeepSeek-V3.2's entries
    ``[num_blocks, block_size, d_v + 4 d_v / 128 + 2 d_pe]`` (or latent + scales beside a bf16
    ``kpe_pool``), ``q`` in any float dtype; ``kv`` is then its uint8 view and ``fp8`` True.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, contiguous_last=True)
    if isinstance(d_v, bool) or not isinstance(d_v, int):
        raise TypeError(f"d_v: expected an int, got {type(d_v).__name__}")
    check_pool_dims("kv_pool", kv_pool)
    R, H, width = q.shape
    if q_pe is not None:
        if width != d_v:
            raise ValueError(
                f"q: expected the latent part only (d_v = {d_v} wide) when q_pe is given, got "
                f"shape {tuple(q.shape)}"
            )
        check_tensor("q_pe", q_pe, ndim=3, contiguous_last=True)
        check_dtype_matches("q_pe", q_pe, "q", q)
        check_tensor("q_pe", q_pe, shape=(R, H, None))
        d_pe = q_pe.shape[2]
    else:
        if width <= d_v:
            raise ValueError(_no_rope_part(q, d_v, kv_pool, kpe_pool))
        d_pe = width - d_v
    d_qk = d_v + d_pe
    if is_fp8_pool(kv_pool):
        return _fp8_operands(q, q_pe, as_bytes(kv_pool), kpe_pool, d_v, d_pe)
    check_tensor("kv_pool", kv_pool, ndim=3, contiguous_last=True)
    check_dtype_matches("kv_pool", kv_pool, "q", q)
    if kpe_pool is None and kv_pool.shape[2] != d_qk:
        raise ValueError(
            f"kv_pool: expected entries as wide as q's rows ({d_qk}), got shape "
            f"{tuple(kv_pool.shape)}"
        )
    if kpe_pool is not None:
        if kv_pool.shape[2] != d_v:
            raise ValueError(
                f"kv_pool: expected the latent part only (d_v = {d_v} wide) when kpe_pool is "
                f"given, got shape {tuple(kv_pool.shape)}"
            )
        check_tensor("kpe_pool", kpe_pool, ndim=3, contiguous_last=True)
        check_dtype_matches("kpe_pool", kpe_pool, "q", q)
        check_tensor("kpe_pool", kpe_pool, shape=(*kv_pool.shape[:2], d_pe))
    for name, w in (("d_v", d_v), ("d_qk - d_v", d_pe)):
        _check_width(name, w, d_qk, d_v)
    split = q_pe is not None or kpe_pool is not None
    if split:
        q_pe = q[..., d_v:] if q_pe is None else q_pe
        kpe_pool = kv_pool[..., d_v:] if kpe_pool is None else kpe_pool
    else:
        q_pe, kpe_pool = q, kv_pool
    for name, t in (("q", q), ("q_pe", q_pe), ("kv_pool", kv_pool), ("kpe_pool", kpe_pool)):
        _check_inner_offsets(name, t)
    return MlaOperands(q, q_pe, kv_pool, kpe_pool, d_v, d_pe, split)


def check_pool_dims(name: str, pool: object) -> None:
    """A 4-D cache ``pool`` is refused by name with its fix: FlashMLA keeps its cache as
    ``[num_blocks, page, 1, d]`` (one KV head), the kernels take ``[num_blocks, page, d]``."""
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
        return
    heads = "" if pool.shape[2] == 1 else " with one KV head (dim 2 = 1: MLA's latent cache)"
    raise ValueError(
        f"{name}: expected 3 dims [num_blocks, block_size, d], got 4-D shape "
        f"{tuple(pool.shape)}, FlashMLA's [num_blocks, page, 1, d] layout{heads}: pass "
        f"k_cache.squeeze(2), or call FlashMLA's adapter "
        f"mqnc.triton_kernels.adapters.flashmla.mla_decode_with_kvcache "
        f"(mla_sparse_with_kvcache for top-k indices), which takes the 4-D cache"
    )


def _no_rope_part(q: torch.Tensor, d_v: int, kv_pool: object, kpe_pool: object) -> str:
    """The error of query rows ``q`` at most ``d_v`` wide without ``q_pe``: no RoPE part. The
    width expected is read from the cache when it says (a fused pool's entries, ``kpe_pool``'s
    rows), else DeepSeek's 576 = 512 + 64 is the example."""
    d_r = None
    if isinstance(kpe_pool, torch.Tensor) and kpe_pool.dim():
        d_r = kpe_pool.shape[-1]
    elif isinstance(kv_pool, torch.Tensor) and kv_pool.dim() and not is_fp8_pool(kv_pool):
        d_r = kv_pool.shape[-1] - d_v if kv_pool.shape[-1] > d_v else None
    if d_r is None:
        want = "e.g. 576 = 512 latent + 64 RoPE"
    else:
        want = f"{d_v + d_r} = {d_v} latent + {d_r} RoPE, as the cache holds"
    return (
        f"q: expected a power of two >= 16 RoPE dims after the d_v = {d_v} latent ones (rows "
        f"d_c + d_r wide: {want}), got shape {tuple(q.shape)}, {q.shape[2]} wide (no RoPE "
        f"part: pass the rotated q_pe in q's last dims, or as q_pe=)"
    )


def _fp8_operands(q, q_pe, kv, kpe_pool, d_v: int, d_pe: int) -> MlaOperands:
    """:func:`mla_operands` for an FP8 ``kv_pool`` (``kv``: its uint8 view): entries of the
    FP8 width (``fp8.cache.check_fp8_layout``), a bf16 ``kpe_pool`` when split; the query in
    any float dtype (the entries are dequantized to it)."""
    check_fp8_layout(kv, kpe_pool, d_v, d_pe)
    for name, w in (("d_v", d_v), ("d_qk - d_v", d_pe)):
        _check_width(name, w, d_v + d_pe, d_v)
    split = q_pe is not None or kpe_pool is not None
    if split:
        q_pe = q[..., d_v:] if q_pe is None else q_pe
        kpe_pool = fp8_rope_view(kv, d_v) if kpe_pool is None else kpe_pool
    else:
        q_pe, kpe_pool = q, kv
    for name, t in (("q", q), ("q_pe", q_pe), ("kv_pool", kv), ("kpe_pool", kpe_pool)):
        _check_inner_offsets(name, t)
    return MlaOperands(q, q_pe, kv, kpe_pool, d_v, d_pe, split, fp8=True)


_INT32_MAX = 2**31 - 1


def _check_inner_offsets(name: str, t: torch.Tensor) -> None:
    """The kernels widen the outer index (row, page) to 64 bits before it meets its stride, but
    offset within a row's heads or a page's entries in 32-bit arithmetic: ``(n - 1) * stride``
    of the middle dim must fit (a permuted view, e.g. a token-major pool transposed to
    ``[num_blocks, block_size, d]`` with ~60K blocks, would wrap and read or write elsewhere)."""
    n, stride = t.shape[1], t.stride(1)
    if (n - 1) * stride > _INT32_MAX:
        raise ValueError(
            f"{name}: expected (shape[1] - 1) * stride(1) < 2**31 (the kernels' 32-bit offsets "
            f"within a row or page), got {n - 1} * {stride}; pass a contiguous tensor"
        )


def check_block_size(block_size: int) -> int:
    """A cache block (page) size: any power of two (1 for SGLang's token pools, 64 in
    production); the kernels look each entry up through its page, so small pages cost one
    page-id load per entry, nothing else."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(
            f"kv_pool: expected a block size (dim 1) that is a power of two (1 for a token "
            f"pool, 64 in production), got {block_size}"
        )
    return block_size


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 for fp32 inputs (never tf32); 16-bit ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def fp8_entry_bytes(ops: MlaOperands) -> int | None:
    """Bytes of one FP8 cache entry as the kernels read it (latent, scales and the bf16 RoPE
    part, fused or from ``kpe_pool``); None for a 16-bit cache (``d_qk`` in its dtype)."""
    if not ops.fp8:
        return None
    return ops.kv.shape[-1] + (2 * ops.d_pe if ops.split else 0)


def fp8_flags(ops: MlaOperands, cfg: TileConfig) -> dict:
    """The kernels' FP8 constexprs: ``FP8`` (the pool holds FP8 entries) and ``FP8_RNE`` (bf16
    dequantized values rounded in software: the interpreter). A ``-tma`` tile reads 16-bit
    caches only (refused for FP8 here)."""
    if ops.fp8 and cfg.kernel == "tma":
        raise ValueError(
            f"tile: expected a classic or '-pipe' tile for an FP8 cache (TMA boxes of FP8 "
            f"entries are not written), got {cfg.label!r}"
        )
    return dict(FP8=ops.fp8, FP8_RNE=ops.fp8 and bf16_rne_in_software(ops.q.dtype, ops.q.device))


def variant_name(
    op: str, dtype: torch.dtype, cfg: TileConfig, split: bool, features: tuple[str, ...] = ()
) -> str:
    """The name of a compiled variant, as the compile step, the sm_90 table and
    ``mqnc/measure/kernel_report.py`` call it: op, cache dtype, tile, warps, stages, output, then
    what
    departs from the production layout (``features``: ``page=N`` for a page other than 64,
    ``csr`` page tables, ``split-kv`` latent / rope tensors, ``sq`` several query tokens per
    sequence, ``causal``), none for the goal shapes."""
    out = "fp32-split" if split else dtype_name(dtype)
    extra = "".join(f",{f}" for f in features)
    return (
        f"{op}[{dtype_name(dtype)},{cfg.block_h}x{cfg.block_n},w{cfg.num_warps},"
        f"s{cfg.num_stages},out={out}{extra}]"
    )


def split_outputs(
    B: int, H: int, d_v: int, dtype: torch.dtype, device, num_splits: int, alloc=new_output
):
    """The outputs ``o [B, H, d_v]`` (``dtype``) and ``lse [B, H]`` fp32, and where the kernel
    writes: straight into them for one split, else into fp32 per-split partials
    ``[num_splits, B, H, d_v]`` / ``[num_splits, B, H]`` that the merge kernel combines.
    ``alloc(shape, dtype, device)`` makes each (a plan's template uses :func:`meta_output`).
    Returns ``(o, lse, o_part, lse_part)``."""
    o = alloc((B, H, d_v), dtype, device)
    lse = alloc((B, H), torch.float32, device)
    if num_splits == 1:
        return o, lse, o, lse
    o_part = alloc((num_splits, B, H, d_v), torch.float32, device)
    lse_part = alloc((num_splits, B, H), torch.float32, device)
    return o, lse, o_part, lse_part


def meta_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A storage-less stand-in for an output (its shape, dtype and contiguous strides are all a
    plan's template needs; :meth:`AttentionPlan.run` allocates the real ones)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def split_strides(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple:
    """``(stride_os, stride_ob, stride_oh, stride_ls, stride_lb, stride_lh)``: split stride
    first, 0 when the kernel writes the unsplit ``[B, H, ...]`` outputs."""
    if o_part.dim() == 3:
        return (0, *o_part.stride()[:2], 0, *lse_part.stride())
    return (*o_part.stride()[:3], *lse_part.stride())


@dataclasses.dataclass(frozen=True)
class MlaPlan:
    """The launches of one partial-MLA call, in order (the attention kernel, then the combine
    when split), and the outputs they write."""

    o: torch.Tensor
    lse: torch.Tensor
    num_splits: int
    launches: tuple

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        for launch in self.launches:
            launch()
        return self.o, self.lse


def plan_mla(
    build,
    *,
    op: str,
    q: torch.Tensor,
    d_v: int,
    cfg: TileConfig,
    tiles: int,
    num_splits: int | None,
    occupancy: Occupancy | None = None,
    d_qk: int | None = None,
    alloc=new_output,
    entry_bytes: int | None = None,
) -> MlaPlan:
    """Plan a partial-MLA call: the split count (given, or the policy's for ``tiles`` tiles
    per row at ``occupancy``, by default the compiled split variant's, see
    :func:`_grid.kernel_occupancy`), the outputs (made by ``alloc``), the attention launch
    ``build(o_part, lse_part, num_splits)`` and, when split, the merge kernel's combine of the
    fp32 partials into the outputs; a ``fused`` tile's split launch is ``build(o, lse,
    num_splits)`` alone (it merges itself). ``d_qk``: the row width (``q``'s last dim by default; a
    split ``q`` holds only its latent part); ``entry_bytes``: bytes of one cache entry (default
    ``d_qk`` in ``q``'s dtype; an FP8 entry's 656)."""
    B, H = q.shape[:2]
    d_qk = q.shape[2] if d_qk is None else d_qk
    device = q.device
    if num_splits is None:
        num_splits = _policy_splits(build, op, q, d_qk, d_v, cfg, tiles, occupancy, entry_bytes)
    fused = num_splits > 1 and cfg.fused  # the kernel merges: no fp32 partials here
    o, lse, o_part, lse_part = split_outputs(
        B, H, d_v, q.dtype, device, 1 if fused else num_splits, alloc
    )
    if B * H == 0:
        return MlaPlan(o, lse, num_splits, ())
    if fused:  # one launch, writing the outputs (its workspace is the launch's own)
        return MlaPlan(o, lse, num_splits, (build(o, lse, num_splits),))
    launches = [build(o_part, lse_part, num_splits)]
    if num_splits > 1:
        launches.append(merge_launch(o_part, lse_part, o, lse))
    return MlaPlan(o, lse, num_splits, tuple(launches))


def _policy_splits(build, op, q, d_qk, d_v, cfg, tiles, occupancy, entry_bytes=None) -> int:
    B, H = q.shape[:2]
    programs = B * triton.cdiv(H, cfg.block_h)
    if programs == 0:
        return 1
    limits = device_limits(q.device)
    if occupancy is None:

        def probe():
            o_part = torch.empty((2, 1, H, d_v), dtype=torch.float32, device=q.device)
            lse_part = torch.empty((2, 1, H), dtype=torch.float32, device=q.device)
            return build(o_part, lse_part, 2)

        o_meta = meta_output((2, 1, H, d_v), torch.float32, q.device)
        name = build(o_meta, meta_output((2, 1, H), torch.float32, q.device), 2).name
        occupancy = kernel_occupancy(name, q.device, probe)
    return choose_num_splits(
        programs,
        tiles,
        **split_bytes(cfg, d_qk, d_v, q.element_size(), H, entry_bytes),
        slots=limits.sms * occupancy.ctas_per_sm(limits),
        sms=limits.sms,
    )


def split_bytes(
    cfg: TileConfig, d_qk: int, d_v: int, elt: int, heads: int, entry_bytes: int | None = None
) -> dict:
    """The DRAM bytes of one program that the split policy weighs (``_core.grid.split_cost``): the
    ``ceil(heads / BLOCK_H)`` head blocks of a token run side by side and read each tile from
    DRAM once between them (then from L2), so a program's share of a tile is
    ``tile / head_blocks``. A fused combine (``cfg.fused``) is one CTA per program reading its
    ``S`` partials alone: priced as such, it keeps the policy to fewer splits. A cache entry is
    ``entry_bytes`` (default ``d_qk * elt``: an FP8 entry is 656 B for 576 dims)."""
    head_blocks = triton.cdiv(heads, cfg.block_h)
    entry = d_qk * elt if entry_bytes is None else entry_bytes
    return dict(
        min_tiles=cfg.min_tiles,
        tile_bytes=cfg.block_n * entry // head_blocks,
        in_bytes=cfg.block_h * d_qk * elt,
        out_bytes=cfg.block_h * (d_v * elt + 4),
        split_out_bytes=cfg.block_h * (d_v * 4 + 4),
        # the combine's CTAs per program: one per head row and 16-byte-per-thread warp slice;
        # fused (``cfg.fused``), the one CTA that draws the program's last ticket
        merge_ctas=1 if cfg.fused else cfg.block_h * -(-d_v * 4 // 512),
    )


def _signature(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class AttentionPlan:
    """A partial-MLA call planned once for a batch shape, run many times (§6.3's holder runs
    one per step and layer): FlashMLA's ``get_mla_metadata`` / FlashInfer's ``plan()``.

    Made by ``plan_mla_decode``, ``plan_mla_decode_csr`` and ``plan_mla_sparse`` (and the
    layout adapters), which do every check (shapes, dtypes, devices, and the host-side range
    checks unless switched off) and the split choice on the tensors they are given. :meth:`run`
    then takes tensors of the same shapes, dtypes, strides and device (new values, or the same
    buffers refilled), compares exactly that with the planning call (host metadata: a tensor
    that differs is a ``ValueError`` naming it, never a launch over the planned sizes) and
    launches: no value check, no host sync, no split search, no launch configuration; the
    outputs are allocated per call (or given as ``out``), so a run can be captured in a CUDA
    graph (outputs then come from the graph's pool).

    The run path is the plan's work done once: each kernel is a
    :class:`~mqnc.triton_kernels._core.launch.LaunchRunner` holding its fixed arguments (strides,
    sizes, scale) and constexprs in parameter order, and on a GPU the compiled kernel itself
    after the first run, so a run is the shape comparison (one tuple compare), the output
    allocations and one launcher call per kernel (``correctness/test_host_path.py`` pins the
    Python calls it makes). A plan keeps no reference to the tensors it was made from:
    ``launches`` (the template launches) carry storage-less stand-ins of them (shape, strides
    and dtype; see :func:`meta_output`), so a plan may be cached (the op's eager call reuses a
    plan per call signature) without pinning a cache pool in memory.

    ``num_splits`` is the split count chosen; ``launches`` the template launches.
    """

    def __init__(
        self,
        template: MlaPlan,
        bind,
        *,
        n_inputs: int,
        device: torch.device,
        planned: tuple[torch.Tensor, ...],
        names: tuple[str, ...],
        attend=None,
        backend: str = "tl",
        kernel: str | None = None,
    ) -> None:
        self.num_splits = template.num_splits
        # the dispatch table's choice (mqnc.triton_kernels.dispatch): its backend and kernel
        self.backend, self.kernel = backend, kernel
        # what run() compares: each bound tensor's shape, strides, dtype and device; ``names``
        # are what its errors call them (a layout adapter sets its own arguments' names)
        self.names = names
        self._planned = tuple(_signature(t) for t in planned)
        self.launches = tuple(_without_tensors(ln) for ln in template.launches)
        self._bind = bind
        self._n = n_inputs
        self._device = device
        self._o = (tuple(template.o.shape), template.o.dtype)
        self._lse = tuple(template.lse.shape)
        self._split = len(self.launches) > 1
        # the kernels as they run: the attention on the bound tensors and its two outputs (the
        # backend's own runner when it has one: the Gluon kernel's reads TMA descriptors made
        # per run); the combine on (partials, outputs, the unread mask stand-in: merge_launch's
        # tensors), its first two arguments the split workspaces
        if attend is None and self.launches:
            attend = LaunchRunner(self.launches[0], n_inputs + 2)
        self._attend = attend if self.launches else None
        self._combine = LaunchRunner(self.launches[-1], 5) if self._split else None
        parts = self.launches[-1].args[:2] if self._split else ()
        self._part = tuple(tuple(t.shape) for t in parts)  # the split workspaces' shapes
        self._interpreted = interpreted(device)  # (the launches' constexprs were chosen for it)
        # a buffer a launch owns (the fused combine's workspace, wrapped, not a torch tensor):
        # two runs of this plan on two streams at once would race on it, so the op's plan
        # cache does not share such a plan between calls (its holder reuses it, one stream)
        self.owns_workspace = any(
            hasattr(a, "data_ptr") and not isinstance(a, torch.Tensor)
            for ln in self.launches
            for a in ln.args
        )

    def run(self, *args, out: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs):
        """Launch on new inputs, passed as to the function that made the plan; returns
        ``(o, lse)`` (``out``: contiguous tensors of the planned output shapes and dtypes,
        sharing memory with no input and not with each other)."""
        tensors = self._bind(*args, **kwargs)
        try:
            same = self._planned == tuple(
                (tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors
            )
        except (AttributeError, TypeError):
            same = False
        if not same:
            self._check_planned(tensors)  # (raises, naming the tensor that differs)
        return self._launch(tensors, out, planned_on=False)

    def run_planned(self, *args, out: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs):
        """:meth:`run` on tensors of the very signature the plan was made for (the op's own
        call: planned, or a cached plan found by that signature, then launched once), whose
        ``out`` its caller has already checked for shared memory; ``out``'s shapes, dtypes and
        device are still checked against the plan."""
        return self._launch(self._bind(*args, **kwargs), out, planned_on=True)

    def _launch(self, tensors: tuple, out, *, planned_on: bool):
        """The launches on ``tensors`` (already compared with the plan); unless ``planned_on``,
        ``out`` checked for shared memory with them."""
        device, alloc = self._device, _nan_filled if poisoning() else torch.empty
        if out is None:
            o = alloc(self._o[0], dtype=self._o[1], device=device)
            lse = alloc(self._lse, dtype=torch.float32, device=device)
        else:
            o, lse = self._check_out(out)
            if not planned_on:
                check_no_overlap((o, lse), dict(zip(self.names, tensors, strict=True)))
        if self._attend is None:
            return o, lse
        if self._split:
            o_part = alloc(self._part[0], dtype=torch.float32, device=device)
            lse_part = alloc(self._part[1], dtype=torch.float32, device=device)
            self._attend(self._interpreted, *tensors, o_part, lse_part)
            self._combine(self._interpreted, o_part, lse_part, o, lse, lse)
        else:
            self._attend(self._interpreted, *tensors, o, lse)
        return o, lse

    def _check_planned(self, tensors: tuple) -> None:
        """Each of ``tensors`` of the shape, strides, dtype and device the plan was made for."""
        for name, t, want in zip(self.names, tensors, self._planned, strict=True):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            got = _signature(t)
            if got != want:
                raise ValueError(
                    f"{name}: expected shape {want[0]}, strides {want[1]}, {want[2]} on "
                    f"{want[3]} (as planned), got shape {got[0]}, strides {got[1]}, {got[2]} "
                    f"on {got[3]}"
                )

    def _check_out(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        """``out`` as the kernels write it: contiguous ``o`` and ``lse`` of the planned shapes,
        dtypes and device (the launches carry the planned strides: anything else would be
        written wrongly, or past its end)."""
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"out: expected a pair (o, lse) of tensors, got {type(out).__name__}")
        planned = ((self._o[0], self._o[1]), (self._lse, torch.float32))
        names = ("out[0] (o)", "out[1] (lse)")
        for name, t, (shape, dtype) in zip(names, out, planned, strict=True):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            want = (shape, _contiguous(shape), dtype)
            got = _signature(t)
            if got[:3] != want or t.device != torch.device(self._device):
                raise ValueError(
                    f"{name}: expected a contiguous tensor of shape {shape} (strides "
                    f"{want[1]}), {dtype} on {self._device} (as planned), got shape {got[0]}, "
                    f"strides {got[1]}, {got[2]} on {got[3]}"
                )
        return out[0], out[1]


def _nan_filled(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """An output NaN-filled (``MQNC_POISON_OUTPUTS=1``, read once per run; else a run
    allocates with ``torch.empty`` itself, no Python call in between)."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _without_tensors(launch: Launch) -> Launch:
    """``launch`` with each tensor argument replaced by a storage-less stand-in of the same
    shape, strides and dtype (on ``meta``): what a plan keeps of the tensors it was made from."""
    args = tuple(
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        if isinstance(a, torch.Tensor) and not a.is_meta
        else a
        for a in launch.args
    )
    return dataclasses.replace(launch, args=args)
