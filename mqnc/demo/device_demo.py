"""``mqnc demo --device-route``: the demo's corpus on one device, each (chunk, agent) routed
or fetched as the predicate decides from this device's measured profile (§5.1, §6.3;
docs/device-route.md).

1. **Host**: the corpus's chunks (the demo model's prefilled caches, canonical positions) on a
   device holder (``mqnc.serving.device_holder``, the pass), a requester pool beside it.
2. **Calibrate**, measured here the bench's way (``mqnc.measure.route_rig``: a step of every
   layer captured in a CUDA graph and replayed on a GPU; eagerly and interpreted on a CPU,
   where the numbers only exercise the path): the probe round trip, the route at both agents'
   ``M_q`` over the smallest and the largest chunk, and the fetch (pull and splice) of each
   of those two. ``mqnc.cost.device_profile`` fits the profile per size.
3. **Decide**: two agents, one token and ``batch`` tokens of every head (``M_q = H`` and
   ``batch x H``), ask every chunk; each (chunk, agent) is priced by ``decide`` (route or
   fetch, per layer) with the profile of the smallest calibrated size at least the chunk's
   (the route's compute grows with ``c_t``: an upper bound) and every decision printed with
   both predicted costs and the margin.
4. **Run** what was decided, each layer: the routed chunks' requests put and the fetched
   chunks' partials (``mla_decode_partial`` over the requester's pool, merged) merged in with
   the replies by one wait-then-merge, checked against fp64 attention over all the chunks
   (the bf16 bound: an ``AssertionError`` past it). The fetch splices at offset 0 (the agents
   attend the chunks where they were cached: the reference is the canonical corpus).

Writes ``device_route.json`` in ``cfg.out`` (the calibration records, the decisions, the
per-layer wall times and errors).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from mqnc.base.runtime import device_name, kernel_mode
from mqnc.demo.config import DemoConfig
from mqnc.demo.workload import Corpus, build_model

__all__ = ["run_device_route"]


def _calibrate(rig, agents: dict, sizes: list[int], reps: int, inner: int) -> list[dict]:
    """Bench-style records (``bench`` probe / route / fetch) measured on ``rig``: the probe,
    the route at every agent's ``M_q`` over chunks ``sizes``, their fetch."""
    import functools

    from mqnc.measure.route_rig import time_step

    g, L = rig.geom, rig.geom.layers
    recs = []

    def rec(bench, x, pct, **extra):
        recs.append(dict(bench=bench, x=x, p50=pct[1], p20=pct[0], p80=pct[2],
                         transport="device-local", device=device_name(),
                         extra=dict(heads=g.heads, requesters=1, **extra)))  # fmt: skip

    zero = [torch.zeros(1, 1, g.d_qk, dtype=torch.bfloat16, device=rig.device)]
    step = functools.partial(rig.route_step, 1, 1, 1, zero, True, sizes[0])
    rec("probe", 1, time_step(rig, step, reps, inner, L)[0])
    for c in sizes:
        c_t = rig.kv[c].shape[1]
        for B in agents.values():
            q = [torch.zeros(B, g.heads, g.d_qk, dtype=torch.bfloat16, device=rig.device)]
            step = functools.partial(rig.route_step, B, g.heads, 1, q, False, c)
            rec("route", B * g.heads, time_step(rig, step, reps, inner, L)[0], c_t=c_t)
        parts = {
            name: time_step(rig, functools.partial(fn, c), reps, inner, L)[0][1]
            for name, fn in (("pull_us", rig.pull_step), ("splice_us", rig.splice_step))
        }
        pct = time_step(rig, functools.partial(rig.fetch_step, c), reps, inner, L)[0]
        rec("fetch", c_t, pct, c_t=c_t, entry_bytes=g.d_qk * 2, **parts)
    return recs


def _decide(records: list[dict], sizes: list[int], rig, agents: dict) -> list[dict]:
    """Every (chunk, agent)'s decision, per layer, from the profiles fitted per calibrated
    size."""
    from mqnc.cost.device_profile import device_profile
    from mqnc.cost.predicate import decide
    from mqnc.cost.profile import Request

    calibrated = sorted(rig.kv[c].shape[1] for c in sizes)
    profiles = {c_t: device_profile(records, c_t, heads=rig.geom.heads) for c_t in calibrated}
    g1 = rig.geom.replace(layers=1)
    out = []
    for c, kv in enumerate(rig.kv):
        c_t = kv.shape[1]
        at = next((s for s in calibrated if s >= c_t), calibrated[-1])
        for name, B in agents.items():
            m_q = B * rig.geom.heads
            req = Request(m_q=m_q, c_t=c_t, attention=False, allow=("route", "fetch"))
            d = decide(g1, profiles[at], req)
            costs = d.costs
            out.append(dict(chunk=c, c_t=c_t, agent=name, m_q=m_q, choice=d.primitive,
                            route_us=costs["route"], fetch_us=costs["fetch"],
                            margin_us=abs(costs["route"] - costs["fetch"]),
                            profile_c_t=at))  # fmt: skip
    return out


