"""``mqnc demo``: an agentic fan-in over a partitioned canonical corpus, decided, executed and
verified end to end (§1, §5, §6.3 of the paper).

One immutable document (a "codebase" of ``chunks`` canonical chunks) is prefilled once into MLA
cache, each chunk on its own at its canonical position (position-independent caching, §1,
§2.2), and partitioned over ``holders`` holder instances (processes over torch.distributed gloo
by default, threads over the in-process loopback with ``--transport loopback``). ``agents``
sub-agents then decode ``steps`` tokens each, through all ``L`` layers of a small real MLA
model (:class:`mqnc.model.MLAModel`, DeepSeek-V2-Lite attention geometry, YaRN RoPE):

- **whole-chunk agents** (contiguous reuse, §2.2) read a few chunks placed at *new* offsets in
  their own context, followed by their own suffix;
- **selection agents** (§5.4) fork the whole corpus as their prefix at its canonical positions
  and attend, per layer and step, a DSA-style top-k selection scattered across the holders
  (the indexer here is exact top-k of a small random projection of the scores; see
  :class:`Indexer`), plus their suffix.

For every (chunk, agent) the closed-form predicate (:func:`mqnc.predicate.decide`) picks route,
fetch or local with this machine's constants (calibrated at start-up by a short probe / route
sweep and one timed call of each primitive, or loaded with ``--profile``), and the demo executes
that choice for real: route sends the absorbed query rows (rotated by the opposite delta, §3.2)
to the holder, which batches all waiting rows into one kernel call (§6.3); fetch pulls all
layers and splices them into the requester's pool (§2.2); local re-prefills the chunk through
the model. ``--force`` runs every (chunk, agent) through one primitive.

Every partial and every merged answer is compared with a single-instance fp64 reference over
the same keys (the canonical cache, re-homed to the agent's offsets by an exact fp64
rotation); the demo fails (exit 1) beyond the bounds of :data:`mqnc.testing.TOLERANCES`
(``demo_partial`` / ``demo_merged``). At the end it prints a table per primitive (count, wire
bytes, measured time per cost term beside the model's prediction, MAPE, max error), writes
everything as JSON under ``--out`` and draws measured against predicted time as a PNG.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

__all__ = ["DemoConfig", "run_demo", "register"]

REQUESTER = 0
TRANSPORTS = ("gloo", "loopback", "nvshmem")


def _device(cfg) -> str:
    """Where pools and kernels live: the GPU when there is one (compiled kernels), else the CPU
    (the interpreter)."""
    import torch

    return cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _process_transport(cfg, rank: int, world: int, store, geometry):
    """This rank's engine for a multi-process run: gloo, or NVSHMEM (GPU only; several PEs
    may share one GPU in NVSHMEM's limited multi-process mode)."""
    if cfg.transport == "nvshmem":
        from mqnc.transport.nvshmem import NvshmemTransport

        return NvshmemTransport(
            rank, world, store, slot_bytes=_slot_bytes(cfg, geometry), lanes=LANES, device=0
        )
    from mqnc.transport.torchdist import TorchDistTransport

    return TorchDistTransport(
        rank, world, store, slot_bytes=_slot_bytes(cfg, geometry), lanes=LANES
    )


@dataclasses.dataclass
class DemoConfig:
    """Everything a run depends on; the defaults finish in under 2 minutes on 2 CPU cores."""

    layers: int = 4
    chunks: int = 16
    min_tokens: int = 256
    max_tokens: int = 512
    holders: int = 2
    replicas: int = 1
    whole_agents: int = 3
    selection_agents: int = 1
    chunks_per_agent: int = 3
    topk: int = 256
    suffix_tokens: int = 16
    steps: int = 2
    hidden: int = 256
    seed: int = 0
    transport: str = "gloo"
    force: str | None = None
    profile: str | None = None
    out: str = "mqnc-demo-out"
    block_size: int = 64
    timeout_s: float = 60.0
    device: str | None = None
    kill_holder: int | None = None
    kill_after_step: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "chunks", "min_tokens", "holders", "replicas", "steps", "hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.max_tokens < self.min_tokens:
            raise ValueError(
                f"max_tokens: expected >= min_tokens ({self.min_tokens}), got {self.max_tokens}"
            )
        if self.replicas > self.holders:
            raise ValueError(f"replicas: expected <= holders ({self.holders}), got {self.replicas}")
        if self.chunks_per_agent > self.chunks:
            raise ValueError(
                f"chunks_per_agent: expected <= chunks ({self.chunks}), got {self.chunks_per_agent}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {TRANSPORTS}, got {self.transport!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device: expected None, 'cpu' or 'cuda', got {self.device!r}")
        if self.force not in (None, "route", "fetch", "local"):
            raise ValueError(f"force: expected route, fetch or local, got {self.force!r}")
        if self.kill_holder is not None and not 1 <= self.kill_holder <= self.holders:
            raise ValueError(
                f"kill_holder: expected a holder rank in 1..{self.holders}, got {self.kill_holder}"
            )


# ---- the corpus ----------------------------------------------------------------------------------


