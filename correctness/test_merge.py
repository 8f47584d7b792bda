"""The M-way online-softmax merge kernel against the fp64 reference, and its algebra (§3.3).

Properties: agreement with fp64 for every dtype, commutativity, associativity, the zero-weight
identity, partition invariance (M disjoint partitions of a key set merge to one call over the
union), extreme LSE gaps, all-empty rows, and the two-way in-place streaming form.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

from mqnc.reference import merge_ml_reference, merge_reference, partial_attention_reference
from mqnc.testing import assert_close, compare, default_device, tolerance
from mqnc.triton_kernels import (
    lse_from_base2,
    lse_from_ml,
    lse_to_base2,
    merge_partials,
    merge_partials_into,
    ml_from_lse,
)
from mqnc.triton_kernels._core.numerics import round_to

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INF = float("inf")
# Where the kernels run (the GPU when compiled); drawn on the CPU, moved there.
DEVICE = default_device()
# Observed maxima, collected across the run and printed at the end (`pytest -s`) for the notes.
OBSERVED: dict[str, float] = {}


def _note(key: str, value: float) -> None:
    OBSERVED[key] = max(OBSERVED.get(key, 0.0), value)


@pytest.fixture(scope="module", autouse=True)
def _report_observed():
    yield
    for key, value in sorted(OBSERVED.items()):
        print(f"[merge observed] {key}: max_abs={value:.3e}")


@st.composite
def partials(draw, max_m=8, dtypes=DTYPES):
    """Random partials [M, B, H, D] with some empty ones (-inf or +inf lse) and NaN garbage in
    their o (an empty partial's o must never be read)."""
    M = draw(st.integers(1, max_m))
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 3))
    D = draw(st.sampled_from([1, 7, 64, 100, 512, 576]))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    o = (torch.rand(M, B, H, D, generator=g) * 8 - 4).to(dtype)
    lse = torch.randn(M, B, H, generator=g) * draw(st.sampled_from([0.1, 3.0, 30.0]))
    empty = torch.rand(M, B, H, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.8]))
    pos = torch.rand(M, B, H, generator=g) < 0.5
    lse = torch.where(empty & pos, INF, torch.where(empty, -INF, lse))
    o = torch.where(empty[..., None], torch.full_like(o, float("nan")), o)
    return o.to(DEVICE), lse.to(DEVICE)


def _tol(dtype):
    return tolerance("merge", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data())
def test_merge_matches_fp64_reference(dtype, data):
    o, lse = data.draw(partials(dtypes=[dtype]))
    o_ref, lse_ref = merge_reference(o, lse)
    o_out, lse_out = merge_partials(o, lse, layout="MBHD")
    assert o_out.dtype == o.dtype and lse_out.dtype == torch.float32
    s = assert_close(o_out, o_ref, _tol(o.dtype), name="o")
    _note(f"reference o {o.dtype}", s.max_abs)
    s = assert_close(lse_out, lse_ref, tolerance("merge_lse", "float32"), name="lse")
    _note("reference lse", s.max_abs)


@given(partials(dtypes=[torch.float32]), st.randoms(use_true_random=False))
def test_merge_commutative(p, rnd):
    o, lse = p
    perm = list(range(o.shape[0]))
    rnd.shuffle(perm)
    a = merge_partials(o, lse, layout="MBHD")
    b = merge_partials(o[perm], lse[perm], layout="MBHD")
    o_ref, lse_ref = merge_reference(o, lse)
    for out in (a, b):
        assert_close(out[0], o_ref, _tol(torch.float32), name="o")
        assert_close(out[1], lse_ref, tolerance("merge_lse", "float32"), name="lse")
    s = compare(a[0], b[0])
    _note("commutativity o (permuted vs original)", s.max_abs)
    assert s.max_abs <= _tol(torch.float32).atol