def _local_partial(rig, q: torch.Tensor, layer: int, chunks: list[int]):
    """The agent's partial over the fetched ``chunks`` in the requester's pool (one call per
    chunk, merged), or None."""
    from mqnc.triton_kernels import merge_partials, mla_decode_partial

    parts = []
    B = q.shape[0]
    for c in chunks:
        slots = rig.slots[c]
        first = int(slots[0]) // 64
        n = -(-slots.numel() // 64)
        table = torch.arange(first, first + n, dtype=torch.int32, device=rig.device)
        table = table[None].expand(B, -1).contiguous()
        lens = torch.full((B,), slots.numel(), dtype=torch.int32, device=rig.device)
        parts.append(mla_decode_partial(q, rig.pool[layer], table, lens,
                                        softmax_scale=rig.scale, d_v=rig.geom.d_v))  # fmt: skip
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    o = torch.stack([p[0] for p in parts])
    lse = torch.stack([p[1] for p in parts])
    o_m, lse_m = merge_partials(o, lse, layout="MBHD", check_lse=False)
    return o_m.to(q.dtype).contiguous(), lse_m.contiguous()


def run_device_route(cfg: DemoConfig) -> dict:
    """The demo over the device route (module docstring). Prints the decisions and the
    per-layer wall time (measured here; on a CPU the interpreter's) and returns what it writes
    to ``device_route.json``."""
    from mqnc.measure.route_rig import RouteRig
    from mqnc.reference import partial_attention_reference
    from mqnc.testing import TOLERANCES, assert_close
    from mqnc.transport.device_route import check_status

    t_start = time.perf_counter()
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dry = device.type != "cuda"
    model = build_model(cfg)
    corpus = Corpus(cfg, model)
    g = model.geometry
    agents = {"one token": 1, "batch": 2 if dry else 64}
    chunks = [corpus.kv(c) for c in range(cfg.chunks)]
    rig = RouteRig(g, model.rope, chunks, slots=cfg.chunks, max_batch=max(agents.values()),
                   device=device, dry=dry, positions=corpus.positions, delta=0)  # fmt: skip
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    try:
        order = sorted(range(cfg.chunks), key=lambda c: corpus.lengths[c])
        sizes = sorted({order[0], order[-1]})
        reps, inner = (1, 1) if dry else (5, 10)
        records = _calibrate(rig, agents, sizes, reps, inner)
        decisions = _decide(records, sizes, rig, agents)
        times, errors = [], []
        for name, B in agents.items():
            mine = [d for d in decisions if d["agent"] == name]
            routed = [d["chunk"] for d in mine if d["choice"] == "route"]
            fetched = [d["chunk"] for d in mine if d["choice"] == "fetch"]
            for c in fetched:  # every layer of each fetched chunk, once
                rig.fetch_step(c)
            for layer in range(g.layers):
                q = (0.5 * torch.randn(B, g.heads, g.d_qk, generator=gen)).to(torch.bfloat16)
                qd = q.to(device)
                t0 = time.perf_counter()
                for c in routed:
                    rig.client.put(c, qd, layer=layer, chunk=c)
                if dry and routed:
                    rig.holder.serve_once()
                local = _local_partial(rig, qd, layer, fetched)
                if routed:
                    o, _, status = rig.client.merge(routed, B, g.heads, local=local)
                    check_status(status, routed)
                else:
                    o = local[0]
                if not dry:
                    torch.cuda.current_stream(device).synchronize()  # (never the device's)
                times.append((time.perf_counter() - t0) * 1e6)
                keys = torch.cat([chunks[c][layer] for c in range(cfg.chunks)]).double()
                valid = torch.ones(B, keys.shape[0], dtype=torch.bool)
                o_ref, _ = partial_attention_reference(q, keys, valid, model.softmax_scale)
                s = assert_close(o.cpu(), o_ref, TOLERANCES[("mla", "bfloat16")],
                                 name=f"{name}, layer {layer} o")  # fmt: skip
                errors.append(s.max_abs)
    finally:
        rig.close()
    result = dict(
        transport="device-local", device=device_name(), kernels=kernel_mode(),
        chunks=cfg.chunks, layers=g.layers, tokens=corpus.total, agents=agents,
        calibration=records, decisions=decisions, layer_us=times, vs_fp64_max_abs=errors,
        host_free=not dry, wall_s=time.perf_counter() - t_start,
    )  # fmt: skip
    _print(result)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    (Path(cfg.out) / "device_route.json").write_text(json.dumps(result, indent=2))
    return result


def _print(result: dict) -> None:
    decisions = result["decisions"]
    n_route = sum(d["choice"] == "route" for d in decisions)
    where = "measured on the GPU" if result["host_free"] else "interpreted: no speed"
    print(
        f"device route: {result['chunks']} chunks ({result['tokens']} tokens), "
        f"{result['layers']} layers on {result['device']} ({where})"
    )
    print(f"{'chunk':>5} {'c_t':>5} {'agent':>10} {'M_q':>5} {'choice':>6} {'route us':>9} "
          f"{'fetch us':>9} {'margin':>8}")  # fmt: skip
    for d in decisions:
        print(f"{d['chunk']:>5} {d['c_t']:>5} {d['agent']:>10} {d['m_q']:>5} {d['choice']:>6} "
              f"{d['route_us']:>9.1f} {d['fetch_us']:>9.1f} {d['margin_us']:>8.1f}")  # fmt: skip
    print(
        f"decisions: route {n_route}, fetch {len(decisions) - n_route} (predicted per layer "
        f"from this device's calibration); per layer {statistics.median(result['layer_us']):.0f} "
        f"us (median wall), worst |o - fp64| {max(result['vs_fp64_max_abs']):.2e}; "
        f"{result['wall_s']:.1f} s in all"
    )
