"""The holder as a resident Triton kernel: route requests served from device memory, no host call
per request (§3.1-§3.3, §6.3 of the paper; the host-driven holder is ``mqnc.serving.Holder``).

A grid of ``k`` CTAs (``k`` below the SM count, so the requesters' kernels still get SMs) polls
the inbox signal words of its ``slots`` (one per requester lane) with acquire loads. A signal
that differs from what a CTA last saw on that slot is a request: every CTA reads its header
(``route.words``: sequence, layer, chunk, tokens, heads, mode, top-k), checks it (a bad header
is answered with an error word, never read past: the chunk table, pool and slot are addressed
only after the check), and takes its share of the request's work items, one item being one
(token, head block, split): item ``i`` is CTA ``i mod k``'s. An item runs the partial attention
of its rows over the chunk's pages with the tile code of ``mla.decode`` / ``mla.sparse``
(``mla.tile``: the same ``_split_range``, ``_attend_rows`` and ``_store_partial``; at the host
ops' split counts and loop bounds for the holder's tile, :data:`HOLDER_TILE`, so the answer is
the host-driven holder's at that tile, bit for bit under the interpreter): an
unsplit item writes ``(o, lse)`` (natural log) into the reply slot, a split one its fp32 partial
into the slot's workspace. Each CTA then arrives on the slot's counter (acq_rel atomic); the
last to arrive folds the split partials in split order exactly as ``merge`` does, writes the
reply header (sequence, status, detail, rows) and raises the reply signal (release; on the
``NVSHMEM`` backend: the reply's rows, its lse, a fence, then its header with a put-with-signal
to the requester's PE). A request is answered only after every CTA has seen it, so no CTA can
miss one: a requester sends its next request on a slot only after the reply of the last. A
signal equal to the slot's reply signal (this PE's copy on NVSHMEM, where the holder writes it
too) is answered already: a duplicate, skipped by every CTA alike, so the arrival count of the
next request stays whole. A number that does not increase is refused once (``ERR_SEQ``); the
slot then counts from it.

The kernel is compiled per request mode (``SPARSE``): one kernel serves sparse requests, the
other every other mode (dense, probe, and the error answer of a mode it does not know), each
with its own ``seen`` / ``arrive`` / ``err`` state; with both attention loops in one kernel it
spilled under triton 3.6.0. A holder runs both (``mqnc.serving.device_holder``).

An FP8 cache (``FP8``: DeepSeek-V3.2's 656-byte entries in a uint8 pool) is read in place by the
attention kernels' own helper (``mla.tile._attend_tile_fp8``: latent bytes decoded, times their
group's float32 scale, rounded once to the queries' dtype), dense and sparse, at its own tile
(:func:`fp8_holder_tile`); the slots (queries, ``o``, ``lse``) are what they are for 16-bit caches.

Modes: ``PERSISTENT`` loops until the stop word is set or ``max_idle`` polls find nothing (a
bound, never a hang); otherwise ONE-SHOT: each CTA serves the requests already signalled, then
returns. One-shot runs under the interpreter, where the grid's programs run one after another
(the last program is every request's last arriver).

Loads of what another agent wrote (headers, rows, indices, workspace) bypass L1
(``cache_modifier=".cg"``): a resident CTA would otherwise read a previous request's lines.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._core.execution import bf16_rne_in_software, dot_in_fp32
from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels._core.numerics import round_to
from mqnc.triton_kernels._core.validate import dtype_name
from mqnc.triton_kernels.mla.plan import (
    TileConfig,
    _triton_minor,
    dot_precision,
    tile_config,
)
from mqnc.triton_kernels.mla.tile import (
    LOG2E,
    _attend_rows,
    _softmax_init,
    _split_range,
    _store_partial,
)
from mqnc.triton_kernels.route.nvshmem_device import (
    fence,
    putmem_nbi_block,
    putmem_signal_nbi_block,
)
from mqnc.triton_kernels.route.nvshmem_device import quiet as nvshmem_quiet
from mqnc.triton_kernels.route.words import (
    ERR_CHUNK,
    ERR_INDEX,
    ERR_LAYER,
    ERR_MODE,
    ERR_ROWS,
    ERR_SEQ,
    ERR_TOPK,
    H_BATCH,
    H_CHUNK,
    H_HEADS,
    H_LAYER,
    H_MODE,
    H_SEQ,
    H_TOPK,
    HEADER_WORDS,
    MODE_DENSE,
    MODE_PROBE,
    MODE_SPARSE,
    OK,
    R_DETAIL,
    R_HEADS,
    R_ROWS,
    R_SEQ,
    R_STATUS,
    REPLY_WORDS,
    RouteBuffers,
)

__all__ = [
    "holder_loop_kernel",
    "holder_loop_launch",
    "holder_tiles",
    "HolderTables",
    "HOLDER_TILE",
    "NVSHMEM_TILE",
    "fp8_holder_tile",
]

_HW = tl.constexpr(HEADER_WORDS)
_RW = tl.constexpr(REPLY_WORDS)
# the attention loops are pipelined explicitly (nested in the service loops, the launch's
# num_stages does not reach them): the KV tile double-buffered in shared memory
TILE_STAGES = tl.constexpr(3)
SPARSE_STAGES = tl.constexpr(2)  # (its per-entry index arithmetic: 3 stages spill 32-40 B)
FOLD_D = tl.constexpr(128)  # columns of o the fold of split partials holds at once
SCAN_H = tl.constexpr(16)  # heads (lse values) the NaN rule reads at once
SCAN_K = tl.constexpr(64)  # selected indices the NaN rule reads at once


@triton.jit
def _wide(x):
    """``x`` as int64 (a loop index is an int32 tensor compiled, an int interpreted)."""
    return x + tl.zeros([], tl.int64)


@triton.jit
def _acquire(ptr, SCOPE: tl.constexpr):
    """An acquire load of one int64 word (an atomic add of 0)."""
    return tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)


@triton.jit
def _check(seq, sig, seen, mode, layer, chunk, batch, heads, topk, tokens, n_chunks, layers,
           H, max_batch, max_rows, max_topk):  # fmt: skip
    """``(status, detail)`` of a request's header (``route.words``' codes; the first failed
    check wins). ``tokens`` is the chunk table's entry for ``chunk`` (-1: not hosted)."""
    status = tl.where(mode == MODE_PROBE, OK, OK)
    detail = seq * 0
    bad = (seq != sig) | (sig <= seen)
    status, detail = tl.where(bad, ERR_SEQ, status), tl.where(bad, sig, detail)
    bad = (status == OK) & (mode != MODE_DENSE) & (mode != MODE_SPARSE) & (mode != MODE_PROBE)
    status, detail = tl.where(bad, ERR_MODE, status), tl.where(bad, mode, detail)
    probe = mode == MODE_PROBE
    bad = (status == OK) & ~probe & ((layer < 0) | (layer >= layers))
    status, detail = tl.where(bad, ERR_LAYER, status), tl.where(bad, layer, detail)
    bad = (status == OK) & ~probe & ((chunk < 0) | (chunk >= n_chunks) | (tokens < 0))
    status, detail = tl.where(bad, ERR_CHUNK, status), tl.where(bad, chunk, detail)
    rows = batch * heads
    bad = (status == OK) & ~probe
    bad = bad & ((batch < 1) | (batch > max_batch) | (heads < 1) | (heads > H) | (rows > max_rows))
    status, detail = tl.where(bad, ERR_ROWS, status), tl.where(bad, rows, detail)
    bad = (status == OK) & (mode == MODE_SPARSE) & ((topk < 1) | (topk > max_topk))
    status, detail = tl.where(bad, ERR_TOPK, status), tl.where(bad, topk, detail)
    return status, detail


