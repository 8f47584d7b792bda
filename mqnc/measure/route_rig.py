"""The device route and the device fetch, measured the same way (§4.3's protocol, §6.3): each a
requester's step over ``L`` layers captured in a CUDA graph and replayed between CUDA events
(a GPU), or run eagerly and interpreted (a CPU: shapes, never a speed).

- **Route** (:meth:`RouteRig.route_step`): per layer, each requester's put
  (``route.put``) and one wait-then-merge (``route.wait_merge``) of its reply from the device
  holder (``mqnc.serving.device_holder``: the pass or the resident kernels, started once).
- **Fetch** (:meth:`RouteRig.fetch_step`): the chunk's entries of all ``L`` layers pulled from
  the holder's pool into a staging chunk (the pull: one gather of its blocks), then spliced to
  a new offset into the requester's own pool (``rope_splice``: one launch for all layers).
- **Holder compute** (:meth:`RouteRig.attend_step`): the pass's dense attention alone (the
  holder's compute inside a route), and the default kernel at the unfolded shape
  (:meth:`RouteRig.default_step`: ``mla_decode_partial`` over ``B`` tokens of ``H`` heads).

:func:`time_step` returns p20 / p50 / p80 microseconds per unit of work (a round trip, a
layer's fetch), the units done and the host calls made (graph replays; eager launches on a
CPU). ``perf/bench_device_route.py`` records them; ``mqnc demo --device-route`` decides from
them (``mqnc.cost.device_profile``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mqnc.model import PRESETS, RopeSpec
from mqnc.reference import partial_attention_reference
from mqnc.serving.device_holder import DeviceHolder
from mqnc.testing import TOLERANCES, assert_close
from mqnc.transport.device_route import LocalBackend, RouteClient, RouteLayout, allocate

__all__ = ["RouteRig", "time_step", "percentiles"]

CHUNK = 0


class RouteRig:
    """A device holder hosting ``chunks`` (each ``[L, c_t, d_qk]`` bf16, canonical positions
    from ``positions``), a client on ``slots`` slots of ``max_batch`` tokens, and a
    requester pool the fetch splices every chunk into (each to its own blocks, ``delta``
    positions on). :meth:`random` makes the bench's: one chunk drawn from a fixed seed.

    ``schedule``, ``num_splits`` and ``pass_rows``: the holder's (``DeviceHolder``);
    ``serve_sparse`` False (no resident sparse kernel holds SMs). On a GPU the holder is
    started (persistent); on a CPU (``dry``) it serves one-shot between the puts and the
    merges."""

    def __init__(self, geometry, rope, chunks: list, *, slots: int, max_batch: int,
                 device: torch.device | str, dry: bool, positions: list[int] | None = None,
                 ctas: int = 8, schedule: str = "pass", num_splits: int | None = None,
                 delta: int = 4096, pass_rows: int | None = None) -> None:  # fmt: skip
        self.geom, self.rope = geometry, rope
        self.scale = rope.softmax_scale
        self.dry, self.device = dry, torch.device(device)
        self.kv = [c.to(torch.bfloat16).cpu() for c in chunks]
        heads, d = geometry.heads, geometry.d_qk
        self.buf = allocate(RouteLayout(slots, max_batch, heads, max_topk=64),
                            LocalBackend(self.device))  # fmt: skip
        blocks = [-(-c.shape[1] // 64) for c in self.kv]
        self.holder = DeviceHolder(self.buf, geometry, softmax_scale=self.scale,
                                   num_blocks=sum(blocks) + 1, ctas=ctas,
                                   max_chunks=len(chunks), schedule=schedule,
                                   num_splits=num_splits, serve_sparse=False,
                                   pass_rows=pass_rows)  # fmt: skip
        positions = positions or [0] * len(chunks)
        for i, c in enumerate(self.kv):
            self.holder.add_chunk(i, c.to(self.device), position=positions[i])
        # bounds, never hangs: a reply waited for ~1-4 s of polls; the holder's take returns
        # after ~2**22 empty polls (seconds idle) if the stop word is lost
        self.client = RouteClient(self.buf, LocalBackend(self.device), spins=1 << 22)
        # the fetch: a staging chunk (the pull's destination) and the requester's pool, every
        # chunk spliced to its own blocks (block 0 left free)
        L = geometry.layers
        self.staged = torch.empty(L, max(blocks) * 64, d, dtype=torch.bfloat16,
                                  device=self.device)  # fmt: skip
        self.pool = torch.zeros(L, sum(blocks) + 1, 64, d, dtype=torch.bfloat16,
                                device=self.device)  # fmt: skip
        self._blocks, self.slots, first = [], [], 64
        for i, c in enumerate(self.kv):
            self._blocks.append(self.holder.chunks[i].blocks.to(self.device).long())
            self.slots.append(torch.arange(first, first + c.shape[1], dtype=torch.int64,
                                           device=self.device))  # fmt: skip
            first += blocks[i] * 64
        self.delta = delta
        self._default = None  # the default kernel's plan (default_step)
        if not dry:
            self.holder.start(max_idle=1 << 22)

    @classmethod
    def random(cls, heads: int, c_t: int, slots: int, max_batch: int, layers: int,
               preset: str = "deepseek-v2-lite", **kw) -> RouteRig:  # fmt: skip
        """The bench's rig: one chunk of ``c_t`` tokens (``N(0, 0.25)``, seed 0) of
        ``preset``'s geometry at ``layers`` layers and ``heads`` heads."""
        geom = PRESETS[preset].replace(layers=layers, heads=heads)
        g = torch.Generator().manual_seed(0)
        kv = 0.5 * torch.randn(layers, c_t, geom.d_qk, generator=g)
        return cls(geom, RopeSpec.from_preset(preset), [kv], slots=slots, max_batch=max_batch,
                   **kw)  # fmt: skip

    @property
    def c_t(self) -> int:
        """Chunk 0's tokens."""
        return self.kv[0].shape[1]

    # ---- the steps --------------------------------------------------------------------------
    def route_step(self, B: int, heads: int, requesters: int, q: list, probe: bool = False,
                   chunk: int = CHUNK):  # fmt: skip
        """Every layer: each requester's put (to ``chunk``), (a CPU: the one-shot holder), each
        merge. Returns the merges' ``(o, lse, status)`` in (layer, requester) order."""
        outs = []
        for layer in range(self.geom.layers):
            for r in range(requesters):
                self.client.put(r, q[r], layer=layer, chunk=chunk, probe=probe)
            if self.dry:
                self.holder.serve_once()
            for r in range(requesters):
                outs.append(self.client.merge([r], 1 if probe else B, 1 if probe else heads))
        return outs

    def pull_step(self, chunk: int = CHUNK) -> None:
        """The pull: the chunk's pool blocks of every layer gathered into the staging chunk."""
        pool = self.holder.pages.kv
        n = self._blocks[chunk].numel()
        out = self.staged[:, : n * 64].view(pool.shape[0], n, *pool.shape[2:])
        torch.index_select(pool, 1, self._blocks[chunk], out=out)

    def splice_step(self, chunk: int = CHUNK) -> None:
        """The splice of the staged chunk, all layers, into the requester's pool at ``delta``
        positions on (``rope_splice``: one launch)."""
        from mqnc.triton_kernels import rope_splice

        c_t = self.kv[chunk].shape[1]
        rope_splice(self.staged[:, :c_t], self.pool, self.slots[chunk], self.delta, self.rope,
                    validate=False)  # fmt: skip

    def fetch_step(self, chunk: int = CHUNK) -> torch.Tensor:
        """The fetch: the pull, then the splice."""
        self.pull_step(chunk)
        self.splice_step(chunk)
        return self.pool

    def attend_step(self) -> None:
        """The pass's dense attention alone (over every slot's folded rows; the slots' lengths
        as the last pass left them)."""
        _, _, attend, _ = self.holder.pass_launches()
        attend()

    def default_step(self, q: torch.Tensor):
        """The default dense kernel at the unfolded shape: ``q [B, H, d_qk]``, every token over
        chunk 0's pages of layer 0 (planned on the first call, outside any capture; then the
        plan's run: no check, no host sync)."""
        from mqnc.triton_kernels import plan_mla_decode

        if self._default is None or self._default[1].shape != q.shape:
            B = q.shape[0]
            blocks = self.holder.chunks[CHUNK].blocks.to(self.device)
            table = blocks[None].expand(B, -1).contiguous()
            lens = torch.full((B,), self.c_t, dtype=torch.int32, device=self.device)
            pool = self.holder.pages.kv[0]
            plan = plan_mla_decode(q, pool, table, lens, softmax_scale=self.scale,
                                   d_v=self.geom.d_v)  # fmt: skip
            self._default = (plan, q, pool, table, lens)
        plan, _, pool, table, lens = self._default
        return plan.run(q, pool, table, lens)

    # ---- checks -----------------------------------------------------------------------------
    def check_route(self, q: list, outs, B: int, heads: int, requesters: int) -> float:
        """The routed answers against fp64 within the bf16 bound (an ``AssertionError`` if
        not); returns the worst absolute error."""
        tol = TOLERANCES[("mla", "bfloat16")]
        worst = 0.0
        for i, (o, _, status) in enumerate(outs):
            assert status.tolist() == [0], f"route failed: status {status.tolist()}"
            layer, r = divmod(i, requesters)
            keys = self.kv[CHUNK][layer].to(self.device).double()
            valid = torch.ones(B, keys.shape[0], dtype=torch.bool, device=self.device)
            o_ref, _ = partial_attention_reference(q[r], keys, valid, self.scale)
            worst = max(worst, assert_close(o.cpu(), o_ref, tol, name="routed o").max_abs)
        return worst

    def check_fetch(self, chunk: int = CHUNK) -> float:
        """The chunk's fetched entries against it re-rotated in fp64 (the rotation's bound)."""
        from mqnc.reference import rope_splice_reference

        pool = torch.zeros(self.pool.shape, dtype=torch.float64)
        slots = self.slots[chunk].cpu()
        want = rope_splice_reference(self.kv[chunk].double(), pool, slots, self.delta, self.rope)
        got = self.pool.cpu().flatten(1, 2)[:, slots]
        return assert_close(got, want.flatten(1, 2)[:, slots], TOLERANCES[("rope", "bfloat16")],
                            name="fetched chunk").max_abs  # fmt: skip

    def close(self) -> None:
        if not self.dry:
            self.holder.stop()


