"""The closed-form route / fetch / local predicate (§5): argmin over the three costs of §4.

:func:`decide` evaluates every term of every primitive for one (chunk, request) and returns a
:class:`Decision` with the chosen primitive, the breakdown and the margin to the runner-up;
:func:`decide_grid` does the same over numpy arrays (broadcasting), and :func:`crossover_map` /
:func:`bw_sweep` build the two grids of the paper's figures (the ``M_q x c_t`` map of Fig. 3(b)
and the bandwidth sweep of Fig. 6(a)).

Closed forms (§5.2, §5.4, §8): :func:`wire_break_even_rows` (``M_q = c_t b_KV / (q + p)``),
:func:`wire_byte_saving`, :func:`selection_break_even_rows` (the same at the selection budget),
:func:`fetch_local_crossover_tokens`, :func:`route_fetch_inversion_rows`,
:func:`congestion_bw_threshold_gbps`. The serving rules of §5.5 as helpers:
:func:`amortisation_steps`, :func:`rank_fabrics`, :func:`local_band_tokens`,
:func:`congestion_reprices`.

Where the paper's prose and its arithmetic part (each checked in
``correctness/test_paper_numbers.py``):

- "breaks even near M_q ≈ 10^3" (§5.2) is 2048 x 1152 / 2184 = 1080.3 rows: the same number
  rounded (Fig. 1(a) prints it as "x1,080"). It is a per-layer comparison (one layer's query
  rows against one layer's chunk); both sides scale with ``L``, so it holds for all layers too.
- "≈270 (V4-Flash's top-512)" (§5.4) is 512 x 1152 / 2184 = 270.1, i.e. V2-Lite's 576-wide
  entry at k = 512; V4-Flash's own geometry (512-wide entry, 1024 B; q+p = 2056 B) gives 255.
- "route loses to fetch only below M_q (q+p) / T_splice ≈ 0.2 GB/s" (§8) compares route's
  transfer with the splice alone, i.e. a congestion that slows route but not fetch's pull; on
  one shared link (Fig. 6(a)'s own model) route moves fewer bytes than the pull and never loses.
- "fetch overtakes local above ≈75-220 tokens" (§5.1) is ``T_splice / (L c)`` with a flat
  3 ms splice and the pull neglected (74 and 222); with Fig. 1(b)'s 70 GB/s pull it is 75-230.
- "The route/fetch ranking inverts only near M_q ≳ 10^5" (§5.5): with IBGDA constants, the
  2.5 ms pull and the 2.91 ms splice it is ≈6 x 10^4 rows, 10^5 to within half a decade.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from mqnc.cost.fabric import FabricProfile, bytes_to_us
from mqnc.cost.profile import (
    PRIMITIVES,
    PROFILE_FIELDS,
    REQUEST_FIELDS,
    MachineProfile,
    Request,
    check_positive,
)
from mqnc.cost.terms import (
    LOCAL_C_RANGE_US,
    LOCAL_C_US,
    SPLICE_PAPER,
    Congestion,
    FetchCost,
    RouteCost,
    SpliceProfile,
    host_of,
    is_scalar,
    t_fetch,
    t_local,
    t_local_range,
    t_route,
)
from mqnc.model.geometry import MLAGeometry

__all__ = [
    "PRIMITIVES",
    "Decision",
    "DecisionGrid",
    "decide",
    "decide_grid",
    "crossover_map",
    "bw_sweep",
    "wire_break_even_rows",
    "wire_byte_saving",
    "selection_break_even_rows",
    "fetch_local_crossover_tokens",
    "route_fetch_inversion_rows",
    "congestion_bw_threshold_gbps",
    "amortisation_steps",
    "rank_fabrics",
    "local_band_tokens",
    "congestion_reprices",
]


@dataclasses.dataclass(frozen=True)
class Decision:
    """One (chunk, request) decision: the choice, every term of every primitive, the margin.

    Attributes
    ----------
    primitive : str
        ``"route"``, ``"fetch"`` or ``"local"``: the argmin of the allowed primitives.
    runner_up : str or None
        The second cheapest allowed primitive (None if only one is allowed).
    margin_us : float
        Runner-up cost minus chosen cost (us, >= 0; inf if only one is allowed).
    margin_ratio : float
        Runner-up cost over chosen cost.
    route, fetch : RouteCost, FetchCost
        Term-by-term breakdowns (us).
    local_us : float
        ``T_local`` at the chosen ``c``; ``local_range_us`` the band over c in [0.5, 1.5].
    inputs : dict
        The request shape and model/fabric names the decision was made for.
    wire : dict
        One layer's wire bytes: ``route_bytes_per_layer`` (``M_q (q + p)``),
        ``chunk_bytes_per_layer`` (``c_t b_KV``), ``saving`` (the fraction route saves) and
        ``break_even_rows`` (§5.2).

    ``str(decision)`` and :meth:`explain` give the readable table ``mqnc predict`` prints (one
    formatter); ``repr`` is one line with the totals rounded to 0.1 us.
    """

    primitive: str
    runner_up: str | None
    margin_us: float
    margin_ratio: float
    route: RouteCost
    fetch: FetchCost
    local_us: float
    local_range_us: tuple[float, float]
    allowed: tuple[str, ...]
    inputs: dict[str, Any]
    wire: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def costs(self) -> dict[str, float]:
        """Total cost of each primitive (us), allowed or not."""
        return {"route": self.route.total, "fetch": self.fetch.total, "local": self.local_us}

    def explain(self) -> str:
        """The decision as the table ``mqnc predict`` prints: the request, each primitive's
        total and terms (us; ``*`` the choice, ``-`` a primitive not allowed), the decision with
        its margin, and one layer's wire bytes."""
        return "\n".join(_explain_lines(self))

    def __str__(self) -> str:
        return self.explain()

    def __repr__(self) -> str:
        costs = ", ".join(f"{k!r}: {v:.1f}" for k, v in self.costs.items())
        return (
            f"Decision(primitive={self.primitive!r}, costs_us={{{costs}}}, "
            f"runner_up={self.runner_up!r}, margin_us={self.margin_us:.1f})"
        )

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython / Jupyter: the table
        printer.text(self.explain())

    def to_dict(self) -> dict[str, Any]:
        return dict(
            primitive=self.primitive,
            runner_up=self.runner_up,
            margin_us=self.margin_us,
            margin_ratio=self.margin_ratio,
            costs=self.costs,
            route=self.route.to_dict(),
            fetch=self.fetch.to_dict(),
            local=dict(
                total=self.local_us, low=self.local_range_us[0], high=self.local_range_us[1]
            ),
            allowed=list(self.allowed),
            inputs=self.inputs,
            wire=self.wire,
        )