@given(partials(dtypes=[torch.float32]), st.randoms(use_true_random=False))
def test_merge_associative(p, rnd):
    """Any grouping into sub-merges, then a merge of the sub-results, equals one M-way merge."""
    o, lse = p
    M = o.shape[0]
    cuts = sorted(rnd.sample(range(1, M), rnd.randint(0, M - 1))) if M > 1 else []
    bounds = [0, *cuts, M]
    subs = [
        merge_partials(o[a:b], lse[a:b], layout="MBHD")
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    o2, lse2 = merge_partials(
        torch.stack([s[0] for s in subs]), torch.stack([s[1] for s in subs]), layout="MBHD"
    )
    o_ref, lse_ref = merge_reference(o, lse)
    # Two merge levels: besides the single-merge bound per level, each sub-result's lse is
    # rounded to fp32 (relative error 2^-24 of |lse|), which perturbs its weight by that much
    # relative, moving o by at most |o_i - o| <= 8 (|o| <= 4) times it.
    finite = lse[torch.isfinite(lse)]
    lse_max = float(finite.abs().max()) if finite.numel() else 0.0
    atol = 2 * _tol(torch.float32).atol + 8 * lse_max * 2**-24
    s = assert_close(o2, o_ref, atol=atol, rms_rtol=2 * _tol(torch.float32).rms_rtol, name="o")
    _note("associativity o", s.max_abs)
    assert_close(lse2, lse_ref, tolerance("merge_lse", "float32"), name="lse")


@given(partials(), st.integers(1, 4), st.booleans())
def test_zero_weight_identity(p, n_empty, plus_inf):
    """Empty partials (lse = -inf, or +inf as FlashMLA writes) are neutral, bit for bit, even
    when their o holds NaN."""
    o, lse = p
    M, B, H, D = o.shape
    e_o = torch.full((n_empty, B, H, D), float("nan"), dtype=o.dtype, device=DEVICE)
    e_lse = torch.full((n_empty, B, H), INF if plus_inf else -INF, device=DEVICE)
    base = merge_partials(o, lse, layout="MBHD")
    with_empty = merge_partials(
        torch.cat([e_o, o, e_o]), torch.cat([e_lse, lse, e_lse]), layout="MBHD"
    )
    assert torch.equal(base[0], with_empty[0]) or compare(base[0], with_empty[0]).max_abs == 0.0
    assert torch.equal(base[1], with_empty[1])


def test_all_empty_rows_give_zero_and_neg_inf():
    o = torch.full((3, 2, 4, 64), float("nan"), device=DEVICE)
    lse = torch.tensor([-INF, INF, -INF], device=DEVICE).view(3, 1, 1).expand(3, 2, 4).contiguous()
    o_out, lse_out = merge_partials(o, lse, layout="MBHD")
    assert torch.equal(o_out, torch.zeros_like(o_out))
    assert torch.isneginf(lse_out).all()


@given(
    st.integers(1, 8),
    st.integers(0, 96),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 2**31 - 1),
)
def test_partition_invariance(M, n_keys, dtype, seed):
    """Split a key set into M disjoint random partitions (some empty), attend each (fp64
    reference, the holder's partial), merge: equals one reference call over the union (§3.3)."""
    g = torch.Generator().manual_seed(seed)
    B, H, d_qk, d_v = 2, 3, 576, 512
    q = torch.randn(B, H, d_qk, generator=g, dtype=torch.float64)
    kv = torch.randn(n_keys, d_qk, generator=g, dtype=torch.float64).clamp(-3.9, 3.9)
    scale = 192**-0.5
    owner = torch.randint(0, M, (n_keys,), generator=g)
    parts_o, parts_lse = [], []
    for i in range(M):
        valid = (owner == i)[None, :].expand(B, -1)
        o_i, lse_i = partial_attention_reference(q, kv, valid, scale, d_v)
        parts_o.append(o_i)
        parts_lse.append(lse_i)
    o = torch.stack(parts_o).to(DEVICE, dtype)  # the partial as it would cross the wire
    lse = torch.stack(parts_lse).to(DEVICE, torch.float32)
    o_out, lse_out = merge_partials(o, lse, layout="MBHD")
    o_ref, lse_ref = partial_attention_reference(
        q, kv, torch.ones(B, n_keys, dtype=torch.bool), scale, d_v
    )
    s = assert_close(o_out, o_ref, tolerance("merge_wire", dtype), name="o")
    _note(f"partition invariance o {dtype}", s.max_abs)
    assert_close(lse_out, lse_ref, tolerance("merge_lse", "float32"), name="lse")


