"""One machine's constants and one request: the two inputs of the predicate (§4, §5).

:class:`MachineProfile` holds every constant the cost model prices a (chunk, request) with on
one machine: the fabric's terms (:class:`~mqnc.cost.FabricProfile`: probe, route bandwidth,
turnaround, bulk-pull rate, host overhead) and the compute terms (the splice, the holder's
compute law, the re-prefill rate ``c``, the merge, the host work per request), each with
where it came from. Every calibration writes one (``mqnc calibrate``, the demo's, the Hugging
Face session's) and every caller of :func:`mqnc.cost.decide` reads one. It is saved and loaded
as one JSON schema with a version field::

    {"schema": "mqnc-profile", "version": 1, "fabric": {...}, "c_us": 0.8, ...}

Files written before the schema load as version 0: a bare fabric profile (``mqnc calibrate``,
``mqnc fit --save``, :meth:`FabricProfile.save`) and a demo profile (``"kind":
"mqnc-demo-profile"``, written by ``mqnc demo`` into ``--out``); a file of another version is
refused with a message naming its version.

:class:`Request` is what is decided: the routed rows ``m_q`` and the chunk ``c_t``, the
selection, the routing pattern, whether the chunk moved, the congestion and the primitives
available.

A compute term left None is not measured: the predicate takes the paper's value for it
(:data:`~mqnc.cost.LOCAL_C_US`, :data:`~mqnc.cost.SPLICE_PAPER`, ...). Adding an input to the
predicate is one field here, its use in :func:`mqnc.cost.decide`, and its test: the JSON form
and the convenience form ``decide(geometry, fabric, m_q, c_t, **kw)`` follow the fields.

Pure Python + numpy (no torch).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from mqnc.base.checks import check_int, check_number
from mqnc.cost.ceilings import spec_tbps
from mqnc.cost.fabric import (
    DEMO_PROFILE_KIND,
    FABRICS,
    PROFILE_SCHEMA,
    PROFILE_VERSION,
    FabricProfile,
    get_fabric,
)
from mqnc.cost.terms import (
    GATHER_PAPER,
    LOCAL_C_US,
    SPLICE_PAPER,
    T_COMPUTE_US,
    T_MERGE_US,
    Congestion,
    GatherProfile,
    HostOverhead,
    SpliceProfile,
    is_scalar,
    t_compute_at,
)

__all__ = [
    "PROFILE_SCHEMA",
    "PROFILE_VERSION",
    "DEMO_PROFILE_KIND",
    "MEASURED_TERMS",
    "MachineProfile",
    "Request",
    "load_profile",
]

PRIMITIVES = ("route", "fetch", "local")
"""The three primitives, in the order of :attr:`mqnc.cost.DecisionGrid.choice` codes."""

MEASURED_TERMS = (
    "send_us",
    "send_alone_us",
    "compute_fixed_us",
    "compute_us_per_row_token",
    "host_us",
    "splice_us_per_token",
    "scatter_us_per_token",
    "merge_us",
    "fetch_fixed_us",
    "c_us",
)
"""The measured compute terms of a profile (us; None: not measured), as a demo profile names
them."""

_SPLICES = ("splice", "splice_fp8", "scatter")
_PROFILE_OBJECTS = ("fabric", *_SPLICES, "gather", "host")
_MAPPINGS = ("measured_with", "sources")


# Every field documented; the methods are what the predicate reads and the JSON form.
@dataclasses.dataclass(frozen=True)
class MachineProfile:
    """One machine's constants for the cost model (§4): the fabric and the compute terms.

    Parameters
    ----------
    fabric : FabricProfile
        The transport's terms: ``T_probe``, route ``BW``, turnaround, bulk-pull rate and, for
        a calibrated profile, the host overhead of this package's holder and requester.
    splice : SpliceProfile or None
        ``T_splice(c_t)`` of a chunk that moved (re-rotation and pool write). None:
        ``splice_us_per_token * c_t`` when measured, else :data:`~mqnc.cost.SPLICE_PAPER`.
    splice_fp8 : SpliceProfile or None
        The same over DeepSeek-V3.2's FP8 cache (656-byte entries: the RoPE part re-rotated in
        place, the latent bytes and scales copied). None: ``splice_fp8_us_per_token * c_t``
        when measured, else the bf16 splice (:meth:`splice_for` names the stand-in).
    scatter : SpliceProfile or None
        What a chunk used at its cached position costs on arrival (the pool write alone).
        None: ``scatter_us_per_token * c_t`` when measured, else nothing (δ = 0 elides, §6.3).
    gather : GatherProfile
        Fetch under selection (§5.4).
    host : HostOverhead or None
        A client's host software on route (§5.3); None: the fabric's own (zero for the
        paper's fabrics); ``HostOverhead(0, 0)`` leaves it out.
    t_compute_us, t_merge_us : float
        The holder's partial attention and the merge charged to route (§6.3, §4.2).
    c_us : float or None
        Re-prefill cost per token-layer, us (the prefill rate, ``T_local = c_t L c``);
        None: :data:`~mqnc.cost.LOCAL_C_US`.
    splice_us_per_token, splice_fp8_us_per_token, scatter_us_per_token : float or None
        Measured splice (bf16 and FP8 caches) and pool write per token (us).
    compute_fixed_us, compute_us_per_row_token : float or None
        The holder's kernel call, ``fixed + per (row x token) x work`` (its compute law past
        the knee, §6.3), measured.
    send_us, send_alone_us : float or None
        The requester's send of one request in a wave and alone (us).
    host_us : float or None
        The holder's host work per request on its core (us).
    merge_us : float or None
        One merge of an agent's partials (us).
    fetch_fixed_us : float or None
        A fetch request's fixed part (its round trip, us).
    read_tbps : float or None
        The device's memory read ceiling (TB/s) the holder term's floor is priced at: the
        kernel-measured one (``perf/bench_copy.py``'s read records,
        :func:`mqnc.cost.ceilings.memory_ceiling`) or the HBM spec, ``sources["read_tbps"]``
        saying which. None: the spec of ``measured_with["device_name"]`` when it is known
        (:meth:`holder_read_tbps`), else no floor.
    measured_with : mapping of str to str
        What the compute terms were measured with (``device``, ``kernels``, ``transport``,
        ``device_name``); empty when nothing was.
    sources : mapping of str to str
        Per term, where it came from (``"profile"``, ``"calibrated"``, ...).
    schema, version : str, int
        :data:`PROFILE_SCHEMA`, :data:`PROFILE_VERSION` (fixed).
    """

    fabric: FabricProfile
    splice: SpliceProfile | None = None
    scatter: SpliceProfile | None = None
    gather: GatherProfile = GATHER_PAPER
    host: HostOverhead | None = None
    t_compute_us: float = T_COMPUTE_US
    t_merge_us: float = T_MERGE_US
    c_us: float | None = None
    splice_us_per_token: float | None = None
    scatter_us_per_token: float | None = None
    compute_fixed_us: float | None = None
    compute_us_per_row_token: float | None = None
    send_us: float | None = None
    send_alone_us: float | None = None
    host_us: float | None = None
    merge_us: float | None = None
    fetch_fixed_us: float | None = None
    read_tbps: float | None = None
    splice_fp8: SpliceProfile | None = None
    splice_fp8_us_per_token: float | None = None
    measured_with: Mapping[str, str] = dataclasses.field(default_factory=dict)
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    schema: str = PROFILE_SCHEMA
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        kinds = dict(
            fabric=FabricProfile,
            splice=SpliceProfile,
            splice_fp8=SpliceProfile,
            scatter=SpliceProfile,
            gather=GatherProfile,
            host=HostOverhead,
        )
        for name, kind in kinds.items():
            value = getattr(self, name)
            if not isinstance(value, kind) and not (value is None and name not in _REQUIRED):
                raise TypeError(
                    f"MachineProfile.{name}: expected a {kind.__name__}"
                    + ("" if name in _REQUIRED else " or None")
                    + f", got {type(value).__name__}"
                )
        for name in ("t_compute_us", "t_merge_us"):
            check_number(f"MachineProfile.{name}", getattr(self, name), nonnegative=True)
        if self.c_us is not None:
            check_number("MachineProfile.c_us", self.c_us, positive=True)
        if self.read_tbps is not None:
            check_number("MachineProfile.read_tbps", self.read_tbps, positive=True)
        for name in (*MEASURED_TERMS, "splice_fp8_us_per_token"):
            if name != "c_us" and getattr(self, name) is not None:
                check_number(f"MachineProfile.{name}", getattr(self, name), nonnegative=True)
        for name in _MAPPINGS:
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                raise TypeError(f"MachineProfile.{name}: expected a mapping of str to str")
        if self.schema != PROFILE_SCHEMA or self.version != PROFILE_VERSION:
            raise ValueError(
                f"MachineProfile.version: expected schema {PROFILE_SCHEMA!r} version "
                f"{PROFILE_VERSION}, got {self.schema!r} version {self.version!r}"
            )

    # -- what the predicate reads --------------------------------------------------------------
    @property
    def name(self) -> str:
        """The fabric's name (what a decision records)."""
        return self.fabric.name

    @property
    def local_c_us(self) -> float:
        """``c`` for ``T_local`` (us per token-layer): measured, else the paper's middle."""
        return LOCAL_C_US if self.c_us is None else self.c_us

    def splice_for(self, c_t: Any, moved: bool = True, kv_format: str = "bf16"):
        """What a fetched chunk of ``c_t`` tokens costs on arrival, as a
        :class:`SpliceProfile`: the splice when it ``moved``, else the pool write alone;
        ``kv_format`` the cache's (``MLAGeometry.cache_dtype``): an FP8 cache's splice is its
        own measured profile, else the bf16 one, named as a stand-in."""
        if moved and kv_format.startswith("fp8"):
            if self.splice_fp8 is not None:
                return self.splice_fp8
            if self.splice_fp8_us_per_token is not None:
                return _per_token(self.splice_fp8_us_per_token, c_t, "measured FP8 splice")
            bf16 = self.splice_for(c_t, True)
            return dataclasses.replace(bf16, name=f"{bf16.name} (bf16: no FP8 splice measured)")
        if moved:
            if self.splice is not None:
                return self.splice
            if self.splice_us_per_token is not None:
                return _per_token(self.splice_us_per_token, c_t, "measured")
            return SPLICE_PAPER
        if self.scatter is not None:
            return self.scatter
        if self.scatter_us_per_token is not None:
            return _per_token(self.scatter_us_per_token, c_t, "measured pool write")
        return _NO_SPLICE

    def holder_read_tbps(self) -> tuple[float | None, str]:
        """``(TB/s, where from)``: the read ceiling the holder term's floor is priced at:
        :attr:`read_tbps` (its source from ``sources``), else the HBM spec of the device the
        profile was measured on, else ``(None, "none")`` (no floor: §6.3's constant alone)."""
        if self.read_tbps is not None:
            return self.read_tbps, self.sources.get("read_tbps", "profile")
        device = self.measured_with.get("device_name", "")
        spec = spec_tbps(device)
        if spec is not None:
            return spec, f"HBM spec of {device}"
        return None, "none"

    def holder_compute_us(self, geometry, c_t: Any, m_q: Any, *, layers: int = 1):
        """The holder's compute for one routed call at ``(c_t, M_q)``: ``t_compute_us`` or the
        memory floor at :meth:`holder_read_tbps` (:func:`mqnc.cost.terms.t_compute_at`),
        whichever is larger."""
        tbps, _ = self.holder_read_tbps()
        return t_compute_at(
            geometry, c_t, m_q, t_compute_us=self.t_compute_us, read_tbps=tbps, layers=layers
        )

    def terms(self) -> dict[str, float]:
        """The measured compute terms (:data:`MEASURED_TERMS`) this profile holds."""
        return {k: getattr(self, k) for k in MEASURED_TERMS if getattr(self, k) is not None}

    def replace(self, **changes: Any) -> MachineProfile:
        """A copy with some fields changed (``p.replace(c_us=0.5)``)."""
        return dataclasses.replace(self, **changes)

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON form (schema and version first)."""
        out: dict[str, Any] = dict(schema=self.schema, version=self.version)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("schema", "version"):
                continue
            if f.name == "fabric":
                value = value.to_dict()
            elif f.name in _PROFILE_OBJECTS:
                value = None if value is None else dataclasses.asdict(value)
                if f.name in _SPLICES and value is not None:
                    value = dict(value, tokens=list(value["tokens"]), us=list(value["us"]))
            elif f.name in _MAPPINGS:
                value = dict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> MachineProfile:
        """Build from the JSON form, or from a version-0 file's content (a fabric profile, a
        demo profile); a field that is unknown or bad is an error naming it."""
        if not isinstance(data, dict):
            raise TypeError(f"profile: expected a dict (a JSON object), got {type(data).__name__}")
        if "schema" not in data:
            return _version0(data)
        if data["schema"] != PROFILE_SCHEMA or data.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"profile: schema {data['schema']!r} version {data.get('version')!r} is not "
                f"supported; this mqnc reads {PROFILE_SCHEMA!r} version {PROFILE_VERSION} (and "
                "version-0 fabric and demo profiles)"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(
                f"profile: unknown keys {unknown}; expected a subset of {sorted(fields)}"
            )
        if "fabric" not in data:
            raise ValueError("profile: missing key 'fabric'")
        kw = dict(data)
        kw["fabric"] = FabricProfile.from_dict(_object("fabric", kw["fabric"]))
        builders = dict(
            splice=SpliceProfile,
            splice_fp8=SpliceProfile,
            scatter=SpliceProfile,
            gather=GatherProfile,
        )
        for name, build in (*builders.items(), ("host", HostOverhead)):
            if kw.get(name) is not None:
                kw[name] = _build(name, build, kw[name])
        return cls(**kw)

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> MachineProfile:
        """Read a profile file (any version this package reads); a missing file is a
        ``FileNotFoundError`` naming it, one that is not JSON a ``ValueError`` naming it, one
        that is not a profile a ``ValueError`` or ``TypeError`` naming the field."""
        key = os.fspath(path)
        if not os.path.isfile(key):
            raise FileNotFoundError(f"profile: no such file {key!r}")
        try:
            with open(key) as f:
                data = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"profile: {key!r} is not JSON: {exc}") from None
        return cls.from_dict(data)


_REQUIRED = ("fabric", "gather")
_NO_SPLICE = SpliceProfile.none()


def _per_token(us_per_token: float, c_t: Any, name: str) -> SpliceProfile:
    """``us_per_token * c_t`` as a splice profile: flat at that value for one chunk size
    (exact), a line through the origin for a grid's axis."""
    if is_scalar(c_t):
        return SpliceProfile.flat(us_per_token * c_t, name)
    return SpliceProfile((0.0, 1.0), (0.0, us_per_token), name)


