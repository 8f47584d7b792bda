"""The paper's figures, drawn from this package's model and from the results file.

Every function draws ONE figure (or one panel) onto a matplotlib ``Axes`` it is given, from
model objects (:class:`~mqnc.geometry.MLAGeometry`, :class:`~mqnc.fabric.FabricProfile`, the
predicate's grids) or from the records of ``perf/results/results.jsonl``; nothing is typed
in. The notebooks (``notebooks/01_cost_model.ipynb``, ``notebooks/02_measurements.ipynb``) and
the CLI call the same functions. matplotlib is imported inside the functions only, so importing
this module costs numpy and nothing else.

Model figures (§4, §5, §8):

- :func:`payload_bars` Fig. 1(a): a routed row ``q + p`` against one layer's and all layers'
  ``c_KV`` chunk;
- :func:`cost_vs_chunk` Fig. 1(b): the three primitives against chunk size (local as the band
  over ``c`` in [0.5, 1.5] us per token-layer);
- :func:`wire_saving_map` Fig. 3(b): route's wire-byte saving over the ``(M_q, c_t)`` grid with
  the break-even line ``M_q = c_t b_KV / (q + p)``; :func:`decision_map` the argmin on total
  cost over the same grid;
- :func:`bw_sweep_plot` Fig. 6(a): cost against effective bandwidth at one request shape.

Measurement figures, from records (the long format of ``perf/_results.py``). Each raises
:class:`MissingData` (with the command that produces the records) when there is nothing to
draw. The records they read:

- :func:`route_round_trip` Fig. 2(b): ``bench="route"``, ``x`` = M_q, ``p50`` the round trip
  (us), one curve per ``variant`` (transport) and device, ``extra["qp_row_bytes"]`` for the
  payload sweep; ``bench="probe"`` (same variant) the 1-byte ``sig_rt``. Fitted with
  :func:`mqnc.costmodel.fit` exactly as ``mqnc fit`` does.
- :func:`gather_vs_route` Fig. 4(a): ``bench="fetch"`` with ``x_name="holders"`` (the scattered
  gather over ``M`` holders, per layer) and ``bench="route_fanout"`` (``x`` = M, the route
  fan-out: sends plus the M-way merge). A separate bench name keeps the fan-out out of the
  M_q fit. Model: the gather's affine law of §5.4 (``M t_handshake + k b_KV / BW_gather``,
  least squares) and the route fan-out's flat line.
- :func:`holder_compute` Fig. 4(b): ``bench="holder"`` with ``x_name="requesters"`` (``x`` = N),
  fitted with the flat-then-linear law of §6.3 (``t_0 + s max(0, N - N_0)``).
- :func:`congestion_plot` Fig. 7: ``bench="congestion"``, ``x`` = K concurrent flows, variant
  ``"probe"`` for the probe and the route round trip at ``extra["m_q"]`` (or a variant
  ``"M_q=256"``) otherwise. Model: :func:`mqnc.costmodel.fit_congestion` from the idle and the
  fully subscribed point at the largest M_q, predicting the other batches.
- :func:`bench_plot`: any benchmark (merge, copy, mla, splice, predicate, ...): p50 against
  ``x`` per variant, p20-p80 shaded, device and backend in the title.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "COLORS",
    "MissingData",
    "COMMANDS",
    "TRANSPORT_BENCHES",
    "results_path",
    "read_results",
    "benches",
    "save",
    "try_draw",
    "payload_bars",
    "cost_vs_chunk",
    "wire_saving_map",
    "decision_map",
    "bw_sweep_plot",
    "route_round_trip",
    "gather_vs_route",
    "holder_compute",
    "congestion_plot",
    "bench_plot",
]

COLORS = {"route": "#2ca02c", "fetch": "#d62728", "local": "#9467bd"}
"""The paper's colours: route green, fetch red, local purple."""

COMMANDS = {
    "route": "python -m perf.bench_route",
    "probe": "python -m perf.bench_route",
    "route_fanout": "python -m perf.bench_fetch",
    "fetch": "python -m perf.bench_fetch",
    "holder": "python -m perf.bench_holder",
    "congestion": "python -m perf.bench_congestion",
    "merge": "python -m perf.bench_merge",
    "copy": "python -m perf.bench_copy",
    "splice": "python -m perf.bench_splice",
    "predicate": "python -m perf.bench_predicate",
}
"""The command that appends each bench's records to the results file."""

TRANSPORT_BENCHES = ("route", "probe", "route_fanout", "fetch", "holder", "congestion")
"""Benches drawn by the figure functions; everything else is a kernel benchmark."""

_UNIT_US = {"us": 1.0, "ms": 1e3, "s": 1e6, "ns": 1e-3}


class MissingData(LookupError):
    """No records to draw a figure from; ``command`` is what produces them."""

    def __init__(self, message: str, command: str | None = None):
        super().__init__(message + (f" (run `{command}`)" if command else ""))
        self.command = command


# ---- the results file --------------------------------------------------------------------------


