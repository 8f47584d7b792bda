"""Sparse top-k partial MLA attention (``mla_sparse_partial``) against the fp64 reference, and
routed exactness under selection (§3.3, §5.4): a selected set scattered across the pool, split
among M holders that each hold only their entries, attended per holder and merged, equals one
call over the whole set.

Outputs are NaN-poisoned (conftest) and every pool slot that is not selected is NaN, so a read
of an unselected or masked (-1) slot fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqnc.reference import mla_sparse_reference
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.triton_kernels import merge_partials, mla_sparse_partial
from mqnc.triton_kernels.mla.plan import _WIDE, _WIDE_ELSE, TileConfig, forced_tile
from mqnc.triton_kernels.mla.sparse import plan_sparse

D_QK = 576
SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2  # DeepSeek-V2-Lite with YaRN
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Module-level rather than the ``device`` fixture: Hypothesis reuses function-scoped fixtures.
DEVICE = default_device()


def selection(gen, B, topk, pool_tokens, unused_frac):
    """``[B, topk]`` int32 indices drawn without replacement per row, a fraction set to -1."""
    rows = []
    for _ in range(B):
        idx = torch.randperm(pool_tokens, generator=gen)[:topk]
        drop = torch.rand(topk, generator=gen) < unused_frac
        rows.append(torch.where(drop, torch.full_like(idx, -1), idx))
    return torch.stack(rows).to(torch.int32)


def pool_with(indices, num_blocks, block_size, dtype, gen, scale=1.0):
    """A pool whose selected slots hold N(0, scale^2) entries and every other slot NaN."""
    flat = torch.full((num_blocks * block_size, D_QK), float("nan"))
    sel = indices[indices >= 0].long().unique()
    flat[sel] = scale * torch.randn(sel.numel(), D_QK, generator=gen)
    return flat.reshape(num_blocks, block_size, D_QK).to(device=DEVICE, dtype=dtype)


@given(
    dtype=st.sampled_from(DTYPES),
    heads=st.sampled_from([1, 5, 16, 24]),
    block_size=st.sampled_from([16, 64]),
    B=st.integers(1, 3),
    topk=st.integers(1, 200),
    unused_frac=st.sampled_from([0.0, 0.3, 1.0]),
    num_splits=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**16),
)
def test_sparse_matches_fp64_reference(
    dtype, heads, block_size, B, topk, unused_frac, num_splits, seed
):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = math.ceil(topk / block_size) + 3
    indices = selection(gen, B, topk, num_blocks * block_size, unused_frac)
    pool = pool_with(indices, num_blocks, block_size, dtype, gen)
    q = torch.randn(B, heads, D_QK, generator=gen).to(device=DEVICE, dtype=dtype)
    indices = indices.to(DEVICE)
    o, lse = mla_sparse_partial(q, pool, indices, softmax_scale=SCALE, num_splits=num_splits)
    o_ref, lse_ref = mla_sparse_reference(q, pool, indices, SCALE)
    assert_close(o, o_ref, tolerance("mla", dtype), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


# Every sparse tile chosen above 32 heads, under any triton (``mla.plan._WIDE``).
WIDE_SPARSE = sorted({t[1].label for t in [*_WIDE.values(), _WIDE_ELSE]})


@pytest.mark.parametrize("tile", WIDE_SPARSE)
@pytest.mark.parametrize("heads,B,topk,num_splits", [(40, 2, 70, None), (128, 1, 100, 3)])
def test_sparse_wide_tiles_match_fp64(tile, heads, B, topk, num_splits):
    """More than 32 heads at each tile the launcher may choose for them (a partial head block
    at 40 heads; masked indices; split and unsplit), in bf16 against fp64."""
    gen = torch.Generator().manual_seed(heads)
    num_blocks = math.ceil(topk / 64) + 3
    indices = selection(gen, B, topk, num_blocks * 64, 0.3)
    pool = pool_with(indices, num_blocks, 64, torch.bfloat16, gen)
    q = torch.randn(B, heads, D_QK, generator=gen).to(DEVICE, torch.bfloat16)
    indices = indices.to(DEVICE)
    with forced_tile(tile, sparse=True):
        plan = plan_sparse(q, pool, indices, SCALE, 512, num_splits)
        assert TileConfig.of_launch(plan.launches[0]).label == tile
        o, lse = mla_sparse_partial(q, pool, indices, softmax_scale=SCALE, num_splits=num_splits)
    o_ref, lse_ref = mla_sparse_reference(q, pool, indices, SCALE)
    assert_close(o, o_ref, tolerance("mla", torch.bfloat16), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


def test_sparse_rows_with_no_valid_index_are_empty():
    gen = torch.Generator().manual_seed(4)
    indices = torch.tensor([[-1] * 40, [3, -1, 70, 5] * 10, [-1] * 40], dtype=torch.int32)
    pool = pool_with(indices, 4, 32, torch.float32, gen)
    q = torch.randn(3, 16, D_QK, generator=gen).to(DEVICE)
    o, lse = mla_sparse_partial(q, pool, indices.to(DEVICE), softmax_scale=SCALE, num_splits=2)
    for b in (0, 2):
        assert torch.equal(o[b], torch.zeros_like(o[b])) and torch.isneginf(lse[b]).all()
    o_ref, lse_ref = mla_sparse_reference(q, pool, indices.to(DEVICE), SCALE)
    assert_close(o, o_ref, tolerance("mla", torch.float32), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


def test_fp32_tolerance_covers_scores_summed_in_the_gpus_order():
    """The fp32 bound (``tolerance("mla", "float32")``) holds for scores rounded as a GPU sums
    them: each 576-term score one sequential fp32 chain (the interpreter's numpy matmul sums
    pairwise, ~3x closer). Inputs of ``perf/gpu_tiles.sh``'s fp32 check (H 128, top-64, scale
    0.1), where an H200 measured 1.05e-5 max-abs; here the rest of the call is in fp64."""
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(0)
    B, H, ct, scale = 2, 128, 256, 0.1
    q = torch.randn(B, H, D_QK, generator=g)
    pool = torch.randn(B * ct // 64, 64, D_QK, generator=g)
    idx = torch.randperm(B * ct, generator=g)[: B * 64].view(B, 64).to(torch.int32)
    o_ref, _ = mla_sparse_reference(q.double(), pool.double(), idx, scale)
    flat = pool.reshape(-1, D_QK).numpy()
    o = np.empty((B, H, 512))
    for b in range(B):
        k, qb = flat[idx[b].long().numpy()], q[b].numpy()
        acc = np.zeros((H, k.shape[0]), np.float32)
        for i in range(D_QK):  # acc = fl(acc + fl(q_i k_i)), i = 0..575 (an FMA rounds once)
            acc += np.float32(qb[:, i : i + 1] * k[:, i])
        s_ = acc.astype(np.float64) * np.float32(scale)
        p_ = np.exp(s_ - s_.max(1, keepdims=True))
        o[b] = (p_ @ k[:, :512].astype(np.float64)) / p_.sum(1, keepdims=True)
    stats = assert_close(torch.from_numpy(o), o_ref, tolerance("mla", "float32"), name="o")
    print(f"fp32 scores in sequence, o vs fp64: {stats}")
    assert stats.max_abs > 5e-6  # what the bound is for: the sequential order's rounding


@settings(max_examples=12)  # up to 9 launches per example: keep the suite's CPU time bounded
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    topk=st.integers(64, 160),  # more than a 64-entry tile, split over up to 8 holders
    holders=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_routed_sparse_equals_one_call(dtype, topk, holders, seed):
    """A top-k set scattered over a 4096-entry store, each entry assigned at random to one of M
    holders; holder i holds only its entries (every other slot of its pool is NaN) and attends
    its part of the selection; the merged partials equal one call over the whole set."""
    gen = torch.Generator().manual_seed(seed)
    B, H, block_size, num_blocks = 1, 16, 64, 64  # (batches: test_sparse_* against fp64)
    indices = selection(gen, B, topk, num_blocks * block_size, 0.0)
    # Entries ~ N(0, 0.15^2), q ~ N(0, 1.25^2): |o| < 0.25, the premise of the bf16 bound.
    store = pool_with(indices, num_blocks, block_size, dtype, gen, scale=0.15)
    q = (1.25 * torch.randn(B, H, D_QK, generator=gen)).to(device=DEVICE, dtype=dtype)
    owner = torch.randint(0, holders, (num_blocks * block_size,), generator=gen)
    partials = []
    for i in range(holders):
        mine = (owner == i).to(DEVICE)
        held = torch.where(mine[:, None], store.reshape(-1, D_QK), float("nan"))
        held = held.reshape(store.shape).to(dtype)
        idx = indices.to(DEVICE)
        idx = torch.where(mine[idx.long()], idx, torch.full_like(idx, -1))
        partials.append(mla_sparse_partial(q, held, idx, softmax_scale=SCALE))
    o_routed, lse_routed = merge_partials(
        torch.stack([p[0] for p in partials]), torch.stack([p[1] for p in partials]), layout="MBHD"
    )
    o_one, lse_one = mla_sparse_partial(q, store, indices.to(DEVICE), softmax_scale=SCALE)
    assert float(o_one.abs().max()) < 0.25
    assert_close(o_routed, o_one, tolerance("mla_routed", dtype), name="o routed vs one call")
    assert_close(lse_routed, lse_one, tolerance("mla_lse", "float32"), name="lse routed")


def _inputs():
    gen = torch.Generator().manual_seed(5)
    indices = selection(gen, 2, 8, 64, 0.25)
    pool = pool_with(indices, 4, 16, torch.float32, gen)
    q = torch.randn(2, 4, D_QK, generator=gen).to(DEVICE)
    return q, pool, indices.to(DEVICE)


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: {**a, "indices": a["indices"].long()}, TypeError, "indices"),
        (lambda a: {**a, "indices": a["indices"][:1]}, ValueError, "indices"),
        (lambda a: {**a, "indices": a["indices"] + 64}, ValueError, r"indices: .*\[0, 64\)"),
        (lambda a: {**a, "indices": a["indices"] - 100}, ValueError, "indices"),
        (lambda a: {**a, "q": a["q"].to(torch.bfloat16)}, TypeError, "kv_pool"),
        (lambda a: {**a, "kv_pool": a["kv_pool"][..., :320]}, ValueError, "kv_pool"),
        (lambda a: {**a, "softmax_scale": float("nan")}, ValueError, "softmax_scale"),
        (lambda a: {**a, "num_splits": -1}, ValueError, "num_splits"),
    ],
)
def test_sparse_bad_input_names_the_argument(mutate, exc, match):
    q, pool, indices = _inputs()
    args = mutate(dict(q=q, kv_pool=pool, indices=indices, softmax_scale=SCALE))
    with pytest.raises(exc, match=match):
        mla_sparse_partial(args.pop("q"), args.pop("kv_pool"), args.pop("indices"), **args)


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("fn", ["mla_sparse_partial", "plan_mla_sparse"])
def test_a_new_users_mistakes_name_the_argument_expected_and_got(fn, case):
    """As for the dense op (one validation, ``mla.plan.mla_operands``): a 512-wide query blames
    q with the width expected and received, FlashMLA's 4-D cache is named with its fix, a dtype
    mismatch says the pool must match q and gives both."""
    from test_mla_decode import _first_mistakes

    import mqnc.triton_kernels as tk

    q, pool, indices = _inputs()
    q_bad, pool_bad, exc, match = _first_mistakes(q, pool)[case]
    with pytest.raises(exc, match=match):
        getattr(tk, fn)(q_bad, pool_bad, indices, softmax_scale=SCALE)


def test_sparse_index_check_can_be_switched_off():
    """With ``check_indices=False`` the host check is skipped (no sync); valid input still
    matches the reference."""
    q, pool, indices = _inputs()
    o, lse = mla_sparse_partial(q, pool, indices, softmax_scale=SCALE, check_indices=False)
    o_ref, lse_ref = mla_sparse_reference(q, pool, indices, SCALE)
    assert_close(o, o_ref, tolerance("mla", torch.float32), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


# ---- the sparse gather see-saw (sm_90; opt-in until a GPU run verifies it) ------------------


def test_the_compaction_puts_each_rows_valid_indices_first():
    """The gather see-saw's compaction (``mla.gluon_plan.compact_launch``, interpreted here):
    each row's valid indices (``>= 0``) first, in their order, their count as the row's length,
    over several of the kernel's 1024-index blocks; a row of -1 (and other negatives) only is
    empty. Entries past a row's count are never read, so not compared."""
    from mqnc.triton_kernels.mla.gluon_plan import compact_launch

    gen = torch.Generator().manual_seed(5)
    K = 2500
    idx = selection(gen, 3, K, 8000, 0.4)
    idx[1] = -1
    idx[2, ::7] = -5  # (any negative is unused)
    idx = idx.to(DEVICE)
    out = torch.full_like(idx, -(2**31))
    lens = torch.full((3,), -1, dtype=torch.int32, device=DEVICE)
    compact_launch(idx, out, lens)()
    for b in range(3):
        want = idx[b][idx[b] >= 0].cpu()
        assert int(lens[b]) == want.numel()
        assert torch.equal(out[b, : want.numel()].cpu(), want)


