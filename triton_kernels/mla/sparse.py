"""Sparse top-k partial absorbed-MLA attention: the holder's compute under selection (§3.3, §5.4,
§6.3 of the paper).

A sparse-attention indexer (DeepSeek-V3.2 DSA, NSA) picks, per query token, ``topk`` cache
entries scattered anywhere in the pool; route attends them where they reside, at their canonical
positions (no rotation), and returns a partial ``(o, lse)`` that the requester merges with the
partials of the other holders the selection spans.

Kernel design: the tile loop is the dense kernel's (``mla.tile``: heads packed per program,
online softmax in fp32, the value read from the latent part of the same tile); only the row
lookup differs: the ``BLOCK_N`` indices of a tile address ``kv_pool.reshape(-1, d_qk)``, and
``-1`` masks a slot, which is never read (with ``check_indices=False`` any negative index
is read as unused). Any number of heads (FlashMLA's
sparse kernel takes only 64 or 128, in FP8). Like the dense op, ``num_splits`` divides each
row's index list into ranges combined by the merge kernel (one query token at top-2048 is
otherwise only ``ceil(H / BLOCK_H)`` programs). Like the dense kernel it reads a split cache
(``kpe_pool``: FlashInfer's ``ckv`` / ``kpe``) and split query rows (``q_pe``) in place.

:func:`mla_sparse_partial` is declared (signature, docstring, fake) in ``ops``; this module
plans it (:func:`plan_mla_sparse`, the same signature without ``out``) and launches it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._core.execution import bf16_rne_in_software, check_launchable, dot_in_fp32
from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels._core.validate import (
    check_num_splits,
    check_same_device,
    check_softmax_scale,
    check_tensor,
)
from mqnc.triton_kernels.dispatch import Case, Target, choose
from mqnc.triton_kernels.fp8.cache import as_bytes, check_fp8_entries, fp8_rope_view, is_fp8_pool
from mqnc.triton_kernels.mla.gluon_plan import (
    fp8_rows,
    plan_fp8_seesaw,
    plan_sparse_seesaw,
    tma_rows,
)
from mqnc.triton_kernels.mla.plan import (
    AttentionPlan,
    MlaOperands,
    MlaPlan,
    TileConfig,
    check_block_size,
    dot_precision,
    fp8_entry_bytes,
    fp8_flags,
    meta_output,
    mla_operands,
    plan_mla,
    split_strides,
    tile_config,
    variant_name,
)
from mqnc.triton_kernels.mla.tile import (
    LOG2E,
    _attend_rows,
    _load_query,
    _softmax_init,
    _split_range,
    _store_partial,
)
from mqnc.triton_kernels.ops import mla_sparse_partial

__all__ = ["mla_sparse_partial", "plan_mla_sparse", "plan_sparse", "sparse_launch"]


# topk and the index rows' stride vary from call to call: not specialised (see mla_decode).
@triton.jit
def _sparse_keys(
    H, topk, NUM_SPLITS, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr
):
    """``(b, h0, split, k_start, k_end)`` of this program of the sparse grid: query row ``b``,
    its first head ``h0``, split ``split`` and that split's index slots ``k_start .. k_end``."""
    head_blocks = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    b = pid // head_blocks
    h0 = (pid - b * head_blocks) * BLOCK_H
    split = tl.program_id(1)
    k_start, k_end = _split_range(topk, NUM_SPLITS, split, BLOCK_N, MIN_TILES)
    return b, h0, split, k_start, k_end