def results_path(path: str | os.PathLike | None = None) -> Path:
    """The results file: ``path``, else ``$MQNC_RESULTS``, else ``perf/results/results.jsonl``
    in the nearest folder at or above the working directory that has one (the repository
    root when run from ``notebooks/``), else that path relative to the working directory."""
    if path is None:
        path = os.environ.get("MQNC_RESULTS") or None
    if path is not None:
        return Path(path)
    rel = Path("perf") / "results" / "results.jsonl"
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / rel).exists():
            return folder / rel
    return here / rel


def read_results(path: str | os.PathLike | None = None) -> list[dict]:
    """Every record of the results file (``[]`` when it does not exist).

    A line that is not JSON is an error naming the file and line.
    """
    from mqnc.costmodel import read_jsonl

    p = results_path(path)
    return read_jsonl(p) if p.exists() else []


def benches(records: Iterable[dict]) -> list[str]:
    """The bench names present, in first-seen order."""
    seen: dict[str, None] = {}
    for r in records:
        seen.setdefault(str(r.get("bench")), None)
    return list(seen)


def _select(records: Iterable[dict], bench: str, x_name: str | None = None, unit_us=True):
    out = []
    for r in records:
        if r.get("bench") != bench:
            continue
        if x_name is not None and r.get("x_name") != x_name:
            continue
        if unit_us and r.get("unit", "us") not in _UNIT_US:
            continue
        out.append(r)
    return out


def _us(r: dict, key: str = "p50") -> float:
    return float(r[key]) * _UNIT_US.get(r.get("unit", "us"), 1.0)


def _devices(records: Iterable[dict]) -> list[str]:
    return sorted({str(r.get("device", "?")) for r in records})


def _medians(records: Iterable[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, p20, p50, p80) sorted by x, the median over repeated records at one x."""
    by_x: dict[float, list[tuple[float, float, float]]] = {}
    for r in records:
        p50 = _us(r)
        p20 = _us(r, "p20") if r.get("p20") is not None else p50
        p80 = _us(r, "p80") if r.get("p80") is not None else p50
        by_x.setdefault(float(r["x"]), []).append((p20, p50, p80))
    xs = np.array(sorted(by_x))
    med = np.array([np.median(np.asarray(by_x[x]), axis=0) for x in xs]).reshape(-1, 3)
    return xs, med[:, 0], med[:, 1], med[:, 2]


def _group(records: Iterable[dict], key: Callable[[dict], Any]) -> dict[Any, list[dict]]:
    out: dict[Any, list[dict]] = {}
    for r in records:
        out.setdefault(key(r), []).append(r)
    return out


def _short_device(name: str) -> str:
    return name.replace("NVIDIA ", "").replace("CPU: ", "")


# ---- saving ------------------------------------------------------------------------------------


def save(fig, name: str, fig_dir: str | os.PathLike | None, dpi: int = 110) -> Path | None:
    """Write ``fig`` as ``fig_dir/name.png`` (nothing when ``fig_dir`` is None)."""
    if fig_dir is None:
        return None
    out = Path(fig_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=dpi)
    return path


def try_draw(
    name: str,
    draw: Callable[..., Any],
    *args: Any,
    fig_dir: str | os.PathLike | None = None,
    figsize: tuple[float, float] = (6.4, 4.2),
    **kwargs: Any,
):
    """Draw ``draw(ax, *args, **kwargs)`` on a new figure and save it as ``name``; when the
    records are missing, print what is missing and the command that produces it instead.

    Returns
    -------
    (Figure, object) or (None, None)
        The figure and what ``draw`` returned (a fit, a grid), or ``(None, None)`` when the
        records are missing.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize, constrained_layout=True)
    try:
        result = draw(ax, *args, **kwargs)
    except MissingData as exc:
        plt.close(fig)
        print(f"{name}: not drawn: {exc}")
        return None, None
    path = save(fig, name, fig_dir)
    if path is not None:
        print(f"{name}: wrote {path}")
    return fig, result


# ---- model figures (§4, §5, §8) ----------------------------------------------------------------


def payload_bars(ax, geometry, *, c_t: int = 2048):
    """Fig. 1(a): wire bytes of one routed row against the chunk a fetch pulls (§2.1, §3.2).

    Bars (log scale): the absorbed query row ``q``, the partial ``p`` (``o`` plus fp32 ``m``,
    ``l``), the routed ``q + p``, one layer of a ``c_t``-token ``c_KV`` chunk and all ``L``
    layers of it; the ratio chunk / (q + p) is written above the one-layer bar.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    geometry : MLAGeometry
        Byte sizes come from its properties.
    c_t : int
        Chunk tokens.
    """
    g = geometry
    one = g.chunk_bytes(c_t, layers=1)
    labels = [
        f"q\n({g.d_qk} x {g.q_row_bytes // g.d_qk} B)",
        "p\n(o, m, l)",
        "q + p\n(routed row)",
        f"c_KV chunk\n1 layer, c_t={c_t}",
        f"c_KV chunk\n{g.layers} layers",
    ]
    values = [g.q_row_bytes, g.p_row_bytes, g.qp_row_bytes, one, g.chunk_bytes(c_t)]
    colors = [COLORS["route"]] * 3 + [COLORS["fetch"]] * 2
    bars = ax.bar(range(len(values)), values, color=colors)
    for b, alpha in zip(bars, (0.55, 0.55, 1.0, 1.0, 0.55), strict=True):
        b.set_alpha(alpha)
    for b, v in zip(bars, values, strict=True):
        ax.text(b.get_x() + b.get_width() / 2, v * 1.15, _fmt_bytes(v), ha="center", fontsize=8)
    ax.annotate(
        f"x{one / g.qp_row_bytes:,.0f}",
        xy=(3, one * 4),
        ha="center",
        fontsize=11,
        fontweight="bold",
    )
    ax.set_xticks(range(len(values)), labels, fontsize=8)
    ax.set(yscale="log", ylabel="bytes", ylim=(min(values) / 3, max(values) * 30))
    ax.set_title(f"(a) payload asymmetry, {g.name}")
    return ax


