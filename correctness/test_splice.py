"""rope_splice and rope_rotate (§2.2, §3.2, §3.3) against the fp64 references and transformers.

Pools are NaN-filled before a splice, so a slot the kernel should have written and did not (or
one it should not have touched and did) shows up as a NaN-mask mismatch; outputs of
``rope_rotate`` are NaN-poisoned by the launcher (MQNC_POISON_OUTPUTS=1, set in conftest).
Under the interpreter shapes stay small (L <= 3, ct <= 40) except where the production width
576 = 512 + 64 matters, which is everywhere.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mqnc.model import ROPE_PRESET_CONFIGS, RopeSpec
from mqnc.reference.attention_ref import partial_attention_reference
from mqnc.reference.rope_ref import (
    rope_encode_reference,
    rope_rotate_reference,
    rope_splice_reference,
)
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.triton_kernels import merge_partials, mla_sparse_partial
from mqnc.triton_kernels.splice.rotate import rope_rotate, rope_splice

D, D_C, D_R = 576, 512, 64
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
device = default_device()


def _spec(layout: str = "interleaved", yarn: bool = True) -> RopeSpec:
    spec = RopeSpec.from_preset("deepseek-v2-lite", layout=layout)
    return spec if yarn else spec.replace(yarn=None)


def _entries(g, *shape, dtype=torch.float32, device="cpu"):
    """Cache entries / query rows with |x| <= 4 per dim (the premise of the tolerance table)."""
    return torch.randn(*shape, generator=g).clamp(-4, 4).to(dtype=dtype, device=device)


def _nan_pool(L, num_blocks, block_size, dtype, device):
    return torch.full((L, num_blocks, block_size, D), float("nan"), dtype=dtype, device=device)


# ---- splice vs the fp64 reference ----
@given(
    L=st.integers(1, 3),
    ct=st.integers(1, 40),
    block_size=st.sampled_from([1, 16, 64]),
    extra_blocks=st.integers(0, 2),
    layout=st.sampled_from(["interleaved", "half"]),
    yarn=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    delta_kind=st.sampled_from(["int", "per_token"]),
    delta=st.integers(-(2**31) + 1, 2**31 - 1),
    seed=st.integers(0, 2**16),
)
def test_splice_matches_reference(
    L, ct, block_size, extra_blocks, layout, yarn, dtype, delta_kind, delta, seed
):
    g = torch.Generator().manual_seed(seed)
    spec = _spec(layout, yarn)
    num_blocks = -(-ct // block_size) + extra_blocks
    chunk = _entries(g, L, ct, D, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:ct].to(device)
    if delta_kind == "per_token":
        # Mix the drawn delta with small and large per-token values.
        d = torch.randint(-200_000, 200_000, (ct,), generator=g)
        d[0] = delta
        d = d.to(device)
    else:
        d = delta
    pool = _nan_pool(L, num_blocks, block_size, dtype, device)
    expected = rope_splice_reference(chunk, pool, slots, d, spec)
    out = rope_splice(chunk, pool, slots, d, spec)
    assert out is pool
    # The latent is copied bit-exactly; untouched slots stay NaN (mask compared below).
    flat = pool.view(L, -1, D)
    assert torch.equal(flat[:, slots, :D_C], chunk[..., :D_C])
    assert_close(pool, expected, tolerance("rope", dtype), name="pool")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_splice_leaves_other_slots_untouched(dtype):
    g = torch.Generator().manual_seed(0)
    spec = _spec()
    pool = _entries(g, 2, 3, 16, D, dtype=dtype, device=device)
    before = pool.clone()
    slots = torch.tensor([3, 17, 40, 41, 5], device=device)
    chunk = _entries(g, 2, 5, D, dtype=dtype, device=device)
    rope_splice(chunk, pool, slots, -77, spec)
    keep = torch.ones(48, dtype=torch.bool)
    keep[slots.cpu()] = False
    assert torch.equal(
        pool.view(2, 48, D)[:, keep.to(device)], before.view(2, 48, D)[:, keep.to(device)]
    )


def test_splice_delta_zero_is_a_copy():
    """R(0) = I: with delta 0 the whole entry, rope dims included, is copied bit-exactly."""
    g = torch.Generator().manual_seed(1)
    chunk = _entries(g, 3, 20, D, dtype=torch.bfloat16, device=device)
    pool = _nan_pool(3, 1, 20, torch.bfloat16, device)
    rope_splice(chunk, pool, torch.arange(20, device=device), 0, _spec())
    assert torch.equal(pool[:, 0], chunk)


def test_splice_empty_chunk_is_a_no_op():
    pool = _nan_pool(2, 1, 4, torch.float32, device)
    chunk = torch.zeros(2, 0, D, device=device)
    rope_splice(chunk, pool, torch.zeros(0, dtype=torch.int64, device=device), 5, _spec())
    assert torch.isnan(pool).all()


# ---- splice(chunk at p, delta) == encoding at p + delta ----
@given(
    ct=st.integers(1, 24),
    p0=st.integers(0, 100_000),
    delta=st.integers(-100_000, 100_000),
    layout=st.sampled_from(["interleaved", "half"]),
    yarn=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_splice_equals_encoding_at_new_positions(ct, p0, delta, layout, yarn, dtype):
    g = torch.Generator().manual_seed(ct * 7919 + p0 % 1000)
    spec = _spec(layout, yarn)
    L = 2
    raw = torch.randn(L, ct, D, generator=g, dtype=torch.float64).clamp(-2.8, 2.8)
    pos = p0 + torch.arange(ct)
    new = pos + delta
    if int(new.min()) < 0:  # positions are non-negative: shift the chunk's new home up
        new, delta = new - int(new.min()), delta - int(new.min())
    cached = raw.clone()
    cached[..., D_C:] = rope_encode_reference(raw[..., D_C:], pos, spec)  # |x| <= 4 per dim
    chunk = cached.to(dtype).to(device)
    pool = _nan_pool(L, 1, ct, dtype, device)
    rope_splice(chunk, pool, torch.arange(ct, device=device), delta, spec)
    expected = raw.clone()
    expected[..., D_C:] = rope_encode_reference(raw[..., D_C:], new, spec)
    expected[..., :D_C] = chunk[..., :D_C].double().cpu()
    assert_close(pool[:, 0], expected, tolerance("rope_twice", dtype), name="spliced keys")


# ---- rope_rotate ----
@given(
    B=st.integers(1, 4),
    H=st.sampled_from([1, 3, 16]),
    layout=st.sampled_from(["interleaved", "half"]),
    dtype=st.sampled_from(DTYPES),
    delta=st.integers(-(2**31) + 1, 2**31 - 1),
    per_token=st.booleans(),
)
def test_rotate_matches_reference(B, H, layout, dtype, delta, per_token):
    g = torch.Generator().manual_seed(B * 31 + H)
    spec = _spec(layout)
    q = _entries(g, B, H, D, dtype=dtype, device=device)
    if per_token:
        d = torch.randint(-(2**20), 2**20, (B,), generator=g)
        d[0] = delta
        d = d.to(device)
    else:
        d = delta
    out = rope_rotate(q, d, spec)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(out[..., :D_C], q[..., :D_C])
    assert_close(out, rope_rotate_reference(q, d, spec), tolerance("rope", dtype), name="q")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rotate_delta_then_minus_delta_returns_input(dtype, layout):
    g = torch.Generator().manual_seed(5)
    spec = _spec(layout)
    x = _entries(g, 6, 4, D, dtype=dtype, device=device)
    delta = torch.tensor([0, 1, -1, 4095, 163_839, -(2**30)], device=device)
    back = rope_rotate(rope_rotate(x, delta, spec), -delta, spec)
    assert torch.equal(back[..., :D_C], x[..., :D_C])
    assert_close(back, x, tolerance("rope_twice", dtype), name="R(-d) R(d) x")


def test_rotate_full_shape_delta_and_strided_input():
    g = torch.Generator().manual_seed(6)
    spec = _spec()
    x = _entries(g, 3, 5, 2 * D, device=device)[..., :D]  # rows strided, last dim unit
    d = torch.randint(-9999, 9999, (3, 5), generator=g).to(device)
    out = rope_rotate(x, d, spec)
    assert_close(out, rope_rotate_reference(x, d, spec), tolerance("rope", torch.float32), name="x")


# ---- position-obliviousness: shifting queries and keys together keeps the scores -----------------
@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_scores_invariant_when_queries_and_keys_shift(layout):
    """§3.2: the requester rotates its query by the holder's offset instead of the holder
    re-homing its cache; attention scores only see relative positions."""
    g = torch.Generator().manual_seed(7)
    spec = _spec(layout)
    B, H, N = 2, 4, 37
    raw_q = torch.randn(B, H, D, generator=g, dtype=torch.float64).clamp(-2.8, 2.8)
    raw_k = torch.randn(1, N, D, generator=g, dtype=torch.float64).clamp(-2.8, 2.8)
    q = raw_q.clone()
    q[..., D_C:] = rope_encode_reference(raw_q[..., D_C:], torch.tensor([[9000], [9001]]), spec)
    k = raw_k.clone()
    k[..., D_C:] = rope_encode_reference(raw_k[..., D_C:], torch.arange(N) * 211, spec)
    q32, k32 = q.float().to(device), k.float().to(device)
    s_ref = torch.einsum("bhd,nd->bhn", q32.double().cpu(), k32[0].double().cpu())
    for delta in (1, 4096, -8000, 150_000):
        q_shift = rope_rotate(q32, delta, spec)
        pool = _nan_pool(1, 1, N, torch.float32, device)
        rope_splice(k32, pool, torch.arange(N, device=device), delta, spec)
        s = torch.einsum("bhd,nd->bhn", q_shift.double().cpu(), pool[0, 0].double().cpu())
        assert_close(s, s_ref, tolerance("rope_scores", "float32"), name=f"scores, delta={delta}")


# ---- transformers' own RoPE at the new positions ----
def test_splice_agrees_with_transformers_at_new_positions():
    """Keys encoded by transformers at p and spliced by delta equal transformers' encoding at
    p + delta, in both cache layouts: DeepseekV3 (interleave variant: interleaved in, half-split
    out, so its cache is "half") and DeepseekV2 (complex multiply, cache "interleaved")."""
    transformers = pytest.importorskip("transformers")
    v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    v2 = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")
    kw = dict(
        rope_scaling=ROPE_PRESET_CONFIGS["deepseek-v2-lite"]["rope_scaling"],
        rope_theta=10000,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        max_position_embeddings=163840,
    )
    g = torch.Generator().manual_seed(8)
    T, L = 40, 2
    pos = torch.randint(0, 2048, (T,), generator=g)
    delta = torch.randint(0, 2048, (T,), generator=g)
    k_raw = torch.randn(1, 1, T, 64, generator=g).clamp(-4, 4)
    tol = tolerance("rope_vs_hf", "float32")

    cfg3 = transformers.DeepseekV3Config(**kw)
    emb3 = v3.DeepseekV3RotaryEmbedding(cfg3)
    cos, sin = emb3(k_raw, pos[None])
    _, k_old = v3.apply_rotary_pos_emb_interleave(k_raw, k_raw, cos, sin)
    cos, sin = emb3(k_raw, (pos + delta)[None])
    _, k_new = v3.apply_rotary_pos_emb_interleave(k_raw, k_raw, cos, sin)

    cfg2 = transformers.DeepseekV2Config(**kw)
    emb2 = v2.DeepseekV2RotaryEmbedding(cfg2)
    _, k2_old = v2.apply_rotary_emb(k_raw, k_raw, emb2(k_raw, pos[None]))
    _, k2_new = v2.apply_rotary_emb(k_raw, k_raw, emb2(k_raw, (pos + delta)[None]))

    for layout, old, new, hf_cfg in (
        ("half", k_old, k_new, cfg3),
        ("interleaved", k2_old, k2_new, cfg2),
    ):
        spec = RopeSpec.from_hf_config(hf_cfg, layout=layout)
        chunk = torch.randn(L, T, D, generator=g).clamp(-4, 4)
        chunk[..., D_C:] = old[0, 0]
        pool = _nan_pool(L, 1, T, torch.float32, device)
        rope_splice(chunk.to(device), pool, torch.arange(T, device=device), delta.to(device), spec)
        assert_close(pool[:, 0, :, D_C:], new[0, 0].expand(L, T, 64), tol, name=f"HF {layout}")


# ---- §3.3 negative control ----
def test_rehoming_a_scattered_selection_breaks_attention_canonical_is_exact():
    """A sparse selection attended at its canonical positions (route: holders attend it in place
    and partials merge) reproduces attention exactly; re-homing the same scattered entries to
    contiguous offsets (the delta rotation a contiguous-reuse fetch applies) changes the output
    by a large margin (the paper saw 25-56%; here >= 20% required, per query head)."""
    spec = _spec()
    g = torch.Generator().manual_seed(9)
    n, H, span = 64, 4, 8192
    pos = torch.randperm(span, generator=g)[:n].sort().values  # scattered canonical positions
    kv = torch.randn(n, D, generator=g, dtype=torch.float64)
    kv[:, D_C:] = rope_encode_reference(kv[:, D_C:], pos, spec)
    q = torch.randn(1, H, D, generator=g, dtype=torch.float64)
    q[..., D_C:] = rope_encode_reference(q[..., D_C:], span, spec)  # the query comes after them
    valid = torch.ones(1, n, dtype=torch.bool)
    o_true, lse_true = partial_attention_reference(q, kv, valid, spec.softmax_scale)

    # Route: three holders each own a disjoint scattered subset, attended in place by the
    # package's sparse kernel (fp32), the partials merged by its merge kernel: fp64's answer.
    owner = torch.randint(0, 3, (n,), generator=g)
    pool_in_place = kv.float()[None].to(device)  # [1 page, n, D]: the entries where they sit
    parts = []
    for m in range(3):
        idx = torch.full((1, n), -1, dtype=torch.int32)
        mine = (owner == m).nonzero().flatten()
        idx[0, : mine.numel()] = mine.to(torch.int32)
        parts.append(mla_sparse_partial(q.float().to(device), pool_in_place, idx.to(device),
                                        softmax_scale=spec.softmax_scale))  # fmt: skip
    o_route, lse_route = merge_partials(
        torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), layout="MBHD"
    )
    assert_close(o_route, o_true, tolerance("mla_routed", torch.float32), name="route o")
    assert_close(lse_route, lse_true, tolerance("mla_lse", torch.float32), name="route lse")

    # Fetch with re-homing: the scattered entries spliced to contiguous offsets before the query.
    pool = _nan_pool(1, 1, n, torch.float32, device)
    new = span - n + torch.arange(n)
    rope_splice(
        kv[None].float().to(device),
        pool,
        torch.arange(n, device=device),
        (new - pos).to(device),
        spec,
    )
    o_rehomed, _ = partial_attention_reference(q, pool[0, 0].cpu(), valid, spec.softmax_scale)
    rel = (o_rehomed - o_true).norm(dim=-1) / o_true.norm(dim=-1)
    assert rel.min() >= 0.2, f"re-homing changed attention by only {rel.tolist()}"


# ---- validation ----
def _valid_args(device):
    chunk = torch.zeros(2, 4, D, device=device)
    pool = torch.zeros(2, 2, 4, D, device=device)
    return chunk, pool, torch.tensor([0, 1, 5, 7], device=device)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(slots=[0, 1, 5, 8]), ValueError, r"slot_mapping: expected slots in \[0, 8\)"),
        (dict(slots=[0, -1, 5, 7]), ValueError, "out-of-range slots"),
        (dict(slots=[0, 1, 5, 5]), ValueError, "distinct slots"),
        (dict(slots_dtype=torch.int32), TypeError, "slot_mapping: invalid dtype"),
        (dict(slots=[0, 1, 5]), ValueError, "slot_mapping: expected shape"),
        (dict(pool_dtype=torch.bfloat16), TypeError, "pool: invalid dtype"),
        (dict(pool_shape=(3, 2, 4, D)), ValueError, "pool: expected shape"),
        (dict(pool_shape=(2, 2, 4, 512)), ValueError, "pool: expected shape"),
        (dict(chunk_shape=(2, 4, 64)), ValueError, "chunk: expected the last dim"),
        (dict(chunk_dtype=torch.int32), TypeError, "chunk: invalid dtype"),
        (dict(delta=2.5), TypeError, "delta: expected an int"),
        (dict(delta=True), TypeError, "delta: expected an int"),
        (dict(delta=2**40), ValueError, r"delta: expected \|delta\|"),
        (dict(delta_tensor=[1, 2, 3]), ValueError, "delta: expected shape"),
        (dict(delta_tensor=[1, 2, 3, 2**40]), ValueError, r"delta: expected \|delta\|"),
        (dict(rope="yarn"), TypeError, "rope: expected a RoPE spec with inv_freq"),
    ],
)
def test_splice_rejects_bad_input(change, exc, match):
    chunk, pool, slots = _valid_args(device)
    if "slots" in change:
        slots = torch.tensor(change["slots"], device=device)
    if "slots_dtype" in change:
        slots = slots.to(change["slots_dtype"])
    if "pool_dtype" in change:
        pool = pool.to(change["pool_dtype"])
    if "pool_shape" in change:
        pool = torch.zeros(change["pool_shape"], device=device)
    if "chunk_shape" in change:
        chunk = torch.zeros(change["chunk_shape"], device=device)
    if "chunk_dtype" in change:
        chunk = chunk.to(change["chunk_dtype"])
    delta = change.get("delta", 3)
    if "delta_tensor" in change:
        delta = torch.tensor(change["delta_tensor"], device=device)
    rope = change.get("rope", _spec())
    with pytest.raises(exc, match=match):
        rope_splice(chunk, pool, slots, delta, rope)


def test_rotate_rejects_bad_input():
    x = torch.zeros(2, 3, D, device=device)
    with pytest.raises(ValueError, match="delta: expected shape equal to a prefix"):
        rope_rotate(x, torch.tensor([1, 2, 3], device=device), _spec())
    with pytest.raises(TypeError, match="delta: invalid dtype"):
        rope_rotate(x, torch.tensor([1.0, 2.0], device=device), _spec())
    with pytest.raises(TypeError, match="x: invalid dtype"):
        rope_rotate(x.to(torch.int64), 1, _spec())
    with pytest.raises(ValueError, match="x: expected the last dim"):
        rope_rotate(torch.zeros(2, 64, device=device), 1, _spec())


@pytest.mark.parametrize(
    "dtype, delta_kind, layers",
    [
        (torch.bfloat16, "per_token", "stacked"),
        (torch.float32, "int", "stacked"),
        (torch.bfloat16, "int", "list"),
    ],
    ids=str,
)
def test_persistent_splice_writes_the_default_splice_bit_for_bit(
    monkeypatch, dtype, delta_kind, layers
):
    """The persistent-grid candidate (``splice.rotate.persistent_splice``): each program strides
    over the (token tile, layer) pairs (here 4 programs for 3 layers x 3 tiles, so programs loop),
    doing one default program's arithmetic per pair: the same pool bit for bit (so the latent
    copy is exact and the rotation within the fp64 reference's bound, as the default's), the
    other slots left NaN; stacked or per-layer pools, one or per-token deltas."""
    from mqnc.triton_kernels.splice import rotate as splice

    monkeypatch.setattr(splice, "sm_count", lambda device: 1)
    g = torch.Generator().manual_seed(7)
    spec = _spec()
    L, ct, block_size, num_blocks = 3, 19, 16, 3
    chunk = _entries(g, L, ct, D, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:ct].to(device)
    d = torch.randint(-200_000, 200_000, (ct,), generator=g).to(device)
    d = d if delta_kind == "per_token" else 123_457

    def pools(persistent):
        pool = _nan_pool(L, num_blocks, block_size, dtype, device)
        target = list(pool.unbind(0)) if layers == "list" else pool
        with splice.persistent_splice(persistent):
            rope_splice(chunk, target, slots, d, spec)
        return pool

    plain, persistent = pools(False), pools(True)
    assert torch.equal(plain.isnan(), persistent.isnan())
    assert torch.equal(plain.nan_to_num(), persistent.nan_to_num())
    expected = rope_splice_reference(chunk, _nan_pool(L, num_blocks, block_size, dtype, device),
                                     slots, d, spec)  # fmt: skip
    assert_close(persistent, expected, tolerance("rope", dtype), name="pool")
    launch = splice.splice_launch(
        chunk, plain, slots, d, torch.zeros(32, dtype=torch.float64), ct, L, block_size,
        (chunk.stride(0), chunk.stride(1)), plain.stride()[:3], spec, persistent=True,
    )  # fmt: skip
    assert launch.grid == (splice.PERSISTENT_CTAS_PER_SM,) and launch.name.endswith(",persistent]")


# ---- FP8 entries (mqnc.model.kv_format): only the bf16 RoPE part is rotated ----
W8, PREFIX8 = 656, 528  # one FP8 entry of 512 + 64: latent and scale bytes, then 64 bf16


def _fp8_chunk(g, L, ct):
    """FP8 entries of cache rows with |x| <= 4 (quantized by the reference's recipe)."""
    from mqnc.triton_kernels.fp8.quant import fp8_quantize

    return fp8_quantize(_entries(g, L, ct, D, dtype=torch.bfloat16, device=device), D_C)


def _ff_pool(L, num_blocks, block_size):
    """An FP8 pool of 0xFF bytes: NaN latent bytes, NaN scales, NaN bf16 RoPE values."""
    return torch.full((L, num_blocks, block_size, W8), 0xFF, dtype=torch.uint8, device=device)


@pytest.mark.parametrize(
    "ct, layout, delta_kind, layers, persistent",
    [
        (13, "interleaved", "int", "stacked", False),
        (9, "half", "per_token", "stacked", False),
        (5, "interleaved", "per_token", "list", False),
        (13, "interleaved", "per_token", "stacked", True),
    ],
)
def test_fp8_splice_copies_latent_and_scales_and_rotates_rope(
    monkeypatch, ct, layout, delta_kind, layers, persistent
):
    """An FP8 chunk spliced by the 16-bit kernel over its bytes read as bf16: latent and
    scale bytes bit-identical to the source, the RoPE part within the bf16 splice's bound of
    the fp64 rotation, every other byte of the 0xFF-poisoned pool untouched; stacked or
    per-layer pools, the persistent grid too (4 programs looping over 2 layers x 2 tiles)."""
    from mqnc.reference.rope_ref import fp8_splice_reference
    from mqnc.triton_kernels.splice import rotate as splice

    monkeypatch.setattr(splice, "sm_count", lambda device: 1)
    g = torch.Generator().manual_seed(ct)
    spec = _spec(layout)
    L, block_size, num_blocks = 2, 16, 2
    chunk = _fp8_chunk(g, L, ct)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:ct].to(device)
    d = 2**31 - 1 if delta_kind == "int" else torch.randint(-(2**30), 2**30, (ct,), generator=g)
    d = d.to(device) if isinstance(d, torch.Tensor) else d
    pool = _ff_pool(L, num_blocks, block_size)
    target = list(pool.unbind(0)) if layers == "list" else pool
    with splice.persistent_splice(persistent):
        assert rope_splice(chunk, target, slots, d, spec) is target
    entries, rotated = fp8_splice_reference(chunk, _ff_pool(L, num_blocks, block_size), slots,
                                            d, spec)  # fmt: skip
    assert torch.equal(pool[..., :PREFIX8], entries[..., :PREFIX8])  # bit for bit, 0xFF kept
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots.cpu()] = True
    flat = pool.view(L, -1, W8)
    assert bool((flat[:, ~written.to(device)] == 0xFF).all())  # RoPE bytes of other slots too
    got = pool[..., PREFIX8:].contiguous().view(torch.bfloat16)
    assert_close(got, rotated, tolerance("rope", torch.bfloat16), name="rope part")


