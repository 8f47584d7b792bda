"""The Gluon (``triton.experimental.gluon``) dense paged MLA decode kernel for sm_90.

Private: imported only by :mod:`mqnc.triton_kernels.mla.gluon` when it launches or
compiles the kernel (never by ``import mqnc``: a triton without Gluon must still import the
package). The schedule, the shared-memory plan and the decisions are written down in
``mla.gluon``'s docstring; the comments here say which line does which step.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

__all__ = ["gluon_mla_decode_kernel", "BLOCK_H", "D_QK", "D_V", "BOX"]

BLOCK_H = gl.constexpr(64)  # query heads per CTA (one M tile of a warpgroup MMA)
D_V = gl.constexpr(512)  # latent (value) width
D_QK = gl.constexpr(576)  # latent + rope
BOX = gl.constexpr(64)  # TMA box: 64 rows x 64 bf16 (128 bytes: one 128-byte swizzle atom)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _load_block(kv_desc, table_row, blk, n, bars, kv_lat, kv_pe, st, BLOCK_N: gl.constexpr):
    """TMA the ``BLOCK_N / 64`` pages of cache block ``blk`` (entries ``blk * BLOCK_N ..``) into
    ring stage ``st``: latent ``kv_lat[st] [BLOCK_N, 512]`` (eight 64 x 64 boxes per page) and
    rope ``kv_pe[st] [BLOCK_N, 64]`` (one box per page), all arriving on ``bars[st]``. A page
    holding no entry below ``n`` (the second page of a row's last 128-entry block) is not looked
    up: the block's first page is loaded again there, its rows past the length, zeroed or
    masked before use."""
    BOX_: gl.constexpr = 64
    PAGES: gl.constexpr = BLOCK_N // BOX_
    bar = bars.index(st)
    lat = kv_lat.index(st)
    pe = kv_pe.index(st)
    mbarrier.expect(bar, PAGES * (D_V // BOX_ + 1) * kv_desc.block_type.nbytes)
    first = gl.load(table_row + blk * PAGES)
    for j in gl.static_range(PAGES):
        if j == 0:
            page = first
        else:
            idx = blk * PAGES + j
            inside = idx * BOX_ < n  # a page holding entries of the row (else never read)
            page = gl.where(inside, gl.load(table_row + idx, mask=inside, other=0), first)
        row = page * BOX_
        lat_j = lat.slice(j * BOX_, BOX_, dim=0)
        for c in gl.static_range(D_V // BOX_):
            tma.async_copy_global_to_shared(
                kv_desc, [row, c * BOX_], bar, lat_j.slice(c * BOX_, BOX_, dim=1)
            )
        tma.async_copy_global_to_shared(kv_desc, [row, D_V], bar, pe.slice(j * BOX_, BOX_, dim=0))


@gluon.jit
def _zero_tail(lat, valid, BLOCK_N: gl.constexpr):
    """Zero the value rows ``>= valid`` of a stage's latent tile (entries past the row's length
    in its last page may hold anything, NaN included; ``P = 0`` times NaN would be NaN), one
    64-column box at a time through registers. Runs once per split at most (its last block)."""
    BOX_: gl.constexpr = 64
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, layout))
    keep = (rows < valid)[:, None]
    for c in gl.static_range(D_V // BOX_):
        box = lat.slice(c * BOX_, BOX_, dim=1)
        x = box.load(layout)
        box.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _softmax_step(s, t, n, m_i, qk_scale, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Online softmax over one block's scores ``s [64, BLOCK_N]`` (fp32, entries ``t ..``):
    base-2 scores, entries ``>= n`` masked; returns ``(p, alpha, m_new)``."""
    offs_n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    s = gl.where(((t + offs_n) < n)[None, :], s * qk_scale, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_shift = gl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_shift)
    p = gl.exp2(s - m_shift[:, None])
    return p, alpha, m_new