def _explain_lines(d: Decision) -> list[str]:
    """:meth:`Decision.explain`'s lines."""
    r, f, i = d.route, d.fetch, d.inputs
    head = f"model {i['model']}  fabric {i['fabric']}  M_q {i['m_q']:g}  c_t {i['c_t']:g}"
    if i.get("topk"):
        head += f"  top-k {i['topk']} over {i['holders']} holder(s)"
    if i.get("kv_format", "bf16") != "bf16":
        head += f"  cache {i['kv_format']}"
    route = (
        f"probe {r.probe:.1f} + turnaround {r.turnaround:.1f} + transfer {r.transfer:.1f} + "
        f"return {r.return_:.1f} + compute {r.compute:.1f} + merge {r.merge:.1f}"
        + (f" + host {r.host:.1f}" if r.host else "")
    )
    fetch = (
        f"gather {f.pull:.1f} (no splice, §5.4)"
        if f.selection
        else f"pull {f.pull:.1f} + splice {f.splice:.1f} ({i['splice']})"
    )
    lo, hi = d.local_range_us
    local = f"c_t L c, band {lo:.1f} .. {hi:.1f} over c in [0.5, 1.5] us"
    lines = [head, f"{'primitive':<10} {'total (us)':>12}  terms (us)"]
    for name, total, terms in (
        ("route", r.total, route),
        ("fetch", f.total, fetch),
        ("local", d.local_us, local),
    ):
        mark = "*" if name == d.primitive else (" " if name in d.allowed else "-")
        lines.append(f"{mark}{name:<9} {total:>12.1f}  {terms}")
    runner = (
        f"runner-up {d.runner_up} by {d.margin_us:.1f} us ({d.margin_ratio:.1f}x)"
        if d.runner_up
        else "only allowed primitive"
    )
    lines.append(f"decision: {d.primitive} ({runner})")
    w = d.wire
    if w:
        saving = w["saving"]
        lines.append(
            f"wire bytes per layer: route {w['route_bytes_per_layer']:,.0f} B vs chunk "
            f"{w['chunk_bytes_per_layer']:,.0f} B ({100 * saving:.1f}% "
            f"{'fewer' if saving >= 0 else 'more'}); break-even M_q = "
            f"{w['break_even_rows']:.1f}"
        )
    return lines


