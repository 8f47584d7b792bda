"""The measured route, fetch and local costs against the paper's numbers and the cost model,
one panel per device and transport, drawn from the results file's records.

Each panel is a dot plot over the paper's operating points (one row each, cost on a log axis):

- **measured** (filled, the primitive's colour): the p50 of this device/transport's records at
  that point, with its p20-p80 bar; absent when nothing was recorded there;
- **paper** (black diamond, or a black bar for a range or a bound): the number the paper
  prints (H100; section in the row's label);
- **model, paper constants** (grey cross): :mod:`mqnc.cost` with the constants the predicate
  uses uncalibrated (the ``h100-ibgda`` fabric of Table 2, :data:`~mqnc.cost.SPLICE_PAPER`,
  :data:`~mqnc.cost.GATHER_PAPER`, ``T_compute`` 15 us, ``c`` 1 us per token-layer);
- **model, fitted here** (green plus, route rows only): the same closed form with the probe and
  bandwidth fitted to this panel's route and probe records (:func:`mqnc.cost.fit`, as
  ``mqnc fit`` fits them).

Records read: ``route`` (``x`` = M_q at the geometry's ``q + p``), ``probe``, ``fetch``
(``x_name`` "holders": the gather per layer; "c_t": the all-layer pull), and per device (no
transport) ``holder`` (``x_name`` "requesters", the geometry's head count, ``c_t`` 2048),
``splice`` (the package's ``one-launch`` variant where recorded, else the fastest) and
``local`` (a re-prefill, ``x`` = c_t), when present.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from mqnc.cost import (
    GATHER_PAPER,
    SPLICE_PAPER,
    T_COMPUTE_US,
    fit,
    get_fabric,
    t_local,
    t_pull,
    t_route,
)
from mqnc.plots._common import (
    COLORS,
    COMMANDS,
    MissingData,
    _short_device,
    _us,
    readable_log_ticks,
    wrapped_title,
)

__all__ = ["PaperPoint", "PAPER_POINTS", "paper_panels", "route_vs_paper"]


@dataclasses.dataclass(frozen=True)
class PaperPoint:
    """One of the paper's operating points: its printed number (``lo`` = ``hi``), range
    (``lo`` < ``hi``) or bound (``lo`` = 0: at most ``hi``), in us, on the H100."""

    label: str
    primitive: str
    lo: float
    hi: float
    section: str


PAPER_POINTS = (
    PaperPoint("probe (1-byte round trip)", "route", 15.9, 15.9, "Table 1"),
    PaperPoint("route round trip, M_q 256", "route", 45.6, 45.6, "§8, idle"),
    PaperPoint("route round trip, M_q 1024", "route", 115.8, 115.8, "Table 1"),
    PaperPoint("route round trip, M_q 4096", "route", 388.0, 388.0, "§7"),
    PaperPoint("holder partial, N <= 16 requesters", "route", 15.0, 37.0, "§6.3"),
    PaperPoint("holder partial, N 256 requesters", "route", 0.0, 400.0, "§6.3"),
    PaperPoint("fetch gather top-2048, 1 holder (per layer)", "fetch", 1300.0, 1300.0, "§5.4"),
    PaperPoint("fetch gather top-2048, 7 holders (per layer)", "fetch", 3900.0, 3900.0, "§5.4"),
    PaperPoint("fetch all-layer pull, c_t 2048", "fetch", 2500.0, 2500.0, "§5.1"),
    PaperPoint("fetch splice, c_t 2048, 27 layers", "fetch", 2910.0, 2910.0, "§7"),
    PaperPoint("local re-prefill, c_t 2048", "local", 27648.0, 82944.0, "§5.1, c 0.5-1.5"),
)
"""The paper's numbers the figure compares against, in row order (the local range is
``c_t L c`` at c = 0.5 and 1.5 us per token-layer, L = 27, as §5.1 states it)."""

_TRANSPORT_BENCHES = ("route", "probe", "fetch")
_DEVICE_BENCHES = ("holder", "splice", "local")


def _at(recs: Sequence[dict], x: float) -> list[dict]:
    return [r for r in recs if float(r["x"]) == x]


def _panel_records(records: Sequence[dict], device: str, transport: str, variant: str | None):
    """This panel's records by bench: the transport's route/probe (of ``variant`` when the
    transport has several) and fetch, and the device's kernel benches."""
    mine = [r for r in records if str(r.get("device")) == device]
    out: dict[str, list[dict]] = {}
    for r in mine:
        bench = r.get("bench")
        if bench in _TRANSPORT_BENCHES and str(r.get("transport")) == transport:
            if bench in ("route", "probe") and variant is not None and r.get("variant") != variant:
                continue
            out.setdefault(bench, []).append(r)
        elif bench in _DEVICE_BENCHES:
            out.setdefault(bench, []).append(r)
    return out


