"""The topology-aware redistribution cost model of §4: every term its own function.

§4.1 decomposes any cross-instance redistribution into additive terms,
``T_redist = T_probe + T_transfer + T_compute + T_return + T_merge``; §4.2 instantiates it per
primitive (all times in microseconds, bandwidths in GB/s = 1e9 B/s):

- route: ``T_route = T_probe + T_turnaround + M_q q / BW + M_q p / BW + T_compute + T_merge``.
  ``T_turnaround`` (≈9 us on IBGDA, §4.3) is the fixed kernel turnaround the paper's
  two-constant form omits; it is 0 in presets where the paper does not report it.
- fetch: ``T_fetch = T_pull + T_splice`` with ``T_pull = c_t b_KV L / BW_bulk`` (all layers,
  bulk-coalesced, §2.2) and ``T_splice`` the re-rotation + scatter (§2.2, §7) from a
  :class:`SpliceProfile`; under selection (§5.4) no splice, and the pull becomes a gather over
  the ``M`` holders the selection spans, from a :class:`GatherProfile`.
- local: ``T_local = c_t L c``, ``c`` in [0.5, 1.5] us per token-layer (§5.1).

Modifiers: :class:`Congestion` (§8: effective-bandwidth degradation and additive probe
inflation), :class:`HostOverhead` (§5.3: a client's host software, the paper's 3.5 ms + 12.5 us
M_q or this package's own, measured by ``perf/bench_host`` and ``mqnc calibrate``),
and tensor-parallel rank pairing (§8: per-rank bytes / N). :func:`mqnc.cost.fit.fit` calibrates a
fabric from measured round trips (§4.3).

The term functions accept Python floats or numpy arrays (broadcasting), so the predicate's
grids reuse them unchanged. This module imports numpy only (no torch, no triton).

Accounting choices where the paper is silent (see also docs/cost-model.md):

- ``round_trips``: the paper charges one round trip of ``M_q`` rows per (chunk, request) and
  compares it with the all-layer pull (Fig. 1(b), Fig. 6(a), §5.1). A decode step that routes
  every layer's query separately pays ``L`` of them; pass ``round_trips=L`` for that reading.
- fan-out to ``M`` holders (§5.4) is flat as in Fig. 4(a) (parallel sends, the ``M``-way merge
  inside ``T_merge``); ``shared_uplink=True`` instead charges the requester's one link for all
  ``M`` copies of the bytes.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
from typing import Any

import numpy as np

from mqnc.base.checks import check_int, check_number
from mqnc.cost.fabric import FabricProfile, bytes_to_us
from mqnc.cost.results_reader import read_jsonl
from mqnc.model.geometry import MLAGeometry

__all__ = [
    "T_COMPUTE_US",
    "T_COMPUTE_RANGE_US",
    "T_MERGE_US",
    "LOCAL_C_RANGE_US",
    "LOCAL_C_US",
    "SpliceProfile",
    "SPLICE_PAPER",
    "SPLICE_NOMINAL",
    "GatherProfile",
    "GATHER_PAPER",
    "Congestion",
    "fit_congestion",
    "HostOverhead",
    "HOST_PAPER",
    "host_of",
    "RouteCost",
    "FetchCost",
    "route_bytes",
    "fetch_bytes",
    "t_probe",
    "t_turnaround",
    "t_transfer",
    "t_return",
    "t_compute",
    "t_compute_floor",
    "t_compute_at",
    "t_merge",
    "t_host",
    "t_route",
    "t_pull",
    "t_splice",
    "t_gather",
    "t_fetch",
    "t_local",
    "t_local_range",
]

# §6.3: holder partial attention at decode (N <= 16 requesters), 15-37 us; §4.2: merge <= 25 us.
T_COMPUTE_RANGE_US = (15.0, 37.0)
T_COMPUTE_US = 15.0
"""Default ``T_compute``: the low end of §6.3's decode range (the paper gives a range, not a
point; pass ``t_compute_us=37`` for the high end)."""
T_MERGE_US = 25.0
"""Default ``T_merge``: the paper's bound (≤ 25 us, §4.2, §5.4), used as the value."""
# §5.1: re-prefill cost per token-layer.
LOCAL_C_RANGE_US = (0.5, 1.5)
LOCAL_C_US = 1.0
"""Default ``c`` for a point estimate of ``T_local``: the middle of §5.1's [0.5, 1.5] range."""