def time_step(rig: RouteRig, fn: Callable[[], object], reps: int, inner: int, units: int,
              warmup: int = 1) -> tuple:  # fmt: skip
    """``((p20, p50, p80) us per unit, units timed, host calls)``: a CUDA graph of ``fn``
    replayed ``inner`` times per sample between CUDA events (a GPU; the holder stopped around
    the capture, which synchronizes the device, and started again), or ``fn`` eagerly once per
    sample (a CPU: every launch a host call)."""
    samples = []
    if rig.dry:
        before = rig.client.launches + rig.holder.launches
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6 / units)
        calls = rig.client.launches + rig.holder.launches - before
        return percentiles(samples), units * reps, max(calls, reps)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()  # warm (compiled, the holder answering)
    side.synchronize()  # (a stream, never the device: the holder's pass never finishes)
    rig.holder.stop()
    with torch.cuda.graph(graph):
        fn()
    rig.holder.start(max_idle=1 << 22)
    replays = 0
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            graph.replay()
        b.record()
        b.synchronize()
        replays += inner
        samples.append(a.elapsed_time(b) * 1e3 / (inner * units))
    return percentiles(samples), units * reps * inner, replays


def percentiles(xs) -> tuple[float, float, float]:
    """p20, p50, p80 of ``xs``."""
    t = torch.tensor(xs, dtype=torch.float64)
    return tuple(float(torch.quantile(t, p)) for p in (0.2, 0.5, 0.8))