def _check_geometry(geometry) -> None:
    if not isinstance(geometry, MLAGeometry):
        raise TypeError(f"geometry: expected an MLAGeometry, got {type(geometry).__name__}")


_CONVENIENCE = (PROFILE_FIELDS | REQUEST_FIELDS) - {"fabric", "m_q", "c_t"}


@functools.lru_cache(maxsize=64)
def _plain_profile(fabric: FabricProfile) -> MachineProfile:
    """A fabric's profile with the paper's compute terms (the convenience form's default)."""
    return MachineProfile(fabric)


def _inputs(
    fabric, m_q, c_t, options: dict[str, Any], template: Request | None = None
) -> tuple[MachineProfile, Request]:
    """The convenience form's ``(fabric or profile, m_q, c_t, **options)`` as the predicate's
    two inputs: each option names a :class:`MachineProfile` field (``c_us``, ``splice``,
    ``host``, ...) or a :class:`Request` field (``topk``, ``congestion``, ``allow``, ...)."""
    if not isinstance(fabric, (FabricProfile, MachineProfile)):
        raise TypeError(
            f"fabric: expected a FabricProfile or a MachineProfile, got {type(fabric).__name__}"
        )
    unknown = sorted(set(options) - _CONVENIENCE)
    if unknown:
        raise TypeError(
            f"options: unexpected {unknown}; expected MachineProfile fields "
            f"{sorted(PROFILE_FIELDS - {'fabric'})} or Request fields "
            f"{sorted(REQUEST_FIELDS - {'m_q', 'c_t'})}"
        )
    own = {k: v for k, v in options.items() if k in PROFILE_FIELDS}
    asked = {k: v for k, v in options.items() if k not in own}
    if isinstance(fabric, MachineProfile):
        profile = fabric.replace(**own) if own else fabric
    else:
        profile = MachineProfile(fabric, **own) if own else _plain_profile(fabric)
    if template is None:
        return profile, Request(m_q, c_t, **asked)
    return profile, template.replace(m_q=m_q, c_t=c_t, **asked)