@pytest.mark.parametrize("gap", [1e4, 1e3, 100.0, 30.0])
def test_extreme_lse_gaps(gap):
    """Partials whose lse differ by up to 1e4: the small one underflows to weight 0 without
    NaN, and large absolute lse values keep their relative accuracy."""
    g = torch.Generator().manual_seed(1)
    o = (torch.rand(3, 2, 2, 128, generator=g) * 2 - 1).to(DEVICE)
    lse = torch.tensor([0.0, -gap, gap], device=DEVICE).view(3, 1, 1).expand(3, 2, 2).contiguous()
    lse[1, 1, 1] = -INF
    o_out, lse_out = merge_partials(o, lse, layout="MBHD")
    o_ref, lse_ref = merge_reference(o, lse)
    assert_close(o_out, o_ref, _tol(torch.float32), name="o")
    # |lse| ~ gap: fp32 carries ~7 digits, so the bound on lse is relative to its size.
    tol = tolerance("merge_lse", "float32")
    assert_close(lse_out, lse_ref, atol=max(tol.atol, 2 * gap * 2**-24), name="lse")
    assert torch.isfinite(o_out).all()


@given(partials(max_m=6))
def test_streaming_in_place_merge_equals_m_way(p):
    o, lse = p
    M, B, H, D = o.shape
    acc_o = torch.zeros(B, H, D, dtype=o.dtype, device=DEVICE)
    acc_lse = torch.full((B, H), -INF, device=DEVICE)
    for i in range(M):
        merge_partials_into(acc_o, acc_lse, o[i].contiguous(), lse[i].contiguous())
    o_ref, lse_ref = merge_reference(o, lse)
    # Each fold rounds the running o to its dtype once: M roundings at most in bf16 / fp16.
    tol = _tol(o.dtype)
    atol = tol.atol if o.dtype == torch.float32 else tol.atol * M
    s = assert_close(acc_o, o_ref, atol=atol, rms_rtol=tol.rms_rtol * M, name="o")
    _note(f"streaming o {o.dtype}", s.max_abs)
    assert_close(acc_lse, lse_ref, tolerance("merge_lse", "float32"), name="lse")


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(4, 3, 2, 640, generator=g).to(DEVICE)
    o = base.permute(1, 2, 0, 3)[..., :600]  # [M=3, B=2, H=4, D=600], strided
    lse = torch.randn(2, 4, 3, generator=g).to(DEVICE).permute(2, 0, 1)
    o_out, lse_out = merge_partials(o, lse, layout="MBHD")
    o_ref, lse_ref = merge_reference(o, lse)
    assert_close(o_out, o_ref, _tol(torch.float32), name="o")
    assert_close(lse_out, lse_ref, tolerance("merge_lse", "float32"), name="lse")


def test_concurrent_launches_from_threads():
    """Under the interpreter the launch lock serialises launches; on a GPU it is a no-op."""
    g = torch.Generator().manual_seed(3)
    o = torch.randn(4, 2, 2, 64, generator=g).to(DEVICE)
    lse = torch.randn(4, 2, 2, generator=g).to(DEVICE)
    o_ref, _ = merge_reference(o, lse)
    errors: list[BaseException] = []

    def work():
        try:
            for _ in range(5):
                out, _ = merge_partials(o, lse, layout="MBHD")
                assert_close(out, o_ref, _tol(torch.float32), name="o")
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_lse_base_conversions_round_trip():
    lse = torch.tensor([-INF, -3.0, 0.0, 2.5, 80.0])
    two = lse_to_base2(lse)
    assert torch.allclose(two[1:], lse[1:] / math.log(2))
    assert torch.equal(lse_from_base2(two)[0:1], lse[0:1])
    assert_close(lse_from_base2(two), lse, atol=1e-5, name="lse round trip")