@constexpr_function
def _n_split_layout(n):
    """The ``[64, n]`` wgmma accumulator layout of 8 warps, the two warpgroups side by side on
    N (``warps_per_cta [4, 2]``): each warpgroup computes its own ``n / 2`` columns."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, n // 2, 16]
    )


@gluon.jit
def _init_state(s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """The running max (``-inf``), denominator and accumulator (0), and a zero score tile."""
    m_i = gl.full([64], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([64, D_V], gl.float32, o_layout)
    return m_i, l_i, acc, gl.zeros([64, BLOCK_N], gl.float32, s_layout)


@gluon.jit
def _row_range(
    LENS,
    H,
    n_blocks_row,
    num_splits,
    S_Q: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """This CTA's query row ``r``, first head ``h0``, sequence, attended length ``n``, split,
    first block ``blk0`` and block count: split ``split`` of ``num_splits`` takes
    ``ceil(ceil(n / BLOCK_N) / num_splits)`` blocks (``mla.decode``'s rule)."""
    head_blocks = gl.cdiv(H, 64)
    pid = gl.program_id(0)
    split = gl.program_id(1)
    r = pid // head_blocks
    h0 = (pid % head_blocks) * 64
    seq = r // S_Q
    n = gl.load(LENS + seq)
    if CAUSAL:
        n = gl.maximum(n - S_Q + (r % S_Q) + 1, 0)
    n = gl.minimum(n, n_blocks_row * 64)  # (checked on the host unless check_inputs=False)
    per_split = gl.maximum(gl.cdiv(gl.cdiv(n, BLOCK_N), num_splits), 1)
    blk0 = split * per_split
    t_end = gl.minimum((blk0 + per_split) * BLOCK_N, n)
    n_iter = gl.maximum(gl.cdiv(t_end - blk0 * BLOCK_N, BLOCK_N), 0)
    return r, h0, seq, n, split, blk0, n_iter


@gluon.jit
def _load_query(q_desc, q_row, bar, q_lat, q_pe):
    """TMA the 64 heads' rows ``[64, 576]`` of Q: eight latent boxes and one rope box."""
    mbarrier.expect(bar, (D_V // BOX + 1) * q_desc.block_type.nbytes)
    for c in gl.static_range(D_V // BOX):
        tma.async_copy_global_to_shared(
            q_desc, [q_row, c * BOX], bar, q_lat.slice(c * BOX, BOX, dim=1)
        )
    tma.async_copy_global_to_shared(q_desc, [q_row, D_V], bar, q_pe)


@gluon.jit
def _pv_step(p, alpha, l_i, acc, lat, pe, t, n, smem: gl.constexpr, BLOCK_N: gl.constexpr):
    """``P`` (bf16) over the stage's rope tile, the tail's value rows zeroed, then
    ``acc += P V`` (async; the row sum updated while it runs) and the wait for it."""
    gl.thread_barrier()  # both warpgroups' QK^T have read the rope tile P overwrites
    p_smem = pe._reinterpret(gl.bfloat16, [64, BLOCK_N], smem)
    p_smem.store(p.to(gl.bfloat16))
    if t + BLOCK_N > n:
        _zero_tail(lat, n - t, BLOCK_N)
    fence_async_shared()
    gl.thread_barrier()  # P (both halves) and the zeroed tail visible to both warpgroups
    acc = warpgroup_mma(p_smem, lat, acc, is_async=True)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    gl.thread_barrier()  # both warpgroups' PV done: this stage may be refilled
    return l_i, acc


@gluon.jit
def _store_outputs(o_base, lse_base, acc, m_i, l_i, h0, H, so_h, sl_h, row_s, o_layout):
    """``o = acc / l`` in O's dtype and ``lse = (m + log2 l) ln 2`` (natural log) for heads
    ``< H``; an empty split writes ``o = 0, lse = -inf``."""
    nonempty = l_i != 0.0
    inv_l = gl.where(nonempty, 1.0 / gl.where(nonempty, l_i, 1.0), 0.0)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    o = acc * gl.convert_layout(inv_l, row_o)[:, None]
    offs_h = h0 + gl.arange(0, 64, row_o)
    offs_d = gl.arange(0, D_V, gl.SliceLayout(0, o_layout))
    o_ptrs = o_base + offs_h[:, None] * so_h + offs_d[None, :]
    gl.store(o_ptrs, o.to(o_base.dtype.element_ty), mask=(offs_h < H)[:, None])
    lse = gl.where(nonempty, (m_i + gl.log2(gl.where(nonempty, l_i, 1.0))) * LN2, -float("inf"))
    offs_hs = h0 + gl.arange(0, 64, row_s)
    gl.store(lse_base + offs_hs * sl_h, lse, mask=offs_hs < H)


@gluon.jit
def gluon_mla_decode_kernel(
    q_desc,
    kv_desc,
    TABLE,
    LENS,
    O,
    LSE,
    H,
    n_blocks_row,
    stride_tb,
    num_splits,
    stride_os,
    stride_ob,
    stride_oh,
    stride_ls,
    stride_lb,
    stride_lh,
    qk_scale,
    S_Q: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """One CTA: 64 heads of query row ``pid0 // ceil(H / 64)`` over split ``pid1`` of its
    cache, 8 warps = two warpgroups side by side on N (``warps_per_cta [4, 2]``)."""
    # Two warpgroups split N: QK^T's BLOCK_N entries (each its own BLOCK_N / 2) and PV's 512
    # output columns (each its own 256), so no warpgroup recomputes the other's product.
    s_layout: gl.constexpr = _n_split_layout(BLOCK_N)
    o_layout: gl.constexpr = _n_split_layout(D_V)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    smem: gl.constexpr = q_desc.layout

    r, h0, seq, n, split, blk0, n_iter = _row_range(
        LENS, H, n_blocks_row, num_splits, S_Q, CAUSAL, BLOCK_N
    )

    # Shared memory: Q (64 x 576) + STAGES ring stages of BLOCK_N cache entries (latent and
    # rope apart: 576 is no power of two). P reuses the stage's rope tile once QK^T read it.
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [64, D_V], smem)
    q_pe = gl.allocate_shared_memory(gl.bfloat16, [64, BOX], smem)
    kv_lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D_V], smem)
    kv_pe = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BOX], smem)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(STAGES + 1):
        mbarrier.init(bars.index(k), count=1)

    _load_query(q_desc, r * H + h0, bars.index(STAGES), q_lat, q_pe)
    table_row = TABLE + seq.to(gl.int64) * stride_tb
    if n_iter > 0:
        _load_block(kv_desc, table_row, blk0, n, bars, kv_lat, kv_pe, 0, BLOCK_N)
    mbarrier.wait(bars.index(STAGES), 0)

    m_i, l_i, acc, s_zero = _init_state(s_layout, o_layout, BLOCK_N)
    for i in range(n_iter):
        stage = i % STAGES
        t = (blk0 + i) * BLOCK_N
        lat = kv_lat.index(stage)
        pe = kv_pe.index(stage)
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        # QK^T: latent (K = 512) and rope (K = 64) products, async
        s = warpgroup_mma(q_lat, lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_pe, pe.permute((1, 0)), s, is_async=True)
        if STAGES > 1:
            if i + 1 < n_iter:  # prefetch the next block while QK^T runs (its stage is free)
                nxt = (i + 1) % STAGES
                _load_block(
                    kv_desc,
                    table_row,
                    blk0 + i + 1,
                    n,
                    bars,
                    kv_lat,
                    kv_pe,
                    nxt,
                    BLOCK_N,
                )
        s = warpgroup_mma_wait(0, deps=(s,))
        p, alpha, m_i = _softmax_step(s, t, n, m_i, qk_scale, s_layout, BLOCK_N)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        l_i, acc = _pv_step(p, alpha, l_i, acc, lat, pe, t, n, smem, BLOCK_N)
        if STAGES == 1:
            if i + 1 < n_iter:
                _load_block(kv_desc, table_row, blk0 + i + 1, n, bars, kv_lat, kv_pe, 0, BLOCK_N)
    for k in gl.static_range(STAGES + 1):
        mbarrier.invalidate(bars.index(k))

    o_base = O + split.to(gl.int64) * stride_os + r.to(gl.int64) * stride_ob
    lse_base = LSE + split.to(gl.int64) * stride_ls + r.to(gl.int64) * stride_lb
    _store_outputs(o_base, lse_base, acc, m_i, l_i, h0, H, stride_oh, stride_lh, row_s, o_layout)


