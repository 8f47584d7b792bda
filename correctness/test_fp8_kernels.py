"""The attention kernels over an FP8 cache (DeepSeek-V3.2's 656-byte entries, read in place and
dequantized in registers): dense paged, CSR, split ``ckv`` / ``kpe`` caches, FlashMLA's MTP
layout (``s_q`` tokens, causal), split-KV and sparse top-k with ``-1`` slots, each against the
fp64 reference over the DEQUANTIZED cache (``mqnc.reference.dequantized_cache``; the
``("mla_fp8", dtype)`` bounds); the quantization error against the original bf16 cache,
measured separately against the bound derived from ``docs/fp8-cache.md``'s per-value one; the
``"torch"`` backend equal to the kernels; bad input named.

Outputs are NaN-poisoned (conftest) and every pool entry not attended is all ``0xFF`` bytes
(NaN latent, NaN scales, NaN RoPE), so a read of an entry that is not attended fails.
"""

from __future__ import annotations

import math

import pytest
import torch

import mqnc.serving.compute  # noqa: F401  (registers the ops' "torch" backend)
from mqnc.reference import mla_decode_reference, mla_sparse_reference
from mqnc.reference.attention_ref import dequantized_cache
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.triton_kernels import mla_decode_partial, mla_decode_partial_csr, mla_sparse_partial
from mqnc.triton_kernels.adapters.flashinfer import mla_paged_attention
from mqnc.triton_kernels.adapters.flashmla import mla_decode_with_kvcache, mla_sparse_with_kvcache
from mqnc.triton_kernels.fp8.quant import fp8_quantize
from mqnc.triton_kernels.mla.plan import forced_tile
from mqnc.triton_kernels.ops import backend_ops

DEVICE = default_device()
D_V, D_R, LATENT, ENTRY = 512, 64, 528, 656
SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2  # DeepSeek-V2-Lite with YaRN
H = 16
PAGE, BLOCKS = 16, 10


def _pool(gen, used: torch.Tensor, blocks: int = BLOCKS, page: int = PAGE):
    """``(entries [blocks, page, 656] uint8, rows [blocks, page, 576] bf16)``: N(0, 1) bf16 rows
    quantized at the flat token slots ``used``; every other entry all 0xFF (NaN bytes)."""
    rows = torch.randn(blocks * page, D_V + D_R, generator=gen).to(torch.bfloat16)
    entries = torch.full((blocks * page, ENTRY), 0xFF, dtype=torch.uint8)
    entries[used] = fp8_quantize(rows[used], D_V)
    shape = (blocks, page)
    return entries.reshape(*shape, ENTRY).to(DEVICE), rows.reshape(*shape, -1).to(DEVICE)