def paper_panels(records: Sequence[dict]) -> list[tuple[str, str, str | None]]:
    """The panels: ``(device, transport, route variant or None)`` for every device and
    transport with route, probe or fetch records (a transport with several route variants gets
    one panel each), GPUs first."""
    keys: set[tuple[str, str, str | None]] = set()
    variants: dict[tuple[str, str], set[str]] = {}
    for r in records:
        if r.get("bench") in _TRANSPORT_BENCHES and r.get("transport"):
            key = (str(r.get("device")), str(r.get("transport")))
            keys.add((*key, None))
            if r.get("bench") in ("route", "probe"):
                variants.setdefault(key, set()).add(str(r.get("variant")))
    out = set()
    for dev, tr, _ in keys:
        vs = variants.get((dev, tr), set())
        out.update({(dev, tr, v) for v in vs} if len(vs) > 1 else {(dev, tr, None)})
    return sorted(out, key=lambda k: (k[0].startswith("CPU"), k[0], k[1], k[2] or ""))


def _measured(recs: dict[str, list[dict]], geometry) -> list[list[dict]]:
    """Per PAPER_POINTS row, the records measuring that point (possibly none)."""
    qp = geometry.qp_row_bytes
    route = [
        r
        for r in recs.get("route", [])
        if int((r.get("extra") or {}).get("qp_row_bytes", qp)) == qp
    ]
    holder = [
        r
        for r in recs.get("holder", [])
        if r.get("x_name") == "requesters"
        and (r.get("extra") or {}).get("heads", geometry.heads) == geometry.heads
        and (r.get("extra") or {}).get("c_t", 2048) == 2048
    ]
    small = [r for r in holder if float(r["x"]) <= 16]
    n_small = max((float(r["x"]) for r in small), default=None)
    gather = [r for r in recs.get("fetch", []) if r.get("x_name") == "holders"]
    pull = [r for r in recs.get("fetch", []) if r.get("x_name") in ("c_t", "ct")]
    splice = _at(recs.get("splice", []), 2048)
    preferred = [r for r in splice if r.get("variant") == "one-launch"]
    if not preferred and splice:
        preferred = [min(splice, key=_us)]
    return [
        recs.get("probe", []),
        _at(route, 256),
        _at(route, 1024),
        _at(route, 4096),
        _at(holder, n_small) if n_small is not None else [],
        _at(holder, 256),
        _at(gather, 1),
        _at(gather, 7),
        _at(pull, 2048),
        preferred,
        _at(recs.get("local", []), 2048),
    ]


def _paper_model(geometry) -> list[float | None]:
    """Per row, the cost model with the paper's constants (None: the model has no such term)."""
    ib = get_fabric("h100-ibgda")
    return [
        ib.t_probe_us,
        float(t_route(geometry, ib, 256).transport),
        float(t_route(geometry, ib, 1024).transport),
        float(t_route(geometry, ib, 4096).transport),
        T_COMPUTE_US,
        None,
        float(GATHER_PAPER.per_layer_us(geometry, 2048, 1)),
        float(GATHER_PAPER.per_layer_us(geometry, 2048, 7)),
        float(t_pull(geometry, ib, 2048)),
        float(SPLICE_PAPER.at(2048)),
        float(t_local(geometry, 2048)),
    ]