class Corpus:
    """The canonical corpus: chunk lengths, positions, token embeddings and cache, all derived
    from the seed, so every process rebuilds exactly the chunks it needs."""

    def __init__(self, cfg: DemoConfig, model) -> None:
        import torch

        self.cfg = cfg
        self.model = model
        g = torch.Generator().manual_seed(cfg.seed)
        self.lengths = [
            int(x)
            for x in torch.randint(cfg.min_tokens, cfg.max_tokens + 1, (cfg.chunks,), generator=g)
        ]
        self.positions = [sum(self.lengths[:i]) for i in range(cfg.chunks)]
        self.total = sum(self.lengths)
        self._kv: dict[int, object] = {}

    def embeddings(self, chunk_id: int):
        import torch

        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + 7919 * (chunk_id + 1))
        return torch.randn(self.lengths[chunk_id], self.model.hidden, generator=g)

    def prefill_at(self, chunk_id: int, offset: int):
        """The chunk's cache ``[L, c_t, d_qk]`` bf16, prefilled with its first token at
        ``offset`` (what ``local`` runs; at the canonical position, how the corpus is built)."""
        import torch

        kv = self.model.prefill(self.embeddings(chunk_id), offset, dtype=torch.float32)
        return kv.to(torch.bfloat16)

    def kv(self, chunk_id: int):
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


def _build_model(cfg: DemoConfig):
    from mqnc.geometry import get_preset
    from mqnc.model import MLAModel
    from mqnc.rope import RopeSpec

    geometry = get_preset("deepseek-v2-lite").replace(layers=cfg.layers)
    rope = RopeSpec.from_preset("deepseek-v2-lite")
    return MLAModel.random(geometry, rope, hidden=cfg.hidden, seed=cfg.seed)


def _slot_bytes(cfg: DemoConfig, geometry) -> int:
    from mqnc.transport import slot_bytes_for

    agents = cfg.whole_agents + cfg.selection_agents
    return slot_bytes_for(
        geometry,
        max_rows=max(agents, 16) * geometry.heads,
        max_topk=cfg.topk,
        max_batch=max(agents, 16),
        max_chunk_tokens=cfg.max_tokens,
    )


LANES = 8


# ---- holders -------------------------------------------------------------------------------------


