"""A DeepSeek-V3.2-style model (DSA: the lightning indexer's top-k) decoding over holders.

transformers' ``DeepseekV32ForCausalLM`` attends, per layer and query token, only the
``index_topk`` cache entries its indexer (``DeepseekV32Indexer``) selects. Here its shared
context's latent cache lives on holders (bf16 entries, or DeepSeek-V3.2's 656-byte FP8 entries,
``docs/fp8-cache.md``) and each query token's selection becomes a sparse **route**: the selected
entries' chunk-local indices go with the absorbed query rows to the holders that hold them
(``mla_sparse_partial`` there), the model's own new tokens give a local partial over the
selected ones, and the partials merge (§3.3, §5.4). The dense HF integration
(:mod:`mqnc.integrations.hf`) supplies the rest: the attention hook, the absorption, the merge.

Where the indexer runs, and where its keys live
-----------------------------------------------
On the requester. The requester keeps the indexer keys of the whole sequence: the context's
(``[L, C, index_head_dim]``, read from the same prefill forward that wrote the latent cache,
:func:`prefill_v32_context`) and its own new tokens' (transformers' own indexer key cache).
Per decode step and layer, transformers' own indexer module scores the query token against all
of them and takes its top-k; a forward pre-hook on the module (installed while the session is
attached) only hands it the context's keys in front of its own, and a mask with the context's
columns open, so the selection is the model's own code over the whole sequence. The attention
call then receives the selected indices (transformers passes them as ``indices=`` to an
attention implementation other than eager/sdpa) and routes each chunk's share.

Why there: the selection is a global top-k over the whole context, so it needs every key's
score before any holder can attend. Scoring on the holders would take two round trips per layer
(send the indexer query, collect each chunk's top-k candidates, then route the merged
selection); scoring on the requester takes one, and a holder never needs the model's indexer
weights. What it costs: the requester stores the indexer keys, ``index_head_dim`` values per
token and layer (128 bf16 = 256 B in DeepSeek-V3.2, 22% of the 1152-byte bf16 latent entry it
does not store; 39% of a 656-byte FP8 entry), and computes the indexer's scores
(``index_n_heads x index_head_dim`` MACs per context token, query token and layer) itself. On
the wire, a route carries its rows (``H x (d_c + d_r)`` values each, as a dense route) plus the
selection, 4 bytes (int32) per selected entry per row, at most ``4 x index_topk`` per row and
chunk (8 KiB at top-2048); the reply is the dense route's (``o``, ``lse``). A chunk no row
selects anything from is not contacted at all that layer.

What it does not do (refused, not approximated): the context at another offset than where it
was prefilled (a selection attends entries at their canonical positions, and the indexer keys
were rotated there; ``offset`` must be the corpus' position); the ``local`` primitive (a
re-prefill through the attached model would need this sparse path inside itself: route and
fetch only, ``force="route"`` by default; fetch pulls the chunk once and attends the selection in
the requester's pool); the predicate (it prices dense attention; the primitive is ``force``).

FP8 cache
---------
``prefill_v32_context(..., fp8=True)`` keeps the corpus as FP8 entries
(``MLAGeometry.cache_dtype == "fp8_e4m3"``; the holders' pools keep them, a fetch moves 656 B
per token and layer). The requester's own tokens are kept in the same format: during the
prefill and :meth:`V32Session.generate`, transformers' cache is an :func:`fp8_rounded_cache`,
which rounds every entry written to it through the format (quantize, then dequantize, with the
torch backend of ``fp8_quantize`` / ``fp8_dequantize``) before any attention reads it, as a
deployment whose whole cache is FP8 attends. The same cache given to transformers' own
``generate`` is the fair reference: the same model attending the same FP8-rounded cache
(tokens equal); against transformers' bf16 cache only the agreement is reported. The indexer
keys stay in the model's dtype on both sides (DeepSeek-V3.2 keeps them in FP8 too; that
format is not here).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mqnc.integrations.hf_model import (
    attention_modules,
    check_model,
    prefill_context,
    random_weights,
)
from mqnc.integrations.hf_session import HFSession, local_partial
from mqnc.model.kv_format import FP8_E4M3
from mqnc.serving import Corpus
from mqnc.transport.wire import HEADER_BYTES

__all__ = [
    "V32_KIND",
    "V32Context",
    "V32Session",
    "attach_v32",
    "fp8_rounded_cache",
    "prefill_v32_context",
    "random_v32_model",
]

V32_KIND = "deepseek_v32"


def _check_v32(model) -> None:
    if check_model(model) != V32_KIND:
        raise TypeError(f"model: expected a DeepseekV32ForCausalLM, got {type(model).__name__}")


def random_v32_model(*, seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny DeepSeek-V3.2 causal LM with random weights, for demos and tests (no download):
    2 layers (one dense MLP, one MoE of 4 experts), hidden 64, vocabulary 256, 2 heads,
    ``kv_lora_rank`` 128 (one FP8 scale group), ``qk_rope_head_dim`` 16, ``qk_nope_head_dim``
    32, ``v_head_dim`` 32, ``q_lora_rank`` 32, an indexer of 16 heads x 32 selecting
    ``index_topk`` 8 entries (16, not fewer: with 2 the index scores tie at 0 often enough that
    transformers' ``topk`` breaks ties differently for different lengths; docs/huggingface.md),
    plain RoPE (theta 10000). Weights as :func:`mqnc.integrations.hf_model.random_weights`;
    ``overrides`` go to the config."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    cfg = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=128,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=8,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(DeepseekV32Config(**cfg))
    return random_weights(model, seed).eval().to(dtype)


# ---- the FP8-rounded cache ----------------------------------------------------------------------


@functools.cache
def _fp8_cache_class():
    from transformers import DynamicCache

    from mqnc.triton_kernels.ops import backend_ops

    ops = backend_ops("torch")

    class FP8RoundedCache(DynamicCache):
        """A ``DynamicCache`` whose latent entries are rounded through the FP8 format on write
        (see :func:`fp8_rounded_cache`); ``entries[layer]`` keeps the FP8 bytes written."""

        def __init__(self, config) -> None:
            super().__init__(config=config)
            self.d_c, self.d_r = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
            self.entries: dict[int, list[torch.Tensor]] = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            # key_states: c_KV [B, 1, S, d_c]; value_states: k_pe [B, 1, S, d_r]
            rows = torch.cat([key_states, value_states], dim=-1)
            dtype = rows.dtype if rows.dtype in (torch.bfloat16, torch.float32) else None
            if dtype is None:
                raise TypeError(f"model: an FP8 cache needs bf16 or fp32 weights, got {rows.dtype}")
            fp8 = ops.fp8_quantize(rows.reshape(-1, rows.shape[-1]).contiguous(), self.d_c)
            self.entries.setdefault(int(layer_idx), []).append(fp8.reshape(*rows.shape[:-1], -1))
            back = ops.fp8_dequantize(fp8, self.d_c, self.d_r, dtype).reshape(rows.shape)
            k, v = back.split([self.d_c, self.d_r], dim=-1)
            return super().update(k, v, layer_idx, *args, **kwargs)

        def fp8_entries(self) -> torch.Tensor:
            """The FP8 entries written, ``[L, S, b_KV]`` uint8 (batch row 0)."""
            return torch.stack(
                [torch.cat(self.entries[i], dim=2)[0, 0] for i in sorted(self.entries)]
            )

    return FP8RoundedCache


def fp8_rounded_cache(model):
    """A transformers ``DynamicCache`` for ``model`` that keeps its latent cache as
    DeepSeek-V3.2's FP8 entries would give it back: every ``(c_KV [B, 1, S, d_c], k_pe
    [B, 1, S, d_r])`` written is quantized (``fp8_quantize``, torch backend: the fp64
    reference, bit-exact with the kernel) and dequantized to the model's dtype before it is
    stored, so every attention reads the rounded values (latent: FP8 e4m3 with one power-of-two
    scale per 128 values; ``k_pe``: bf16). Pass it as ``generate(..., cache=...)``: the model
    attending an FP8 cache. Its ``fp8_entries()`` returns the bytes written ``[L, S, b_KV]``."""
    _check_v32(model)
    return _fp8_cache_class()(model.config)


# ---- the context's prefill ----------------------------------------------------------------------


class V32Context(NamedTuple):
    """A prefilled shared context: the latent cache for the holders, the indexer keys for the
    requester."""

    corpus: Corpus
    """The latent cache cut into chunks on holders (bf16 rows or FP8 entries)."""
    index_keys: torch.Tensor
    """``[L, C, index_head_dim]`` in the model's dtype: the indexer keys of the context
    (RoPE'd at the canonical positions), kept by the requester."""


def prefill_v32_context(model, token_ids, *, fp8: bool = False, **kwargs) -> V32Context:
    """Prefill the shared context once with the model's own forward: its latent cache on
    holders (:func:`mqnc.integrations.hf_model.prefill_context`, whose keyword arguments
    ``kwargs`` are: ``chunk_tokens``, ``holders``, ``replicas``, ``position``, ``block_size``,
    ``kernels``) and its indexer keys for the requester, both from the one forward.

    ``fp8``: the forward writes an :func:`fp8_rounded_cache` and the corpus keeps its FP8
    entries (geometry ``cache_dtype="fp8_e4m3"``; the routed rows stay in the model's dtype)."""
    from transformers import DynamicCache

    _check_v32(model)
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8: expected True or False, got {fp8!r}")
    if "cache" in kwargs:
        raise TypeError("cache: chosen here (fp8= selects the FP8-rounded one)")
    cache = fp8_rounded_cache(model) if fp8 else DynamicCache(config=model.config)
    corpus = prefill_context(model, token_ids, cache=cache, **kwargs)
    keys = torch.stack([layer.indexer_keys[0] for layer in cache.layers]).cpu()
    if fp8:
        corpus = Corpus(
            corpus.geometry.replace(cache_dtype=FP8_E4M3.name),
            corpus.softmax_scale,
            list(corpus.chunks.values()),
            dtype=corpus.dtype,
            entries=cache.fp8_entries().cpu(),
            rope=corpus.rope,
            block_size=corpus.block_size,
            meta=corpus.meta,
        )
    return V32Context(corpus, keys)


# ---- the session --------------------------------------------------------------------------------


class V32Session(HFSession):
    """A transformers ``DeepseekV32ForCausalLM`` attached to a context on holders: every layer
    attends its indexer's top-k selection, routed to the chunks that hold it (see the module
    docstring).

    Parameters
    ----------
    model : DeepseekV32ForCausalLM
        The model whose context was prefilled into ``context`` (same weights, same dtype).
    context : V32Context
        :func:`prefill_v32_context`'s result: the corpus on holders and the indexer keys.
    requester : mqnc.serving.Requester
        This instance's requester, connected to the corpus' holders.
    force : {"route", "fetch"}
        The primitive of every chunk (the other is the fallback): route sends the rows and the
        chunk's share of the selection; fetch pulls the chunk once and attends the selection in
        the requester's pool.
    steps : int, on_step : callable or None
        As :class:`~mqnc.integrations.hf_session.HFSession`'s.

    The context sits where it was prefilled (its canonical positions) and the prompt follows it.
    """

    _sparse = True

    def __init__(self, model, context, requester, *, force="route", steps=16, on_step=None):
        if not isinstance(context, V32Context):
            raise TypeError(f"context: expected a V32Context, got {type(context).__name__}")
        if force not in ("route", "fetch"):
            raise ValueError(f"force: expected 'route' or 'fetch', got {force!r}")
        super().__init__(
            model, context.corpus, requester, force=force, steps=steps, on_step=on_step
        )
        self.token_ids = None  # no local primitive: a re-prefill would need this sparse path
        self.index_keys = _check_index_keys(context.index_keys, model, context.corpus)
        # per forward and layer: rows, {chunk contacted: its selection's width k_c}
        self.selections: list[dict] = []
        self._hooks: list = []

    def __enter__(self) -> V32Session:
        super().__enter__()
        for m in attention_modules(self.model):
            hook = m.indexer.register_forward_pre_hook(self._index_hook, with_kwargs=True)
            self._hooks.append(hook)
        return self

    def close(self) -> None:
        """Remove the indexer hooks and give the model its attention back."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        super().close()

    def generate(self, input_ids: torch.Tensor, **kwargs):
        """:meth:`HFSession.generate`; over an FP8 corpus the model's own tokens are kept in
        an :func:`fp8_rounded_cache` too (unless ``cache=`` is given)."""
        if self.corpus.geometry.fp8_layout is not None and "cache" not in kwargs:
            kwargs["cache"] = fp8_rounded_cache(self.model)
        return super().generate(input_ids, **kwargs)

    def _max_route_tokens(self) -> int:
        """Rows per route message: the dense rows' bytes plus the selection's (int32)."""
        item = torch.empty((), dtype=self.corpus.dtype).element_size()
        g = self.geometry
        row = g.heads * max(g.d_qk * item, g.d_v * item + 8) + 4 * self.model.config.index_topk
        return max(1, (self.requester.transport.slot_bytes - HEADER_BYTES) // row)

    # ---- the indexer: the context's keys in front of the model's own ----------------------------
    def _index_hook(self, module, args, kwargs):
        """Forward pre-hook of ``DeepseekV32Indexer``: its mask gets the context's columns
        (open) in front and its cache hands out the context's keys in front of its own."""
        if len(args) != 5:
            raise RuntimeError(
                "DeepseekV32Indexer: expected the call (hidden_states, q_resid, "
                f"position_embeddings, attention_mask, position_ids, cache=), got {len(args)} "
                "positional arguments (a transformers version this hook does not know)"
            )
        hidden, q_resid, rope, mask, position_ids = args
        if position_ids is not None and int(position_ids.min()) < self.context_end:
            raise ValueError(
                f"position_ids: the shared context occupies positions [{self.offset}, "
                f"{self.context_end}); new tokens must follow it, got positions from "
                f"{int(position_ids.min())} (call session.generate)"
            )
        ctx = self.index_keys[module.layer_idx].to(hidden.device, hidden.dtype)
        shape = (mask.shape[0], mask.shape[1], ctx.shape[0])
        if mask.dtype == torch.bool:
            opened = torch.ones(shape, dtype=torch.bool, device=mask.device)
        else:
            opened = torch.zeros(shape, dtype=mask.dtype, device=mask.device)
        mask = torch.cat([opened, mask], dim=-1)
        kwargs = dict(kwargs, cache=_ContextIndexerKeys(kwargs.get("cache"), ctx))
        return (hidden, q_resid, rope, mask, position_ids), kwargs

    # ---- one layer: the selection's partials ---------------------------------------------------
    def _attend(self, module, query, key, value, mask, scaling, kwargs):
        B, H, T, _ = query.shape
        sel = kwargs.get("indices")
        if sel is None:
            raise RuntimeError(
                "indices: the attention call carries no selection (the indexer hook is not "
                "installed: attach with attach_v32, as a context manager)"
            )
        layer, rows = self._layer_rows(module, query, key, mask, scaling, kwargs)
        sel = sel.reshape(B * T, -1).long().cpu()  # over [0, C + N): the context first
        per_chunk = chunk_selections(sel, self.corpus)
        widths = {c: int(x.shape[1]) for c, x in sorted(per_chunk.items())}
        self.selections.append(dict(layer=layer, rows=B * T, chunks=widths))
        parts = self._remote(rows, layer, per_chunk) if per_chunk else []
        local = _selected_local_partial(query, key, value, mask, scaling, sel - self.corpus.tokens)
        o_m = self._merged(layer, rows, parts, local)
        return o_m.view(B, T, H, -1).to(query.device, query.dtype), None


class _ContextIndexerKeys:
    """What the indexer sees as its cache: ``update_indexer`` stores the new keys in the
    model's own cache (if any) and returns the context's ``[C, D]`` keys in front of all of the
    model's own ``[B, N, D]``."""

    def __init__(self, cache, context_keys: torch.Tensor) -> None:
        self.cache = cache
        self.context_keys = context_keys

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        own = keys if self.cache is None else self.cache.update_indexer(keys, layer_idx)
        ctx = self.context_keys.expand(own.shape[0], -1, -1)
        return torch.cat([ctx, own], dim=1)


def _check_index_keys(keys, model, corpus: Corpus) -> torch.Tensor:
    """The context's indexer keys ``[L, C, index_head_dim]`` floating, in the model's dtype."""
    want = (model.config.num_hidden_layers, corpus.tokens, model.config.index_head_dim)
    if not isinstance(keys, torch.Tensor) or not keys.is_floating_point():
        got = keys.dtype if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise TypeError(f"context.index_keys: expected a floating tensor, got {got}")
    if tuple(keys.shape) != want:
        raise ValueError(
            f"context.index_keys: expected shape {want} (layers, context tokens, "
            f"index_head_dim), got {tuple(keys.shape)}"
        )
    return keys.to(model.dtype)


def chunk_selections(sel: torch.Tensor, corpus: Corpus) -> dict[int, torch.Tensor]:
    """Each chunk's share of a selection.

    Parameters
    ----------
    sel : torch.Tensor
        ``[R, k]`` int64 indices over the requester's sequence, the context's ``C`` tokens
        first (index ``t < C``: the context's token ``t``); larger indices are the requester's
        own tokens and belong to no chunk.
    corpus : mqnc.serving.Corpus

    Returns
    -------
    dict
        ``{chunk_id: [R, k_c] int32}`` chunk-local indices, each row's valid ones first and
        ``-1`` after them, ``k_c`` the most any row selects in the chunk; only chunks with a
        selected entry.
    """
    out = {}
    for cid, c in corpus.chunks.items():
        local = sel - c.start
        inside = (local >= 0) & (local < c.tokens)
        if not bool(inside.any()):
            continue
        k = int(inside.sum(-1).max())
        first = torch.argsort((~inside).to(torch.int8), dim=-1, stable=True)[:, :k]
        out[cid] = torch.where(inside, local, -1).gather(-1, first).to(torch.int32)
    return out


def _selected_local_partial(query, key, value, mask, scaling: float, sel: torch.Tensor):
    """The partial over the model's own tokens that a row selected: ``sel [B*T, k]`` indices
    into the local keys (others negative or past them), HF's expanded keys and values, its
    additive causal mask. Returns ``o [B*T, H, Dv]`` (0 for a row that selected none of them)
    and natural-log ``lse [B*T, H]`` (``-inf`` there), float32."""
    B, H, T, _ = query.shape
    N = key.shape[2]
    ok = (sel >= 0) & (sel < N)
    picked = torch.zeros(B * T, N, dtype=torch.bool)
    rows = torch.arange(B * T)[:, None].expand_as(sel)
    picked[rows[ok], sel[ok]] = True
    hidden = torch.zeros(B, 1, T, N).masked_fill(~picked.view(B, T, N)[:, None], float("-inf"))
    hidden = hidden.to(query.device)
    if mask is not None:
        full = mask[..., :N].float() + hidden
    else:
        causal = torch.ones(T, N, dtype=torch.bool, device=query.device).tril(N - T)
        full = hidden.masked_fill(~causal, float("-inf"))
    o, lse = local_partial(query, key, value, full, scaling)
    return o.masked_fill(torch.isneginf(lse)[..., None], 0.0), lse


def attach_v32(model, context: V32Context, requester, **kwargs) -> V32Session:
    """Attach a ``DeepseekV32ForCausalLM`` to its context through ``requester``; use as a
    context manager::

        with attach_v32(model, context, requester) as session:
            out = session.generate(prompt_ids, max_new_tokens=8, do_sample=False)

    ``kwargs`` are :class:`V32Session`'s (``force``, ``steps``, ``on_step``)."""
    return V32Session(model, context, requester, **kwargs)
