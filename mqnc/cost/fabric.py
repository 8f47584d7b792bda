"""Fabric profiles: the two (plus two optional) constants the cost model needs per fabric.

A fabric enters the cost model of §4 only through

- ``t_probe_us``: the payload-free put-plus-signal round trip (the paper's ``sig_rt``, §3.2);
- ``bw_gbps``: the effective route bandwidth, the slope of the round trip against
  ``M_q (q + p)`` (§4.3). On every fabric the paper measures it is the single-block dispatch
  rate (18-25 GB/s), not the link peak (§8);
- ``turnaround_us``: the fixed kernel turnaround beyond the probe that the two-constant form
  omits (≈9 us on H100 IBGDA, §4.3); the affine fit's intercept minus the probe;
- ``link_peak_gbps``: the per-GPU-pair link rate a multi-block bulk transfer reaches
  (Fig. 6(a)'s dashed ticks), which fetch's coalesced bulk pull sees (§8, "fetch is the mirror
  image"). ``bulk_bw_gbps`` falls back to it, then to ``bw_gbps``.

Units throughout: microseconds and GB/s with 1 GB = 1e9 bytes (so ``bytes / (bw_gbps * 1e3)``
is microseconds).

Presets (:data:`FABRICS`) are the paper's Table 2, the five measured fabrics, with the link peaks
of §8 / Fig. 6(a). Only H100 IBGDA has a published turnaround (§4.3: "a fixed ∼9 us kernel
turnaround beyond the probe"); for the others the paper reports only the two-constant fit, so
their turnaround is 0 and the fit's MAPE (also stored) says how far that form is off. (The
single decode points of §8 imply ~6 us for A100 NVLink 3.0, 39 us measured vs 32.7 us modelled,
and ~2 us for RTX Pro 6000 PCIe Gen5, 32 vs 30.2 us; we do not put numbers read off one
rounded point into a preset.)

A profile is saved to / loaded from JSON (what ``mqnc fit --save`` and ``mqnc calibrate``
write)::

    >>> from mqnc.cost import get_fabric
    >>> f = get_fabric("h100-ibgda")
    >>> f.t_probe_us, f.bw_gbps, f.turnaround_us, f.bulk_bw
    (16.0, 25.0, 9.0, 25.0)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from mqnc.base.checks import check_number

__all__ = ["FabricProfile", "FABRICS", "get_fabric", "load_fabric", "bytes_to_us"]


def bytes_to_us(nbytes, gbps):
    """Microseconds to move ``nbytes`` at ``gbps`` (1 GB/s = 1e3 bytes per microsecond)."""
    return nbytes / (gbps * 1e3)


@dataclasses.dataclass(frozen=True)
class FabricProfile:
    """The constants of one fabric (§4.3, Table 2).

    Parameters
    ----------
    name : str
        Short identifier (``"h100-ibgda"``).
    t_probe_us : float
        ``T_probe``: the 1-byte put-plus-signal round trip, microseconds (> 0).
    bw_gbps : float
        ``BW``: effective route bandwidth (GB/s, 1e9 B/s), the slope of the round trip in bytes.
    turnaround_us : float, default 0
        Fixed kernel turnaround beyond the probe (intercept minus probe of the affine fit).
    link_peak_gbps : float or None
        Per-GPU-pair link peak (what a multi-block transfer reaches), GB/s.
    bulk_bw_gbps : float or None
        Bandwidth of fetch's coalesced bulk pull; defaults to ``link_peak_gbps``, then ``bw_gbps``.
    mape_amortised, mape_full : float or None
        MAPE (fraction, 0.07 = 7%) of the two-constant form over ``M_q >= 512`` and over all
        points, as Table 2 reports them.
    host_fixed_us, host_per_row_us : float or None
        The host software of a routed call beyond the transport, ``fixed + per_row * M_q``
        (§5.3's host term, :class:`mqnc.cost.HostOverhead`): what ``mqnc calibrate`` measures
        for this package's holder and requester. None for the paper's fabrics (transport
        alone). :func:`mqnc.cost.t_route` adds it unless given another ``host``.
    description, source : str
        What the fabric is and where the numbers come from.
    """

    name: str
    t_probe_us: float
    bw_gbps: float
    turnaround_us: float = 0.0
    link_peak_gbps: float | None = None
    bulk_bw_gbps: float | None = None
    mape_amortised: float | None = None
    mape_full: float | None = None
    host_fixed_us: float | None = None
    host_per_row_us: float | None = None
    description: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"FabricProfile.name: expected a non-empty str, got {self.name!r}")
        for field in ("t_probe_us", "bw_gbps"):
            check_number(f"FabricProfile.{field}", getattr(self, field), positive=True)
        check_number("FabricProfile.turnaround_us", self.turnaround_us, nonnegative=True)
        for field in ("link_peak_gbps", "bulk_bw_gbps"):
            value = getattr(self, field)
            if value is not None:
                check_number(f"FabricProfile.{field}", value, positive=True)
        for field in ("mape_amortised", "mape_full", "host_fixed_us", "host_per_row_us"):
            value = getattr(self, field)
            if value is not None:
                check_number(f"FabricProfile.{field}", value, nonnegative=True)

    @property
    def bulk_bw(self) -> float:
        """Bulk-pull GB/s: ``bulk_bw_gbps``, else ``link_peak_gbps``, else ``bw_gbps``."""
        if self.bulk_bw_gbps is not None:
            return float(self.bulk_bw_gbps)
        if self.link_peak_gbps is not None:
            return float(self.link_peak_gbps)
        return float(self.bw_gbps)

    def replace(self, **changes: Any) -> FabricProfile:
        """A copy with some fields changed (``f.replace(bw_gbps=70.0)``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FabricProfile:
        """Build from a dict (e.g. parsed JSON); unknown keys are an error naming them.

        A machine profile's dict (:class:`mqnc.cost.MachineProfile`, ``"schema"``; or a
        version-0 demo profile, ``"kind"``) gives its fabric.
        """
        if not isinstance(data, dict):
            raise TypeError(f"data: expected a dict, got {type(data).__name__}")
        if "schema" in data or "kind" in data:
            data = _fabric_of(data)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(
                f"fabric profile: unknown keys {unknown}; expected a subset of {sorted(fields)}"
            )
        missing = [k for k in ("name", "t_probe_us", "bw_gbps") if k not in data]
        if missing:
            raise ValueError(f"fabric profile: missing keys {missing}")
        return cls(**data)

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> FabricProfile:
        """Read a profile written by :meth:`save`, or the fabric of a machine profile
        (``mqnc calibrate``, ``mqnc fit --save``, a demo profile)."""
        with open(path) as f:
            return cls.from_dict(json.load(f))


PROFILE_SCHEMA = "mqnc-profile"
"""The ``schema`` of a machine profile file (:class:`mqnc.cost.MachineProfile`)."""
PROFILE_VERSION = 1
"""The version this package writes and reads (files without a schema are version 0)."""
DEMO_PROFILE_KIND = "mqnc-demo-profile"
"""The ``kind`` of a version-0 demo profile (``demo_profile.json`` before the schema)."""


def _fabric_of(data: dict) -> Any:
    """The fabric of a machine profile's dict (any version :class:`mqnc.cost.MachineProfile`
    reads; checked in full there), or an error naming the schema and version."""
    versioned = data.get("schema") == PROFILE_SCHEMA and data.get("version") == PROFILE_VERSION
    if not (versioned or ("schema" not in data and data.get("kind") == DEMO_PROFILE_KIND)):
        raise ValueError(
            f"fabric profile: schema {data.get('schema')!r} version {data.get('version')!r} "
            f"(kind {data.get('kind')!r}) is not supported; this mqnc reads {PROFILE_SCHEMA!r} "
            f"version {PROFILE_VERSION} and version-0 fabric and demo profiles"
        )
    if "fabric" not in data:
        raise ValueError("fabric profile: a machine profile without 'fabric'")
    return data["fabric"]


# Table 2 (T_probe, BW, MAPE amortised / full); link peaks from §8 and Fig. 6(a); the IBGDA
# turnaround from §4.3.
FABRICS: dict[str, FabricProfile] = {
    f.name: f
    for f in (
        FabricProfile(
            "h100-ibgda",
            16.0,
            25.0,
            turnaround_us=9.0,
            link_peak_gbps=25.0,
            mape_amortised=0.07,
            mape_full=0.16,
            description="H100 SXM5, cross-node NVSHMEM IBGDA over InfiniBand NDR-200",
            source="paper Table 2; turnaround §4.3; NDR-200 link 25 GB/s (Fig. 6(a))",
        ),
        FabricProfile(
            "h100-nvlink4",
            1.2,
            21.0,
            link_peak_gbps=125.0,
            mape_amortised=0.03,
            mape_full=0.18,
            description="H100 SXM5, intra-node NVLink 4.0, NV6 direct (no NVSwitch)",
            source="paper Table 2; pair peak ~125 GB/s for six links (§8)",
        ),
        FabricProfile(
            "a100-nvlink3",
            1.6,
            18.0,
            link_peak_gbps=235.0,
            mape_amortised=0.04,
            mape_full=0.22,
            description="A100, NVLink 3.0 through NVSwitch",
            source="paper Table 2; NVSwitch pair rate 235 GB/s (§8)",
        ),
        FabricProfile(
            "rtx-pro-6000-pcie5",
            4.8,
            22.0,
            link_peak_gbps=41.0,
            mape_amortised=0.02,
            mape_full=0.07,
            description="RTX Pro 6000, PCIe Gen5 P2P",
            source="paper Table 2; PCIe Gen5 pair rate 41 GB/s (§8)",
        ),
        FabricProfile(
            "a40-pcie4",
            8.7,
            19.0,
            link_peak_gbps=19.0,
            mape_amortised=0.13,
            mape_full=0.16,
            description="A40, PCIe Gen4 same-socket P2P (wire-bound)",
            source="paper Table 2; PCIe Gen4 pair rate 19 GB/s (§8)",
        ),
    )
}


def get_fabric(name: str) -> FabricProfile:
    """Look a preset fabric up by name; an unknown name lists the valid ones."""
    try:
        return FABRICS[name]
    except KeyError:
        raise ValueError(
            f"fabric: unknown preset {name!r}; expected one of {sorted(FABRICS)} "
            "or a path to a fabric JSON file"
        ) from None


def load_fabric(name_or_path: str | os.PathLike) -> FabricProfile:
    """A preset name, or a path to a JSON profile written by :meth:`FabricProfile.save`."""
    key = os.fspath(name_or_path)
    if key in FABRICS:
        return FABRICS[key]
    if key.endswith(".json") or os.path.exists(key):
        if not os.path.exists(key):
            raise FileNotFoundError(f"fabric: no such profile file {key!r}")
        return FabricProfile.load(key)
    return get_fabric(key)