def _fmt_bytes(v: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if v >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0f} B"


def cost_vs_chunk(
    ax,
    geometry,
    fabric,
    *,
    m_q: float = 256,
    bw_gbps: float | None = 70.0,
    c_t_axis: Sequence[float] | np.ndarray | None = None,
    splice=None,
    **route_kwargs: Any,
):
    """Fig. 1(b): cost of route, fetch and local against chunk size (§4.2, §5.1).

    route is ``T_route(M_q)`` (flat in ``c_t``); fetch the all-layer pull plus the splice
    profile; local ``c_t L c`` as a band over ``c`` in [0.5, 1.5] us per token-layer with the
    middle ``c`` drawn. The fetch/local crossover band of §5.1 is shaded.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    geometry : MLAGeometry
    fabric : FabricProfile
        Probe and turnaround; its bandwidths unless ``bw_gbps`` is given.
    m_q : float
        Routed rows (256: a decode step).
    bw_gbps : float or None
        Bandwidth for both route and fetch's pull (the paper's Fig. 1(b) uses 70 GB/s).
    c_t_axis : array-like or None
        Chunk sizes (default 16 .. 8192, log-spaced).
    splice : SpliceProfile or None
        Default :data:`mqnc.costmodel.SPLICE_PAPER` (measured on H100, §7).
    route_kwargs
        Passed to :func:`mqnc.costmodel.t_route` (``t_compute_us``, ``t_merge_us``, ...).
    """
    from mqnc.costmodel import SPLICE_PAPER, t_fetch, t_local, t_local_range, t_route
    from mqnc.predicate import local_band_tokens

    splice = SPLICE_PAPER if splice is None else splice
    c = np.geomspace(16, 8192, 200) if c_t_axis is None else np.asarray(c_t_axis, float)
    route = t_route(geometry, fabric, m_q, bw_gbps=bw_gbps, **route_kwargs).total
    fetch = t_fetch(geometry, fabric, c, splice=splice, bw_gbps=bw_gbps).total
    lo, hi = t_local_range(geometry, c)
    ax.plot(c, np.full_like(c, route), color=COLORS["route"], lw=2, label=f"route (M_q={m_q:g})")
    ax.plot(c, fetch, color=COLORS["fetch"], lw=2, label="fetch (all-layer pull + splice)")
    ax.fill_between(c, lo, hi, color=COLORS["local"], alpha=0.25, label="local band (c 0.5-1.5)")
    ax.plot(c, t_local(geometry, c), color=COLORS["local"], lw=1.5, label="local (c = 1 us)")
    a, b = local_band_tokens(geometry, fabric, splice=splice, bw_gbps=bw_gbps)
    ax.axvspan(a, b, color="gray", alpha=0.12)
    ax.text(
        np.sqrt(a * b),
        route * 1.6,
        f"fetch < local\nabove {a:.0f}-{b:.0f} tok",
        ha="center",
        fontsize=7,
        color="dimgray",
    )
    bw_text = f"{bw_gbps:g} GB/s" if bw_gbps is not None else f"{fabric.bw_gbps:g} GB/s"
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="chunk tokens $c_t$",
        ylabel="cost (us)",
        title=f"(b) cost vs chunk size, {geometry.name}, {bw_text}",
    )
    ax.legend(fontsize=7, loc="upper left")
    return ax


