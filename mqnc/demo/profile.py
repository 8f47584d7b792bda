"""What ``mqnc demo --profile FILE`` loads (torch-free: read before any work starts).

Two kinds of file are accepted:

- a **fabric profile** (``mqnc calibrate``, ``mqnc fit --save``, :meth:`FabricProfile.save`):
  the transport's terms (``T_probe``, ``BW``, turnaround, the bulk pull's rate and, where the
  profile carries one, the host overhead); the demo calibrates the rest (holder compute, merge,
  splice, re-prefill) against its own holders;
- a **demo profile** (``demo_profile.json``, written by every run into ``--out``): the fabric
  and every demo term, with the device, kernels and transport they were measured with. All of
  it is loaded and nothing is recalibrated, except the compute terms when the profile was
  measured with other kernels or on another device (then those are measured again, and the
  run says so).

A preset fabric name (``h100-ibgda``, ...) is accepted too, as by ``mqnc predict --fabric``.
"""

from __future__ import annotations

import dataclasses
import json
import os

from mqnc.cost import FABRICS, FabricProfile

__all__ = ["DEMO_PROFILE", "COMPUTE_TERMS", "DEMO_TERMS", "LoadedProfile", "load_profile"]

DEMO_PROFILE = "mqnc-demo-profile"
"""The ``kind`` of a demo profile file."""

COMPUTE_TERMS = (
    "send_us",
    "send_alone_us",
    "compute_fixed_us",
    "compute_us_per_row_token",
    "host_us",
    "splice_us_per_token",
    "scatter_us_per_token",
    "merge_us",
)
"""The demo terms computed by the kernels (``--kernels``) on the device: measured again when a
profile was measured with other kernels or on another device. A send rotates the query; the
splice re-rotates and writes a fetched chunk into the pool, the scatter only writes it (a chunk
used at its canonical position)."""

DEMO_TERMS = (*COMPUTE_TERMS, "fetch_fixed_us", "c_us")
"""Every demo term a demo profile holds, besides the fabric."""


@dataclasses.dataclass(frozen=True)
class LoadedProfile:
    """A profile file's content: the fabric, the demo terms it holds (a demo profile's; empty
    for a fabric profile) and what they were measured with (``device``, ``kernels``,
    ``transport``, ``device_name``; empty for a fabric profile)."""

    path: str
    fabric: FabricProfile
    terms: dict[str, float]
    measured_with: dict[str, str]


def _bad(path: str, why: str) -> ValueError:
    return ValueError(
        f"profile: {path!r} is not a profile ({why}); expected a fabric profile JSON "
        "(mqnc calibrate, mqnc fit --save), a demo_profile.json written by mqnc demo, or a "
        f"preset fabric name {sorted(FABRICS)}"
    )


def load_profile(path: str) -> LoadedProfile:
    """Read ``path`` (see the module docstring); a missing file is a ``FileNotFoundError``, a
    file that is not a profile a ``ValueError``, both naming it."""
    if path in FABRICS:
        return LoadedProfile(path, FABRICS[path], {}, {})
    if not os.path.isfile(path):
        raise FileNotFoundError(f"profile: no such file {path!r}")
    try:
        with open(path) as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _bad(path, f"a JSON {type(data).__name__}, not an object")
    terms: dict[str, float] = {}
    measured_with: dict[str, str] = {}
    if data.get("kind") == DEMO_PROFILE:
        missing = [k for k in ("fabric", "terms", "measured_with") if k not in data]
        if missing:
            raise _bad(path, f"a demo profile without {missing}")
        terms = {k: float(v) for k, v in data["terms"].items() if k in DEMO_TERMS}
        measured_with = {k: str(v) for k, v in data["measured_with"].items()}
        data = data["fabric"]
    try:
        fabric = FabricProfile.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise _bad(path, str(exc)) from None
    return LoadedProfile(path, fabric, terms, measured_with)
