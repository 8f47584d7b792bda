"""The Hugging Face side of :mod:`mqnc.integrations.hf`: which models, their geometry and RoPE,
a small random-weight model for demos and tests, and the shared context's prefill (computed
once, by the model's own forward, and placed on holders as a :class:`mqnc.serving.Corpus`)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from mqnc.base.checks import check_int
from mqnc.model import PRESET_CONFIGS, MLAGeometry, RopeSpec
from mqnc.serving.compute import check_kernels
from mqnc.serving.corpus import Corpus, dtype_code

__all__ = [
    "ATTN_IMPLEMENTATION",
    "MODEL_KINDS",
    "prefill_context",
    "rope_spec_of",
    "geometry_of",
    "random_model",
    "random_weights",
    "check_model",
    "attention_modules",
    "prefill_entries",
    "check_token_ids",
    "check_prompt_ids",
]

ATTN_IMPLEMENTATION = "mqnc"
MODEL_KINDS = {"deepseek_v2": "interleaved", "deepseek_v3": "half", "deepseek_v32": "half"}
"""``model_type`` -> the pair layout of the ``k_pe`` its cache holds. ``deepseek_v32`` (DSA: the
indexer's top-k selection) attends through :mod:`mqnc.integrations.hf_v32`, not
:class:`~mqnc.integrations.hf_session.HFSession`."""


# ---- the model ----------------------------------------------------------------------------------


def check_model(model) -> str:
    """The model's ``model_type`` if it is a transformers DeepSeek-V2 / V3 / V3.2 causal LM,
    else a ``TypeError`` naming what it got."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in MODEL_KINDS or not hasattr(model, "generate"):
        raise TypeError(
            "model: expected a transformers DeepseekV2ForCausalLM, DeepseekV3ForCausalLM or "
            f"DeepseekV32ForCausalLM, got {type(model).__name__} (model_type {kind!r})"
        )
    return kind


def attention_modules(model) -> list:
    """Each decoder layer's attention module, in layer order."""
    return [layer.self_attn for layer in model.model.layers]


def rope_spec_of(model):
    """The :class:`mqnc.model.RopeSpec` of a transformers DeepSeek model: its config's RoPE
    (YaRN scales included), the frequencies the model itself encodes positions with, and the
    pair layout of the ``k_pe`` its cache holds (``"interleaved"`` for DeepseekV2, ``"half"``
    for DeepseekV3 with or without ``rope_interleave``: see :mod:`mqnc.model.rope`).

    The frequencies are read from the model's rotary buffer ``model.model.rotary_emb.inv_freq``,
    the values its forward multiplies positions by: ``model.to(torch.bfloat16)`` rounds that
    buffer to bf16 and transformers then encodes every position with the rounded values, so a
    chunk moved to another offset is rotated with them too (:attr:`RopeSpec.frequencies`; left
    None where the buffer holds exactly the config's float32 values)."""
    spec = RopeSpec.from_hf_config(model.config, layout=MODEL_KINDS[check_model(model)])
    own = _rotary_frequencies(model, spec.pairs)
    return spec if own == spec.inv_freq else spec.replace(frequencies=own)


def _rotary_frequencies(model, pairs: int) -> tuple[float, ...]:
    """The model's own per-pair RoPE frequencies: its rotary buffer ``inv_freq`` as floats (a
    ``ValueError`` if it is missing, not a floating ``[pairs]`` tensor, or not finite)."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    buf = getattr(rotary, "inv_freq", None)
    if not isinstance(buf, torch.Tensor) or not buf.is_floating_point() or buf.shape != (pairs,):
        got = f"{buf.dtype} {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else repr(buf)
        raise ValueError(
            f"model.model.rotary_emb.inv_freq: expected the rotary buffer of {pairs} "
            f"frequencies (qk_rope_head_dim // 2) the model encodes positions with, got {got}"
        )
    values = tuple(float(v) for v in buf.detach().double().cpu().tolist())
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(
            f"model.model.rotary_emb.inv_freq: expected finite frequencies >= 0, got {values}"
        )
    return values


def geometry_of(model) -> MLAGeometry:
    """The model's :class:`~mqnc.model.MLAGeometry`, cache and wire dtype its own."""
    code = dtype_code(model.dtype, "model")
    return MLAGeometry.from_hf_config(
        model.config, name=getattr(model.config, "_name_or_path", "") or model.config.model_type
    ).replace(cache_dtype=code, wire_dtype=code)


def random_model(kind: str = "deepseek_v2", *, seed: int = 0, dtype=torch.float32, **overrides):
    """A small DeepSeek causal LM with random weights and DeepSeek-V2-Lite's attention dims
    (16 heads, ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, ``qk_nope_head_dim`` 128,
    ``v_head_dim`` 128, YaRN factor 40), 2 layers (one dense MLP, one MoE of 4 experts),
    hidden 512, vocabulary 512: for demos and tests (no download).

    Weights are ``N(0, 1 / fan_in)`` (embeddings ``N(0, 1)``, norms 1) so that activations are
    O(1) as in a trained model; transformers' default ``N(0, 0.02)`` makes such a small random
    model repeat one token. ``overrides`` go to the config (``q_lora_rank=96``,
    ``rope_interleave=False``, ``num_hidden_layers=4``, ...).
    """
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    if kind not in ("deepseek_v2", "deepseek_v3"):  # V3.2: hf_v32.random_v32_model
        raise ValueError(f"kind: expected 'deepseek_v2' or 'deepseek_v3', got {kind!r}")
    lite = PRESET_CONFIGS["deepseek-v2-lite"]  # the published attention dims and RoPE
    attention = {k: lite[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")}
    cfg = dict(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=lite["num_attention_heads"],
        num_key_value_heads=lite["num_attention_heads"],
        v_head_dim=lite["v_head_dim"],
        q_lora_rank=None,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        max_position_embeddings=lite["max_position_embeddings"],
        rope_parameters=dict(
            {k: v for k, v in lite["rope_scaling"].items() if k != "type"},
            rope_type=lite["rope_scaling"]["type"],
            rope_theta=float(lite["rope_theta"]),
        ),
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        **attention,
    )
    if kind == "deepseek_v3":
        cfg.update(n_group=1, topk_group=1)
    cfg.update(overrides)
    config = (DeepseekV2Config if kind == "deepseek_v2" else DeepseekV3Config)(**cfg)
    torch.manual_seed(seed)
    model = (DeepseekV2ForCausalLM if kind == "deepseek_v2" else DeepseekV3ForCausalLM)(config)
    return random_weights(model, seed).eval().to(dtype)


def random_weights(model, seed: int):
    """``model`` with weights ``N(0, 1 / fan_in)`` (embeddings ``N(0, 1)``, vectors 1) drawn from
    ``seed`` in parameter order, in place: activations O(1) as in a trained model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                p.fill_(1.0)
    return model


# ---- the shared context's prefill ---------------------------------------------------------------


def check_token_ids(ids: torch.Tensor, vocab_size: int, name: str) -> torch.Tensor:
    """``ids`` (any shape) if they are integer token ids in ``[0, vocab_size)``: a bool or
    floating tensor is a ``TypeError``, an id outside the vocabulary a ``ValueError``, both
    naming ``name``."""
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{name}: expected integer token ids, got dtype {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{name}: expected token ids in [0, {vocab_size}) (the model's vocabulary), got ids "
            f"from {int(ids.min())} to {int(ids.max())}"
        )
    return ids


def check_prompt_ids(ids, name: str) -> None:
    """A ``[B, S]`` tensor with ``B, S >= 1``, else a ``ValueError`` naming ``name``."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or 0 in ids.shape:
        shape = f" of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else ""
        raise ValueError(
            f"{name}: expected a [B, S] tensor of token ids with B, S >= 1, got "
            f"{type(ids).__name__}{shape}"
        )


def _token_ids(token_ids, name: str, vocab_size: int) -> torch.Tensor:
    ids = torch.as_tensor(token_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(
            f"{name}: expected a non-empty 1-D sequence of token ids (or [1, C]), got "
            f"shape {tuple(ids.shape)} dtype {ids.dtype}"
        )
    return check_token_ids(ids, vocab_size, name).long()


def prefill_entries(model, ids: torch.Tensor, position: int, cache=None) -> torch.Tensor:
    """HF's own forward over ``ids [C]`` at positions ``position ..``: the latent cache it
    writes, ``[L, C, d_c + d_r]`` in the model's dtype, into ``cache`` (an empty transformers
    ``Cache``; default a ``DynamicCache``), which the caller may read further (a V3.2 model's
    indexer keys)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if cache is None else cache
    pos = torch.arange(position, position + ids.numel(), device=model.device)[None]
    with torch.no_grad():
        model.model(
            input_ids=ids[None].to(model.device), position_ids=pos, cache=cache, use_cache=True
        )
    layers = []
    for layer in cache.layers:
        c_kv, k_pe = layer.keys, layer.values  # [1, 1, C, d_c], [1, 1, C, d_r]
        layers.append(torch.cat([c_kv[0, 0], k_pe[0, 0]], dim=-1))
    return torch.stack(layers)


def prefill_context(
    model,
    token_ids,
    *,
    chunk_tokens: int,
    holders: Sequence[int],
    replicas: int = 1,
    position: int = 0,
    block_size: int = 64,
    kernels: str = "triton",
    cache=None,
) -> Corpus:
    """Prefill the shared context once with the model's own forward and place it on holders.

    Parameters
    ----------
    model : DeepseekV2ForCausalLM or DeepseekV3ForCausalLM
        The model (any attention implementation but ``"mqnc"``; weights in bf16, fp16 or fp32).
    token_ids : sequence of int or torch.Tensor
        ``[C]`` (or ``[1, C]``) the context's tokens.
    chunk_tokens : int
        Tokens per chunk (the last may be shorter).
    holders : sequence of int
        Holder ranks; chunk ``c`` goes to ``holders[c % M]`` and the ``replicas - 1`` next ones.
    replicas : int
        Copies of each chunk.
    position : int
        Canonical position of the first context token (where its RoPE is encoded).
    block_size : int
        The holders' pool page.
    kernels : {"triton", "torch"}
        The kernels the corpus will be served with (the holders' and requesters' ``kernels=``):
        a model geometry they cannot run is refused here, before the forward, naming the config
        field (:meth:`mqnc.model.MLAGeometry.check_triton`: the Triton kernels need
        ``kv_lora_rank`` and ``qk_rope_head_dim`` powers of two >= 16; the torch references run
        any width).
    cache : transformers Cache or None
        An empty cache for the forward to write (default a ``DynamicCache``; read afterwards
        by :func:`mqnc.integrations.hf_v32.prefill_v32_context` for the indexer keys).

    Returns
    -------
    mqnc.serving.Corpus
        Entries ``[L, C, d_c + d_r]`` in the model's dtype, with the geometry, softmax scale,
        RoPE spec, and in ``meta`` the token ids (for a local re-prefill), the model type, the
        transformers version and the prefill's wall time (``prefill_us``).
    """
    import transformers

    kind = check_model(model)
    if getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        raise ValueError(
            "model: attached to an mqnc session (attention 'mqnc'); prefill the context with the "
            "model's own attention (before attach, or after the session closes)"
        )
    ids = _token_ids(token_ids, "token_ids", model.config.vocab_size)
    position = check_int("position", position, minimum=0)
    geometry = geometry_of(model)  # the dtype is checked before the forward, not after
    if check_kernels(kernels) == "triton":
        geometry.check_triton()
    if isinstance(holders, (str, bytes)) or not isinstance(holders, Sequence | range):
        raise TypeError(f"holders: expected a sequence of holder ranks, got {holders!r}")
    if any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in holders):
        raise ValueError(f"holders: expected ranks (ints >= 0), got {list(holders)}")
    t0 = time.perf_counter()
    entries = prefill_entries(model, ids, position, cache)
    prefill_us = (time.perf_counter() - t0) * 1e6
    attn = attention_modules(model)[0]
    return Corpus.partition(
        entries.cpu(),
        geometry,
        float(attn.scaling),
        chunk_tokens=chunk_tokens,
        holders=holders,
        replicas=replicas,
        position=position,
        rope=rope_spec_of(model),
        block_size=block_size,
        meta=dict(
            model_type=kind,
            name_or_path=getattr(model.config, "_name_or_path", ""),
            transformers=transformers.__version__,
            token_ids=ids.tolist(),
            prefill_us=prefill_us,
        ),
    )