def _terms(
    geometry: MLAGeometry,
    profile: MachineProfile,
    request: Request,
    *,
    bw_gbps=None,
    c_us=None,
) -> tuple[RouteCost, FetchCost, Any, SpliceProfile]:
    """Every primitive's cost for :func:`decide` and :func:`decide_grid` (scalars or arrays),
    and the splice profile fetch was priced with."""
    fabric, r = profile.fabric, request
    route = t_route(
        geometry,
        fabric,
        r.m_q,
        # §6.3's constant, or the holder's memory floor at the profile's read ceiling if larger
        t_compute_us=profile.holder_compute_us(geometry, r.c_t, r.m_q) if r.attention else 0.0,
        t_merge_us=profile.t_merge_us if r.attention else 0.0,
        congestion=r.congestion,
        tp=r.tp,
        holders=r.holders,
        shared_uplink=r.shared_uplink,
        host=profile.host,
        round_trips=r.round_trips,
        bw_gbps=bw_gbps,
    )
    splice = profile.splice_for(r.c_t, r.moved, geometry.cache_dtype)
    fetch = t_fetch(
        geometry,
        fabric,
        r.c_t,
        splice=splice,
        topk=r.topk,
        holders=r.holders,
        gather=profile.gather,
        congestion=r.congestion,
        bw_gbps=bw_gbps,
    )
    local = t_local(geometry, r.c_t, profile.local_c_us if c_us is None else c_us)
    return route, fetch, local, splice


def decide(
    geometry: MLAGeometry,
    profile: MachineProfile | FabricProfile,
    request: Request | float,
    c_t: float | None = None,
    **options: Any,
) -> Decision:
    """Choose route, fetch or local for one (chunk, request) (§5.1).

    ``decide(geometry, profile, request)`` prices ``request`` with ``profile``'s constants.
    The convenience form ``decide(geometry, fabric, m_q, c_t, **options)`` (the README's)
    builds the two: ``fabric`` is a :class:`~mqnc.cost.FabricProfile` (the paper's compute
    terms) or a :class:`MachineProfile`, and each option names a field of either
    (``c_us=0.5``, ``splice=...``, ``host=HOST_PAPER``; ``topk=2048``, ``holders=7``,
    ``congestion=...``, ``allow=("fetch", "local")``); an unknown name is a ``TypeError``.

    Parameters
    ----------
    geometry : MLAGeometry
        The model (``mqnc.model.get_preset``).
    profile : MachineProfile or FabricProfile
        The machine's constants (:func:`mqnc.cost.load_profile`, a calibration), or, in the
        convenience form, a fabric (``mqnc.cost.get_fabric`` or a fit).
    request : Request or float
        What is decided (:class:`Request`: ``m_q``, ``c_t``, selection, routing, congestion,
        the primitives allowed); in the convenience form the routed rows ``m_q``.
    c_t : float or None
        The convenience form's chunk tokens (None with a :class:`Request`).
    **options
        The convenience form's profile and request fields.

    Returns
    -------
    Decision
        The route term includes a host overhead: the profile's ``host``, else the fabric's
        own (a calibrated fabric carries this package's; the paper's fabrics none).
    """
    _check_geometry(geometry)
    if isinstance(request, Request):
        if c_t is not None or options:
            raise TypeError("decide: with a Request, expected no c_t and no options")
        if not isinstance(profile, MachineProfile):
            raise TypeError(
                f"profile: expected a MachineProfile with a Request, got {type(profile).__name__}"
            )
    else:
        profile, request = _inputs(profile, request, c_t, options)
    if not request.scalar:
        raise ValueError("m_q, c_t: expected scalars; use decide_grid for arrays")
    route, fetch, local, splice = _terms(geometry, profile, request)
    costs = {"route": route.total, "fetch": fetch.total, "local": local}
    best, runner, margin, ratio = _rank(costs, request.allow)
    host = host_of(profile.fabric) if profile.host is None else profile.host  # what was added
    congestion = request.congestion
    inputs = dict(
        model=geometry.name,
        kv_format=geometry.cache_dtype,
        fabric=profile.fabric.name,
        m_q=request.m_q,
        c_t=request.c_t,
        topk=request.topk,
        holders=request.holders,
        c_us=profile.local_c_us,
        tp=request.tp,
        round_trips=request.round_trips,
        congestion=dataclasses.asdict(congestion) if congestion else None,
        host=dataclasses.asdict(host) if host else None,
        splice=splice.name,
    )
    return Decision(
        best,
        runner,
        margin,
        ratio,
        route,
        fetch,
        local,
        t_local_range(geometry, request.c_t),
        request.allow,
        inputs,
        dict(
            route_bytes_per_layer=request.m_q * geometry.qp_row_bytes,
            chunk_bytes_per_layer=request.c_t * geometry.kv_bytes_per_token_layer,
            saving=wire_byte_saving(geometry, request.m_q, request.c_t),
            break_even_rows=wire_break_even_rows(geometry, request.c_t),
        ),
    )