def is_scalar(x) -> bool:
    """True for a Python or numpy scalar (fast path for plain ints and floats)."""
    return type(x) in (int, float) or np.ndim(x) == 0


# ---- profiles ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpliceProfile:
    """``T_splice(c_t)``: re-rotate a contiguous chunk to a new offset and scatter it (§2.2, §7).

    Piecewise-linear in ``c_t`` through measured points; flat below the first point (the splice
    is launch-bound there, §7) and extrapolated with the last segment's slope above the last
    (the scatter starts to scale past 1024 tokens, §7). The paper's profile is
    :data:`SPLICE_PAPER` (2.77/2.78/2.91/3.06 ms at c_t = 55/1024/2048/4096 on H100);
    :data:`SPLICE_NOMINAL` is the flat "≈3 ms" the paper's ratios use. This package's own splice
    kernel (one launch) is measured by its benchmark: :meth:`from_results` reads it.

    Parameters
    ----------
    tokens : tuple of float
        Chunk sizes ``c_t``, strictly increasing.
    us : tuple of float
        Splice times at those sizes, microseconds.
    name : str
        Where the profile comes from.
    """

    tokens: tuple[float, ...]
    us: tuple[float, ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        tokens = tuple(float(t) for t in self.tokens)
        us = tuple(float(u) for u in self.us)
        if not tokens or len(tokens) != len(us):
            raise ValueError(
                f"SpliceProfile: expected equal, non-empty tokens and us, got "
                f"{len(tokens)} and {len(us)} points"
            )
        if any(b <= a for a, b in zip(tokens, tokens[1:], strict=False)):
            raise ValueError(f"SpliceProfile.tokens: expected strictly increasing, got {tokens}")
        if any(not math.isfinite(u) or u < 0 for u in us):
            raise ValueError(f"SpliceProfile.us: expected finite values >= 0, got {us}")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "us", us)

    @classmethod
    def flat(cls, us: float, name: str | None = None) -> SpliceProfile:
        """A splice independent of chunk size (``us`` microseconds)."""
        return cls((1.0,), (float(us),), name or f"flat {us:g} us")

    @classmethod
    def none(cls) -> SpliceProfile:
        """No splice: a true prefix served at its cached position (δ = 0 elides, §6.3)."""
        return cls((1.0,), (0.0,), "none (delta = 0)")

    def at(self, c_t):
        """Splice time (us) at chunk size ``c_t`` (a float or a numpy array)."""
        tok, us = self.tokens, self.us
        if len(tok) == 1:
            return us[0] if is_scalar(c_t) else np.full(np.shape(c_t), us[0])
        slope = (us[-1] - us[-2]) / (tok[-1] - tok[-2])
        if is_scalar(c_t):
            x = float(c_t)
            if x <= tok[0]:
                return us[0]
            if x >= tok[-1]:
                return us[-1] + slope * (x - tok[-1])
            i = bisect.bisect_right(tok, x)
            return us[i - 1] + (us[i] - us[i - 1]) * (x - tok[i - 1]) / (tok[i] - tok[i - 1])
        x = np.asarray(c_t, dtype=np.float64)
        out = np.interp(x, tok, us)
        return np.where(x > tok[-1], us[-1] + slope * (x - tok[-1]), out)

    @classmethod
    def from_results(
        cls,
        path: str | os.PathLike,
        *,
        bench: str = "splice",
        variant: str | None = None,
        device: str | None = None,
        backend: str | None = None,
        kv_dtype: str | None = None,
    ) -> SpliceProfile:
        """Build from the results file: records ``bench`` (default ``"splice"``), ``x`` = c_t,
        ``p50`` in us, of one device, backend and variant; the median p50 per ``x`` when a size
        was measured more than once; ``kv_dtype`` (``"bf16"``, ``"fp8"``): only the records of
        that cache format (``extra.kv_dtype``; a record without one is bf16's).

        Parameters
        ----------
        path : str or os.PathLike
            A results file (:mod:`mqnc.measure.results_file`' JSON lines).
        bench : str
            The records' ``bench``.
        variant, device, backend : str, optional
            Keep only the records whose field equals this (exactly). Each may be left out
            while the records left hold one value of it.

        Returns
        -------
        SpliceProfile
            Named ``measured: <device>, <backend> backend, variant <variant>, commit <commits>
            (<path>)``: where every point came from.

        Raises
        ------
        ValueError
            No such records, or the records left are of several (device, backend, variant):
            a profile never pools them (one machine's splice is not another's, an interpreter
            run is not a kernel's, as ``mqnc fit`` never pools devices); the message lists
            those present.
        """
        recs = [r for r in read_jsonl(path) if r.get("bench") == bench]
        if kv_dtype is not None:
            recs = [r for r in recs if (r.get("extra") or {}).get("kv_dtype", "bf16") == kv_dtype]
        wanted = {"device": device, "backend": backend, "variant": variant}
        for key, value in wanted.items():
            if value is not None:
                recs = [r for r in recs if r.get(key) == value]
        if not recs:
            given = "".join(f" and {k}={v!r}" for k, v in wanted.items() if v is not None)
            if kv_dtype is not None:
                given += f" and kv_dtype={kv_dtype!r} (perf.bench_splice --kv-dtype {kv_dtype})"
            raise ValueError(f"results: no records with bench={bench!r}{given} in {path}")
        groups = sorted({tuple(str(r.get(k)) for k in wanted) for r in recs})
        if len(groups) > 1:
            listed = "; ".join(f"device={d!r}, backend={b!r}, variant={v!r}" for d, b, v in groups)
            raise ValueError(
                f"results: {path}: expected the {bench!r} records of one device, backend and "
                f"variant (a profile never pools them, as mqnc fit never pools devices), got "
                f"{len(groups)}: {listed}; pick one with device=, backend=, variant= "
                f"(mqnc predict: --splice-device, --splice-backend, --splice-variant)"
            )
        by_x: dict[float, list[float]] = {}
        for r in recs:
            by_x.setdefault(float(r["x"]), []).append(float(r["p50"]))
        xs = sorted(by_x)
        (d, b, v), commits = groups[0], sorted({str(r.get("commit")) for r in recs})
        name = f"measured: {d}, {b} backend, variant {v}, commit {', '.join(commits)} ({path})"
        return cls(tuple(xs), tuple(float(np.median(by_x[x])) for x in xs), name)


