"""Dense paged partial MLA attention (``mla_decode_partial``) against the fp64 reference, and the
routed exactness of §3.3: a cache split across M holders, attended per holder and merged, equals
one call over the whole.

Outputs are NaN-poisoned (conftest), and every pool slot that no row attends is NaN, so a read
past a row's length or through a wrong page fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqnc.reference import mla_decode_reference
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.triton_kernels import merge_partials, mla_decode_partial
from mqnc.triton_kernels.mla.decode import plan_decode
from mqnc.triton_kernels.mla.plan import _WIDE, _WIDE_ELSE, TileConfig, forced_tile

D_QK, D_V = 576, 512
# DeepSeek-V2-Lite's scale with YaRN (factor 40, mscale_all_dim 0.707): 192^-0.5 * mscale^2.
SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Module-level rather than the ``device`` fixture: Hypothesis reuses function-scoped fixtures.
DEVICE = default_device()


def paged_cache(lengths, block_size, dtype, gen, *, spare_blocks=2, values=None):
    """A NaN-padded pool holding ``lengths[b]`` entries per row in shuffled pages.

    Returns ``(kv_pool, block_table, cache_seqlens)``; table entries past a row's pages are -1.
    ``values[b]`` (``[lengths[b], D_QK]``), when given, are the entries; else N(0, 1).
    """
    pages = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(pages) + spare_blocks
    pool = torch.full((num_blocks, block_size, D_QK), float("nan"), dtype=torch.float32)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(lengths), max(max(pages, default=0), 1)), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lengths):
        v = values[b] if values is not None else torch.randn(n, D_QK, generator=gen)
        for j in range(pages[b]):
            blk = int(perm[used])
            used += 1
            table[b, j] = blk
            chunk = v[j * block_size : (j + 1) * block_size]
            pool[blk, : chunk.shape[0]] = chunk.float()
    lens = torch.tensor(lengths, dtype=torch.int32)
    return pool.to(device=DEVICE, dtype=dtype), table.to(DEVICE), lens.to(DEVICE)


@given(
    dtype=st.sampled_from(DTYPES),
    heads=st.sampled_from([1, 3, 16, 20]),
    block_size=st.sampled_from([16, 32, 64, 128]),
    lengths=st.lists(st.integers(0, 200), min_size=1, max_size=3),  # > the largest page
    num_splits=st.sampled_from([None, 1, 2, 3, 7]),
    seed=st.integers(0, 2**16),
)
def test_decode_matches_fp64_reference(dtype, heads, block_size, lengths, num_splits, seed):
    gen = torch.Generator().manual_seed(seed)
    pool, table, lens = paged_cache(lengths, block_size, dtype, gen)
    q = torch.randn(len(lengths), heads, D_QK, generator=gen).to(device=DEVICE, dtype=dtype)
    o, lse = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, num_splits=num_splits)
    o_ref, lse_ref = mla_decode_reference(q, pool, table, lens, SCALE)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close(o, o_ref, tolerance("mla", dtype), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


def test_decode_production_geometry_default_splits():
    """V2-Lite's 16 heads at 576 = 512 + 64, page 64, one query token over 1000 entries: the
    split policy spreads it over 64-entry splits (16 programs instead of one), and the rows
    shorter than the table's capacity leave trailing splits empty."""
    gen = torch.Generator().manual_seed(1)
    pool, table, lens = paged_cache([1000], 64, torch.bfloat16, gen)
    q = torch.randn(1, 16, D_QK, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    plan = plan_decode(q, pool, table, lens, SCALE, D_V, None)
    assert plan.num_splits == 16 and len(plan.launches) == 2
    o, lse = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE)
    o_ref, lse_ref = mla_decode_reference(q, pool, table, lens, SCALE)
    assert_close(o, o_ref, tolerance("mla", torch.bfloat16), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


# Every tile chosen above 32 heads, under any triton (``mla.plan._WIDE``): the 64-head tiles
# compile to HGMMA on the GPU; here the interpreter runs the same code at those block shapes.
WIDE_DENSE = sorted({t[0].label for t in [*_WIDE.values(), _WIDE_ELSE]})


@pytest.mark.parametrize("tile", WIDE_DENSE)
@pytest.mark.parametrize("heads,lengths,num_splits", [(40, [70, 0, 129], None), (128, [96], 3)])
def test_decode_wide_tiles_match_fp64(tile, heads, lengths, num_splits):
    """More than 32 heads at each tile the launcher may choose for them (a partial head block
    at 40 heads; a row with no entries; split and unsplit), in bf16 against fp64."""
    gen = torch.Generator().manual_seed(heads)
    pool, table, lens = paged_cache(lengths, 64, torch.bfloat16, gen)
    q = torch.randn(len(lengths), heads, D_QK, generator=gen).to(DEVICE, torch.bfloat16)
    with forced_tile(tile):
        plan = plan_decode(q, pool, table, lens, SCALE, D_V, num_splits)
        assert TileConfig.of_launch(plan.launches[0]).label == tile
        o, lse = mla_decode_partial(
            q, pool, table, lens, softmax_scale=SCALE, num_splits=num_splits
        )
    o_ref, lse_ref = mla_decode_reference(q, pool, table, lens, SCALE)
    assert_close(o, o_ref, tolerance("mla", torch.bfloat16), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_empty_rows(num_splits):
    """Rows with no entries give o = 0, lse = -inf, next to a non-empty row; splits with no
    tiles (more splits than tiles) are empty partials the merge ignores."""
    gen = torch.Generator().manual_seed(2)
    pool, table, lens = paged_cache([0, 40, 0], 16, torch.float32, gen)
    q = torch.randn(3, 4, D_QK, generator=gen, device="cpu").to(DEVICE)
    o, lse = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, num_splits=num_splits)
    for b in (0, 2):
        assert torch.equal(o[b], torch.zeros_like(o[b]))
        assert torch.isneginf(lse[b]).all()
    o_ref, lse_ref = mla_decode_reference(q, pool, table, lens, SCALE)
    assert_close(o, o_ref, tolerance("mla", torch.float32), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


@settings(max_examples=12)  # up to 9 launches per example: keep the suite's CPU time bounded
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    ct=st.integers(64, 192),  # up to three 64-entry pages, or twelve 16-entry ones
    cuts=st.lists(st.floats(0.0, 1.0), min_size=0, max_size=7),
    block_size=st.sampled_from([16, 64]),
    seed=st.integers(0, 2**16),
)
def test_routed_dense_equals_one_call(dtype, ct, cuts, block_size, seed):
    """§3.3: a ct-entry cache split into M = len(cuts) + 1 <= 8 contiguous chunks, each held by a
    different holder (its own pool and block table), attended per holder and merged with the
    merge kernel, equals one kernel call over the whole cache."""
    gen = torch.Generator().manual_seed(seed)
    B, H = 1, 16  # (batches: test_decode_matches_fp64_reference)
    # Entries ~ N(0, 0.15^2), q ~ N(0, 1.25^2): scores as with q ~ N(0, 0.19^2) over unit entries
    # (std ~0.7, attention spread over the chunk) and |o| < 0.25, the premise of the project's
    # 2e-3 bf16 bound (one bf16 ulp of |o|; see the tolerance's reason), checked below.
    q = (1.25 * torch.randn(B, H, D_QK, generator=gen)).to(device=DEVICE, dtype=dtype)
    entries = 0.15 * torch.randn(B, ct, D_QK, generator=gen)
    bounds = sorted({0, ct, *(int(c * ct) for c in cuts)})
    partials = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        pool, table, lens = paged_cache(
            [hi - lo] * B, block_size, dtype, gen, values=entries[:, lo:hi]
        )
        partials.append(mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE))
    o_routed, lse_routed = merge_partials(
        torch.stack([p[0] for p in partials]), torch.stack([p[1] for p in partials]), layout="MBHD"
    )
    pool, table, lens = paged_cache([ct] * B, block_size, dtype, gen, values=entries)
    o_one, lse_one = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE)
    assert float(o_one.abs().max()) < 0.25
    assert_close(o_routed, o_one, tolerance("mla_routed", dtype), name="o routed vs one call")
    assert_close(lse_routed, lse_one, tolerance("mla_lse", "float32"), name="lse routed")