def _make_holder(cfg: DemoConfig, transport, model, corpus):
    from mqnc.holder import Holder

    g = model.geometry
    mine = [c for c, hs in corpus.placement().items() if transport.rank in hs]
    blocks = sum(-(-corpus.lengths[c] // cfg.block_size) for c in mine) + 1
    holder = Holder(
        transport,
        g,
        softmax_scale=model.softmax_scale,
        num_blocks=blocks,
        block_size=cfg.block_size,
        device=_device(cfg),
    )
    for c in mine:
        holder.add_chunk(c, corpus.kv(c), corpus.positions[c])
    return holder


def _holder_process(rank: int, world: int, port: int, cfg_dict: dict) -> None:
    """Entry point of a holder process (gloo or NVSHMEM): build its chunks, serve until shut
    down."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from mqnc.runtime import use_interpreter_without_cuda

    use_interpreter_without_cuda()
    import torch
    from torch.distributed import TCPStore

    torch.set_num_threads(1)
    cfg = DemoConfig(**cfg_dict)
    model = _build_model(cfg)
    corpus = Corpus(cfg, model)
    store = TCPStore("127.0.0.1", port, world, is_master=False)
    transport = _process_transport(cfg, rank, world, store, model.geometry)
    holder = _make_holder(cfg, transport, model, corpus)
    store.set(f"ready/{rank}", "1")
    try:
        holder.serve_forever()
    finally:
        transport.close()


# ---- agents -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Agent:
    """One sub-agent: its attended chunks (at their offsets in its context, or a selection over
    the whole corpus), its own suffix cache and its decode state."""

    name: str
    kind: str  # "whole" or "selection"
    chunks: list[int]
    offsets: dict[int, int]
    start: int  # position of the first suffix token
    suffix_kv: object = None  # [L, n, d_qk] bf16
    hidden: object = None  # [1, D] fp32 input of the next step


class Indexer:
    """A DSA-style selector: per layer, top-k of ``q_idx . k_idx`` over every corpus token, with
    ``q_idx``/``k_idx`` a fixed random 32-dim projection of the absorbed query / cache entry.

    It stands in for DeepSeek's Lightning Indexer (a small learned scorer): what matters here is
    that the selected set is scattered across chunks and holders and re-chosen every step.
    """

    def __init__(self, corpus: Corpus, topk: int, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed + 17)
        d_qk = corpus.model.geometry.d_qk
        self.proj = torch.randn(d_qk, 32, generator=g) / math.sqrt(d_qk)
        self.keys = [
            torch.cat([corpus.kv(c)[layer].float() for c in range(len(corpus.lengths))]) @ self.proj
            for layer in range(corpus.model.geometry.layers)
        ]
        self.topk = min(topk, corpus.total)
        self.corpus = corpus

    def select(self, layer: int, q) -> dict[int, list[int]]:
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


def _make_agents(cfg: DemoConfig, corpus: Corpus) -> list[Agent]:
    import torch

    g = torch.Generator().manual_seed(cfg.seed + 5)
    agents = []
    for a in range(cfg.whole_agents):
        chunks = torch.randperm(cfg.chunks, generator=g)[: cfg.chunks_per_agent].tolist()
        pos = 32 * (a + 1)  # each agent's own preamble before its chunks: a new offset for all
        offsets = {}
        for c in chunks:
            offsets[c] = pos
            pos += corpus.lengths[c]
        agents.append(Agent(f"whole-{a}", "whole", chunks, offsets, pos))
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


# ---- the requester's run ------------------------------------------------------------------------


class _Run:
    """The requester side: calibration, decisions, execution, verification, report."""

    def __init__(self, cfg: DemoConfig, transport, model, corpus, kill=None) -> None:
        from mqnc.requester import ChunkInfo, Requester

        self.cfg, self.transport, self.model, self.corpus = cfg, transport, model, corpus
        self.kill = kill
        g = model.geometry
        self.geometry = g
        n_agents = cfg.whole_agents + cfg.selection_agents
        per_chunk_blocks = -(-cfg.max_tokens // cfg.block_size)
        self.req = Requester(
            transport,
            g,
            softmax_scale=model.softmax_scale,
            rope=model.rope,
            timeout_s=cfg.timeout_s,
            # every agent's chunks, every chunk once more, and the calibration's 6 copies
            pool_blocks=per_chunk_blocks * (n_agents * cfg.chunks_per_agent + cfg.chunks + 6),
            block_size=cfg.block_size,
            device=_device(cfg),
            model=corpus.prefill_at,
        )
        for c, hs in corpus.placement().items():
            self.req.register(ChunkInfo(c, corpus.lengths[c], corpus.positions[c], hs))
        self.agents = _make_agents(cfg, corpus)
        self.indexer = Indexer(corpus, cfg.topk, cfg.seed) if cfg.selection_agents else None
        self.decisions: dict[tuple[str, int], dict] = {}
        self.errors: dict[str, list[float]] = defaultdict(list)
        self.fallbacks: list[dict] = []
        self.deltas: dict[int, int] = {}  # id(CostRecord) -> delta of the call
        self.batch_work: dict[int, int] = {}  # id(CostRecord) -> rows x tokens of its batch
        self.calls = 0

    # -- calibration -----------------------------------------------------------------------------
    def calibrate(self) -> dict:
        """This machine's constants: the transport (probe + route sweep, affine fit, §4.3) and
        one timed call of each primitive's own work (holder compute, merge, splice, prefill)."""
        import torch

        from mqnc import costmodel
        from mqnc.fabric import FabricProfile, load_fabric

        g, req, c0 = self.geometry, self.req, 0
        info = req.directory[c0]
        holder = info.holders[0]
        for _ in range(20):  # warm the link up first (gloo's first transfers run slow)
            req.probe(holder)
        probes = [req.probe(holder) for _ in range(9)]
        samples, computes = [], []
        dev = _device(self.cfg)
        req.route(c0, torch.randn(1, g.heads, g.d_qk, dtype=torch.bfloat16, device=dev), 0)
        for rows in (1, 4, 16):
            q = torch.randn(rows, g.heads, g.d_qk, dtype=torch.bfloat16, device=dev)
            for _ in range(2):
                part = req.route(c0, q, 0)
                rec = part.record
                computes.append((rows * g.heads * info.tokens, rec.compute_us))
                samples.append((rows * g.heads, rec.total_us - rec.compute_us))
        fit, fit_error = None, None
        if self.cfg.profile:
            fabric = load_fabric(self.cfg.profile)
        else:
            try:
                fit = costmodel.fit(samples, qp_row_bytes=g.qp_row_bytes, probe_us=probes)
                fabric = fit.to_fabric("this-machine (demo calibration)")
            except ValueError as exc:
                # Decode-sized rows (M_q <= 256) on a fast local link are all fixed cost: the
                # slope drowns in noise. Then BW comes from the bulk fetch below and the fixed
                # cost from the smallest route (less the probe).
                fit_error = str(exc)
                fabric = None
        # holder compute per routed row and attended token (the interpreter on a CPU is far
        # from the paper's 15-37 us, which is the point of measuring it here)
        compute_per_row_token = sum(c / n for n, c in computes) / len(computes)
        # one warm-up call each, then the timed call (first calls pay one-off set-up costs)
        for k in range(2):
            t0 = time.perf_counter()
            req.local(c0, offset=info.position + 1 + k)
            prefill_us = (time.perf_counter() - t0) * 1e6
        c_us = prefill_us / (info.tokens * g.layers)
        for k in range(4):
            lc = req.fetch(c0, offset=info.position + 3 + k)
        # the best of the three timed pulls (the first was the warm-up): a busy machine only
        # ever slows a transfer down
        fetch_rec = min(req.costs[-3:], key=lambda r: r.return_us)
        splice_per_token = fetch_rec.splice_us / info.tokens
        bulk_bw = fetch_rec.bytes_recv / (fetch_rec.return_us * 1e3)
        if fabric is None:
            probe = sorted(probes)[len(probes) // 2]
            fixed = min(t for m, t in samples if m == samples[0][0])
            fabric = FabricProfile(
                "this-machine (demo calibration, route BW from the bulk fetch)",
                t_probe_us=probe,
                bw_gbps=bulk_bw,
                turnaround_us=max(
                    fixed - probe - costmodel.bytes_to_us(samples[0][0] * g.qp_row_bytes, bulk_bw),
                    0.0,
                ),
                source="mqnc demo calibration",
            )
        if not self.cfg.profile:
            # fetch's pull is one bulk transfer (§2.2): price it with the measured pull
            fabric = dataclasses.replace(fabric, bulk_bw_gbps=bulk_bw)
        o = torch.randn(4, 1, g.heads, g.d_v, dtype=torch.bfloat16, device=dev)
        lse = torch.randn(4, 1, g.heads, device=dev)
        from mqnc.triton_kernels.merge import merge_partials

        merge_partials(o, lse)
        t0 = time.perf_counter()
        merge_partials(o, lse)
        merge_us = (time.perf_counter() - t0) * 1e6
        del lc
        # forget the calibration's cost records and pooled chunks (they are not the workload)
        req.costs.clear()
        req.local_chunks.clear()
        req._free = list(range(req.pool.shape[1]))
        self.cal = dict(
            fabric=dataclasses.asdict(fabric),
            fit=None if fit is None else fit.to_dict(),
            fit_error=fit_error,
            probe_samples_us=probes,
            compute_us_per_row_token=compute_per_row_token,
            merge_us=merge_us,
            splice_us_per_token=splice_per_token,
            c_us=c_us,
        )
        self.fabric = fabric
        return self.cal

    def _splice_profile(self):
        from mqnc.costmodel import SpliceProfile

        per_tok = self.cal["splice_us_per_token"]
        lo, hi = self.cfg.min_tokens, max(self.cfg.max_tokens, self.cfg.min_tokens + 1)
        return SpliceProfile((lo, hi), (per_tok * lo, per_tok * hi), "measured (demo calibration)")

    def predict(self, rec) -> dict[str, float]:
        """The model's terms for one recorded call, with this machine's constants."""
        from mqnc import costmodel

        g, f, cal = self.geometry, self.fabric, self.cal
        if rec.primitive == "route":
            work = self.batch_work.get(id(rec), rec.m_q * self.corpus.lengths[rec.chunk_id])
            compute = cal["compute_us_per_row_token"] * work
            r = costmodel.t_route(g, f, rec.m_q, t_compute_us=compute, t_merge_us=0.0)
            return dict(
                probe=r.probe + r.turnaround,
                transfer=r.transfer,
                compute=r.compute,
                return_=r.return_,
                total=r.total,
            )
        ct = self.corpus.lengths[rec.chunk_id]
        if rec.primitive == "fetch":
            pull = costmodel.t_pull(g, f, ct)
            delta = self.deltas.get(id(rec), 1)
            splice = costmodel.t_splice(ct, self._splice_profile()) if delta else 0.0
            return dict(transfer=pull, splice=splice, total=pull + splice)
        prefill = costmodel.t_local(g, ct, cal["c_us"])
        return dict(prefill=prefill, total=prefill)

    # -- decisions -------------------------------------------------------------------------------
    def decide(self, agent: Agent, chunk: int) -> str:
        """The predicate's choice for (chunk, agent): the agent's whole decode over the chunk
        is the request (``steps * L`` round trips of ``H`` rows for route; one pull + splice
        for fetch, one re-prefill for local). The attention compute is left out of the
        comparison: route pays it on the holder, fetch and local on the requester afterwards.
        Memoised; ``--force`` overrides."""
        key = (agent.name, chunk)
        if key in self.decisions:
            return self.decisions[key]["primitive"]
        from mqnc.costmodel import SpliceProfile
        from mqnc.predicate import decide

        g, cfg = self.geometry, self.cfg
        chunk_delta = agent.offsets[chunk] - self.corpus.positions[chunk]
        d = decide(
            g,
            self.fabric,
            g.heads,
            self.corpus.lengths[chunk],
            c_us=self.cal["c_us"],
            # the partial attention and the merge are paid by every primitive (route: attention
            # on the holder; fetch / local: on the requester afterwards; the agent merges its
            # partials either way): they do not enter the comparison
            t_compute_us=0.0,
            t_merge_us=0.0,
            # a selection agent attends at canonical positions: its fetch pulls the chunks that
            # hold the selected entries and splices nothing
            splice=self._splice_profile() if chunk_delta else SpliceProfile.none(),
            round_trips=cfg.steps * g.layers,
        )
        chosen = cfg.force or d.primitive
        self.decisions[key] = dict(
            agent=agent.name,
            chunk=chunk,
            primitive=chosen,
            predicate=d.primitive,
            costs_us=d.costs,
            margin_ratio=d.margin_ratio,
        )
        return chosen

    # -- one layer of one step for all agents ----------------------------------------------------
    def _order(self, primitive: str) -> tuple[str, ...]:
        rest = [p for p in ("route", "fetch", "local") if p != primitive]
        return (primitive, *rest)

    def _attend(self, agent, chunk, q, layer, indices=None):
        """One partial of ``agent`` over ``chunk`` by its decided primitive, with fallback."""
        from mqnc.requester import AllPrimitivesFailed

        primitive = self.decide(agent, chunk)
        off = agent.offsets[chunk]
        n_before = len(self.req.costs)
        try:
            part = self.req.attend(
                chunk, q, layer, offset=off, indices=indices, order=self._order(primitive)
            )
        except AllPrimitivesFailed:
            raise
        self._note_records(
            n_before, [(agent, chunk, q, layer, indices)] * (len(self.req.costs) - n_before)
        )
        first = self.req.directory[chunk].holders[0]
        if part.primitive != primitive or part.peer not in (None, first):
            # another primitive, or the same one from a replica, answered
            self.fallbacks.append(
                dict(
                    agent=agent.name,
                    chunk=chunk,
                    layer=layer,
                    decided=primitive,
                    used=part.primitive,
                    holder=first,
                    peer=part.peer,
                )
            )
        self.calls += 1
        return part

    def _reference(self, q, keys_by_chunk, suffix):
        """fp64 attention of ``q [1, H, d_qk]`` over each key set and over their union."""
        import torch

        from mqnc.reference import partial_attention_reference

        scale, d_v = self.model.softmax_scale, self.geometry.d_v
        parts = {}
        for c, kv in keys_by_chunk.items():
            valid = torch.ones(1, kv.shape[0], dtype=torch.bool)
            parts[c] = partial_attention_reference(q, kv, valid, scale, d_v)
        allk = torch.cat([*keys_by_chunk.values(), suffix])
        whole = partial_attention_reference(
            q, allk, torch.ones(1, allk.shape[0], dtype=torch.bool), scale, d_v
        )
        return parts, whole

    def _agent_keys(self, agent, chunk, layer, indices=None):
        """The canonical cache of ``chunk`` in ``agent``'s frame, fp64 (exact rotation)."""
        from mqnc.reference.rope import rope_rotate_reference

        kv = self.corpus.kv(chunk)[layer].double()
        delta = agent.offsets[chunk] - self.corpus.positions[chunk]
        if delta:
            kv = rope_rotate_reference(kv, delta, self.model.rope)
        if indices is not None:
            kv = kv[indices]
        return kv

    @staticmethod
    def _check(op: str, actual, expected, name: str):
        """``assert_close`` with the demo's bound scaled by the reference's largest |o|."""
        from mqnc.testing import assert_close, tolerance

        tol = tolerance(op, "bfloat16")
        scale = max(float(expected.abs().max()), 2**-4)
        return assert_close(
            actual, expected, atol=tol.atol * scale, rms_rtol=tol.rms_rtol, name=name
        )

    def _selection(self, agent: Agent, layer: int, q) -> dict:
        """Chunk -> ``indices [1, topk]`` int32 (chunk-local, -1 padded) or None (whole chunk)."""
        import torch

        if agent.kind != "selection":
            return {c: None for c in agent.chunks}
        out = {}
        for c, idx in self.indexer.select(layer, q).items():
            ind = torch.full((1, self.cfg.topk), -1, dtype=torch.int32)
            ind[0, : len(idx)] = torch.tensor(idx, dtype=torch.int32)
            out[c] = ind.to(_device(self.cfg))
        return out

    def _routed_wave(self, jobs: list[tuple]) -> dict[tuple, object]:
        """Route many (agent, chunk) jobs of one layer at once, so that each holder sees the
        rows of several requesters waiting together and batches them into one kernel call
        (dispatcher batching, §6.3). At most ``LANES`` requests per holder are in flight; a
        wave with a failure is redone job by job through the fallback order."""
        out: dict[tuple, object] = {}
        by_holder: dict[int, list] = defaultdict(list)
        for job in jobs:
            by_holder[self.req.directory[job[1]].holders[0]].append(job)
        while any(by_holder.values()):
            wave = []
            for h in list(by_holder):
                wave += by_holder[h][:LANES]
                by_holder[h] = by_holder[h][LANES:]
            n_before = len(self.req.costs)
            try:
                parts = self.req.route_many(
                    [
                        dict(
                            chunk_id=c,
                            q=q,
                            layer=layer,
                            indices=ind,
                            offset=None if ind is not None else agent.offsets[c],
                        )
                        for agent, c, q, layer, ind in wave
                    ],
                    merge=False,
                )
            except Exception:  # noqa: BLE001 - each job retried through the fallback order
                for agent, c, q, layer, ind in wave:
                    out[(agent.name, c)] = self._attend(agent, c, q, layer, ind)
                continue
            for (agent, c, *_), part in zip(wave, parts, strict=True):
                out[(agent.name, c)] = part
                self.calls += 1
            self._note_records(n_before, wave)
        return out

    def _note_records(self, n_before: int, wave) -> None:
        """Remember, per new cost record, its delta and the work of the holder batch it was
        answered in: rows x attended tokens summed over the wave's requests to that holder
        (the holder runs them as one batch, and each request waits for all of it, §6.3)."""
        recs = self.req.costs[n_before:]
        batch: dict[int | None, int] = defaultdict(int)
        work = []
        for rec, (agent, c, _q, _layer, ind) in zip(recs, wave, strict=False):
            self.deltas[id(rec)] = agent.offsets[c] - self.corpus.positions[c]
            tokens = self.corpus.lengths[c] if ind is None else int((ind >= 0).sum())
            work.append((rec, rec.m_q * tokens))
            batch[rec.peer] += rec.m_q * tokens
        for rec, _ in work:
            self.batch_work[id(rec)] = batch[rec.peer]

    def layer(self, layer: int, states: dict[str, tuple]) -> None:
        """One layer of one decode step for every agent: decide, execute (routes batched across
        agents), merge each agent's partials with its suffix, verify, advance its hidden state.

        ``states[agent.name] = (h [1, D], pos)``, updated in place.
        """
        import torch

        from mqnc.testing import assert_close, tolerance
        from mqnc.triton_kernels.merge import merge_partials
        from mqnc.triton_kernels.mla_decode import mla_decode_partial

        g, dev = self.geometry, _device(self.cfg)
        queries, sels, routed, direct = {}, {}, [], []
        for agent in self.agents:
            h, pos = states[agent.name]
            # the model runs on the CPU; its query row goes to the kernels' device
            q_cpu = self.model.absorbed_query(layer, h, torch.tensor([pos])).to(torch.bfloat16)
            q = q_cpu.to(dev)
            queries[agent.name] = q
            sels[agent.name] = self._selection(agent, layer, q_cpu)
            for c, ind in sels[agent.name].items():
                job = (agent, c, q, layer, ind)
                local = (c, agent.offsets[c]) in self.req.local_chunks
                (routed if self.decide(agent, c) == "route" and not local else direct).append(job)
        parts = self._routed_wave(routed)
        for agent, c, q, layer_, ind in direct:
            parts[(agent.name, c)] = self._attend(agent, c, q, layer_, ind)
        for agent in self.agents:
            h, pos = states[agent.name]
            q = queries[agent.name]
            used = list(sels[agent.name])
            partials = [parts[(agent.name, c)] for c in used]
            keys = {
                c: self._agent_keys(
                    agent, c, layer, None if ind is None else ind[0][ind[0] >= 0].long().cpu()
                )
                for c, ind in sels[agent.name].items()
            }
            # the agent's own suffix (its prompt and the tokens it decoded), attended locally
            suffix = agent.suffix_kv[layer]
            n, bs = suffix.shape[0], self.cfg.block_size
            nb = -(-n // bs)
            pool = torch.zeros(nb, bs, g.d_qk, dtype=torch.bfloat16, device=dev)
            pool.view(-1, g.d_qk)[:n] = suffix.to(dev)
            o_s, lse_s = mla_decode_partial(
                q,
                pool,
                torch.arange(nb, dtype=torch.int32, device=dev)[None],
                torch.tensor([n], dtype=torch.int32, device=dev),
                softmax_scale=self.model.softmax_scale,
                d_v=g.d_v,
            )
            o, lse = merge_partials(
                torch.stack([*(p.o for p in partials), o_s]),
                torch.stack([*(p.lse for p in partials), lse_s]),
            )
            ref_parts, (o_ref, lse_ref) = self._reference(q.cpu(), keys, suffix.double())
            for c, part in zip(used, partials, strict=True):
                where = f"{agent.name} chunk {c} layer {layer} ({part.primitive})"
                s = self._check("demo_partial", part.o, ref_parts[c][0], f"{where} o")
                assert_close(
                    part.lse, ref_parts[c][1], tolerance("demo_lse", "float32"), name=f"{where} lse"
                )
                self.errors[part.primitive].append(s.max_abs)
            s = self._check("demo_merged", o, o_ref, f"{agent.name} layer {layer} merged o")
            assert_close(lse, lse_ref, tolerance("demo_lse", "float32"), name="merged lse")
            self.errors["merged"].append(s.max_abs)
            states[agent.name] = (h + self.model.attention_output(layer, o.float().cpu()), pos)

    def run(self, progress=None) -> None:
        """Every agent decodes ``steps`` tokens through all layers, layer by layer in lockstep
        (so that the holders see the agents' rows together)."""
        import torch

        g, cfg = self.geometry, self.cfg
        gen = torch.Generator().manual_seed(cfg.seed + 99)
        for agent in self.agents:  # each agent's suffix: its own prompt, prefilled on its own
            x = torch.randn(cfg.suffix_tokens, self.model.hidden, generator=gen)
            agent.suffix_kv = self.model.prefill(x, agent.start, dtype=torch.float32).to(
                torch.bfloat16
            )
            agent.hidden = torch.randn(1, self.model.hidden, generator=gen)
        for step in range(cfg.steps):
            if self.kill is not None and step == cfg.kill_after_step:
                self.kill()
            states = {a.name: (a.hidden, a.start + a.suffix_kv.shape[1]) for a in self.agents}
            new_kv = defaultdict(list)
            for layer in range(g.layers):
                for agent in self.agents:
                    h, pos = states[agent.name]
                    new_kv[agent.name].append(
                        self.model.cache_entries(layer, h, torch.tensor([pos]))
                    )
                self.layer(layer, states)
                if progress is not None:
                    progress.update(len(self.agents))
            for agent in self.agents:
                kv = torch.stack(new_kv[agent.name]).to(torch.bfloat16)
                agent.suffix_kv = torch.cat([agent.suffix_kv, kv], dim=1)
                agent.hidden = (
                    torch.randn(1, self.model.hidden, generator=gen) + 0.1 * (states[agent.name][0])
                )

    # -- report ----------------------------------------------------------------------------------
    def report(self) -> dict:
        from mqnc.costmodel import mape

        rows = {}
        for prim in ("route", "fetch", "local"):
            recs = [r for r in self.req.costs if r.primitive == prim and r.ok]
            if not recs:
                continue
            preds = [self.predict(r) for r in recs]
            measured = dict(
                transfer=sum(r.transfer_us for r in recs),
                compute=sum(r.compute_us for r in recs),
                return_=sum(r.return_us for r in recs),
                merge=sum(r.merge_us for r in recs),
                splice=sum(r.splice_us for r in recs),
                prefill=sum(r.prefill_us for r in recs),
                total=sum(r.total_us for r in recs),
            )
            if prim == "fetch":
                measured["transfer"] = sum(r.return_us for r in recs)
                measured["return_"] = 0.0
            predicted = defaultdict(float)
            for p in preds:
                for k, v in p.items():
                    predicted[k] += v
            rows[prim] = dict(
                count=len(recs),
                wire_bytes=sum(r.bytes_sent + r.bytes_recv for r in recs),
                measured_us=measured,
                predicted_us=dict(predicted),
                mape=mape([p["total"] for p in preds], [r.total_us for r in recs]),
                per_call=[
                    dict(measured=r.total_us, predicted=p["total"], m_q=r.m_q, chunk=r.chunk_id)
                    for r, p in zip(recs, preds, strict=True)
                ],
                max_abs_error=max(self.errors.get(prim, [0.0])),
            )
        return rows


def _print_table(rows: dict, errors: dict, decisions: dict, fallbacks: list, cal: dict) -> None:
    terms = ("probe", "transfer", "compute", "return_", "merge", "splice", "prefill")
    f = cal["fabric"]
    print(
        f"\ncalibrated fabric: T_probe {f['t_probe_us']:.1f} us, BW {f['bw_gbps']:.3f} GB/s, "
        f"turnaround {f['turnaround_us']:.1f} us; holder compute "
        f"{cal['compute_us_per_row_token']:.2f} us/(row x token), merge {cal['merge_us']:.0f} us, "
        f"splice {cal['splice_us_per_token']:.1f} us/token, "
        f"prefill c = {cal['c_us']:.1f} us/token-layer"
    )
    chosen = defaultdict(int)
    for d in decisions.values():
        chosen[d["primitive"]] += 1
    print(
        "decisions per (chunk, agent): " + ", ".join(f"{k} {v}" for k, v in sorted(chosen.items()))
    )
    if fallbacks:
        print(f"fallbacks: {len(fallbacks)} (a primitive failed; the next in order answered)")
    head = f"{'primitive':<9} {'calls':>5} {'wire MB':>8}  " + "  ".join(
        f"{t.rstrip('_'):>15}" for t in terms
    )
    print("\n" + head + f"  {'total ms':>17} {'MAPE':>6} {'max|err|':>9}")
    print("-" * len(head) + "-" * 36)
    for prim, r in rows.items():
        cells = []
        for t in terms:
            m = r["measured_us"].get(t)
            p = r["predicted_us"].get(t)
            ms = "-" if m is None else f"{m / 1e3:.1f}"
            ps = "-" if p is None else f"{p / 1e3:.1f}"
            cells.append(f"{ms:>7}/{ps:>7}")
        tot = f"{r['measured_us']['total'] / 1e3:8.1f}/{r['predicted_us']['total'] / 1e3:8.1f}"
        print(
            f"{prim:<9} {r['count']:>5} {r['wire_bytes'] / 1e6:8.2f}  "
            + "  ".join(cells)
            + f"  {tot} {r['mape'] * 100:5.0f}% {r['max_abs_error']:9.2e}"
        )
    print("(each cell: measured / predicted, milliseconds summed over the calls)")
    merged = max(errors.get("merged", [0.0]))
    print(
        f"merged answers: {len(errors.get('merged', []))} checked against the fp64 reference, "
        f"max |err| {merged:.2e}"
    )


def _plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    colors = {"route": "tab:green", "fetch": "tab:red", "local": "tab:purple"}
    lo, hi = math.inf, 0.0
    for prim, r in rows.items():
        xs = [c["predicted"] for c in r["per_call"]]
        ys = [c["measured"] for c in r["per_call"]]
        ax.scatter(
            xs,
            ys,
            s=14,
            alpha=0.7,
            color=colors[prim],
            label=f"{prim} (n={r['count']}, MAPE {r['mape'] * 100:.0f}%)",
        )
        lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="measured = predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted per call (us)")
    ax.set_ylabel("measured per call (us)")
    ax.set_title("mqnc demo: measured vs the cost model")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- entry point ---------------------------------------------------------------------------------


def run_demo(cfg: DemoConfig) -> dict:
    """Run the demo; returns the JSON-able result (also written under ``cfg.out``).

    Raises ``AssertionError`` when an answer is beyond its bound (the CLI exits 1).
    """
    from mqnc.runtime import device_name, kernel_mode, use_interpreter_without_cuda

    use_interpreter_without_cuda()
    import torch

    if cfg.transport == "nvshmem" and _device(cfg) != "cuda":
        raise ValueError(
            "transport: 'nvshmem' needs a CUDA device (and nvshmem4py: pip install 'mqnc[gpu]'); "
            f"this machine has device {_device(cfg)!r}: use 'gloo' or 'loopback'"
        )
    t_start = time.perf_counter()
    model = _build_model(cfg)
    corpus = Corpus(cfg, model)
    world = cfg.holders + 1
    procs, holders, fabric = [], [], None
    if cfg.transport == "loopback":
        from mqnc.transport import LoopbackFabric

        fabric = LoopbackFabric(world, _slot_bytes(cfg, model.geometry), lanes=LANES)
        for r in range(1, world):
            holders.append(_make_holder(cfg, fabric.endpoint(r), model, corpus).start())
        transport = fabric.endpoint(REQUESTER)

        def kill():
            holders[cfg.kill_holder - 1].stop()
            fabric.kill(cfg.kill_holder)
    else:
        import multiprocessing as mp

        from mqnc.transport.torchdist import free_port_store

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = free_port_store(world)
        ctx = mp.get_context("spawn")
        for r in range(1, world):
            p = ctx.Process(
                target=_holder_process, args=(r, world, store.port, dataclasses.asdict(cfg))
            )
            p.start()
            procs.append(p)
        transport = _process_transport(cfg, REQUESTER, world, store, model.geometry)
        # one intra-op thread: on 2 cores, torch's OpenMP workers spin after each op and starve
        # gloo's receive threads (seen: a 1.4 ms round trip became 3.9 ms)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        for r in range(1, world):
            store.wait([f"ready/{r}"], torch.distributed.constants.default_pg_timeout)

        def kill():
            procs[cfg.kill_holder - 1].kill()
            procs[cfg.kill_holder - 1].join()

    run = _Run(cfg, transport, model, corpus, kill if cfg.kill_holder is not None else None)
    try:
        cal = run.calibrate()
        total = cfg.steps * model.geometry.layers * len(run.agents)
        progress = None
        if cfg.progress:
            from tqdm import tqdm

            progress = tqdm(total=total, desc="decode (agent x layer x step)", file=sys.stderr)
        try:
            run.run(progress)
        finally:
            if progress is not None:
                progress.close()
        rows = run.report()
    finally:
        for r in range(1, world):
            if r == cfg.kill_holder:
                continue
            try:
                run.req.shutdown(r)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        for h in holders:
            h.stop()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        transport.close()
        if procs:
            torch.set_num_threads(threads)
    result = dict(
        config=dataclasses.asdict(cfg),
        device=device_name(),
        kernels=kernel_mode(),
        calibration=cal,
        decisions=list(run.decisions.values()),
        fallbacks=run.fallbacks,
        primitives=rows,
        max_abs_error={k: max(v) for k, v in run.errors.items()},
        checked={k: len(v) for k, v in run.errors.items()},
        # each agent's last hidden state: the --force runs of one config must agree on it
        final_hidden={a.name: a.hidden.flatten().tolist() for a in run.agents},
        wall_s=time.perf_counter() - t_start,
    )
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "demo.json", "w") as f:
        json.dump(result, f, indent=2, default=float)
    _plot(rows, out / "measured_vs_predicted.png")
    _print_table(rows, run.errors, run.decisions, run.fallbacks, cal)
    print(
        f"\nwrote {out / 'demo.json'} and {out / 'measured_vs_predicted.png'} "
        f"({result['wall_s']:.0f} s, {device_name()}, kernels {kernel_mode()})"
    )
    return result


def _run(args) -> int:
    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    cfg = DemoConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    try:
        run_demo(cfg)
    except AssertionError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    d = DemoConfig()
    p = subparsers.add_parser(
        "demo", help="agentic fan-in over a partitioned corpus: decide, execute, verify, report"
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=d.transport,
        help="holder processes over gloo (default), threads over loopback, or NVSHMEM PEs (GPU)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where pools and kernels live (default: cuda when available)",
    )
    p.add_argument(
        "--force",
        choices=("route", "fetch", "local"),
        default=None,
        help="run every (chunk, agent) through one primitive",
    )
    p.add_argument("--profile", default=None, help="fabric profile JSON (else calibrate at start)")
    p.add_argument("--out", default=d.out, help="folder for demo.json and the PNG")
    for name in (
        "layers",
        "chunks",
        "min_tokens",
        "max_tokens",
        "holders",
        "replicas",
        "whole_agents",
        "selection_agents",
        "chunks_per_agent",
        "topk",
        "steps",
        "seed",
    ):
        p.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=int,
            default=None,
            help=f"default {getattr(d, name)}",
        )
    p.add_argument(
        "--kill-holder",
        dest="kill_holder",
        type=int,
        default=None,
        help="kill this holder rank before --kill-after-step (fault drill)",
    )
    p.add_argument("--kill-after-step", dest="kill_after_step", type=int, default=None)
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    p.set_defaults(func=_run)