SPLICE_PAPER = SpliceProfile((55, 1024, 2048, 4096), (2770, 2780, 2910, 3060), "paper §7 (H100)")
SPLICE_NOMINAL = SpliceProfile.flat(3000.0, "paper nominal ≈3 ms (§2.2)")


@dataclasses.dataclass(frozen=True)
class GatherProfile:
    """Fetch under selection: a scattered gather of ``k`` entries over ``M`` holders (§5.4).

    Per layer, ``T_gather = M t_handshake + k b_KV / gather_bw``: the paper says what fetch pays
    there is "the moved bytes and the per-holder handshakes" (holders are pulled one at a time),
    and Fig. 4(a) measures it affine in ``M`` (≈1.3 ms at M = 1 to ≈3.9 ms at M = 7, top-2048,
    per layer). Two points give the two constants (:meth:`from_two_points`): a 433 us handshake
    per holder and a byte rate of ≈2.7 GB/s (host-copy-bound in their prototype, §5.4; it is
    fabric-invariant, so the fabric does not enter). The full pull is ``L`` times the per-layer
    gather ("the full pull scales this by L = 27 layers", Fig. 4(a)). That the byte term scales
    linearly in ``k`` is our reading of the same sentence; the paper plots, but does not state,
    the top-1024 and top-512 curves.
    """

    handshake_us: float
    gather_gbps: float
    name: str = "custom"

    @classmethod
    def from_two_points(
        cls,
        m1: float,
        t1_us: float,
        m2: float,
        t2_us: float,
        *,
        topk: int,
        kv_bytes: int,
        name: str = "custom",
    ) -> GatherProfile:
        """Constants from two per-layer gather times ``t1``, ``t2`` at ``m1``, ``m2`` holders."""
        if m2 == m1:
            raise ValueError(f"m2: expected a holder count different from m1={m1}, got {m2}")
        handshake = (t2_us - t1_us) / (m2 - m1)
        byte_us = t1_us - m1 * handshake
        if handshake < 0 or byte_us <= 0:
            raise ValueError(
                f"gather points: expected time growing with holders and a positive "
                f"byte term, got handshake={handshake:.3g} us, bytes={byte_us:.3g} us"
            )
        return cls(handshake, topk * kv_bytes / (byte_us * 1e3), name)

    def per_layer_us(self, geometry: MLAGeometry, topk, holders):
        return holders * self.handshake_us + bytes_to_us(
            topk * geometry.kv_bytes_per_token_layer, self.gather_gbps
        )


