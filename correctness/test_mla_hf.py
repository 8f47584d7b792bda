"""A real model, not our own reference: mqnc's absorbed pipeline reproduces Hugging Face
transformers' ``DeepseekV3Attention`` (§2.1, §3.3).

A small module (random weights, kv_lora_rank 512, qk_rope_head_dim 64, YaRN RoPE as in
DeepSeek-V2-Lite, both ``rope_interleave`` settings, with and without query LoRA) runs on a
short causal sequence. mqnc then rebuilds every token's output from its own pieces: cache
entries ``[c_KV, k_pe]`` (``mqnc.model.project_kv``, ``k_pe`` rotated by the module's own
rotary embedding and rotation function), absorbed queries (``absorb_query``), the cache split
across M holders that each attend their chunk with the Triton kernel (causal prefixes give
per-row lengths, empty for a holder whose chunk lies in a query's future), ``merge_partials``,
then ``W_UV`` and ``o_proj`` (``output_projection``). The softmax scale is read from the
config by ``softmax_scale_from_config`` and checked against the module's.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

from mqnc.model import (  # noqa: E402
    MLAWeights,
    absorb_query,
    cache_entry,
    output_projection,
    project_kv,
    project_query,
    softmax_scale_from_config,
)
from mqnc.testing import assert_close, default_device, tolerance  # noqa: E402
from mqnc.triton_kernels import merge_partials, mla_decode_partial  # noqa: E402

DEVICE = default_device()
YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "rope_theta": 10000.0,
}


def hf_attention(rope_interleave: bool, q_lora_rank: int | None, seed: int):
    cfg = DeepseekV3Config(
        hidden_size=96,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=1,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=48,
        q_lora_rank=q_lora_rank,
        rope_interleave=rope_interleave,
        rope_parameters=dict(YARN),
        max_position_embeddings=163840,
        attention_bias=False,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = hf.DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():  # O(1) activations: weights ~ N(0, 1/fan_in), norms around 1
        for p in attn.parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:
                p.uniform_(0.5, 1.5)
    return cfg, attn, hf.DeepseekV3RotaryEmbedding(cfg)


def rotate(cfg, x, cos, sin):
    """The module's own rotation of a ``[T, heads, 64]`` rope part (HF's functions rotate q and
    k together; the k slot here gets a dummy)."""
    x = x.transpose(0, 1)[None]  # [1, heads, T, 64]
    fn = hf.apply_rotary_pos_emb_interleave if cfg.rope_interleave else hf.apply_rotary_pos_emb
    out, _ = fn(x, x, cos, sin)
    return out[0].transpose(0, 1)


def paged(entries: torch.Tensor, lens: list[int], block_size: int):
    """One holder's pool of its chunk ``entries [n, d]`` (NaN padding) shared by all rows."""
    n, d = entries.shape
    blocks = max(1, math.ceil(n / block_size))
    pool = torch.full((blocks * block_size, d), float("nan"), dtype=entries.dtype)
    pool[:n] = entries
    pool = pool.view(blocks, block_size, d).to(DEVICE)
    table = torch.arange(blocks, dtype=torch.int32).repeat(len(lens), 1).to(DEVICE)
    return pool, table, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("rope_interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [None, 48])
@pytest.mark.parametrize("holders", [1, 3])
def test_absorbed_pipeline_reproduces_hf_deepseek_v3(rope_interleave, q_lora_rank, holders):
    T = 24
    cfg, attn, rotary = hf_attention(rope_interleave, q_lora_rank, seed=7 + holders)
    x = torch.randn(1, T, cfg.hidden_size, generator=torch.Generator().manual_seed(11))
    positions = torch.arange(T)[None]
    cos, sin = rotary(x, positions)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = attn(x, position_embeddings=(cos, sin), attention_mask=causal)
    expected = expected[0]  # [T, hidden]

    w = MLAWeights.from_hf_attention(attn)
    assert math.isclose(softmax_scale_from_config(cfg), attn.scaling, rel_tol=1e-12)
    with torch.no_grad():
        c_kv, k_pe = project_kv(w, x[0])  # [T, 512], [T, 64]
        k_pe = rotate(cfg, k_pe[:, None], cos, sin)[:, 0]
        q_nope, q_pe = project_query(w, x[0])  # [T, H, 32], [T, H, 64]
        q = absorb_query(q_nope, rotate(cfg, q_pe, cos, sin), w.w_uk)  # [T, H, 576]
        kv = cache_entry(c_kv, k_pe)  # [T, 576]

        # Holder i holds tokens [lo, hi); query token t attends its causal prefix 0..t.
        bounds = [round(i * T / holders) for i in range(holders + 1)]
        partials = []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            lens = [min(max(t + 1 - lo, 0), hi - lo) for t in range(T)]
            pool, table, seqlens = paged(kv[lo:hi], lens, block_size=16)
            partials.append(
                mla_decode_partial(
                    q.to(DEVICE), pool, table, seqlens, softmax_scale=w.softmax_scale
                )
            )
        o_lat, lse = merge_partials(
            torch.stack([p[0] for p in partials]),
            torch.stack([p[1] for p in partials]),
            layout="MBHD",
        )
        out = output_projection(w, o_lat.cpu())
    assert torch.isfinite(lse).all()
    assert_close(out, expected, tolerance("mla_hf", torch.float32), name="attention output")
