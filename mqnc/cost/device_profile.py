"""The device route and the device fetch as the predicate prices them (§4, §5.1, §6.3): a
:class:`~mqnc.cost.MachineProfile` fitted per chunk size from ``perf.bench_device_route``
records, and the route / fetch crossover in ``M_q`` measured there against the predicate's.

Both sides are per layer, as the records are (§5.2's comparison: one layer's query rows
against one layer's chunk; both scale with ``L``):

- route: the device route's round trip per routed layer at ``c_t``
  (:func:`~mqnc.cost.calibration_fits.fit_device_route` over that ``c_t``'s one-requester
  sweep; a sweep that does not grow with ``M_q`` beyond its noise, where the round trip is all
  fixed cost, takes the rows at the pull rate). It includes the holder's partial attention and
  the merge, so the request is priced with ``attention=False`` (nothing charged twice);
- fetch: the pull of one layer's ``c_t`` entries at the measured pull rate (``bulk_bw_gbps``
  of the fabric) plus the splice of one layer (a :class:`~mqnc.cost.SpliceProfile` through
  the measured sizes), priced with a one-layer geometry.

:func:`device_profile` builds the profile; :func:`crossovers` puts, for each ``c_t`` with both
kinds of records, the measured crossover (the ``M_q`` where the route's measured round trip
meets the fetch's, linear between the bracketing points) beside the predicate's (the ``M_q``
where :func:`~mqnc.cost.decide` turns from route to fetch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from mqnc.cost.calibration_fits import fit_device_route
from mqnc.cost.predicate import decide
from mqnc.cost.profile import MachineProfile, Request
from mqnc.cost.terms import HostOverhead, SpliceProfile
from mqnc.model.geometry import MLAGeometry

__all__ = ["device_profile", "measured_crossover", "predicted_crossover", "Crossover",
           "crossovers"]  # fmt: skip


def _fetch_record(records: list[dict], c_t: int) -> dict:
    got = [r for r in records if r.get("bench") == "fetch" and int(r.get("x", -1)) == c_t]
    if not got:
        raise ValueError(f"records: expected a device fetch record at c_t {c_t}, got none")
    return got[-1]


def device_profile(records: Iterable[dict], c_t: int, *, heads: int = 16) -> MachineProfile:
    """The device's profile for chunks of ``c_t`` tokens: the route fitted from that ``c_t``'s
    route records (``heads`` heads, one requester), the pull rate from its fetch record, and
    the splice (and a non-moved chunk's write, the same kernel) through every fetch record's
    size (per layer; :class:`~mqnc.cost.SpliceProfile`: flat below the first, the last
    segment's slope above the last). Price requests with ``attention=False`` and a one-layer
    geometry (:func:`predicted_crossover` does). A ``ValueError`` naming what the records
    lack."""
    records = list(records)
    f = _fetch_record(records, c_t)
    extra = f.get("extra") or {}
    entry = float(extra.get("entry_bytes", 1152))
    bulk = c_t * entry / float(extra["pull_us"]) / 1e3  # GB/s: a layer's entries over its pull
    fabric = fit_device_route(records, heads=heads, c_t=c_t, bulk_bw_gbps=bulk)
    fabric = dataclasses.replace(fabric, bulk_bw_gbps=bulk)
    sizes = {}
    for r in records:
        if r.get("bench") == "fetch":
            sizes[int(r["x"])] = float((r.get("extra") or {})["splice_us"])
    source = f"perf.bench_device_route fetch on {f.get('device', '?')} at {f.get('commit', '?')}"
    splice = SpliceProfile(tuple(sorted(sizes)), tuple(sizes[k] for k in sorted(sizes)),
                           name=f"device splice, one layer ({source})")  # fmt: skip
    return MachineProfile(
        fabric=fabric,
        splice=splice,
        scatter=splice,
        host=HostOverhead(0.0, 0.0),
        t_compute_us=0.0,
        t_merge_us=0.0,
        sources=dict(fabric=fabric.source, splice=source, pull=source),
    )


def predicted_crossover(profile: MachineProfile, geometry: MLAGeometry, c_t: int,
                        hi: float = 1e7) -> float | None:  # fmt: skip
    """The ``M_q`` where the predicate turns from route to fetch at ``c_t`` (bisection: route
    wins below it), priced per layer (``geometry`` at one layer, ``attention=False``); 0 when
    fetch wins from one row on, None when route still wins at ``hi`` rows."""
    g = geometry.replace(layers=1)

    def route_wins(m: float) -> bool:
        req = Request(m_q=m, c_t=c_t, attention=False, allow=("route", "fetch"))
        return decide(g, profile, req).primitive == "route"

    if not route_wins(1.0):
        return 0.0
    if route_wins(hi):
        return None
    lo, up = 1.0, hi
    while up - lo > 1e-3 * lo:
        mid = (lo * up) ** 0.5
        lo, up = (mid, up) if route_wins(mid) else (lo, mid)
    return (lo + up) / 2


def measured_crossover(records: Iterable[dict], c_t: int, *,
                       heads: int = 16) -> tuple[float | None, tuple[float, float]]:  # fmt: skip
    """The measured ``M_q`` where the route's round trip (one requester, ``heads`` heads,
    ``c_t``) meets the fetch's (per layer), linear between the bracketing route points, and
    the measured ``M_q`` range. 0 when fetch is faster at every measured point, None when route
    is faster at every one."""
    records = list(records)
    fetch = float(_fetch_record(records, c_t)["p50"])
    pts = sorted(
        (float(r["x"]), float(r["p50"]))
        for r in records
        if r.get("bench") == "route"
        and int((r.get("extra") or {}).get("c_t", -1)) == c_t
        and (r.get("extra") or {}).get("requesters") == 1
        and (r.get("extra") or {}).get("heads") == heads
    )
    if len(pts) < 2:
        raise ValueError(f"records: expected >= 2 route points at c_t {c_t}, got {len(pts)}")
    span = (pts[0][0], pts[-1][0])
    if pts[0][1] >= fetch:
        return 0.0, span
    for (m0, t0), (m1, t1) in zip(pts, pts[1:], strict=False):
        if t1 >= fetch:
            return m0 + (fetch - t0) * (m1 - m0) / (t1 - t0), span
    return None, span


@dataclasses.dataclass(frozen=True)
class Crossover:
    """The measured and the predicted route / fetch crossover at one ``c_t`` (``M_q``; 0:
    fetch wins from one row on; None: route wins past the range)."""

    c_t: int
    measured: float | None
    predicted: float | None
    span: tuple[float, float]

    def agrees(self, tol: float = 0.15) -> bool:
        """Within ``tol`` of each other, or on the same side of the measured range (both below
        its first point, or both above its last)."""
        m, p, (lo, hi) = self.measured, self.predicted, self.span
        if m == 0.0:
            return p is not None and p <= lo * (1 + tol)
        if m is None:
            return p is None or p >= hi * (1 - tol)
        return p is not None and abs(m - p) <= tol * max(p, 1e-9)

    def describe(self) -> str:
        def f(x):
            if x is None:
                return f"route wins past M_q {self.span[1]:g}"
            if x == 0.0:
                return f"fetch wins from M_q {self.span[0]:g}"
            return f"M_q {x:.0f}"

        return f"measured {f(self.measured)}, predicted {f(self.predicted)}"


def crossovers(records: Iterable[dict], geometry: MLAGeometry | None = None) -> list[Crossover]:
    """:class:`Crossover` at every ``c_t`` with a fetch record and route points (the bench's
    geometry: DeepSeek-V2-Lite's 576-wide bf16 entry, unless ``geometry``)."""
    from mqnc.model import PRESETS

    records = list(records)
    g = geometry or PRESETS["deepseek-v2-lite"]
    out = []
    for c_t in sorted({int(r["x"]) for r in records if r.get("bench") == "fetch"}):
        try:
            m, span = measured_crossover(records, c_t)
            p = predicted_crossover(device_profile(records, c_t), g, c_t)
        except ValueError:
            continue
        out.append(Crossover(c_t, m, p, span))
    return out
