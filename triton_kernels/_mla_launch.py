"""Host side shared by the dense paged and the sparse top-k partial-MLA launchers (§3.3, §6.3):
tile configurations, shape checks, the split-KV outputs, and the plan of a call: the split
choice, the attention launch and the merge kernel's combine of split partials.

The device side they share is :mod:`mqnc.triton_kernels._mla_tile`; the public ops are
``mla_decode.mla_decode_partial`` and ``mla_sparse.mla_sparse_partial``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from mqnc.triton_kernels._checks import FLOAT_DTYPES, check_tensor, dtype_name
from mqnc.triton_kernels._grid import (
    MIN_TOKENS_PER_SPLIT,
    Occupancy,
    choose_num_splits,
    device_limits,
    kernel_occupancy,
)
from mqnc.triton_kernels._runtime import new_output
from mqnc.triton_kernels.merge import merge_launch

__all__ = [
    "TileConfig",
    "tile_config",
    "check_mla_shapes",
    "dot_precision",
    "variant_name",
    "split_outputs",
    "split_strides",
    "split_bytes",
    "MlaPlan",
    "plan_mla",
]


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
    # CTAs per SM can have anyway, so every variant may take up to 255 (no spill under both).
    maxnreg: int = 255

    @property
    def min_tiles(self) -> int:
        """Tiles per split so that a split holds at least ``MIN_TOKENS_PER_SPLIT`` entries."""
        return max(1, MIN_TOKENS_PER_SPLIT // self.block_n)


# num_stages = 5 is what makes Triton double-buffer the KV tile behind one level of indirection
# (the page-table or index load feeds the KV addresses): the pipeliner gives the index load its
# own stage, and at 3 or 4 stages only one KV buffer is left (TTGIR: `1x64x512xbf16`,
# `async_wait {num = 0}` at the loop top, i.e. no overlap); at 5 it allocates `2x64x512xbf16`
# and waits with `num = 4` groups in flight (triton 3.6.0 and 3.9.0; test_compile_sm90 checks).
_DENSE = {16: TileConfig(16, 64, 8, 5), 32: TileConfig(32, 32, 8, 5)}
_SPARSE = {16: TileConfig(16, 32, 8, 5), 32: TileConfig(32, 16, 8, 5)}


def tile_config(heads: int, *, sparse: bool = False) -> TileConfig:
    """The tile configuration for ``heads`` query heads per token.

    Chosen from launch-exact sm_90 compiles of the bf16 kernels (``_variants``, registers and
    spills read with cuobjdump under triton 3.6.0 and 3.9.0; the figures of the launched
    variants are in ``_sm90_table`` and README "Kernels"):

    - dense: 16 heads x 64-entry tiles on 8 warps; above 16 heads, 32 heads x 32-entry tiles;
    - sparse (the per-entry index arithmetic costs registers): 16 x 32 and 32 x 16.

    64 packed heads (FlashMLA's shape) spill in every Triton configuration tried (8 or 16 warps,
    16..64-entry tiles), its fp32 accumulator alone being 64 x 512; so H > 16 runs in programs
    of 32 heads, the head blocks of one token scheduled together (grid axis 0) so that each of
    the token's tiles is read from DRAM once and from L2 by the others.
    """
    table = _SPARSE if sparse else _DENSE
    return table[16] if heads <= 16 else table[32]


def check_mla_shapes(q: torch.Tensor, kv_pool: torch.Tensor, d_v: int) -> tuple[int, int]:
    """Validate ``q`` and ``kv_pool`` as absorbed-MLA rows and cache; returns (d_v, d_pe)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, contiguous_last=True)
    d_qk = q.shape[2]
    check_tensor("kv_pool", kv_pool, ndim=3, dtypes=(q.dtype,), contiguous_last=True)
    if kv_pool.shape[2] != d_qk:
        raise ValueError(
            f"kv_pool: expected entries as wide as q's rows ({d_qk}), got shape "
            f"{tuple(kv_pool.shape)}"
        )
    if isinstance(d_v, bool) or not isinstance(d_v, int):
        raise TypeError(f"d_v: expected an int, got {type(d_v).__name__}")
    d_pe = d_qk - d_v
    for name, width in (("d_v", d_v), ("d_qk - d_v", d_pe)):
        if width < 16 or width & (width - 1):
            raise ValueError(
                f"{name}: expected a power of two >= 16 (the latent and rope parts of a "
                f"{d_qk}-wide row are tiled separately), got {width} (d_qk = {d_qk}, d_v = {d_v})"
            )
    return d_v, d_pe


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 for fp32 inputs (never tf32); 16-bit ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def variant_name(op: str, dtype: torch.dtype, cfg: TileConfig, split: bool) -> str:
    """The name of a compiled variant, as the compile step, the sm_90 table and
    ``perf/kernel_report.py`` call it: op, cache dtype, tile, warps, stages, output."""
    out = "fp32-split" if split else dtype_name(dtype)
    return (
        f"{op}[{dtype_name(dtype)},{cfg.block_h}x{cfg.block_n},w{cfg.num_warps},"
        f"s{cfg.num_stages},out={out}]"
    )