GATHER_PAPER = GatherProfile.from_two_points(
    1, 1300.0, 7, 3900.0, topk=2048, kv_bytes=1152, name="paper Fig. 4(a) (H100, top-2048)"
)


@dataclasses.dataclass(frozen=True)
class Congestion:
    """Congestion as the two effects §8 names: a bandwidth degradation and a probe inflation.

    Parameters
    ----------
    bw_factor : float, default 1
        Effective bandwidth is multiplied by this (0 < bw_factor; 0.5 halves it).
    probe_add_us : float, default 0
        Queueing added to the probe (an additive term, §8 (ii)).
    on_fetch : bool, default True
        Whether fetch's bulk pull sees the same degraded bandwidth (the same link). The paper's
        threshold "route loses to fetch only below M_q (q+p) / T_splice ≈ 0.2 GB/s" (§8 (i))
        holds only if it does not (``on_fetch=False``): with one shared link both primitives
        slow by the same factor and route, moving fewer bytes, never loses (Fig. 6(a)).
    """

    bw_factor: float = 1.0
    probe_add_us: float = 0.0
    on_fetch: bool = True

    def __post_init__(self) -> None:
        check_number("Congestion.bw_factor", self.bw_factor, positive=True)
        check_number("Congestion.probe_add_us", self.probe_add_us, nonnegative=True)

    def apply(self, fabric: FabricProfile, *, for_fetch: bool = False) -> FabricProfile:
        """The fabric as the congested route (or, ``for_fetch``, fetch's pull) sees it."""
        if for_fetch:
            if not self.on_fetch:
                return fabric
            return fabric.replace(bulk_bw_gbps=fabric.bulk_bw * self.bw_factor)
        return fabric.replace(
            t_probe_us=fabric.t_probe_us + self.probe_add_us,
            bw_gbps=fabric.bw_gbps * self.bw_factor,
        )


def fit_congestion(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    m_q: int,
    *,
    probe_idle_us: float,
    probe_congested_us: float,
    rt_idle_us: float,
    rt_congested_us: float,
) -> Congestion:
    """The two congestion constants from one idle / congested pair of probe and round trip.

    The probe inflation is the probe difference; what the round trip rose beyond it is the
    transfer term ``M_q (q+p) / BW`` growing by ``1 / bw_factor - 1`` (§8).
    """
    probe_add = probe_congested_us - probe_idle_us
    extra = (rt_congested_us - rt_idle_us) - probe_add
    transfer = bytes_to_us(m_q * geometry.qp_row_bytes, fabric.bw_gbps)
    # a congested transfer faster than the idle one (bw_factor > 1) is refused too; the slack
    # is floating-point rounding only (bw_factor = 1 exactly when nothing changed)
    if probe_add < 0 or extra < -1e-9 * transfer:
        raise ValueError(
            f"congested round trips: expected no faster than idle, got probe "
            f"{probe_idle_us}->{probe_congested_us}, rt {rt_idle_us}->"
            f"{rt_congested_us} us"
        )
    return Congestion(bw_factor=min(1.0 / (1.0 + extra / transfer), 1.0), probe_add_us=probe_add)


