"""One calibration of a fabric's route terms from what was measured (§4.3).

Every calibration times payload-free probes and routed round trips of a few sizes, then needs
``T_probe``, ``BW`` and the turnaround from them: ``mqnc calibrate``
(:func:`mqnc.measure.calibrate.calibrate`, an echo holder), the demo's calibration against its
holders (:mod:`mqnc.demo.calibration`) and the Hugging Face session's
(:func:`mqnc.integrations.hf_predicate.measure_constants`). They measure differently (what
they route through differs); :func:`fit_route` is the one way all three turn the measurements
into terms, and :meth:`RouteFit.fabric` the one way into a
:class:`~mqnc.cost.FabricProfile` (then a :class:`~mqnc.cost.MachineProfile` with the compute
terms each measures).

When the fit fails (decode-sized rows on a fast local link are all fixed cost: the slope
drowns in noise) the route's fixed part is still known: the smallest round trip less the probe
(and less its rows' bytes at the bulk pull's rate, when that was measured), and the rows' bytes
move at the bulk rate.

numpy only (no torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mqnc.cost.fabric import FabricProfile, bytes_to_us
from mqnc.cost.fitting import FitResult, fit

__all__ = ["RouteFit", "fit_route"]


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
