"""The probe and route sweep of §4.3 / Table 1 on an echo fabric: what ``perf/bench_route``
records and ``mqnc calibrate`` fits.

- ``bench="probe"``: a 1-byte put + signal answered by a 1-byte put + signal (``sig_rt``);
- ``bench="route"``: ``M_q q`` bytes out, ``M_q p`` bytes back, both with signals
  (``full_rt``), per ``M_q`` and per row size ``q + p`` (the real MLA row, or Table 1's payload
  sweep split in the geometry's proportion). All points are timed round-robin
  (:func:`~mqnc.measure.timing.time_interleaved`).
"""

from __future__ import annotations

from functools import partial

from tqdm import tqdm

from mqnc.measure.echo import EchoFabric, host_extra, split_row_bytes
from mqnc.measure.results_file import record
from mqnc.measure.timing import time_interleaved
from mqnc.model.geometry import MLAGeometry

__all__ = ["route_sweep"]


def route_sweep(
    fabric: EchoFabric,
    geometry: MLAGeometry,
    m_qs: list[int],
    payloads: list[int],
    *,
    reps: int,
    warmup: int,
    out=None,
    write: bool = True,
    progress: bool = True,
) -> tuple[list[float], dict[int, list[tuple[int, float]]]]:
    """Time the probe and the route sweep on ``fabric``; record each point (unless not
    ``write``) into ``out`` (default: the results file).

    Returns
    -------
    (list of float, dict)
        The probe's (p20, p50, p80) in us, and ``{q + p: [(M_q, p50_us), ...]}``.
    """
    t = fabric.name
    fns = {"probe": fabric.probe}
    for qp in payloads:
        q_b, p_b = split_row_bytes(qp, geometry)
        for m in m_qs:
            msg = fabric.route_message(m, q_b, p_b)
            fns[(qp, m)] = lambda msg=msg: fabric.round_trip(1, msg)
    bar = partial(tqdm, desc=f"bench_route[{t}] reps", disable=not progress)
    times = time_interleaved(fns, warmup=warmup, reps=reps, progress=bar)
    probe = times.pop("probe")
    if write:
        what = "1-byte put + signal, 1-byte put + signal back"
        record(
            "probe",
            t,
            1,
            probe,
            x_name="payload_bytes",
            nbytes=2,
            transport=t,
            backend="host-echo",
            extra=host_extra(fabric, what=what),
            path=out,
        )
    sweeps: dict[int, list[tuple[int, float]]] = {}
    for (qp, m), p in times.items():
        if write:
            _record_route(fabric, geometry, qp, m, p, out)
        sweeps.setdefault(qp, []).append((m, p[1]))
    return list(probe), sweeps


def _record_route(fabric: EchoFabric, geometry: MLAGeometry, qp: int, m: int, p, out) -> None:
    q_b, p_b = split_row_bytes(qp, geometry)
    extra = host_extra(
        fabric,
        qp_row_bytes=qp,
        q_row_bytes=q_b,
        p_row_bytes=p_b,
        payload="real" if qp == geometry.qp_row_bytes else "sweep",
    )
    record(
        "route",
        fabric.name,
        m,
        p,
        x_name="m_q",
        nbytes=m * qp,
        transport=fabric.name,
        backend="host-echo",
        extra=extra,
        path=out,
    )