@triton.jit
def _query(QS, b, h0, heads, stride_qb, stride_qh, BLOCK_H: tl.constexpr, D_LAT: tl.constexpr,
           D_PE: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """``mla.tile._load_query``'s fused-row tiles of token ``b``, heads ``h0 ..``, read past
    L1 (the slot is rewritten by every request)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_h = offs_h < heads
    row = QS + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    q_lat = tl.load(row + tl.arange(0, D_LAT)[None, :], mask=mask_h[:, None], other=0.0,
                    cache_modifier=".cg")  # fmt: skip
    q_pe = tl.load(row + D_LAT + tl.arange(0, D_PE)[None, :], mask=mask_h[:, None], other=0.0,
                   cache_modifier=".cg")  # fmt: skip
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    return q_lat, q_pe, offs_h, mask_h


@triton.jit
def _dense_item(QS, KVL, table_row, tokens, b, h0, split, S, heads, qk_scale, stride_qb,
                stride_qh, stride_kb, stride_kt, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr, D_LAT: tl.constexpr,
                D_PE: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                FP8: tl.constexpr, FP8_RNE: tl.constexpr):  # fmt: skip
    """One dense item: ``mla.decode``'s loop over split ``split`` of ``S`` of the chunk's
    ``tokens`` entries (page ids from ``table_row``), heads ``h0 ..`` of token ``b``.
    ``FP8``: the pool holds FP8 entries (``KVL`` uint8), read by :func:`_attend`."""
    q_lat, q_pe, offs_h, mask_h = _query(
        QS, b, h0, heads, stride_qb, stride_qh, BLOCK_H, D_LAT, D_PE, DOT_FP32
    )
    m, l, acc = _softmax_init(BLOCK_H, D_LAT)
    t_start, t_end = _split_range(tokens, S, split, BLOCK_N, MIN_TILES)
    offs_n = tl.arange(0, BLOCK_N)
    for t0 in tl.range(t_start, t_end, BLOCK_N, num_stages=TILE_STAGES):
        t = t0 + offs_n
        valid = t < t_end
        page = tl.load(table_row + t // PAGE, mask=valid, other=0)
        kv_rows = KVL + page.to(tl.int64) * stride_kb + (t % PAGE) * stride_kt
        m, l, acc = _attend_rows(q_lat, q_pe, kv_rows, kv_rows, valid, m, l, acc, qk_scale,
                                 D_LAT, D_PE, False, DOT_FP32, PRECISION, FP8,
                                 QS.dtype.element_ty, FP8_RNE)  # fmt: skip
    return m, l, acc, offs_h, mask_h


@triton.jit
def _sparse_item(QS, IdxRow, KVL, table_row, tokens, topk, b, h0, split, S, heads, qk_scale,
                 stride_qb, stride_qh, stride_kb, stride_kt, PAGE: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
                 D_LAT: tl.constexpr, D_PE: tl.constexpr, DOT_FP32: tl.constexpr,
                 PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_RNE: tl.constexpr):  # fmt: skip
    """One sparse item: ``mla.sparse``'s loop over split ``split`` of ``S`` of the ``topk``
    chunk-local indices at ``IdxRow`` (the pool row of index ``j`` is the chunk's page
    ``j // PAGE``, entry ``j % PAGE``: the host holder's slot map). An index outside
    ``[-1, tokens)`` is counted in ``nbad`` and never read. ``FP8`` as in
    :func:`_dense_item`."""
    q_lat, q_pe, offs_h, mask_h = _query(
        QS, b, h0, heads, stride_qb, stride_qh, BLOCK_H, D_LAT, D_PE, DOT_FP32
    )
    m, l, acc = _softmax_init(BLOCK_H, D_LAT)
    k_start, k_end = _split_range(topk, S, split, BLOCK_N, MIN_TILES)
    offs_n = tl.arange(0, BLOCK_N)
    nbad = tl.sum(tl.zeros([BLOCK_N], tl.int32), 0)
    for k0 in tl.range(k_start, k_end, BLOCK_N, num_stages=SPARSE_STAGES):
        k = k0 + offs_n
        inside = k < k_end
        j = tl.load(IdxRow + k, mask=inside, other=-1, cache_modifier=".cg")
        nbad += tl.sum((inside & ((j < -1) | (j >= tokens))).to(tl.int32), 0)
        valid = inside & (j >= 0) & (j < tokens)
        j = tl.where(valid, j, 0)
        page = tl.load(table_row + j // PAGE, mask=valid, other=0)
        kv_rows = KVL + page.to(tl.int64) * stride_kb + (j % PAGE) * stride_kt
        m, l, acc = _attend_rows(q_lat, q_pe, kv_rows, kv_rows, valid, m, l, acc, qk_scale,
                                 D_LAT, D_PE, False, DOT_FP32, PRECISION, FP8,
                                 QS.dtype.element_ty, FP8_RNE)  # fmt: skip
    return m, l, acc, offs_h, mask_h, nbad


@triton.jit
def _fold_splits(WsO, WsLse, RepO, RepLse, ws_row, o_base, lse_base, S, heads, H,
                 BLOCK_H: tl.constexpr, D_LAT: tl.constexpr, BF16_RNE: tl.constexpr,
                 h0):  # fmt: skip
    """``merge``'s fold of the ``S`` fp32 split partials of one (token, head block) (workspace
    rows ``ws_row + split``, each ``[H, D_LAT]``) into the reply: the max first, then the
    partials in split order, weights ``exp(lse_i - max)`` (``+inf`` read as empty, an empty
    partial's o never read); ``FOLD_D`` columns at a time (the same arithmetic per element,
    fewer registers beside the attention's)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_h = offs_h < heads
    m = tl.full([BLOCK_H], -float("inf"), tl.float32)
    for i in range(0, S):
        x = tl.load(WsLse + (ws_row + i) * H + offs_h, mask=mask_h, other=-float("inf"),
                    cache_modifier=".cg")  # fmt: skip
        x = tl.where(x == float("inf"), -float("inf"), x)
        m = tl.maximum(m, x)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    for d0 in range(0, D_LAT, FOLD_D):
        offs_d = d0 + tl.arange(0, FOLD_D)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, FOLD_D], tl.float32)
        for i in range(0, S):
            x = tl.load(WsLse + (ws_row + i) * H + offs_h, mask=mask_h, other=-float("inf"),
                        cache_modifier=".cg")  # fmt: skip
            x = tl.where(x == float("inf"), -float("inf"), x)
            e = tl.exp(x - m_safe)
            keep = (e > 0.0) & mask_h
            o_row = ((ws_row + i) * H + offs_h[:, None]).to(tl.int64) * D_LAT
            o = tl.load(WsO + o_row + offs_d[None, :], mask=keep[:, None], other=0.0,
                        cache_modifier=".cg")  # fmt: skip
            l += e
            acc += e[:, None] * o
        nonempty = l != 0.0
        inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l, 1.0), 0.0)
        y = RepO + o_base + offs_h[:, None] * D_LAT + offs_d[None, :]
        out = round_to(acc * inv_l[:, None], RepO.dtype.element_ty, BF16_RNE)
        tl.store(y, out, mask=mask_h[:, None])
        if d0 == 0:
            lse = tl.where(nonempty, m_safe + tl.log(tl.where(nonempty, l, 1.0)), -float("inf"))
            tl.store(RepLse + lse_base + offs_h, lse, mask=mask_h)


