"""One calibration of a fabric's route terms from what was measured (§4.3).

Every calibration times payload-free probes and routed round trips of a few sizes, then needs
``T_probe``, ``BW`` and the turnaround from them: ``mqnc calibrate``
(:func:`mqnc.measure.calibrate.calibrate`, an echo holder), the demo's calibration against its
holders (:mod:`mqnc.demo.calibration`) and the Hugging Face session's
(:func:`mqnc.integrations.hf_predicate.measure_constants`). The last two time the same calls
through a requester (:mod:`mqnc.serving.calibration_samples`, each with its own counts); ``mqnc
calibrate`` times the bare transport. :func:`fit_route` is the one way all three turn the
measurements into terms, and :meth:`RouteFit.fabric` the one way into a
:class:`~mqnc.cost.FabricProfile` (then a :class:`~mqnc.cost.MachineProfile` with the compute
terms each measures).

When the fit fails (decode-sized rows on a fast local link are all fixed cost: the slope
drowns in noise) the route's fixed part is still known: the smallest round trip less the probe
(and less its rows' bytes at the bulk pull's rate, when that was measured), and the rows' bytes
move at the bulk rate.

The calibrations that time calls through a requester (the demo's and the Hugging Face session's,
:mod:`mqnc.serving.calibration_samples`) fit their other lines here too: :func:`theil_sen` and
:func:`robust_affine` (the holder's kernel call over its work, fetch's pull over its bytes,
:func:`fit_pull`), and :func:`bulk_rate_gbps` turns a timed transfer into a rate (``mqnc
calibrate``'s bulk pull as well).

numpy only (no torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mqnc.cost.fabric import FabricProfile, bytes_to_us
from mqnc.cost.fitting import FitResult, fit

__all__ = [
    "RouteFit",
    "fit_route",
    "theil_sen",
    "robust_affine",
    "fit_pull",
    "bulk_rate_gbps",
    "TPFit",
    "fit_tp",
    "fit_device_route",
]


@dataclasses.dataclass(frozen=True)
class RouteFit:
    """A fabric's route terms from one calibration (us, GB/s).

    Attributes
    ----------
    t_probe_us : float
        The median probe.
    turnaround_us : float
        The fit's intercept less the probe, clamped at 0 (a negative one is not a time,
        :class:`~mqnc.cost.FitResult`); when the fit failed, the fixed part beyond the probe.
    bw_gbps : float or None
        The route bandwidth; None when the fit failed and no bulk rate was given.
    fit : FitResult or None
        The fit (None when it failed).
    error : str or None
        Why the fit failed (None when it did not).
    """

    t_probe_us: float
    turnaround_us: float
    bw_gbps: float | None
    fit: FitResult | None
    error: str | None

    def terms(self) -> dict[str, float]:
        """The fabric terms it gives (``bw_gbps`` only when known)."""
        out = dict(t_probe_us=self.t_probe_us, turnaround_us=self.turnaround_us)
        if self.bw_gbps is not None:
            out["bw_gbps"] = self.bw_gbps
        return out

    def fabric(self, name: str, **fields: Any) -> FabricProfile:
        """The fabric: the fit's (:meth:`FitResult.to_fabric`, with its MAPE), else one with
        the fixed part and the bulk rate; ``fields`` as in :class:`FabricProfile`."""
        if self.fit is not None:
            return self.fit.to_fabric(name, **fields)
        if self.bw_gbps is None:
            raise ValueError(f"bw_gbps: the route fit failed ({self.error}) and no bulk rate")
        return FabricProfile(
            name,
            t_probe_us=self.t_probe_us,
            bw_gbps=self.bw_gbps,
            turnaround_us=self.turnaround_us,
            **fields,
        )


def fit_route(
    samples: Iterable[Sequence[float]],
    probes_us: Iterable[float],
    *,
    qp_row_bytes: int,
    fit_min_rows: int = 512,
    bulk_bw_gbps: float | None = None,
    strict: bool = False,
) -> RouteFit:
    """``T_probe``, ``BW`` and the turnaround from measured probes and route round trips.

    Parameters
    ----------
    samples : iterable of (M_q, round_trip_us)
        Routed round trips (the holder's compute left out), repeats allowed.
    probes_us : iterable of float
        Payload-free round trips (their median is ``T_probe``).
    qp_row_bytes : int
        ``q + p`` bytes per routed row.
    fit_min_rows : int
        As in :func:`mqnc.cost.fit`.
    bulk_bw_gbps : float or None
        The bulk pull's rate, when measured: the rows' rate when the fit fails.
    strict : bool
        Raise the fit's ``ValueError`` instead of falling back.

    Returns
    -------
    RouteFit
    """
    samples = [(float(m), float(t)) for m, t in samples]
    probes = [float(p) for p in probes_us]
    if not probes:
        raise ValueError("probes_us: expected at least one probe round trip, got none")
    try:
        res = fit(samples, qp_row_bytes=qp_row_bytes, probe_us=probes, fit_min_rows=fit_min_rows)
    except ValueError as exc:
        if strict or not samples:
            raise
        probe = float(np.median(probes))
        # the fixed part: each round trip less its rows' bytes (at the bulk rate, if known)
        rate = bulk_bw_gbps
        fixed = min(
            t - (0.0 if rate is None else bytes_to_us(m * qp_row_bytes, rate)) for m, t in samples
        )
        return RouteFit(probe, max(fixed - probe, 0.0), bulk_bw_gbps, None, str(exc))
    return RouteFit(res.t_probe_us, max(res.turnaround_us, 0.0), res.bw_gbps, res, None)


def theil_sen(pairs: Iterable[Sequence[float]]) -> tuple[float, float] | None:
    """The Theil-Sen line through ``(x, y)`` points.

    The slope is the median of the slopes between every two points at different ``x``, the
    intercept the median of ``y - slope * x``. A point the OS descheduled moves neither (a
    median), unlike a least-squares line, whose intercept swings with one slow call at an end
    of the range.

    Parameters
    ----------
    pairs : iterable of (x, y)

    Returns
    -------
    (intercept, slope) or None
        None when no two points have different ``x`` (every point at one ``x``, or fewer than
        two points).
    """
    pts = _points("pairs", pairs)
    x, y = pts[:, 0], pts[:, 1]
    i, j = np.triu_indices(x.size, k=1)
    apart = x[i] != x[j]
    if not apart.any():
        return None
    i, j = i[apart], j[apart]
    slope = float(np.median((y[j] - y[i]) / (x[j] - x[i])))
    return float(np.median(y - slope * x)), slope


def robust_affine(pairs: Iterable[Sequence[float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of the Theil-Sen line (:func:`theil_sen`) through ``(x, y)``;
    proportional through the origin (intercept 0, slope the median of ``y / x``) when no
    rising line with a non-negative intercept fits.

    Raises
    ------
    ValueError
        No point, or (for the proportional fallback) a point at ``x <= 0``.
    """
    pts = _points("pairs", pairs)
    if not len(pts):
        raise ValueError("pairs: expected at least one (x, y) point, got none")
    line = theil_sen(pts)
    if line is not None and line[1] > 0 and line[0] >= 0:
        return line
    if (pts[:, 0] <= 0).any():
        raise ValueError(
            f"pairs: the proportional fit needs every x > 0, got x = {pts[:, 0].min():g}"
        )
    return 0.0, float(np.median(pts[:, 1] / pts[:, 0]))


def fit_pull(points: Iterable[Sequence[float]]) -> dict[str, float]:
    """Fetch's pull, ``fixed + bytes / bulk rate``, from ``(bytes, us)`` over chunk sizes
    (:func:`robust_affine`: Theil-Sen; proportional through the origin when the sizes do not
    say more).

    Returns
    -------
    dict
        ``fetch_fixed_us`` (the request's round trip, us) and ``bulk_bw_gbps`` (GB/s).
    """
    fixed, slope = robust_affine(points)
    if not slope > 0:
        raise ValueError(f"points: expected a pull that grows with its bytes, got slope {slope}")
    return dict(fetch_fixed_us=fixed, bulk_bw_gbps=bulk_rate_gbps(1.0, slope))


def bulk_rate_gbps(nbytes: float, us: float) -> float:
    """The rate (GB/s) of ``nbytes`` moved in ``us`` microseconds."""
    if not (np.isfinite(us) and us > 0):
        raise ValueError(f"us: expected a finite time > 0, got {us!r}")
    return float(nbytes) / (float(us) * 1e3)


def _points(name: str, pairs) -> np.ndarray:
    """``pairs`` as an ``[n, 2]`` float64 array (a ValueError naming ``name`` otherwise)."""
    pts = np.asarray([tuple(p) for p in pairs], dtype=np.float64)
    if not len(pts):
        return pts.reshape(0, 2)
    if pts.ndim != 2 or pts.shape[1] != 2:
        raise ValueError(f"{name}: expected (x, y) pairs, got an array of shape {pts.shape}")
    if not np.isfinite(pts).all():
        raise ValueError(f"{name}: expected finite numbers, got {pts[~np.isfinite(pts)][:3]}")
    return pts


@dataclasses.dataclass(frozen=True)
class TPFit:
    """The cost model's tensor-parallel term (§8: each of ``N`` rank pairs ships ``1/N`` of the
    bytes, in parallel) fitted from rank-paired round trips (``perf/bench_tp.py``'s
    ``tp_route`` records): ``T(N) = fixed + (N - 1) group + rank_bytes / bw``.

    Attributes
    ----------
    fixed_us : float
        The round trip's fixed part (probe, agreement, compute at these sizes).
    group_us : float
        What each further rank of the instances adds (the holder group's agreement and score
        reduction, and, on one host, the ranks' share of its cores); 0 when the records have
        one degree, or when the three-term fit is not a valid one (then the two-term line).
    bw_gbps : float
        One rank pair's rate.
    rank_fraction : dict
        ``N ->`` one rank pair's measured wire bytes over the ``N = 1`` pair's (mean over
        ``M_q``); the model's term is ``1 / N`` (the replicated 8-byte ``(m, l)`` per row and the
        headers make it slightly more).
    mape : float
        Mean absolute percentage error of the fit over the records (0.1 = 10%).
    """

    fixed_us: float
    group_us: float
    bw_gbps: float
    rank_fraction: dict
    mape: float

    def predict_us(self, rank_bytes: float, degree: int = 1) -> float:
        """The fitted round trip of a rank pair moving ``rank_bytes`` at TP ``degree``."""
        return self.fixed_us + (degree - 1) * self.group_us + bytes_to_us(rank_bytes, self.bw_gbps)

    def summary(self) -> str:
        frac = ", ".join(
            f"N={n}: {100 * f:.1f}% (model {100 / n:.1f}%)"
            for n, f in sorted(self.rank_fraction.items())
        )
        return (
            f"TP fit: round trip = {self.fixed_us:.0f} us + (N - 1) x {self.group_us:.0f} us + "
            f"rank bytes / {self.bw_gbps:.3g} GB/s (MAPE {100 * self.mape:.0f}%); bytes per rank "
            f"pair vs N = 1: {frac}"
        )


def _tp_line(recs: list[dict]) -> tuple[float, float, float]:
    """``(fixed, group, slope)``: non-negative least squares over ``[1, N - 1, bytes]`` (every
    subset of the three terms that keeps the bytes' slope, solved exactly, the best whose
    coefficients are all >= 0), else the Theil-Sen line over the bytes (group 0)."""
    x = np.array([[1.0, r["extra"]["degree"] - 1.0, float(r["bytes"])] for r in recs])
    y = np.array([float(r["p50"]) for r in recs])
    best = None
    for cols in ([0, 1, 2], [1, 2], [0, 2], [2]):
        if len(recs) < len(cols) or (1 in cols and len(set(x[:, 1])) < 2):
            continue
        c, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (c < 0).any() or not c[-1] > 0:
            continue
        full = np.zeros(3)
        full[cols] = c
        err = float(np.sum((x @ full - y) ** 2))
        if best is None or err < best[0]:
            best = (err, full)
    if best is not None:
        return float(best[1][0]), float(best[1][1]), float(best[1][2])
    fixed, slope = robust_affine(list(zip(x[:, 2], y, strict=True)))
    return fixed, 0.0, slope


def fit_tp(records: Iterable[dict]) -> TPFit:
    """Fit :class:`TPFit` from ``tp_route`` records (``bytes``: one rank pair's wire bytes,
    ``p50``: the round trip in us, ``extra["degree"]`` and ``extra["rank_fraction"]``).

    Raises
    ------
    ValueError
        No record, or the times do not grow with the bytes.
    """
    recs = [r for r in records if r.get("bench") == "tp_route"]
    if not recs:
        raise ValueError("records: expected tp_route records (perf/bench_tp.py), got none")
    fixed, group, slope = _tp_line(recs)
    if not slope > 0:
        raise ValueError(f"records: expected round trips that grow with the bytes, got {slope}")
    fit_ = TPFit(fixed, group, bulk_rate_gbps(1.0, slope), {}, 0.0)
    err = [
        abs(fit_.predict_us(r["bytes"], r["extra"]["degree"]) - r["p50"]) / r["p50"] for r in recs
    ]
    by_n: dict[int, list[float]] = {}
    for r in recs:
        by_n.setdefault(int(r["extra"]["degree"]), []).append(float(r["extra"]["rank_fraction"]))
    frac = {n: float(np.mean(v)) for n, v in by_n.items()}
    return dataclasses.replace(fit_, rank_fraction=frac, mape=float(np.mean(err)))


def fit_device_route(
    records: Iterable[dict],
    *,
    heads: int = 16,
    qp_row_bytes: int = 2184,
    name: str | None = None,
    c_t: int | None = None,
    bulk_bw_gbps: float | None = None,
) -> FabricProfile:
    """The device route's profile, fitted from ``perf.bench_device_route`` records.

    Takes the records' probe (``bench="probe"``) and their one-requester route sweep at
    ``heads`` heads (``bench="route"``, ``extra.requesters == 1``: ``x`` = M_q, ``p50`` the
    round trip per routed layer, host-free), and fits ``T_probe + turnaround + M_q (q + p) /
    BW`` (:func:`fit_route`, ``M_q >= 512`` for the MAPE). The device route's round trip
    includes the holder kernel's partial attention over the chunk (``extra.c_t`` entries): the
    fitted turnaround and bandwidth carry that compute, which the host-driven fabrics' echo
    round trips leave to ``T_compute``; the profile's ``description`` says so and its
    ``source`` names the records' device, commit and ``c_t``. ``host_fixed_us`` is 0 (no host
    call per routed layer: the step is a replayed CUDA graph). ``c_t``: only route points over
    chunks of that size (the compute the fit carries is that chunk's; None: every size).
    ``bulk_bw_gbps``: the device's measured pull rate, the rows' rate when the round trip does
    not grow with ``M_q`` beyond the timing's noise (the turnaround then the fastest round
    trip's less the probe; the fabric's ``description`` says so); None: that is an error. A
    ``ValueError`` when the records hold no probe or fewer than two route points.
    """
    recs = [r for r in records if str(r.get("transport", "")).startswith("device-")]
    probes = [float(r["p50"]) for r in recs if r.get("bench") == "probe"]
    route = [
        r
        for r in recs
        if r.get("bench") == "route"
        and r.get("extra", {}).get("requesters") == 1
        and r.get("extra", {}).get("heads") == heads
        and (c_t is None or r.get("extra", {}).get("c_t") == c_t)
    ]
    if not probes or len({r["x"] for r in route}) < 2:
        raise ValueError(
            f"records: expected a device-route probe and route points at >= 2 M_q values "
            f"({heads} heads, one requester), got {len(probes)} probes and "
            f"{len({r['x'] for r in route})} M_q values"
        )
    points = [(r["x"], r["p50"]) for r in route]
    res = fit_route(points, probes, qp_row_bytes=qp_row_bytes, strict=bulk_bw_gbps is None)
    if res.error is not None:  # all fixed cost: the fastest round trip, rows at the pull rate
        probe = float(np.median(probes))
        fixed = max(min(t for _, t in points) - probe, 0.0)
        res = RouteFit(probe, fixed, bulk_bw_gbps, None, res.error)
    first = route[0]
    transport = str(first.get("transport"))
    source = (
        f"perf.bench_device_route on {first.get('device', '?')} at commit "
        f"{first.get('commit', '?')}, c_t {first.get('extra', {}).get('c_t', '?')}"
    )
    return res.fabric(
        name or transport,
        host_fixed_us=0.0,
        host_per_row_us=0.0,
        description=(
            "device route (the holder's pass or resident kernels, requester step in a CUDA "
            "graph); the round trip includes the holder's partial attention over the chunk"
            + ("" if res.error is None else f"; rows at the pull rate ({res.error})")
        ),
        source=source,
    )
