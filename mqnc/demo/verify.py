"""The demo's verification: every partial and every merged answer against a single-instance
fp64 reference over the same keys (the canonical cache re-homed to the agent's offsets by an
exact fp64 rotation), within ``demo_partial`` / ``demo_merged`` / ``demo_lse`` of
:data:`mqnc.testing.TOLERANCES`.

With an FP8 cache (``--kv-dtype fp8``) the keys are the canonical cache quantized to FP8 entries
and dequantized exactly (fp64 references of ``mqnc.reference.fp8_ref``; the RoPE part is bf16
in the entry, so only the latent changes): the bounds are the kernels', as for bf16. The
quantization error, what FP8 moves an answer, is reported apart (``quantization``: the fp64
merged answer over the dequantized keys against the one over the bf16 keys), never folded into
a bound."""

from __future__ import annotations

from collections import defaultdict

import torch

from mqnc.demo.workload import Agent, Corpus
from mqnc.model import MLAModel
from mqnc.reference import partial_attention_reference
from mqnc.reference.fp8_ref import fp8_dequantize_reference, fp8_quantize_reference
from mqnc.reference.rope_ref import rope_rotate_reference
from mqnc.serving import Partial
from mqnc.testing import CloseStats, assert_close, tolerance

__all__ = ["Verifier"]


class Verifier:
    """Checks an agent's partials and merged answer; keeps the largest error per primitive
    (``errors["route" | "fetch" | "local" | "merged"]``, one entry per check), the same per
    decode (``by_decode[tag]``, ``tag`` set by the run before each decode: ``"predicate"`` or
    ``"other"``) and, with an FP8 cache, the quantization error of each merged answer
    (``quantization``)."""

    def __init__(self, model: MLAModel, corpus: Corpus) -> None:
        self.model = model
        self.corpus = corpus
        self.errors: dict[str, list[float]] = defaultdict(list)
        self.tag: str | None = None
        self.by_decode: dict[str | None, dict[str, list[float]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self.quantization: list[float] = []
        self._dequantized: dict[int, torch.Tensor] = {}

    def canonical(self, chunk: int, *, quantized: bool = True) -> torch.Tensor:
        """``chunk``'s canonical cache ``[L, c_t, d_qk]`` as the holders keep it, fp64: the bf16
        rows, or with an FP8 cache (and ``quantized``) their FP8 entries dequantized exactly."""
        layout = self.model.geometry.fp8_layout
        if layout is None or not quantized:
            return self.corpus.kv(chunk).double()
        if chunk not in self._dequantized:
            entries = fp8_quantize_reference(self.corpus.kv(chunk), layout.d_c)
            rows = fp8_dequantize_reference(entries, layout.d_c, layout.d_r, torch.float32)
            self._dequantized[chunk] = rows.double()
        return self._dequantized[chunk]

    def agent_keys(
        self, agent: Agent, chunk: int, layer: int, indices=None, *, quantized: bool = True
    ) -> torch.Tensor:
        """The canonical cache of ``chunk`` in ``agent``'s frame, fp64 (exact rotation);
        only the selected entries when ``indices`` (chunk-local, int64) are given; an FP8
        cache's entries dequantized unless ``quantized`` is False."""
        kv = self.canonical(chunk, quantized=quantized)[layer]
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
        picks = {
            c: None if ind is None else ind[0][ind[0] >= 0].long().cpu()
            for c, ind in selection.items()
        }
        keys = {c: self.agent_keys(agent, c, layer, ind) for c, ind in picks.items()}
        ref_parts, (o_ref, lse_ref) = self.reference(q.cpu(), keys, suffix.double())
        if self.model.geometry.fp8_layout is not None:  # what FP8 moves the answer, apart
            rows = {
                c: self.agent_keys(agent, c, layer, ind, quantized=False)
                for c, ind in picks.items()
            }
            _, (o_bf16, _) = self.reference(q.cpu(), rows, suffix.double())
            self.quantization.append(float((o_ref - o_bf16).abs().max()))
        lse_tol = tolerance("demo_lse", "float32")
        for c, part in zip(selection, partials, strict=True):
            where = f"{agent.name} chunk {c} layer {layer} ({part.primitive})"
            s = self._check("demo_partial", part.o, ref_parts[c][0], f"{where} o")
            assert_close(part.lse, ref_parts[c][1], lse_tol, name=f"{where} lse")
            self.errors[part.primitive].append(s.max_abs)
            self.by_decode[self.tag][part.primitive].append(s.max_abs)
        o, lse = merged
        s = self._check("demo_merged", o, o_ref, f"{agent.name} layer {layer} merged o")
        assert_close(lse, lse_ref, lse_tol, name="merged lse")
        self.errors["merged"].append(s.max_abs)
        self.by_decode[self.tag]["merged"].append(s.max_abs)