def _dense_case(seed: int = 0, lens=(45, 0, 17)):
    """A padded table over shuffled pages, rows of ``lens`` tokens: ``(q, pool, table, lens,
    original rows)``; only the attended entries are quantized."""
    gen = torch.Generator().manual_seed(seed)
    B, width = len(lens), 3
    table = torch.randperm(BLOCKS, generator=gen)[: B * width].reshape(B, width).to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    t = torch.arange(width * PAGE)
    slots = (table.long()[:, t // PAGE] * PAGE + t % PAGE)[t[None, :] < lens_t[:, None]]
    pool, rows = _pool(gen, slots)
    q = torch.randn(B, H, D_V + D_R, generator=gen).to(DEVICE)
    return q, pool, table.to(DEVICE), lens_t.to(DEVICE), rows


def _check(o, lse, ref, dtype, backend=None):
    """``backend``: whose bound (None: the Triton kernels' in this mode; "compiled": the bound
    every implementation meets, the torch reference backend's)."""
    assert_close(o, ref[0], tolerance("mla_fp8", dtype, backend=backend), name="o")
    assert_close(lse, ref[1], tolerance("mla_lse", "float32"), name="lse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_dense_paged_matches_fp64_over_the_dequantized_cache(dtype, num_splits):
    q, pool, table, lens, _ = _dense_case()
    q = q.to(dtype)
    o, lse = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, num_splits=num_splits)
    assert o.dtype == dtype and o.shape == (3, H, D_V) and bool(torch.isneginf(lse[1]).all())
    ref = mla_decode_reference(q, dequantized_cache(pool, D_V, dtype), table, lens, SCALE)
    _check(o, lse, ref, dtype)


def test_fp8_kernel_equals_the_16_bit_kernel_on_the_dequantized_cache():
    """Power-of-two scales: the dequantized values are bf16 values, so the FP8 kernel attends
    exactly what the bf16 kernel attends over ``dequantized_cache`` (bit for bit)."""
    q, pool, table, lens, _ = _dense_case(seed=1)
    q = q.to(torch.bfloat16)
    rows = dequantized_cache(pool, D_V, torch.bfloat16).nan_to_num(0.0)
    with forced_tile("16x32w8s5"):  # (the same tile: the same summation order)
        got = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, num_splits=1)
        want = mla_decode_partial(q, rows, table, lens, softmax_scale=SCALE, num_splits=1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_other_scales_round_once_to_the_query_dtype():
    """A scale that is not a power of two (FlashMLA multiplies by any stored fp32 scale): the
    product is rounded to fp32, then to bf16, as the reference does; a float8_e4m3fn pool is
    read as its bytes."""
    q, pool, table, lens, _ = _dense_case(seed=2, lens=(40, 9, 31))
    scales = pool[..., D_V:LATENT].contiguous().view(torch.float32) * 0.3
    pool[..., D_V:LATENT] = scales.contiguous().view(torch.uint8).nan_to_num(0)
    pool = pool.view(torch.float8_e4m3fn)
    q = q.to(torch.bfloat16)
    o, lse = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, num_splits=1)
    ref = mla_decode_reference(q, dequantized_cache(pool, D_V, q.dtype), table, lens, SCALE)
    _check(o, lse, ref, torch.bfloat16)


@pytest.mark.parametrize(
    "tile,num_splits", [("16x16w8s2-pipe", 1), ("16x16w8s5-pipe-fused", 2), ("16x32w8s5", 3)]
)
def test_restructured_tiles_read_fp8(tile, num_splits):
    """The sweep's restructured candidates (full tiles unmasked in a pipelined loop, the tail
    masked once; ``-fused``: the split combine in the kernel) over FP8 entries, dense (pages of
    16 under 16-entry tiles: one page id per tile) and sparse."""
    q, pool, table, lens, _ = _dense_case(seed=14)
    q = q.to(torch.bfloat16)
    rows = dequantized_cache(pool, D_V, q.dtype)
    kw = dict(softmax_scale=SCALE, num_splits=num_splits)
    with forced_tile(tile):
        o, lse = mla_decode_partial(q, pool, table, lens, **kw)
    _check(o, lse, mla_decode_reference(q, rows, table, lens, SCALE), torch.bfloat16)
    idx = table.long()[0, :2, None] * PAGE + torch.arange(PAGE, device=DEVICE)
    idx = idx.reshape(1, -1).expand(3, -1).clone()
    idx[:, 5] = -1
    idx = idx.to(torch.int32)
    with forced_tile(tile.replace("-fused", ""), sparse=True):
        o, lse = mla_sparse_partial(q, pool, idx, **kw)
    _check(o, lse, mla_sparse_reference(q, rows, idx, SCALE), torch.bfloat16)


def test_csr_page_table():
    q, pool, table, lens, _ = _dense_case(seed=3)
    q = q.to(torch.bfloat16)
    indptr = torch.arange(0, 10, 3, dtype=torch.int32, device=DEVICE)
    o, lse = mla_decode_partial_csr(
        q, pool, indptr, table.reshape(-1).contiguous(), lens, softmax_scale=SCALE, num_splits=2
    )
    ref = mla_decode_reference(q, dequantized_cache(pool, D_V, q.dtype), table, lens, SCALE)
    _check(o, lse, ref, torch.bfloat16)


def test_split_ckv_kpe_caches_and_split_queries():
    """FlashInfer's layout: ``kv_pool`` latent + scales ``[.., 528]`` uint8 and ``kpe_pool``
    bf16 ``[.., 64]``, ``q`` / ``q_pe`` apart; dense and sparse."""
    q, pool, table, lens, _ = _dense_case(seed=4)
    q = q.to(torch.bfloat16)
    ckv = pool[..., :LATENT].contiguous()
    kpe = pool[..., LATENT:].contiguous().view(torch.bfloat16)
    q_lat, q_pe = q[..., :D_V].contiguous(), q[..., D_V:].contiguous()
    kw = dict(softmax_scale=SCALE, num_splits=1, q_pe=q_pe, kpe_pool=kpe)
    o, lse = mla_decode_partial(q_lat, ckv, table, lens, **kw)
    ref = mla_decode_reference(q, dequantized_cache(pool, D_V, q.dtype), table, lens, SCALE)
    _check(o, lse, ref, torch.bfloat16)
    idx = torch.tensor([[5, -1, 3], [-1, -1, -1], [12, 7, -1]], dtype=torch.int32, device=DEVICE)
    idx = torch.where(idx >= 0, table.long()[0, 0] * PAGE + idx, -1).to(torch.int32)
    o, lse = mla_sparse_partial(q_lat, ckv, idx, **kw)
    ref = mla_sparse_reference(q, dequantized_cache(ckv, D_V, q.dtype, kpe), idx, SCALE)
    _check(o, lse, ref, torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_sparse_top_k_with_unused_slots(num_splits):
    gen = torch.Generator().manual_seed(5)
    B, topk = 2, 70
    idx = torch.randperm(BLOCKS * PAGE, generator=gen)[: B * topk].reshape(B, topk)
    idx[:, ::4] = -1
    pool, _ = _pool(gen, idx[idx >= 0])
    q = torch.randn(B, H, D_V + D_R, generator=gen).to(DEVICE, torch.bfloat16)
    idx = idx.to(torch.int32).to(DEVICE)
    o, lse = mla_sparse_partial(q, pool, idx, softmax_scale=SCALE, num_splits=num_splits)
    ref = mla_sparse_reference(q, dequantized_cache(pool, D_V, q.dtype), idx, SCALE)
    _check(o, lse, ref, torch.bfloat16)


def test_flashmla_layout_mtp_causal_and_sparse():
    """FlashMLA's interface: ``q [b, s_q, h, 576]``, ``k_cache [blocks, page, 1, 656]``
    float8_e4m3fn with ``is_fp8_kvcache=True``; ``s_q = 2`` causal (token ``i`` attends the
    first ``len - s_q + i + 1`` entries) and the sparse call with ``indices [b, s_q, topk]``."""
    q, pool, table, lens, _ = _dense_case(seed=6, lens=(30, 1, 17))
    b, s_q = 3, 2
    q4 = torch.randn(b, s_q, H, D_V + D_R, generator=torch.Generator().manual_seed(7))
    q4 = q4.to(DEVICE, torch.bfloat16)
    k_cache = pool.view(torch.float8_e4m3fn)[:, :, None]
    o, lse = mla_decode_with_kvcache(
        q4, k_cache, table, lens, softmax_scale=SCALE, causal=True, is_fp8_kvcache=True
    )
    rows = dequantized_cache(pool, D_V, q4.dtype)
    for i in range(s_q):
        lens_i = (lens - s_q + i + 1).clamp_min(0).to(torch.int32)
        ref = mla_decode_reference(q4[:, i], rows, table, lens_i, SCALE)
        _check(o[:, i], lse[:, :, i], ref, torch.bfloat16)
    idx = table.long()[0, 0] * PAGE + torch.arange(12, device=DEVICE).expand(b, 12)
    idx = torch.stack([idx, torch.where(idx % 3 == 0, -1, idx)], dim=1).to(torch.int32)
    o, lse = mla_sparse_with_kvcache(q4, k_cache, idx, softmax_scale=SCALE, is_fp8_kvcache=True)
    for i in range(s_q):
        ref = mla_sparse_reference(q4[:, i], rows, idx[:, i], SCALE)
        _check(o[:, i], lse[:, :, i], ref, torch.bfloat16)
    with pytest.raises(ValueError, match="is_fp8_kvcache"):
        mla_decode_with_kvcache(q4, k_cache, table, lens, softmax_scale=SCALE)


def test_flashinfer_split_layout():
    """FlashInfer's MLA wrapper: ``ckv_cache`` FP8 latent + scales ``[.., 528]``, ``kpe_cache``
    bf16, CSR, ``q_nope`` / ``q_pe``; base-2 lse."""
    q, pool, table, lens, _ = _dense_case(seed=11)
    q = q.to(torch.bfloat16)
    ckv = pool[..., :LATENT].contiguous()
    kpe = pool[..., LATENT:].contiguous().view(torch.bfloat16)
    indptr = torch.arange(0, 10, 3, dtype=torch.int32, device=DEVICE)
    o, lse2 = mla_paged_attention(
        q[..., :D_V].contiguous(), q[..., D_V:].contiguous(), ckv, kpe, indptr,
        table.reshape(-1).contiguous(), lens, sm_scale=SCALE, return_lse=True, num_splits=1,
    )  # fmt: skip
    ref = mla_decode_reference(q, dequantized_cache(pool, D_V, q.dtype), table, lens, SCALE)
    _check(o, lse2 * math.log(2.0), ref, torch.bfloat16)


def test_every_finite_e4m3_byte_decodes_as_torch_does():
    """One entry whose latent bytes are every finite e4m3 value (subnormals, -0, the largest),
    scale 1, attended alone: ``o`` is the decoded row exactly (a bf16 value, one weight of 1),
    on the GPU's conversion and on the interpreter's. (0x7F / 0xFF, NaN, are refused on the
    host: the interpreter would read them as 480.)"""
    byte = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    entry = torch.zeros(1, 1, ENTRY, dtype=torch.uint8)
    entry[0, 0, :D_V] = byte.repeat(3)[:D_V]
    entry[0, 0, D_V:LATENT] = torch.ones(4).view(torch.uint8)
    q = torch.zeros(1, H, D_V + D_R, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, dtype=torch.int32)
    o, _ = mla_sparse_partial(q.to(DEVICE), entry.to(DEVICE), idx.to(DEVICE), softmax_scale=1.0)
    want = entry[0, 0, :D_V].view(torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(o.cpu()[0], want.expand(H, D_V))  # (-0 comes back +0: 0 + p * -0)


def test_torch_backend_equals_the_kernels():
    q, pool, table, lens, _ = _dense_case(seed=8)
    q = q.to(torch.bfloat16)
    kw = dict(softmax_scale=SCALE, num_splits=1)
    for name, bound in (("triton", None), ("torch", "compiled")):
        o, lse = backend_ops(name).mla_decode_partial(q, pool, table, lens, **kw)
        ref = mla_decode_reference(q, dequantized_cache(pool, D_V, q.dtype), table, lens, SCALE)
        _check(o, lse, ref, torch.bfloat16, bound)
    idx = (table.long()[0, :2] * PAGE + torch.arange(3, device=DEVICE)[:, None]).reshape(1, 6)
    idx = idx.expand(3, 6).to(torch.int32)
    got = [
        ops.mla_sparse_partial(q, pool, idx, **kw)
        for ops in (backend_ops("triton"), backend_ops("torch"))
    ]
    _check(*got[0], (got[1][0].double(), got[1][1].double()), torch.bfloat16, "compiled")


def _quantization_bounds(q, x, xq, slot):
    """Bounds on what quantizing the cache moves in exact attention of ``q [H, 576]`` over the
    entries ``slot`` (``x``: the original rows, ``xq``: the dequantized ones, flat ``[N, 576]``
    fp64): ``(d, do)`` a priori, from ``docs/fp8-cache.md``'s per-value bound ``|dx| <= e =
    max(2**-4 |x|, 2**-10 scale)`` (the RoPE part exact), and ``(d, do)`` a posteriori, from the
    actual ``dx``. Score ``j`` moves by ``SCALE q . dx_j``, at most ``SCALE sum_i |q_i| e_ji``
    a priori; with ``d`` the largest move, ``|dlse| <= d`` and a weight moves by a factor
    within ``exp(+-2 d)``, so with
    ``o = sum_j p_j v_j``: ``|do_c| <= max_j |dv_jc| + (exp(2 d) - 1) sum_j p_j |v_jc - o_c|``
    (``sum_j (p'_j - p_j) = 0``). Per head ``d`` [H], per head and dim ``do`` [H, 512]."""
    xs, dx = x[slot], (xq[slot] - x[slot])[:, :D_V]
    lat = xs[:, :D_V]
    amax = lat.reshape(-1, 4, 128).abs().amax(-1)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / 448, min=1e-4))))
    e = torch.maximum(lat.abs() / 16, scale.repeat_interleave(128, -1) / 1024)
    assert bool((dx.abs() <= e).all())  # the format's per-value bound (test_fp8_cache too)
    p = torch.softmax(SCALE * q @ xs.T, dim=-1)  # [H, n]
    spread = torch.einsum("hn,hnc->hc", p, (lat[None] - (p @ lat)[:, None]).abs())
    d_prior = (SCALE * q[:, :D_V].abs() @ e.T).amax(-1)
    d_post = (SCALE * q[:, :D_V] @ dx.T).abs().amax(-1)  # the scores' actual moves
    return [
        (d, err.amax(0)[None, :] + torch.expm1(2 * d)[:, None] * spread)
        for d, err in ((d_prior, e), (d_post, dx.abs()))
    ]