def wire_saving_map(
    ax,
    geometry,
    *,
    m_q_axis: Sequence[float] | np.ndarray | None = None,
    c_t_axis: Sequence[float] | np.ndarray | None = None,
    mark: tuple[float, float] | None = (256, 2048),
    colorbar: bool = True,
):
    """Fig. 3(b): route's wire-byte saving ``1 - M_q (q+p) / (c_t b_KV)`` over ``(M_q, c_t)``
    (§5.2): green where routing moves fewer bytes, red where pulling the chunk does, the dashed
    break-even line ``M_q = c_t b_KV / (q + p)``; ``mark`` = ``(M_q, c_t)`` is annotated.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    geometry : MLAGeometry
    m_q_axis, c_t_axis : array-like or None
        Grid axes (defaults 1 .. 8192 rows and 16 .. 8192 tokens, log-spaced).
    mark : (float, float) or None
        A point to annotate (the paper's decode point, M_q 256 at c_t 2048).
    colorbar : bool
        Draw a colour bar.
    """
    from mqnc.predicate import wire_break_even_rows, wire_byte_saving

    m = np.geomspace(1, 8192, 160) if m_q_axis is None else np.asarray(m_q_axis, float)
    c = np.geomspace(16, 8192, 160) if c_t_axis is None else np.asarray(c_t_axis, float)
    saving = 100 * wire_byte_saving(geometry, m[:, None], c[None, :])
    pcm = ax.pcolormesh(c, m, saving, cmap="RdYlGn", vmin=-100, vmax=100, shading="nearest")
    ax.plot(
        c,
        wire_break_even_rows(geometry, c),
        "k--",
        lw=1.3,
        label="break-even $M_q = c_t b_{KV}/(q+p)$",
    )
    if mark is not None:
        mq, ct = mark
        s = 100 * wire_byte_saving(geometry, mq, ct)
        ax.plot([ct], [mq], "ko", ms=5)
        ax.annotate(
            f"M_q={mq:g}, c_t={ct:g}\n{s:.0f}% fewer bytes",
            xy=(ct, mq),
            xytext=(ct / 12, mq / 12),
            fontsize=8,
            arrowprops=dict(arrowstyle="->", lw=0.8),
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="chunk tokens $c_t$",
        ylabel="routed query rows $M_q$",
        xlim=(c[0], c[-1]),
        ylim=(m[0], m[-1]),
        title=f"(b) route vs fetch wire bytes, {geometry.name}",
    )
    ax.legend(loc="upper left", fontsize=8)
    if colorbar:
        ax.figure.colorbar(pcm, ax=ax, label="route wire-byte saving (%)")
    return pcm