@triton.jit(do_not_specialize=["topk", "NUM_SPLITS", "stride_ib"])
def _mla_sparse_kernel(
    Q,
    Q_PE,
    KV,
    KV_PE,
    Indices,
    O,
    LSE,
    H,
    topk,
    NUM_SPLITS,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_pqb,
    stride_pqh,
    stride_kb,
    stride_kt,
    stride_pkb,
    stride_pkt,
    stride_ib,
    stride_ik,
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
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_RNE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_RNE: tl.constexpr,
):
    """Grid ``(B * ceil(H / BLOCK_H), NUM_SPLITS)``: a row's head blocks adjacent on axis 0 (as
    the dense kernel's); split ``s`` takes a contiguous range of the row's ``topk`` index
    slots, whole tiles each. ``FP8``: ``KV`` holds FP8 entries (uint8), dequantized to ``Q``'s
    dtype in registers (``mla.tile._load_fp8_tile``; ``FP8_RNE``: the interpreter's bf16)."""
    b, h0, split, k_start, k_end = _sparse_keys(H, topk, NUM_SPLITS, BLOCK_H, BLOCK_N, MIN_TILES)

    q_lat, q_pe, offs_h, mask_h = _load_query(
        Q, Q_PE, b, h0, H, stride_qb, stride_qh, stride_pqb, stride_pqh, BLOCK_H, D_LAT, D_PE,
        SPLIT, DOT_FP32,
    )  # fmt: skip
    m, l, acc = _softmax_init(BLOCK_H, D_LAT)

    index_row = Indices + b.to(tl.int64) * stride_ib
    offs_n = tl.arange(0, BLOCK_N)
    for k0 in range(k_start, k_end, BLOCK_N):
        k = k0 + offs_n
        idx = tl.load(index_row + k * stride_ik, mask=k < k_end, other=-1)
        kv_rows, pe_rows, valid = _sparse_rows(
            KV, KV_PE, idx, stride_kb, stride_kt, stride_pkb, stride_pkt, PAGE, SPLIT
        )
        m, l, acc = _attend_rows(
            q_lat, q_pe, kv_rows, pe_rows, valid, m, l, acc, qk_scale, D_LAT, D_PE, SPLIT,
            DOT_FP32, PRECISION, FP8, Q.dtype.element_ty, FP8_RNE,
        )  # fmt: skip

    o_base = split.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob
    lse_base = split.to(tl.int64) * stride_ls + b.to(tl.int64) * stride_lb
    _store_partial(
        O, LSE, o_base, lse_base, offs_h, mask_h, stride_oh, stride_lh, m, l, acc, D_LAT, BF16_RNE
    )