def _object(name: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"profile.{name}: expected a JSON object, got {type(value).__name__}")
    return value


def _build(name: str, build, value: Any):
    """``build(**value)``, an error naming the field when ``value`` does not fit."""
    try:
        return build(**_object(name, value))
    except TypeError as exc:
        raise TypeError(f"profile.{name}: {exc}") from None


def _version0(data: dict) -> MachineProfile:
    """A file written before the schema: a demo profile (``kind``) or a bare fabric."""
    kind = data.get("kind")
    if kind is None:
        return MachineProfile(FabricProfile.from_dict(data))
    if kind != DEMO_PROFILE_KIND:
        raise ValueError(
            f"profile: kind {kind!r} is not a profile; expected {DEMO_PROFILE_KIND!r} "
            f"(version 0) or schema {PROFILE_SCHEMA!r}"
        )
    missing = [k for k in ("fabric", "terms", "measured_with") if k not in data]
    if missing:
        raise ValueError(f"profile: a version-0 demo profile without {missing}")
    terms = {k: float(v) for k, v in _object("terms", data["terms"]).items() if k in MEASURED_TERMS}
    return MachineProfile(
        FabricProfile.from_dict(_object("fabric", data["fabric"])),
        measured_with={
            k: str(v) for k, v in _object("measured_with", data["measured_with"]).items()
        },
        sources={k: str(v) for k, v in (data.get("sources") or {}).items()},
        **terms,
    )