def _fitted_model(recs: dict[str, list[dict]], geometry) -> list[float | None]:
    """Route rows from the probe and bandwidth fitted to this panel's records, else None."""
    qp = geometry.qp_row_bytes
    route = [
        r
        for r in recs.get("route", [])
        if int((r.get("extra") or {}).get("qp_row_bytes", qp)) == qp
    ]
    probes = [_us(r) for r in recs.get("probe", [])]
    none: list[float | None] = [None] * len(PAPER_POINTS)
    if len({float(r["x"]) for r in route}) < 2:
        return none
    try:
        res = fit(
            [(float(r["x"]), _us(r)) for r in route], qp_row_bytes=qp, probe_us=probes or None
        )
    except ValueError:
        return none
    pred = [float(res.t_probe_us)] + [float(res.predict(m)) for m in (256, 1024, 4096)]
    return pred + none[4:]


def route_vs_paper_panel(
    ax, records: Sequence[dict], geometry, device: str, transport: str, variant: str | None = None
) -> dict:
    """One panel of :func:`route_vs_paper`: ``device`` over ``transport`` (and route
    ``variant``). Returns ``{"measured": [p50 or None per row], "paper": [(lo, hi)],
    "model_paper": [...], "model_fitted": [...]}`` in :data:`PAPER_POINTS` order."""
    recs = _panel_records(records, device, transport, variant)
    measured = _measured(recs, geometry)
    model_p, model_f = _paper_model(geometry), _fitted_model(recs, geometry)
    rows = np.arange(len(PAPER_POINTS))[::-1]
    out = {"measured": [], "paper": [], "model_paper": model_p, "model_fitted": model_f}
    rows_in = zip(rows, PAPER_POINTS, measured, model_p, model_f, strict=True)
    for i, (y, point, meas, mp, mf) in enumerate(rows_in):
        if point.lo == point.hi:
            ax.plot([point.lo], [y], "D", color="k", ms=5, mfc="none", mew=1.2, gid=f"paper:{i}")
        else:
            lo = point.lo if point.lo > 0 else point.hi / 4
            ax.plot(
                [lo, point.hi],
                [y, y],
                "-",
                color="k",
                lw=2.2,
                alpha=0.55,
                solid_capstyle="butt",
                gid=f"paper:{i}",
            )
            if point.lo == 0:
                ax.plot([point.hi], [y], "<", color="k", ms=5)
        out["paper"].append((point.lo, point.hi))
        if mp is not None:
            ax.plot([mp], [y + 0.18], "x", color="0.45", ms=6, mew=1.4, gid=f"model_paper:{i}")
        if mf is not None:
            ax.plot(
                [mf], [y + 0.18], "+", color=COLORS["route"], ms=8, mew=1.4, gid=f"model_fitted:{i}"
            )
        out["measured"].append(_draw_measured(ax, y - 0.18, meas, point, f"measured:{i}"))
    ax.set_yticks(rows, [f"{p.label} ({p.section})" for p in PAPER_POINTS], fontsize=7)
    for tick, p in zip(ax.get_yticklabels(), PAPER_POINTS, strict=True):
        tick.set_color(COLORS[p.primitive])
    ax.set_xscale("log")
    drawn = [x for line in ax.get_lines() for x in line.get_xdata()]
    if drawn:  # room right of the largest for a point's backend label (shared across panels)
        ax.set_xlim(right=max(ax.get_xlim()[1], 6.0 * max(drawn)))
    ax.set_ylim(-0.6, len(PAPER_POINTS) - 0.4)
    ax.grid(axis="x", which="major", alpha=0.3)
    ax.set_xlabel("cost (us)")
    name = transport + (f" / {variant}" if variant and variant != transport else "")
    setups = sorted(
        {str(r["extra"]["pes"]) for r in recs.get("route", []) if (r.get("extra") or {}).get("pes")}
    )
    wrapped_title(ax, f"{_short_device(device)}, {name}" + "".join(f"\n({s})" for s in setups))
    readable_log_ticks(ax, "x", fmt=_time)
    return out