@triton.jit
def _sparse_rows(
    KV, KV_PE, idx, stride_kb, stride_kt, stride_pkb, stride_pkt, PAGE: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """``(kv_rows, pe_rows, valid)`` of a tile's gathered indices ``idx [BLOCK_N]`` (``< 0``:
    an unused slot, never read)."""
    valid = idx >= 0
    idx = tl.where(valid, idx, 0)
    kv_rows = KV + (idx // PAGE).to(tl.int64) * stride_kb + (idx % PAGE) * stride_kt
    if SPLIT:
        pe_rows = KV_PE + (idx // PAGE).to(tl.int64) * stride_pkb + (idx % PAGE) * stride_pkt
    else:
        pe_rows = kv_rows  # (not read: the rope part follows the latent)
    return kv_rows, pe_rows, valid


@triton.jit(do_not_specialize=["topk", "NUM_SPLITS", "stride_ib"])
def _mla_sparse_pipe_kernel(
    Q, Q_PE, KV, KV_PE, Indices, O, LSE, H, topk, NUM_SPLITS, qk_scale, stride_qb, stride_qh,
    stride_pqb, stride_pqh, stride_kb, stride_kt, stride_pkb, stride_pkt, stride_ib, stride_ik,
    stride_os, stride_ob, stride_oh, stride_ls, stride_lb, stride_lh,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
    D_LAT: tl.constexpr, D_PE: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, BF16_RNE: tl.constexpr, RING: tl.constexpr, FP8: tl.constexpr,
    FP8_RNE: tl.constexpr,
):  # fmt: skip
    """The restructured sparse kernel (the ``pipe`` candidates; grid, arguments and outputs as
    :func:`_mla_sparse_kernel`'s): the split's full tiles in a software-pipelined loop
    (``tl.range(num_stages=RING)``: a later tile's index gather is in flight while this one is
    attended) whose index loads carry no range mask, then the last, partial tile's range mask
    once. The ``-1`` slots stay masked on every tile: which slots are used is data, not
    shape. TMA does not apply: Hopper's TMA has no row gather (Blackwell's ``gather``).
    ``FP8``: FP8 entries, as in :func:`_mla_sparse_kernel`."""
    b, h0, split, k_start, k_end = _sparse_keys(H, topk, NUM_SPLITS, BLOCK_H, BLOCK_N, MIN_TILES)
    q_lat, q_pe, offs_h, mask_h = _load_query(
        Q, Q_PE, b, h0, H, stride_qb, stride_qh, stride_pqb, stride_pqh, BLOCK_H, D_LAT, D_PE,
        SPLIT, DOT_FP32,
    )  # fmt: skip
    m, l, acc = _softmax_init(BLOCK_H, D_LAT)
    index_row = Indices + b.to(tl.int64) * stride_ib
    offs_n = tl.arange(0, BLOCK_N)
    n_full = (k_end - k_start) // BLOCK_N
    for i in tl.range(0, n_full, num_stages=RING):
        idx = tl.load(index_row + (k_start + i * BLOCK_N + offs_n) * stride_ik)
        kv_rows, pe_rows, valid = _sparse_rows(
            KV, KV_PE, idx, stride_kb, stride_kt, stride_pkb, stride_pkt, PAGE, SPLIT
        )
        m, l, acc = _attend_rows(
            q_lat, q_pe, kv_rows, pe_rows, valid, m, l, acc, qk_scale, D_LAT, D_PE, SPLIT,
            DOT_FP32, PRECISION, FP8, Q.dtype.element_ty, FP8_RNE,
        )  # fmt: skip
    k_tail = k_start + n_full * BLOCK_N
    if k_tail < k_end:
        k = k_tail + offs_n
        idx = tl.load(index_row + k * stride_ik, mask=k < k_end, other=-1)
        kv_rows, pe_rows, valid = _sparse_rows(
            KV, KV_PE, idx, stride_kb, stride_kt, stride_pkb, stride_pkt, PAGE, SPLIT
        )
        m, l, acc = _attend_rows(
            q_lat, q_pe, kv_rows, pe_rows, valid, m, l, acc, qk_scale, D_LAT, D_PE, SPLIT,
            DOT_FP32, PRECISION, FP8, Q.dtype.element_ty, FP8_RNE,
        )  # fmt: skip
    o_base = split.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob
    lse_base = split.to(tl.int64) * stride_ls + b.to(tl.int64) * stride_lb
    _store_partial(
        O, LSE, o_base, lse_base, offs_h, mask_h, stride_oh, stride_lh, m, l, acc, D_LAT, BF16_RNE
    )


def check_index_range(indices: torch.Tensor, pool_tokens: int) -> None:
    """Host-side check (one sync): every index is -1 (unused) or in ``[0, pool_tokens)``; the
    first one that is not is named at its place in ``indices`` (any number of dims: an
    adapter checks its own layout, e.g. FlashMLA's ``[b, s_q, topk]``)."""
    bad = (indices < -1) | (indices >= pool_tokens)
    if bool(bad.any()):
        where = tuple(int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"indices: expected -1 (unused) or a token id in [0, {pool_tokens}) of the flattened "
            f"kv_pool, got {int(indices[where])} at [{', '.join(map(str, where))}] "
            f"({int(bad.sum())} out of range)"
        )


@mla_sparse_partial.op.planner
def plan_mla_sparse(call) -> AttentionPlan:
    """Plan :func:`mla_sparse_partial` once for a batch shape: every check and the split choice
    here; ``plan.run(q, kv_pool, indices, q_pe=None, kpe_pool=None)`` then launches on tensors
    of the same shapes, dtypes, strides and device, unchecked and without a host sync (new
    indices each step: the range check ran on the planning call's only)."""
    q, kv_pool, indices, q_pe, kpe_pool = (
        call.q,
        call.kv_pool,
        call.indices,
        call.q_pe,
        call.kpe_pool,
    )
    d_v = call.d_v
    ops = mla_operands(q, kv_pool, d_v, q_pe=q_pe, kpe_pool=kpe_pool)
    B = q.shape[0]
    num_blocks, block_size, _ = kv_pool.shape
    check_block_size(block_size)
    check_tensor("indices", indices, ndim=2, dtypes=(torch.int32,), shape=(B, None))
    tensors = dict(q=q, kv_pool=kv_pool, indices=indices)
    for name, t in (("q_pe", q_pe), ("kpe_pool", kpe_pool)):
        if t is not None:
            tensors[name] = t
    check_same_device(**tensors)
    check_launchable(q, "q")
    scale = check_softmax_scale(call.softmax_scale)
    check_num_splits(call.num_splits)
    if call.check_indices:
        check_index_range(indices, num_blocks * block_size)
        if ops.fp8:
            check_fp8_entries(ops.kv, indices[indices >= 0], d_v, kpe_pool)
    choice = choose(
        Case.of_dtypes(
            "mla_sparse",
            q.dtype,
            None if ops.fp8 else kv_pool.dtype,
            split_cache=kpe_pool is not None,
            split_q=q_pe is not None,
            d_qk=ops.d_v + ops.d_pe,
            d_v=d_v,
            page=block_size,
            tma_rows=fp8_rows(ops.kv) if ops.fp8 else tma_rows(kv_pool, kpe_pool),
        ),
        Target.of(q.device),
    )
    attend = None
    if choice.backend == "gluon" and ops.fp8:
        template, attend = plan_fp8_seesaw(
            q, ops.kv, indices, scale=scale, num_splits=call.num_splits, sparse=True
        )
    elif choice.backend == "gluon":
        template, attend = plan_sparse_seesaw(
            q, kv_pool, indices, scale=scale, num_splits=call.num_splits
        )
    else:
        template = plan_sparse(
            q, kv_pool, indices, scale, d_v, call.num_splits, ops=ops, alloc=meta_output
        )
    split, fp8 = ops.split, ops.fp8

    def bind(q, kv_pool, indices, *, q_pe=None, kpe_pool=None):
        kv_pool = as_bytes(kv_pool) if fp8 else kv_pool
        if not split:
            return (q, q, kv_pool, kv_pool, indices)
        q_pe = q[..., d_v:] if q_pe is None else q_pe
        if kpe_pool is None:
            kpe_pool = fp8_rope_view(kv_pool, d_v) if fp8 else kv_pool[..., d_v:]
        return (q, q_pe, kv_pool, kpe_pool, indices)

    planned = bind(q, kv_pool, indices, q_pe=q_pe, kpe_pool=kpe_pool)
    names = ("q", "q_pe", "kv_pool", "kpe_pool", "indices")
    return AttentionPlan(
        template,
        bind,
        n_inputs=5,
        device=q.device,
        planned=planned,
        names=names,
        attend=attend,
        backend=choice.backend,
        kernel=choice.kernel,
    )


def plan_sparse(
    q,
    kv_pool,
    indices,
    scale,
    d_v,
    num_splits,
    occupancy=None,
    *,
    ops: MlaOperands | None = None,
    alloc=None,
) -> MlaPlan:
    """The launches of one :func:`mla_sparse_partial` call for valid inputs (unchecked), at
    ``occupancy`` if given (see ``mla.plan.plan_mla``); ``ops`` the checked operands
    (default: fused ``q`` and ``kv_pool``), ``alloc`` how outputs are made."""
    if ops is None:  # fused rows; an FP8 pool's operands (its uint8 view) checked as such
        fp8 = is_fp8_pool(kv_pool)
        ops = mla_operands(q, kv_pool, d_v) if fp8 else MlaOperands(
            q, q, kv_pool, kv_pool, d_v, q.shape[2] - d_v, False
        )  # fmt: skip
    cfg = tile_config(q.shape[1], sparse=True, dtype=q.dtype, fp8=ops.fp8)

    def build(o_part, lse_part, splits):
        return sparse_launch(ops, indices, o_part, lse_part, splits, scale, cfg)

    extra = {} if alloc is None else {"alloc": alloc}
    return plan_mla(
        build,
        op="mla_sparse",
        q=q,
        d_v=d_v,
        cfg=cfg,
        tiles=triton.cdiv(indices.shape[1], cfg.block_n),
        num_splits=num_splits,
        occupancy=occupancy,
        d_qk=d_v + ops.d_pe,
        entry_bytes=fp8_entry_bytes(ops),
        **extra,
    )


def sparse_launch(
    ops: MlaOperands,
    indices: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    num_splits: int,
    scale: float,
    cfg: TileConfig,
) -> Launch:
    """The sparse kernel's launch (no checks: :func:`mla_sparse_partial` checks); outputs as
    in :func:`mqnc.triton_kernels.mla.decode.decode_launch`."""
    q, kv_pool = ops.q, ops.kv
    B, H = q.shape[:2]
    page = kv_pool.shape[1]
    feats = () if page == 64 else (f"page={page}",)
    feats += ("split-kv",) if ops.split else ()
    restructured = fp8_flags(ops, cfg)
    if cfg.kernel:  # the restructured loop (no TMA on Hopper for a gather; no fused combine)
        if cfg.kernel != "pipe" or cfg.fused:
            raise ValueError(
                f"tile: expected a classic or '-pipe' tile for the sparse kernel, got {cfg.label!r}"
            )
        feats += ("pipe",)
        restructured["RING"] = cfg.num_stages
    return Launch(
        name=variant_name(
            "mla_sparse-fp8" if ops.fp8 else "mla_sparse", q.dtype, cfg, o_part.dim() == 4, feats
        ),
        kernel=_mla_sparse_pipe_kernel if cfg.kernel else _mla_sparse_kernel,
        grid=(B * triton.cdiv(H, cfg.block_h), num_splits),
        args=(
            q,
            ops.q_pe,
            kv_pool,
            ops.kv_pe,
            indices,
            o_part,
            lse_part,
            H,
            indices.shape[1],
            num_splits,
            scale * LOG2E,
            q.stride(0),
            q.stride(1),
            ops.q_pe.stride(0),
            ops.q_pe.stride(1),
            kv_pool.stride(0),
            kv_pool.stride(1),
            ops.kv_pe.stride(0),
            ops.kv_pe.stride(1),
            indices.stride(0),
            indices.stride(1),
            *split_strides(o_part, lse_part),
        ),
        kwargs=dict(
            PAGE=kv_pool.shape[1],
            BLOCK_H=cfg.block_h,
            BLOCK_N=cfg.block_n,
            MIN_TILES=cfg.min_tiles,
            D_LAT=ops.d_v,
            D_PE=ops.d_pe,
            SPLIT=ops.split,
            DOT_FP32=dot_in_fp32(q.dtype, q.device),
            PRECISION=dot_precision(q.dtype),
            BF16_RNE=bf16_rne_in_software(o_part.dtype, o_part.device),
            **restructured,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            maxnreg=cfg.reg_cap,
        ),
    )
