"""One decode step of the demo, layer by layer for all agents in lockstep (§5, §6.3): decide
route / fetch / local per (chunk, agent), execute (routed rows of all agents batched), merge
each agent's partials with its own suffix, verify, advance its hidden state."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from mqnc.demo.calibration import Calibration
from mqnc.demo.config import LANES, DemoConfig
from mqnc.demo.teams import decide_read
from mqnc.demo.verify import Verifier
from mqnc.demo.waves import WaveCall
from mqnc.demo.workload import Agent, Corpus, Indexer
from mqnc.model import MLAModel
from mqnc.serving import CostRecord, Partial, Requester
from mqnc.serving.compute import kernel_ops

__all__ = ["Decisions", "Decoder"]

PRIMITIVES = ("route", "fetch", "local")
OTHER = {"route": "fetch", "fetch": "route", "local": "route"}
"""The primitive the comparison decode (``compare``) runs instead of the predicate's choice."""


class Decisions:
    """The predicate's choice per (agent, chunk), memoised, with its inputs and costs; with
    ``first`` (the run's own decisions), :data:`OTHER` of its choice (the comparison decode).

    ``readers``: ``(chunk, offset)`` -> the agents reading the chunk there
    (:func:`mqnc.demo.workload.readers`); they share one decision (one fetched or re-prefilled
    copy, or a route per reader: :func:`mqnc.demo.teams.decide_read`)."""

    def __init__(
        self,
        cfg: DemoConfig,
        model: MLAModel,
        corpus: Corpus,
        cal: Calibration,
        readers: dict[tuple[int, int], tuple[str, ...]],
        first: Decisions | None = None,
    ):
        self.cfg, self.geometry, self.corpus, self.cal = cfg, model.geometry, corpus, cal
        self.model, self.first, self.readers = model, first, readers
        self.profile = cal.machine_profile(cfg)
        self.table: dict[tuple[str, int], dict] = {}
        self._shared: dict[tuple[int, int], dict] = {}  # (chunk, offset) -> its decision

    def other(self) -> Decisions:
        """The decisions of the comparison decode: each (chunk, agent) through the other
        primitive."""
        return Decisions(self.cfg, self.model, self.corpus, self.cal, self.readers, first=self)

    def __call__(self, agent: Agent, chunk: int) -> str:
        """The choice for (chunk, agent): the whole decode of every agent reading the chunk at
        this agent's offset is the request (:func:`mqnc.demo.teams.read_request`: route
        ``readers x steps x L`` round trips of ``H`` rows, each with the holder's side of the
        call, :func:`mqnc.demo.teams.holder_overhead`; fetch one pull + splice, local one
        re-prefill, shared). The requester's attention and merge are left out of the
        comparison (every path pays them). ``--force`` overrides."""
        key = (agent.name, chunk)
        if key not in self.table and self.first is None:
            self.table[key] = {"agent": agent.name, **self._decide(agent, chunk)}
        elif key not in self.table:
            self.first(agent, chunk)
            chosen = self.first.table[key]
            self.table[key] = dict(chosen, primitive=OTHER[chosen["primitive"]])
        return self.table[key]["primitive"]

    def _decide(self, agent: Agent, chunk: int) -> dict:
        offset = agent.offsets[chunk]
        if (chunk, offset) in self._shared:
            return self._shared[(chunk, offset)]
        g, cfg = self.geometry, self.cfg
        who = self.readers.get((chunk, offset), (agent.name,))
        # a selection agent attends at canonical positions: its fetch pulls the chunks that
        # hold the selected entries and only writes them into its pool (no rotation)
        moved = agent.delta(self.corpus, chunk) != 0
        tokens = self.corpus.lengths[chunk]
        # a selection's route call attends its index row (topk wide), a whole chunk's the chunk
        width = cfg.topk if agent.kind == "selection" else None
        d = decide_read(
            g, self.profile, tokens, moved=moved, readers=len(who), steps=cfg.steps, width=width
        )
        self._shared[(chunk, offset)] = out = dict(
            chunk=chunk,
            offset=offset,
            tokens=tokens,
            moved=moved,
            readers=list(who),
            round_trips=d.inputs["round_trips"],
            primitive=cfg.force or d.primitive,
            predicate=d.primitive,
            costs_us=d.costs,
            runner_up=d.runner_up,
            margin_us=d.margin_us,
            margin_ratio=d.margin_ratio,
            # the explain() table's content: every term of every path, inputs, wire bytes
            explain=d.to_dict(),
        )
        return out


