"""What ``mqnc demo --profile FILE`` loads (torch-free: read before any work starts).

Every profile file is a :class:`mqnc.cost.MachineProfile` (one versioned JSON schema,
:func:`mqnc.cost.MachineProfile.load`): the fabric and the compute terms it holds, with the
device, kernels and transport they were measured with.

- a profile with only the fabric (``mqnc calibrate``, ``mqnc fit --save``, a version-0 fabric
  file of :meth:`FabricProfile.save`): the transport's terms (``T_probe``, ``BW``, turnaround,
  the bulk pull's rate and, where the profile carries one, the host overhead); the demo
  calibrates the rest (holder compute, merge, splice, re-prefill) against its own holders;
- a demo profile (``demo_profile.json``, written by every run into ``--out``; version 0:
  ``"kind": "mqnc-demo-profile"``): the fabric and every demo term. All of it is loaded and
  nothing is recalibrated, except the compute terms when the profile was measured with other
  kernels or on another device (then those are measured again, and the run says so).

A preset fabric name (``h100-ibgda``, ...) is accepted too, as by ``mqnc predict --fabric``.
"""

from __future__ import annotations

import dataclasses

from mqnc.cost import DEMO_PROFILE_KIND, FABRICS, MEASURED_TERMS, FabricProfile, MachineProfile

__all__ = ["DEMO_PROFILE", "COMPUTE_TERMS", "DEMO_TERMS", "LoadedProfile", "load_profile"]

DEMO_PROFILE = DEMO_PROFILE_KIND
"""The ``kind`` of a version-0 demo profile file (the versioned schema has none)."""

COMPUTE_TERMS = tuple(t for t in MEASURED_TERMS if t not in ("fetch_fixed_us", "c_us"))
"""The demo terms computed by the kernels (``--kernels``) on the device: measured again when a
profile was measured with other kernels or on another device. A send rotates the query; the
splice re-rotates and writes a fetched chunk into the pool, the scatter only writes it (a chunk
used at its canonical position)."""

DEMO_TERMS = MEASURED_TERMS
"""Every demo term a demo profile holds, besides the fabric (:data:`COMPUTE_TERMS`, then
``fetch_fixed_us`` and ``c_us``)."""


@dataclasses.dataclass(frozen=True)
class LoadedProfile:
    """A profile file's content: the fabric, the demo terms it holds (empty for a profile
    with only the fabric) and what they were measured with (``device``, ``kernels``,
    ``transport``, ``device_name``; empty for a fabric)."""

    path: str
    fabric: FabricProfile
    terms: dict[str, float]
    measured_with: dict[str, str]


def _bad(path: str, why: str) -> ValueError:
    return ValueError(
        f"profile: {path!r} is not a profile ({why}); expected a profile JSON "
        "(mqnc calibrate, mqnc fit --save), a demo_profile.json written by mqnc demo, or a "
        f"preset fabric name {sorted(FABRICS)}"
    )


def load_profile(path: str) -> LoadedProfile:
    """Read ``path`` (see the module docstring); a missing file is a ``FileNotFoundError``, a
    file that is not a profile (or of a version this package does not read) a ``ValueError``,
    both naming it."""
    if path in FABRICS:
        return LoadedProfile(path, FABRICS[path], {}, {})
    try:
        profile = MachineProfile.load(path)
    except (TypeError, ValueError) as exc:
        raise _bad(path, str(exc)) from None
    return LoadedProfile(path, profile.fabric, profile.terms(), dict(profile.measured_with))
