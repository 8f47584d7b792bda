"""The tile loop shared by the dense paged and the sparse top-k partial MLA kernels (§3.3, §6.3).

Private ``@triton.jit`` helpers; the public ops are ``mla.decode.mla_decode_partial`` and
``mla.sparse.mla_sparse_partial``, which differ only in how they find a tile's cache rows (a
block-table lookup, or the top-k indices) and share everything else here:

- :func:`_split_range` gives a split its contiguous range of whole tiles;
- :func:`_load_query` loads the ``BLOCK_H`` heads of one query token as two tiles, the latent
  part ``[BLOCK_H, D_LAT]`` and the rope part ``[BLOCK_H, D_PE]`` (``tl.arange`` needs
  power-of-two extents, so the 576-wide head is split 512 + 64), from one fused row or from two
  tensors (``SPLIT``: FlashInfer's ``q_nope`` / ``q_pe`` and ``ckv`` / ``kpe`` caches, read in
  place through their own pointers and strides; the fused path's addresses are unchanged);
- :func:`_attend_tile` streams one tile of ``BLOCK_N`` cache entries through an online softmax
  for all ``BLOCK_H`` heads at once (every head attends the same entries, so each tile is read
  once per program); the value is the latent part of the same loaded tile, never read again;
- :func:`_store_partial` normalises and writes ``(o, lse)``; an empty row writes
  ``o = 0, lse = -inf``.

Decisions: scores are kept in base 2 (the scale is pre-multiplied by ``log2(e)`` so the loop
uses ``exp2``) and converted to the natural-log LSE on store; the running max, denominator and
accumulator are fp32; ``tl.dot`` takes the cache dtype (bf16 / fp16 on the tensor cores, fp32
with ``input_precision="ieee"`` so fp32 inputs are not silently rounded to tf32), except under
the interpreter with bf16, where ``DOT_FP32`` upcasts the operands (see
``_core.execution.dot_in_fp32``).
The softmax weights ``p`` are rounded to the cache dtype for the PV product, as FlashMLA does.

**FP8 entries** (:func:`_attend_tile_fp8`, :func:`_load_fp8_tile`; DeepSeek-V3.2's 656-byte
entry, ``mqnc.model.kv_format``), read in place through uint8 pointers and dequantized in
registers; the kernels select them with an ``FP8`` constexpr, so the 16-bit variants compile
exactly as before. Decisions:

- **Decoding**: a latent byte is bitcast to ``tl.float8e4nv`` and converted natively to fp32
  (on sm_90 ``cvt`` from e4m3; Triton 3.9.0's interpreter converts every finite e4m3 byte
  exactly, which the tests check against torch). The NaN bytes ``0x7F`` / ``0xFF`` are not
  handled in the kernel: a GPU decodes them as NaN (the output carries it), the interpreter as
  480; the host refuses them, with every scale not finite and > 0, in the entries a call
  attends, when its ``check_inputs`` / ``check_indices`` is on (``fp8.cache``).
- **Scale**: the group's fp32 scale (``D_LAT / 128`` per entry, read in place at byte
  ``D_LAT``) multiplies the decoded value in fp32, one multiply, then the product is rounded
  once to the query's dtype (bf16 for wgmma, as FlashMLA dequantizes to bf16; fp16 / fp32
  queries take their own dtype). For the quantizer's power-of-two scales every step is exact
  (an e4m3 value times a power of two is a bf16 value); another finite positive scale rounds
  twice, ``bf16(fp32(e4m3 * scale))``: within ``(1 + 2^-24)(1 + 2^-8) - 1`` relative (bf16's
  unit roundoff, plus fp32's), the reference's own rounding
  (``mqnc.reference.attention_ref.dequantized_cache``). The RoPE part is bf16, converted to
  the query's dtype (exact for bf16 and fp32).
- **The value** is the same dequantized latent tile (one read per tile, as for 16-bit caches).
- **Tiles**: the dequantized bf16 tile goes to shared memory for the dots beside the uint8 copy
  ring, so FP8 launches take tiles of their own (``mla.plan.tile_config``: 16 x 32 on 8
  warps, 64 x 16 above 32 heads under triton 3.6); variant names read ``mla_decode-fp8[...]`` /
  ``mla_sparse-fp8[...]``. The restructured ``-pipe`` candidates read FP8 entries too
  (:func:`_load_full_tile_fp8`); ``-tma`` ones 16-bit caches only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mqnc.triton_kernels._core.numerics import round_to

LOG2E = 1.4426950408889634
FP8_GROUP = tl.constexpr(128)  # latent values per fp32 scale of an FP8 entry (kv_format)


@triton.jit
def _split_range(n, NUM_SPLITS, split, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """``[start, end)`` of split ``split`` over ``n`` entries: ``NUM_SPLITS`` contiguous ranges
    of whole ``BLOCK_N`` tiles, at least ``MIN_TILES`` tiles each (so a row shorter than the
    capacity the host planned for fills its first splits and leaves the last ones empty)."""
    tiles_per_split = tl.maximum(tl.cdiv(tl.cdiv(n, BLOCK_N), NUM_SPLITS), MIN_TILES)
    start = split * tiles_per_split * BLOCK_N
    return start, tl.minimum(start + tiles_per_split * BLOCK_N, n)


@triton.jit
def _load_query(
    Q,
    Q_PE,
    b,
    h0,
    H,
    stride_qb,
    stride_qh,
    stride_pb,
    stride_ph,
    BLOCK_H: tl.constexpr,
    D_LAT: tl.constexpr,
    D_PE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Heads ``h0 .. h0 + BLOCK_H`` of query token ``b``: ``(q_lat [BLOCK_H, D_LAT],
    q_pe [BLOCK_H, D_PE], head mask [BLOCK_H])``; heads ``>= H`` load as 0 and are never stored.

    Fused rows (``SPLIT`` False): the rope part follows the latent in ``Q``'s rows (``Q_PE`` and
    its strides are not read). ``SPLIT``: the rope part is ``Q_PE [B, H, D_PE]`` with its own
    strides (FlashInfer's ``q_nope`` / ``q_pe``)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    row = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    if SPLIT:
        pe_row = Q_PE + b.to(tl.int64) * stride_pb + offs_h[:, None] * stride_ph
    else:
        pe_row = row + D_LAT
    q_lat = tl.load(row + tl.arange(0, D_LAT)[None, :], mask=mask_h[:, None], other=0.0)
    q_pe = tl.load(pe_row + tl.arange(0, D_PE)[None, :], mask=mask_h[:, None], other=0.0)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    return q_lat, q_pe, offs_h, mask_h


@triton.jit
def _attend_tile(
    q_lat,
    q_pe,
    kv_rows,
    pe_rows,
    valid,
    m,
    l,
    acc,
    qk_scale,
    D_LAT: tl.constexpr,
    D_PE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One online-softmax step over ``BLOCK_N`` cache entries for ``BLOCK_H`` heads.

    ``kv_rows`` [BLOCK_N] are pointers to the entries' first element (unit stride inside an
    entry), ``pe_rows`` [BLOCK_N] pointers to their rope parts when ``SPLIT`` (FlashInfer's
    ``kpe`` rows; fused 576-wide entries: not read, the rope part is ``kv_rows + D_LAT``, the
    addresses of one row), ``valid`` [BLOCK_N] says which to attend (invalid rows are never
    read, so padding may hold anything, NaN included). ``m`` [BLOCK_H] is the running max in
    base-2 units, ``l`` [BLOCK_H] the denominator relative to it, ``acc`` [BLOCK_H, D_LAT] the
    unnormalised output, all fp32. ``qk_scale = softmax_scale * log2(e)``.
    """
    kv_lat = tl.load(
        kv_rows[:, None] + tl.arange(0, D_LAT)[None, :], mask=valid[:, None], other=0.0
    )
    if SPLIT:
        pe_at = pe_rows[:, None] + tl.arange(0, D_PE)[None, :]
    else:
        pe_at = kv_rows[:, None] + D_LAT + tl.arange(0, D_PE)[None, :]
    kv_pe = tl.load(pe_at, mask=valid[:, None], other=0.0)
    return _attend_masked(
        q_lat, q_pe, kv_lat, kv_pe, valid, m, l, acc, qk_scale, DOT_FP32, PRECISION
    )