class Decoder:
    """Runs the agents' decode against the holders, through one requester.

    ``kill``, when given, is called once before step ``cfg.kill_after_step`` (the fault drill;
    :attr:`killed` says which holder, before which step, when). The requester's own work (the
    suffix partial, the merge) runs on ``cfg.kernels``. Keeps, per cost record (keyed by
    ``id(record)``), the delta of its call (:attr:`deltas`) and, for a route, the wave it went
    out in and its place there (:attr:`waves`: the wave's
    :class:`~mqnc.demo.waves.WaveCall` list in send order, and the index), the fallbacks taken,
    and the number of partials computed.
    """

    def __init__(
        self,
        cfg: DemoConfig,
        model: MLAModel,
        corpus: Corpus,
        req: Requester,
        agents: list[Agent],
        decisions: Decisions,
        verifier: Verifier,
        kill=None,
    ) -> None:
        self.cfg, self.model, self.corpus, self.req = cfg, model, corpus, req
        self.agents, self.decisions, self.verifier = agents, decisions, verifier
        self.device = cfg.device
        self.kill = kill  # called once before step cfg.kill_after_step (the fault drill)
        self.killed: dict | None = None
        self.ops = kernel_ops(cfg.kernels)
        self.step = 0
        self.indexer = Indexer(corpus, cfg.topk, cfg.seed) if cfg.selection_agents else None
        self.fallbacks: list[dict] = []
        self.deltas: dict[int, int] = {}
        self.waves: dict[int, tuple[list[WaveCall], int]] = {}
        self.calls = 0
        self.decode_s = 0.0

    # -- executing one (agent, chunk) ------------------------------------------------------------
    def _attend(self, agent: Agent, chunk: int, q, layer: int, indices=None) -> Partial:
        """One partial of ``agent`` over ``chunk`` by its decided primitive, with fallback."""
        primitive = self.decisions(agent, chunk)
        order = (primitive, *(p for p in PRIMITIVES if p != primitive))
        n_before = len(self.req.costs)
        part = self.req.attend(
            chunk, q, layer, offset=agent.offsets[chunk], indices=indices, order=order
        )
        for k in range(n_before, len(self.req.costs)):  # each call its own wave
            self._note_records(k, [(agent, chunk, q, layer, indices)])
        first = self.req.directory[chunk].holders[0]
        if part.primitive != primitive or part.peer not in (None, first):
            # another primitive, or the same one from a replica, answered
            self.fallbacks.append(
                dict(
                    agent=agent.name,
                    chunk=chunk,
                    step=self.step,
                    layer=layer,
                    decided=primitive,
                    used=part.primitive,
                    holder=first,
                    peer=part.peer,
                )
            )
        self.calls += 1
        return part

    def _routed_wave(self, jobs: list[tuple]) -> dict[tuple, Partial]:
        """Route many (agent, chunk) jobs of one layer at once, so that each holder sees the
        rows of several requesters waiting together and batches them into one kernel call
        (dispatcher batching, §6.3). At most ``LANES`` requests per holder are in flight; a
        wave with a failure is redone job by job through the fallback order."""
        out: dict[tuple, Partial] = {}
        by_holder: dict[int, list] = defaultdict(list)
        for job in jobs:
            by_holder[self.req.directory[job[1]].holders[0]].append(job)
        while any(by_holder.values()):
            wave = []
            for h in list(by_holder):
                wave += by_holder[h][:LANES]
                by_holder[h] = by_holder[h][LANES:]
            requests = [
                dict(
                    chunk_id=c,
                    q=q,
                    layer=layer,
                    indices=ind,
                    offset=None if ind is not None else agent.offsets[c],
                )
                for agent, c, q, layer, ind in wave
            ]
            n_before = len(self.req.costs)
            try:
                parts = self.req.route_many(requests, merge=False)
            except Exception:  # noqa: BLE001 - each job retried through the fallback order
                for agent, c, q, layer, ind in wave:
                    out[(agent.name, c)] = self._attend(agent, c, q, layer, ind)
                continue
            for (agent, c, *_), part in zip(wave, parts, strict=True):
                out[(agent.name, c)] = part
                self.calls += 1
            self._note_records(n_before, wave)
        return out

    def _note_records(self, n_before: int, jobs) -> None:
        """Remember, per new cost record (one per job, in order), its delta and, for a route,
        its wave: the routes among them, in send order (a wave of one for a call on its
        own)."""
        recs: list[CostRecord] = self.req.costs[n_before:]
        routes = []
        for rec, (agent, c, _q, _layer, ind) in zip(recs, jobs, strict=False):
            self.deltas[id(rec)] = agent.delta(self.corpus, c)
            if rec.primitive == "route" and rec.ok:
                # a selection is computed over its whole index row, -1 padding included (the
                # holder pads a group to its widest row): its width is the work, not its count
                tokens = self.corpus.lengths[c] if ind is None else ind.shape[-1]
                call = WaveCall(rec.peer, rec.m_q, rec.m_q * tokens, ind is not None)
                routes.append((rec, call))
        wave = [call for _, call in routes]
        for i, (rec, _) in enumerate(routes):
            self.waves[id(rec)] = (wave, i)

    # -- one layer of one step for all agents ----------------------------------------------------
    def _selection(self, agent: Agent, layer: int, q) -> dict:
        """Chunk -> ``indices [1, topk]`` int32 (chunk-local, -1 padded) or None (whole chunk)."""
        if agent.kind != "selection":
            return {c: None for c in agent.chunks}
        out = {}
        for c, idx in self.indexer.select(layer, q).items():
            ind = torch.full((1, self.cfg.topk), -1, dtype=torch.int32)
            ind[0, : len(idx)] = torch.tensor(idx, dtype=torch.int32)
            out[c] = ind.to(self.device)
        return out

    def _suffix_partial(self, q, suffix: torch.Tensor):
        """The agent's own suffix (its prompt and the tokens it decoded), attended locally
        from a pool of its own."""
        d_qk, bs, dev = self.model.geometry.d_qk, self.cfg.block_size, self.device
        n = suffix.shape[0]
        nb = -(-n // bs)
        pool = torch.zeros(nb, bs, d_qk, dtype=torch.bfloat16, device=dev)
        pool.view(-1, d_qk)[:n] = suffix.to(dev)
        return self.ops.mla_decode_partial(
            q,
            pool,
            torch.arange(nb, dtype=torch.int32, device=dev)[None],
            torch.tensor([n], dtype=torch.int32, device=dev),
            softmax_scale=self.model.softmax_scale,
            d_v=self.model.geometry.d_v,
        )

    def layer(self, layer: int, states: dict[str, tuple]) -> None:
        """One layer of one decode step for every agent: decide, execute (routes batched across
        agents), merge each agent's partials with its suffix, verify, advance its hidden state.

        ``states[agent.name] = (h [1, D], pos)``, updated in place.
        """
        queries, sels, routed, direct = {}, {}, [], []
        for agent in self.agents:
            h, pos = states[agent.name]
            # the model runs on the CPU; its query row goes to the kernels' device
            q_cpu = self.model.absorbed_query(layer, h, torch.tensor([pos])).to(torch.bfloat16)
            queries[agent.name] = q_cpu.to(self.device)
            sels[agent.name] = self._selection(agent, layer, q_cpu)
            for c, ind in sels[agent.name].items():
                job = (agent, c, queries[agent.name], layer, ind)
                local = (c, agent.offsets[c]) in self.req.local_chunks
                (routed if self.decisions(agent, c) == "route" and not local else direct).append(
                    job
                )
        parts = self._routed_wave(routed)
        for agent, c, q, layer_, ind in direct:
            parts[(agent.name, c)] = self._attend(agent, c, q, layer_, ind)
        for agent in self.agents:
            h, pos = states[agent.name]
            q = queries[agent.name]
            partials = [parts[(agent.name, c)] for c in sels[agent.name]]
            suffix = agent.suffix_kv[layer]
            o_s, lse_s = self._suffix_partial(q, suffix)
            o, lse = self.ops.merge_partials(
                torch.stack([*(p.o for p in partials), o_s]),
                torch.stack([*(p.lse for p in partials), lse_s]),
                layout="MBHD",
            )
            self.verifier.check_agent(agent, layer, q, sels[agent.name], partials, suffix, (o, lse))
            states[agent.name] = (h + self.model.attention_output(layer, o.float().cpu()), pos)

    # -- the decode ------------------------------------------------------------------------------
    def run(self, progress=None) -> None:
        """Every agent decodes ``steps`` tokens through all layers, layer by layer in lockstep
        (so that the holders see the agents' rows together); ``kill`` (the fault drill) runs
        before step ``cfg.kill_after_step``."""
        gen = torch.Generator().manual_seed(self.cfg.seed + 99)
        for agent in self.agents:  # each agent's suffix: its own prompt, prefilled on its own
            x = torch.randn(self.cfg.suffix_tokens, self.model.hidden, generator=gen)
            kv = self.model.prefill(x, agent.start, dtype=torch.float32)
            agent.suffix_kv = kv.to(torch.bfloat16)
            agent.hidden = torch.randn(1, self.model.hidden, generator=gen)
        t0 = time.perf_counter()
        for step in range(self.cfg.steps):
            self.step = step
            if self.kill is not None and step == self.cfg.kill_after_step:
                self.kill()
                self.killed = dict(
                    holder=self.cfg.kill_holder,
                    before_step=step,
                    decode_s=time.perf_counter() - t0,
                )
            self._step(gen, progress)
        self.decode_s = time.perf_counter() - t0

    def _step(self, gen: torch.Generator, progress) -> None:
        states = {a.name: (a.hidden, a.start + a.suffix_kv.shape[1]) for a in self.agents}
        new_kv = defaultdict(list)
        for layer in range(self.model.geometry.layers):
            for agent in self.agents:
                h, pos = states[agent.name]
                new_kv[agent.name].append(self.model.cache_entries(layer, h, torch.tensor([pos])))
            self.layer(layer, states)
            if progress is not None:
                progress.update(len(self.agents))
        for agent in self.agents:
            kv = torch.stack(new_kv[agent.name]).to(torch.bfloat16)
            agent.suffix_kv = torch.cat([agent.suffix_kv, kv], dim=1)
            agent.hidden = (
                torch.randn(1, self.model.hidden, generator=gen) + 0.1 * (states[agent.name][0])
            )