def test_quantization_error_against_the_original_cache_stays_within_its_bound():
    """Reported apart from the kernels' bound: exact (fp64) attention over the dequantized rows
    against exact attention over the original bf16 rows, within the bound propagated from the
    format's per-value one and within the tighter one from the actual errors
    (``_quantization_bounds``); the measured error and both bounds are printed."""
    q, pool, table, lens, rows = _dense_case(seed=9, lens=(45, 33, 17))
    q = q.to(torch.bfloat16)
    xq = dequantized_cache(pool, D_V, torch.float32)
    deq = mla_decode_reference(q, xq, table, lens, SCALE)
    orig = mla_decode_reference(q, rows, table, lens, SCALE)
    x, xq = rows.double().cpu().reshape(-1, D_V + D_R), xq.double().cpu().reshape(-1, D_V + D_R)
    for b in range(q.shape[0]):
        t = torch.arange(int(lens[b]))
        slot = table.long().cpu()[b, t // PAGE] * PAGE + t % PAGE
        prior, post = _quantization_bounds(q[b].double().cpu(), x, xq, slot)
        dlse = (deq[1][b] - orig[1][b]).abs().cpu()
        dout = (deq[0][b] - orig[0][b]).abs().cpu()
        print(f"row {b}: |dlse| {float(dlse.max()):.2e} (bounds {float(post[0].max()):.2e} / "
              f"{float(prior[0].max()):.2e}), |do| {float(dout.max()):.2e} (bounds "
              f"{float(post[1].max()):.2e} / {float(prior[1].max()):.2e})")  # fmt: skip
        for d, do in (post, prior):
            assert bool((dlse <= d).all()) and bool((dout <= do).all())
        assert float(dout.max()) > 0  # (the quantization does move the output)


def test_bad_fp8_input_is_named():
    q, pool, table, lens, _ = _dense_case(seed=10)
    q = q.to(torch.bfloat16)
    kw = dict(softmax_scale=SCALE, num_splits=1)
    with pytest.raises(ValueError, match=r"kv_pool: expected FP8 entries of 656 bytes"):
        mla_decode_partial(q, pool[..., :655], table, lens, **kw)
    with pytest.raises(ValueError, match=r"kv_pool: expected FP8 entries of 528 bytes"):
        mla_decode_partial(q, pool, table, lens, kpe_pool=pool[..., :64].half(), **kw)
    kpe = pool[..., LATENT:].contiguous().view(torch.bfloat16)
    with pytest.raises(TypeError, match=r"kpe_pool: expected torch.bfloat16"):
        mla_decode_partial(
            q, pool[..., :LATENT].contiguous(), table, lens, kpe_pool=kpe.half(), **kw
        )
    first = int(table[0, 0])  # row 0's first page: attended
    for value in (float("nan"), -1.0, 0.0, float("inf")):
        bad = pool.clone()
        bad[first, 3, D_V + 4 : D_V + 8] = torch.tensor([value]).view(torch.uint8).to(DEVICE)
        with pytest.raises(ValueError, match=r"kv_pool: expected every scale .*\(scale 1 of"):
            mla_decode_partial(q, bad, table, lens, **kw)
        with pytest.raises(ValueError, match=r"kv_pool: expected every scale"):
            idx = torch.full((3, 4), first * PAGE + 3, dtype=torch.int32, device=DEVICE)
            mla_sparse_partial(q, bad, idx, **kw)
    bad = pool.clone()
    bad[first, 0, 7] = 0x7F
    with pytest.raises(ValueError, match=r"kv_pool: expected no NaN latent byte .* byte 7"):
        mla_decode_partial(q, bad, table, lens, **kw)
    # Entries not attended may hold anything (they are all 0xFF here): no error
    unused = pool.clone()
    unused[int(table[1, 0])] = 0xFF  # row 1 has length 0
    mla_decode_partial(q, unused, table, lens, **kw)
    with pytest.raises(ValueError, match=r"tile: expected a classic or '-pipe' tile for an FP8"):
        with forced_tile("16x32w8s2-tma"):
            mla_decode_partial(q, pool, table, lens, **kw)


def test_the_entry_check_finds_a_bad_entry_in_any_chunk(monkeypatch):
    """The host check gathers the attended entries a chunk at a time (millions of entries in a
    production batch): a bad scale in a later chunk is found and named all the same."""
    from mqnc.triton_kernels.fp8 import cache as fp8_cache

    monkeypatch.setattr(fp8_cache, "_CHUNK", 8)
    q, pool, table, lens, _ = _dense_case(seed=12)
    last = int(table[0, 2])  # row 0's third page: tokens 32..44, in its last chunks
    pool[last, 10, D_V + 12 : D_V + 16] = torch.tensor([-2.0]).view(torch.uint8).to(DEVICE)
    with pytest.raises(ValueError, match=rf"scale 3 of token slot {last * PAGE + 10}, 1 entries"):
        mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, num_splits=1)


