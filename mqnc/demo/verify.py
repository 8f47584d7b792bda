"""The demo's verification: every partial and every merged answer against a single-instance
fp64 reference over the same keys (the canonical cache re-homed to the agent's offsets by an
exact fp64 rotation), within ``demo_partial`` / ``demo_merged`` / ``demo_lse`` of
:data:`mqnc.testing.TOLERANCES`."""

from __future__ import annotations

from collections import defaultdict

import torch

from mqnc.demo.workload import Agent, Corpus
from mqnc.model import MLAModel
from mqnc.reference import partial_attention_reference
from mqnc.reference.rope_ref import rope_rotate_reference
from mqnc.serving import Partial
from mqnc.testing import CloseStats, assert_close, tolerance

__all__ = ["Verifier"]


class Verifier:
    """Checks an agent's partials and merged answer; keeps the largest error per primitive
    (``errors["route" | "fetch" | "local" | "merged"]``, one entry per check)."""

    def __init__(self, model: MLAModel, corpus: Corpus) -> None:
        self.model = model
        self.corpus = corpus
        self.errors: dict[str, list[float]] = defaultdict(list)

    def agent_keys(self, agent: Agent, chunk: int, layer: int, indices=None) -> torch.Tensor:
        """The canonical cache of ``chunk`` in ``agent``'s frame, fp64 (exact rotation);
        only the selected entries when ``indices`` (chunk-local, int64) are given."""
        kv = self.corpus.kv(chunk)[layer].double()
        delta = agent.delta(self.corpus, chunk)
        if delta:
            kv = rope_rotate_reference(kv, delta, self.model.rope)
        if indices is not None:
            kv = kv[indices]
        return kv

    def reference(self, q: torch.Tensor, keys_by_chunk: dict, suffix: torch.Tensor):
        """fp64 attention of ``q [1, H, d_qk]`` over each key set and over their union."""
        scale, d_v = self.model.softmax_scale, self.model.geometry.d_v
        parts = {}
        for c, kv in keys_by_chunk.items():
            valid = torch.ones(1, kv.shape[0], dtype=torch.bool)
            parts[c] = partial_attention_reference(q, kv, valid, scale, d_v)
        allk = torch.cat([*keys_by_chunk.values(), suffix])
        whole = partial_attention_reference(
            q, allk, torch.ones(1, allk.shape[0], dtype=torch.bool), scale, d_v
        )
        return parts, whole

    @staticmethod
    def _check(op: str, actual, expected, name: str) -> CloseStats:
        """``assert_close`` with the demo's bound scaled by the reference's largest |o|."""
        tol = tolerance(op, "bfloat16")
        scale = max(float(expected.abs().max()), 2**-4)
        return assert_close(
            actual, expected, atol=tol.atol * scale, rms_rtol=tol.rms_rtol, name=name
        )

    def check_agent(
        self,
        agent: Agent,
        layer: int,
        q: torch.Tensor,
        selection: dict,
        partials: list[Partial],
        suffix: torch.Tensor,
        merged: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Check each of ``partials`` (one per chunk of ``selection``, in order) and the
        ``merged`` ``(o, lse)`` over them and the agent's ``suffix`` entries; raises
        ``AssertionError`` beyond a bound."""
        keys = {
            c: self.agent_keys(
                agent, c, layer, None if ind is None else ind[0][ind[0] >= 0].long().cpu()
            )
            for c, ind in selection.items()
        }
        ref_parts, (o_ref, lse_ref) = self.reference(q.cpu(), keys, suffix.double())
        lse_tol = tolerance("demo_lse", "float32")
        for c, part in zip(selection, partials, strict=True):
            where = f"{agent.name} chunk {c} layer {layer} ({part.primitive})"
            s = self._check("demo_partial", part.o, ref_parts[c][0], f"{where} o")
            assert_close(part.lse, ref_parts[c][1], lse_tol, name=f"{where} lse")
            self.errors[part.primitive].append(s.max_abs)
        o, lse = merged
        s = self._check("demo_merged", o, o_ref, f"{agent.name} layer {layer} merged o")
        assert_close(lse, lse_ref, lse_tol, name="merged lse")
        self.errors["merged"].append(s.max_abs)