def load_profile(name_or_path: str | os.PathLike) -> MachineProfile:
    """A preset fabric name (its profile: the fabric, the paper's compute terms) or a path to
    a profile file of any version this package reads."""
    key = os.fspath(name_or_path)
    if key in FABRICS:
        return MachineProfile(FABRICS[key])
    if key.endswith(".json") or os.path.exists(key):
        return MachineProfile.load(key)
    return MachineProfile(get_fabric(key))


# ---- the request -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """One (chunk, request) to decide (§5.1): what is routed, what would be fetched.

    Parameters
    ----------
    m_q : float
        Routed query rows (tokens x heads) attending the chunk (an array for a grid).
    c_t : float
        Chunk tokens (what fetch pulls and local re-prefills; an array for a grid).
    topk : int or None
        Selection budget (§5.4): fetch becomes a splice-free gather of ``topk`` entries over
        ``holders`` holders.
    holders : int
        Holders the selection spans.
    moved : bool
        Whether the chunk is attended at another position than its cached one: a fetch then
        splices it (:meth:`MachineProfile.splice_for`); else it only writes it.
    tp, round_trips, shared_uplink
        See :func:`mqnc.cost.t_route` (``round_trips = steps x L`` for a whole decode that
        routes every layer).
    congestion : Congestion or None
        Bandwidth degradation and probe inflation (§8).
    attention : bool
        Whether route is charged the holder's partial attention and the merge
        (``t_compute_us``, ``t_merge_us``). False where every primitive pays them (route on
        the holder, fetch and local in the requester's pool afterwards): the comparison then
        leaves them out.
    allow : tuple of str
        Primitives available (e.g. ``("fetch", "local")`` when the holder is a byte store
        that cannot run the partial, §6.3).
    """

    m_q: Any
    c_t: Any
    topk: int | None = None
    holders: int = 1
    moved: bool = True
    tp: int = 1
    round_trips: int = 1
    shared_uplink: bool = False
    congestion: Congestion | None = None
    attention: bool = True
    allow: tuple[str, ...] = PRIMITIVES

    def __post_init__(self) -> None:
        check_positive("m_q", self.m_q)
        check_positive("c_t", self.c_t)
        if self.topk is not None:
            check_positive("topk", self.topk)
        for name in ("holders", "tp", "round_trips"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                check_int(name, value, minimum=1)
        for name in ("moved", "shared_uplink", "attention"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{name}: expected a bool, got {value!r}")
            object.__setattr__(self, name, bool(value))
        if self.congestion is not None and not isinstance(self.congestion, Congestion):
            raise TypeError(
                f"congestion: expected a Congestion or None, got {type(self.congestion).__name__}"
            )
        if self.allow is not PRIMITIVES:
            allow = tuple(self.allow)
            bad = [a for a in allow if a not in PRIMITIVES]
            if bad or not allow or len(set(allow)) != len(allow):
                raise ValueError(
                    f"allow: expected a non-empty subset of {list(PRIMITIVES)}, each once, "
                    f"got {allow}"
                )
            object.__setattr__(self, "allow", allow)

    @property
    def scalar(self) -> bool:
        """Whether ``m_q`` and ``c_t`` are scalars (one decision, not a grid)."""
        return is_scalar(self.m_q) and is_scalar(self.c_t)

    def replace(self, **changes: Any) -> Request:
        """A copy with some fields changed (``r.replace(m_q=512)``)."""
        return dataclasses.replace(self, **changes)


def check_positive(name: str, value: Any) -> None:
    """A finite number > 0, or an array of them (a grid's axis)."""
    if type(value) in (int, float) and value > 0 and value != math.inf:
        return
    if is_scalar(value) and not isinstance(value, np.ndarray):
        check_number(name, value, positive=True)
        return
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.number):
        raise TypeError(f"{name}: expected a numeric array, got dtype {arr.dtype}")
    if not (np.isfinite(arr).all() and (arr > 0).all()):
        raise ValueError(f"{name}: expected finite values > 0")


PROFILE_FIELDS = frozenset(
    f.name for f in dataclasses.fields(MachineProfile) if f.name not in ("schema", "version")
)
"""The keyword arguments of the convenience form that set a profile field."""
REQUEST_FIELDS = frozenset(f.name for f in dataclasses.fields(Request))
"""The keyword arguments of the convenience form that set a request field."""