def decision_map(ax, geometry, fabric, m_q_axis, c_t_axis, **kwargs: Any):
    """The argmin of total cost over ``(M_q, c_t)`` (§5.1; Fig. 3(b) on cost, not bytes).

    ``kwargs`` go to :func:`mqnc.predicate.crossover_map` (splice, congestion, topk, ...).
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from mqnc.predicate import PRIMITIVES, crossover_map

    m, c = np.asarray(m_q_axis, float), np.asarray(c_t_axis, float)
    grid = crossover_map(geometry, fabric, m, c, **kwargs)
    colors = [COLORS[p] for p in PRIMITIVES]
    ax.pcolormesh(
        c, m, grid.choice, shading="nearest", vmin=-0.5, vmax=2.5, cmap=ListedColormap(colors)
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="chunk tokens $c_t$",
        ylabel="routed query rows $M_q$",
        title=f"argmin total cost, {geometry.name}, {fabric.name}",
    )
    handles = [
        Patch(color=col, label=f"{p} ({100 * grid.fraction(p):.0f}%)")
        for col, p in zip(colors, PRIMITIVES, strict=True)
    ]
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    return grid


def bw_sweep_plot(
    ax,
    geometry,
    fabric,
    *,
    bw_axis: Sequence[float] | np.ndarray | None = None,
    m_q: float = 256,
    c_t: float = 2048,
    fabrics: Iterable | None = None,
    **kwargs: Any,
):
    """Fig. 6(a): route, fetch and local against effective bandwidth (§8).

    The bandwidth replaces both route's and fetch's pull bandwidth
    (:func:`mqnc.predicate.bw_sweep`). The shaded green band is the span of the fabrics'
    route bandwidths (single-block effBW, Table 2), the dotted ticks their link peaks (what the
    bulk pull sees).

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    geometry : MLAGeometry
    fabric : FabricProfile
        Probe and turnaround of the route.
    bw_axis : array-like or None
        GB/s (default 0.2 .. 1000, log-spaced).
    m_q, c_t : float
        The request (the decode point: 256 rows, 2048 tokens).
    fabrics : iterable of FabricProfile or None
        For the band and ticks (default :data:`mqnc.fabric.FABRICS`).
    kwargs
        Passed to :func:`mqnc.predicate.bw_sweep`.
    """
    from mqnc.costmodel import t_local_range
    from mqnc.fabric import FABRICS
    from mqnc.predicate import bw_sweep

    bw = np.geomspace(0.2, 1000, 200) if bw_axis is None else np.asarray(bw_axis, float)
    sweep = bw_sweep(geometry, fabric, bw, m_q=m_q, c_t=c_t, **kwargs)
    lo, hi = t_local_range(geometry, c_t)
    fabrics = list(FABRICS.values()) if fabrics is None else list(fabrics)
    ax.plot(bw, sweep.route_us, color=COLORS["route"], lw=2, label="route")
    ax.plot(bw, sweep.fetch_us, color=COLORS["fetch"], lw=2, label="fetch (pull + splice)")
    ax.fill_between(bw, lo, hi, color=COLORS["local"], alpha=0.25, label="local band")
    ax.plot(bw, sweep.local_us, color=COLORS["local"], lw=1.5, label="local (c = 1 us)")
    if fabrics:
        route_bws = [f.bw_gbps for f in fabrics]
        ax.axvspan(
            min(route_bws),
            max(route_bws),
            color=COLORS["route"],
            alpha=0.15,
            label="route effBW of the fabrics",
        )
    ax.set(xscale="log", yscale="log")
    top = max(float(np.max(sweep.fetch_us)), hi) * 3
    ax.set_ylim(float(np.min(sweep.route_us)) / 3, top)
    for f in fabrics:
        if f.link_peak_gbps and bw[0] <= f.link_peak_gbps <= bw[-1]:
            ax.axvline(f.link_peak_gbps, color="gray", ls=":", lw=1)
            ax.text(
                f.link_peak_gbps,
                top / 1.2,
                f.name,
                rotation=90,
                fontsize=6,
                va="top",
                ha="right",
                color="gray",
            )
    ax.set(
        xlabel="effective per-GPU-pair bandwidth (GB/s)",
        ylabel=f"cost at M_q={m_q:g}, c_t={c_t:g} (us)",
        title=f"(a) cost vs bandwidth (model), {geometry.name}",
    )
    ax.legend(fontsize=7, loc="lower left")
    return sweep


# ---- measurement figures -----------------------------------------------------------------------


def _route_groups(records: Sequence[dict], qp_row_bytes: int):
    """Route sweeps keyed ``(device, variant, q+p)`` with their probes, as ``mqnc fit`` groups
    them (a probe matches by variant; a file with probes of one variant serves all)."""
    routes = [r for r in _select(records, "route") if r.get("x_name") != "holders"]
    probes: dict[tuple[str, str], list[float]] = {}
    for r in _select(records, "probe"):
        probes.setdefault((str(r.get("device")), str(r.get("variant"))), []).append(_us(r))
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in routes:
        qp = int((r.get("extra") or {}).get("qp_row_bytes", qp_row_bytes))
        groups.setdefault((str(r.get("device")), str(r.get("variant")), qp), []).append(r)
    out = {}
    for (dev, variant, qp), recs in groups.items():
        probe = probes.get((dev, variant))
        same_dev = [v for (d, _), v in probes.items() if d == dev]
        if probe is None and len(same_dev) == 1:
            probe = same_dev[0]
        out[(dev, variant, qp)] = (recs, probe)
    return out


def route_round_trip(
    ax,
    records: Sequence[dict],
    geometry,
    *,
    fit_min_rows: int = 512,
    amortised_min_rows: int = 512,
    qp_row_bytes: int | None = None,
):
    """Fig. 2(b): measured route round trip against ``M_q`` beside the fitted cost model (§4.3).

    For each (device, transport, row size): the median p50 with its p20-p80 bar, the
    two-constant model ``T_probe + M_q (q+p) / BW`` (solid) and the affine fit with the
    turnaround (dotted) from :func:`mqnc.costmodel.fit`, MAPE over ``M_q >= 512`` in the legend;
    the amortised regime is shaded.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    records : sequence of dict
        The results file's records (``bench`` "route" and "probe" are read).
    geometry : MLAGeometry
        ``q + p`` of a row unless a record carries ``extra["qp_row_bytes"]``.
    fit_min_rows, amortised_min_rows : int
        As in :func:`mqnc.costmodel.fit`.
    qp_row_bytes : int or None
        Restrict to one payload of the sweep (default: the geometry's).

    Returns
    -------
    dict
        ``(device, variant, q+p) -> FitResult``.

    Raises
    ------
    MissingData
        No route records (or none with two distinct M_q).
    """
    from mqnc.costmodel import fit

    qp_default = geometry.qp_row_bytes
    want = qp_default if qp_row_bytes is None else qp_row_bytes
    groups = {k: v for k, v in _route_groups(records, qp_default).items() if k[2] == want}
    if not groups:
        raise MissingData(
            f"no route round trips (bench 'route', q+p = {want} B) in the results",
            COMMANDS["route"],
        )
    fits = {}
    many_dev = len({k[0] for k in groups}) > 1
    cycle = _cycle()
    for (dev, variant, qp), (recs, probe) in sorted(groups.items()):
        x, p20, p50, p80 = _medians(recs)
        if x.size < 2:
            continue
        color = next(cycle)
        samples = [(float(r["x"]), _us(r)) for r in recs]
        res = fit(
            samples,
            qp_row_bytes=qp,
            probe_us=probe,
            fit_min_rows=fit_min_rows,
            amortised_min_rows=amortised_min_rows,
        )
        fits[(dev, variant, qp)] = res
        label = variant + (f" ({_short_device(dev)})" if many_dev else "")
        ax.errorbar(x, p50, yerr=[p50 - p20, p80 - p50], fmt="o", color=color, ms=4, label=label)
        xx = np.geomspace(x[0], x[-1], 100)
        probe_txt = "probe" if res.probe_measured else "intercept"
        ax.plot(
            xx,
            res.predict(xx, with_turnaround=False),
            "-",
            color=color,
            lw=1.3,
            label=f"model: {probe_txt} {res.t_probe_us:.1f} us + M_q(q+p)/{res.bw_gbps:.3g} GB/s"
            f" (MAPE {100 * res.mape_amortised:.0f}% at M_q>={amortised_min_rows})",
        )
        if res.probe_measured:
            ax.plot(
                xx,
                res.predict(xx),
                ":",
                color=color,
                lw=1.1,
                label=f"affine fit, turnaround {res.turnaround_us:.1f} us",
            )
    if not fits:
        raise MissingData("route records span fewer than two M_q", COMMANDS["route"])
    ax.set(xscale="log", yscale="log")  # before reading the limits: a linear axis starts < 0
    right = ax.get_xlim()[1]
    if right > amortised_min_rows:
        ax.axvspan(amortised_min_rows, right, color="gray", alpha=0.1, zorder=0)
        ax.set_xlim(right=right)
    ax.set(
        xlabel="routed query rows $M_q$",
        ylabel="route round trip (us)",
        title=f"(b) route round trip vs model, q+p = {want} B"
        + _title_suffix([r for recs, _ in groups.values() for r in recs]),
    )
    ax.legend(fontsize=6)
    return fits


def _title_suffix(records: Sequence[dict]) -> str:
    devs = ", ".join(_short_device(d) for d in _devices(records))
    backends = ", ".join(sorted({str(r.get("transport") or r.get("backend")) for r in records}))
    return f"\n{devs} [{backends}]"


def _cycle():
    import itertools

    return itertools.cycle([f"C{i}" for i in range(10)])


def gather_vs_route(ax, records: Sequence[dict]):
    """Fig. 4(a): fetch's scattered gather vs route's fan-out over ``M`` holders (§5.4).

    Measured medians (p20-p80 bars) of ``bench="fetch"`` with ``x_name="holders"`` per variant
    (red shades) and ``bench="route_fanout"`` (green); beside each, the model's fit: the
    gather's affine law ``M t_handshake + t_bytes`` (the constants of
    :class:`mqnc.costmodel.GatherProfile`) and an affine fit of the fan-out (flat when route
    is layer- and holder-independent, as the paper finds).

    Returns
    -------
    dict
        ``(bench, device, variant) -> (slope_us_per_holder, intercept_us)``.

    Raises
    ------
    MissingData
        Neither gather nor fan-out records.
    """
    gather = _select(records, "fetch", "holders")
    fan = _select(records, "route_fanout")
    if not gather and not fan:
        raise MissingData(
            "no gather-over-holders records (bench 'fetch', x_name 'holders') and no route "
            "fan-out (bench 'route_fanout')",
            COMMANDS["fetch"],
        )
    fits = {}
    many_dev = len(_devices(gather + fan)) > 1
    reds = iter(["#d62728", "#ff7f0e", "#8c564b", "#e377c2", "#bcbd22"] * 4)
    greens = iter(["#2ca02c", "#17becf", "#1f77b4", "#7f7f7f"] * 4)
    for bench, recs, colors, what in (
        ("fetch", gather, reds, "gather"),
        ("route_fanout", fan, greens, "route"),
    ):
        for (dev, variant), grp in sorted(
            _group(recs, lambda r: (str(r.get("device")), str(r.get("variant")))).items()
        ):
            x, p20, p50, p80 = _medians(grp)
            color = next(colors)
            label = f"{what}: {variant}" + (f" ({_short_device(dev)})" if many_dev else "")
            ax.errorbar(
                x, p50, yerr=[p50 - p20, p80 - p50], fmt="o", color=color, ms=4, label=label
            )
            if x.size >= 2:
                slope, icpt = np.polyfit(x, p50, 1)
                fits[(bench, dev, variant)] = (float(slope), float(icpt))
                xx = np.linspace(x[0], x[-1], 50)
                ax.plot(
                    xx,
                    icpt + slope * xx,
                    "--",
                    color=color,
                    lw=1,
                    label=f"fit: {icpt:.3g} + {slope:.3g} us x M",
                )
    ax.set(
        yscale="log",
        xlabel="holders M the selection spans",
        ylabel="time per layer (us)",
        title="(a) gather vs route fan-out over holders" + _title_suffix(gather + fan),
    )
    if not gather:
        ax.text(
            0.02, 0.02, f"gather: run `{COMMANDS['fetch']}`", fontsize=7, transform=ax.transAxes
        )
    if not fan:
        ax.text(
            0.02,
            0.02,
            f"route fan-out: run `{COMMANDS['route_fanout']}`",
            fontsize=7,
            transform=ax.transAxes,
        )
    ax.legend(fontsize=6)
    return fits


def _knee_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares of ``y = t0 + s max(0, x - n0)`` with ``n0`` over the measured ``x``."""
    best = (np.inf, float(np.median(y)), 0.0, float(x[-1]))
    for n0 in x[:-1]:
        a = np.stack([np.ones_like(x), np.maximum(0.0, x - n0)], axis=1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        err = float(np.sum((a @ coef - y) ** 2))
        if err < best[0]:
            best = (err, float(coef[0]), float(coef[1]), float(n0))
    return best[1], best[2], best[3]


def holder_compute(ax, records: Sequence[dict], *, splice_us: float | None = None):
    """Fig. 4(b): a holder's batched partial attention against ``N`` routed requesters (§6.3).

    Measured medians of ``bench="holder"`` with ``x_name="requesters"`` per variant, with the
    flat-then-linear fit ``t_0 + s max(0, N - N_0)`` (the knee ``N_0`` chosen by least
    squares over the measured N); fetch's splice as the dashed reference (default: the paper's
    profile at 2048 tokens, :data:`mqnc.costmodel.SPLICE_PAPER`).

    Returns
    -------
    dict
        ``(device, variant) -> (t0_us, slope_us_per_requester, knee_N)``.

    Raises
    ------
    MissingData
        No holder records.
    """
    from mqnc.costmodel import SPLICE_PAPER

    recs = _select(records, "holder", "requesters")
    if not recs:
        raise MissingData(
            "no holder batching records (bench 'holder', x_name 'requesters')",
            COMMANDS["holder"],
        )
    fits = {}
    cycle = _cycle()
    many_dev = len(_devices(recs)) > 1
    for (dev, variant), grp in sorted(
        _group(recs, lambda r: (str(r.get("device")), str(r.get("variant")))).items()
    ):
        x, p20, p50, p80 = _medians(grp)
        color = next(cycle)
        label = variant + (f" ({_short_device(dev)})" if many_dev else "")
        ax.errorbar(x, p50, yerr=[p50 - p20, p80 - p50], fmt="o", color=color, ms=4, label=label)
        if x.size >= 3:
            t0, s, n0 = _knee_fit(x, p50)
            fits[(dev, variant)] = (t0, s, n0)
            xx = np.geomspace(x[0], x[-1], 100)
            ax.plot(
                xx,
                t0 + s * np.maximum(0.0, xx - n0),
                "-",
                color=color,
                lw=1,
                label=f"fit: flat {t0:.3g} us to N={n0:g}, then +{s:.3g} us/requester",
            )
    splice = SPLICE_PAPER.at(2048) if splice_us is None else splice_us
    ax.axhline(splice, color=COLORS["fetch"], ls="--", lw=1, label=f"fetch splice {splice:.0f} us")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="routed requesters N batched by one holder",
        ylabel="holder partial attention (us)",
        title="(b) holder compute vs requesters" + _title_suffix(recs),
    )
    ax.legend(fontsize=6)
    return fits


