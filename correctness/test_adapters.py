"""The ecosystem adapters against the package's own call on the same data.

Each layout is an adapter over the same kernels, so each is compared bit for bit
(``same_kernel``: atol 0) with the plain call that the layout stands for, at the same split
count: FlashMLA's ``[b, s_q, h_q, d]`` queries and ``[b, h_q, s_q]`` lse (causal or not) with
the plain call over an explicitly repeated table and the per-token lengths FlashMLA's rule
gives; CSR page tables and page size 1 with the padded table over the same entries; split
``ckv`` / ``kpe`` caches (and ``q_nope`` / ``q_pe``) with the fused cache; FlashInfer's MLA
call (CSR + split + base-2 lse) with the plain call; the splice into one cache per layer with
the splice into the stacked pool; the merge's ``layout="BMHD"`` with the transposed call; the
masked merge with the unmasked one on the rows it merges. Outputs are NaN-poisoned (conftest),
pool padding is NaN, so an unwritten element or a read past a row's length fails. One fp64
check per layout with the default split choice closes the loop.
"""

from __future__ import annotations

import math

import pytest
import torch

from mqnc.model import RopeSpec
from mqnc.reference import (
    mla_decode_reference,
    mla_sparse_reference,
    partial_attention_reference,
    rope_splice_reference,
)
from mqnc.reference.merge_ref import merge_reference
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.triton_kernels import (
    lse_from_base2,
    lse_to_base2,
    merge_partials,
    merge_partials_into,
    mla_decode_partial,
    mla_decode_partial_csr,
    mla_sparse_partial,
    rope_splice,
)
from mqnc.triton_kernels.adapters.flashinfer import (
    BatchMLAPagedAttentionWrapper,
    merge_state,
    merge_state_in_place,
    merge_states,
    mla_paged_attention,
)
from mqnc.triton_kernels.adapters.flashmla import (
    flash_mla_with_kvcache,
    flashmla_from_partial,
    get_mla_metadata,
    mla_decode_with_kvcache,
    mla_sparse_with_kvcache,
    partial_from_flashmla,
)
from mqnc.triton_kernels.splice.rotate import PlainRope

D_QK, D_V = 576, 512
SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2
DEVICE = default_device()


def same(actual, expected, name):
    dt = expected.dtype if expected.dtype != torch.float32 else "float32"
    assert_close(actual, expected, tolerance("same_kernel", dt), name=name)


def paged(lengths, page, dtype, gen, spare=2):
    """A NaN-padded pool ``[nb, page, 576]`` holding ``lengths[b]`` N(0, 1) entries per row in
    shuffled pages; ``(pool, table [B, W] int32 (-1 past a row), lens [B] int32)``."""
    pages = [math.ceil(n / page) for n in lengths]
    nb = sum(pages) + spare
    pool = torch.full((nb, page, D_QK), float("nan"))
    perm = torch.randperm(nb, generator=gen)
    table = torch.full((len(lengths), max(max(pages), 1)), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lengths):
        v = torch.randn(n, D_QK, generator=gen)
        for j in range(pages[b]):
            blk = int(perm[used])
            used += 1
            table[b, j] = blk
            part = v[j * page : (j + 1) * page]
            pool[blk, : part.shape[0]] = part
    lens = torch.tensor(lengths, dtype=torch.int32)
    return pool.to(DEVICE, dtype), table.to(DEVICE), lens.to(DEVICE)


def csr_of(table, lens, page):
    """The padded table's used pages as a CSR table ``(kv_indptr, kv_indices)``."""
    rows = [table[b, : math.ceil(int(n) / page)] for b, n in enumerate(lens.tolist())]
    counts = torch.tensor([0] + [r.numel() for r in rows])
    indptr = counts.cumsum(0).to(torch.int32).to(DEVICE)
    return indptr, torch.cat(rows).to(torch.int32)


