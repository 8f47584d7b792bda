"""Fitting the cost model's constants to measurements (§4.3, §6.3).

- :func:`fit` / :func:`fit_groups`: a fabric's ``(T_probe, BW, turnaround)`` from measured
  round trips against ``M_q (q + p)`` (affine least squares, MAPE as the paper reports it,
  Table 2), from samples or from a results file, one fit per sweep (device, transport, row
  size, commit); :func:`newest_group` is the sweep ``mqnc fit --save`` takes by default;
- :func:`knee_fit`: the holder's flat-then-linear compute law ``t0 + s max(0, N - N0)`` over
  ``N`` batched requesters (§6.3, Fig. 4(b));
- :func:`fit_host`: the host software's ``fixed + per_row * M_q`` (§5.3) from calls through
  the package beside the transport alone at the same ``M_q``;
- :func:`mape`: the error statistic;
- :func:`read_jsonl` / :func:`check_record`: the records of a results file, defined in
  :mod:`mqnc.cost.results_reader` and re-exported here.

numpy only (no torch): the ``mqnc fit`` command and the notebooks run it anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mqnc.cost.fabric import FabricProfile, bytes_to_us
from mqnc.cost.results_reader import check_record, read_jsonl  # noqa: F401 - mqnc.cost.fitting.read_jsonl

__all__ = [
    "FitResult",
    "RouteGroup",
    "fit",
    "fit_groups",
    "fit_results",
    "fit_host",
    "knee_fit",
    "mape",
    "newest_group",
]


def mape(predicted, measured) -> float:
    """Mean absolute percentage error as a fraction: mean(|pred - meas| / meas)."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    if p.size == 0:
        return float("nan")
    return float(np.mean(np.abs(p - m) / m))