@triton.jit
def _attend_masked(
    q_lat, q_pe, kv_lat, kv_pe, valid, m, l, acc, qk_scale, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """The scores and the online-softmax step of a loaded tile ``kv_lat [BLOCK_N, D_LAT]``,
    ``kv_pe [BLOCK_N, D_PE]`` (the dot dtype) whose entries ``valid`` [BLOCK_N] are attended
    (the others score ``-inf``); ``m``, ``l``, ``acc`` as in :func:`_attend_tile`."""
    if DOT_FP32:
        kv_lat = kv_lat.to(tl.float32)
        kv_pe = kv_pe.to(tl.float32)
    s = tl.dot(q_lat, tl.trans(kv_lat), input_precision=PRECISION)
    s = tl.dot(q_pe, tl.trans(kv_pe), acc=s, input_precision=PRECISION)
    s = tl.where(valid[None, :], s * qk_scale, -float("inf"))
    return _softmax_step(s, kv_lat, m, l, acc, PRECISION)


@triton.jit
def _load_fp8_tile(
    kv_rows, pe_rows, valid, D_LAT: tl.constexpr, D_PE: tl.constexpr, SPLIT: tl.constexpr,
    DT: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    """Load and dequantize ``BLOCK_N`` FP8 entries: ``(kv_lat [BLOCK_N, D_LAT], kv_pe
    [BLOCK_N, D_PE])`` in ``DT`` (the query's dtype, the dots' operand type).

    ``kv_rows`` [BLOCK_N] are uint8 pointers to the entries' first byte: ``D_LAT`` e4m3fn
    bytes, then ``D_LAT / 128`` float32 scales, then (fused, not ``SPLIT``) ``D_PE`` bf16 RoPE
    values; ``SPLIT``: ``pe_rows`` [BLOCK_N] point to the bf16 RoPE rows of FlashInfer's
    ``kpe`` cache. A latent value is ``fp32(e4m3(byte)) * scale`` (one fp32 multiply, exact for
    a power-of-two scale) rounded once to ``DT`` (nearest even; ``RNE``: by integer arithmetic,
    the interpreter's bf16 cast truncates); the RoPE part is converted from bf16 to ``DT``.
    Rows not ``valid`` are not read (0)."""
    cols = tl.arange(0, D_LAT)
    raw = tl.load(kv_rows[:, None] + cols[None, :], mask=valid[:, None], other=0)
    lat = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale_at = (kv_rows + D_LAT).to(tl.pointer_type(tl.float32), bitcast=True)
    group = (cols // FP8_GROUP)[None, :]
    scale = tl.zeros_like(lat)
    for g in tl.static_range(D_LAT // FP8_GROUP):
        s_g = tl.load(scale_at + g, mask=valid, other=0.0)
        scale = tl.where(group == g, s_g[:, None], scale)
    kv_lat = round_to(lat * scale, DT, RNE)
    if SPLIT:
        pe_at = pe_rows[:, None] + tl.arange(0, D_PE)[None, :]
    else:
        rope = kv_rows + D_LAT + 4 * (D_LAT // FP8_GROUP)
        pe_at = rope.to(tl.pointer_type(tl.bfloat16), bitcast=True)[:, None]
        pe_at = pe_at + tl.arange(0, D_PE)[None, :]
    kv_pe = tl.load(pe_at, mask=valid[:, None], other=0.0).to(DT)
    return kv_lat, kv_pe


@triton.jit
def _attend_tile_fp8(
    q_lat, q_pe, kv_rows, pe_rows, valid, m, l, acc, qk_scale, D_LAT: tl.constexpr,
    D_PE: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    DT: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    """:func:`_attend_tile` over FP8 entries (``kv_rows``: uint8 pointers to each entry's
    first byte; ``pe_rows``: the ``kpe`` rows when ``SPLIT``), dequantized in registers by
    :func:`_load_fp8_tile` to ``DT`` before the dots; the value is the same dequantized
    latent."""
    kv_lat, kv_pe = _load_fp8_tile(kv_rows, pe_rows, valid, D_LAT, D_PE, SPLIT, DT, RNE)
    return _attend_masked(
        q_lat, q_pe, kv_lat, kv_pe, valid, m, l, acc, qk_scale, DOT_FP32, PRECISION
    )


@triton.jit
def _attend_rows(
    q_lat, q_pe, kv_rows, pe_rows, valid, m, l, acc, qk_scale, D_LAT: tl.constexpr,
    D_PE: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    FP8: tl.constexpr, DT: tl.constexpr, FP8_RNE: tl.constexpr,
):  # fmt: skip
    """One tile of entries (``kv_rows`` / ``pe_rows`` as :func:`_attend_tile`'s) through the
    online softmax: :func:`_attend_tile` over 16-bit entries, or (``FP8``)
    :func:`_attend_tile_fp8` over FP8 entries (uint8 pointers) dequantized to ``DT`` (the
    query's dtype; ``FP8_RNE``: rounded in software). The dense, sparse and holder kernels'
    one switch between the two; ``DT`` and ``FP8_RNE`` are not read when ``FP8`` is False."""
    if FP8:
        return _attend_tile_fp8(
            q_lat, q_pe, kv_rows, pe_rows, valid, m, l, acc, qk_scale, D_LAT, D_PE, SPLIT,
            DOT_FP32, PRECISION, DT, FP8_RNE,
        )  # fmt: skip
    else:
        return _attend_tile(
            q_lat, q_pe, kv_rows, pe_rows, valid, m, l, acc, qk_scale, D_LAT, D_PE, SPLIT,
            DOT_FP32, PRECISION,
        )  # fmt: skip


@triton.jit
def _softmax_init(BLOCK_H: tl.constexpr, D_LAT: tl.constexpr):
    """The online softmax's start ``(m, l, acc)``: running max ``-inf`` [BLOCK_H], denominator
    0 [BLOCK_H], unnormalised output 0 [BLOCK_H, D_LAT], all fp32."""
    m = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_LAT], tl.float32)
    return m, l, acc


@triton.jit
def _softmax_step(s, v, m, l, acc, PRECISION: tl.constexpr):
    """One online-softmax update: scores ``s [BLOCK_H, BLOCK_N]`` (fp32, base 2, already
    scaled by ``qk_scale``; ``-inf`` where an entry is not attended) against the values
    ``v [BLOCK_N, D]`` (the dtype ``p`` is cast to for the ``p @ v`` dot). Returns the new
    ``(m, l, acc)``: running max [BLOCK_H], denominator [BLOCK_H], unnormalised output
    [BLOCK_H, D], all fp32."""
    m_new = tl.maximum(m, tl.max(s, 1))
    # A tile with no valid entry (possible for sparse indices) or -inf scores (from -inf
    # inputs) leaves m_new = -inf: shift by 0.
    m_shift = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_shift)
    p = tl.exp2(s - m_shift[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _store_partial(
    O,
    LSE,
    o_base,
    lse_base,
    offs_h,
    mask_h,
    stride_oh,
    stride_lh,
    m,
    l,
    acc,
    D_LAT: tl.constexpr,
    BF16_RNE: tl.constexpr,
):
    """Write ``o = acc / l`` in ``O``'s dtype (round to nearest even, ``_core.numerics.round_to``)
    and the natural-log ``lse = (m + log2 l) ln 2``; a row that attended nothing (``l = 0``)
    writes ``o = 0, lse = -inf``; a NaN ``l`` (a NaN or overflowing input) writes NaN."""
    nonempty = l != 0.0  # NaN is "non-empty": it propagates, never reads as "no keys"
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l, 1.0), 0.0)
    o = acc * inv_l[:, None]
    o_ptrs = O + o_base + offs_h[:, None] * stride_oh + tl.arange(0, D_LAT)[None, :]
    tl.store(o_ptrs, round_to(o, O.dtype.element_ty, BF16_RNE), mask=mask_h[:, None])
    lse = tl.where(
        nonempty, (m + tl.log2(tl.where(nonempty, l, 1.0))) * 0.6931471805599453, -float("inf")
    )
    tl.store(LSE + lse_base + offs_h * stride_lh, lse, mask=mask_h)


# ---- The restructured loop (the ``pipe`` / ``tma`` kernel variants of the dense kernel) ----
# New helpers, beside the ones above (whose signatures other kernels import and keep): full
# tiles attended without per-entry masks, and the page-granular addressing that lets a tile of
# BLOCK_N <= PAGE entries be one contiguous box (one page id, one TMA load per part).


@triton.jit
def _attend_loaded(
    q_lat,
    q_pe,
    kv_lat,
    kv_pe,
    m,
    l,
    acc,
    qk_scale,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """:func:`_attend_tile` on an already loaded full tile (every entry valid: no mask, no
    ``where`` on the scores): ``kv_lat [BLOCK_N, D_LAT]``, ``kv_pe [BLOCK_N, D_PE]`` in the
    cache dtype; ``m``, ``l``, ``acc`` as there (fp32, base-2 max)."""
    if DOT_FP32:
        kv_lat = kv_lat.to(tl.float32)
        kv_pe = kv_pe.to(tl.float32)
    s = tl.dot(q_lat, tl.trans(kv_lat), input_precision=PRECISION)
    s = tl.dot(q_pe, tl.trans(kv_pe), acc=s, input_precision=PRECISION) * qk_scale
    return _softmax_step(s, kv_lat, m, l, acc, PRECISION)


@triton.jit
def _full_tile_pages(table_row, t0, offs_n, stride_tj, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(page ids, offsets in their pages)`` of the entries ``t0 .. t0 + BLOCK_N`` of a full
    tile (``t0`` a multiple of ``BLOCK_N``). ``PAGE >= BLOCK_N``: a tile never straddles a
    page, so ONE scalar page-id load (int64) and the scalar offset of the tile's first entry
    (the entries are the next ``BLOCK_N`` rows of that page); smaller pages: one unmasked
    page-id load per entry and per-entry offsets."""
    if PAGE >= BLOCK_N:
        page = tl.load(table_row + (t0 // PAGE) * stride_tj).to(tl.int64)
        return page, t0 % PAGE
    else:
        t = t0 + offs_n
        page = tl.load(table_row + (t // PAGE) * stride_tj).to(tl.int64)
        return page, t % PAGE


@triton.jit
def _load_full_tile(
    KV,
    KV_PE,
    lat_desc,
    pe_desc,
    table_row,
    t0,
    offs_n,
    stride_tj,
    stride_kb,
    stride_kt,
    stride_pkb,
    stride_pkt,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_LAT: tl.constexpr,
    D_PE: tl.constexpr,
    SPLIT: tl.constexpr,
    TMA: tl.constexpr,
):
    """``(kv_lat [BLOCK_N, D_LAT], kv_pe [BLOCK_N, D_PE])`` of a full tile, both loads issued
    together after the page-id load they depend on (one per tile when ``PAGE >= BLOCK_N``).
    ``TMA`` (needs ``PAGE >= BLOCK_N``): two tensor-descriptor boxes ``[1, BLOCK_N, D]`` of the
    page (``lat_desc`` / ``pe_desc`` from :func:`_page_descriptors`); else unmasked pointer
    loads (cp.async when the loop is pipelined)."""
    page, off = _full_tile_pages(table_row, t0, offs_n, stride_tj, PAGE, BLOCK_N)
    if TMA:
        kv_lat = lat_desc.load([page.to(tl.int32), off, 0]).reshape(BLOCK_N, D_LAT)
        if SPLIT:
            kv_pe = pe_desc.load([page.to(tl.int32), off, 0]).reshape(BLOCK_N, D_PE)
        else:
            kv_pe = pe_desc.load([page.to(tl.int32), off, D_LAT]).reshape(BLOCK_N, D_PE)
    else:
        if PAGE >= BLOCK_N:
            off = off + offs_n
        rows = page * stride_kb + off * stride_kt
        kv_lat = tl.load(KV + rows[:, None] + tl.arange(0, D_LAT)[None, :])
        if SPLIT:
            pe_rows = page * stride_pkb + off * stride_pkt
            kv_pe = tl.load(KV_PE + pe_rows[:, None] + tl.arange(0, D_PE)[None, :])
        else:
            kv_pe = tl.load(KV + rows[:, None] + D_LAT + tl.arange(0, D_PE)[None, :])
    return kv_lat, kv_pe


@triton.jit
def _load_full_tile_fp8(
    KV, KV_PE, table_row, t0, offs_n, stride_tj, stride_kb, stride_kt, stride_pkb, stride_pkt,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D_LAT: tl.constexpr, D_PE: tl.constexpr,
    SPLIT: tl.constexpr, DT: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    """:func:`_load_full_tile` (pointer loads, no TMA) of FP8 entries: the full tile's page ids
    (one per tile when ``PAGE >= BLOCK_N``), then its entries dequantized by
    :func:`_load_fp8_tile` to ``DT``, every row attended (``valid`` all true)."""
    page, off = _full_tile_pages(table_row, t0, offs_n, stride_tj, PAGE, BLOCK_N)
    if PAGE >= BLOCK_N:
        off = off + offs_n
    kv_rows = KV + page * stride_kb + off * stride_kt
    pe_rows = KV_PE + page * stride_pkb + off * stride_pkt  # (read when SPLIT)
    return _load_fp8_tile(kv_rows, pe_rows, offs_n < BLOCK_N, D_LAT, D_PE, SPLIT, DT, RNE)


@triton.jit
def _page_descriptors(
    KV,
    KV_PE,
    n_blocks,
    stride_kb,
    stride_kt,
    stride_pkb,
    stride_pkt,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_LAT: tl.constexpr,
    D_PE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Device-side TMA descriptors over the paged pool ``[n_blocks, PAGE, D]`` (its own
    strides; the last dim unit-stride): ``lat_desc`` boxes ``[1, BLOCK_N, D_LAT]``, ``pe_desc``
    ``[1, BLOCK_N, D_PE]`` (of ``KV_PE`` when ``SPLIT``, else of ``KV``'s columns from
    ``D_LAT``). On a GPU they live in a global scratch that Triton allocates per launch through
    ``triton.set_allocator`` (the launcher installs one)."""
    lat_desc = tl.make_tensor_descriptor(
        KV,
        shape=[n_blocks, PAGE, D_LAT + (0 if SPLIT else D_PE)],
        strides=[stride_kb, stride_kt, 1],
        block_shape=[1, BLOCK_N, D_LAT],
    )
    if SPLIT:
        pe_desc = tl.make_tensor_descriptor(
            KV_PE,
            shape=[n_blocks, PAGE, D_PE],
            strides=[stride_pkb, stride_pkt, 1],
            block_shape=[1, BLOCK_N, D_PE],
        )
    else:
        pe_desc = tl.make_tensor_descriptor(
            KV,
            shape=[n_blocks, PAGE, D_LAT + D_PE],
            strides=[stride_kb, stride_kt, 1],
            block_shape=[1, BLOCK_N, D_PE],
        )
    return lat_desc, pe_desc


@triton.jit
def _merge_if_last(
    WO,
    WLSE,
    Tickets,
    O,
    LSE,
    ticket,
    o_base,
    lse_base,
    offs_h,
    mask_h,
    NUM_SPLITS,
    stride_ws,
    stride_wh,
    stride_wls,
    stride_wlh,
    stride_oh,
    stride_lh,
    D_LAT: tl.constexpr,
    BF16_RNE: tl.constexpr,
):
    """The split combine fused into the attention kernel (the ``fused`` candidates): after a
    split has stored its fp32 partial (``WO`` / ``WLSE``, split stride ``stride_ws`` /
    ``stride_wls``, already offset to this row), it takes a ticket (``Tickets[ticket]``, one per
    row and head block, an acq_rel atomic at GPU scope after a CTA barrier, so the partial is
    visible before the ticket); the split that draws the last ticket merges the row's
    ``NUM_SPLITS`` partials (read through L2, ``.cg``) into ``O`` / ``LSE`` at ``o_base`` /
    ``lse_base`` (the merge kernel's math: natural-log weights, empty partials ``lse = -inf``
    weigh 0, an all-empty row writes ``o = 0, lse = -inf``) and resets the ticket to 0, so the
    next launch (a plan's next run, a CUDA graph's replay) starts from zero."""
    tl.debug_barrier()
    drawn = tl.atomic_add(Tickets + ticket, 1, sem="acq_rel", scope="gpu")
    if drawn == NUM_SPLITS - 1:
        offs_d = tl.arange(0, D_LAT)
        m = tl.full(offs_h.shape, -float("inf"), tl.float32)
        l = tl.zeros(offs_h.shape, tl.float32)
        acc = tl.zeros([offs_h.shape[0], D_LAT], tl.float32)
        for s in range(0, NUM_SPLITS):
            lse_s = tl.load(
                WLSE + s * stride_wls + offs_h * stride_wlh, mask=mask_h, other=-float("inf"),
                cache_modifier=".cg",
            )  # fmt: skip
            o_s = tl.load(
                WO + s * stride_ws + offs_h[:, None] * stride_wh + offs_d[None, :],
                mask=mask_h[:, None], other=0.0, cache_modifier=".cg",
            )  # fmt: skip
            m_new = tl.maximum(m, lse_s)
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp(m - shift)
            w = tl.exp(lse_s - shift)
            l = l * alpha + w
            acc = acc * alpha[:, None] + w[:, None] * o_s
            m = m_new
        nonempty = l != 0.0
        inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l, 1.0), 0.0)
        o_ptrs = O + o_base + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, round_to(acc * inv_l[:, None], O.dtype.element_ty, BF16_RNE),
                 mask=mask_h[:, None])  # fmt: skip
        lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, l, 1.0)), -float("inf"))
        tl.store(LSE + lse_base + offs_h * stride_lh, lse, mask=mask_h)
        tl.atomic_xchg(Tickets + ticket, 0)