def _draw_measured(ax, y: float, meas: list[dict], point: PaperPoint, gid: str) -> float | None:
    """The median p50 of ``meas`` at row ``y`` with its p20-p80 bar (the backend beside a
    kernel's point); returns that p50, None (nothing drawn) when ``meas`` is empty."""
    if not meas:
        return None

    def pct(key: str) -> float:
        return float(np.median([_us(r, key) if r.get(key) is not None else _us(r) for r in meas]))

    p50, p20, p80 = pct("p50"), pct("p20"), pct("p80")
    bars = ax.errorbar(
        [p50],
        [y],
        xerr=[[p50 - p20], [p80 - p50]],
        fmt="o",
        color=COLORS[point.primitive],
        ms=5.5,
        capsize=2,
    )
    bars[0].set_gid(gid)
    if point.primitive != "route" or meas[0].get("bench") in _DEVICE_BENCHES:
        backends = ", ".join(sorted({str(r.get("backend")) for r in meas}))
        ax.annotate(
            backends,
            (p80, y),
            xytext=(4, 0),
            textcoords="offset points",
            fontsize=5.5,
            va="center",
            color="0.3",
        )
    return p50


def _time(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:g} s"
    if us >= 1e3:
        return f"{us / 1e3:g} ms"
    return f"{us:g} us"


def route_vs_paper(
    fig,
    records: Sequence[dict],
    geometry,
    *,
    ncols: int = 2,
    panel: Callable = route_vs_paper_panel,
) -> dict:
    """Draw one panel per device and transport (:func:`paper_panels`) into ``fig``, with one
    legend for the figure. Returns ``{(device, transport, variant): panel's dict}``.

    Raises
    ------
    MissingData
        No route, probe or fetch records.
    """
    keys = paper_panels(records)
    if not keys:
        raise MissingData(
            "no route, probe or fetch records to compare with the paper", COMMANDS["route"]
        )
    ncols = min(ncols, len(keys))
    nrows = -(-len(keys) // ncols)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, sharex=True, squeeze=False)).ravel()
    out = {}
    for i, (ax, key) in enumerate(zip(axes, keys, strict=False)):
        out[key] = panel(ax, records, geometry, *key)
        if i % ncols:
            ax.tick_params(labelleft=False)
    for ax in axes[len(keys) :]:
        ax.set_axis_off()
    handles = [
        fig.axes[0].plot([], [], "o", color="0.3", ms=5.5)[0],
        fig.axes[0].plot([], [], "D", color="k", mfc="none", ms=5)[0],
        fig.axes[0].plot([], [], "-", color="k", lw=2.2, alpha=0.55)[0],
        fig.axes[0].plot([], [], "x", color="0.45", ms=6, mew=1.4)[0],
        fig.axes[0].plot([], [], "+", color=COLORS["route"], ms=8, mew=1.4)[0],
    ]
    labels = [
        "measured p50 (p20-p80), colour = primitive: route green, fetch red, local purple",
        "paper (H100)",
        "paper range / bound (<)",
        "model, paper constants (h100-ibgda, paper splice, gather, c)",
        "model, probe and bandwidth fitted to this panel's route records",
    ]
    fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=7)
    fig.suptitle(
        f"route / fetch / local: measured vs the paper vs the cost model ({geometry.name})",
        fontsize=10,
    )
    return out