@triton.jit
def _store_item(RepO, RepLse, WsO, WsLse, m, l, acc, offs_h, mask_h, s, b, split, S, H,
                max_batch, ws_rows, D_LAT: tl.constexpr, BF16_RNE: tl.constexpr):  # fmt: skip
    """An unsplit item's ``(o, lse)`` into reply slot ``s``'s token ``b``; a split item's fp32
    partial into workspace row ``b * S + split`` of slot ``s``."""
    if S == 1:
        row = _wide(s) * max_batch + b
        _store_partial(RepO, RepLse, row * H * D_LAT, row * H, offs_h, mask_h, D_LAT, 1,
                       m, l, acc, D_LAT, BF16_RNE)  # fmt: skip
    else:
        row = _wide(s) * ws_rows + b * S + split
        _store_partial(WsO, WsLse, row * H * D_LAT, row * H, offs_h, mask_h, D_LAT, 1,
                       m, l, acc, D_LAT, False)  # fmt: skip


@triton.jit
def _splits(SplitsD, SplitsS, dense, chunk, batch, topk, n_chunks, max_batch, sparse_tiles,
            BLOCK_N_S: tl.constexpr):  # fmt: skip
    """The request's split count, from the holder's tables (what the host policy chose for the
    same call); indices clamped, so a bad header reads inside them (and serves nothing)."""
    c = tl.minimum(tl.maximum(chunk, 0), n_chunks - 1)
    bb = tl.minimum(tl.maximum(batch, 0), max_batch)
    t = tl.minimum(tl.maximum(tl.cdiv(topk, BLOCK_N_S), 0), sparse_tiles)
    s_dense = tl.load(SplitsD + c * (max_batch + 1) + bb)
    s_sparse = tl.load(SplitsS + bb * (sparse_tiles + 1) + t)
    return tl.maximum(tl.where(dense, s_dense, s_sparse), 1)