@dataclasses.dataclass(frozen=True)
class HostOverhead:
    """Host overhead of a client's software on a routed call (§5.3):
    ``fixed_us + per_row_us * M_q``.

    The paper measures route's time-to-first-token through its prototype Python client as
    ≈3.5 ms + 12.5 us · M_q (:data:`HOST_PAPER`); it is a property of that software, not of
    the operation, and the three reductions of §5.3 remove most of it. This package's own is
    what its holder and requester add to the transport's round trip (packing, checks, the
    engine's threads, the reply), fitted by :func:`mqnc.cost.fit_host` from ``perf/bench_host``
    or ``mqnc calibrate``, and carried by a calibrated profile (``host_fixed_us``,
    ``host_per_row_us``): :func:`t_route` adds the profile's unless given another (pass
    ``HostOverhead(0, 0)`` for none). The paper's fabrics carry none.
    """

    fixed_us: float = 3500.0
    per_row_us: float = 12.5


HOST_PAPER = HostOverhead(3500.0, 12.5)


# ---- wire bytes --------------------------------------------------------------------------------


def route_bytes(geometry: MLAGeometry, m_q, *, tp: int = 1):
    """Bytes a routed batch moves there and back per rank pair: ``M_q (q + p) / N`` (§3.2, §8)."""
    return m_q * geometry.qp_row_bytes / tp


def fetch_bytes(geometry: MLAGeometry, c_t, *, layers: int | None = None):
    """Bytes a fetch pulls: ``c_t b_KV`` per layer, times ``layers`` (default all ``L``)."""
    return c_t * geometry.kv_bytes_per_token_layer * (geometry.layers if layers is None else layers)


# ---- route terms (§4.1, §4.2) ------------------------------------------------------------------


def t_probe(fabric: FabricProfile, congestion: Congestion | None = None) -> float:
    """``T_probe(F)``: the payload-free round trip, plus congestion's queueing (§4.3, §8)."""
    return fabric.t_probe_us + (congestion.probe_add_us if congestion else 0.0)


def t_turnaround(fabric: FabricProfile) -> float:
    """The fixed kernel turnaround beyond the probe (§4.3; 0 where the paper gives none)."""
    return fabric.turnaround_us


def _route_bw(fabric: FabricProfile, congestion: Congestion | None, bw_gbps=None):
    bw = fabric.bw_gbps if bw_gbps is None else bw_gbps
    return bw * congestion.bw_factor if congestion else bw


def t_transfer(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    m_q,
    *,
    tp: int = 1,
    congestion: Congestion | None = None,
    bw_gbps=None,
):
    """``T_transfer``: ``M_q q / N`` bytes of query rows out at ``BW(F)`` (§4.1)."""
    return bytes_to_us(m_q * geometry.q_row_bytes / tp, _route_bw(fabric, congestion, bw_gbps))


def t_return(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    m_q,
    *,
    tp: int = 1,
    congestion: Congestion | None = None,
    bw_gbps=None,
):
    """``T_return``: ``M_q p / N`` bytes of partials (o, m, l) back at ``BW(F)`` (§4.1)."""
    return bytes_to_us(m_q * geometry.p_row_bytes / tp, _route_bw(fabric, congestion, bw_gbps))


def t_compute(t_compute_us: float = T_COMPUTE_US) -> float:
    """``T_compute``: the holder's partial attention, a bounded constant (15-37 us, §6.3)."""
    return t_compute_us


def t_compute_floor(geometry: MLAGeometry, c_t, m_q, read_tbps: float, *, layers: int = 1):
    """The holder partial's memory floor (us): the bytes it must move at the device's read
    ceiling ``read_tbps`` (TB/s: the kernel-measured read ceiling, or the HBM spec,
    :mod:`mqnc.cost.ceilings`), its ``c_t`` cache entries of ``layers`` layers read once (the
    routed rows share them) plus its ``m_q`` query rows in and partial rows out::

        (c_t L b_KV + M_q (q + p)) / ceiling

    At c_t 2048 on an H200 (4.8 TB/s) one layer's 2.4 MB take 0.49 us, far under §6.3's 15 us
    constant; at c_t 131072 they take 31 us, over it: a holder's compute is
    ``max(T_compute, floor)`` (:func:`t_compute_at`). Scalars or numpy arrays."""
    check_number("read_tbps", read_tbps, positive=True)
    _check_count("layers", layers)
    nbytes = c_t * layers * geometry.kv_bytes_per_token_layer + m_q * geometry.qp_row_bytes
    return nbytes / (read_tbps * 1e6)


