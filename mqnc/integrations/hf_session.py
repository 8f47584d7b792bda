"""A transformers DeepSeek model attached to a corpus on holders: the attention function
transformers calls, and the session that routes, fetches or re-prefills every chunk of the shared
context per decode step and layer (the design is in :mod:`mqnc.integrations.hf`)."""

from __future__ import annotations

import dataclasses
import math
import sys
import weakref
from collections.abc import Callable, Mapping

import torch

from mqnc.base.checks import check_int
from mqnc.integrations.hf_model import (
    ATTN_IMPLEMENTATION,
    attention_modules,
    check_model,
    check_prompt_ids,
    check_token_ids,
    geometry_of,
    prefill_entries,
    rope_spec_of,
)
from mqnc.integrations.hf_predicate import as_fabric, decide_chunk, measure_constants
from mqnc.model import MLAGeometry, MLAWeights, absorb_query, latent_to_heads
from mqnc.reference import merge_reference, partial_attention_reference, rope_rotate_reference
from mqnc.serving import Corpus, Requester, kernel_ops
from mqnc.testing import compare
from mqnc.transport.wire import HEADER_BYTES

__all__ = ["HFSession", "attach", "local_partial"]

_BINDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ---- the attention function transformers calls -------------------------------------------------


def _mqnc_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' attention-interface signature; dispatches to the module's session."""
    session = _BINDINGS.get(module)
    if session is None:
        raise RuntimeError(
            f"mqnc attention: layer {getattr(module, 'layer_idx', '?')} is not attached to an "
            "mqnc session (use mqnc.integrations.hf.attach)"
        )
    if (
        session._reprefills.running
    ):  # a nested re-prefill (the local primitive): the model's own attention
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    return session._attend(module, query, key, value, attention_mask, scaling, kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _mqnc_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)


PRIMITIVES = ("route", "fetch", "local")


@dataclasses.dataclass
class _Request:
    """What the predicate decides for: one ``generate`` call (rows per step, steps).

    ``decisions[chunk_id]``: the chunk's decision (``primitive``, ``predicate``, ``forced``)
    and ``taken``, the paths that answered it, counted per layer and forward pass (see
    :meth:`HFSession.primitive`); ``made``: the chunks whose copy in the requester's pool was
    fetched or re-prefilled during this request. The bookkeeping of both is here: a decision
    kept, whether a copy in the pool answers a chunk, which path answered it."""

    batch: int
    steps: int
    decisions: dict[int, dict] = dataclasses.field(default_factory=dict)
    made: set[int] = dataclasses.field(default_factory=set)

    def primitives(self) -> dict[int, str]:
        """Chunk -> its decided primitive, for the chunks decided so far."""
        return {k: d["primitive"] for k, d in self.decisions.items()}

    def decided(self, chunk_id: int, record: dict, *, forced: bool) -> str:
        """Keep ``record`` (``primitive`` and, unless ``forced``, the predicate's terms) as the
        chunk's decision, with no path taken yet; returns its primitive."""
        self.decisions[chunk_id] = dict(record, forced=forced, taken={})
        return record["primitive"]

    def held(self, requester, key: tuple[int, int], primitive: str) -> bool:
        """Whether ``requester``'s pool answers chunk ``key[0]`` in place (its copy at ``key``,
        ``(chunk_id, offset)``): a chunk the predicate decided, or one whose forced fetch /
        re-prefill was made in this request. A copy from before the request is never what a
        forced primitive asked for: route goes to a holder past it, and a forced fetch / local
        drops it (the chunk is then fetched / re-prefilled again)."""
        chunk_id = key[0]
        if key not in requester.local_chunks:
            return False
        if not self.decisions[chunk_id]["forced"]:
            return True
        if chunk_id in self.made:
            return primitive != "route"
        if primitive != "route":
            requester.evict_local(*key)
        return False

    def took(self, chunk_id: int, part) -> None:
        """Count the path that answered ``chunk_id`` (``part``) in the chunk's record."""
        path = part.primitive
        if path != "route" and chunk_id not in self.made:
            path = f"held-{path}"
        taken = self.decisions[chunk_id]["taken"]
        taken[path] = taken.get(path, 0) + 1


class HFSession:
    """A transformers DeepSeek-V2 / V3 model attached to a corpus on holders (see the module
    docstring; a DeepSeek-V3.2 model: :class:`mqnc.integrations.hf_v32.V32Session`).

    Parameters
    ----------
    model : DeepseekV2ForCausalLM or DeepseekV3ForCausalLM
        The model whose context was prefilled into ``corpus`` (same weights, same dtype).
    corpus : mqnc.serving.Corpus
        The shared context (:func:`prefill_context`).
    requester : mqnc.serving.Requester
        This instance's requester, connected to the corpus' holders
        (:meth:`mqnc.serving.Corpus.make_requester`); its ``kernels`` choice also runs the
        session's merge. The corpus' chunks are registered on it if they are not already, and
        while attached its ``model`` (the local primitive) is a re-prefill through ``model``
        when the corpus carries the context's token ids.
    offset : int or None
        Position of the context's first token in this requester's sequence (default: where it
        was prefilled). Another offset makes route rotate the query and fetch splice (§2.2).
    force : {"route", "fetch", "local"}, mapping or None
        Run every chunk (a str), or the chunks a mapping ``{chunk_id: "route" | "fetch" |
        "local"}`` names (the others: the predicate's choice), through that primitive instead
        of the predicate's. A forced primitive is the path taken in every request (a failure
        still falls back, recorded in :attr:`fallbacks`): ``"route"`` routes even when the
        requester's pool holds a copy of the chunk (fetched or re-prefilled earlier), and
        ``"fetch"`` / ``"local"`` drop a copy made before the request and fetch /
        re-prefill the chunk again at its first layer in each request (the copy then serves
        the request's other layers and steps; a re-prefill reuses the session's cache of the
        context's entries when it already reaches the chunk). An unknown chunk id or
        primitive is a ``ValueError`` naming ``force``. A chunk the predicate decides is
        answered by a copy the pool holds, whatever it decided (exact, and the cheaper).
        Which path answered each chunk: :meth:`primitive`'s record, ``taken``.
    fabric : mqnc.cost.FabricProfile, str or None
        The fabric the predicate prices (a profile, a preset name or a JSON path); None:
        calibrate against the holders on first use (:meth:`calibrate`). Unused for forced
        chunks.
    steps : int
        Decode steps assumed for a ``model.generate`` call that did not go through
        :meth:`generate` (which knows ``max_new_tokens``).
    verify : bool
        Check every partial and merged answer against an fp64 reference (slow; the demo's
        table reports the errors in :attr:`errors`).
    on_step : callable or None
        ``on_step(step)`` before every forward pass (fault drills: kill a holder at step k).
    """

    _sparse = False  # a DSA session (hf_v32.V32Session) attends the indexer's selection

    def __init__(
        self,
        model,
        corpus: Corpus,
        requester,
        *,
        offset: int | None = None,
        force: str | Mapping[int, str] | None = None,
        fabric=None,
        steps: int = 16,
        verify: bool = False,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        g = _check_arguments(
            model, corpus, requester, force, steps, verify, on_step, sparse=self._sparse
        )
        self.model = model
        self.corpus = corpus
        self.requester = requester
        self.geometry = g
        self.offset = corpus.position if offset is None else check_int("offset", offset, minimum=0)
        self.force = dict(force) if isinstance(force, Mapping) else force
        self.steps = steps
        self.verify = verify
        self.on_step = on_step
        self.kernels = requester.kernels
        self.ops = kernel_ops(requester.kernels)
        self.rope = rope_spec_of(model)
        self.weights = [MLAWeights.from_hf_attention(m) for m in attention_modules(model)]
        self.token_ids = corpus.meta.get("token_ids")
        self._reprefills = _Reprefills(model, corpus)
        self._request: _Request | None = None
        self.step = 0
        self.fabric = None if fabric is None else as_fabric(fabric)
        self.cal: dict | None = None
        self.errors: dict[str, list[float]] = {}
        self.fallbacks: list[dict] = []
        self.requests: list[_Request] = []
        self.batch_work: dict[int, int] = {}
        _register_corpus(corpus, requester)
        _check_rope(self.rope, requester.rope, self.offset - corpus.position)
        self._first_record = len(requester.costs)
        self._saved_impl = None
        self._saved_model = None
        self._route_tokens = self._max_route_tokens()

    # ---- attach / detach --------------------------------------------------------------------
    def __enter__(self) -> HFSession:
        _register()
        for m in attention_modules(self.model):
            if m in _BINDINGS:
                which = "this session" if _BINDINGS[m] is self else "another mqnc session"
                raise RuntimeError(f"model: already attached to {which} (close it first)")
        self._saved_impl = self.model.config._attn_implementation
        self._saved_model = self.requester.model
        if self.token_ids is not None:  # the local primitive: a re-prefill through this model
            self.requester.model = self._reprefill
        for m in attention_modules(self.model):
            _BINDINGS[m] = self
        self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        return self

    def close(self) -> None:
        """Give the model its attention implementation back."""
        if self._saved_impl is None:
            return
        for m in attention_modules(self.model):
            _BINDINGS.pop(m, None)
        self.model.set_attn_implementation(self._saved_impl)
        self.requester.model = self._saved_model
        self._saved_impl = self._saved_model = None

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- generate -----------------------------------------------------------------------------
    @property
    def context_end(self) -> int:
        """First position after the context in this requester's sequence."""
        return self.offset + self.corpus.tokens

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``position_ids [B, S]`` of a prompt ``input_ids [B, S]`` that follows the context
        directly."""
        check_prompt_ids(input_ids, "input_ids")
        B, S = input_ids.shape
        pos = torch.arange(self.context_end, self.context_end + S, device=input_ids.device)
        return pos[None].expand(B, -1)

    def generate(self, input_ids: torch.Tensor, **kwargs):
        """``model.generate(input_ids, position_ids=self.positions(input_ids), **kwargs)``: the
        prompt continues the shared context; everything else is transformers' ``generate``.

        ``input_ids [B, S]`` (``S >= 1``) are equal-length prompts: padding is refused with a
        ``ValueError`` naming ``attention_mask`` (a mask with zeros, or the one transformers
        builds from ``pad_token_id`` when a prompt contains the pad token), see
        :mod:`mqnc.integrations.hf`."""
        if self._saved_impl is None:
            raise RuntimeError("session: not attached (use `with attach(...) as session:`)")
        check_prompt_ids(input_ids, "input_ids")
        check_token_ids(input_ids, self.model.config.vocab_size, "input_ids")
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).all()):
            raise ValueError(
                "attention_mask: padded prompts are not supported; pass equal-length prompts"
            )
        if "position_ids" in kwargs:
            raise ValueError("position_ids: set by the session (the prompt follows the context)")
        steps = _new_tokens(self.model, input_ids.shape[1], kwargs) or self.steps
        self._request = _Request(int(input_ids.shape[0]), int(steps))
        self.requests.append(self._request)
        return self.model.generate(input_ids, position_ids=self.positions(input_ids), **kwargs)

    # ---- decisions ------------------------------------------------------------------------------
    def chunk_offset(self, chunk_id: int) -> int:
        """Position of ``chunk_id``'s first token in this requester's sequence."""
        return self.offset + (self.corpus.chunks[chunk_id].position - self.corpus.position)

    def forced(self, chunk_id: int) -> str | None:
        """The primitive ``force`` sets for ``chunk_id`` (None: the predicate decides)."""
        if isinstance(self.force, dict):
            return self.force.get(chunk_id)
        return self.force

    def primitive(self, chunk_id: int) -> str:
        """The primitive of ``chunk_id`` for the current request (``force``, or the predicate's
        argmin with this session's constants; decided once per request).

        The request's record of the chunk, ``session.requests[i].decisions[chunk_id]``, holds
        ``primitive``, ``predicate`` (the predicate's terms; None when forced), ``forced`` and
        ``taken``: the paths that answered the chunk, each counted once per layer and forward
        pass: ``"route"`` (routed to a holder), ``"fetch"`` / ``"local"`` (attended over a copy
        fetched / re-prefilled during this request), ``"held-fetch"`` / ``"held-local"`` (over a
        copy the requester's pool held from before the request)."""
        req = self._request
        if chunk_id in req.decisions:
            return req.decisions[chunk_id]["primitive"]
        forced = self.forced(chunk_id)
        if forced is not None:
            record = dict(chunk=chunk_id, primitive=forced, predicate=None)
            return req.decided(chunk_id, record, forced=True)
        if self.fabric is None:
            self.calibrate()
        record = decide_chunk(
            self.corpus,
            self.geometry,
            self.fabric,
            self.cal or {},
            chunk_id,
            delta=self.chunk_offset(chunk_id) - self.corpus.chunks[chunk_id].position,
            batch=req.batch,
            steps=req.steps,
            allow_local=self.token_ids is not None,
        )
        return req.decided(chunk_id, record, forced=False)

    def _held(self, chunk_id: int, primitive: str) -> bool:
        """Whether the requester's pool answers ``chunk_id`` in place (:meth:`_Request.held`)."""
        key = (chunk_id, self.chunk_offset(chunk_id))
        return self._request.held(self.requester, key, primitive)

    # ---- calibration ----------------------------------------------------------------------------
    def calibrate(self, *, probes: int = 9, reps: int = 2) -> dict:
        """Measure this machine's constants against the holders
        (:func:`mqnc.integrations.hf_predicate.measure_constants`); sets :attr:`fabric` (unless
        one was given) and :attr:`cal`. The calls' cost records are not part of :meth:`records`."""
        self.fabric, self.cal = measure_constants(
            self.requester,
            self.corpus,
            self.geometry,
            fabric=self.fabric,
            kernels=self.kernels,
            probes=probes,
            reps=reps,
        )
        self._first_record = len(self.requester.costs)
        return self.cal

    def records(self) -> list:
        """The requester's cost records of this session's requests (calibration excluded)."""
        return self.requester.costs[self._first_record :]

    # ---- the local primitive: re-prefill through this model -------------------------------------
    def _reprefill(self, chunk_id: int, offset: int) -> torch.Tensor:
        """``Requester.model``: the chunk's cache ``[L, c_t, d_qk]`` re-prefilled at ``offset``
        by the model's own forward over the context's tokens up to the end of this chunk and of
        every chunk the request re-prefills (a long enough prefix already computed at the same
        context offset is reused)."""
        decided = {} if self._request is None else self._request.primitives()
        local = [k for k, d in decided.items() if d == "local"]
        return self._reprefills.entries(chunk_id, offset, local)

    # ---- one layer of one forward pass ----------------------------------------------------------
    def _max_route_tokens(self) -> int:
        item = torch.empty((), dtype=self.corpus.dtype).element_size()
        row = self.geometry.heads * max(self.geometry.d_qk * item, self.geometry.d_v * item + 8)
        return max(1, (self.requester.transport.slot_bytes - HEADER_BYTES) // row)

    def _attend(self, module, query, key, value, mask, scaling, kwargs):
        B, H, T, _ = query.shape
        layer, rows = self._layer_rows(module, query, key, mask, scaling, kwargs)
        parts = self._remote(rows, layer)
        o_m = self._merged(layer, rows, parts, local_partial(query, key, value, mask, scaling))
        return o_m.view(B, T, H, -1).to(query.device, query.dtype), None

    def _layer_rows(self, module, query, key, mask, scaling, kwargs):
        """One layer's call checked (positions, scale, padding; a new forward counted at layer
        0): ``(layer, rows)``, the query ``[B, H, T, qk_nope + d_r]`` as absorbed rows
        ``[B*T, H, d_c + d_r]`` in the corpus dtype on the requester's device."""
        layer = int(module.layer_idx)
        B, H, T, _ = query.shape
        pos = kwargs.get("position_ids")
        if pos is not None and int(pos.min()) < self.context_end:
            raise ValueError(
                f"position_ids: the shared context occupies positions [{self.offset}, "
                f"{self.context_end}); new tokens must follow it, got positions from "
                f"{int(pos.min())} (call session.generate, or pass "
                "position_ids=session.positions(input_ids) to model.generate)"
            )
        if not math.isclose(float(scaling), self.corpus.softmax_scale, rel_tol=1e-6):
            raise ValueError(
                f"scaling: the model attends with {scaling}, the corpus was written with "
                f"{self.corpus.softmax_scale}"
            )
        if layer == 0:
            _check_unpadded(mask, key.shape[2])
            self._begin_forward(B, T, key.shape[2])
        w = self.weights[layer]
        dn = w.qk_nope_head_dim
        q_nope, q_pe = query[..., :dn].transpose(1, 2), query[..., dn:].transpose(1, 2)
        rows = absorb_query(q_nope, q_pe, w.w_uk).reshape(B * T, H, -1).to(self.corpus.dtype)
        return layer, rows.to(self.requester.device).contiguous()

    def _merged(self, layer: int, rows, parts, local) -> torch.Tensor:
        """The ``M`` latent partials ``[(chunk_id, Partial)]`` through ``W_UV`` merged with the
        local partial ``(o [B*T, H, d_v], lse [B*T, H])``: ``[B*T, H, d_v]`` float32."""
        o_loc, lse_loc = (t.to(rows.device) for t in local)
        w_uv = self.weights[layer].w_uv.float().to(rows.device)
        o = torch.stack([latent_to_heads(p.o.float(), w_uv) for _, p in parts] + [o_loc])
        lse = torch.stack([p.lse.float() for _, p in parts] + [lse_loc])
        o_m, _ = self.ops.merge_partials(o, lse, layout="MBHD")
        if self.verify:
            _check_layer(self, layer, rows, parts, (o_loc, lse_loc), o_m, w_uv)
        return o_m

    def _begin_forward(self, B: int, T: int, n_local: int) -> None:
        if self._request is None or n_local == T:  # a fresh local cache: a new request
            if self._request is None or self._request.decisions:
                self._request = _Request(B, self.steps)
                self.requests.append(self._request)
        if self.on_step is not None:
            self.on_step(self.step)
        self.step += 1

    def _remote(self, rows: torch.Tensor, layer: int, indices=None) -> list[tuple[int, object]]:
        """``[(chunk_id, Partial)]`` of every chunk for these rows at ``layer`` (``indices``:
        None, or ``{chunk_id: [B*T, k] chunk-local selection}`` for the chunks to attend)."""
        routed, direct = [], []
        for cid in sorted(self.corpus.chunks if indices is None else indices):
            primitive = self.primitive(cid)
            held = self._held(cid, primitive)
            (routed if primitive == "route" and not held else direct).append(cid)
        parts: dict[int, object] = {}
        if routed:
            parts.update(self._route_wave(routed, rows, layer, indices))
        for cid in direct:
            parts[cid] = self._attend_one(
                cid, rows, layer, None if indices is None else indices[cid]
            )
        for cid, part in parts.items():
            self._request.took(cid, part)
        return [(cid, parts[cid]) for cid in sorted(parts)]

    def _route_wave(self, chunks: list[int], rows: torch.Tensor, layer: int, indices=None) -> dict:
        """Route every chunk's rows at once (the holders batch them, §6.3), in slices of rows
        that fit a transport slot; a failed wave is redone chunk by chunk with fallback.
        ``indices``: None (each chunk attended whole) or ``{chunk_id: [B*T, k] chunk-local
        selection}`` (:mod:`mqnc.integrations.hf_v32`)."""
        req, n = self.requester, self._route_tokens
        slices = [slice(i, min(i + n, rows.shape[0])) for i in range(0, rows.shape[0], n)]
        # each chunk's first holder the transport does not know to be dead (else a replica)
        peers = {}
        for c in chunks:
            holders = req.directory[c].holders
            peers[c] = next((h for h in holders if req.transport.peer_alive(h)), holders[0])
        n_before = len(req.costs)
        try:
            out: dict[int, list] = {c: [] for c in chunks}
            for sl in slices:
                got = req.route_many(
                    [
                        dict(
                            chunk_id=c,
                            q=rows[sl],
                            layer=layer,
                            offset=self.chunk_offset(c),
                            peer=peers[c],
                            indices=None if indices is None else indices[c][sl],
                        )
                        for c in chunks
                    ],
                    merge=False,
                )
                for c, p in zip(chunks, got, strict=True):
                    out[c].append(p)
        except Exception:  # noqa: BLE001 - each chunk retried through the fallback order
            return {
                c: self._attend_one(c, rows, layer, None if indices is None else indices[c])
                for c in chunks
            }
        self._note_batches(req.costs[n_before:])
        for c in chunks:
            if peers[c] != req.directory[c].holders[0]:
                self._fallback(c, layer, "route", "route", peers[c])
        return {c: _concat(ps) for c, ps in out.items()}

    def _fallback(self, chunk_id: int, layer: int, decided: str, used: str, peer) -> None:
        holder = self.requester.directory[chunk_id].holders[0]
        self.fallbacks.append(
            dict(
                chunk=chunk_id,
                layer=layer,
                step=self.step - 1,
                decided=decided,
                used=used,
                holder=holder,
                peer=peer,
            )
        )

    def _note_batches(self, recs) -> None:
        """Per routed record, the rows x tokens of its holder's batch (the requests of one
        wave to one holder run as one kernel call and each waits for all of it, §6.3)."""
        work: dict[int | None, int] = {}
        for r in recs:
            work[r.peer] = work.get(r.peer, 0) + r.m_q * self.corpus.chunks[r.chunk_id].tokens
        for r in recs:
            self.batch_work[id(r)] = work[r.peer]

    def _attend_one(self, chunk_id: int, rows: torch.Tensor, layer: int, indices=None):
        """One chunk by its primitive, then the others (and replicas) on failure (``indices``:
        None, or the rows' ``[B*T, k]`` chunk-local selection)."""
        req = self.requester
        chosen = self.primitive(chunk_id)
        order = (chosen, *(p for p in PRIMITIVES if p != chosen))
        info, off = req.directory[chunk_id], self.chunk_offset(chunk_id)
        # a copy in the pool answers in place, unless this is a forced route (_held)
        reused = self._held(chunk_id, chosen)
        existed = (chunk_id, off) in req.local_chunks
        n = self._route_tokens if chosen == "route" else rows.shape[0]
        sel = [None if indices is None else indices[i : i + n] for i in range(0, len(rows), n)]
        parts = [
            req.attend(
                chunk_id,
                rows[i * n : (i + 1) * n],
                layer,
                offset=off,
                order=order,
                indices=x,
                held=reused,
            )
            for i, x in enumerate(sel)
        ]
        part = _concat(parts)
        if not existed and (chunk_id, off) in req.local_chunks:
            self._request.made.add(chunk_id)  # fetched / re-prefilled now, for this request
        if not reused and (part.primitive != chosen or part.peer not in (None, info.holders[0])):
            self._fallback(chunk_id, layer, chosen, part.primitive, part.peer)
        return part


def _check_layer(session: HFSession, layer, rows, parts, local, o_merged, w_uv) -> None:
    """The verification of one layer (``verify=True``; the demo's table): each chunk's partial
    ``[(chunk_id, Partial)]`` against fp64 attention over the chunk's canonical entries (rotated
    to the session's offset), and the merged answer ``o_merged`` against the fp64 merge of those
    references through ``w_uv`` with the ``local`` partial; the largest errors go to
    ``session.errors`` by path and ``"merged"``."""
    refs_o, refs_lse = [], []
    q64 = rows.double()
    for cid, p in parts:
        c = session.corpus.chunks[cid]
        kv = session.corpus.chunk_kv(cid)[layer].double()
        delta = session.chunk_offset(cid) - c.position
        if delta:
            kv = rope_rotate_reference(kv, delta, session.rope)
        valid = torch.ones(q64.shape[0], kv.shape[0], dtype=torch.bool)
        o_ref, lse_ref = partial_attention_reference(
            q64, kv, valid, session.corpus.softmax_scale, session.geometry.d_v
        )
        session.errors.setdefault(p.primitive, []).append(compare(p.o, o_ref).max_abs)
        refs_o.append(latent_to_heads(o_ref, w_uv.double()))
        refs_lse.append(lse_ref)
    o_ref, _ = merge_reference(
        torch.stack([*refs_o, local[0].double()]), torch.stack([*refs_lse, local[1].double()])
    )
    session.errors.setdefault("merged", []).append(compare(o_merged, o_ref).max_abs)


def _check_force(force, corpus: Corpus) -> None:
    """``force``: None, a primitive, or a mapping of the corpus' chunk ids to primitives; else
    a ``ValueError`` naming ``force``."""
    if force is None or force in PRIMITIVES:
        return
    if not isinstance(force, Mapping):
        raise ValueError(
            f"force: expected None, 'route', 'fetch', 'local' or a mapping chunk_id -> one of "
            f"them, got {force!r}"
        )
    for chunk_id, primitive in force.items():
        if isinstance(chunk_id, bool) or not isinstance(chunk_id, int):
            raise ValueError(
                f"force: expected chunk ids (ints) as keys, got {chunk_id!r} "
                f"({type(chunk_id).__name__})"
            )
        if chunk_id not in corpus.chunks:
            raise ValueError(
                f"force: expected chunk ids of the corpus ({sorted(corpus.chunks)}), got {chunk_id}"
            )
        if primitive not in PRIMITIVES:
            raise ValueError(
                f"force[{chunk_id}]: expected 'route', 'fetch' or 'local', got {primitive!r}"
            )


def _check_arguments(
    model, corpus, requester, force, steps, verify, on_step, *, sparse: bool = False
) -> MLAGeometry:
    """:class:`HFSession`'s arguments checked; returns the model's geometry. ``sparse``: the
    session attends a DSA model's selection (:mod:`mqnc.integrations.hf_v32`)."""
    if (check_model(model) == "deepseek_v32") != sparse:
        raise TypeError(
            "model: a DeepseekV32ForCausalLM attends its indexer's top-k selection: attach it "
            "with mqnc.integrations.hf_v32.attach_v32"
            if not sparse
            else f"model: expected a DeepseekV32ForCausalLM, got {type(model).__name__}"
        )
    if not isinstance(corpus, Corpus):
        raise TypeError(f"corpus: expected an mqnc.serving.Corpus, got {type(corpus).__name__}")
    if not isinstance(requester, Requester):
        raise TypeError(f"requester: expected a Requester, got {type(requester).__name__}")
    _check_force(force, corpus)
    if model.dtype != corpus.dtype or requester.dtype != corpus.dtype:
        raise TypeError(
            f"model: expected the corpus dtype {corpus.dtype} for the model and the requester, "
            f"got {model.dtype} and {requester.dtype}"
        )
    g = geometry_of(model)
    if requester.kernels == "triton":  # its rotation, splice, pool attention and merge
        g.check_triton()
    cg = corpus.geometry
    if (g.layers, g.d_c, g.d_r, g.heads) != (cg.layers, cg.d_c, cg.d_r, cg.heads):
        raise ValueError(
            f"corpus: written by a model with (layers, d_c, d_r, heads) = "
            f"{(cg.layers, cg.d_c, cg.d_r, cg.heads)}, this model has "
            f"{(g.layers, g.d_c, g.d_r, g.heads)}"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    if not isinstance(verify, bool):
        raise TypeError(f"verify: expected True or False, got {verify!r}")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step: expected None or a callable on_step(step), got {on_step!r}")
    return g


def _register_corpus(corpus: Corpus, requester) -> None:
    """Register the corpus' chunks on the requester (a chunk it knows must be the same chunk)
    and give it the corpus' rope when it has none."""
    for info in corpus.directory():
        known = requester.directory.get(info.chunk_id)
        if known is None:
            requester.register(info)
        elif not known.same_chunk(info):
            raise ValueError(
                f"corpus: chunk {info.chunk_id} is {info}, the requester has {known} "
                "registered (its holders serve another corpus); attach through a requester "
                "of this corpus' holders (corpus.make_requester, LocalHolders(corpus))"
            )
    if requester.rope is None:
        requester.rope = corpus.rope


def _check_rope(own, rope, delta: int) -> None:
    """A context used ``delta != 0`` positions from where it was prefilled is rotated by the
    requester's RoPE spec ``rope`` (the query by ``R(-delta)``, a fetched chunk by ``R(delta)``):
    it must rotate pairs of the cache's layout by the model's own frequencies ``own`` (those its
    forward encoded the cache and the query with), else a ``ValueError`` naming ``rope``."""
    if not delta or rope is None:  # no rotation (a None the requester refuses itself)
        return
    theirs, mine = tuple(rope.inv_freq), own.inv_freq
    if rope.layout != own.layout:
        what = f"pairs in layout {rope.layout!r}, the model's cache in {own.layout!r}"
    elif len(theirs) != len(mine):
        what = f"{len(theirs)} frequencies, the model {len(mine)}"
    elif theirs != mine:
        i = next(i for i, (a, b) in enumerate(zip(theirs, mine, strict=True)) if a != b)
        what = f"pair {i} at {theirs[i]!r} rad per position, the model at {mine[i]!r}"
    else:
        return
    raise ValueError(
        f"rope: the requester would rotate the context by {delta} positions with other RoPE "
        f"frequencies than the model encodes positions with (model.model.rotary_emb.inv_freq): "
        f"{what}; prefill the context with this model (prefill_context records its frequencies "
        "in the corpus) or give the requester rope=rope_spec_of(model)"
    )


class _Reprefills:
    """The local primitive's cache: the context's entries ``[L, n, d_qk]`` re-prefilled by the
    model's own forward over the context's tokens, by the context offset they were computed at.

    A cached prefix long enough for the chunks asked for is reused, else one forward computes
    through the last of them. While it runs, ``running`` is True: the attention hook then gives
    the model its own attention.
    """

    def __init__(self, model, corpus: Corpus) -> None:
        self.model = model
        self.corpus = corpus
        self._by_start: dict[int, torch.Tensor] = {}
        self.running = False

    def entries(self, chunk_id: int, offset: int, also: list[int]) -> torch.Tensor:
        """``chunk_id``'s entries ``[L, c_t, d_qk]`` re-prefilled at ``offset``, computed (if
        not cached) through the end of this chunk and of every chunk in ``also``."""
        chunks = self.corpus.chunks
        c = chunks[chunk_id]
        start = int(offset) - (c.position - self.corpus.position)
        end = max(chunks[k].start + chunks[k].tokens for k in (chunk_id, *also))
        have = self._by_start.get(start)
        if have is None or have.shape[1] < end:
            ids = torch.tensor(self.corpus.meta["token_ids"][:end], dtype=torch.long)
            self.running = True
            try:
                self._by_start[start] = prefill_entries(self.model, ids, start).cpu()
            finally:
                self.running = False
        return self._by_start[start][:, c.start : c.start + c.tokens]


def _concat(parts: list):
    """Partials of consecutive row slices as one (the record of the first is kept)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return dataclasses.replace(
        first, o=torch.cat([p.o for p in parts]), lse=torch.cat([p.lse for p in parts])
    )


def _new_tokens(model, prompt_len: int, kwargs: dict) -> int | None:
    """The tokens ``generate`` will add as transformers resolves them: ``max_new_tokens`` (a
    keyword, else the passed or the model's generation config), else ``max_length`` minus the
    prompt; None if neither is set."""
    gc = kwargs.get("generation_config") or model.generation_config
    n = kwargs.get("max_new_tokens", gc.max_new_tokens)
    if n is None:
        length = kwargs.get("max_length", gc.max_length)
        n = None if length is None else max(int(length) - int(prompt_len), 1)
    return n


def _check_unpadded(mask, n_local: int) -> None:
    """Refuse padding: every query row must attend to a prefix of the local keys (its own
    earlier tokens), the same for every row of the batch, one key more per query token, as an
    unpadded causal row does. ``mask``: HF's additive (or boolean) mask ``[B, 1, T, N]``."""
    if mask is None:
        return
    m = mask[:, 0, :, :n_local]
    allowed = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    k = allowed.sum(-1)  # [B, T] keys each row sees
    prefix = allowed.long().cumprod(-1).sum(-1) == k
    causal = k[:1, :1] + torch.arange(k.shape[1], device=k.device)
    bad = (~prefix | (k != causal)).any(-1).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(
            "attention_mask: padded prompts are not supported; expected every row to attend to "
            f"all of its own earlier tokens (an unpadded causal mask), got a mask hiding tokens "
            f"of batch row {b} (an attention_mask with zeros, or the one transformers builds from "
            "pad_token_id when the prompt contains the pad token: pass attention_mask of ones "
            "if it is a real token)"
        )


def local_partial(query, key, value, mask, scaling: float):
    """The partial over the model's own tokens: HF's expanded keys ``[B, H, N, Dqk]`` and
    values ``[B, H, N, Dv]``, HF's additive mask ``[B, 1, T, N]`` (or None: causal), in fp32.
    Returns ``o [B*T, H, Dv]`` and natural-log ``lse [B*T, H]``, float32."""
    B, H, T, _ = query.shape
    N = key.shape[2]
    s = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling  # [B, H, T, N]
    if mask is not None:
        s = s + mask[..., :N].float()
    elif T > 1:
        causal = torch.ones(T, N, dtype=torch.bool, device=s.device).tril(N - T)
        s = s.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.softmax(s, dim=-1), value.float())
    return o.transpose(1, 2).reshape(B * T, H, -1), lse.transpose(1, 2).reshape(B * T, H)


def attach(model, corpus: Corpus, requester, **kwargs) -> HFSession:
    """Attach ``model`` to ``corpus`` through ``requester``; use as a context manager::

        with attach(model, corpus, requester) as session:
            out = session.generate(prompt_ids, max_new_tokens=16, do_sample=False)

    ``kwargs`` are :class:`HFSession`'s (``offset``, ``force``, ``fabric``, ``verify``, ...).
    """
    return HFSession(model, corpus, requester, **kwargs)