_MQ = re.compile(r"m_?q\s*=\s*(\d+)", re.IGNORECASE)


def _m_q_of(r: dict) -> float | None:
    extra = r.get("extra") or {}
    if extra.get("m_q") is not None:
        return float(extra["m_q"])
    m = _MQ.search(str(r.get("variant", "")))
    return float(m.group(1)) if m else None


def congestion_plot(
    ax, records: Sequence[dict], geometry, *, splice_us: float | None = None, fabric=None
):
    """Fig. 7: route round trip and probe under ``K`` concurrent route flows on one link (§8).

    Measured medians of ``bench="congestion"`` (``x`` = K): the probe (variant ``"probe"``) and
    the round trip at each ``M_q``. The model (crosses): idle constants from the ``K = 0``
    round trips (:func:`mqnc.costmodel.fit` with the K = 0 probe), congested ones from
    :func:`mqnc.costmodel.fit_congestion` at the largest ``M_q`` and the largest K; the other
    batches' congested round trips are predictions. The splice is the dashed reference.

    Returns
    -------
    Congestion or None
        The fitted congestion (None when the records do not allow the fit).

    Raises
    ------
    MissingData
        No congestion records.
    """
    from mqnc.costmodel import SPLICE_PAPER, fit, fit_congestion, t_route

    recs = _select(records, "congestion")
    if not recs:
        raise MissingData("no congestion records (bench 'congestion')", COMMANDS["congestion"])
    probe = [r for r in recs if str(r.get("variant")) == "probe"]
    routes = _group([r for r in recs if _m_q_of(r) is not None], _m_q_of)
    cycle = _cycle()
    colors = {}
    if probe:
        x, p20, p50, p80 = _medians(probe)
        ax.errorbar(x, p50, yerr=[p50 - p20, p80 - p50], fmt="s-", color="k", ms=4, label="probe")
    for m_q in sorted(routes):
        x, p20, p50, p80 = _medians(routes[m_q])
        colors[m_q] = next(cycle)
        ax.errorbar(
            x,
            p50,
            yerr=[p50 - p20, p80 - p50],
            fmt="o-",
            color=colors[m_q],
            ms=4,
            label=f"route M_q={m_q:g}",
        )
    congestion = None
    ks = sorted({float(r["x"]) for r in recs})
    if probe and len(routes) >= 2 and len(ks) >= 2:
        k0, k1 = ks[0], ks[-1]

        def at(grp, k):
            vals = [_us(r) for r in grp if float(r["x"]) == k]
            return float(np.median(vals)) if vals else None

        p_idle, p_cong = at(probe, k0), at(probe, k1)
        idle = [(m, at(g, k0)) for m, g in routes.items() if at(g, k0) is not None]
        m_big = max(routes)
        rt_idle, rt_cong = at(routes[m_big], k0), at(routes[m_big], k1)
        if None not in (p_idle, p_cong, rt_idle, rt_cong) and len(idle) >= 2:
            fab = fabric
            try:
                if fab is None:
                    res = fit(
                        idle, qp_row_bytes=geometry.qp_row_bytes, probe_us=p_idle, fit_min_rows=1
                    )
                    fab = res.to_fabric("idle (K=0 fit)")
                congestion = fit_congestion(
                    geometry,
                    fab,
                    m_big,
                    probe_idle_us=p_idle,
                    probe_congested_us=p_cong,
                    rt_idle_us=rt_idle,
                    rt_congested_us=rt_cong,
                )
            except ValueError as exc:
                ax.text(0.02, 0.95, f"no congestion fit: {exc}", fontsize=6, transform=ax.transAxes)
            for m_q in sorted(routes) if fab is not None else ():
                for k, cong in ((k0, None), (k1, congestion)):
                    if k == k1 and cong is None:
                        continue
                    pred = t_route(geometry, fab, m_q, congestion=cong).transport
                    ax.plot([k], [pred], "x", color=colors[m_q], ms=9, mew=2)
            if congestion is not None:
                ax.plot(
                    [],
                    [],
                    "x",
                    color="gray",
                    ms=8,
                    mew=2,
                    label=f"model: idle fit, K={k1:g}: BW x{congestion.bw_factor:.2f}, "
                    f"probe +{congestion.probe_add_us:.1f} us",
                )
    splice = SPLICE_PAPER.at(2048) if splice_us is None else splice_us
    ax.axhline(splice, color=COLORS["fetch"], ls="--", lw=1, label=f"fetch splice {splice:.0f} us")
    ax.set(
        yscale="log",
        xlabel="concurrent route flows K sharing the link",
        ylabel="round trip (us)",
        xticks=ks,
        title="route under self-congestion (Fig. 7)" + _title_suffix(recs),
    )
    ax.legend(fontsize=6)
    return congestion