def t_compute_at(
    geometry: MLAGeometry,
    c_t,
    m_q,
    *,
    t_compute_us: float = T_COMPUTE_US,
    read_tbps: float | None = None,
    layers: int = 1,
):
    """``T_compute`` of one holder call at ``(c_t, M_q)``: the constant ``t_compute_us``
    (§6.3's latency-bound decode) or the memory floor at ``read_tbps``
    (:func:`t_compute_floor`), whichever is larger; the constant alone when no ceiling is
    known (``read_tbps`` None)."""
    if read_tbps is None:
        return t_compute(t_compute_us) + 0.0 * (c_t + m_q)
    return np.maximum(t_compute_us, t_compute_floor(geometry, c_t, m_q, read_tbps, layers=layers))


def t_merge(t_merge_us: float = T_MERGE_US) -> float:
    """``T_merge``: the requester's online-softmax merge (≤ 25 us, §4.2)."""
    return t_merge_us


def t_host(m_q, host: HostOverhead | None):
    """A client's host overhead (§5.3); 0 when ``host`` is None."""
    if host is None:
        return 0.0 * m_q
    return host.fixed_us + host.per_row_us * m_q


def host_of(fabric: FabricProfile) -> HostOverhead | None:
    """The host overhead a (calibrated) profile carries, or None (the paper's fabrics)."""
    if fabric.host_fixed_us is None and fabric.host_per_row_us is None:
        return None
    return HostOverhead(fabric.host_fixed_us or 0.0, fabric.host_per_row_us or 0.0)