def test_planning_without_operands_reads_the_pool_as_fp8():
    """``plan_decode`` / ``plan_sparse`` (the holders' unchecked planning path) given an FP8
    pool and no checked operands launch the FP8 variants, not a 16-bit read of the bytes."""
    from mqnc.triton_kernels.mla.decode import plan_decode
    from mqnc.triton_kernels.mla.sparse import plan_sparse

    q, pool, table, lens, _ = _dense_case(seed=13)
    q = q.to(torch.bfloat16)
    o, lse = plan_decode(q, pool, table, lens, SCALE, D_V, 1).run()
    _check(
        o,
        lse,
        mla_decode_reference(q, dequantized_cache(pool, D_V, q.dtype), table, lens, SCALE),
        torch.bfloat16,
    )
    idx = (table.long()[0, 0] * PAGE + torch.arange(5, device=DEVICE)).expand(3, 5)
    plan = plan_sparse(q, pool, idx.to(torch.int32), SCALE, D_V, 1)
    assert plan.launches[0].name.startswith("mla_sparse-fp8[")


# ---- the FP8 see-saw (sm_90; opt-in until a GPU run verifies it) --------------------------


def _fp8_seesaw_why(op: str) -> str | None:
    from mqnc.triton_kernels.dispatch import Case, Target, choose, force_backend

    if DEVICE.type != "cuda":
        return "the FP8 see-saw runs on a CUDA sm_90 device only"
    with force_backend(op, "gluon"):
        try:
            choose(Case(op, kv="fp8"), Target.of(DEVICE))
        except ValueError as exc:
            return str(exc)
    return None


