"""The demo's workload (§1, §5.4): a small real MLA model, one canonical corpus prefilled chunk
by chunk, and the sub-agents that read it (the whole-chunk agents' teams and chunks planned from
the constants by :mod:`mqnc.demo.teams`).

Everything derives from the seed, so every process (the requester and each holder) rebuilds
exactly the model and the chunks it needs.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch

from mqnc.demo.config import DemoConfig
from mqnc.demo.teams import PREAMBLE, Plan
from mqnc.model import MLAModel, RopeSpec, get_preset

__all__ = ["build_model", "Corpus", "Agent", "Indexer", "make_agents", "readers"]


def build_model(cfg: DemoConfig) -> MLAModel:
    """DeepSeek-V2-Lite attention (16 heads, 512 + 64 latent, YaRN RoPE) with ``cfg.layers``
    layers and seeded weights; its geometry keeps the cache in ``cfg.kv_dtype``'s format."""
    geometry = get_preset("deepseek-v2-lite").replace(
        layers=cfg.layers, cache_dtype=cfg.cache_dtype
    )
    rope = RopeSpec.from_preset("deepseek-v2-lite")
    return MLAModel.random(geometry, rope, hidden=cfg.hidden, seed=cfg.seed)


class Corpus:
    """The canonical corpus: chunk lengths, positions, token embeddings and cache, all derived
    from the seed, so every process rebuilds exactly the chunks it needs."""

    def __init__(self, cfg: DemoConfig, model: MLAModel) -> None:
        self.cfg = cfg
        self.model = model
        g = torch.Generator().manual_seed(cfg.seed)
        self.lengths = [
            int(x)
            for x in torch.randint(cfg.min_tokens, cfg.max_tokens + 1, (cfg.chunks,), generator=g)
        ]
        self.positions = [sum(self.lengths[:i]) for i in range(cfg.chunks)]
        self.total = sum(self.lengths)
        self._kv: dict[int, torch.Tensor] = {}

    def embeddings(self, chunk_id: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + 7919 * (chunk_id + 1))
        return torch.randn(self.lengths[chunk_id], self.model.hidden, generator=g)

    def prefill_at(self, chunk_id: int, offset: int) -> torch.Tensor:
        """The chunk's cache ``[L, c_t, d_qk]`` bf16, prefilled with its first token at
        ``offset`` (what ``local`` runs; at the canonical position, how the corpus is built)."""
        kv = self.model.prefill(self.embeddings(chunk_id), offset, dtype=torch.float32)
        return kv.to(torch.bfloat16)

    def kv(self, chunk_id: int) -> torch.Tensor:
        """The canonical cache of a chunk (bf16, built once per process)."""
        if chunk_id not in self._kv:
            self._kv[chunk_id] = self.prefill_at(chunk_id, self.positions[chunk_id])
        return self._kv[chunk_id]

    def placement(self) -> dict[int, tuple[int, ...]]:
        """Chunk -> holder ranks (1..holders), round robin, ``replicas`` consecutive holders."""
        n = self.cfg.holders
        return {
            c: tuple(1 + (c + r) % n for r in range(self.cfg.replicas))
            for c in range(self.cfg.chunks)
        }


@dataclasses.dataclass
class Agent:
    """One sub-agent: its attended chunks (at their offsets in its context, or a selection over
    the whole corpus), its own suffix cache and its decode state."""

    name: str
    kind: str  # "whole" or "selection"
    chunks: list[int]
    offsets: dict[int, int]
    start: int  # position of the first suffix token
    suffix_kv: torch.Tensor | None = None  # [L, n, d_qk] bf16
    hidden: torch.Tensor | None = None  # [1, D] fp32 input of the next step

    def delta(self, corpus: Corpus, chunk: int) -> int:
        """How far this agent sees ``chunk`` from its canonical position."""
        return self.offsets[chunk] - corpus.positions[chunk]


class Indexer:
    """A DSA-style selector: per layer, top-k of ``q_idx . k_idx`` over every corpus token, with
    ``q_idx``/``k_idx`` a fixed random 32-dim projection of the absorbed query / cache entry.

    It stands in for DeepSeek's Lightning Indexer (a small learned scorer): what matters here is
    that the selected set is scattered across chunks and holders and re-chosen every step.
    """

    def __init__(self, corpus: Corpus, topk: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed + 17)
        d_qk = corpus.model.geometry.d_qk
        self.proj = torch.randn(d_qk, 32, generator=g) / math.sqrt(d_qk)
        self.keys = [
            torch.cat([corpus.kv(c)[layer].float() for c in range(len(corpus.lengths))]) @ self.proj
            for layer in range(corpus.model.geometry.layers)
        ]
        self.topk = min(topk, corpus.total)
        self.corpus = corpus

    def select(self, layer: int, q: torch.Tensor) -> dict[int, list[int]]:
        """Chunk -> sorted chunk-local token indices selected for query ``q [1, H, d_qk]``."""
        score = (q.float().mean(dim=1) @ self.proj) @ self.keys[layer].T  # [1, N]
        top = score[0].topk(self.topk).indices.sort().values.tolist()
        out: dict[int, list[int]] = defaultdict(list)
        c = 0
        for t in top:
            while t >= self.corpus.positions[c] + self.corpus.lengths[c]:
                c += 1
            out[c].append(t - self.corpus.positions[c])
        return dict(out)


def make_agents(cfg: DemoConfig, corpus: Corpus, plan: Plan) -> list[Agent]:
    """The whole-chunk agents of ``plan`` (:func:`mqnc.demo.teams.plan_workload`), team by team:
    each team's agents read its chunks at the same new offsets, after a preamble of the team's
    own (``PREAMBLE * (team + 1)`` tokens); then ``selection_agents`` agents forking the whole
    corpus at its canonical positions."""
    agents = []
    for t, team in enumerate(plan.teams):
        pos = PREAMBLE * (t + 1)  # the team's own preamble before its chunks: a new offset
        offsets = {}
        for c in team.chunks:
            offsets[c] = pos
            pos += corpus.lengths[c]
        for _ in range(team.size):
            name = f"whole-{len(agents)}"
            agents.append(Agent(name, "whole", list(team.chunks), dict(offsets), pos))
    for a in range(cfg.selection_agents):
        agents.append(
            Agent(
                f"select-{a}",
                "selection",
                list(range(cfg.chunks)),
                dict(enumerate(corpus.positions)),
                corpus.total,
            )
        )
    return agents


def readers(agents: list[Agent]) -> dict[tuple[int, int], tuple[str, ...]]:
    """``(chunk, offset)`` -> the agents that read the chunk at that offset (who share one
    fetched or re-prefilled copy of it)."""
    out: dict[tuple[int, int], list[str]] = defaultdict(list)
    for a in agents:
        for c in a.chunks:
            out[(c, a.offsets[c])].append(a.name)
    return {k: tuple(v) for k, v in out.items()}