def test_ml_form_merges_to_attention_over_the_union():
    """The wire form (o, m, l) (§3.2) merged is attention over the union of the partials' key
    sets, computed directly (one fp64 softmax over all keys: not the merge it checks); each
    partial's (m, l) is taken from its own scores (the max, the exp-sum below it), one partial
    empty for one token (l = 0); ``lse_from_ml`` / ``ml_from_lse`` agree with a direct
    log-sum-exp of the scores."""
    g = torch.Generator().manual_seed(4)
    B, H, N, D, Dv, scale = 2, 2, 60, 48, 32, 0.3
    q = torch.randn(B, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(N, D, generator=g, dtype=torch.float64)
    part_of = torch.randint(0, 3, (N,), generator=g)  # three disjoint key sets
    part_of[(part_of == 1) & (torch.arange(N) % 2 == 0)] = 2
    every = torch.ones(B, N, dtype=torch.bool)
    valid = torch.stack([every & (part_of == i) for i in range(3)])  # [3, B, N]
    valid[1, 0] = False  # partial 1 holds nothing for token 0
    o_union, lse_union = partial_attention_reference(q, kv, valid.any(0), scale, d_v=Dv)
    scores = scale * torch.einsum("bhd,nd->bhn", q, kv)  # [B, H, N]
    os, ms, ls = [], [], []
    for i in range(3):
        o_i, _ = partial_attention_reference(q, kv, valid[i], scale, d_v=Dv)
        s_i = scores.masked_fill(~valid[i][:, None, :], -INF)
        m_i = s_i.max(-1).values
        empty = torch.isneginf(m_i)
        m_i = torch.where(empty, torch.zeros_like(m_i), m_i)
        l_i = torch.exp(s_i - m_i[..., None]).sum(-1)  # 0 for an empty partial
        os.append(torch.where(empty[..., None], torch.zeros_like(o_i), o_i))
        ms.append(m_i)
        ls.append(l_i)
    o, m, l = torch.stack(os), torch.stack(ms), torch.stack(ls)
    assert (l[1, 0] == 0).all() and (l > 0).sum() == l.numel() - H
    o_b, m_b, l_b = merge_ml_reference(o, m, l)
    assert_close(o_b, o_union, atol=1e-12, name="o")
    assert_close(lse_from_ml(m_b, l_b), lse_union, atol=1e-12, name="lse")
    direct = torch.logsumexp(scores.masked_fill(~valid[0][:, None, :], -INF), -1)
    assert_close(lse_from_ml(m[0], l[0]), direct, atol=1e-12, name="lse_from_ml")
    m2, l2 = ml_from_lse(direct)
    assert_close(lse_from_ml(m2, l2), direct, atol=1e-12, name="ml_from_lse")


@pytest.mark.parametrize(
    "o, lse, err, match",
    [
        (torch.zeros(2, 1, 1, 8), torch.zeros(2, 1), ValueError, "lse: expected 3 dims"),
        (torch.zeros(1, 1, 8), torch.zeros(1, 1, 1), ValueError, "o: expected 4 dims"),
        (
            torch.zeros(2, 1, 1, 8),
            torch.zeros(3, 1, 1),
            ValueError,
            r"lse: expected shape \(2, 1, 1\)",
        ),
        (
            torch.zeros(2, 1, 1, 8),
            torch.zeros(2, 1, 1, dtype=torch.float64),
            TypeError,
            "lse: invalid dtype",
        ),
        (
            torch.zeros(2, 1, 1, 8, dtype=torch.int32),
            torch.zeros(2, 1, 1),
            TypeError,
            "o: invalid dtype",
        ),
        (torch.zeros(0, 1, 1, 8), torch.zeros(0, 1, 1), ValueError, "M >= 1"),
        (torch.zeros(2, 1, 1, 8), torch.tensor([[[0.0]], [[float("nan")]]]), ValueError, "NaN"),
        ([[0.0]], torch.zeros(1, 1, 1), TypeError, "o: expected a torch.Tensor"),
    ],
)
def test_merge_rejects_bad_input(o, lse, err, match):
    o = o.to(DEVICE) if isinstance(o, torch.Tensor) else o
    with pytest.raises(err, match=match):
        merge_partials(o, lse.to(DEVICE), layout="MBHD")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_merge_has_no_default_layout(backend):
    """FlashInfer's ``[seq, num_states, H, D]`` and mqnc's ``[M, B, H, D]`` have the same shapes
    (``v [3, 2, 16, 512]`` is either), so ``layout`` is required: a call without it is a
    ``TypeError`` naming ``layout`` and its two values (the public function, a backend's, and
    the ``torch.ops`` op, whose schema has no default for it); each layout merges its own
    axis, against the fp64 reference."""
    from mqnc.serving.compute import kernel_ops

    merge = kernel_ops(backend).merge_partials
    g = torch.Generator().manual_seed(9)
    v, s = torch.randn(3, 2, 16, 512, generator=g).to(DEVICE), torch.randn(3, 2, 16).to(DEVICE)
    with pytest.raises(
        TypeError,
        match=r"^layout: expected 'MBHD' \(mqnc's partials stacked first: \[M, B, H, D\]\) or "
        r"'BMHD' \(FlashInfer's \[B, M, H, D\]\), got no layout",
    ):
        merge(v, s)
    with pytest.raises(TypeError, match="layout: expected 'MBHD'"):
        merge(v, s, check_lse=False, base2=True)
    with pytest.raises(RuntimeError, match="missing value for argument 'layout'"):
        torch.ops.mqnc.merge_partials(v, s, backend=backend)
    v = v[..., :16]  # (a narrower D: the merge per layout, against fp64)
    for layout, axis in (("MBHD", 0), ("BMHD", 1)):
        o_ref, lse_ref = merge_reference(v.movedim(axis, 0), s.movedim(axis, 0))
        o, lse = merge(v, s, layout=layout)
        assert o.shape == o_ref.shape == ((2, 16, 16) if axis == 0 else (3, 16, 16))
        assert_close(o, o_ref, _tol(torch.float32), name=f"o {layout}")
        assert_close(lse, lse_ref, tolerance("merge_lse", "float32"), name=f"lse {layout}")


def test_merge_into_rejects_mismatched_dtype():
    acc, lse = torch.zeros(1, 2, 8, device=DEVICE), torch.zeros(1, 2, device=DEVICE)
    with pytest.raises(TypeError, match="o_new: invalid dtype"):
        merge_partials_into(acc, lse, acc.to(torch.bfloat16), lse)


def test_merge_into_given_outputs_in_another_dtype():
    """``out=``: the fp32 accumulator is rounded once into the caller's tensors (how split-KV
    workspaces in fp32 are combined straight into bf16 attention outputs)."""
    g = torch.Generator().manual_seed(5)
    o = (torch.rand(3, 2, 2, 64, generator=g) * 8 - 4).to(DEVICE)
    lse = torch.randn(3, 2, 2, generator=g).to(DEVICE)
    o_out = torch.full((2, 2, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse_out = torch.full((2, 2), float("nan"), device=DEVICE)
    got = merge_partials(o, lse, out=(o_out, lse_out), layout="MBHD")
    assert got[0] is o_out and got[1] is lse_out
    o_ref, lse_ref = merge_reference(o, lse)
    assert_close(o_out, o_ref, _tol(torch.bfloat16), name="o")
    assert_close(lse_out, lse_ref, tolerance("merge_lse", "float32"), name="lse")
    with pytest.raises(ValueError, match=r"out\[0\]: expected shape"):
        merge_partials(o, lse, out=(o_out[:1], lse_out), layout="MBHD")
    with pytest.raises(TypeError, match="out: expected a tuple"):
        merge_partials(o, lse, out=o_out, layout="MBHD")


def test_many_partials_beyond_one_lse_block():
    """M = 300 > LSE_BLOCK (256): the max runs over two lse blocks and the fold over ten steps
    of 32 partials; empty partials (NaN o) scattered among them. One row's largest lse (120) is
    in the second block, far above the first block's (< ~15): a max over the first block alone
    would overflow ``exp(lse - max)`` there (an inf lse and NaN o), which any shift within a
    few units of the true max would not show."""
    g = torch.Generator().manual_seed(6)
    o = (torch.rand(300, 1, 2, 64, generator=g) * 8 - 4).to(DEVICE)
    lse = (torch.randn(300, 1, 2, generator=g) * 3).to(DEVICE)
    lse[::7] = -INF
    lse[5::11] = INF
    o[::7] = float("nan")
    lse[281, 0, 1] = 120.0  # (281: not a multiple of 7, nor 5 mod 11: a full partial)
    o_out, lse_out = merge_partials(o, lse, layout="MBHD")
    o_ref, lse_ref = merge_reference(o, lse)
    assert_close(o_out, o_ref, _tol(torch.float32), name="o")
    assert_close(lse_out, lse_ref, tolerance("merge_lse", "float32"), name="lse")


@pytest.mark.parametrize(
    "dtype, D, block_d",
    [(torch.float32, 512, 128), (torch.bfloat16, 512, 256), (torch.float32, 600, 128)],
    ids=str,
)
def test_the_compiled_paths_slicing_of_o(dtype, D, block_d):
    """On a GPU a row's o is merged in 16-byte-per-thread slices by several programs (the
    interpreter runs one program per row): the same kernel at the GPU's slice width, a ragged
    last slice, and the lse written once per row, into NaN-poisoned outputs."""
    from mqnc.triton_kernels.merge.partials import merge_launch

    g = torch.Generator().manual_seed(7)
    o = (torch.rand(5, 2, 3, D, generator=g) * 8 - 4).to(DEVICE, dtype)
    lse = torch.randn(5, 2, 3, generator=g).to(DEVICE)
    lse[1, 0, 2] = -INF
    o[1, 0, 2] = float("nan")
    o_out = torch.full((2, 3, D), float("nan"), dtype=dtype, device=DEVICE)
    lse_out = torch.full((2, 3), float("nan"), device=DEVICE)
    launch = merge_launch(o, lse, o_out, lse_out, block_d=block_d)
    assert launch.grid == (6, -(-D // block_d))
    launch()
    o_ref, lse_ref = merge_reference(o, lse)
    assert_close(o_out, o_ref, _tol(dtype), name="o")
    assert_close(lse_out, lse_ref, tolerance("merge_lse", "float32"), name="lse")


@triton.jit
def _round_bf16(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, round_to(tl.load(X + offs), tl.bfloat16, True))


def test_software_bf16_rounding_keeps_every_nan_a_nan():
    """``_core.numerics.round_to`` with ``BF16_RNE`` (the interpreter's store-side cast, shared by
    every kernel's bf16 store): round to nearest even as torch's cast does, and a NaN of any
    payload stays a NaN (the carry once made 0x7F800001 inf and 0x7FFFFFFF -0.0)."""
    from mqnc.triton_kernels._core.execution import interpreting, launch_lock

    if not interpreting():
        pytest.skip("the software rounding runs under the interpreter only")
    bits = [0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFF800001, 0x7F800000, 0xFF800000]
    bits += [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x00000001, 0x80000000, 0x477FFFFF, 0x7F7FFFFF]
    x = torch.tensor(bits + [0] * (16 - len(bits)), dtype=torch.int64).to(torch.uint32)
    x = x.view(torch.float32)
    y = torch.full((16,), float("nan"), dtype=torch.bfloat16)
    with launch_lock():
        _round_bf16[(1,)](x, y, 16)
    want = x.to(torch.bfloat16)
    assert torch.equal(torch.isnan(y), torch.isnan(x))
    finite = ~torch.isnan(x)
    assert torch.equal(y[finite].view(torch.int16), want[finite].view(torch.int16))


def test_combine_pdl_is_opt_in_compiled_only_and_part_of_a_plans_key(monkeypatch):
    """``merge.combine_pdl()``: merge launches planned inside are programmatic dependent
    launches (``launch_pdl``, the kernel's ``gdc_wait`` first) on a GPU; never under the
    interpreter (no grid dependency control there) nor outside the block; the op's plan cache
    plans a call again inside it (the choice is part of every key)."""
    from mqnc.triton_kernels import mla_decode_partial
    from mqnc.triton_kernels.merge import partials as merge

    o, lse = torch.zeros(2, 1, 16, 512), torch.zeros(2, 1, 16)
    o_out, lse_out = torch.empty(1, 16, 512), torch.empty(1, 16)
    assert "launch_pdl" not in merge.merge_launch(o, lse, o_out, lse_out).kwargs
    with merge.combine_pdl():
        assert "launch_pdl" not in merge.merge_launch(o, lse, o_out, lse_out).kwargs
        plans = mla_decode_partial.op.plans
        plans.clear()
        q, pool = torch.randn(1, 16, 576), torch.randn(2, 64, 576)
        table, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([64], dtype=torch.int32)
        mla_decode_partial(q, pool, table, lens, softmax_scale=0.1, check_inputs=False)
    mla_decode_partial(q, pool, table, lens, softmax_scale=0.1, check_inputs=False)
    assert (plans.misses, plans.hits) == (2, 0)
    monkeypatch.setattr(merge, "interpreted", lambda device: False)
    with merge.combine_pdl():
        ln = merge.merge_launch(o, lse, o_out, lse_out)
    assert ln.kwargs["PDL"] is True and ln.kwargs["launch_pdl"] is True
    assert ln.name.endswith(",pdl]")
    assert "launch_pdl" not in merge.merge_launch(o, lse, o_out, lse_out).kwargs
    assert merge.merge_launch(o, lse, o_out, lse_out, pdl=True).kwargs["launch_pdl"] is True


def test_device_calls_under_the_interpreter_patch_the_language_once_per_launch(monkeypatch):
    """``_core.execution.skip_repatching_device_calls`` (applied when interpreting): a merge launch
    patches ``triton.language`` for the interpreter once per module it meets (the kernel's
    ``tl``, then ``tl.core`` for ``tl.max``), not again at each of its programs' device calls
    (``_row_max``, ``tl.max``, ``round_to``); and the result is Triton's own, bit for bit."""
    from mqnc.triton_kernels._core.execution import interpreting, skip_repatching_device_calls

    if not interpreting():
        pytest.skip("the interpreter's patching only exists under the interpreter")
    from triton.runtime import interpreter as ti

    assert skip_repatching_device_calls()  # applied at import already: idempotent
    skipping = ti._patch_lang
    calls = []

    def counted(fn):
        calls.append(fn.__name__)
        return triton_own(fn)

    triton_own = skipping.original
    g = torch.Generator().manual_seed(7)
    o = torch.randn(3, 2, 4, 64, generator=g).to(torch.bfloat16)  # bf16 stores: round_to
    lse = torch.randn(3, 2, 4, generator=g)
    lse[1, 0] = -float("inf")  # an empty partial in some rows
    monkeypatch.setattr(skipping, "original", counted)
    got = merge_partials(o, lse, layout="MBHD")
    assert 1 <= len(calls) <= 2, calls  # the launch's own patch, then tl.core's
    monkeypatch.setattr(ti, "_patch_lang", counted)  # Triton's own behaviour
    calls.clear()
    want = merge_partials(o, lse, layout="MBHD")
    assert len(calls) > 8, calls  # at least one device call per program (8 programs)
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(got[1], want[1])
