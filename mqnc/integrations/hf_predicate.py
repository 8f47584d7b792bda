"""The predicate's side of a Hugging Face session (:mod:`mqnc.integrations.hf_session`): this
machine's constants measured against the holders, and route / fetch / local per chunk (§4, §5).
"""

from __future__ import annotations

import dataclasses

import torch

from mqnc.cost import (
    LOCAL_C_US,
    FabricProfile,
    MachineProfile,
    Request,
    bulk_rate_gbps,
    decide,
    fit_route,
    load_fabric,
    t_local,
)
from mqnc.serving.calibration_samples import fetch_samples, merge_times, probe_times, route_sweep

__all__ = ["as_fabric", "prefill_c_us", "measure_constants", "session_profile", "decide_chunk"]


def as_fabric(fabric):
    """A :class:`~mqnc.cost.FabricProfile` from a profile, a preset name or a JSON path."""
    if isinstance(fabric, FabricProfile):
        return fabric
    if isinstance(fabric, str):
        return load_fabric(fabric)
    raise TypeError(f"fabric: expected a FabricProfile, a preset name or a path, got {fabric!r}")


def prefill_c_us(corpus, geometry) -> float:
    """``c``, the local re-prefill's cost per token-layer (us): the context prefill's own time
    (``corpus.meta["prefill_us"]``), else the paper's default."""
    us = corpus.meta.get("prefill_us")
    if not us:
        return LOCAL_C_US
    return float(us) / (corpus.tokens * geometry.layers)


def measure_constants(
    requester, corpus, geometry, *, fabric=None, kernels="triton", probes: int = 9, reps: int = 2
):
    """This machine's constants against the corpus' first holder, timed as the demo's are
    (:mod:`mqnc.serving.calibration_samples`): ``probes`` probe round trips after 5 warm-ups, a
    route sweep (1, 4, 16 query tokens of ``H`` rows, ``reps`` each in a row; affine fit, §4.3,
    :func:`mqnc.cost.fit_route`), one fetch spliced at a new offset (bulk pull rate and splice
    per token; the copy is evicted again, so the requester's pool is left as it was), one
    merge; the local re-prefill cost per token-layer is the context prefill's own time.
    Returns ``(fabric, cal)``: the given ``fabric`` or the fitted one, and the constants (the
    keys ``mqnc demo``'s table prints)."""
    req, g = requester, geometry
    c0 = min(corpus.chunks)
    probe = probe_times(req, req.directory[c0].holders[0], reps=probes, warmup=5)
    gen = torch.Generator().manual_seed(0)  # the global RNG is the caller's (sampling)
    sweep = route_sweep(req, c0, (1, 4, 16), reps=reps, warmup=0, generator=gen, interleave=False)
    routes = [s for got in sweep.values() for s in got]
    samples = [(s.rows, max(s.round_trip_us, 1e-3)) for s in routes]
    computes = [s.compute_us / s.work for s in routes]
    # a real pull and splice at an offset nothing keeps, then evicted: the pool is left as the
    # calibration found it (a kept copy would be attended in place by every later request)
    (fetch,) = fetch_samples(req, [c0], rounds=1)
    bulk_bw = bulk_rate_gbps(fetch.bytes, max(fetch.return_us, 1e-3))
    (merge_us,) = merge_times(
        kernels,
        len(corpus.chunks) + 1,
        g,
        generator=gen,
        dtype=torch.float32,
        device=req.device,
        reps=1,
        width=g.v_head_dim,
    )
    fit_error = None
    if fabric is None:
        # the fit every calibration shares; decode-sized rows on a fast link are all fixed
        # cost, and then the rows move at the bulk pull's rate
        rf = fit_route(samples, probe, qp_row_bytes=g.qp_row_bytes, bulk_bw_gbps=bulk_bw)
        fit_error = rf.error
        if rf.fit is not None:
            fabric = rf.fabric("this-machine (mqnc hf calibration)")
        else:
            fabric = rf.fabric(
                "this-machine (mqnc hf calibration, route BW from the bulk pull)",
                source="mqnc hf calibration",
            )
        fabric = dataclasses.replace(fabric, bulk_bw_gbps=bulk_bw)
    cal = dict(
        fabric=dataclasses.asdict(fabric),
        fit_error=fit_error,
        probe_samples_us=probe,
        compute_us_per_row_token=sum(computes) / len(computes),
        merge_us=merge_us,
        splice_us_per_token=fetch.splice_us_per_token,
        c_us=prefill_c_us(corpus, g),
    )
    return fabric, cal


def session_profile(fabric: FabricProfile, cal: dict, corpus, geometry) -> MachineProfile:
    """The session's constants as the predicate reads them: ``fabric`` and the measured
    compute terms of ``cal`` (:func:`measure_constants`: the splice per token; the re-prefill
    rate, else the context prefill's own, else the paper's)."""
    terms = {k: cal[k] for k in ("splice_us_per_token", "merge_us") if cal.get(k) is not None}
    if cal.get("compute_us_per_row_token") is not None:
        terms["compute_us_per_row_token"] = cal["compute_us_per_row_token"]
    return MachineProfile(
        as_fabric(fabric),
        c_us=cal.get("c_us") or prefill_c_us(corpus, geometry),
        sources=dict.fromkeys(terms, "mqnc hf calibration"),
        **terms,
    )


def decide_chunk(
    corpus,
    geometry,
    fabric,
    cal: dict,
    chunk_id: int,
    *,
    delta: int,
    batch: int,
    steps: int,
    allow_local: bool,
) -> dict:
    """The predicate's choice for one chunk of one request (``batch * H`` rows per step,
    ``steps * L`` round trips) and every primitive's total (us). The partial attention and the
    merge are paid by every primitive (on the holder for route, in the requester's pool for
    fetch and local), so they stay out of the comparison; fetch splices only when ``delta``
    (the measured splice per token, else the paper's profile); an exact local re-prefill runs
    the context up to the chunk's end (a causal prefix)."""
    c, g = corpus.chunks[chunk_id], geometry
    profile = session_profile(fabric, cal, corpus, g)
    request = Request(
        batch * g.heads,
        c.tokens,
        moved=bool(delta),
        attention=False,
        round_trips=steps * g.layers,
    )
    d = decide(g, profile, request)
    costs = dict(d.costs, local=t_local(g, c.start + c.tokens, profile.local_c_us))
    allowed = [p for p in costs if p != "local" or allow_local]
    chosen = min(allowed, key=costs.__getitem__)
    return dict(chunk=chunk_id, primitive=chosen, predicate=chosen, costs_us=costs, delta=delta)