@triton.jit
def _nan_without_finite_lse(InHdr, InIdx, ChunkTokens, RepLse, s, batch, heads, n_chunks, H,
                            max_batch, max_topk, SPARSE: tl.constexpr):  # fmt: skip
    """The host route's rule (``mqnc.serving.batching``, ``wire.stat_of_lse``) on slot ``s``'s
    answered rows ``[batch, heads]`` of ``RepLse [n_slots, max_batch, H]``: a row with keys (a
    dense request: the chunk has entries; sparse: token ``b``'s selection ``InIdx[s, b,
    :topk]`` has an index in ``[0, tokens)``) whose ``lse`` is not finite (every score ``-inf``:
    an overflowing ``q . k``; or a NaN input) gets ``lse = NaN``, never ``-inf``, which the
    merge would read as an empty partial and drop; its ``o`` stays what the tile wrote (the
    host route's too). A row without keys stays empty (``lse = -inf``). The chunk's ``tokens``
    and the selection width are read here again (not kept live across the fold)."""
    hdr = InHdr + _wide(s) * _HW
    chunk = tl.load(hdr + H_CHUNK, cache_modifier=".cg")
    tokens = tl.load(ChunkTokens + tl.minimum(tl.maximum(chunk, 0), n_chunks - 1))
    offs_h = tl.arange(0, SCAN_H)
    for b in range(0, batch):
        if SPARSE:
            topk = tl.load(hdr + H_TOPK, cache_modifier=".cg")
            at = InIdx + (_wide(s) * max_batch + b) * max_topk
            n = tl.sum(tl.zeros([SCAN_K], tl.int32), 0)
            for k0 in range(0, topk, SCAN_K):
                ks = k0 + tl.arange(0, SCAN_K)
                j = tl.load(at + ks, mask=ks < topk, other=-1, cache_modifier=".cg")
                n += tl.sum(((j >= 0) & (j < tokens)).to(tl.int32), 0)
            keyed = n > 0
        else:
            keyed = tokens > 0
        base = (_wide(s) * max_batch + b) * H
        for h0 in range(0, heads, SCAN_H):
            hs = h0 + offs_h
            inside = hs < heads
            x = tl.load(RepLse + base + hs, mask=inside, other=0.0, cache_modifier=".cg")
            # not finite (-inf, +inf, NaN); (a scalar & a block: int32 under the interpreter)
            bad = tl.where(keyed, inside & ((x != x) | (tl.abs(x) == float("inf"))), False)
            tl.store(RepLse + base + hs, tl.full([SCAN_H], float("nan"), tl.float32), mask=bad)


@triton.jit
def _answer(InHdr, InIdx, ChunkTokens, SplitsD, SplitsS, RepSig, RepHdr, RepO, RepLse, Arrive,
            Err, WsO, WsLse, SlotPe, s, sig, seen, n_chunks, layers, H, max_batch, max_rows,
            max_topk, sparse_tiles, ws_rows, D_LAT: tl.constexpr, BLOCK_H_D: tl.constexpr,
            BLOCK_H_S: tl.constexpr, BLOCK_N_S: tl.constexpr, BF16_RNE: tl.constexpr,
            ELT: tl.constexpr, SPARSE: tl.constexpr, NVSHMEM: tl.constexpr,
            SCOPE: tl.constexpr):  # fmt: skip
    """The last arriver's part: the request read again (nothing of it is kept live across the
    items), the index errors the items found, the fold of split partials, the NaN rule
    (:func:`_nan_without_finite_lse`), the reply header, then the reply signal (release; or
    put-with-signal to the slot's PE)."""
    _, _, _, batch, heads, mode, _, _, status, detail, S, _ = _request(
        InHdr, ChunkTokens, SplitsD, SplitsS, s, sig, seen, n_chunks, layers, H, max_batch,
        max_rows, max_topk, sparse_tiles, BLOCK_H_D, BLOCK_H_S, BLOCK_N_S,
    )  # fmt: skip
    err = tl.atomic_xchg(Err + s, 0, sem="acq_rel", scope=SCOPE)
    status, detail = tl.where((status == OK) & (err != 0), err, status), detail
    served = (status == OK) & (mode != MODE_PROBE)
    if served & (S > 1):
        hb = tl.cdiv(heads, BLOCK_H_S) if SPARSE else tl.cdiv(heads, BLOCK_H_D)
        for bh in range(0, batch * hb):
            b = bh // hb
            row = _wide(s) * max_batch + b
            ws_row = _wide(s) * ws_rows + b * S
            hblk = bh - b * hb
            if not SPARSE:
                _fold_splits(WsO, WsLse, RepO, RepLse, ws_row, row * H * D_LAT, row * H, S,
                             heads, H, BLOCK_H_D, D_LAT, BF16_RNE, hblk * BLOCK_H_D)  # fmt: skip
            else:
                _fold_splits(WsO, WsLse, RepO, RepLse, ws_row, row * H * D_LAT, row * H, S,
                             heads, H, BLOCK_H_S, D_LAT, BF16_RNE, hblk * BLOCK_H_S)  # fmt: skip
    if served:
        _nan_without_finite_lse(InHdr, InIdx, ChunkTokens, RepLse, s, batch, heads, n_chunks, H,
                                max_batch, max_topk, SPARSE)  # fmt: skip
    tl.atomic_xchg(Arrive + s, 0, sem="relaxed", scope=SCOPE)
    _publish(RepSig, RepHdr, RepO, RepLse, SlotPe, s, sig, status, detail, served, batch, heads,
             H, max_batch, D_LAT, ELT, NVSHMEM, SCOPE)  # fmt: skip


