"""RopeSpec and the fp64 RoPE references, checked against transformers' own implementation.

transformers (5.x) is a reference nobody here wrote: its ``_compute_yarn_parameters`` (the
frequencies and the cos/sin factor), ``yarn_apply_mscale`` (the softmax scale), and the
DeepseekV3 (``apply_rotary_pos_emb``, ``apply_rotary_pos_emb_interleave``) and DeepseekV2
(complex multiply) rotations. No kernels run here.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mqnc.model import ROPE_PRESET_CONFIGS, RopeSpec, YarnScaling
from mqnc.reference.attention_ref import partial_attention_reference
from mqnc.reference.rope_ref import (
    half_to_interleaved,
    interleaved_to_half,
    rope_delta_reference,
    rope_encode_reference,
    rope_rotate_reference,
)
from mqnc.testing import assert_close, tolerance

transformers = pytest.importorskip("transformers")
v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
v2 = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")

V2_LITE_SCALING = ROPE_PRESET_CONFIGS["deepseek-v2-lite"]["rope_scaling"]


def _hf_config(rope_scaling=V2_LITE_SCALING, theta=10000.0, cls=None, new_keys=False, **extra):
    cls = cls or transformers.DeepseekV3Config
    kw = dict(qk_rope_head_dim=64, qk_nope_head_dim=128, max_position_embeddings=163840, **extra)
    if new_keys:
        params = {"rope_type": "default", "rope_theta": theta}
        if rope_scaling is not None:
            params = {
                **{k: v for k, v in rope_scaling.items() if k != "type"},
                "rope_type": "yarn",
                "rope_theta": theta,
            }
        return cls(rope_parameters=params, **kw)
    return cls(rope_scaling=rope_scaling, rope_theta=theta, **kw)


# ---- RopeSpec vs transformers ----
@pytest.mark.parametrize("new_keys", [False, True], ids=["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("model", ["v3", "v2"])
def test_v2_lite_frequencies_match_transformers_bitwise(new_keys, model):
    cls = transformers.DeepseekV3Config if model == "v3" else transformers.DeepseekV2Config
    emb_cls = v3.DeepseekV3RotaryEmbedding if model == "v3" else v2.DeepseekV2RotaryEmbedding
    cfg = _hf_config(cls=cls, new_keys=new_keys)
    emb = emb_cls(cfg)
    spec = RopeSpec.from_hf_config(cfg)
    assert spec == RopeSpec.from_preset("deepseek-v2-lite")
    assert torch.equal(torch.tensor(spec.inv_freq, dtype=torch.float32), emb.inv_freq)
    assert spec.attention_factor == emb.attention_scaling == 1.0
    hf_scale = v3.yarn_apply_mscale(cfg.rope_parameters, spec.qk_head_dim**-0.5)
    assert spec.softmax_scale == pytest.approx(hf_scale, rel=1e-15)
    m = 0.1 * 0.707 * math.log(40) + 1
    assert spec.softmax_scale == pytest.approx(192**-0.5 * m * m, rel=1e-15)


@given(
    factor=st.sampled_from([2.0, 4.0, 16.0, 40.0]),
    ompe=st.sampled_from([2048, 4096, 8192]),
    beta_fast=st.sampled_from([16, 32, 64]),
    beta_slow=st.sampled_from([1, 2]),
    mscale=st.sampled_from([0.707, 1.0]),
    mscale_all_dim=st.sampled_from([0.707, 1.0]),
    theta=st.sampled_from([10000.0, 50000.0, 1e6]),
)
def test_yarn_frequencies_and_factor_match_transformers(
    factor, ompe, beta_fast, beta_slow, mscale, mscale_all_dim, theta
):
    scaling = dict(
        type="yarn",
        factor=factor,
        original_max_position_embeddings=ompe,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )
    cfg = _hf_config(scaling, theta=theta)
    emb = v3.DeepseekV3RotaryEmbedding(cfg)
    spec = RopeSpec.from_hf_config(cfg)
    assert torch.equal(torch.tensor(spec.inv_freq, dtype=torch.float32), emb.inv_freq)
    assert spec.attention_factor == pytest.approx(emb.attention_scaling, rel=1e-15)
    hf_scale = v3.yarn_apply_mscale(cfg.rope_parameters, 192**-0.5)
    assert spec.softmax_scale == pytest.approx(hf_scale, rel=1e-15)


def test_plain_rope_matches_transformers_default():
    cfg = _hf_config(None, new_keys=True)
    emb = v3.DeepseekV3RotaryEmbedding(cfg)
    spec = RopeSpec.from_hf_config(cfg)
    assert spec.yarn is None
    assert torch.equal(torch.tensor(spec.inv_freq, dtype=torch.float32), emb.inv_freq)
    assert spec.attention_factor == 1.0 and spec.softmax_scale == 192**-0.5


def test_yarn_blend_structure():
    """Independent of transformers: pairs below the ramp extrapolate (theta^(-2i/d)), pairs
    above interpolate (divided by the factor); V2-Lite's ramp is pairs 10..23."""
    spec = RopeSpec.from_preset("deepseek-v2-lite")
    from mqnc.model import yarn_find_correction_range

    assert yarn_find_correction_range(32, 1, 64, 10000, 4096) == (10, 23)
    f = torch.tensor(spec.inv_freq, dtype=torch.float64)
    base = 10000.0 ** -(torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(f[:11], base[:11], rtol=1e-6, atol=0)
    assert torch.allclose(f[23:], base[23:] / 40, rtol=1e-6, atol=0)
    assert (f[11:23] < base[11:23]).all() and (f[11:23] > base[11:23] / 40).all()


def test_from_hf_config_errors():
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        RopeSpec.from_hf_config({"rope_theta": 10000})
    with pytest.raises(ValueError, match="not supported"):
        RopeSpec.from_hf_config({"qk_rope_head_dim": 64, "rope_scaling": {"type": "longrope"}})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RopeSpec.from_hf_config(
            {"qk_rope_head_dim": 64, "rope_scaling": {"type": "yarn", "factor": 4}}
        )
    with pytest.raises(TypeError, match="config"):
        RopeSpec.from_hf_config(42)
    with pytest.raises(ValueError, match="layout"):
        RopeSpec(layout="neox")
    with pytest.raises(ValueError, match="rope_dim"):
        RopeSpec(rope_dim=63)
    with pytest.raises(ValueError, match="unknown rope preset"):
        RopeSpec.from_preset("llama")
    with pytest.raises(ValueError, match="factor"):
        YarnScaling(factor=-1.0, original_max_position_embeddings=4096)


def test_missing_factor_from_max_positions():
    cfg = {
        "qk_rope_head_dim": 64,
        "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096},
    }
    assert RopeSpec.from_hf_config(cfg).yarn.factor == 40.0


# ---- the fp64 reference rotation vs transformers' rotations ----
def _hf_cos_sin(cfg, positions):
    emb = v3.DeepseekV3RotaryEmbedding(cfg)
    x = torch.zeros(1, dtype=torch.float32)
    return emb(x, positions[None, :])  # [1, T, 64] each, cat(freqs, freqs), fp32


@pytest.fixture(scope="module")
def v2_lite_cfg():
    return _hf_config()


def test_reference_matches_hf_interleave_variant(v2_lite_cfg):
    """DeepseekV3 with rope_interleave=True: interleaved in, half-split out (its cache layout)."""
    g = torch.Generator().manual_seed(0)
    T = 257
    pos = torch.randint(0, 4096, (T,), generator=g)
    k = torch.randn(1, 1, T, 64, generator=g).clamp(-4, 4)
    cos, sin = _hf_cos_sin(v2_lite_cfg, pos)
    _, k_hf = v3.apply_rotary_pos_emb_interleave(k, k, cos, sin)
    ours = rope_encode_reference(k[0, 0], pos, RopeSpec.from_preset("deepseek-v2-lite"))
    assert_close(
        k_hf[0, 0],
        interleaved_to_half(ours),
        tolerance("rope_vs_hf", "float32"),
        name="k_pe (interleaved -> half)",
    )
    # The same keys permuted to halves first and rotated with the "half" layout agree too.
    ours_half = rope_encode_reference(
        interleaved_to_half(k[0, 0]), pos, RopeSpec.from_preset("deepseek-v2-lite", layout="half")
    )
    assert torch.equal(ours_half, interleaved_to_half(ours))


def test_reference_matches_hf_rotate_half(v2_lite_cfg):
    g = torch.Generator().manual_seed(1)
    T = 257
    pos = torch.randint(0, 4096, (T,), generator=g)
    k = torch.randn(1, 1, T, 64, generator=g).clamp(-4, 4)
    cos, sin = _hf_cos_sin(v2_lite_cfg, pos)
    q_hf, k_hf = v3.apply_rotary_pos_emb(k, k, cos, sin)
    ours = rope_encode_reference(
        k[0, 0], pos, RopeSpec.from_preset("deepseek-v2-lite", layout="half")
    )
    assert_close(k_hf[0, 0], ours, tolerance("rope_vs_hf", "float32"), name="k_pe (half)")


def test_reference_matches_hf_deepseek_v2_complex():
    """DeepseekV2 (complex multiply on interleaved pairs, interleaved out), with a config whose
    YaRN cos/sin factor is not 1 (mscale 1.0 vs mscale_all_dim 0.707), so the encode factor is
    exercised."""
    scaling = {**V2_LITE_SCALING, "mscale": 1.0}
    cfg = _hf_config(scaling, cls=transformers.DeepseekV2Config)
    emb = v2.DeepseekV2RotaryEmbedding(cfg)
    spec = RopeSpec.from_hf_config(cfg)
    assert spec.attention_factor == pytest.approx(emb.attention_scaling, rel=1e-15)
    assert spec.attention_factor > 1.05
    g = torch.Generator().manual_seed(2)
    T = 129
    pos = torch.randint(0, 4096, (T,), generator=g)
    k = torch.randn(1, 1, T, 64, generator=g).clamp(-4, 4)
    freqs_cis = emb(torch.zeros(1), pos[None, :])
    _, k_hf = v2.apply_rotary_emb(k, k, freqs_cis)
    ours = rope_encode_reference(k[0, 0], pos, spec)
    tol = tolerance("rope_vs_hf", "float32")
    assert_close(
        k_hf[0, 0],
        ours,
        atol=tol.atol * spec.attention_factor,
        rms_rtol=tol.rms_rtol,
        name="k_pe (complex)",
    )


# ---- algebra of the reference ----
@given(
    p=st.integers(0, 200_000),
    delta=st.integers(-200_000, 200_000),
    layout=st.sampled_from(["interleaved", "half"]),
    yarn=st.booleans(),
)
def test_reference_delta_composes_with_encoding(p, delta, layout, yarn):
    spec = RopeSpec.from_preset("deepseek-v2-lite", layout=layout)
    if not yarn:
        spec = spec.replace(yarn=None)
    k = torch.randn(7, 64, generator=torch.Generator().manual_seed(p % 1000), dtype=torch.float64)
    lhs = rope_delta_reference(rope_encode_reference(k, p, spec), delta, spec)
    rhs = rope_encode_reference(k, p + delta, spec)
    # fp64 angles up to ~4e5 rad: cos/sin of an angle carry ~ulp(4e5) = 6e-11 absolute error.
    assert_close(lhs, rhs, atol=1e-9, rms_rtol=1e-9, name="R(d) enc(p) vs enc(p+d)")


def test_layout_permutations_are_inverse():
    x = torch.randn(3, 5, 64)
    assert torch.equal(half_to_interleaved(interleaved_to_half(x)), x)
    assert torch.equal(interleaved_to_half(torch.arange(64.0))[:4], torch.tensor([0.0, 2, 4, 6]))


def test_reference_scores_invariant_under_common_shift():
    spec = RopeSpec.from_preset("deepseek-v2-lite")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 576, generator=g, dtype=torch.float64)
    kv = torch.randn(2, 33, 576, generator=g, dtype=torch.float64)
    q[..., 512:] = rope_encode_reference(q[..., 512:], 5000, spec)
    kv[..., 512:] = rope_encode_reference(kv[..., 512:], torch.arange(33) * 37, spec)
    valid = torch.ones(2, 33, dtype=torch.bool)
    o0, l0 = partial_attention_reference(q, kv, valid, spec.softmax_scale)
    o1, l1 = partial_attention_reference(
        rope_rotate_reference(q, 12345, spec),
        rope_rotate_reference(kv, 12345, spec),
        valid,
        spec.softmax_scale,
    )
    assert_close(o1, o0, atol=1e-10, name="o")
    assert_close(l1, l0, atol=1e-10, name="lse")