def token_slots(table, lens, page):
    """Page size 1 of the same data: every entry's flat slot, as a CSR table of tokens."""
    rows = []
    for b, n in enumerate(lens.tolist()):
        t = torch.arange(n, device=table.device)
        rows.append(table[b, t // page].long() * page + t % page)
    counts = torch.tensor([0] + [int(n) for n in lens.tolist()])
    return counts.cumsum(0).to(torch.int32).to(DEVICE), torch.cat(rows).to(torch.int32)


def queries(rows, heads, dtype, gen, width=D_QK):
    return torch.randn(rows, heads, width, generator=gen).to(DEVICE, dtype)


# ---- FlashMLA: [b, s_q, h_q, d] queries, [b, h_q, s_q] lse, causal -------------------------


@pytest.mark.parametrize("s_q, causal", [(1, False), (2, True), (3, True), (3, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flashmla_layout_equals_the_plain_call(s_q, causal, dtype):
    """FlashMLA's rule: query token ``i`` of ``s_q`` attends the first ``len - s_q + i + 1``
    entries when causal (the new tokens are the cache's last ``s_q``), all ``len`` otherwise;
    a sequence shorter than ``s_q`` leaves its first tokens empty (o 0, lse -inf)."""
    gen = torch.Generator().manual_seed(10 + s_q)
    pool, table, lens = paged([40, 2, 23], 16, dtype, gen)
    b, h = 3, 4
    q = queries(b * s_q, h, dtype, gen).view(b, s_q, h, D_QK)
    o, lse = mla_decode_with_kvcache(
        q, pool[:, :, None], table, lens, softmax_scale=SCALE, causal=causal, num_splits=2
    )
    assert o.shape == (b, s_q, h, D_V) and lse.shape == (b, h, s_q)
    i = torch.arange(s_q, device=DEVICE).repeat(b)
    row_lens = lens.repeat_interleave(s_q)
    if causal:
        row_lens = (row_lens - (s_q - 1 - i)).clamp(min=0)
    row_lens = row_lens.to(torch.int32)
    rows = table.repeat_interleave(s_q, 0)
    o_ref, lse_ref = mla_decode_partial(
        q.reshape(b * s_q, h, D_QK), pool, rows, row_lens, softmax_scale=SCALE, num_splits=2
    )
    same(o.reshape(b * s_q, h, D_V), o_ref, "o")
    same(lse.transpose(1, 2).reshape(b * s_q, h), lse_ref, "lse")
    # and against fp64 at the default split choice
    o, lse = mla_decode_with_kvcache(q, pool, table, lens, softmax_scale=SCALE, causal=causal)
    o64, lse64 = mla_decode_reference(q.reshape(b * s_q, h, D_QK), pool, rows, row_lens, SCALE)
    assert_close(o.reshape(b * s_q, h, D_V), o64, tolerance("mla", dtype), name="o vs fp64")
    assert_close(lse.transpose(1, 2).reshape(b * s_q, h), lse64, tolerance("mla_lse", "float32"))


def test_flashmla_sparse_layout_equals_the_plain_call():
    gen = torch.Generator().manual_seed(11)
    b, s_q, h, topk = 2, 2, 4, 40
    pool = torch.randn(4, 16, D_QK, generator=gen).to(DEVICE)
    idx = torch.randint(-1, 64, (b, s_q, topk), generator=gen, dtype=torch.int32).to(DEVICE)
    q = queries(b * s_q, h, torch.float32, gen).view(b, s_q, h, D_QK)
    o, lse = mla_sparse_with_kvcache(q, pool[:, :, None], idx, softmax_scale=SCALE, num_splits=1)
    o_ref, lse_ref = mla_sparse_partial(
        q.reshape(-1, h, D_QK), pool, idx.reshape(b * s_q, topk), softmax_scale=SCALE, num_splits=1
    )
    same(o.reshape(-1, h, D_V), o_ref, "o")
    same(lse.transpose(1, 2).reshape(-1, h), lse_ref, "lse")
    # FlashMLA's topk_length: only the leftmost topk_length[i] indices of sequence i count
    length = torch.tensor([7, 40], dtype=torch.int32, device=DEVICE)
    o_len, lse_len = mla_sparse_with_kvcache(
        q, pool, idx, softmax_scale=SCALE, topk_length=length, num_splits=1
    )
    cut = idx.clone()
    cut[0, :, 7:] = -1
    o_cut, lse_cut = mla_sparse_with_kvcache(q, pool, cut, softmax_scale=SCALE, num_splits=1)
    same(o_len, o_cut, "o (topk_length)")
    same(lse_len, lse_cut, "lse (topk_length)")


def test_outputs_are_laid_out_as_the_libraries_return_them():
    """FlashMLA's dense call returns a contiguous lse ``[b, h_q, s_q]`` (its sparse call the
    transposed view); FlashInfer's MLA ``run`` returns ``o`` alone unless ``return_lse``, base 2
    unless ``return_lse_base_on_e``."""
    gen = torch.Generator().manual_seed(12)
    pool, table, lens = paged([40, 23], 16, torch.float32, gen)
    q = queries(6, 4, torch.float32, gen).view(2, 3, 4, D_QK)
    o, lse = mla_decode_with_kvcache(q, pool, table, lens, softmax_scale=SCALE, causal=True)
    assert lse.shape == (2, 4, 3) and lse.is_contiguous() and lse.view(2, -1).shape == (2, 12)
    indptr, indices = token_slots(table, lens, 16)
    ckv = pool[..., :D_V].reshape(-1, 1, D_V).clone()
    kpe = pool[..., D_V:].reshape(-1, 1, D_QK - D_V).clone()
    qn, qp = q[:, 0, :, :D_V].contiguous(), q[:, 0, :, D_V:].contiguous()
    args = (qn, qp, ckv, kpe, indptr, indices, lens)
    alone = mla_paged_attention(*args, sm_scale=SCALE, num_splits=1)
    assert isinstance(alone, torch.Tensor) and alone.shape == (2, 4, D_V)
    o2, lse2 = mla_paged_attention(*args, sm_scale=SCALE, num_splits=1, return_lse=True)
    oe, lse_e = mla_paged_attention(
        *args, sm_scale=SCALE, num_splits=1, return_lse=True, return_lse_base_on_e=True
    )
    same(alone, o2, "o alone")
    same(oe, o2, "o (base e)")
    assert_close(lse_e, lse2 * math.log(2), tolerance("mla_lse", "float32"), name="lse base e")
    with pytest.raises(TypeError, match="return_lse_base_on_e: expected a bool"):
        mla_paged_attention(*args, sm_scale=SCALE, return_lse=True, return_lse_base_on_e=1)


def test_flashmla_outputs_to_the_merge_and_back():
    """FlashMLA's documented return values (``flash_mla_with_kvcache``: ``out [batch_size,
    seq_len_q, num_heads_q, head_dim_v]``, ``softmax_lse [batch_size, num_heads_q, seq_len_q]``
    float32) as the merge's partials ``[b * s_q, h, d_v]`` / ``[b * s_q, h]`` (row
    ``b_i * s_q + i``) and back, element for element; FlashMLA's empty-row ``+inf`` kept."""
    b, s_q, h, d_v = 2, 3, 4, 8
    o = torch.arange(b * s_q * h * d_v, dtype=torch.float32).view(b, s_q, h, d_v).bfloat16()
    lse = torch.arange(b * h * s_q, dtype=torch.float32).view(b, h, s_q)
    lse[1, 2, 0] = float("inf")
    o2, lse2 = partial_from_flashmla(o, lse)
    assert o2.shape == (b * s_q, h, d_v) and lse2.shape == (b * s_q, h)
    assert o2.dtype == torch.bfloat16 and lse2.dtype == torch.float32 and lse2.is_contiguous()
    for bi in range(b):
        for i in range(s_q):
            assert torch.equal(o2[bi * s_q + i], o[bi, i])
            assert torch.equal(lse2[bi * s_q + i], lse[bi, :, i])
    o4, lse3 = flashmla_from_partial(o2, lse2, s_q)
    assert torch.equal(o4, o) and torch.equal(lse3, lse) and lse3.is_contiguous()
    assert flashmla_from_partial(o2, lse2)[1].shape == (b * s_q, h, 1)  # s_q = 1: one per row
    bad = [
        (lambda: partial_from_flashmla(o2, lse), ValueError, "o: expected 4 dims"),
        (lambda: partial_from_flashmla(o, lse.double()), TypeError, "lse: invalid dtype"),
        (lambda: partial_from_flashmla(o, lse.transpose(1, 2)), ValueError, "lse: expected shape"),
        (lambda: partial_from_flashmla(o.int(), lse), TypeError, "o: invalid dtype"),
        (lambda: flashmla_from_partial(o2, lse2, 4), ValueError, "expected b \\* s_q rows"),
        (lambda: flashmla_from_partial(o2, lse2, True), TypeError, "s_q: expected an int"),
        (lambda: flashmla_from_partial(o2, lse2[:, :2], 3), ValueError, "lse: expected shape"),
        (lambda: flashmla_from_partial(o2, lse2[None], 3), ValueError, "lse: expected 2 dims"),
    ]
    for call, kind, needle in bad:
        with pytest.raises(kind, match=needle):
            call()


def test_flashmla_layout_partials_merge_to_one_call():
    """Three holders each attend one page of every sequence in FlashMLA's layout (``s_q = 2``);
    their outputs, converted by ``partial_from_flashmla``, merge to one call over all pages."""
    gen = torch.Generator().manual_seed(13)
    pool, table, lens = paged([40, 23], 16, torch.float32, gen)
    b, s_q, h = 2, 2, 4
    q = queries(b * s_q, h, torch.float32, gen).view(b, s_q, h, D_QK)

    def partial(t, n):
        return partial_from_flashmla(*mla_decode_with_kvcache(q, pool, t, n, softmax_scale=SCALE))

    one = partial(table, lens)
    parts = [partial(table[:, j : j + 1], (lens - 16 * j).clamp(0, 16)) for j in range(3)]
    o, lse = merge_partials(
        torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), layout="MBHD"
    )
    assert_close(o, one[0], tolerance("mla_routed", torch.float32), name="o")
    assert_close(lse, one[1], tolerance("mla_lse", "float32"), name="lse")


# ---- page size 1 and CSR page tables (SGLang, FlashInfer) ----------------------------------


@pytest.mark.parametrize("table_kind", ["csr", "tokens"])
def test_csr_tables_and_token_pools_equal_the_padded_call(table_kind):
    """The CSR table of the padded table's pages (FlashInfer), and the token table of the same
    entries in a page-1 view of the pool (SGLang's token pool, CSR), read the same entries in
    the same order as the padded call."""
    gen = torch.Generator().manual_seed(20)
    pool, table, lens = paged([50, 0, 17], 16, torch.float32, gen)
    q = queries(3, 4, torch.float32, gen)
    o_ref, lse_ref = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, num_splits=1)
    if table_kind == "csr":  # offsets that start past two unused (out-of-range) entries
        indptr, indices = csr_of(table, lens, 16)
        indptr = indptr + 2
        indices = torch.cat([torch.full((2,), 999, dtype=torch.int32, device=DEVICE), indices])
        view = pool
    else:
        indptr, indices = token_slots(table, lens, 16)
        view = pool.reshape(-1, 1, D_QK)
    o, lse = mla_decode_partial_csr(
        q, view, indptr, indices, lens, softmax_scale=SCALE, num_splits=1
    )
    same(o, o_ref, "o")
    same(lse, lse_ref, "lse")
    if table_kind == "tokens":  # lengths derived from the table (whole pages of one token)
        o2, _ = mla_decode_partial_csr(q, view, indptr, indices, softmax_scale=SCALE, num_splits=1)
        same(o2, o_ref, "o (kv_lens from kv_indptr)")


@pytest.mark.parametrize("page", [1, 2, 8])
def test_padded_tables_take_any_power_of_two_page(page):
    """Page sizes below 16 (SGLang's 1) through the padded table, against fp64."""
    gen = torch.Generator().manual_seed(30 + page)
    pool, table, lens = paged([37, 5], page, torch.bfloat16, gen)
    q = queries(2, 16, torch.bfloat16, gen)
    o, lse = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE)
    o64, lse64 = mla_decode_reference(q, pool, table, lens, SCALE)
    assert_close(o, o64, tolerance("mla", torch.bfloat16), name="o")
    assert_close(lse, lse64, tolerance("mla_lse", "float32"), name="lse")


def test_csr_split_choice_without_a_host_sync():
    """``check_inputs=False`` without ``max_kv_len``: the split policy takes every page of
    ``kv_indices`` as the capacity (no sync); with ``max_kv_len`` it plans for the longest row.
    Both match fp64."""
    gen = torch.Generator().manual_seed(40)
    pool, table, lens = paged([300, 64, 5], 16, torch.float32, gen)
    indptr, indices = csr_of(table, lens, 16)
    q = queries(3, 4, torch.float32, gen)
    o64, lse64 = mla_decode_reference(q, pool, table, lens, SCALE)
    for kw in ({}, {"max_kv_len": 300}):
        o, lse = mla_decode_partial_csr(
            q, pool, indptr, indices, lens, softmax_scale=SCALE, check_inputs=False, **kw
        )
        assert_close(o, o64, tolerance("mla", torch.float32), name=f"o {kw}")
        assert_close(lse, lse64, tolerance("mla_lse", "float32"), name=f"lse {kw}")


# ---- split ckv / kpe caches, q_nope / q_pe (FlashInfer) ------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_caches_equal_the_fused_cache(dtype):
    """Separate latent and rope tensors (copies here, so their strides differ from the fused
    pool's) read in place give the fused call's bits; dense and sparse, split cache with a
    fused query and split both."""
    gen = torch.Generator().manual_seed(50)
    pool, table, lens = paged([45, 80], 16, dtype, gen)
    ckv, kpe = pool[..., :D_V].clone(), pool[..., D_V:].clone()
    q = queries(2, 20, dtype, gen)  # 20 heads: the 32-head tile
    q_nope, q_pe = q[..., :D_V].clone(), q[..., D_V:].clone()
    o_ref, lse_ref = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, num_splits=2)
    for qq, qpe in ((q, None), (q_nope, q_pe)):
        o, lse = mla_decode_partial(
            qq, ckv, table, lens, softmax_scale=SCALE, num_splits=2, q_pe=qpe, kpe_pool=kpe
        )
        same(o, o_ref, "o")
        same(lse, lse_ref, "lse")
    idx = torch.randint(-1, pool.shape[0] * 16, (2, 48), generator=gen, dtype=torch.int32)
    idx = torch.where(idx >= 0, table[0, 0].cpu() * 16 + idx % 16, idx).to(DEVICE)  # finite rows
    s_ref = mla_sparse_partial(q, pool, idx, softmax_scale=SCALE, num_splits=1)
    s = mla_sparse_partial(
        q_nope, ckv, idx, softmax_scale=SCALE, num_splits=1, q_pe=q_pe, kpe_pool=kpe
    )
    same(s[0], s_ref[0], "sparse o")
    same(s[1], s_ref[1], "sparse lse")


@pytest.mark.parametrize("s_q, causal", [(1, False), (2, True)])
def test_flashinfer_mla_call_equals_the_plain_call(s_q, causal):
    """FlashInfer's MLA layout (q_nope / q_pe, ckv / kpe at page size 1, CSR table, kv_len)
    against the plain call; its lse is base 2 (``lse_to_base2`` of the plain call's)."""
    gen = torch.Generator().manual_seed(60 + s_q)
    pool, table, lens = paged([33, 70], 16, torch.float32, gen)
    indptr, indices = token_slots(table, lens, 16)
    ckv = pool[..., :D_V].reshape(-1, 1, D_V).clone()
    kpe = pool[..., D_V:].reshape(-1, 1, D_QK - D_V).clone()
    q = queries(2 * s_q, 4, torch.float32, gen)
    o, lse2 = mla_paged_attention(
        q[..., :D_V].contiguous(),
        q[..., D_V:].contiguous(),
        ckv,
        kpe,
        indptr,
        indices,
        lens,
        sm_scale=SCALE,
        causal=causal,
        num_splits=1,
        return_lse=True,
    )
    i = torch.arange(s_q, device=DEVICE).repeat(2)
    row_lens = lens.repeat_interleave(s_q) - ((s_q - 1 - i) if causal else 0)
    o_ref, lse_ref = mla_decode_partial(
        q,
        pool,
        table.repeat_interleave(s_q, 0),
        row_lens.to(torch.int32),
        softmax_scale=SCALE,
        num_splits=1,
    )
    same(o, o_ref, "o")
    same(lse2, lse_to_base2(lse_ref), "lse (base 2)")


# ---- the documented flows, unchanged but for the import line ------------------------------


def _causal_rows(table, lens, s_q, causal):
    """The plain call's rows for FlashMLA's ``[b, s_q]`` tokens: the table repeated, and each
    token's length by FlashMLA's bottom-right rule."""
    i = torch.arange(s_q, device=DEVICE).repeat(lens.shape[0])
    row_lens = lens.repeat_interleave(s_q)
    if causal:
        row_lens = (row_lens - (s_q - 1 - i)).clamp(min=0)
    return table.repeat_interleave(s_q, 0), row_lens.to(torch.int32)


@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flashmla_readme_flow_runs_unchanged(s_q, dtype):
    """FlashMLA's README, as written: ``get_mla_metadata(cache_seqlens, s_q * h_q // h_kv,
    h_kv)`` once, then per layer ``flash_mla_with_kvcache(q_i, kvcache_i, block_table,
    cache_seqlens, dv, tile_scheduler_metadata, num_splits, causal=True)`` with FlashMLA's
    default scale ``q.shape[-1] ** -0.5``, against fp64 with that scale; the schedule, reused by
    every layer, refuses a call of another config by the field's name."""
    gen = torch.Generator().manual_seed(90 + s_q)
    b, h_q, h_kv, d, dv = 2, 16, 1, D_QK, D_V
    pool, block_table, cache_seqlens = paged([150, 1], 64, dtype, gen)  # a 1-entry sequence
    tile_scheduler_metadata, num_splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
    rows, row_lens = _causal_rows(block_table, cache_seqlens, s_q, True)
    for layer in range(2):
        kvcache_i = pool.roll(layer, -1)[:, :, None]  # another layer's entries, same pages
        q_i = queries(b * s_q, h_q, dtype, gen).view(b, s_q, h_q, d)
        o_i, lse_i = flash_mla_with_kvcache(
            q_i, kvcache_i, block_table, cache_seqlens, dv,
            tile_scheduler_metadata, num_splits, causal=True,
        )  # fmt: skip
        assert o_i.shape == (b, s_q, h_q, dv) and o_i.dtype == dtype
        assert lse_i.shape == (b, h_q, s_q) and lse_i.dtype == torch.float32
        assert not o_i.isnan().any() and not lse_i.isnan().any()
        o64, lse64 = mla_decode_reference(
            q_i.reshape(b * s_q, h_q, d), kvcache_i[:, :, 0], rows, row_lens, d**-0.5
        )
        assert_close(o_i.reshape(b * s_q, h_q, dv), o64, tolerance("mla", dtype), name="o")
        lse = lse_i.transpose(1, 2).reshape(b * s_q, h_q)
        assert_close(lse, lse64, tolerance("mla_lse", "float32"), name="lse")
    if s_q == 2:  # the 1-entry sequence's first token attends nothing: mqnc's -inf
        assert torch.isneginf(lse_i[1, :, 0]).all() and (o_i[1, 0] == 0).all()
    config = tile_scheduler_metadata.config
    assert (config.b, config.s_q, config.h_q, config.page_block_size, config.causal) == (
        b, s_q, h_q, 64, True,
    )  # fmt: skip
    for change, field in (({"h_q": 8}, "h_q"), ({"causal": False}, "causal")):
        q = q_i[:, :, : change.get("h_q", h_q)]
        with pytest.raises(ValueError, match=f"tile_scheduler_metadata: expected {field} = "):
            flash_mla_with_kvcache(
                q, kvcache_i, block_table, cache_seqlens, dv, tile_scheduler_metadata,
                num_splits, causal=change.get("causal", True),
            )  # fmt: skip


def _sink_reference(o64, lse64, sink):
    """FlashMLA's sink in fp64: ``o * exp(lse) / (exp(lse) + exp(sink[h]))``."""
    keep = torch.sigmoid(lse64 - sink.double())
    keep = torch.where(torch.isneginf(sink.double()).expand_as(keep), 1.0, keep)
    return o64 * keep[..., None]


def test_flashmla_sparse_flow_with_sink_and_extra_tokens():
    """FlashMLA's sparse call (``indices``, ``topk_length``, block_table / cache_seqlens None),
    its ``attn_sink`` (finite, +inf, -inf) and extra tokens from a second cache
    (``extra_k_cache``, ``extra_indices_in_kvcache``, ``extra_topk_length``: a second partial
    merged with the first), each against fp64 (the extra tokens: attention over the
    concatenated rows of both selections); a token with nothing selected gives lse -inf, o 0."""
    gen = torch.Generator().manual_seed(95)
    b, s_q, h, topk, extra_topk, page = 2, 2, 16, 40, 24, 64
    pool = torch.randn(3, page, 1, D_QK, generator=gen).to(DEVICE)
    extra_pool = torch.randn(2, page, 1, D_QK, generator=gen).to(DEVICE)
    idx = torch.randint(-1, 3 * page, (b, s_q, topk), generator=gen, dtype=torch.int32)
    extra = torch.randint(-1, 2 * page, (b, s_q, extra_topk), generator=gen, dtype=torch.int32)
    idx[0, 0], extra[0, 0] = -1, -1  # token (0, 0): nothing in either selection
    idx, extra = idx.to(DEVICE), extra.to(DEVICE)
    length = torch.tensor([13, topk], dtype=torch.int32, device=DEVICE)
    extra_length = torch.tensor([extra_topk, 9], dtype=torch.int32, device=DEVICE)
    sink = torch.tensor([0.5, -2.0, 3.0, float("inf"), float("-inf")] + [1.0] * 11).to(DEVICE)
    q = queries(b * s_q, h, torch.float32, gen).view(b, s_q, h, D_QK)
    rows = q.reshape(b * s_q, h, D_QK)

    def cut(indices, n):  # the leftmost n[b] indices of sequence b
        keep = torch.arange(indices.shape[2], device=DEVICE) < n[:, None, None]
        return torch.where(keep, indices, -1).reshape(b * s_q, -1)

    def check(o, lse, o64, lse64, what):
        assert_close(o.reshape(b * s_q, h, D_V), o64, tolerance("mla", torch.float32), name=what)
        lse = lse.transpose(1, 2).reshape(b * s_q, h)
        assert_close(lse, lse64, tolerance("mla_lse", "float32"), name=f"lse ({what})")

    sched, splits = get_mla_metadata()
    o, lse = flash_mla_with_kvcache(
        q, pool, None, None, D_V, sched, splits, softmax_scale=SCALE, indices=idx,
        topk_length=length,
    )  # fmt: skip
    o64, lse64 = mla_sparse_reference(rows, pool[:, :, 0], cut(idx, length), SCALE)
    check(o, lse, o64, lse64, "sparse")
    o, lse = flash_mla_with_kvcache(
        q, pool, None, None, D_V, sched, splits, softmax_scale=SCALE, indices=idx,
        topk_length=length, attn_sink=sink,
    )  # fmt: skip
    check(o, lse, _sink_reference(o64, lse64, sink), lse64, "sparse, sink")
    assert (o[:, :, 3] == 0).all()  # +inf sink

    sched, splits = get_mla_metadata()
    o, lse = flash_mla_with_kvcache(
        q, pool, None, None, D_V, sched, splits, softmax_scale=SCALE, indices=idx,
        topk_length=length, attn_sink=sink, extra_k_cache=extra_pool,
        extra_indices_in_kvcache=extra, extra_topk_length=extra_length,
    )  # fmt: skip
    assert sched.config.extra_topk == extra_topk and sched.config.extra_page_block_size == page
    sel, extra_sel = cut(idx, length), cut(extra, extra_length)
    union = torch.cat(
        [pool.reshape(-1, D_QK)[sel.clamp(min=0).long()],
         extra_pool.reshape(-1, D_QK)[extra_sel.clamp(min=0).long()]], dim=1,
    )  # fmt: skip
    valid = torch.cat([sel >= 0, extra_sel >= 0], dim=1)
    o64, lse64 = partial_attention_reference(rows, union, valid, SCALE)
    check(o, lse, _sink_reference(o64, lse64, sink), lse64, "sparse + extra, sink")
    assert torch.isneginf(lse[0, :, 0]).all() and (o[0, 0] == 0).all()


class FlashMLASchedMeta:  # FlashMLA's own schedule class (another module's), as a caller has it
    pass


def _drop_in_bad_calls():
    torch.set_default_device(DEVICE)  # every tensor below; reset by the caller
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q = torch.randn(1, 2, 4, D_QK, generator=gen)
    cache = torch.randn(2, 16, 1, D_QK, generator=gen)
    table, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    idx = torch.zeros(1, 2, 3, dtype=torch.int32)

    def mla(*args, **kw):
        sched = kw.pop("sched") if "sched" in kw else get_mla_metadata()[0]
        head = (q, cache, table, lens, D_V, sched, kw.pop("num_splits", None))
        return flash_mla_with_kvcache(*(args or head), **kw)

    def wrapper(**kw):
        return BatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.int8), **kw)

    def planned(s_q_steps=(0, 1, 2), **kw):
        w = wrapper()
        plan = dict(
            qo_indptr=torch.tensor(s_q_steps, dtype=torch.int32),
            kv_indptr=torch.tensor([0, 1, 2], dtype=torch.int32),
            kv_indices=torch.tensor([0, 1], dtype=torch.int32),
            kv_len_arr=torch.tensor([3, 5], dtype=torch.int32),
            num_heads=4, head_dim_ckv=D_V, head_dim_kpe=64, page_size=16, causal=False,
            sm_scale=SCALE, q_data_type=torch.float32, kv_data_type=torch.float32,
        )  # fmt: skip
        w.plan(**(plan | kw))
        return w

    qn, qp = torch.zeros(2, 4, D_V), torch.zeros(2, 4, 64)
    ckv, kpe = cache[:, :, 0, :D_V], cache[:, :, 0, D_V:]
    return [
        # FlashMLA's old interface: int32 tensors as the schedule and the split counts
        (lambda: mla(sched=torch.zeros(8, 8, dtype=torch.int32)), TypeError,
         r"tile_scheduler_metadata: expected the schedule of mqnc's get_mla_metadata .* got a "
         r"torch.Tensor of shape \(8, 8\), int32; import get_mla_metadata from "
         r"mqnc.triton_kernels.adapters.flashmla"),
        (lambda: mla(num_splits=torch.zeros(2, dtype=torch.int32)), TypeError,
         r"num_splits: expected None .* got a torch.Tensor of shape \(2,\), int32; pass None"),
        (lambda: mla(sched=FlashMLASchedMeta()), TypeError,
         r"tile_scheduler_metadata: .* got a test_adapters.FlashMLASchedMeta; import"),
        (lambda: mla(q, cache, None, lens, D_V, get_mla_metadata()[0]), ValueError,
         "block_table: expected a tensor for dense attention"),
        (lambda: mla(topk_length=lens), ValueError, "topk_length: expected None without indices"),
        (lambda: mla(q, cache, None, None, D_V, get_mla_metadata()[0], indices=idx, causal=True),
         ValueError, "causal: expected False with indices"),
        (lambda: mla(q, cache, None, None, D_V, get_mla_metadata()[0], indices=idx,
                     extra_k_cache=cache), ValueError,
         "extra_indices_in_kvcache: expected a tensor with extra_k_cache"),
        (lambda: mla(q, cache, None, None, D_V, get_mla_metadata()[0], indices=idx,
                     extra_k_cache=cache, extra_indices_in_kvcache=idx + 99), ValueError,
         r"extra_indices_in_kvcache: expected -1 \(unused\) or a token id in \[0, 32\)"),
        (lambda: mla(attn_sink=torch.zeros(3)), ValueError, r"attn_sink: expected shape \(4,\)"),
        (lambda: mla(attn_sink=torch.zeros(4, dtype=torch.float64)), TypeError,
         "attn_sink: invalid dtype"),
        # FlashInfer's wrapper
        (lambda: planned(s_q_steps=(0, 1, 3)), ValueError,
         r"qo_indptr: expected equal steps from 0 .* got \[0, 1, 3\]"),
        (lambda: wrapper(backend="cutlass"), ValueError, "backend: expected one of"),
        (lambda: planned(use_profiler=True), ValueError, "use_profiler: expected False"),
        (lambda: planned(sm_scale=-1.0), ValueError, "sm_scale: expected a finite positive"),
        (lambda: wrapper(use_cuda_graph=True), TypeError,
         "qo_indptr: expected a torch.Tensor, got NoneType"),
        (lambda: wrapper().run(qn, qp, ckv, kpe), ValueError, "plan: expected plan"),
        (lambda: planned().run(qn, qp, ckv, kpe, profiler_buffer=torch.zeros(1)), ValueError,
         "profiler_buffer: expected None"),
        (lambda: planned().run(qn, qp, ckv, kpe, kv_len=lens), ValueError,
         "kv_len: expected None"),
        (lambda: planned().run(qn[:1], qp, ckv, kpe), ValueError, r"q_nope: expected shape"),
        (lambda: planned().run(qn, qp, ckv, kpe, out=qn.half()), TypeError, "out: invalid dtype"),
        (lambda: planned().run(qn, qp, ckv, kpe, lse=torch.zeros(2, 5)), ValueError,
         r"lse: expected shape \(2, 4\)"),
        (lambda: planned(page_size=1).run(qn, qp, ckv, kpe), ValueError,
         "ckv_cache: expected page_size 1"),
        (lambda: planned(kv_len_arr=torch.tensor([3, 99], dtype=torch.int32)).run(qn, qp, ckv, kpe),
         ValueError, "kv_len_arr: expected values"),
    ]  # fmt: skip