def split_outputs(B: int, H: int, d_v: int, dtype: torch.dtype, device, num_splits: int):
    """The outputs ``o [B, H, d_v]`` (``dtype``) and ``lse [B, H]`` fp32, and where the kernel
    writes: straight into them for one split, else into fp32 per-split partials
    ``[num_splits, B, H, d_v]`` / ``[num_splits, B, H]`` that :func:`combine_splits` merges.
    Returns ``(o, lse, o_part, lse_part)``."""
    o = new_output((B, H, d_v), dtype, device)
    lse = new_output((B, H), torch.float32, device)
    if num_splits == 1:
        return o, lse, o, lse
    o_part = new_output((num_splits, B, H, d_v), torch.float32, device)
    lse_part = new_output((num_splits, B, H), torch.float32, device)
    return o, lse, o_part, lse_part


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
) -> MlaPlan:
    """Plan a partial-MLA call: the split count (given, or the policy's for ``tiles`` tiles
    per row at ``occupancy``, by default the compiled split variant's, see
    :func:`_grid.kernel_occupancy`), the outputs, the attention launch
    ``build(o_part, lse_part, num_splits)`` and, when split, the merge kernel's combine of the
    fp32 partials into the outputs."""
    B, H, d_qk = q.shape
    device = q.device
    if num_splits is None:
        num_splits = _policy_splits(build, op, q, d_v, cfg, tiles, occupancy)
    o, lse, o_part, lse_part = split_outputs(B, H, d_v, q.dtype, device, num_splits)
    if B * H == 0:
        return MlaPlan(o, lse, num_splits, ())
    launches = [build(o_part, lse_part, num_splits)]
    if num_splits > 1:
        launches.append(merge_launch(o_part, lse_part, o, lse))
    return MlaPlan(o, lse, num_splits, tuple(launches))


def _policy_splits(build, op, q, d_v, cfg, tiles, occupancy) -> int:
    B, H, d_qk = q.shape
    programs = B * triton.cdiv(H, cfg.block_h)
    if programs == 0:
        return 1
    limits = device_limits(q.device)
    if occupancy is None:

        def probe():
            o_part = torch.empty((2, 1, H, d_v), dtype=torch.float32, device=q.device)
            lse_part = torch.empty((2, 1, H), dtype=torch.float32, device=q.device)
            return build(o_part, lse_part, 2)

        occupancy = kernel_occupancy(variant_name(op, q.dtype, cfg, True), q.device, probe)
    return choose_num_splits(
        programs,
        tiles,
        **split_bytes(cfg, d_qk, d_v, q.element_size(), H),
        slots=limits.sms * occupancy.ctas_per_sm(limits),
        sms=limits.sms,
    )


def split_bytes(cfg: TileConfig, d_qk: int, d_v: int, elt: int, heads: int) -> dict:
    """The DRAM bytes of one program that the split policy weighs (``_grid.split_cost``): the
    ``ceil(heads / BLOCK_H)`` head blocks of a token run side by side and read each tile from
    DRAM once between them (then from L2), so a program's share of a tile is
    ``tile / head_blocks``."""
    head_blocks = triton.cdiv(heads, cfg.block_h)
    return dict(
        min_tiles=cfg.min_tiles,
        tile_bytes=cfg.block_n * d_qk * elt // head_blocks,
        in_bytes=cfg.block_h * d_qk * elt,
        out_bytes=cfg.block_h * (d_v * elt + 4),
        split_out_bytes=cfg.block_h * (d_v * 4 + 4),
        # the combine's CTAs per program: one per head row and 16-byte-per-thread warp slice
        merge_ctas=cfg.block_h * -(-d_v * 4 // 512),
    )