def _inputs(dtype=torch.float32, B=2, H=4, block_size=16):
    gen = torch.Generator().manual_seed(3)
    pool, table, lens = paged_cache([20, 5], block_size, dtype, gen)
    q = torch.randn(B, H, D_QK, generator=gen).to(device=DEVICE, dtype=dtype)
    return q, pool, table, lens


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: {**a, "q": a["q"].to(torch.float64)}, TypeError, "q: invalid dtype"),
        (lambda a: {**a, "q": a["q"][..., :512]}, ValueError, "q: expected .*576 = 512 latent"),
        (lambda a: {**a, "kv_pool": a["kv_pool"].to(torch.float16)}, TypeError, "kv_pool"),
        (
            lambda a: {**a, "kv_pool": a["kv_pool"][:, :12]},
            ValueError,
            "block size .* power of two",
        ),
        (lambda a: {**a, "block_table": a["block_table"].long()}, TypeError, "block_table"),
        (lambda a: {**a, "block_table": a["block_table"][:1]}, ValueError, "block_table"),
        (lambda a: {**a, "cache_seqlens": a["cache_seqlens"].long()}, TypeError, "cache_seqlens"),
        (lambda a: {**a, "cache_seqlens": a["cache_seqlens"] * 100}, ValueError, "cache_seqlens"),
        (lambda a: {**a, "cache_seqlens": a["cache_seqlens"] - 6}, ValueError, "cache_seqlens"),
        (lambda a: {**a, "block_table": a["block_table"] + 1000}, ValueError, "block ids"),
        (lambda a: {**a, "softmax_scale": 0.0}, ValueError, "softmax_scale"),
        (lambda a: {**a, "softmax_scale": "0.1"}, TypeError, "softmax_scale"),
        (lambda a: {**a, "num_splits": 0}, ValueError, "num_splits"),
        (lambda a: {**a, "d_v": 500}, ValueError, "d_v"),
    ],
)
def test_decode_bad_input_names_the_argument(mutate, exc, match):
    q, pool, table, lens = _inputs()
    args = dict(q=q, kv_pool=pool, block_table=table, cache_seqlens=lens, softmax_scale=SCALE)
    args = mutate(args)
    with pytest.raises(exc, match=match):
        mla_decode_partial(
            args.pop("q"),
            args.pop("kv_pool"),
            args.pop("block_table"),
            args.pop("cache_seqlens"),
            **args,
        )


