"""Dense paged partial absorbed-MLA attention: the holder's compute for a routed query batch
(§3.3, §6.3 of the paper).

A holder receives absorbed query rows ``q [B, H, 576]`` and attends them over the cache it
holds, a paged pool of 576-wide entries (512 latent ``c_KV`` + 64 rotated ``k_pe``) shared by
all heads, returning the partial ``(o [B, H, 512], lse [B, H])`` the requester merges.

Kernel design (decisions written down here, where the issue was silent):

- **Heads packed**: one program handles ``BLOCK_H`` heads of one query token (16 for H <= 16,
  else 32; FlashMLA's 64 spills registers in Triton, see ``_mla_launch.tile_config``) and
  streams that token's cache tiles once for all of them; the value is the first ``d_v`` dims of
  the same tile (no second read of the latent).
- **Grid order**: ``(ceil(H / BLOCK_H), S, B)``, head blocks fastest, so the head blocks of one
  token (and split) run side by side and read each tile once from DRAM, then from L2.
- **Paged, pipelined**: the ``BLOCK_N`` (64, or 32 at 32 heads) entries of a tile are looked
  up in the block table (any power-of-two block size >= 16 works, smaller or larger than the
  tile); with 5 pipeline stages Triton double-buffers the KV tile behind that indirection (the
  next tile's page ids and entries are in flight while this one is attended: TTGIR
  ``2x64x512xbf16`` buffers, ``async_wait {num = 4}``, checked by ``test_compile_sm90``).
- **Split-KV**: with ``num_splits = S > 1`` each row's tiles are divided into S contiguous
  ranges of at least 64 entries; each split writes an fp32 partial into a workspace
  ``[S, B, H, d_v]`` and the S partials are combined by the package's merge kernel
  (``mqnc.triton_kernels.merge``: one implementation of the merge math). ``num_splits=None``
  lets the split / grid policy choose (``_grid.choose_num_splits``: whole waves of the CTAs
  that the compiled kernel fits per SM, 132 SMs assumed without a GPU), from the block table's
  capacity, never ``cache_seqlens`` (no host sync).
- Lengths per row may differ, including 0 (``o = 0, lse = -inf``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._checks import (
    check_kernel_device,
    check_num_splits,
    check_same_device,
    check_softmax_scale,
    check_tensor,
)
from mqnc.triton_kernels._launch import Launch
from mqnc.triton_kernels._mla_launch import (
    MlaPlan,
    TileConfig,
    check_mla_shapes,
    dot_precision,
    plan_mla,
    split_strides,
    tile_config,
    variant_name,
)
from mqnc.triton_kernels._mla_tile import (
    LOG2E,
    _attend_tile,
    _load_query,
    _split_range,
    _store_partial,
)
from mqnc.triton_kernels._runtime import bf16_rne_in_software, dot_in_fp32

__all__ = ["mla_decode_partial", "plan_decode", "decode_launch"]


# Runtime ints that vary from call to call are not specialised (an int equal to 1 would become
# a constexpr, one divisible by 16 get an alignment hint: each a separate compile at run time);
# the block table's row stride is its width, which follows the longest context of the batch.
@triton.jit(do_not_specialize=["NUM_SPLITS", "stride_tb"])
def _mla_decode_kernel(
    Q,
    KV,
    BlockTable,
    SeqLens,
    O,
    LSE,
    H,
    NUM_SPLITS,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_tb,
    stride_tj,
    stride_os,
    stride_ob,
    stride_oh,
    stride_ls,
    stride_lb,
    stride_lh,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    D_LAT: tl.constexpr,
    D_PE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_RNE: tl.constexpr,
):
    """Grid ``(ceil(H / BLOCK_H), NUM_SPLITS, B)``: one program per (head block, split, token)."""
    h0 = tl.program_id(0) * BLOCK_H
    split = tl.program_id(1)
    b = tl.program_id(2)

    seqlen = tl.load(SeqLens + b)
    t_start, t_end = _split_range(seqlen, NUM_SPLITS, split, BLOCK_N, MIN_TILES)

    q_lat, q_pe, offs_h, mask_h = _load_query(
        Q, b, h0, H, stride_qb, stride_qh, BLOCK_H, D_LAT, D_PE, DOT_FP32
    )
    m = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_LAT], tl.float32)

    table_row = BlockTable + b.to(tl.int64) * stride_tb
    offs_n = tl.arange(0, BLOCK_N)
    for t0 in range(t_start, t_end, BLOCK_N):
        t = t0 + offs_n
        valid = t < t_end
        page = tl.load(table_row + (t // PAGE) * stride_tj, mask=valid, other=0)
        kv_rows = KV + page.to(tl.int64) * stride_kb + (t % PAGE) * stride_kt
        m, l, acc = _attend_tile(
            q_lat, q_pe, kv_rows, valid, m, l, acc, qk_scale, D_LAT, D_PE, DOT_FP32, PRECISION
        )

    o_base = split.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob
    lse_base = split.to(tl.int64) * stride_ls + b.to(tl.int64) * stride_lb
    _store_partial(
        O, LSE, o_base, lse_base, offs_h, mask_h, stride_oh, stride_lh, m, l, acc, D_LAT, BF16_RNE
    )


def _check_paging(
    block_table: torch.Tensor, cache_seqlens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Host-side range checks (one sync): lengths fit the table, used pages exist."""
    cap = block_table.shape[1] * block_size
    lens = cache_seqlens.long()
    bad = (lens < 0) | (lens > cap)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"cache_seqlens: expected values in [0, {cap}] (block_table has "
            f"{block_table.shape[1]} blocks of {block_size}), got {int(lens[i])} at row {i}"
        )
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * block_size
    used = used < lens[:, None]
    pages = block_table.long()
    bad = used & ((pages < 0) | (pages >= num_blocks))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table: expected block ids in [0, {num_blocks}) for blocks in use, got "
            f"{int(pages[i, j])} at [{i}, {j}]"
        )


