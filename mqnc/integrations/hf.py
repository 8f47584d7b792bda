"""Hugging Face DeepSeek-V2 / V3 causal LMs decoding over a shared context that lives on holders.

A model loaded with transformers (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``: both RoPE
pair layouts, YaRN, with or without query LoRA) attends over a **shared context** whose latent
cache is partitioned over holder instances, plus its **own new tokens** in an ordinary local
cache, and produces the tokens its own ``generate`` produces on the whole prompt (§2.1, §3.3).

Where the hook is, and why there
--------------------------------
transformers' DeepSeek attention computes per layer the query (``q_proj``, or ``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``), the latent ``c_KV`` (``kv_a_proj_with_mqa`` ->
``kv_a_layernorm``) and ``k_pe``, RoPE on ``q_pe`` and ``k_pe`` at the tokens' positions
(V2: a complex multiply on interleaved pairs; V3: interleaved pairs rotated into halves, or
``rotate_half`` without ``rope_interleave``), ``cache.update(c_KV, k_pe)`` (the cache holds the
latent: the ``d_c + d_r`` entry of §2.1), expands keys and values through ``kv_b_proj``, and
calls the attention function registered under ``config._attn_implementation`` with
``(module, query, key, value, attention_mask, scaling)``; then ``o_proj``. Only that call is
replaced: :func:`attach` registers a function named ``"mqnc"`` with transformers' public
``AttentionInterface`` (and transformers' own ``eager_mask`` under the same name with
``AttentionMaskInterface``, so the local causal mask is HF's) and switches the model to it with
``model.set_attn_implementation("mqnc")`` for as long as the session is attached. Projections,
RoPE, the local ``DynamicCache``, masks, ``o_proj``, MLP / MoE, norms, logits processors and
sampling stay transformers' own code, and the weights are the modules' own tensors
(:meth:`mqnc.model.MLAWeights.from_hf_attention`; only ``W_UK`` / ``W_UV`` absorption is done
here, :func:`mqnc.model.absorb_query`, :func:`mqnc.model.latent_to_heads`).

Rejected: swapping each layer's attention module (re-implements projections and RoPE, breaks on
the next refactor of the modules); a custom ``Cache`` (sees keys, never queries: it can fetch but
not route); forward hooks (cannot replace a computation). The attention interface is the seam
transformers keeps stable for external kernels, and it hands over the query already rotated at
the token's true position, in the layout the cache uses.

What runs per decode step and layer (:meth:`HFSession._attend`)
------------------------------------------------------------------
1. the query ``[B, H, T, qk_nope + d_r]`` becomes absorbed rows ``[B*T, H, d_c + d_r]``;
2. every chunk of the context gives a latent partial ``(o [B*T, H, d_c], lse)`` by its primitive:
   **route** (all routed chunks fanned out at once with ``Requester.route_many``; the requester
   rotates the rows by ``-delta`` when the context sits at another offset than where it was
   cached), **fetch** (pulled once with all layers and spliced at the offset, then attended in the
   requester's pool) or **local** (re-prefilled once through this same model at the offset); a
   failed primitive falls back to the next one or a replica (``Requester.attend``);
3. the local partial: the model's own tokens with HF's expanded keys, values and causal mask, in
   fp32, with its log-sum-exp (natural log);
4. each latent partial goes through ``W_UV``; the ``M + 1`` partials merge (§3.3,
   :mod:`mqnc.serving.compute`); the result ``[B, T, H, v_head_dim]`` returns to HF.

The primitive per chunk is :func:`mqnc.cost.decide`'s argmin for the request (``B * H``
rows per step, ``steps * L`` round trips; calibrated constants or a given fabric), or ``force``
(one primitive for every chunk, or a mapping ``chunk_id -> primitive``): a forced primitive is
the path taken, whatever copies of the chunk the requester's pool holds, and each request
records the path that answered each chunk (:meth:`HFSession.primitive`).

Positions
---------
The context occupies positions ``[offset, offset + C)`` of the requester's sequence (``offset``
defaults to where it was prefilled) and the new tokens follow it. transformers derives positions
from its own cache, which holds only the local tokens, so :meth:`HFSession.generate` calls
``model.generate`` with ``position_ids`` (``model.generate(ids,
position_ids=session.positions(ids), ...)`` is the same call); the attention function rejects
tokens placed inside the context. Batches of equal-length prompts are supported; padded batches
are refused, not supported: every layer checks the mask transformers hands over (an
``attention_mask`` with zeros, or the one ``generate`` builds from ``pad_token_id`` when the prompt
contains the pad token) and raises a ``ValueError`` naming ``attention_mask`` unless each row
attends to all of its own earlier tokens, as an unpadded causal row does. Padding would need the
shared context's positions per row (a left-padded row's prompt starts later, so the context would
sit at another offset per row) and was left out: split such a batch by prompt length.

Moving the context to another offset rotates by ``R(delta)`` with the frequencies the model
itself encodes positions with, read from its rotary buffer (:func:`rope_spec_of`): a model cast
with ``model.to(torch.bfloat16)`` rounds that buffer, and transformers then encodes every
position with the rounded values, so the corpus records them and the requester rotates with
them; a requester that would rotate with other frequencies is refused at :func:`attach`.

Geometry
--------
The Triton kernels tile ``kv_lora_rank`` and ``qk_rope_head_dim`` each as a power of two >= 16
(:meth:`mqnc.model.MLAGeometry.check_triton`); a model they cannot run is refused by
:func:`prefill_context` (``kernels="triton"``, the default) and by :func:`attach` through a
Triton requester, naming the config field. The torch references (``kernels="torch"``) run any
width.

Where the shared context's prefill is computed, and by whom
-----------------------------------------------------------
Once, by whoever has the model, with transformers' own forward: :func:`prefill_context` runs the
model over the context tokens at their canonical positions with a ``DynamicCache``, reads the
latent cache out of it (``c_KV`` and ``k_pe`` per layer, exactly what HF's ``generate`` would
have cached for the same tokens), and cuts it into chunks placed round robin on the holder ranks
(:class:`mqnc.serving.Corpus`, replicas on the next holders). In one process the corpus is handed
to local holders (:class:`mqnc.serving.LocalHolders`); across machines it is saved
(:meth:`~mqnc.serving.Corpus.save`, ``mqnc corpus``) and each holder rank of ``mqnc serve`` loads
its own chunks from the file. Holders never need the model. Because the context is prefilled
causally as one sequence, a chunk's cache at layer ``>= 1`` depends on the tokens before it: an
exact ``local`` primitive re-prefills the context up to the chunk's end (its cost in the predicate
counts those tokens).

The parts: :mod:`mqnc.integrations.hf_model` (models, RoPE spec, geometry, the context's
prefill), :mod:`mqnc.integrations.hf_session` (the attention function and :class:`HFSession`),
:mod:`mqnc.integrations.hf_predicate` (this machine's constants, route / fetch / local per
chunk), :mod:`mqnc.integrations.hf_serve` (``mqnc serve --generate``'s requester job),
:mod:`mqnc.integrations.hf_v32` (DeepSeek-V3.2: the indexer's top-k as sparse routes);
:mod:`mqnc.integrations.hf_exactness` compares a run with transformers' own.
"""

from __future__ import annotations

from mqnc.integrations.hf_model import (
    ATTN_IMPLEMENTATION,
    MODEL_KINDS,
    geometry_of,
    prefill_context,
    random_model,
    rope_spec_of,
)
from mqnc.integrations.hf_serve import serve_generate
from mqnc.integrations.hf_session import HFSession, attach

__all__ = [
    "ATTN_IMPLEMENTATION",
    "MODEL_KINDS",
    "HFSession",
    "attach",
    "geometry_of",
    "prefill_context",
    "random_model",
    "rope_spec_of",
    "serve_generate",
]