def _first_mistakes(q, pool):
    """``(q, kv_pool, exception, message)`` of a new user's three first mistakes with query rows
    ``q`` (fp32, 576 wide) and ``pool`` (fp32 ``[nb, page, 576]``)."""
    return [
        # latent-only query rows (no RoPE part): q is named with the width expected and got
        (
            q[..., :512],
            pool,
            ValueError,
            r"q: expected .*d_c \+ d_r wide: 576 = 512 latent \+ 64 RoPE.*got shape \(2, 4, 512\)",
        ),
        # FlashMLA's 4-D cache: its layout and the fix
        (
            q,
            pool.unsqueeze(2),
            ValueError,
            r"kv_pool: expected 3 dims .*got 4-D shape \(\d+, 16, 1, 576\), FlashMLA's "
            r"\[num_blocks, page, 1, d\].*k_cache\.squeeze\(2\).*adapters\.flashmla\."
            r"mla_decode_with_kvcache",
        ),
        # fp16 rows over a bf16 pool: the pool must match q, both dtypes given
        (
            q.half(),
            pool.bfloat16(),
            TypeError,
            r"kv_pool: invalid dtype, must match q's \(float16\), got bfloat16",
        ),
    ]


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("fn", ["mla_decode_partial", "plan_mla_decode"])
def test_a_new_users_mistakes_name_the_argument_expected_and_got(fn, case):
    """The function and its plan (one validation): a 512-wide query blames q (the width
    expected, d_c + d_r, and received), FlashMLA's [nb, 64, 1, 576] cache is named with its fix,
    a dtype mismatch says the pool must match q and gives both."""
    import mqnc.triton_kernels as tk

    q, pool, table, lens = _inputs()
    q_bad, pool_bad, exc, match = _first_mistakes(q, pool)[case]
    with pytest.raises(exc, match=match):
        getattr(tk, fn)(q_bad, pool_bad, table, lens, softmax_scale=SCALE)


def test_decode_requires_softmax_scale():
    q, pool, table, lens = _inputs()
    with pytest.raises(TypeError, match="softmax_scale"):
        mla_decode_partial(q, pool, table, lens)


def test_the_paging_check_kernel_flags_what_the_torch_checks_name():
    """The compiled path's range check (``mla.decode.paging_fault_flag``: one kernel, one sync),
    run here under the interpreter: good rows pass (lengths 0 .. capacity, pages in the pool,
    unused entries anything), a length past the capacity, a negative length and a page out of
    the pool in use each raise the torch checks' own error naming the row and entry; a bad
    page past a row's length is not in use and passes."""
    from mqnc.triton_kernels.mla.decode import paging_fault_flag

    table = torch.tensor([[3, 1, -1], [0, 2, 9]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([128, 128], dtype=torch.int32, device=DEVICE)
    paging_fault_flag(table, lens, 4, 64)  # row 1's page 9 is past its 128 entries
    paging_fault_flag(table, torch.zeros(2, dtype=torch.int32, device=DEVICE), 4, 64)
    cases = [
        (torch.tensor([193, 0]), r"expected values in \[0, 192\].*got 193 at row 0"),
        (torch.tensor([0, -1]), r"got -1 at row 1"),
        (
            torch.tensor([129, 0]),
            r"block_table: expected block ids in \[0, 4\).*got -1 at \[0, 2\]",
        ),
        (torch.tensor([0, 129]), r"got 9 at \[1, 2\]"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            paging_fault_flag(table, bad.to(torch.int32).to(DEVICE), 4, 64)