def _fp8_pages(gen, lengths, page):
    """A padded table over shuffled ``page``-entry pages holding rows of ``lengths`` entries,
    -1 past each row's pages; every entry not attended all 0xFF: ``(pool, table, lens)``."""
    pages = [math.ceil(n / page) for n in lengths]
    blocks = sum(pages) + 2
    perm = torch.randperm(blocks, generator=gen)
    table = torch.full((len(lengths), max(max(pages), 1)), -1, dtype=torch.int32)
    used, k = [], 0
    for b, n in enumerate(lengths):
        for j in range(pages[b]):
            table[b, j] = int(perm[k])
            used += [int(perm[k]) * page + t for t in range(min(page, n - j * page))]
            k += 1
    pool, _ = _pool(gen, torch.tensor(used, dtype=torch.long), blocks, page)
    lens = torch.tensor(lengths, dtype=torch.int32)
    return pool, table.to(DEVICE), lens.to(DEVICE)


@pytest.mark.parametrize(
    ("heads", "lengths", "page", "splits"),
    [(128, (1, 65, 200, 0), 64, None), (128, (300, 1, 128), 64, 3), (16, (2048, 700), 64, 8),
     (100, (129, 64), 16, None), (64, (90, 1), 1, 2)],
)  # fmt: skip
def test_the_fp8_seesaw_dense_matches_fp64(heads, lengths, page, splits):
    """The FP8 see-saw forced over a padded page table, against fp64 over the dequantized
    cache on an sm_90 GPU: lengths 0, 1 and partial pages, pages of 64 / 16 / 1, split and
    unsplit, 16 / 64 / 100 / 128 heads, every entry not attended 0xFF (NaN bytes) and the
    table -1 past each row's pages. Skipped elsewhere (Gluon: no interpreter runs it);
    ``perf/gpu_fastpath.sh`` runs such cases too."""
    why = _fp8_seesaw_why("mla_decode")
    if why is not None:
        pytest.skip(why)
    from mqnc.triton_kernels.dispatch import force_backend

    gen = torch.Generator().manual_seed(sum(lengths) + heads)
    pool, table, lens = _fp8_pages(gen, lengths, page)
    q = torch.randn(len(lengths), heads, D_V + D_R, generator=gen).to(DEVICE, torch.bfloat16)
    with force_backend("mla_decode", "gluon"):
        o, lse = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, num_splits=splits)
    safe = table.clamp_min(0)
    ref = mla_decode_reference(q, dequantized_cache(pool, D_V, q.dtype), safe, lens, SCALE)
    _check(o, lse, ref, torch.bfloat16)


