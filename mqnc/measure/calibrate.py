"""Measure this machine's fabric and fit its profile (§4.3, Table 2): what ``mqnc calibrate``
runs.

A short probe + route sweep on one transport (the echo fabric of :mod:`mqnc.measure.echo`:
rank 0 here, one echo holder; ``sig_rt`` and ``full_rt`` exactly as ``perf/bench_route.py``
times them, :func:`mqnc.measure.sweep.route_sweep`), a fit of ``(T_probe, BW, turnaround)``
with :func:`mqnc.cost.fit_route` (the fit every calibration shares: :func:`mqnc.cost.fit`;
the probe is the measured ``sig_rt``; ``BW`` the large-``M_q`` slope; turnaround = intercept -
probe), and a :class:`~mqnc.cost.FabricProfile` that ``mqnc calibrate`` writes as a machine
profile and ``mqnc predict --fabric FILE``, the predicate and the demo (``--profile FILE``)
load. Unless ``bulk_tokens`` is None, one contiguous all-layer chunk pull is timed too and its
rate stored as ``bulk_bw_gbps`` (fetch's ``T_pull``, :func:`mqnc.cost.bulk_rate_gbps`), so
that the profile prices fetch on the same machine.

The demo's and the Hugging Face session's calibrations time their probes, routes and fetches through
a requester (:mod:`mqnc.serving.calibration_samples`); this one times the bare transport against an
echo holder (the sweep every benchmark of the transport shares,
:func:`mqnc.measure.sweep.route_sweep`), so it shares their fit and rate, not their harness.

Then the package's own path (its host software is part of a route's cost): a real
:class:`~mqnc.serving.Requester` routes to a real :class:`~mqnc.serving.Holder` (its kernel stubbed:
the compute is priced apart) on the same transport, interleaved with echo round trips of the same
``M_q`` (:mod:`mqnc.measure.holders`); the difference, fitted as ``fixed + per_row * M_q``
(:func:`mqnc.cost.fit_host`), is the host term of §5.3 for this package's software. The profile
carries it (``host_fixed_us``, ``host_per_row_us``) and :func:`mqnc.cost.t_route` adds it, so that a
profile from here prices what a call through the holder and requester costs, not the bare transport
alone.
The default sweep takes a few seconds on loopback and about 10-20 s on gloo (process start
included) on a 2-core CPU.
"""

from __future__ import annotations

from mqnc.base.checks import check_int
from mqnc.base.runtime import device_name
from mqnc.cost import FabricProfile, FitResult, bulk_rate_gbps, fit_host, fit_route
from mqnc.measure.echo import HDR, OP_CHUNK, EchoFabric, Unavailable
from mqnc.measure.sweep import route_sweep
from mqnc.measure.timing import one_intra_op_thread, time_fn, time_interleaved
from mqnc.model.geometry import MLAGeometry, load_geometry
from mqnc.transport import engine

HOST_M_Q = (1, 16, 256)  # route sizes of the host-overhead sweep (one token's heads, 16 tokens)

__all__ = ["calibrate"]