N_DROP_IN_BAD = 23


@pytest.mark.parametrize("i", range(N_DROP_IN_BAD))
def test_drop_in_flows_fail_in_one_line_naming_the_argument(i):
    """FlashMLA's old-style int32 schedule / split tensors, its own schedule object, and the
    arguments mqnc's kernels cannot take: one line (a ValueError / TypeError) naming the
    argument, what was expected and what was received."""
    try:
        calls = _drop_in_bad_calls()
        assert len(calls) == N_DROP_IN_BAD
        call, exc, match = calls[i]
        with pytest.raises(exc, match=match) as caught:
            call()
        assert "\n" not in str(caught.value)
    finally:
        torch.set_default_device(None)


def _flashinfer_case(page_size, s_q, dtype, gen, lengths=(150, 37), heads=16):
    """FlashInfer's docstring inputs for one batch: ``(qo_indptr, kv_indptr, kv_indices,
    kv_lens, q_nope, q_pe, ckv, kpe)`` over the pages of :func:`paged`, and the fp64
    reference's ``(q rows, pool, table, lens)``."""
    pool, table, lens = paged(list(lengths), 64, dtype, gen)
    if page_size == 1:
        kv_indptr, kv_indices = token_slots(table, lens, 64)
        cache = pool.reshape(-1, 1, D_QK)
    else:
        kv_indptr, kv_indices = csr_of(table, lens, 64)
        cache = pool
    B = len(lengths)
    q = queries(B * s_q, heads, dtype, gen)
    qo_indptr = (torch.arange(0, B + 1) * s_q).int().to(DEVICE)
    inputs = (
        qo_indptr, kv_indptr, kv_indices, lens, q[..., :D_V].clone(), q[..., D_V:].clone(),
        cache[..., :D_V].clone(), cache[..., D_V:].clone(),
    )  # fmt: skip
    return inputs, (q, pool, table, lens)