def test_fp8_splice_torch_backend_and_delta_zero():
    """The torch backend writes the same latent and scale bytes and RoPE values within the
    bound; at delta 0 the kernel copies whole entries bit for bit."""
    from mqnc.serving.compute import kernel_ops

    g = torch.Generator().manual_seed(3)
    spec, L, ct = _spec(), 2, 7
    chunk = _fp8_chunk(g, L, ct)
    slots = torch.arange(3, 3 + ct, device=device)
    kernel, ref = _ff_pool(L, 1, 16), _ff_pool(L, 1, 16)
    rope_splice(chunk, kernel, slots, -4097, spec)
    kernel_ops("torch").rope_splice(chunk, ref, slots, -4097, spec)
    assert torch.equal(kernel[..., :PREFIX8], ref[..., :PREFIX8])
    assert_close(kernel[..., PREFIX8:].contiguous().view(torch.bfloat16),
                 ref[..., PREFIX8:].contiguous().view(torch.bfloat16).double(),
                 tolerance("rope", torch.bfloat16), name="rope part")  # fmt: skip
    zero = _ff_pool(L, 1, 16)
    rope_splice(chunk, zero, slots, 0, spec)
    assert torch.equal(zero[:, 0, 3 : 3 + ct], chunk)


@pytest.mark.parametrize(
    "chunk_width, pool_dtype, exc, match",
    [
        (640, torch.uint8, ValueError, r"chunk: expected FP8 entries .* got 640 \(scales missing"),
        (W8, torch.bfloat16, TypeError, "pool: cache format mismatch.*got a bfloat16 cache"),
        (None, torch.uint8, TypeError, "chunk: cache format mismatch.*FP8 entries.*got bfloat16"),
        (W8, "narrow", ValueError, "pool: expected FP8 entries of 656 bytes"),
    ],
)
def test_fp8_splice_rejects_bad_input(chunk_width, pool_dtype, exc, match):
    chunk = (
        torch.zeros(2, 4, D, dtype=torch.bfloat16, device=device)
        if chunk_width is None
        else torch.zeros(2, 4, chunk_width, dtype=torch.uint8, device=device)
    )
    if pool_dtype == "narrow":
        pool = torch.zeros(2, 1, 16, 640, dtype=torch.uint8, device=device)
    elif pool_dtype == torch.uint8:
        pool = _ff_pool(2, 1, 16)
    else:
        pool = torch.zeros(2, 1, 16, D, dtype=pool_dtype, device=device)
    with pytest.raises(exc, match=match):
        rope_splice(chunk, pool, torch.arange(4, device=device), 5, _spec())