def test_the_fp8_seesaw_mtp_causal_matches_fp64():
    """FlashMLA's call on the FP8 see-saw, forced: ``s_q`` 2 causal (token ``i`` attends the
    first ``len - s_q + i + 1`` entries) over ``k_cache [blocks, 64, 1, 656]`` float8_e4m3fn,
    a row of one entry (its first token attends nothing) included."""
    why = _fp8_seesaw_why("mla_decode")
    if why is not None:
        pytest.skip(why)
    from mqnc.triton_kernels.dispatch import force_backend

    gen = torch.Generator().manual_seed(11)
    pool, table, lens = _fp8_pages(gen, (130, 1, 64), 64)
    b, s_q = 3, 2
    q4 = torch.randn(b, s_q, 128, D_V + D_R, generator=gen).to(DEVICE, torch.bfloat16)
    k_cache = pool.view(torch.float8_e4m3fn)[:, :, None]
    with force_backend("mla_decode", "gluon"):
        o, lse = mla_decode_with_kvcache(
            q4, k_cache, table, lens, softmax_scale=SCALE, causal=True, is_fp8_kvcache=True
        )
    rows = dequantized_cache(pool, D_V, q4.dtype)
    for i in range(s_q):
        lens_i = (lens - s_q + i + 1).clamp_min(0).to(torch.int32)
        ref = mla_decode_reference(q4[:, i], rows, table.clamp_min(0), lens_i, SCALE)
        _check(o[:, i], lse[:, :, i], ref, torch.bfloat16)