def mla_decode_partial(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float,
    d_v: int = 512,
    num_splits: int | None = None,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of absorbed MLA query rows over a paged cache (the holder's compute, §3.3).

    For query token ``b`` and head ``h``, with ``kv[t]`` the ``t``-th cache entry of token ``b``
    (``t < cache_seqlens[b]``) and ``s_t = softmax_scale * <q[b, h], kv[t]>``::

        lse[b, h] = log(sum_t exp(s_t))        o[b, h] = sum_t exp(s_t - lse[b, h]) * kv[t, :d_v]

    Parameters
    ----------
    q : torch.Tensor
        Absorbed query rows, shape ``[B, H, d_qk]`` (``d_qk = 576``: ``q_nope @ W_UK`` then the
        rotated ``q_pe``), bf16 / fp16 / fp32, unit stride on the last dim.
    kv_pool : torch.Tensor
        Paged cache, shape ``[num_blocks, block_size, d_qk]``, same dtype as ``q``, unit stride on
        the last dim; ``block_size`` a power of two >= 16 (64 in production). Each entry is
        ``[c_KV (d_v), k_pe (d_qk - d_v)]``, shared by all heads.
    block_table : torch.Tensor
        ``[B, max_blocks]`` int32: token ``t`` of row ``b`` lives at
        ``kv_pool[block_table[b, t // block_size], t % block_size]``. Entries past a row's
        length are never read.
    cache_seqlens : torch.Tensor
        ``[B]`` int32, entries attended per row, ``0 <= cache_seqlens[b] <= max_blocks *
        block_size``; 0 gives ``o = 0, lse = -inf``.
    softmax_scale : float
        The model's scale, required (DeepSeek with YaRN: ``192**-0.5 * mscale**2``, not
        ``576**-0.5``).
    d_v : int
        Value width, the first ``d_v`` dims of each entry (512). ``d_v`` and ``d_qk - d_v`` must
        be powers of two >= 16.
    num_splits : int or None
        Splits of each row's key axis (split-KV), combined by the merge kernel; None chooses
        (see the module docstring). 1 writes the output directly.
    check_inputs : bool
        Check on the host (one sync) that lengths fit the table and the blocks in use exist;
        pass False on a hot path.

    Returns
    -------
    o : torch.Tensor
        ``[B, H, d_v]`` in ``q``'s dtype (accumulated in fp32).
    lse : torch.Tensor
        ``[B, H]`` float32, **natural-log** log-sum-exp of the scaled scores; ``-inf`` for an
        empty row. ``lse_to_base2`` converts to FlashInfer's convention.

    Examples
    --------
    >>> import torch
    >>> from mqnc.triton_kernels import mla_decode_partial
    >>> q = torch.randn(2, 16, 576)
    >>> pool = torch.randn(4, 64, 576)
    >>> table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    >>> lens = torch.tensor([100, 0], dtype=torch.int32)
    >>> o, lse = mla_decode_partial(q, pool, table, lens, softmax_scale=192**-0.5)
    >>> o.shape, lse.shape, float(lse[1, 0])
    (torch.Size([2, 16, 512]), torch.Size([2, 16]), -inf)
    """
    d_v, d_pe = check_mla_shapes(q, kv_pool, d_v)
    B, H, _ = q.shape
    num_blocks, block_size, _ = kv_pool.shape
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"kv_pool: expected a block size (dim 1) that is a power of two >= 16, got {block_size}"
        )
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), shape=(B, None))
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32,), shape=(B,))
    if not cache_seqlens.is_contiguous():
        raise ValueError(
            f"cache_seqlens: expected a contiguous tensor, got strides {cache_seqlens.stride()}"
        )
    check_same_device(q=q, kv_pool=kv_pool, block_table=block_table, cache_seqlens=cache_seqlens)
    check_kernel_device("q", q)
    scale = check_softmax_scale(softmax_scale)
    check_num_splits(num_splits)
    if check_inputs:
        _check_paging(block_table, cache_seqlens, num_blocks, block_size)

    return plan_decode(q, kv_pool, block_table, cache_seqlens, scale, d_v, num_splits).run()


def plan_decode(
    q, kv_pool, block_table, cache_seqlens, scale, d_v, num_splits, occupancy=None
) -> MlaPlan:
    """The launches of :func:`mla_decode_partial` for valid inputs (unchecked), at
    ``occupancy`` if given (see ``_mla_launch.plan_mla``)."""
    cfg = tile_config(q.shape[1])

    def build(o_part, lse_part, splits):
        return decode_launch(
            q, kv_pool, block_table, cache_seqlens, o_part, lse_part, splits, scale, d_v, cfg
        )

    tiles = triton.cdiv(block_table.shape[1] * kv_pool.shape[1], cfg.block_n)
    return plan_mla(
        build,
        op="mla_decode",
        q=q,
        d_v=d_v,
        cfg=cfg,
        tiles=tiles,
        num_splits=num_splits,
        occupancy=occupancy,
    )


def decode_launch(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    num_splits: int,
    scale: float,
    d_v: int,
    cfg: TileConfig,
) -> Launch:
    """The dense kernel's launch (no checks: :func:`mla_decode_partial` checks), writing into
    ``o_part [B, H, d_v]`` / ``lse_part [B, H]`` for one split or the fp32 workspaces
    ``[num_splits, B, H, d_v]`` / ``[num_splits, B, H]``."""
    B, H, d_qk = q.shape
    block_size = kv_pool.shape[1]
    split = o_part.dim() == 4
    return Launch(
        name=variant_name("mla_decode", q.dtype, cfg, split),
        kernel=_mla_decode_kernel,
        grid=(triton.cdiv(H, cfg.block_h), num_splits, B),
        args=(
            q,
            kv_pool,
            block_table,
            cache_seqlens,
            o_part,
            lse_part,
            H,
            num_splits,
            scale * LOG2E,
            q.stride(0),
            q.stride(1),
            kv_pool.stride(0),
            kv_pool.stride(1),
            block_table.stride(0),
            block_table.stride(1),
            *split_strides(o_part, lse_part),
        ),
        kwargs=dict(
            PAGE=block_size,
            BLOCK_H=cfg.block_h,
            BLOCK_N=cfg.block_n,
            MIN_TILES=cfg.min_tiles,
            D_LAT=d_v,
            D_PE=d_qk - d_v,
            DOT_FP32=dot_in_fp32(q.dtype),
            PRECISION=dot_precision(q.dtype),
            BF16_RNE=bf16_rne_in_software(o_part.dtype),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            maxnreg=cfg.maxnreg,
        ),
    )
