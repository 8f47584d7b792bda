"""Dense paged partial absorbed-MLA attention: the holder's compute for a routed query batch
(§3.3, §6.3 of the paper).

A holder receives absorbed query rows ``q [B, H, 576]`` and attends them over the cache it
holds, a paged pool of 576-wide entries (512 latent ``c_KV`` + 64 rotated ``k_pe``) shared by
all heads, returning the partial ``(o [B, H, 512], lse [B, H])`` the requester merges.

Kernel design (decisions written down here, where the issue was silent):

- **Heads packed**: one program handles ``BLOCK_H`` heads of one query token (16 for H <= 16,
  else 32; FlashMLA's 64 spills registers in Triton, see ``_mla_tile.tile_config``) and streams
  that token's cache tiles once for all of them; the value is the first ``d_v`` dims of the
  same tile (no second read of the latent).
- **Paged**: the ``BLOCK_N`` (64, or 32 at 32 heads) entries of a tile are looked up one by one
  in the block table, so any power-of-two block size >= 16 works, smaller or larger than the
  tile.
- **Split-KV**: with ``num_splits = S > 1`` each row's tiles are divided into S contiguous
  ranges; each split writes an fp32 partial into a workspace ``[S, B, H, d_v]`` and the S
  partials are combined by the package's merge kernel (``mqnc.triton_kernels.merge``: one
  implementation of the merge math). ``num_splits=None`` picks S so that
  ``B * ceil(H / BLOCK_H) * S`` programs cover the device's SMs (132 assumed without a GPU, so
  the interpreter exercises the same choices as an H100/H200) with at least 256 entries per split.
  The choice uses the block table's capacity, never ``cache_seqlens`` (no host sync).
- Lengths per row may differ, including 0 (``o = 0, lse = -inf``).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._checks import (
    FLOAT_DTYPES,
    check_same_device,
    check_tensor,
)
from mqnc.triton_kernels._mla_tile import (
    LOG2E,
    _attend_tile,
    _load_query,
    _store_partial,
    tile_config,
)
from mqnc.triton_kernels._runtime import (
    bf16_rne_in_software,
    dot_in_fp32,
    launch_lock,
    new_output,
)
from mqnc.triton_kernels.merge import merge_partials

__all__ = ["mla_decode_partial", "choose_num_splits", "compile_specs"]

MIN_TOKENS_PER_SPLIT = 256
ASSUMED_SMS = 132  # H100 / H200 SXM, used when no GPU is present


@triton.jit
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
    D_LAT: tl.constexpr,
    D_PE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_RNE: tl.constexpr,
):
    """Grid ``(B, ceil(H / BLOCK_H), NUM_SPLITS)``: one program per (token, head block, split)."""
    b = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    split = tl.program_id(2)

    seqlen = tl.load(SeqLens + b)
    tiles_per_split = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), NUM_SPLITS)
    t_start = split * tiles_per_split * BLOCK_N
    t_end = tl.minimum(t_start + tiles_per_split * BLOCK_N, seqlen)

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


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (queried at launch, cached); 132 off-GPU."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return ASSUMED_SMS


def choose_num_splits(programs: int, max_tokens: int, sms: int) -> int:
    """Splits of the key axis so that ``programs * splits`` fill ``sms`` SMs, keeping at least
    ``MIN_TOKENS_PER_SPLIT`` entries per split (1 when the grid is already full)."""
    if programs <= 0 or programs >= sms:
        return 1
    return max(1, min(math.ceil(sms / programs), max_tokens // MIN_TOKENS_PER_SPLIT))


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


def check_softmax_scale(softmax_scale: object) -> float:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale: expected a finite positive float, got {softmax_scale!r}")
    return scale


def check_num_splits(num_splits: object) -> None:
    if num_splits is None:
        return
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits: expected None or an int, got {type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"num_splits: expected None or an int >= 1, got {num_splits}")


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 for fp32 inputs (never tf32); 16-bit ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


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
    device = check_same_device(
        q=q, kv_pool=kv_pool, block_table=block_table, cache_seqlens=cache_seqlens
    )
    scale = check_softmax_scale(softmax_scale)
    check_num_splits(num_splits)
    if check_inputs:
        _check_paging(block_table, cache_seqlens, num_blocks, block_size)

    block_h, block_n, num_warps = tile_config(H)
    head_blocks = triton.cdiv(H, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(
            B * head_blocks, block_table.shape[1] * block_size, sm_count(device)
        )

    o, lse, o_part, lse_part, o_strides, l_strides = split_outputs(
        B, H, d_v, q.dtype, device, num_splits
    )
    if B * H == 0:
        return o, lse

    with launch_lock():
        _mla_decode_kernel[(B, head_blocks, num_splits)](
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
            *o_strides,
            *l_strides,
            PAGE=block_size,
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            D_LAT=d_v,
            D_PE=d_pe,
            DOT_FP32=dot_in_fp32(q.dtype),
            PRECISION=dot_precision(q.dtype),
            BF16_RNE=bf16_rne_in_software(o_part.dtype),
            num_warps=num_warps,
        )
        combine_splits(o_part, lse_part, o, lse, num_splits)
    return o, lse


def split_outputs(B: int, H: int, d_v: int, dtype: torch.dtype, device, num_splits: int):
    """The outputs ``o [B, H, d_v]`` (``dtype``) and ``lse [B, H]`` fp32, and where the kernel
    writes: straight into them for one split, else into fp32 per-split partials
    ``[num_splits, B, H, d_v]`` / ``[num_splits, B, H]`` that :func:`combine_splits` merges.
    Returns ``(o, lse, o_part, lse_part, o_strides, lse_strides)`` with the split stride first
    (0 for one split)."""
    o = new_output((B, H, d_v), dtype, device)
    lse = new_output((B, H), torch.float32, device)
    if num_splits == 1:
        return o, lse, o, lse, (0, *o.stride()[:2]), (0, *lse.stride())
    o_part = new_output((num_splits, B, H, d_v), torch.float32, device)
    lse_part = new_output((num_splits, B, H), torch.float32, device)
    return o, lse, o_part, lse_part, o_part.stride()[:3], lse_part.stride()


def combine_splits(o_part, lse_part, o, lse, num_splits: int) -> None:
    """Split-KV partials are disjoint key subsets: the one merge kernel combines them into
    ``(o, lse)`` (a no-op for one split, where the kernel wrote them directly)."""
    if num_splits > 1:
        merge_partials(o_part, lse_part, check_lse=False, out=(o, lse))


def decode_signature(dtype: str = "bf16") -> dict:
    ptr = f"*{dtype}"
    return {
        "Q": ptr,
        "KV": ptr,
        "BlockTable": "*i32",
        "SeqLens": "*i32",
        "O": ptr,
        "LSE": "*fp32",
        "H": "i32",
        "NUM_SPLITS": "i32",
        "qk_scale": "fp32",
        **{
            k: "i32"
            for k in (
                "stride_qb",
                "stride_qh",
                "stride_kb",
                "stride_kt",
                "stride_tb",
                "stride_tj",
                "stride_os",
                "stride_ob",
                "stride_oh",
                "stride_ls",
                "stride_lb",
                "stride_lh",
            )
        },
        **{
            k: "constexpr"
            for k in (
                "PAGE",
                "BLOCK_H",
                "BLOCK_N",
                "D_LAT",
                "D_PE",
                "DOT_FP32",
                "PRECISION",
                "BF16_RNE",
            )
        },
    }


def compile_specs():
    """The dense kernel at its production tiles (``_mla_tile.tile_config``: 16 heads x 64
    entries and 32 heads x 32 entries, 8 warps), bf16, 576 = 512 + 64, page 64, for the sm_90
    compile test; with and without split-KV (the split workspace is fp32)."""
    specs = []
    for heads in (16, 128):
        block_h, block_n, num_warps = tile_config(heads)
        for out in ("bf16", "fp32"):  # direct output, or the fp32 split-KV workspace
            sig = decode_signature()
            sig["O"] = f"*{out}"
            specs.append(
                dict(
                    name=f"mla_decode[bf16,BLOCK_H={block_h},BLOCK_N={block_n},O={out}]",
                    fn=_mla_decode_kernel,
                    signature=sig,
                    constexprs=dict(
                        PAGE=64,
                        BLOCK_H=block_h,
                        BLOCK_N=block_n,
                        D_LAT=512,
                        D_PE=64,
                        DOT_FP32=False,
                        PRECISION="tf32",
                        BF16_RNE=False,
                    ),
                    num_warps=num_warps,
                )
            )
    return specs