@pytest.mark.parametrize(
    "page_size, causal, s_q, dtype",
    [(1, False, 1, torch.bfloat16), (64, False, 1, torch.float32), (1, True, 2, torch.float32),
     (64, True, 2, torch.bfloat16)],
    ids=["page1-bf16", "page64-fp32", "page1-causal-sq2-fp32", "page64-causal-sq2-bf16"],
)  # fmt: skip
def test_flashinfer_wrapper_docstring_flow_runs_unchanged(page_size, causal, s_q, dtype):
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` docstring flow (workspace, ``plan`` with
    ``qo_indptr`` / ``kv_indptr`` / ``kv_indices`` / ``kv_lens`` and the twelve positional
    arguments, ``run(q_nope, q_pe, ckv, kpe, return_lse=False)``) against fp64; the lse base 2
    (FlashInfer's) or natural (``return_lse_base_on_e``); ``out=`` / ``lse=`` written in place
    (contiguous, or strided: copied into)."""
    gen = torch.Generator().manual_seed(100 + page_size + s_q)
    (qo_indptr, kv_indptr, kv_indices, kv_lens, q_nope, q_pe, ckv, kpe), ref = _flashinfer_case(
        page_size, s_q, dtype, gen
    )
    num_local_heads, head_dim_ckv, head_dim_kpe, sm_scale = 16, D_V, 64, SCALE
    mla_wrapper = BatchMLAPagedAttentionWrapper(
        torch.empty(128 * 1024, dtype=torch.int8).to(DEVICE), backend="fa2"
    )
    mla_wrapper.plan(
        qo_indptr, kv_indptr, kv_indices, kv_lens, num_local_heads, head_dim_ckv, head_dim_kpe,
        page_size, causal, sm_scale, q_nope.dtype, ckv.dtype,
    )  # fmt: skip
    o = mla_wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=False)
    assert isinstance(o, torch.Tensor) and o.shape == (2 * s_q, 16, D_V) and o.dtype == dtype
    assert not o.isnan().any()
    q, pool, table, lens = ref
    rows, row_lens = _causal_rows(table, lens, s_q, causal)
    o64, lse64 = mla_decode_reference(q, pool, rows, row_lens, SCALE)
    assert_close(o, o64, tolerance("mla", dtype), name="o")
    o2, lse2 = mla_wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    same(o2, o, "o (return_lse)")
    assert_close(lse2, lse64 / math.log(2), tolerance("mla_lse", "float32"), name="lse base 2")
    oe, lse_e = mla_wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True)
    assert_close(lse_e, lse64, tolerance("mla_lse", "float32"), name="lse base e")
    same(lse2, lse_to_base2(lse_e), "lse base 2 vs base e")
    if page_size == 64:  # in place: contiguous, then strided (copied into)
        for strided in (False, True):
            nan = dict(fill_value=float("nan"), device=DEVICE)
            if strided:
                out = torch.full((16, 2 * s_q, D_V), dtype=dtype, **nan).transpose(0, 1)
                lse = torch.full((16, 2 * s_q), **nan).t()
            else:
                out, lse = torch.full(o.shape, dtype=dtype, **nan), torch.full(lse2.shape, **nan)
            got = mla_wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, return_lse=True)
            assert got[0] is out and got[1] is lse
            same(out, o, f"out= (strided {strided})")
            same(lse, lse2, f"lse= (strided {strided})")


def test_flashinfer_wrapper_cuda_graph_buffers_are_read():
    """``use_cuda_graph=True``: ``plan()`` copies the page table and lengths into the buffers
    given to the wrapper (as FlashInfer's) and ``run`` reads them there; a second ``plan()``
    (new lengths, fewer pages) refills them and the next run follows: both equal the plain
    wrapper's output bit for bit."""
    gen = torch.Generator().manual_seed(110)
    (qo, kv_indptr, kv_indices, kv_lens, qn, qp, ckv, kpe), _ = _flashinfer_case(
        64, 1, torch.float32, gen, lengths=(150, 37), heads=4
    )
    bufs = dict(
        qo_indptr=torch.zeros(3, dtype=torch.int32, device=DEVICE),
        kv_indptr=torch.zeros(3, dtype=torch.int32, device=DEVICE),
        kv_indices=torch.full((16,), -1, dtype=torch.int32, device=DEVICE),
        kv_len_arr=torch.zeros(2, dtype=torch.int32, device=DEVICE),
    )
    workspace = torch.empty(1024, dtype=torch.int8, device=DEVICE)
    graph = BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=True, **bufs)
    plain = BatchMLAPagedAttentionWrapper(workspace)
    short = kv_lens - torch.tensor([100, 0], dtype=torch.int32, device=DEVICE)  # 50 and 37
    short_indptr = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    short_indices = torch.cat([kv_indices[:1], kv_indices[3:4]])
    for indptr, indices, lens in ((kv_indptr, kv_indices, kv_lens),
                                  (short_indptr, short_indices, short)):  # fmt: skip
        for w in (graph, plain):
            w.plan(qo, indptr, indices, lens, 4, D_V, 64, 64, False, SCALE, qn.dtype, ckv.dtype)
        assert torch.equal(bufs["kv_len_arr"], lens) and torch.equal(bufs["kv_indptr"], indptr)
        assert torch.equal(bufs["kv_indices"][: indices.shape[0]], indices)
        o = graph.run(qn, qp, ckv, kpe)
        assert not o.isnan().any()
        same(o, plain.run(qn, qp, ckv, kpe), f"o, lens {lens.tolist()}")


# ---- the splice into one cache per layer (vLLM, SGLang) ------------------------------------


@pytest.mark.parametrize("form", ["blocks", "one-head", "tokens", "unaligned"])
def test_splice_into_per_layer_caches_equals_the_stacked_pool(form):
    """One launch over a list of per-layer caches (``[nb, bs, D]``, ``[nb, bs, 1, D]``,
    ``[slots, D]``, or layers that are odd-element views of one buffer: the unaligned form
    falls back to element offsets) writes what the stacked pool's splice writes."""
    gen = torch.Generator().manual_seed(70)
    L, ct, nb, bs = 3, 21, 4, 16
    rope = RopeSpec.from_preset("deepseek-v2-lite")
    chunk = torch.randn(L, ct, D_QK, generator=gen).to(DEVICE)
    stacked = torch.full((L, nb, bs, D_QK), float("nan"), device=DEVICE)
    slots = torch.randperm(nb * bs, generator=gen)[:ct].to(DEVICE)
    expected = rope_splice_reference(chunk, stacked, slots, 1234, rope)
    rope_splice(chunk, stacked, slots, 1234, rope)
    if form == "unaligned":
        buf = torch.full((L * nb * bs * D_QK + L,), float("nan"), device=DEVICE)
        caches = [
            buf[1 + l * (nb * bs * D_QK + 1) :][: nb * bs * D_QK].view(nb, bs, D_QK)
            for l in range(L)
        ]
    else:
        caches = [torch.full((nb, bs, D_QK), float("nan"), device=DEVICE) for _ in range(L)]
        if form == "one-head":
            caches = [c[:, :, None] for c in caches]
        elif form == "tokens":
            caches = [c.view(nb * bs, D_QK) for c in caches]
    assert rope_splice(chunk, caches, slots, 1234, rope) is caches
    for layer, c in enumerate(caches):
        got = c.reshape(nb, bs, D_QK)
        same(got, stacked[layer], f"layer {layer}")
        assert_close(got, expected[layer], tolerance("rope", torch.float32), name="vs fp64")


# ---- the merge: an explicit axis, a mask, base-2 lse (FlashInfer) ----------------------------


def _partials(gen, M=3, T=4, H=2, D=64):
    o = torch.randn(M, T, H, D, generator=gen).to(DEVICE)
    lse = (3 * torch.randn(M, T, H, generator=gen)).to(DEVICE)
    lse[0, 1] = float("-inf")
    return o, lse


def test_merge_layout_names_the_axis_of_the_partials():
    """``layout="BMHD"`` (FlashInfer's ``[T, M, H, D]``) merges over the second axis, through
    strides: the transposed tensors merged as ``MBHD`` give the same bits."""
    gen = torch.Generator().manual_seed(80)
    o, lse = _partials(gen)
    ref = merge_partials(o, lse, layout="MBHD")
    got = merge_partials(
        o.transpose(0, 1).contiguous(), lse.transpose(0, 1).contiguous(), layout="BMHD"
    )
    same(got[0], ref[0], "o")
    same(got[1], ref[1], "lse")


def test_flashinfer_merges_in_base_2():
    """``merge_states`` / ``merge_state`` take and give base-2 lse (FlashInfer's): they agree
    with the fp64 merge of the natural-log values."""
    gen = torch.Generator().manual_seed(81)
    o, lse = _partials(gen)
    o64, lse64 = merge_reference(o, lse)
    v, s2 = merge_states(o.transpose(0, 1), lse_to_base2(lse).transpose(0, 1))
    assert_close(v, o64, tolerance("merge", torch.float32), name="merge_states o")
    assert_close(lse_from_base2(s2), lse64, tolerance("merge_lse", "float32"), name="lse")
    v, s2 = merge_state(o[0], lse_to_base2(lse[0]), o[1], lse_to_base2(lse[1]))
    o64, lse64 = merge_reference(o[:2], lse[:2])
    assert_close(v, o64, tolerance("merge", torch.float32), name="merge_state o")
    assert_close(lse_from_base2(s2), lse64, tolerance("merge_lse", "float32"), name="lse")


@pytest.mark.parametrize("base2", [False, True])
def test_masked_in_place_merge_leaves_other_rows_untouched(base2):
    """FlashInfer's ``merge_state_in_place`` mask: rows with mask false keep their bits (even
    NaN), the others equal the unmasked merge."""
    gen = torch.Generator().manual_seed(82)
    o, lse = _partials(gen)
    if base2:
        lse = lse_to_base2(lse)
    mask = torch.tensor([True, False, True, False], device=DEVICE)
    acc, lacc = o[0].clone(), lse[0].clone()
    acc[1] = float("nan")  # never read, never written
    full, lfull = o[0].clone(), lse[0].clone()
    merge_partials_into(full, lfull, o[1], lse[1], base2=base2)
    if base2:
        merge_state_in_place(acc, lacc, o[1], lse[1], mask=mask)
    else:
        merge_partials_into(acc, lacc, o[1], lse[1], mask=mask)
    same(acc[mask], full[mask], "merged rows")
    same(lacc[mask], lfull[mask], "merged lse")
    assert torch.isnan(acc[1]).all() and torch.equal(acc[3], o[0][3])
    assert torch.equal(lacc[~mask], lse[0][~mask])


# ---- bad input names the argument ----------------------------------------------------------


def _bad_calls():
    torch.set_default_device(DEVICE)  # every tensor below; reset by the caller
    q3, pool = torch.zeros(2, 4, D_QK), torch.zeros(2, 16, D_QK)
    table, lens = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    o, lse = torch.zeros(3, 2, 4, 8), torch.zeros(3, 2, 4)

    def paged(**change):  # FlashInfer's layout, two requests of one row each, one field changed
        args = dict(
            q_nope=torch.zeros(2, 4, D_V), q_pe=torch.zeros(2, 4, 64), ckv_cache=pool[..., :D_V],
            kpe_cache=pool[..., D_V:], kv_indptr=torch.tensor([0, 1, 2], dtype=torch.int32),
            kv_indices=torch.zeros(2, dtype=torch.int32), kv_len=torch.ones(2, dtype=torch.int32),
        )  # fmt: skip
        return mla_paged_attention(**(args | change), sm_scale=SCALE)

    return [
        (lambda: merge_partials(o, lse, layout="TMHD"), ValueError, "layout: expected 'MBHD'"),
        (
            lambda: merge_partials(o[0], lse[0], layout="BMHD"),
            ValueError,
            r"o: expected 4 dims \[T, M",
        ),
        (
            lambda: merge_partials(o, lse.transpose(1, 2), layout="BMHD"),
            ValueError,
            "lse: expected shape",
        ),
        (
            lambda: merge_partials_into(
                o[0], lse[0], o[1], lse[1], mask=torch.ones(3, dtype=torch.bool)
            ),
            ValueError,
            "mask: expected shape",
        ),
        (
            lambda: merge_partials_into(o[0], lse[0], o[1], lse[1], mask=torch.ones(2)),
            TypeError,
            "mask: invalid dtype",
        ),
        (
            lambda: mla_decode_with_kvcache(q3, pool, table, lens, softmax_scale=SCALE),
            ValueError,
            r"q: expected \[b, s_q, h_q, d\]",
        ),
        (
            lambda: mla_decode_with_kvcache(
                q3[:, None], torch.zeros(2, 16, 2, D_QK), table, lens, softmax_scale=SCALE
            ),
            ValueError,
            "k_cache: expected one KV head",
        ),
        (
            lambda: mla_decode_with_kvcache(
                q3.view(1, 2, 4, D_QK), pool, table, lens, softmax_scale=SCALE, causal=1
            ),
            TypeError,
            "causal",
        ),
        (
            lambda: mla_decode_partial_csr(
                q3,
                pool,
                torch.tensor([0, 2, 1], dtype=torch.int32),
                torch.zeros(2, dtype=torch.int32),
                softmax_scale=SCALE,
            ),
            ValueError,
            "kv_indptr: expected non-decreasing",
        ),
        (
            lambda: mla_decode_partial_csr(
                q3,
                pool,
                torch.tensor([0, 1, 2], dtype=torch.int32),
                torch.tensor([0, 7], dtype=torch.int32),
                softmax_scale=SCALE,
            ),
            ValueError,
            r"kv_indices: expected page ids in \[0, 2\)",
        ),
        (
            lambda: mla_decode_partial_csr(
                q3,
                pool,
                torch.tensor([0, 1, 2], dtype=torch.int32),
                torch.zeros(2, dtype=torch.int32),
                torch.tensor([3, 17], dtype=torch.int32),
                softmax_scale=SCALE,
            ),
            ValueError,
            "kv_lens: expected values",
        ),
        (
            lambda: mla_decode_partial(
                q3,
                pool[..., :D_V],
                table,
                lens,
                softmax_scale=SCALE,
                kpe_pool=torch.zeros(2, 16, 32),
            ),
            ValueError,
            "kpe_pool: expected shape",
        ),
        (
            lambda: mla_decode_partial(
                q3[..., :D_V], pool, table, lens, softmax_scale=SCALE, q_pe=torch.zeros(3, 4, 64)
            ),
            ValueError,
            r"q_pe: expected shape \(2, 4, '\*'\)",
        ),
        (
            lambda: rope_splice(
                torch.zeros(2, 3, D_QK),
                [torch.zeros(2, 16, D_QK)],
                torch.arange(3),
                1,
                PlainRope(tuple([1.0] * 32), 64, "interleaved"),
            ),
            ValueError,
            "pool: expected one cache per layer",
        ),
        (
            lambda: rope_splice(
                torch.zeros(2, 3, D_QK),
                [torch.zeros(2, 16, D_QK), torch.zeros(3, 16, D_QK)],
                torch.arange(3),
                1,
                PlainRope(tuple([1.0] * 32), 64, "interleaved"),
            ),
            ValueError,
            r"pool\[1\]: expected the shape, strides and device of pool\[0\]",
        ),
        (  # one cache given for two layers: the layers would overwrite each other
            lambda: rope_splice(
                torch.zeros(2, 3, D_QK),
                [pool, pool],
                torch.arange(3),
                1,
                PlainRope(tuple([1.0] * 32), 64, "interleaved"),
            ),
            ValueError,
            r"pool\[1\]: expected a cache of its own per layer, got memory shared with pool\[0\]",
        ),
        (
            lambda: mla_decode_with_kvcache(
                torch.zeros(2, 0, 4, D_QK), pool, table, lens, softmax_scale=SCALE
            ),
            ValueError,
            "s_q: expected an int >= 1, got 0",
        ),
        (
            lambda: paged(q_nope=torch.zeros(0, 4, D_V), q_pe=torch.zeros(0, 4, 64)),
            ValueError,
            "q_nope: expected N = B \\* s_q query rows, s_q >= 1",
        ),
        (lambda: paged(q_pe=None), TypeError, "q_pe: expected a torch.Tensor, got NoneType"),
        (
            lambda: paged(kpe_cache=None),
            TypeError,
            "kpe_cache: expected a torch.Tensor, got NoneType",
        ),
        (
            lambda: merge_state(o[0], lse[0], o[1].to(torch.bfloat16), lse[1]),
            TypeError,
            "v_b: invalid dtype",
        ),
        (
            lambda: merge_state(o[0], lse[0], o[1, ..., :4], lse[1]),
            ValueError,
            "v_b: expected shape",
        ),
        (
            lambda: merge_state(o[0], lse[0], o[1], lse[1, :, :3]),
            ValueError,
            "s_b: expected shape",
        ),
        (
            lambda: merge_partials(o[..., :0], lse, layout="MBHD"),
            ValueError,
            "o: expected D >= 1 values per row",
        ),
        (
            lambda: merge_partials_into(o[0, ..., :0], lse[0], o[1, ..., :0], lse[1]),
            ValueError,
            "o_acc: expected D >= 1 values per row",
        ),
        # an adapter's errors name its own arguments, not the kernels' (kv_pool, lse_acc, ...)
        (lambda: paged(kv_len=torch.ones(2, dtype=torch.int64)), TypeError, "kv_len: invalid"),
        (lambda: paged(ckv_cache=pool[..., :D_V].double()), TypeError, "ckv_cache: invalid"),
        (
            lambda: mla_decode_with_kvcache(
                q3[:, None], pool.double(), table, lens, softmax_scale=SCALE
            ),
            TypeError,
            "k_cache: invalid dtype",
        ),
        (
            lambda: mla_decode_with_kvcache(
                q3[:, None, :, :D_V], pool[..., :D_V], table, lens, softmax_scale=SCALE
            ),
            ValueError,
            r"q: expected a power of two >= 16",
        ),
        (
            lambda: merge_state(o[0], lse[0].half(), o[1], lse[1]),
            TypeError,
            "s_a: invalid dtype",
        ),
        (
            lambda: merge_state_in_place(o[0], lse[0, :, :3], o[1], lse[1]),
            ValueError,
            "s: expected shape",
        ),
        (
            lambda: mla_sparse_with_kvcache(
                q3.view(1, 2, 4, D_QK),
                pool,
                torch.tensor([[[0, 1, 2], [3, 4, 99]]], dtype=torch.int32),
                softmax_scale=SCALE,
            ),
            ValueError,
            r"got 99 at \[0, 1, 2\]",
        ),
        (
            lambda: mla_sparse_with_kvcache(
                q3.view(1, 2, 4, D_QK),
                pool,
                torch.zeros(1, 2, 3, dtype=torch.int32),
                softmax_scale=SCALE,
                topk_length=torch.ones(2, dtype=torch.int32),
            ),
            ValueError,
            "topk_length: expected shape",
        ),
    ]


N_BAD = 33


@pytest.mark.parametrize("i", range(N_BAD))
def test_adapters_reject_bad_input_naming_the_argument(i):
    try:
        calls = _bad_calls()
        assert len(calls) == N_BAD
        call, exc, match = calls[i]
        with pytest.raises(exc, match=match):
            call()
    finally:
        torch.set_default_device(None)