@triton.jit
def _publish(RepSig, RepHdr, RepO, RepLse, SlotPe, s, sig, status, detail, served, batch, heads,
             H, max_batch, D_LAT: tl.constexpr, ELT: tl.constexpr, NVSHMEM: tl.constexpr,
             SCOPE: tl.constexpr):  # fmt: skip
    """Slot ``s``'s reply made visible, its rows already written: the reply header (sequence
    ``sig``, status, detail, rows ``batch x heads`` and heads when ``served``, else 0), then the
    reply signal raised to ``sig`` (release); on ``NVSHMEM`` the rows, their lse, a fence, then
    the header with a put-with-signal to the slot's PE (and this PE's copy of the signal)."""
    rep = RepHdr + s * _RW
    tl.store(rep + R_SEQ, sig)
    tl.store(rep + R_STATUS, _wide(status))
    tl.store(rep + R_DETAIL, detail.to(tl.int64))
    tl.store(rep + R_ROWS, tl.where(served, batch * heads, 0).to(tl.int64))
    tl.store(rep + R_HEADS, tl.where(served, heads, 0).to(tl.int64))
    tl.debug_barrier()
    if NVSHMEM:
        pe = tl.load(SlotPe + s)
        row = _wide(s) * max_batch
        if served:
            o_at = (RepO + row * H * D_LAT).to(tl.int64)
            lse_at = (RepLse + row * H).to(tl.int64)
            putmem_nbi_block(o_at, o_at, _wide(batch) * H * D_LAT * ELT, pe)
            putmem_nbi_block(lse_at, lse_at, _wide(batch) * H * 4, pe)
        fence()
        rep_at = rep.to(tl.int64)
        nbytes = _wide(0) + _RW * 8
        set_op = tl.full([], 9, tl.int32)  # NVSHMEM_SIGNAL_SET
        putmem_signal_nbi_block(rep_at, rep_at, nbytes, (RepSig + s).to(tl.int64),
                                sig.to(tl.uint64), set_op, pe)  # fmt: skip
        nvshmem_quiet()
        tl.atomic_xchg(RepSig + s, sig, sem="release", scope=SCOPE)  # answered (this PE's copy)
    else:
        tl.atomic_xchg(RepSig + s, sig, sem="release", scope=SCOPE)


@triton.jit
def _request(InHdr, ChunkTokens, SplitsD, SplitsS, s, sig, seen, n_chunks, layers, H, max_batch,
             max_rows, max_topk, sparse_tiles, BLOCK_H_D: tl.constexpr, BLOCK_H_S: tl.constexpr,
             BLOCK_N_S: tl.constexpr):  # fmt: skip
    """Slot ``s``'s request: its header words (read past L1), the chunk's ``c_t``, the
    header's check, its split count and head blocks."""
    hdr = InHdr + _wide(s) * _HW
    seq = tl.load(hdr + H_SEQ, cache_modifier=".cg")
    layer = tl.load(hdr + H_LAYER, cache_modifier=".cg")
    chunk = tl.load(hdr + H_CHUNK, cache_modifier=".cg")
    batch = tl.load(hdr + H_BATCH, cache_modifier=".cg")
    heads = tl.load(hdr + H_HEADS, cache_modifier=".cg")
    mode = tl.load(hdr + H_MODE, cache_modifier=".cg")
    topk = tl.load(hdr + H_TOPK, cache_modifier=".cg")
    tokens = tl.load(ChunkTokens + tl.minimum(tl.maximum(chunk, 0), n_chunks - 1))
    status, detail = _check(seq, sig, seen, mode, layer, chunk, batch, heads, topk, tokens,
                            n_chunks, layers, H, max_batch, max_rows, max_topk)  # fmt: skip
    dense = mode == MODE_DENSE
    S = _splits(SplitsD, SplitsS, dense, chunk, batch, topk, n_chunks, max_batch, sparse_tiles,
                BLOCK_N_S)  # fmt: skip
    hb = tl.where(dense, tl.cdiv(heads, BLOCK_H_D), tl.cdiv(heads, BLOCK_H_S))
    return seq, layer, chunk, batch, heads, mode, topk, tokens, status, detail, S, hb