def _rank(costs: dict[str, float], allow: tuple[str, ...]):
    """``(best, runner_up, margin_us, margin_ratio)`` among the allowed primitives."""
    ranked = sorted(allow, key=costs.__getitem__)
    best = ranked[0]
    if len(ranked) == 1:
        return best, None, math.inf, math.inf
    runner = ranked[1]
    ratio = costs[runner] / costs[best] if costs[best] > 0 else math.inf
    return best, runner, costs[runner] - costs[best], ratio


@dataclasses.dataclass(frozen=True)
class DecisionGrid:
    """Decisions over a grid: arrays of one broadcast shape.

    ``choice`` holds int8 codes into :data:`PRIMITIVES`; ``route_us``, ``fetch_us``, ``local_us``
    the totals; ``margin_us`` the runner-up minus the chosen cost.
    """

    choice: np.ndarray
    route_us: np.ndarray
    fetch_us: np.ndarray
    local_us: np.ndarray
    margin_us: np.ndarray

    @property
    def primitive(self) -> np.ndarray:
        """The chosen primitive's name at each grid point."""
        return np.asarray(PRIMITIVES)[self.choice]

    def fraction(self, primitive: str) -> float:
        """Share of grid points where ``primitive`` wins."""
        return float(np.mean(self.choice == PRIMITIVES.index(primitive)))


def decide_grid(
    geometry: MLAGeometry,
    profile: MachineProfile | FabricProfile,
    m_q,
    c_t,
    *,
    bw_gbps=None,
    request: Request | None = None,
    **options: Any,
) -> DecisionGrid:
    """:func:`decide` over numpy arrays that broadcast together (``m_q[:, None]``, ...).

    ``bw_gbps`` (an array or a float), when given, replaces both the route bandwidth and the
    bulk-pull bandwidth (the single "effective per-GPU-pair bandwidth" axis of Fig. 6(a)).
    ``request``, when given, is the template of every grid point (its ``m_q`` and ``c_t``
    replaced); ``options`` as in :func:`decide`'s convenience form (``c_us`` may be an array).
    """
    _check_geometry(geometry)
    c_us = options.get("c_us")
    if c_us is not None and not is_scalar(c_us):  # an axis of the grid, not a profile term
        del options["c_us"]
        check_positive("c_us", c_us)
    else:
        c_us = None
    if bw_gbps is not None:
        check_positive("bw_gbps", bw_gbps)
    profile, req = _inputs(profile, m_q, c_t, options, request)
    req = req.replace(
        m_q=np.asarray(req.m_q, dtype=np.float64), c_t=np.asarray(req.c_t, dtype=np.float64)
    )
    route, fetch, local, _ = _terms(geometry, profile, req, bw_gbps=bw_gbps, c_us=c_us)
    route, fetch, local = np.broadcast_arrays(route.total, fetch.total, local)
    stack = np.stack([route, fetch, local]).astype(np.float64, copy=True)
    for i, name in enumerate(PRIMITIVES):
        if name not in req.allow:
            stack[i] = np.inf
    choice = np.argmin(stack, axis=0).astype(np.int8)
    if len(req.allow) > 1:
        part = np.partition(stack, 1, axis=0)
        margin = part[1] - part[0]
    else:
        margin = np.full(choice.shape, np.inf)
    return DecisionGrid(choice, route.copy(), fetch.copy(), local.copy(), margin)