@pytest.mark.parametrize(
    ("B", "heads", "topk", "splits", "page"),
    [(1, 128, 2048, None, 64), (3, 128, 2048, 4, 64), (2, 16, 300, None, 16), (4, 100, 700, 3, 1),
     (2, 64, 64, 1, 64)],
)  # fmt: skip
def test_the_fp8_seesaw_sparse_matches_fp64(B, heads, topk, splits, page):
    """The FP8 see-saw forced over a top-k selection, against fp64 over the dequantized cache
    on an sm_90 GPU: -1 slots (every fourth), a partial top-k (the first row's second half
    -1), an all-empty row, every entry outside the selection all 0xFF, split and unsplit, pages
    of 64 / 16 / 1."""
    why = _fp8_seesaw_why("mla_sparse")
    if why is not None:
        pytest.skip(why)
    from mqnc.triton_kernels.dispatch import force_backend

    gen = torch.Generator().manual_seed(topk + heads + B)
    blocks = (math.ceil(topk / page) + 1) * B + 2
    idx = torch.stack([torch.randperm(blocks * page, generator=gen)[:topk] for _ in range(B)])
    idx[:, ::4] = -1
    idx[0, topk // 2 :] = -1
    if B > 2:
        idx[2] = -1
    pool, _ = _pool(gen, idx[idx >= 0].unique(), blocks, page)
    q = torch.randn(B, heads, D_V + D_R, generator=gen).to(DEVICE, torch.bfloat16)
    idx = idx.to(torch.int32).to(DEVICE)
    with force_backend("mla_sparse", "gluon"):
        o, lse = mla_sparse_partial(q, pool, idx, softmax_scale=SCALE, num_splits=splits)
    ref = mla_sparse_reference(q, dequantized_cache(pool, D_V, q.dtype), idx, SCALE)
    _check(o, lse, ref, torch.bfloat16)