@dataclasses.dataclass(frozen=True)
class RouteCost:
    """Every term of ``T_route`` (us); floats, or arrays on a grid."""

    probe: Any
    turnaround: Any
    transfer: Any
    return_: Any
    compute: Any
    merge: Any
    host: Any

    @property
    def transport(self):
        """The round trip the paper fits and reports (probe, turnaround and the bytes)."""
        return self.probe + self.turnaround + self.transfer + self.return_

    @property
    def total(self):
        return self.transport + self.compute + self.merge + self.host

    def to_dict(self) -> dict[str, Any]:
        d = {f.name.rstrip("_"): _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        d["transport"], d["total"] = _plain(self.transport), _plain(self.total)
        return d


def t_route(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    m_q,
    *,
    t_compute_us: float = T_COMPUTE_US,
    t_merge_us: float = T_MERGE_US,
    congestion: Congestion | None = None,
    tp: int = 1,
    holders: int = 1,
    shared_uplink: bool = False,
    host: HostOverhead | None = None,
    round_trips: int = 1,
    bw_gbps=None,
) -> RouteCost:
    """``T_route(F, M_q)`` term by term (§4.2), with §8's congestion and TP rank pairing.

    Parameters
    ----------
    geometry : MLAGeometry
        Gives ``q``, ``p`` (bytes per row).
    fabric : FabricProfile
        ``T_probe``, ``BW``, turnaround.
    m_q : int or float or numpy.ndarray
        Routed query rows (token x head); an array broadcasts.
    tp : int
        Tensor-parallel degree ``N``: each rank pair ships ``1/N`` of the bytes, in parallel.
    holders : int
        Holders the selection spans (§5.4); the fan-out is flat unless ``shared_uplink``.
    host : HostOverhead or None
        A client's host overhead (§5.3); None: the fabric's own (a calibrated profile's, this
        package's software; none for the paper's fabrics). ``HOST_PAPER`` is the paper's.
    round_trips : int
        Sequential round trips charged (1 as in the paper; ``L`` for per-layer routing), each
        a routed call of its own: every term, the host overhead included, is charged that
        many times.
    bw_gbps : float or numpy.ndarray or None
        Override the fabric's route bandwidth (the Fig. 6(a) sweep).
    """
    _check_count("tp", tp)
    _check_count("holders", holders)
    _check_count("round_trips", round_trips)
    fan = holders if shared_uplink else 1
    kw = dict(tp=tp, congestion=congestion, bw_gbps=bw_gbps)
    r = round_trips
    return RouteCost(
        probe=r * t_probe(fabric, congestion),
        turnaround=r * t_turnaround(fabric),
        transfer=r * fan * t_transfer(geometry, fabric, m_q, **kw),
        return_=r * fan * t_return(geometry, fabric, m_q, **kw),
        compute=r * t_compute(t_compute_us),
        merge=r * t_merge(t_merge_us),
        host=r * t_host(m_q, host_of(fabric) if host is None else host),
    )


# ---- fetch and local ---------------------------------------------------------------------------


def t_pull(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    c_t,
    *,
    congestion: Congestion | None = None,
    bw_gbps=None,
):
    """``T_pull = c_t b_KV L / BW_bulk(F)``: the all-layer chunk, one coalesced transfer (§2.2)."""
    bw = fabric.bulk_bw if bw_gbps is None else bw_gbps
    if congestion is not None and congestion.on_fetch:
        bw = bw * congestion.bw_factor
    return bytes_to_us(fetch_bytes(geometry, c_t), bw)


def t_splice(c_t, splice: SpliceProfile = SPLICE_PAPER):
    """``T_splice(c_t)``: the position-adaptation cost of contiguous reuse (§2.2, §7)."""
    return splice.at(c_t)


def t_gather(geometry: MLAGeometry, topk, holders, gather: GatherProfile = GATHER_PAPER):
    """Fetch's all-layer scattered gather of ``topk`` entries over ``holders`` holders (§5.4)."""
    return geometry.layers * gather.per_layer_us(geometry, topk, holders)


@dataclasses.dataclass(frozen=True)
class FetchCost:
    """Every term of ``T_fetch`` (us): the pull (a gather under selection) and the splice."""

    pull: Any
    splice: Any
    selection: bool = False

    @property
    def total(self):
        return self.pull + self.splice

    def to_dict(self) -> dict[str, Any]:
        return dict(
            pull=_plain(self.pull),
            splice=_plain(self.splice),
            selection=self.selection,
            total=_plain(self.total),
        )


def t_fetch(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    c_t,
    *,
    splice: SpliceProfile = SPLICE_PAPER,
    topk=None,
    holders: int = 1,
    gather: GatherProfile = GATHER_PAPER,
    congestion: Congestion | None = None,
    bw_gbps=None,
) -> FetchCost:
    """``T_fetch = T_pull + T_splice`` (§4.2); under selection (``topk`` given) the splice
    vanishes and the pull is a gather of ``topk`` entries over ``holders`` holders (§5.4)."""
    if topk is not None:
        _check_count("holders", holders)
        return FetchCost(t_gather(geometry, topk, holders, gather), 0.0 * topk, True)
    return FetchCost(
        t_pull(geometry, fabric, c_t, congestion=congestion, bw_gbps=bw_gbps),
        t_splice(c_t, splice),
    )


def t_local(geometry: MLAGeometry, c_t, c_us: float = LOCAL_C_US):
    """``T_local = T_prefill(c_t) ≈ c_t L c`` (§4.2, §5.1), ``c`` us per token-layer."""
    return c_t * geometry.layers * c_us


def t_local_range(geometry: MLAGeometry, c_t):
    """``(low, high)`` of ``T_local`` over the paper's ``c`` in [0.5, 1.5] us (§5.1)."""
    lo, hi = LOCAL_C_RANGE_US
    return t_local(geometry, c_t, lo), t_local(geometry, c_t, hi)


# ---- helpers -----------------------------------------------------------------------------------


def _check_count(name: str, value: Any) -> None:
    if type(value) is int and value >= 1:  # the common case, without the ABC check
        return
    check_int(name, value, minimum=1)


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