@triton.jit
def _serve(InHdr, InQ, InIdx, RepSig, RepHdr, RepO, RepLse, Arrive, Err, WsO, WsLse, KV,
           ChunkBlocks, ChunkTokens, SplitsD, SplitsS, SlotPe, s, sig, seen, cta, k, n_chunks,
           layers, H, max_batch, max_rows, max_topk, max_blocks, ws_rows, sparse_tiles, qk_scale,
           stride_kl, stride_kb, stride_kt, PAGE: tl.constexpr, D_LAT: tl.constexpr,
           D_PE: tl.constexpr, BLOCK_H_D: tl.constexpr, BLOCK_N_D: tl.constexpr,
           MIN_TILES_D: tl.constexpr, BLOCK_H_S: tl.constexpr, BLOCK_N_S: tl.constexpr,
           MIN_TILES_S: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
           BF16_RNE: tl.constexpr, ELT: tl.constexpr, SPARSE: tl.constexpr,
           NVSHMEM: tl.constexpr, SCOPE: tl.constexpr, FP8: tl.constexpr,
           FP8_RNE: tl.constexpr):  # fmt: skip
    """This CTA's part of the request signalled ``sig`` on slot ``s``: check its header, run
    its share of the items, arrive; the last to arrive answers (:func:`_answer`)."""
    seq, layer, chunk, batch, heads, mode, topk, tokens, status, detail, S, hb = _request(
        InHdr, ChunkTokens, SplitsD, SplitsS, s, sig, seen, n_chunks, layers, H, max_batch,
        max_rows, max_topk, sparse_tiles, BLOCK_H_D, BLOCK_H_S, BLOCK_N_S,
    )  # fmt: skip
    served = (status == OK) & (mode != MODE_PROBE)
    c = tl.minimum(tl.maximum(chunk, 0), n_chunks - 1)
    n_items = tl.where(served, batch * hb * S, 0).to(tl.int32)
    batch, heads, topk, layer = (
        batch.to(tl.int32),
        heads.to(tl.int32),
        topk.to(tl.int32),
        _wide(layer),
    )
    S, hb = S.to(tl.int32), hb.to(tl.int32)
    QS = InQ + _wide(s) * max_batch * H * (D_LAT + D_PE)
    KVL = KV + tl.where(served, layer, 0) * stride_kl
    table_row = ChunkBlocks + _wide(c) * max_blocks
    for i in range(cta, n_items, k):
        b = i // (hb * S)
        r = i - b * (hb * S)
        split = r % S
        if not SPARSE:
            h0 = (r // S) * BLOCK_H_D
            m, l, acc, offs_h, mask_h = _dense_item(
                QS, KVL, table_row, tokens, b, h0, split, S, heads, qk_scale, H * (D_LAT + D_PE),
                D_LAT + D_PE, stride_kb, stride_kt, PAGE, BLOCK_H_D, BLOCK_N_D, MIN_TILES_D,
                D_LAT, D_PE, DOT_FP32, PRECISION, FP8, FP8_RNE,
            )  # fmt: skip
            _store_item(RepO, RepLse, WsO, WsLse, m, l, acc, offs_h, mask_h, s, b, split, S, H,
                        max_batch, ws_rows, D_LAT, BF16_RNE)  # fmt: skip
        else:
            h0 = (r // S) * BLOCK_H_S
            IdxRow = InIdx + (_wide(s) * max_batch + b) * max_topk
            m, l, acc, offs_h, mask_h, nbad = _sparse_item(
                QS, IdxRow, KVL, table_row, tokens, topk, b, h0, split, S, heads, qk_scale,
                H * (D_LAT + D_PE), D_LAT + D_PE, stride_kb, stride_kt, PAGE, BLOCK_H_S,
                BLOCK_N_S, MIN_TILES_S, D_LAT, D_PE, DOT_FP32, PRECISION, FP8, FP8_RNE,
            )  # fmt: skip
            if nbad > 0:
                tl.atomic_max(Err + s, _wide(0) + ERR_INDEX, sem="relaxed", scope=SCOPE)
            _store_item(RepO, RepLse, WsO, WsLse, m, l, acc, offs_h, mask_h, s, b, split, S, H,
                        max_batch, ws_rows, D_LAT, BF16_RNE)  # fmt: skip
    tl.debug_barrier()
    old = tl.atomic_add(Arrive + s, 1, sem="acq_rel", scope=SCOPE)
    if old == k - 1:
        tl.debug_barrier()
        _answer(InHdr, InIdx, ChunkTokens, SplitsD, SplitsS, RepSig, RepHdr, RepO, RepLse,
                Arrive, Err, WsO, WsLse, SlotPe, s, sig, seen, n_chunks, layers, H, max_batch,
                max_rows, max_topk, sparse_tiles, ws_rows, D_LAT, BLOCK_H_D, BLOCK_H_S, BLOCK_N_S,
                BF16_RNE, ELT, SPARSE, NVSHMEM, SCOPE)  # fmt: skip


_RUNTIME_INTS = [
    "n_slots", "n_chunks", "layers", "H", "max_batch", "max_rows", "max_topk", "max_blocks",
    "ws_rows", "sparse_tiles", "stride_kl", "stride_kb", "stride_kt", "max_idle",
]  # fmt: skip


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def holder_loop_kernel(
    InSig, InHdr, InQ, InIdx, RepSig, RepHdr, RepO, RepLse, Stop, Seen, Arrive, Err, WsO, WsLse,
    KV, ChunkBlocks, ChunkTokens, SplitsD, SplitsS, SlotPe, n_slots, n_chunks, layers, H,
    max_batch, max_rows, max_topk, max_blocks, ws_rows, sparse_tiles, qk_scale, stride_kl,
    stride_kb, stride_kt, max_idle, PAGE: tl.constexpr, D_LAT: tl.constexpr, D_PE: tl.constexpr,
    BLOCK_H_D: tl.constexpr, BLOCK_N_D: tl.constexpr, MIN_TILES_D: tl.constexpr,
    BLOCK_H_S: tl.constexpr, BLOCK_N_S: tl.constexpr, MIN_TILES_S: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BF16_RNE: tl.constexpr, ELT: tl.constexpr,
    SPARSE: tl.constexpr, PERSISTENT: tl.constexpr, NVSHMEM: tl.constexpr, SCOPE: tl.constexpr,
    FP8: tl.constexpr, FP8_RNE: tl.constexpr,
):  # fmt: skip
    """Grid ``(k,)``: CTA ``cta`` polls every slot's signal, serves what it has not seen
    (``Seen [k, n_slots]``, its own row), until the stop word or ``max_idle`` empty polls
    (``PERSISTENT``) or after one pass (one-shot). Tensors as ``mqnc.transport.device_route``
    lays them out (contiguous): inbox ``InSig [n_slots]``, ``InHdr [n_slots, 8]``,
    ``InQ [n_slots, max_batch, H, D_LAT + D_PE]``, ``InIdx [n_slots, max_batch, max_topk]``;
    reply ``RepSig``, ``RepHdr [n_slots, 4]``, ``RepO [n_slots, max_batch, H, D_LAT]``,
    ``RepLse [n_slots, max_batch, H]`` fp32; state ``Stop [1]``, ``Arrive``, ``Err [n_slots]``,
    workspace ``WsO [n_slots, ws_rows, H, D_LAT]`` / ``WsLse [n_slots, ws_rows, H]`` fp32;
    the pool ``KV [layers, blocks, PAGE, D_LAT + D_PE]`` in the queries' dtype, or (``FP8``)
    uint8 ``[layers, blocks, PAGE, 656]`` FP8 entries (``mqnc.model.kv_format``: e4m3 latent,
    one float32 scale per 128 values, bf16 RoPE; strides in bytes), its chunk table
    ``ChunkBlocks [n_chunks, max_blocks]`` / ``ChunkTokens [n_chunks]`` (-1: not hosted) and
    split tables ``SplitsD [n_chunks, max_batch + 1]`` / ``SplitsS [max_batch + 1,
    sparse_tiles + 1]`` int32; ``SlotPe [n_slots]`` the requester PE of each slot."""
    cta = tl.program_id(0)
    k = tl.num_programs(0)
    idle = 0
    go = 1
    while go != 0:
        served = 0
        for s in range(0, n_slots):
            sig = _acquire(InSig + s, SCOPE)
            seen = tl.load(Seen + cta * n_slots + s)
            # new: not seen by this CTA and not answered (a number already answered, by either
            # kernel, is a duplicate for every CTA alike, even one that never saw it)
            answered = tl.load(RepSig + s, cache_modifier=".cg")
            new = (sig != seen) & (sig != answered)
            mine = new
            if new:
                tl.store(Seen + cta * n_slots + s, sig)
                mode = tl.load(InHdr + s * _HW + H_MODE, cache_modifier=".cg")
                if SPARSE:  # the sparse kernel serves sparse requests, the dense one the rest
                    mine = mode == MODE_SPARSE
                else:
                    mine = mode != MODE_SPARSE
            if mine:
                _serve(InHdr, InQ, InIdx, RepSig, RepHdr, RepO, RepLse, Arrive, Err, WsO, WsLse,
                       KV, ChunkBlocks, ChunkTokens, SplitsD, SplitsS, SlotPe, s, sig, seen, cta,
                       k, n_chunks, layers, H, max_batch, max_rows, max_topk, max_blocks,
                       ws_rows, sparse_tiles, qk_scale, stride_kl, stride_kb, stride_kt, PAGE,
                       D_LAT, D_PE, BLOCK_H_D, BLOCK_N_D, MIN_TILES_D, BLOCK_H_S, BLOCK_N_S,
                       MIN_TILES_S, DOT_FP32, PRECISION, BF16_RNE, ELT, SPARSE, NVSHMEM,
                       SCOPE, FP8, FP8_RNE)  # fmt: skip
                served += 1
        if PERSISTENT:
            stop = _acquire(Stop, SCOPE)
            idle = tl.where(served > 0, 0, idle + 1)
            go = tl.where((stop != 0) | (idle >= max_idle), 0, 1)
        else:
            go = 0


# ---- the launch -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HolderTables:
    """What the holder kernel reads besides the slots: its pool and chunk table, its split
    tables and state. ``kv [L, blocks, page, d_qk]`` in the slots' dtype, or uint8
    ``[L, blocks, page, b_KV]`` FP8 entries (``b_KV = 656`` for 512 + 64);
    ``chunk_blocks [n_chunks, max_blocks]`` int32 (a chunk's pool blocks in token order),
    ``chunk_tokens [n_chunks]`` int32 (``c_t``, -1: no chunk with that id);
    ``splits_dense [n_chunks, max_batch + 1]`` and ``splits_sparse [max_batch + 1,
    sparse_tiles + 1]`` int32; ``slot_pe [slots]`` int32;
    ``stop [1]`` int64; ``seen [k, slots]`` int64; ``arrive [slots]`` int32; ``err [slots]``
    int64; workspace ``ws_o [slots, ws_rows, H, d_v]`` / ``ws_lse [slots, ws_rows, H]`` fp32."""

    kv: torch.Tensor
    chunk_blocks: torch.Tensor
    chunk_tokens: torch.Tensor
    splits_dense: torch.Tensor
    splits_sparse: torch.Tensor
    slot_pe: torch.Tensor
    stop: torch.Tensor
    seen: torch.Tensor
    arrive: torch.Tensor
    err: torch.Tensor
    ws_o: torch.Tensor
    ws_lse: torch.Tensor


HOLDER_TILE = TileConfig(16, 32, 8, 3)
"""The holder kernel's tile, dense and sparse, at every head count of a 16-bit cache: 16 heads x
32 entries on 8 warps, the KV loop pipelined 3 deep. Inside the resident kernel (its service
loops' state live beside the attention) the standalone ops' tiles spill under triton 3.6.0: the
dense 16 x 64 by 56-112 B of stack, the 64-head tiles by over 1 KB; this one compiles to 215-221
(dense) and 254-255 (sparse) registers with no spill (``test_compile_sm90``). 16 x 32 is one of
``mla.decode``'s own sweep tiles (``mla.plan.forced_tile`` plans the host ops with it)."""


NVSHMEM_TILE = TileConfig(16, 16, 8, 3)
"""The ``nvshmem`` backend's holder tile, dense and sparse: with NVSHMEM's put code inlined
beside the attention, 16 x 32 spills (sparse 48-88 B under triton 3.6.0, dense 32 B under
3.9.0); 16 x 16 does not (``test_compile_sm90``)."""


_FP8_HOLDER = {(3, 6): TileConfig(16, 16, 8, 3)}
_FP8_HOLDER_ELSE = TileConfig(16, 16, 4, 3)


def fp8_holder_tile() -> TileConfig:
    """The holder tile over an FP8 cache (16-bit queries), dense and sparse, both backends: 16
    heads x 16 entries, on 8 warps under triton 3.6 (the GPU's), 4 under any other. The
    dequantized bf16 tile goes through shared memory beside the uint8 ring (as in
    ``mla.decode``'s FP8 variants), and inside the resident kernel wider tiles spill. Launch-exact
    sm_90 compiles (``test_compile_sm90``), registers dense / sparse, no spill:

    - triton 3.6.0, 16 x 16 on 8 warps: 153-155 / 195-198 (local), 195-206 / 224-236
      (nvshmem); there 16 x 32 spills (8 B at 3 stages, 88 B at 2, 128 B at 1; 280-336 B on
      4 warps) and 16 x 16 on 4 warps too (16 B, sparse);
    - triton 3.9.0, 16 x 16 on 4 warps: 219 / 240 (local), 231-232 / 250 (nvshmem);
      there 16 x 16 on 8 warps spills (dense capped at 128 registers: 16-88 B), 16 x 32 too
      with NVSHMEM's puts (24-64 B).

    The block shape is the same under both, so the answers are; the host ops planned with this
    tile (``forced_tile``) answer as the holder kernel, bit for bit. No GPU has timed it."""
    return _FP8_HOLDER.get(_triton_minor(), _FP8_HOLDER_ELSE)


def holder_tiles(
    heads: int, dtype: torch.dtype, nvshmem: bool = False, fp8: bool = False
) -> tuple[TileConfig, TileConfig]:
    """The dense and sparse tiles the holder kernel runs for ``heads`` heads of ``dtype`` (the
    queries'; an FP8 cache's entries are dequantized to it): :data:`HOLDER_TILE` for 16-bit
    queries over a 16-bit cache (:data:`NVSHMEM_TILE` on the ``nvshmem`` backend),
    the ops' own fp32 tile for fp32; ``fp8`` (16-bit queries over FP8 entries):
    :func:`fp8_holder_tile`. The host ops planned with the same tile (``forced_tile``) compute
    the same partial, bit for bit."""
    if dtype.itemsize == 4:
        return tile_config(heads, dtype=dtype), tile_config(heads, sparse=True, dtype=dtype)
    if fp8:
        tile = fp8_holder_tile()
        return tile, tile
    tile = NVSHMEM_TILE if nvshmem else HOLDER_TILE
    return tile, tile


def holder_loop_launch(
    buf: RouteBuffers,
    tables: HolderTables,
    *,
    softmax_scale: float,
    max_rows: int,
    sparse: bool = False,
    persistent: bool = False,
    max_idle: int = 1 << 30,
    nvshmem_lib: str | None = None,
) -> Launch:
    """The holder kernel's launch on ``k = tables.seen.shape[0]`` CTAs (no checks: the
    device holder built every tensor). ``persistent``: serve until the stop word (or
    ``max_idle`` empty polls); else one-shot. ``sparse``: the kernel that serves sparse
    requests (else the one that serves every other mode; each has its own ``seen``, ``arrive``
    and ``err`` in ``tables``). ``nvshmem_lib``: NVSHMEM's device bitcode (the
    ``nvshmem`` backend: replies put with a signal to ``slot_pe``); None: the ``local``
    backend (replies stored, signal released, in this device's memory). A uint8
    ``tables.kv`` holds FP8 entries: the kernel compiled with ``FP8`` reads them in place."""
    kv = tables.kv
    L, _, page, _ = kv.shape
    d_qk, d_v, qdt = buf.in_q.shape[3], buf.rep_o.shape[3], buf.in_q.dtype
    fp8 = kv.dtype == torch.uint8  # FP8 entries (the device holder's pool checked their width)
    tiles = holder_tiles(buf.heads, qdt, nvshmem=nvshmem_lib is not None, fp8=fp8)
    dense, sparse_tile = tiles
    kwargs = dict(
        PAGE=page,
        D_LAT=d_v,
        D_PE=d_qk - d_v,
        BLOCK_H_D=dense.block_h,
        BLOCK_N_D=dense.block_n,
        MIN_TILES_D=dense.min_tiles,
        BLOCK_H_S=sparse_tile.block_h,
        BLOCK_N_S=sparse_tile.block_n,
        MIN_TILES_S=sparse_tile.min_tiles,
        DOT_FP32=dot_in_fp32(qdt, kv.device),
        PRECISION=dot_precision(qdt),
        BF16_RNE=bf16_rne_in_software(buf.rep_o.dtype, kv.device),
        ELT=buf.rep_o.element_size(),
        SPARSE=bool(sparse),
        PERSISTENT=bool(persistent),
        NVSHMEM=nvshmem_lib is not None,
        SCOPE="sys" if nvshmem_lib is not None else "gpu",
        FP8=fp8,
        FP8_RNE=fp8 and bf16_rne_in_software(qdt, kv.device),
        num_warps=(sparse and tiles[1] or tiles[0]).num_warps,
        num_stages=1 if persistent else 2,
    )
    if nvshmem_lib is not None:
        kwargs["extern_libs"] = {"libnvshmem_device": nvshmem_lib}
    t = tables
    args = (
        buf.in_sig, buf.in_hdr, buf.in_q, buf.in_idx, buf.rep_sig, buf.rep_hdr, buf.rep_o,
        buf.rep_lse, t.stop, t.seen, t.arrive, t.err, t.ws_o, t.ws_lse, kv, t.chunk_blocks,
        t.chunk_tokens, t.splits_dense, t.splits_sparse, t.slot_pe, buf.slots,
        t.chunk_tokens.shape[0], L, buf.heads, buf.max_batch, max_rows, buf.max_topk,
        t.chunk_blocks.shape[1], t.ws_o.shape[1], t.splits_sparse.shape[1] - 1,
        softmax_scale * LOG2E, kv.stride(0), kv.stride(1), kv.stride(2), max_idle,
    )  # fmt: skip
    mode = "persistent" if persistent else "one-shot"
    backend = "nvshmem" if nvshmem_lib is not None else "local"
    return Launch(
        name=f"holder_loop{'-fp8' if fp8 else ''}[{dtype_name(qdt)},"
        f"{'sparse' if sparse else 'dense'},{mode},{backend},k={t.seen.shape[0]}]",
        kernel=holder_loop_kernel,
        grid=(t.seen.shape[0],),
        args=args,
        kwargs=kwargs,
    )