def crossover_map(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    m_q_axis: Iterable[float],
    c_t_axis: Iterable[float],
    **kwargs: Any,
) -> DecisionGrid:
    """The ``M_q x c_t`` decision map (Fig. 3(b) on total cost): rows ``M_q``, columns ``c_t``."""
    m = np.asarray(list(m_q_axis) if not isinstance(m_q_axis, np.ndarray) else m_q_axis, float)
    c = np.asarray(list(c_t_axis) if not isinstance(c_t_axis, np.ndarray) else c_t_axis, float)
    return decide_grid(geometry, fabric, m[:, None], c[None, :], **kwargs)


def bw_sweep(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    bw_axis: Iterable[float],
    *,
    m_q: float = 256,
    c_t: float = 2048,
    **kwargs: Any,
) -> DecisionGrid:
    """Costs vs effective bandwidth at one request shape (Fig. 6(a): ``M_q`` 256, ``c_t`` 2048)."""
    bw = np.asarray(list(bw_axis) if not isinstance(bw_axis, np.ndarray) else bw_axis, float)
    return decide_grid(geometry, fabric, m_q, c_t, bw_gbps=bw, **kwargs)


# ---- closed forms ------------------------------------------------------------------------------


def wire_break_even_rows(geometry: MLAGeometry, c_t):
    """``M_q = c_t b_KV / (q + p)`` (§5.2): where route's and fetch's wire bytes are equal.

    Per layer on both sides (or all layers on both: ``L`` cancels). V2-Lite, c_t = 2048: 1080.3.
    """
    return c_t * geometry.kv_bytes_per_token_layer / geometry.qp_row_bytes


def wire_byte_saving(geometry: MLAGeometry, m_q, c_t):
    """Fraction of wire bytes route saves over pulling the chunk: ``1 - M_q (q+p) / (c_t b_KV)``
    (§5.2, Fig. 3(b)); negative where the pull moves fewer bytes."""
    return 1.0 - m_q * geometry.qp_row_bytes / (c_t * geometry.kv_bytes_per_token_layer)


def selection_break_even_rows(geometry: MLAGeometry, topk: int | None = None):
    """The §5.4 reading: the wire break-even at the selection budget ``c_t = k``.

    ``topk`` defaults to the model's published ``index_topk``; an error if it has none.
    """
    k = geometry.topk if topk is None else topk
    if k is None:
        raise ValueError(
            f"topk: model {geometry.name!r} has no selection budget (index_topk); pass topk="
        )
    return wire_break_even_rows(geometry, k)


def fetch_local_crossover_tokens(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    *,
    c_us: float = LOCAL_C_US,
    splice: SpliceProfile = SPLICE_PAPER,
    bw_gbps: float | None = None,
) -> float:
    """Chunk size above which fetch (pull + splice) undercuts local (re-prefill) (§5.1, Fig. 1(b)).

    Solves ``c_t L c = c_t b_KV L / BW_bulk + T_splice(c_t)``: closed form for a flat splice,
    bisection for a measured profile (its slope is far below ``L c``). ``inf`` when a token is
    cheaper to re-prefill than to pull (then local always wins).
    """
    bw = fabric.bulk_bw if bw_gbps is None else bw_gbps
    per_token = geometry.layers * c_us - bytes_to_us(
        geometry.kv_bytes_per_token_layer * geometry.layers, bw
    )
    if per_token <= 0:
        return math.inf
    if len(splice.tokens) == 1:
        return splice.us[0] / per_token

    def gap(x: float) -> float:
        return per_token * x - splice.at(x)

    lo, hi = 0.0, 1.0
    while gap(hi) < 0:
        hi *= 2.0
        if hi > 1e15:
            return math.inf
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
        if hi - lo <= 1e-9 * hi:
            break
    return 0.5 * (lo + hi)