def _pct(r: dict, key: str) -> float:
    return float(r["p50"] if r.get(key) is None else r[key])


def bench_plot(ax, records: Sequence[dict], bench: str, *, reference=None):
    """A benchmark's p50 against ``x`` per variant (and device), p20-p80 shaded.

    The title names the bench, the devices and the backends (``triton``, ``interpreter``,
    ``torch-reference``...), so interpreter timings are never mistaken for kernel timings. For
    ``bench="splice"`` the cost model's splice profile (:data:`mqnc.costmodel.SPLICE_PAPER`,
    H100) is drawn dashed, or ``reference`` (a ``SpliceProfile``) when given.

    Raises
    ------
    MissingData
        No records of ``bench``.
    """
    recs = [r for r in records if r.get("bench") == bench]
    if not recs:
        raise MissingData(f"no records of bench {bench!r}", COMMANDS.get(bench))
    units = sorted({str(r.get("unit", "us")) for r in recs})
    x_names = sorted({str(r.get("x_name", "x")) for r in recs})
    many_dev = len(_devices(recs)) > 1
    cycle = _cycle()
    groups = _group(
        recs, lambda r: (str(r.get("variant")), str(r.get("device")), str(r.get("backend")))
    )
    for (variant, dev, backend), grp in sorted(groups.items()):
        color = next(cycle)
        xs = np.array(sorted({float(r["x"]) for r in grp}))
        p20, p50, p80 = (
            np.array([np.median([_pct(r, k) for r in grp if float(r["x"]) == x]) for x in xs])
            for k in ("p20", "p50", "p80")
        )
        label = f"{variant} [{backend}]" + (f" ({_short_device(dev)})" if many_dev else "")
        ax.plot(xs, p50, "o-", color=color, ms=4, label=label)
        if xs.size > 1:
            ax.fill_between(xs, p20, p80, color=color, alpha=0.2)
        else:
            ax.errorbar(xs, p50, yerr=[p50 - p20, p80 - p50], color=color, fmt="none")
    if bench == "splice":
        from mqnc.costmodel import SPLICE_PAPER

        prof = SPLICE_PAPER if reference is None else reference
        xs = np.array(sorted({float(r["x"]) for r in recs}))
        xx = np.geomspace(max(xs.min(), 1.0), max(xs.max(), 2.0), 50)
        ax.plot(xx, prof.at(xx), "k--", lw=1, label=f"model splice: {prof.name}")
    xs_all = np.array([float(r["x"]) for r in recs])
    ys_all = np.array([float(r["p50"]) for r in recs])
    ax.set(
        xscale="log" if (xs_all > 0).all() and xs_all.max() > 4 * xs_all.min() else "linear",
        yscale="log" if (ys_all > 0).all() else "linear",
        xlabel=" / ".join(x_names),
        ylabel=f"p50 ({', '.join(units)})",
        title=f"bench {bench!r}" + _title_suffix(recs),
    )
    ax.legend(fontsize=6)
    return groups