# Over 60 lines by its numpy docstring (29) and signature; the body is 23 lines.
def calibrate(
    transport: str = "loopback",
    *,
    m_qs=(1, 16, 64, 256, 512, 1024, 2048, 4096),
    model: str | MLAGeometry = "deepseek-v2-lite",
    reps: int = 15,
    warmup: int = 3,
    fit_min_rows: int = 512,
    bulk_tokens: int | None = 256,
    name: str | None = None,
    results: str | None = None,
    progress: bool = False,
    host: bool = True,
) -> tuple[FabricProfile, FitResult, dict]:
    """Measure and fit this machine's fabric on ``transport``.

    Parameters
    ----------
    transport : str
        ``"loopback"`` or ``"gloo"`` (``"nvshmem"`` raises: its benchmark is
        ``perf/gpu_check_nvshmem.py``).
    m_qs : sequence of int
        Route batch sizes (at least two distinct; the fit uses ``M_q >= fit_min_rows`` when
        two such sizes exist, all points otherwise).
    model : str or MLAGeometry
        Geometry (a preset name, a Hugging Face ``config.json`` path, or the geometry) giving
        ``q + p`` (2184 B/row for DeepSeek-V2-Lite).
    reps, warmup : int
        Timed and untimed repetitions per point (p50 of the timed ones is fitted).
    fit_min_rows : int
        As in :func:`mqnc.cost.fit` (also the amortised-MAPE threshold).
    bulk_tokens : int or None
        Chunk tokens of the bulk-pull measurement (``None``: skip it).
    name : str or None
        Profile name (default ``"<transport>@<device>"``).
    results : str or None
        Also append the probe/route records to this results file (``bench_route``'s format).
    host : bool
        Also measure the package's own path and store its host overhead in the profile.

    Returns
    -------
    (FabricProfile, FitResult, dict)
        The profile, the fit, and the raw measurements (``probe_us``, ``route`` as
        ``[(M_q, p50_us)]``, ``bulk`` as ``(bytes, p50_us)`` or None, ``host`` as
        ``[(M_q, package_p50_us, echo_p50_us)]`` or None).
    """
    engine(transport)  # a ValueError naming the registry's engines for an unknown one
    m_qs = sorted({int(m) for m in m_qs})
    if len(m_qs) < 2 or m_qs[0] < 1:
        raise ValueError(f"m_q: expected at least two distinct sizes >= 1, got {m_qs}")
    check_int("reps", reps, minimum=1)
    g = model if isinstance(model, MLAGeometry) else load_geometry(model)
    probe, route, bulk, host_pts = _measure(
        transport, g, m_qs, reps, warmup, bulk_tokens, results=results, progress=progress,
        host=host,
    )  # fmt: skip
    rf = fit_route(
        route, [probe], qp_row_bytes=g.qp_row_bytes, fit_min_rows=fit_min_rows, strict=True
    )
    dev = device_name()
    extra = {} if bulk is None else {"bulk_bw_gbps": bulk_rate_gbps(*bulk)}
    if host_pts:
        h = fit_host(host_pts)
        extra.update(host_fixed_us=h.fixed_us, host_per_row_us=h.per_row_us)
    profile = rf.fabric(
        name or f"{transport}@{dev}",
        description=f"{transport} echo fabric on {dev} (host-side put + signal, §3.2 sig_rt / "
        f"full_rt), {g.name} rows q+p = {g.qp_row_bytes} B",
        source=f"mqnc calibrate --transport {transport}: M_q {m_qs}, {reps} reps, p50; fit "
        f"over M_q >= {fit_min_rows}"
        + (f"; bulk pull of {bulk_tokens} tokens x {g.layers} layers" if bulk else "")
        + (f"; host overhead from Holder/Requester routes at M_q {HOST_M_Q}" if host_pts else ""),
        **extra,
    )
    raw = {"probe_us": probe, "route": route, "bulk": bulk, "host": host_pts}
    return profile, rf.fit, raw


def _measure(transport, g: MLAGeometry, m_qs, reps, warmup, bulk_tokens, *, results, progress,
             host):  # fmt: skip
    """The probe's p50, the route sweep ``[(M_q, p50)]``, the bulk pull ``(bytes, p50)`` and
    the host sweep ``[(M_q, package_p50, echo_p50)]`` (None without ``host``)."""
    one_intra_op_thread()
    slot = HDR + max(max(m_qs), max(HOST_M_Q)) * max(g.q_row_bytes, g.p_row_bytes)
    bulk_bytes = g.chunk_bytes(bulk_tokens) if bulk_tokens else 0
    try:
        fabric = EchoFabric(
            transport, holders=1, slot_bytes=max(slot, HDR + bulk_bytes), chunk_bytes=bulk_bytes
        )
    except Unavailable as exc:
        raise ValueError(f"transport: {exc}") from None
    with fabric:
        probe, sweeps = route_sweep(
            fabric,
            g,
            m_qs,
            [g.qp_row_bytes],
            reps=reps,
            warmup=warmup,
            out=results,
            write=results is not None,
            progress=progress,
        )
        bulk = None
        if bulk_bytes:
            msg = fabric.message(OP_CHUNK, HDR, bulk_bytes)
            pb = time_fn(lambda: fabric.round_trip(1, msg), warmup=warmup, reps=reps, cuda=False)
            bulk = (bulk_bytes, pb[1])
        host_pts = _host_sweep(fabric, g, reps, warmup) if host else None
    return probe[1], sweeps[g.qp_row_bytes], bulk, host_pts


def _host_sweep(fabric: EchoFabric, g: MLAGeometry, reps: int, warmup: int):
    """Routes through a real holder and requester (kernel stubbed) interleaved with echo round
    trips of the same ``M_q``: ``[(M_q, package_p50, echo_p50)]``."""
    import torch

    from mqnc.measure.holders import HolderFabric

    gen = torch.Generator().manual_seed(0)
    fns = {}
    with HolderFabric(fabric.name, max_rows=max(HOST_M_Q), model=g) as hf:
        for m in HOST_M_Q:
            heads = min(m, g.heads)
            q = torch.randn(m // heads, heads, g.d_qk, generator=gen).to(torch.bfloat16)
            fns[("pkg", m)] = lambda q=q: hf.requester.route(1, q, 0)
            msg = fabric.route_message(m, g.q_row_bytes, g.p_row_bytes)
            fns[("echo", m)] = lambda msg=msg: fabric.round_trip(1, msg)
        times = time_interleaved(fns, warmup=warmup, reps=reps)
    return [(m, times[("pkg", m)][1], times[("echo", m)][1]) for m in HOST_M_Q]