# ---- the see-saw schedule: warp-specialized (two consumer warpgroups and a TMA warp) ----------
# Pages are paired: page A = 2k of a split's pages (warpgroup 0's QK^T and softmax), page B =
# 2k + 1 (warpgroup 1's), in buffers 0 and 1. ``bars``: 0 Q ready; 1 / 2 buffer 0 / 1 free (one
# arrival from each consumer); 3 A's P, max and sum published; 4 B's. ``boxes``: buffer b's box c
# landed (TMA bytes) at ``9 b + c``. ``stats`` rows: 0 A's max, 1 A's row sum, 2 the pair's max
# (B's), 3 B's row sum.


@constexpr_function
def _wg_layout(n):
    """The ``[64, n]`` wgmma accumulator layout of one warpgroup (4 warps)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _opaque_zero(k):
    """0, computed from ``k`` so the compiler cannot hoist what it indexes out of the loop:
    the wgmma descriptors of a fixed buffer would otherwise be hoisted, 72 of them held (and
    spilled) across the loop."""
    return gl.inline_asm_elementwise(
        "mov.u32 $0, 0;", "=r,r", [k], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _ss_loader(q_desc, kv_desc, TABLE, LENS, H, n_blocks_row, stride_tb, num_splits, q_lat, q_pe,
               kv_lat, kv_pe, bars, boxes, stats, O, LSE, o_strides, l_strides, qk_scale,
               S_Q: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """The TMA warp: Q once, then page ``i`` of the split into buffer ``i % 2`` as soon as both
    consumers have released that buffer's previous page."""
    r, h0, seq, n, split, blk0, n_iter = _row_range(
        LENS, H, n_blocks_row, num_splits, S_Q, CAUSAL, 64
    )
    _load_query(q_desc, r * H + h0, bars.index(0), q_lat.index(0), q_pe.index(0))
    table_row = TABLE + seq.to(gl.int64) * stride_tb
    for i in range(n_iter):
        buf = i % 2
        mbarrier.wait(bars.index(1 + buf), ((i // 2) & 1) ^ 1)  # (a fresh barrier passes)
        row = gl.load(table_row + blk0 + i) * BOX
        for c in gl.static_range(D_V // BOX + 1):  # one barrier per box: QK^T starts on box 0
            ready = boxes.index(buf * 9 + c)
            mbarrier.expect(ready, kv_desc.block_type.nbytes)
            if c < D_V // BOX:
                dst = kv_lat.index(buf).slice(c * BOX, BOX, dim=1)
            else:
                dst = kv_pe.index(buf)
            tma.async_copy_global_to_shared(kv_desc, [row, c * BOX], ready, dst)


@gluon.jit
def _ss_scores(q_lat, q_pe, lat, pe, boxes, buf, phase, t, n, qk_scale, s_layout: gl.constexpr):
    """One warpgroup's own page: ``QK^T [64, 64]`` box by box as each 64 x 64 box lands (nine
    async wgmma groups, K = 64 each, then waited), in base 2, entries ``>= n`` masked."""
    s = gl.zeros([64, 64], gl.float32, s_layout)
    for c in gl.static_range(D_V // BOX):
        mbarrier.wait(boxes.index(buf * 9 + c), phase)
        q_c = q_lat.slice(c * BOX, BOX, dim=1)
        k_c = lat.slice(c * BOX, BOX, dim=1).permute((1, 0))
        s = warpgroup_mma(q_c, k_c, s, use_acc=c > 0, is_async=True)
    mbarrier.wait(boxes.index(buf * 9 + D_V // BOX), phase)
    s = warpgroup_mma(q_pe, pe.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    offs = t + gl.arange(0, 64, gl.SliceLayout(0, s_layout))
    return gl.where((offs < n)[None, :], s * qk_scale, -float("inf"))


@gluon.jit
def _ss_zero_tail(lat, valid):
    """Zero the value rows ``>= valid`` of a page (one warpgroup; padding may hold NaN)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    keep = (gl.arange(0, 64, gl.SliceLayout(1, layout)) < valid)[:, None]
    for c in gl.static_range(D_V // BOX):
        box = lat.slice(c * BOX, BOX, dim=1)
        x = box.load(layout)
        box.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _ss_publish(p, m, p_sum, pe, stats, row: gl.constexpr, lat, t, n, bar):
    """Publish a page's ``P`` (bf16, over its rope tile, read by ``QK^T`` already), its row max
    and row sum (``stats`` rows ``row``, ``row + 1``), its tail zeroed; then signal ``bar``."""
    pe.store(p.to(gl.bfloat16))
    stats.index(row).store(m)
    stats.index(row + 1).store(p_sum)
    if t + 64 > n:
        _ss_zero_tail(lat, n - t)
    fence_async_shared()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _ss_pv(acc, p_smem, lat, HALF: gl.constexpr):
    """``acc += P V[:, 256 HALF ..]``: this warpgroup's 256 output columns of a page, waited."""
    acc = warpgroup_mma(p_smem, lat.slice(HALF * 256, 256, dim=1), acc, is_async=True)
    return warpgroup_mma_wait(0, deps=(acc,))


@gluon.jit
def _ss_store(acc, m_i, l_i, O, LSE, r, h0, H, split, o_strides, l_strides,
              HALF: gl.constexpr, o_layout: gl.constexpr, row_s: gl.constexpr):  # fmt: skip
    """This warpgroup's 256 columns of ``o = acc / l``; warpgroup 0 also writes the natural-log
    ``lse``. An empty split writes ``o = 0, lse = -inf``."""
    so_s, so_b, so_h = o_strides
    sl_s, sl_b, sl_h = l_strides
    nonempty = l_i != 0.0
    inv_l = gl.where(nonempty, 1.0 / gl.where(nonempty, l_i, 1.0), 0.0)
    o = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))[:, None]
    offs_h = h0 + gl.arange(0, 64, gl.SliceLayout(1, o_layout))
    offs_d = HALF * 256 + gl.arange(0, 256, gl.SliceLayout(0, o_layout))
    o_base = O + split.to(gl.int64) * so_s + r.to(gl.int64) * so_b
    o_ptrs = o_base + offs_h[:, None] * so_h + offs_d[None, :]
    gl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(offs_h < H)[:, None])
    if HALF == 0:
        lse = gl.where(nonempty, (m_i + gl.log2(gl.where(nonempty, l_i, 1.0))) * LN2, -float("inf"))
        offs_hs = h0 + gl.arange(0, 64, row_s)
        lse_base = LSE + split.to(gl.int64) * sl_s + r.to(gl.int64) * sl_b
        gl.store(lse_base + offs_hs * sl_h, lse, mask=offs_hs < H)


@gluon.jit
def _ss_first(q_desc, kv_desc, TABLE, LENS, H, n_blocks_row, stride_tb, num_splits, q_lat, q_pe,
              kv_lat, kv_pe, bars, boxes, stats, O, LSE, o_strides, l_strides, qk_scale,
              S_Q: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """Warpgroup 0: ``QK^T`` and softmax of each pair's page A, output columns 0..255: rescale,
    ``P_A V_A``, then (B's max and ``P_B`` published) rescale again and ``P_B V_B``."""
    s_layout: gl.constexpr = _wg_layout(64)
    o_layout: gl.constexpr = _wg_layout(256)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    r, h0, seq, n, split, blk0, n_iter = _row_range(
        LENS, H, n_blocks_row, num_splits, S_Q, CAUSAL, 64
    )
    m_i = gl.full([64], -float("inf"), gl.float32, row_s)
    l_i = gl.zeros([64], gl.float32, row_s)
    acc = gl.zeros([64, 256], gl.float32, o_layout)
    mbarrier.wait(bars.index(0), 0)
    for k in range(gl.cdiv(n_iter, 2)):
        t = (blk0 + 2 * k) * 64
        z = _opaque_zero(k)
        lat_a, pe_a, lat_b, pe_b = (
            kv_lat.index(z),
            kv_pe.index(z),
            kv_lat.index(z + 1),
            kv_pe.index(z + 1),
        )
        s = _ss_scores(
            q_lat.index(z), q_pe.index(z), lat_a, pe_a, boxes, z, k & 1, t, n, qk_scale, s_layout
        )
        m_a = gl.maximum(m_i, gl.max(s, 1))
        m_sa = gl.where(m_a == -float("inf"), 0.0, m_a)
        p = gl.exp2(s - m_sa[:, None])
        alpha = gl.exp2(m_i - m_sa)
        p_sum = gl.sum(p, 1)
        _ss_publish(p, m_a, p_sum, pe_a, stats, 0, lat_a, t, n, bars.index(3))
        acc = _ss_pv(acc * gl.convert_layout(alpha, row_o)[:, None], pe_a, lat_a, 0)
        mbarrier.arrive(bars.index(1), count=1)  # page A's left half and P_A read
        mbarrier.wait(bars.index(4), k & 1)  # the pair's max, B's row sum and P_B
        m_i = stats.index(2).load(row_s)
        beta = gl.exp2(m_sa - gl.where(m_i == -float("inf"), 0.0, m_i))
        l_i = (l_i * alpha + p_sum) * beta + stats.index(3).load(row_s)
        acc = acc * gl.convert_layout(beta, row_o)[:, None]
        if 2 * k + 1 < n_iter:
            acc = _ss_pv(acc, pe_b, lat_b, 0)
            mbarrier.arrive(bars.index(2), count=1)  # page B's left half and P_B read
    _ss_store(acc, m_i, l_i, O, LSE, r, h0, H, split, o_strides, l_strides, 0, o_layout, row_s)


@gluon.jit
def _ss_second(q_desc, kv_desc, TABLE, LENS, H, n_blocks_row, stride_tb, num_splits, q_lat, q_pe,
               kv_lat, kv_pe, bars, boxes, stats, O, LSE, o_strides, l_strides, qk_scale,
               S_Q: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """Warpgroup 1: ``QK^T`` of each pair's page B (under warpgroup 0's softmax), then, A's max
    published, the pair's max and ``P_B``; output columns 256..511 over both pages."""
    s_layout: gl.constexpr = _wg_layout(64)
    o_layout: gl.constexpr = _wg_layout(256)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    r, h0, seq, n, split, blk0, n_iter = _row_range(
        LENS, H, n_blocks_row, num_splits, S_Q, CAUSAL, 64
    )
    m_i = gl.full([64], -float("inf"), gl.float32, row_s)
    l_i = gl.zeros([64], gl.float32, row_s)
    acc = gl.zeros([64, 256], gl.float32, o_layout)
    mbarrier.wait(bars.index(0), 0)
    for k in range(gl.cdiv(n_iter, 2)):
        t = (blk0 + 2 * k + 1) * 64
        has_b = 2 * k + 1 < n_iter
        z = _opaque_zero(k)
        lat_a, pe_a, lat_b, pe_b = (
            kv_lat.index(z),
            kv_pe.index(z),
            kv_lat.index(z + 1),
            kv_pe.index(z + 1),
        )
        s = gl.full([64, 64], -float("inf"), gl.float32, s_layout)  # (no page B: nothing)
        if has_b:
            s = _ss_scores(
                q_lat.index(z),
                q_pe.index(z),
                lat_b,
                pe_b,
                boxes,
                z + 1,
                k & 1,
                t,
                n,
                qk_scale,
                s_layout,
            )
        mbarrier.wait(bars.index(3), k & 1)  # A's max, row sum and P_A
        m_a = stats.index(0).load(row_s)
        m_sa = gl.where(m_a == -float("inf"), 0.0, m_a)
        alpha = gl.exp2(m_i - m_sa)
        # P_A V_A (its right half) runs while this warpgroup's softmax of page B does
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(pe_a, lat_a.slice(256, 256, dim=1), acc, is_async=True)
        m_b = gl.maximum(m_a, gl.max(s, 1))
        m_sb = gl.where(m_b == -float("inf"), 0.0, m_b)
        p = gl.exp2(s - m_sb[:, None])
        beta = gl.exp2(m_sa - m_sb)
        p_sum = gl.sum(p, 1)
        l_i = (l_i * alpha + stats.index(1).load(row_s)) * beta + p_sum
        m_i = m_b
        if has_b:
            _ss_publish(p, m_b, p_sum, pe_b, stats, 2, lat_b, t, n, bars.index(4))
        else:
            stats.index(2).store(m_b)
            stats.index(3).store(p_sum)
            mbarrier.arrive(bars.index(4), count=1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(bars.index(1), count=1)  # page A's right half and P_A read
        acc = acc * gl.convert_layout(beta, row_o)[:, None]
        if has_b:
            acc = _ss_pv(acc, pe_b, lat_b, 1)
            mbarrier.arrive(bars.index(2), count=1)
    _ss_store(acc, m_i, l_i, O, LSE, r, h0, H, split, o_strides, l_strides, 1, o_layout, row_s)


@gluon.jit
def gluon_mla_seesaw_kernel(
    q_desc,
    kv_desc,
    TABLE,
    LENS,
    O,
    LSE,
    H,
    n_blocks_row,
    stride_tb,
    num_splits,
    stride_os,
    stride_ob,
    stride_oh,
    stride_ls,
    stride_lb,
    stride_lh,
    qk_scale,
    S_Q: gl.constexpr,
    CAUSAL: gl.constexpr,
    num_warps: gl.constexpr,
):
    """FlashMLA's see-saw on 64 heads of one query row and one split: warpgroup 0 (the default
    partition, ``num_warps`` 4) and warpgroup 1 (a 4-warp worker) each compute ``QK^T`` for
    their own page of a pair and half the output columns over both pages, exchanging the row
    max, row sums and ``P`` through shared memory; a one-warp worker issues the TMA loads."""
    smem: gl.constexpr = q_desc.layout
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [1, 64, D_V], smem)
    q_pe = gl.allocate_shared_memory(gl.bfloat16, [1, 64, BOX], smem)
    kv_lat = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D_V], smem)
    kv_pe = gl.allocate_shared_memory(gl.bfloat16, [2, 64, BOX], smem)
    stats = gl.allocate_shared_memory(gl.float32, [4, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(5):
        mbarrier.init(bars.index(i), count=2 if i == 1 or i == 2 else 1)
    boxes = gl.allocate_shared_memory(gl.int64, [18, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(18):
        mbarrier.init(boxes.index(i), count=1)
    o_strides = (stride_os, stride_ob, stride_oh)
    l_strides = (stride_ls, stride_lb, stride_lh)
    args = (
        q_desc,
        kv_desc,
        TABLE,
        LENS,
        H,
        n_blocks_row,
        stride_tb,
        num_splits,
        q_lat,
        q_pe,
        kv_lat,
        kv_pe,
        bars,
        boxes,
        stats,
        O,
        LSE,
        o_strides,
        l_strides,
        qk_scale,
        S_Q,
        CAUSAL,
    )
    gl.warp_specialize(
        [(_ss_first, args), (_ss_second, args), (_ss_loader, args)], [4, 1], [240, 24]
    )


# ---- the see-saw over a split cache (FlashInfer's ckv / kpe): opt-in until a GPU verifies it --


@gluon.jit
def _ss_loader_split(q_desc, kv_desc, TABLE, LENS, H, n_blocks_row, stride_tb, num_splits, q_lat,
                     q_pe, kv_lat, kv_pe, bars, boxes, stats, O, LSE, o_strides, l_strides,
                     qk_scale, S_Q: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """``_ss_loader`` over a split cache: ``kv_desc`` is the pair ``(ckv_desc, kpe_desc)``, the
    eight latent boxes of a page from the first (``[pages x 64, 512]``), its rope box from the
    second (``[pages x 64, 64]``), each box on its own mbarrier as there."""
    ckv_desc, kpe_desc = kv_desc
    r, h0, seq, n, split, blk0, n_iter = _row_range(
        LENS, H, n_blocks_row, num_splits, S_Q, CAUSAL, 64
    )
    _load_query(q_desc, r * H + h0, bars.index(0), q_lat.index(0), q_pe.index(0))
    table_row = TABLE + seq.to(gl.int64) * stride_tb
    for i in range(n_iter):
        buf = i % 2
        mbarrier.wait(bars.index(1 + buf), ((i // 2) & 1) ^ 1)  # (a fresh barrier passes)
        row = gl.load(table_row + blk0 + i) * BOX
        for c in gl.static_range(D_V // BOX):
            ready = boxes.index(buf * 9 + c)
            mbarrier.expect(ready, ckv_desc.block_type.nbytes)
            dst = kv_lat.index(buf).slice(c * BOX, BOX, dim=1)
            tma.async_copy_global_to_shared(ckv_desc, [row, c * BOX], ready, dst)
        ready = boxes.index(buf * 9 + D_V // BOX)
        mbarrier.expect(ready, kpe_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kpe_desc, [row, 0], ready, kv_pe.index(buf))


@gluon.jit
def gluon_mla_seesaw_split_kernel(
    q_desc,
    ckv_desc,
    kpe_desc,
    TABLE,
    LENS,
    O,
    LSE,
    H,
    n_blocks_row,
    stride_tb,
    num_splits,
    stride_os,
    stride_ob,
    stride_oh,
    stride_ls,
    stride_lb,
    stride_lh,
    qk_scale,
    S_Q: gl.constexpr,
    CAUSAL: gl.constexpr,
    num_warps: gl.constexpr,
):
    """:func:`gluon_mla_seesaw_kernel` over FlashInfer's split cache: the same consumers
    (``_ss_first``, ``_ss_second``: the same shared memory, barriers and arithmetic), the TMA
    warp reading latent and rope boxes from their own descriptors (``_ss_loader_split``). Its
    body repeats the see-saw kernel's set-up rather than sharing a helper with it: the see-saw's
    device code is the code its GPU evidence verified (``mqnc.triton_kernels.evidence``), so it
    changes only with a new GPU record."""
    smem: gl.constexpr = q_desc.layout
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [1, 64, D_V], smem)
    q_pe = gl.allocate_shared_memory(gl.bfloat16, [1, 64, BOX], smem)
    kv_lat = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D_V], smem)
    kv_pe = gl.allocate_shared_memory(gl.bfloat16, [2, 64, BOX], smem)
    stats = gl.allocate_shared_memory(gl.float32, [4, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(5):
        mbarrier.init(bars.index(i), count=2 if i == 1 or i == 2 else 1)
    boxes = gl.allocate_shared_memory(gl.int64, [18, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(18):
        mbarrier.init(boxes.index(i), count=1)
    args = (
        q_desc,
        (ckv_desc, kpe_desc),
        TABLE,
        LENS,
        H,
        n_blocks_row,
        stride_tb,
        num_splits,
        q_lat,
        q_pe,
        kv_lat,
        kv_pe,
        bars,
        boxes,
        stats,
        O,
        LSE,
        (stride_os, stride_ob, stride_oh),
        (stride_ls, stride_lb, stride_lh),
        qk_scale,
        S_Q,
        CAUSAL,
    )
    gl.warp_specialize(
        [(_ss_first, args), (_ss_second, args), (_ss_loader_split, args)], [4, 1], [240, 24]
    )


# ---- the see-saw over a top-k selection: opt-in until a GPU verifies it ---------------------
# Hopper's TMA has no gather: a 4-warp warpgroup gathers the selected entries into the same
# buffers with cp.async, 16 bytes a thread a copy, each box's copies tracked by its mbarrier
# (``cp.async.mbarrier.arrive``, one arrival per gathering thread). The plan compacts each row's
# selection first (valid indices to the front, their count as the row's length), so the
# consumers are the dense see-saw's, unchanged: a block of 64 selected entries is a page.

GATHER_WARPS = gl.constexpr(4)


@gluon.jit
def _gather_query(q_desc, r, h0, H, q_lat, q_pe, bar):
    """Q's 64 head rows ``h0 ..`` of query row ``r`` (``q_desc``: the query's base, its token
    and head strides) by cp.async into ``q_lat`` / ``q_pe``, head rows past ``H`` zero-filled;
    ``bar`` arrived on by each gathering thread once its copies land."""
    Q, stride_qr, stride_qh = q_desc
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [GATHER_WARPS, 1], [1, 0])
    cols = gl.arange(0, BOX, gl.SliceLayout(0, layout))[None, :]
    heads = h0 + gl.arange(0, 64, gl.SliceLayout(1, layout))
    q_rows = Q + r.to(gl.int64) * stride_qr + heads.to(gl.int64)[:, None] * stride_qh + cols
    live = (heads < H)[:, None]
    for c in gl.static_range(D_V // BOX):
        dst = q_lat.index(0).slice(c * BOX, BOX, dim=1)
        async_copy.async_copy_global_to_shared(dst, q_rows + c * BOX, mask=live)
    async_copy.async_copy_global_to_shared(q_pe.index(0), q_rows + D_V, mask=live)
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _sp_gather(q_desc, kv_desc, TABLE, LENS, H, n_blocks_row, stride_tb, num_splits, q_lat, q_pe,
               kv_lat, kv_pe, bars, boxes, stats, O, LSE, o_strides, l_strides, qk_scale,
               S_Q: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """The gather warpgroup: Q's 64 head rows (``q_desc``: the query's base, its token and head
    strides), then block ``i`` of the split's compacted selection (``TABLE``: a row's valid
    indices first, ``LENS`` their count; ``kv_desc``: the pool's base and entry stride) into
    buffer ``i % 2`` as soon as both consumers have released it; rows past the count (and head
    rows past ``H``) are zero-filled, never read."""
    KV, stride_e = kv_desc
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [GATHER_WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols = gl.arange(0, BOX, gl.SliceLayout(0, layout))[None, :]
    r, h0, seq, n, split, blk0, n_iter = _row_range(
        LENS, H, n_blocks_row, num_splits, S_Q, CAUSAL, 64
    )
    _gather_query(q_desc, r, h0, H, q_lat, q_pe, bars.index(0))
    table_row = TABLE + seq.to(gl.int64) * stride_tb
    for i in range(n_iter):
        buf = i % 2
        mbarrier.wait(bars.index(1 + buf), ((i // 2) & 1) ^ 1)  # (a fresh barrier passes)
        pos = (blk0 + i) * 64 + gl.arange(0, 64, rows_l)
        valid = pos < n
        idx = gl.load(table_row + pos, mask=valid, other=0)
        entry = KV + idx.to(gl.int64)[:, None] * stride_e + cols
        for c in gl.static_range(D_V // BOX):
            dst = kv_lat.index(buf).slice(c * BOX, BOX, dim=1)
            async_copy.async_copy_global_to_shared(dst, entry + c * BOX, mask=valid[:, None])
            async_copy.mbarrier_arrive(boxes.index(buf * 9 + c), increment_count=False)
        async_copy.async_copy_global_to_shared(kv_pe.index(buf), entry + D_V, mask=valid[:, None])
        async_copy.mbarrier_arrive(boxes.index(buf * 9 + D_V // BOX), increment_count=False)


@gluon.jit
def gluon_mla_sparse_seesaw_kernel(
    Q,
    KV,
    TABLE,
    LENS,
    O,
    LSE,
    H,
    n_blocks_row,
    stride_tb,
    num_splits,
    stride_qr,
    stride_qh,
    stride_e,
    stride_os,
    stride_ob,
    stride_oh,
    stride_ls,
    stride_lb,
    stride_lh,
    qk_scale,
    S_Q: gl.constexpr,
    CAUSAL: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The see-saw over a compacted top-k selection (``TABLE [B, n_blocks_row x 64]`` int32:
    each query row's valid indices into the pool's flattened entries first, ``LENS [B]`` their
    count): the dense see-saw's consumers (``_ss_first``, ``_ss_second``) and shared memory, a
    gathering warpgroup (``_sp_gather``) in place of the TMA warp. The set-up repeats the
    see-saw kernel's (its device code is what its GPU evidence verified)."""
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [1, 64, D_V], smem)
    q_pe = gl.allocate_shared_memory(gl.bfloat16, [1, 64, BOX], smem)
    kv_lat = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D_V], smem)
    kv_pe = gl.allocate_shared_memory(gl.bfloat16, [2, 64, BOX], smem)
    stats = gl.allocate_shared_memory(gl.float32, [4, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
    gathering: gl.constexpr = GATHER_WARPS * 32  # (threads: one cp.async arrival each)
    mbarrier.init(bars.index(0), count=gathering)
    for i in gl.static_range(1, 5):
        mbarrier.init(bars.index(i), count=2 if i == 1 or i == 2 else 1)
    boxes = gl.allocate_shared_memory(gl.int64, [18, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(18):
        mbarrier.init(boxes.index(i), count=gathering)
    args = (
        (Q, stride_qr, stride_qh),
        (KV, stride_e),
        TABLE,
        LENS,
        H,
        n_blocks_row,
        stride_tb,
        num_splits,
        q_lat,
        q_pe,
        kv_lat,
        kv_pe,
        bars,
        boxes,
        stats,
        O,
        LSE,
        (stride_os, stride_ob, stride_oh),
        (stride_ls, stride_lb, stride_lh),
        qk_scale,
        S_Q,
        CAUSAL,
    )
    gl.warp_specialize(
        [(_ss_first, args), (_ss_second, args), (_sp_gather, args)], [4, GATHER_WARPS], [240, 32]
    )


# ---- the see-saw over DeepSeek-V3.2's FP8 cache (656-byte entries): opt-in until a GPU verifies
# A dequantizing warpgroup stands in for the TMA warp: a page's raw FP8 latent bytes (32 KB) land
# by cp.async in the upper half of its own bf16 buffer (box-major: raw box c at bytes 32 KB + 4 KB
# c), its scales in a small buffer of their own and its bf16 RoPE straight in the rope tile; the
# warpgroup then writes the page's bf16 latent box by box (the fp8 value times its group's
# power-of-two scale: exact in bf16), each box on its own mbarrier as the TMA's were. Box 4 + k
# overwrites raw boxes 2k and 2k + 1, read already; box 7 reads its own raw box whole first. The
# consumers are the dense see-saw's, unchanged.

FP8_GROUP = gl.constexpr(128)  # latent values per fp32 scale (an entry: 512 fp8, 4 scales, 64 bf16)


@gluon.jit
def _fp8_entries(table_row, pos, valid, page):
    """Flattened entry ids of block positions ``pos``: a compacted selection's (``page`` 0:
    ``table_row[pos]``) or a page table's (``table_row[pos // page] * page + pos % page``)."""
    if page == 0:
        idx = gl.load(table_row + pos, mask=valid, other=0)
    else:
        idx = gl.load(table_row + pos // page, mask=valid, other=0) * page + pos % page
    return idx.to(gl.int64)


@gluon.jit
def _fp8_issue(KV8, KVS, KVB, stride_e, page, table_row, pos0, n, raw, raw0, scales, scales0, pe):
    """cp.async one page's bytes: raw FP8 latent box ``c`` into ``raw[raw0 + c]`` ([64, 64] uint8),
    the scales of group ``g`` into ``scales[scales0 + g]`` ([64] fp32), the bf16 RoPE (bytes
    528 .. 655 of an entry) into ``pe``; rows past ``n`` zero-filled (never attended); then one
    commit group."""
    lay: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [GATHER_WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, lay)
    cols = gl.arange(0, BOX, gl.SliceLayout(0, lay))[None, :]
    pos = pos0 + gl.arange(0, 64, rows_l)
    valid = pos < n
    idx = _fp8_entries(table_row, pos, valid, page)
    entry = KV8 + idx[:, None] * stride_e + cols
    for c in gl.static_range(D_V // BOX):
        dst = raw.index(raw0 + c)
        async_copy.async_copy_global_to_shared(dst, entry + c * BOX, mask=valid[:, None])
    lay_pe: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [GATHER_WARPS, 1], [1, 0])
    rows_pe: gl.constexpr = gl.SliceLayout(1, lay_pe)
    pos_pe = pos0 + gl.arange(0, 64, rows_pe)
    valid_pe = pos_pe < n
    idx_pe = _fp8_entries(table_row, pos_pe, valid_pe, page)
    cols_pe = gl.arange(0, BOX, gl.SliceLayout(0, lay_pe))[None, :]
    rope_at: gl.constexpr = (D_V + 4 * (D_V // FP8_GROUP)) // 2  # (in bf16 halves)
    rope = KVB + idx_pe[:, None] * (stride_e // 2) + rope_at + cols_pe
    async_copy.async_copy_global_to_shared(pe, rope, mask=valid_pe[:, None])
    lay_s: gl.constexpr = gl.BlockedLayout([1], [32], [GATHER_WARPS], [0])
    pos_s = pos0 + gl.arange(0, 64, lay_s)
    valid_s = pos_s < n
    sc = KVS + _fp8_entries(table_row, pos_s, valid_s, page) * (stride_e // 4) + D_V // 4
    for g in gl.static_range(D_V // FP8_GROUP):
        dst = scales.index(scales0 + g)
        async_copy.async_copy_global_to_shared(dst, sc + g, mask=valid_s)
    async_copy.commit_group()


@gluon.jit
def _fp8_dequant(raw, raw0, scales, scales0, lat, boxes, buf):
    """The page's bf16 latent, box by box from its raw FP8 bytes and scales (landed and visible
    to every thread of the warpgroup), each box's mbarrier arrived once it is in place."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [GATHER_WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, lay)
    for c in gl.static_range(D_V // BOX):
        x = raw.index(raw0 + c).load(lay)
        s = scales.index(scales0 + c * BOX // FP8_GROUP).load(rows_l)[:, None]
        if c == D_V // BOX - 1:
            gl.thread_barrier()  # box 7 overwrites its own raw bytes: all read first
        v = x.to(gl.float8e4nv, bitcast=True).to(gl.float32) * s
        lat.slice(c * BOX, BOX, dim=1).store(v.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # every thread's part of the box written (and raw box c read)
        mbarrier.arrive(boxes.index(buf * 9 + c), count=1)


@gluon.jit
def _fp8_gather(q_desc, kv_desc, TABLE, LENS, H, n_blocks_row, stride_tb, num_splits, q_lat, q_pe,
                kv_lat, kv_pe, bars, boxes, stats, O, LSE, o_strides, l_strides, qk_scale,
                S_Q: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """The dequantizing warpgroup: Q's 64 head rows by cp.async (as the gather see-saw's), then
    page ``i`` of the split into buffer ``i % 2`` once both consumers released it: its bytes by
    cp.async (:func:`_fp8_issue`), the RoPE box's mbarrier once they landed, then the latent
    box by box (:func:`_fp8_dequant`). ``kv_desc``: the pool's FP8, fp32 and bf16 views, the
    entry stride in bytes, the page size (0: ``TABLE`` is a compacted selection) and the scales'
    buffers."""
    KV8, KVS, KVB, stride_e, page, scales = kv_desc
    r, h0, seq, n, split, blk0, n_iter = _row_range(
        LENS, H, n_blocks_row, num_splits, S_Q, CAUSAL, 64
    )
    _gather_query(q_desc, r, h0, H, q_lat, q_pe, bars.index(0))
    table_row = TABLE + seq.to(gl.int64) * stride_tb
    raw_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    raw = kv_lat._reinterpret(gl.uint8, [32, 64, BOX], raw_l)  # buffer b's raw box c: 16 b + 8 + c
    for i in range(n_iter):
        buf = i % 2
        mbarrier.wait(bars.index(1 + buf), ((i // 2) & 1) ^ 1)  # (a fresh barrier passes)
        lat = kv_lat.index(buf)
        _fp8_issue(KV8, KVS, KVB, stride_e, page, table_row, (blk0 + i) * 64, n, raw, buf * 16 + 8,
                   scales, buf * 4, kv_pe.index(buf))  # fmt: skip
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()  # every thread's copies landed
        mbarrier.arrive(boxes.index(buf * 9 + D_V // BOX), count=1)  # the RoPE box
        _fp8_dequant(raw, buf * 16 + 8, scales, buf * 4, lat, boxes, buf)


@gluon.jit
def gluon_mla_seesaw_fp8_kernel(
    Q,
    KV8,
    KVS,
    KVB,
    TABLE,
    LENS,
    O,
    LSE,
    H,
    n_blocks_row,
    stride_tb,
    num_splits,
    stride_qr,
    stride_qh,
    stride_e,
    page,
    stride_os,
    stride_ob,
    stride_oh,
    stride_ls,
    stride_lb,
    stride_lh,
    qk_scale,
    S_Q: gl.constexpr,
    CAUSAL: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The see-saw over the FP8 cache (``KV8`` its entries as FP8 bytes, ``KVS`` as fp32 and
    ``KVB`` as bf16: three views of one pool, ``stride_e`` bytes an entry): ``page`` > 0 reads a
    padded page table of ``page``-entry pages (dense, ``S_Q`` / ``CAUSAL`` as the see-saw's),
    ``page`` 0 a compacted top-k selection (sparse). The dense see-saw's consumers (``_ss_first``,
    ``_ss_second``) and shared memory, a dequantizing warpgroup (``_fp8_gather``) in place of the
    TMA warp, plus 2 KB of scales."""
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [1, 64, D_V], smem)
    q_pe = gl.allocate_shared_memory(gl.bfloat16, [1, 64, BOX], smem)
    kv_lat = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D_V], smem)
    kv_pe = gl.allocate_shared_memory(gl.bfloat16, [2, 64, BOX], smem)
    stats = gl.allocate_shared_memory(gl.float32, [4, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    scales = gl.allocate_shared_memory(gl.float32, [8, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
    gathering: gl.constexpr = GATHER_WARPS * 32  # (threads: one cp.async arrival each for Q)
    mbarrier.init(bars.index(0), count=gathering)
    for i in gl.static_range(1, 5):
        mbarrier.init(bars.index(i), count=2 if i == 1 or i == 2 else 1)
    boxes = gl.allocate_shared_memory(gl.int64, [18, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(18):
        mbarrier.init(boxes.index(i), count=1)
    args = (
        (Q, stride_qr, stride_qh),
        (KV8, KVS, KVB, stride_e, page, scales),
        TABLE,
        LENS,
        H,
        n_blocks_row,
        stride_tb,
        num_splits,
        q_lat,
        q_pe,
        kv_lat,
        kv_pe,
        bars,
        boxes,
        stats,
        O,
        LSE,
        (stride_os, stride_ob, stride_oh),
        (stride_ls, stride_lb, stride_lh),
        qk_scale,
        S_Q,
        CAUSAL,
    )
    gl.warp_specialize(
        [(_ss_first, args), (_ss_second, args), (_fp8_gather, args)], [4, GATHER_WARPS], [240, 32]
    )