def route_fetch_inversion_rows(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    c_t: float,
    *,
    splice: SpliceProfile = SPLICE_PAPER,
    **route_kwargs: Any,
) -> float:
    """``M_q`` above which fetch's total cost undercuts route's (§5.5, "≳ 10^5").

    Route is affine in ``M_q``, so the crossing is closed-form. ``route_kwargs`` go to
    :func:`mqnc.cost.t_route` (compute, merge, congestion, tp, ...).
    """
    fetch = t_fetch(
        geometry, fabric, c_t, splice=splice, congestion=route_kwargs.get("congestion")
    ).total
    a = t_route(geometry, fabric, 0.0, **route_kwargs).total
    b = t_route(geometry, fabric, 1.0, **route_kwargs).total - a
    return (fetch - a) / b if fetch > a else 0.0


def congestion_bw_threshold_gbps(geometry: MLAGeometry, m_q: float, t_splice_us: float) -> float:
    """§8 (i): the route bandwidth below which route's transfer alone exceeds the splice,
    ``M_q (q+p) / T_splice`` (≈0.19 GB/s at M_q = 256, 3 ms). This assumes congestion slows
    route but not fetch's pull (``Congestion(on_fetch=False)``); see the module docstring."""
    return m_q * geometry.qp_row_bytes / (t_splice_us * 1e3)


# ---- serving rules of thumb (§5.5) -------------------------------------------------------------


def amortisation_steps(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    m_q: float,
    c_t: float,
    *,
    splice: SpliceProfile = SPLICE_PAPER,
    **route_kwargs: Any,
) -> float:
    """ "fetch only to amortise" (§5.5): attention steps after which one fetch pays off.

    After a fetch every later step attends locally for ``T_compute`` (the same partial, now
    local); routing pays ``T_route`` every step. Break-even: ``T_fetch + n T_compute = n T_route``,
    so ``n = T_fetch / (T_route - T_compute)``.
    """
    route = t_route(geometry, fabric, m_q, **route_kwargs)
    congestion = route_kwargs.get("congestion")  # the fetch sees it too (as in the inversion)
    fetch = t_fetch(geometry, fabric, c_t, splice=splice, congestion=congestion).total
    per_step = route.total - route.compute
    return fetch / per_step if per_step > 0 else math.inf


def rank_fabrics(
    geometry: MLAGeometry, fabrics: Iterable[FabricProfile], m_q: float, **route_kwargs: Any
) -> list[tuple[str, float]]:
    """ "choose the fabric by probe, not peak bandwidth" (§5.5): fabrics by route round trip at
    ``m_q`` (transport term), cheapest first."""
    out = [(f.name, float(t_route(geometry, f, m_q, **route_kwargs).transport)) for f in fabrics]
    return sorted(out, key=lambda t: t[1])


def local_band_tokens(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    *,
    splice: SpliceProfile = SPLICE_PAPER,
    bw_gbps: float | None = None,
) -> tuple[float, float]:
    """ "local only for small chunks" (§5.5): the fetch-vs-local crossover over c in [0.5, 1.5]
    us per token-layer, as ``(low, high)`` tokens (c = 1.5 gives the low end)."""
    lo_c, hi_c = LOCAL_C_RANGE_US
    kw = dict(splice=splice, bw_gbps=bw_gbps)
    return (
        fetch_local_crossover_tokens(geometry, fabric, c_us=hi_c, **kw),
        fetch_local_crossover_tokens(geometry, fabric, c_us=lo_c, **kw),
    )


def congestion_reprices(
    geometry: MLAGeometry,
    fabric: FabricProfile,
    m_q: float,
    c_t: float,
    congestion: Congestion,
    **kwargs: Any,
) -> bool:
    """ "contention does not reprice the decision" (§5.5): whether ``congestion`` changes it."""
    before = decide(geometry, fabric, m_q, c_t, **kwargs).primitive
    after = decide(geometry, fabric, m_q, c_t, congestion=congestion, **kwargs).primitive
    return before != after
