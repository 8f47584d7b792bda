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
    """One device holder hosting one chunk of ``c_t`` tokens (``layers`` layers, ``heads``
    heads, bf16; the chunk drawn from a fixed seed), a client on ``slots`` slots of
    ``max_batch`` tokens, and a requester pool the fetch splices into.

    ``schedule`` and ``num_splits``: the holder's (``DeviceHolder``); ``serve_sparse`` False
    (no resident sparse kernel holds SMs). On a GPU the holder is started (persistent); on a
    CPU (``dry``) it serves one-shot between the puts and the merges."""

    def __init__(self, heads: int, c_t: int, slots: int, max_batch: int, layers: int, *,
                 device: torch.device | str, dry: bool, ctas: int = 8, schedule: str = "pass",
                 num_splits: int | None = None, preset: str = "deepseek-v2-lite") -> None:  # fmt: skip
        self.geom = PRESETS[preset].replace(layers=layers, heads=heads)
        self.rope = RopeSpec.from_preset(preset)
        self.scale = self.rope.softmax_scale
        self.dry, self.device, self.c_t = dry, torch.device(device), c_t
        self.buf = allocate(RouteLayout(slots, max_batch, heads, max_topk=64),
                            LocalBackend(self.device))  # fmt: skip
        blocks = -(-c_t // 64)
        self.holder = DeviceHolder(self.buf, self.geom, softmax_scale=self.scale,
                                   num_blocks=blocks + 1, ctas=ctas, max_chunks=1,
                                   schedule=schedule, num_splits=num_splits,
                                   serve_sparse=False)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        self.kv = (0.5 * torch.randn(layers, c_t, self.geom.d_qk, generator=g)).to(torch.bfloat16)
        self.holder.add_chunk(CHUNK, self.kv.to(self.device))
        # bounds, never hangs: a reply waited for ~1-4 s of polls; the holder's take returns
        # after ~2**22 empty polls (seconds idle) if the stop word is lost
        self.client = RouteClient(self.buf, LocalBackend(self.device), spins=1 << 22)
        # the fetch: a staging chunk (the pull's destination) and the requester's pool
        self._blocks = self.holder.chunks[CHUNK].blocks.to(self.device).long()
        self.staged = torch.empty(layers, blocks * 64, self.geom.d_qk, dtype=torch.bfloat16,
                                  device=self.device)  # fmt: skip
        self.pool = torch.zeros(layers, blocks + 1, 64, self.geom.d_qk, dtype=torch.bfloat16,
                                device=self.device)  # fmt: skip
        self.slots = torch.arange(64, 64 + c_t, dtype=torch.int64, device=self.device)
        self.delta = 4096  # re-homed 4096 positions on
        self.host_calls = 0
        if not dry:
            self.holder.start(max_idle=1 << 22)

    # ---- the steps --------------------------------------------------------------------------
    def route_step(self, B: int, heads: int, requesters: int, q: list, probe: bool = False):
        """Every layer: each requester's put, (a CPU: the one-shot holder), each merge.
        Returns the merges' ``(o, lse, status)`` in (layer, requester) order."""
        outs = []
        for layer in range(self.geom.layers):
            for r in range(requesters):
                self.client.put(r, q[r], layer=layer, chunk=CHUNK, probe=probe)
            if self.dry:
                self.holder.serve_once()
            for r in range(requesters):
                outs.append(self.client.merge([r], 1 if probe else B, 1 if probe else heads))
        return outs

    def fetch_step(self) -> torch.Tensor:
        """The pull (the chunk's pool blocks of every layer gathered into the staging chunk)
        and the splice of all layers into the requester's pool at ``delta`` positions on."""
        from mqnc.triton_kernels import rope_splice

        pool = self.holder.pages.kv
        torch.index_select(pool, 1, self._blocks, out=self.staged.view(pool.shape[0], -1,
                           *pool.shape[2:]))  # fmt: skip
        rope_splice(self.staged[:, : self.c_t], self.pool, self.slots, self.delta, self.rope,
                    validate=False)  # fmt: skip
        return self.pool

    def attend_step(self) -> None:
        """The pass's dense attention alone (over every slot's folded rows; the slots' lengths
        as the last pass left them)."""
        self.holder.pass_launches()[1]()

    def default_step(self, q: torch.Tensor):
        """The default dense kernel at the unfolded shape: ``q [B, H, d_qk]``, every token over
        the chunk's pages of layer 0."""
        from mqnc.triton_kernels import mla_decode_partial

        B = q.shape[0]
        table = self.holder.chunks[CHUNK].blocks.to(self.device)[None].expand(B, -1).contiguous()
        lens = torch.full((B,), self.c_t, dtype=torch.int32, device=self.device)
        return mla_decode_partial(q, self.holder.pages.kv[0], table, lens,
                                  softmax_scale=self.scale, d_v=self.geom.d_v)  # fmt: skip

    # ---- checks -----------------------------------------------------------------------------
    def check_route(self, q: list, outs, B: int, heads: int, requesters: int) -> float:
        """The routed answers against fp64 within the bf16 bound (an ``AssertionError`` if
        not); returns the worst absolute error."""
        tol = TOLERANCES[("mla", "bfloat16")]
        worst = 0.0
        for i, (o, _, status) in enumerate(outs):
            assert status.tolist() == [0], f"route failed: status {status.tolist()}"
            layer, r = divmod(i, requesters)
            keys = self.kv[layer].to(self.device).double()
            valid = torch.ones(B, keys.shape[0], dtype=torch.bool, device=self.device)
            o_ref, _ = partial_attention_reference(q[r], keys, valid, self.scale)
            worst = max(worst, assert_close(o.cpu(), o_ref, tol, name="routed o").max_abs)
        return worst

    def check_fetch(self) -> float:
        """The fetched pool against the chunk re-rotated in fp64 (the splice's bound)."""
        from mqnc.reference import rope_splice_reference

        pool = torch.zeros(self.pool.shape, dtype=torch.float64)
        want = rope_splice_reference(self.kv.double(), pool, self.slots.cpu(), self.delta,
                                     self.rope)  # fmt: skip
        return assert_close(self.pool.cpu(), want, TOLERANCES[("rope", "bfloat16")],
                            name="fetched pool").max_abs  # fmt: skip

    def close(self) -> None:
        if not self.dry:
            self.holder.stop()


def time_step(rig: RouteRig, fn: Callable[[], object], reps: int, inner: int, units: int,
              warmup: int = 1, holder_running: bool = True) -> tuple:  # fmt: skip
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
    if holder_running:
        rig.holder.stop()
    with torch.cuda.graph(graph):
        fn()
    if holder_running:
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
