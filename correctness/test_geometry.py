"""Geometry presets and derived byte sizes (§3.2): derived from dims, never typed twice."""

from __future__ import annotations

import pytest

from mqnc.model import PRESET_CONFIGS, PRESETS, MLAGeometry, get_preset


def test_v2_lite_wire_sizes_follow_from_dims():
    g = get_preset("deepseek-v2-lite")
    assert (g.d_c, g.d_r, g.heads, g.layers) == (512, 64, 16, 27)
    assert g.d_qk == g.d_c + g.d_r
    # §3.2: q = d_qk x 2 B, p = d_v x 2 B + 2 x 4 B.
    assert g.q_row_bytes == g.d_qk * 2
    assert g.p_row_bytes == g.d_v * 2 + 2 * 4
    assert g.qp_row_bytes == g.q_row_bytes + g.p_row_bytes
    assert g.chunk_bytes(2048) == 2048 * g.layers * g.d_qk * 2


def test_fp32_wire_doubles_row_bytes():
    g = get_preset("deepseek-v2-lite").replace(wire_dtype="fp32")
    assert g.q_row_bytes == g.d_qk * 4 and g.p_row_bytes == g.d_v * 4 + 8


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_hf_config(name):
    g = MLAGeometry.from_hf_config(PRESET_CONFIGS[name], name=name)
    assert g.d_c == PRESET_CONFIGS[name]["kv_lora_rank"]
    assert g.heads == PRESET_CONFIGS[name]["num_attention_heads"]
    assert g.topk == PRESET_CONFIGS[name].get("index_topk")


def test_selection_budgets_of_sparse_presets():
    # §5.4: V3.2 and GLM-5.1 select 2048 tokens, V4-Flash 512 compressed entries.
    assert PRESETS["deepseek-v3.2"].topk == PRESETS["glm-5.1"].topk == 2048
    assert PRESETS["deepseek-v4-flash"].topk == 512
    assert PRESETS["deepseek-v3"].topk is None


def test_from_transformers_config_object():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        num_attention_heads=8, num_hidden_layers=3, kv_lora_rank=512, qk_rope_head_dim=64
    )
    g = MLAGeometry.from_hf_config(cfg)
    assert (g.d_c, g.d_r, g.heads, g.layers) == (512, 64, 8, 3)


def test_kimi_style_text_config_is_read_through():
    g = MLAGeometry.from_hf_config({"text_config": PRESET_CONFIGS["kimi-k2"]}, name="k")
    assert g.heads == 64


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_c=0), "d_c"),
        (dict(d_r=63), "d_r: expected an even width"),
        (dict(heads=2.5), "heads"),
        (dict(topk=0), "topk"),
        (dict(cache_dtype="int4"), "cache_dtype"),
    ],
)
def test_bad_geometry_is_rejected(kwargs, match):
    base = dict(name="x", d_c=512, d_r=64, heads=16, layers=27)
    with pytest.raises(ValueError, match=match):
        MLAGeometry(**{**base, **kwargs})


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="deepseek-v2-lite"):
        get_preset("llama")


def test_non_mla_config_is_rejected():
    with pytest.raises(ValueError, match="missing"):
        MLAGeometry.from_hf_config({"num_attention_heads": 32, "num_hidden_layers": 2})


def test_hf_config_values_are_taken_as_given_never_cut_or_replaced():
    """A float is not truncated to an int and a 0 is not replaced by the default 128: the
    geometry (and the RoPE spec) refuse them by name; only an absent width defaults."""
    from mqnc.model import MLAGeometry, RopeSpec

    base = dict(kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16, num_hidden_layers=27)
    for bad, name in (
        (dict(kv_lora_rank=512.9), "d_c"),
        (dict(num_attention_heads=16.5), "heads"),
        (dict(qk_nope_head_dim=0), "qk_nope_head_dim"),
        (dict(v_head_dim=0), "v_head_dim"),
    ):
        with pytest.raises(ValueError, match=f"MLAGeometry.{name}: expected an int >= 1"):
            MLAGeometry.from_hf_config(base | bad)
    g = MLAGeometry.from_hf_config(base | dict(v_head_dim=None))
    assert g.qk_nope_head_dim == g.v_head_dim == 128
    for bad, name in ((dict(qk_nope_head_dim=0), "qk_nope_head_dim"),
                      (dict(qk_rope_head_dim=63.5), "qk_rope_head_dim")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            RopeSpec.from_hf_config(base | bad)
    assert RopeSpec.from_hf_config(base).qk_head_dim == 192


def test_fp8_cache_entry_is_656_bytes_and_bf16_stays_1152():
    """b_KV follows the cache format: DeepSeek-V3.2's FP8 entry (512 FP8 latent bytes, 4 fp32
    scales, 64 bf16 RoPE values) is 656 B; the paper's bf16 entry stays 1152 B; the wire rows
    do not change with the cache format."""
    from mqnc.model.kv_format import FP8_E4M3, kv_bytes_per_token

    g = get_preset("deepseek-v3.2")
    f = g.replace(cache_dtype="fp8_e4m3")
    assert g.kv_bytes_per_token_layer == 1152 and f.kv_bytes_per_token_layer == 656
    assert f.chunk_bytes(2048) == 2048 * g.layers * 656
    assert (f.q_row_bytes, f.p_row_bytes) == (g.q_row_bytes, g.p_row_bytes)
    lay = FP8_E4M3.layout(512, 64)
    assert [x[:3] for x in lay.fields()] == [
        ("latent", 0, 512), ("scales", 512, 16), ("rope", 528, 128)
    ]  # fmt: skip
    assert sum(x[2] for x in lay.fields()) == lay.token_bytes == 656
    assert kv_bytes_per_token("fp32", 512, 64) == 2304


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cache_dtype="fp8"), "fp8_e4m3': FP8 latent with scales"),
        (dict(cache_dtype="fp8_e4m3", d_c=448), "multiple of 128"),
    ],
)
def test_fp8_cache_format_refuses_what_it_cannot_lay_out(kwargs, match):
    base = dict(name="x", d_c=512, d_r=64, heads=16, layers=27)
    with pytest.raises(ValueError, match=match):
        MLAGeometry(**{**base, **kwargs})