def test_a_compacted_selection_attends_as_the_original():
    """What the gather see-saw attends after the compaction (the valid indices first, their
    count as the row's length) is the call's selection: the ``tl`` kernel over the compacted
    rows (-1 past each count) equals the fp64 reference over the original ones, -1 slots, an
    all-empty row and NaN in every unselected slot included."""
    from mqnc.triton_kernels.mla.gluon_plan import compact_launch

    gen = torch.Generator().manual_seed(6)
    idx = selection(gen, 3, 300, 40 * 64, 0.5)
    idx[2] = -1
    pool = pool_with(idx, 40, 64, torch.float32, gen)
    q = torch.randn(3, 16, D_QK, generator=gen).to(DEVICE)
    idx = idx.to(DEVICE)
    out, lens = torch.empty_like(idx), torch.empty(3, dtype=torch.int32, device=DEVICE)
    compact_launch(idx, out, lens)()
    pos = torch.arange(idx.shape[1], device=DEVICE)[None, :]
    compacted = torch.where(pos < lens[:, None].long(), out, torch.full_like(out, -1))
    o, lse = mla_sparse_partial(q, pool, compacted, softmax_scale=SCALE)
    o_ref, lse_ref = mla_sparse_reference(q, pool, idx, SCALE)
    assert_close(o, o_ref, tolerance("mla", torch.float32), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


def _gluon_sparse_why() -> str | None:
    from mqnc.triton_kernels.dispatch import Case, Target, choose, force_backend

    if DEVICE.type != "cuda":
        return "the gather see-saw runs on a CUDA sm_90 device only"
    with force_backend("mla_sparse", "gluon"):
        try:
            choose(Case("mla_sparse"), Target.of(DEVICE))
        except ValueError as exc:
            return str(exc)
    return None


@pytest.mark.parametrize(
    ("B", "heads", "topk", "unused", "splits"),
    [(1, 128, 2048, 0.0, None), (3, 128, 2048, 0.3, 4), (2, 16, 300, 0.5, None),
     (2, 64, 64, 1.0, 1), (4, 100, 700, 0.2, 3)],
)  # fmt: skip
def test_the_gather_seesaw_matches_fp64(B, heads, topk, unused, splits):
    """The sparse gather see-saw, forced (opt-in: no GPU record yet), against fp64 on an sm_90
    GPU: -1 slots, a partial top-k (trailing -1), an all-empty row, NaN in every unselected
    slot, split and unsplit, 16 / 64 / 100 / 128 heads. Skipped elsewhere (the kernel is
    Gluon: no interpreter runs it); ``perf/gpu_fastpath.sh`` runs the same cases."""
    why = _gluon_sparse_why()
    if why is not None:
        pytest.skip(why)
    from mqnc.triton_kernels.dispatch import force_backend

    gen = torch.Generator().manual_seed(topk + heads)
    num_blocks = math.ceil(topk / 64) * 2 + 2
    idx = selection(gen, B, topk, num_blocks * 64, unused)
    idx[0, topk // 2 :] = -1  # a partial top-k
    if B > 2:
        idx[2] = -1  # an all-empty row
    pool = pool_with(idx, num_blocks, 64, torch.bfloat16, gen)
    q = torch.randn(B, heads, D_QK, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    idx = idx.to(DEVICE)
    with force_backend("mla_sparse", "gluon"):
        o, lse = mla_sparse_partial(q, pool, idx, softmax_scale=SCALE, num_splits=splits)
    o_ref, lse_ref = mla_sparse_reference(q, pool, idx, SCALE)
    assert_close(o, o_ref, tolerance("mla", torch.bfloat16), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")