@dataclasses.dataclass(frozen=True)
class FitResult:
    """A fabric calibrated from measured round trips (§4.3, Table 2).

    ``intercept_us`` and the slope come from an affine least-squares fit of the round trip
    against ``M_q (q + p)``; ``bw_gbps`` is the bytes per unit slope. With the probe measured
    separately (the paper's ``sig_rt``), ``t_probe_us`` is that probe and
    ``turnaround_us = intercept - probe``; without it, the intercept is the probe and the
    turnaround cannot be separated (0).

    A negative ``turnaround_us`` (the intercept below the measured probe) is not a time: a
    holder cannot answer a routed batch faster than an empty probe. It says that the round
    trip is not affine in ``M_q`` over the fitted points (noise, or a slope that changes with
    size) or that the probe was timed under other load; :meth:`to_fabric` stores 0 for it.
    Without a probe a negative intercept is no ``T_probe`` either (a profile rejects it).

    ``mape_amortised`` / ``mape_full`` are the paper's numbers: the two-constant model
    ``T_probe + M_q (q + p) / BW`` "with its measured constants and no refit" (§4.3) over
    ``M_q >= amortised_min_rows`` and over all points. ``mape_*_affine`` are the same for the
    affine fit including the turnaround.
    """

    t_probe_us: float
    bw_gbps: float
    intercept_us: float
    turnaround_us: float
    qp_row_bytes: int
    n_points: int
    n_fit: int
    fit_min_rows: int
    amortised_min_rows: int
    mape_amortised: float
    mape_full: float
    mape_amortised_affine: float
    mape_full_affine: float
    probe_measured: bool

    def predict(self, m_q, *, with_turnaround: bool = True):
        """Modelled round trip (us) at ``m_q`` rows."""
        base = self.intercept_us if with_turnaround else self.t_probe_us
        return base + bytes_to_us(
            np.asarray(m_q, dtype=np.float64) * self.qp_row_bytes, self.bw_gbps
        )

    def to_fabric(self, name: str, **fields: Any) -> FabricProfile:
        """A :class:`FabricProfile` with the fitted constants (extra fields: link peak, ...)."""
        return FabricProfile(
            name=name,
            t_probe_us=self.t_probe_us,
            bw_gbps=self.bw_gbps,
            turnaround_us=max(self.turnaround_us, 0.0),
            # no point at M_q >= amortised_min_rows: the amortised MAPE is undefined (NaN)
            mape_amortised=None if math.isnan(self.mape_amortised) else self.mape_amortised,
            mape_full=None if math.isnan(self.mape_full) else self.mape_full,
            **{"source": "mqnc fit", **fields},
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Over 60 lines by its numpy docstring (20) and signature; the body (51) is one least-squares fit
# and the paper's four MAPE figures of it.
def fit(
    samples: Iterable[Sequence[float]] | np.ndarray,
    *,
    qp_row_bytes: int,
    probe_us=None,
    fit_min_rows: int = 512,
    amortised_min_rows: int = 512,
) -> FitResult:
    """Affine least squares of measured round trips against ``M_q (q + p)`` (§4.3).

    Parameters
    ----------
    samples : iterable of (M_q, round_trip_us), or numpy.ndarray of shape [n, 2]
        Measured round trips (the paper's ``full_rt``) at each batch size; repeats allowed.
    qp_row_bytes : int
        ``q + p`` bytes per routed row (``geometry.qp_row_bytes``; 2184 for V2-Lite).
    probe_us : float or sequence of float or None
        The separately measured payload-free round trip (``sig_rt``), or several (their median).
    fit_min_rows : int
        Fit the slope and intercept over ``M_q >= fit_min_rows`` (the paper reads ``BW`` "from
        the large-M_q slope"); all points are used when fewer than two distinct sizes qualify.
    amortised_min_rows : int
        Threshold of the amortised-regime MAPE (512 in the paper).

    Returns
    -------
    FitResult
    """
    arr = np.asarray(
        list(samples) if not isinstance(samples, np.ndarray) else samples, dtype=np.float64
    )
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(
            f"samples: expected pairs (M_q, round_trip_us) of shape [n, 2], got "
            f"shape {list(arr.shape)}"
        )
    m, rt = arr[:, 0], arr[:, 1]
    if not (np.isfinite(arr).all() and (m > 0).all() and (rt > 0).all()):
        raise ValueError("samples: expected finite, positive M_q and round trips")
    if np.unique(m).size < 2:
        raise ValueError(
            f"samples: expected at least two distinct M_q, got {np.unique(m).tolist()}"
        )
    if not isinstance(qp_row_bytes, (int, np.integer)) or qp_row_bytes <= 0:
        raise ValueError(f"qp_row_bytes: expected a positive int, got {qp_row_bytes!r}")
    sel = m >= fit_min_rows
    if np.unique(m[sel]).size < 2:
        sel = np.ones_like(m, dtype=bool)
    x = m[sel] * qp_row_bytes
    slope, intercept = np.polyfit(x, rt[sel], 1)
    if slope <= 0:
        raise ValueError(f"samples: round trip does not grow with M_q (slope {slope:.3g} us/B)")
    bw = 1.0 / (slope * 1e3)
    if probe_us is None:
        probe, turnaround, measured = float(intercept), 0.0, False
    else:
        probe = float(np.median(np.atleast_1d(np.asarray(probe_us, dtype=np.float64))))
        if not (math.isfinite(probe) and probe > 0):
            raise ValueError(f"probe_us: expected a positive round trip, got {probe_us!r}")
        turnaround, measured = float(intercept) - probe, True
    two = probe + m * qp_row_bytes * slope
    aff = intercept + m * qp_row_bytes * slope
    am = m >= amortised_min_rows
    return FitResult(
        t_probe_us=probe,
        bw_gbps=float(bw),
        intercept_us=float(intercept),
        turnaround_us=float(turnaround),
        qp_row_bytes=int(qp_row_bytes),
        n_points=int(m.size),
        n_fit=int(sel.sum()),
        fit_min_rows=int(fit_min_rows),
        amortised_min_rows=int(amortised_min_rows),
        mape_amortised=mape(two[am], rt[am]),
        mape_full=mape(two, rt),
        mape_amortised_affine=mape(aff[am], rt[am]),
        mape_full_affine=mape(aff, rt),
        probe_measured=measured,
    )


@dataclasses.dataclass(frozen=True)
class RouteGroup:
    """One route sweep of a results file and its fit: the records of one device, transport
    (the record's ``variant``), row size ``q + p`` and commit.

    ``label`` is unique within the file: the variant, then ``@<q+p>B`` when the variant was swept
    at several row sizes, ``/<commit>`` when it was recorded at several commits, ``/<device>``
    when on several devices. ``date`` is the newest record's date (ISO 8601), ``order`` the
    line of its last record (ties of ``date`` go to the later line). ``fit`` is None when the
    sweep cannot be fitted (fewer than two sizes, a round trip that does not grow with
    ``M_q``); ``error`` says why.
    """

    label: str
    variant: str
    device: str
    commit: str
    qp_row_bytes: int
    date: str
    order: int
    fit: FitResult | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fit's fields (if any) and the group's (label, variant, device, commit, date,
        error)."""
        return dict(
            self.fit.to_dict() if self.fit is not None else {"qp_row_bytes": self.qp_row_bytes},
            label=self.label,
            variant=self.variant,
            device=self.device,
            commit=self.commit,
            date=self.date,
            error=self.error,
        )


def fit_groups(
    results: str | os.PathLike | list[dict],
    *,
    qp_row_bytes: int,
    route_bench: str = "route",
    probe_bench: str = "probe",
    **kwargs: Any,
) -> list[RouteGroup]:
    """Fit every route sweep of a results file (the long format of
    :mod:`mqnc.measure.results_file`), one fit per (device, variant, row size, commit).

    Records are never pooled across devices or commits: a file that several machines or
    versions appended to holds several sweeps, and one fit over all of them describes none.
    Expected records: ``bench == route_bench`` ("route"), ``variant`` the transport measured,
    ``x`` = M_q, ``p50`` the round trip in us (``unit`` "us"), the row size in
    ``extra["qp_row_bytes"]`` (default ``qp_row_bytes``, for a payload sweep, Table 1); and
    ``bench == probe_bench`` ("probe") with ``p50`` the 1-byte round trip. A sweep's probe is
    the median of the probe records of the same device, variant and commit; without one,
    ``T_probe`` is the intercept (``probe_measured`` False).

    Parameters
    ----------
    results : path or list of dict
        The results file, or its records (:func:`read_jsonl`).
    qp_row_bytes : int
        Row size of records that do not carry one.
    route_bench, probe_bench : str
        Bench names of the round trips and the probes.
    **kwargs
        Passed to :func:`fit` (``fit_min_rows``, ``amortised_min_rows``).

    Returns
    -------
    list of RouteGroup
        Ordered by variant, row size, then date; a sweep that cannot be fitted is kept with
        ``fit=None`` and the reason in ``error``.
    """
    # a probe needs no x (its payload is fixed); a route record is checked for one below
    if isinstance(results, list):
        recs = [check_record(r, f"record {i}", required=("p50",)) for i, r in enumerate(results)]
    else:
        recs = read_jsonl(results, required=("p50",))
    where = "the records" if isinstance(results, list) else os.fspath(results)
    routes = [(i, r) for i, r in enumerate(recs) if r.get("bench") == route_bench]
    for i, r in routes:
        check_record(r, f"{where}, record {i + 1} (bench {route_bench!r})")
    if not routes:
        benches = sorted({str(r.get("bench")) for r in recs})
        raise ValueError(
            f"results: no records with bench={route_bench!r} in {where}; found benches {benches}"
        )
    probes: dict[tuple[str, str, str], list[float]] = {}
    for r in recs:
        if r.get("bench") == probe_bench:
            probes.setdefault(_sweep_key(r), []).append(float(r["p50"]))
    groups: dict[tuple[str, str, str, int], list[tuple[int, dict]]] = {}
    for i, r in routes:
        if r.get("unit", "us") != "us":
            raise ValueError(f"results: route record with unit {r.get('unit')!r}, expected 'us'")
        qp = int((r.get("extra") or {}).get("qp_row_bytes", qp_row_bytes))
        groups.setdefault((*_sweep_key(r), qp), []).append((i, r))
    labels = _labels(list(groups))
    out = []
    for key, members in groups.items():
        device, variant, commit, qp = key
        pts = [(float(r["x"]), float(r["p50"])) for _, r in members]
        try:
            res, error = fit(pts, qp_row_bytes=qp, probe_us=probes.get(key[:3]), **kwargs), None
        except ValueError as exc:
            res, error = None, str(exc)
        last = max(members, key=lambda m: (str(m[1].get("date") or ""), m[0]))
        out.append(
            RouteGroup(
                label=labels[key],
                variant=variant,
                device=device,
                commit=commit,
                qp_row_bytes=qp,
                date=str(last[1].get("date") or ""),
                order=last[0],
                fit=res,
                error=error,
            )
        )
    return sorted(out, key=lambda g: (g.variant, g.qp_row_bytes, g.date, g.order))


def _sweep_key(r: dict) -> tuple[str, str, str]:
    return (str(r.get("device")), str(r.get("variant")), str(r.get("commit")))


def _labels(keys: list[tuple[str, str, str, int]]) -> dict[tuple[str, str, str, int], str]:
    """Short unique names: variant, then row size, commit and device where they tell apart."""
    out = {}
    for key in keys:
        device, variant, commit, qp = key
        same = [k for k in keys if k[1] == variant]
        label = variant
        if len({k[3] for k in same}) > 1:
            label += f"@{qp}B"
        same = [k for k in same if k[3] == qp]
        if len({k[2] for k in same}) > 1:
            label += f"/{commit}"
        if len([k for k in same if k[2] == commit]) > 1:
            label += f"/{device}"
        out[key] = label
    return out


def newest_group(groups: Sequence[RouteGroup], qp_row_bytes: int) -> RouteGroup:
    """The sweep a saved profile is taken from when none is named: among the sweeps at the
    model's own row size ``qp_row_bytes`` (all sweeps when there is none), the newest (latest
    record date; a tie goes to the one written later in the file); sweeps without a fit are
    passed over."""
    fitted = [g for g in groups if g.fit is not None]
    if not fitted:
        raise ValueError(f"groups: expected at least one fitted route sweep, got {len(groups)}")
    real = [g for g in fitted if g.qp_row_bytes == qp_row_bytes] or fitted
    return max(real, key=lambda g: (g.date, g.order))


def fit_results(
    path: str | os.PathLike,
    *,
    qp_row_bytes: int,
    route_bench: str = "route",
    probe_bench: str = "probe",
    **kwargs: Any,
) -> dict[str, FitResult]:
    """:func:`fit_groups` as ``{label: FitResult}`` (one fit per device, variant, row size and
    commit; the labels are the groups' short unique names); a sweep that cannot be fitted is a
    ValueError naming it."""
    groups = fit_groups(
        path,
        qp_row_bytes=qp_row_bytes,
        route_bench=route_bench,
        probe_bench=probe_bench,
        **kwargs,
    )
    failed = [f"{g.label}: {g.error}" for g in groups if g.fit is None]
    if failed:
        raise ValueError(f"results: cannot fit {'; '.join(failed)}")
    return {g.label: g.fit for g in groups}


def fit_host(samples: Iterable[Sequence[float]]):
    """The host overhead (§5.3) of a client's software from paired measurements.

    Parameters
    ----------
    samples : iterable of (M_q, package_us, transport_us)
        The same routed call's time through the package (holder and requester, the holder's
        kernel stubbed) and through the transport alone (echo holders: what the fabric's
        ``T_probe + turnaround + M_q (q + p) / BW`` describes), at one or more ``M_q``.

    Returns
    -------
    mqnc.cost.HostOverhead
        ``fixed_us + per_row_us * M_q``: least squares of ``package - transport`` against
        ``M_q`` (one ``M_q``: the difference as ``fixed_us``); negative constants, which noise
        can give, are clamped to 0.
    """
    from mqnc.cost.terms import HostOverhead

    arr = np.asarray(list(samples), dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != 3 or not len(arr) or not np.isfinite(arr).all():
        raise ValueError(
            f"samples: expected finite triples (M_q, package_us, transport_us), got shape "
            f"{list(arr.shape)}"
        )
    m, extra = arr[:, 0], arr[:, 1] - arr[:, 2]
    if np.unique(m).size < 2:
        return HostOverhead(max(float(np.median(extra)), 0.0), 0.0)
    slope, intercept = np.polyfit(m, extra, 1)
    if intercept < 0:  # refit through the origin's floor: all of it per row
        slope, intercept = float(np.sum(m * extra) / np.sum(m * m)), 0.0
    return HostOverhead(max(float(intercept), 0.0), max(float(slope), 0.0))


def knee_fit(x, y) -> tuple[float, float, float]:
    """Least squares of ``y = t0 + s max(0, x - n0)`` with the knee ``n0`` chosen among the
    measured ``x`` (sorted ascending, at least two points): ``(t0, s, n0)`` (§6.3's flat-then-
    linear holder compute over ``N`` requesters, Fig. 4(b))."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    best = (np.inf, float(np.median(y)), 0.0, float(x[-1]))
    for n0 in x[:-1]:
        a = np.stack([np.ones_like(x), np.maximum(0.0, x - n0)], axis=1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        err = float(np.sum((a @ coef - y) ** 2))
        if err < best[0]:
            best = (err, float(coef[0]), float(coef[1]), float(n0))
    return best[1], best[2], best[3]
