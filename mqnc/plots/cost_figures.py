"""The cost model's figures (§4, §5, §8), drawn from this package's own model: Fig. 1(a),
1(b), 3(b) (on bytes and on total cost) and 6(a)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mqnc.cost import (
    FABRICS,
    PRIMITIVES,
    SPLICE_PAPER,
    bw_sweep,
    crossover_map,
    local_band_tokens,
    t_fetch,
    t_local,
    t_local_range,
    t_route,
    wire_break_even_rows,
    wire_byte_saving,
)
from mqnc.plots._common import COLORS, readable_log_ticks

__all__ = ["payload_bars", "cost_vs_chunk", "wire_saving_map", "decision_map", "bw_sweep_plot"]


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
    readable_log_ticks(ax, "y")
    return ax


def _fmt_bytes(v: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if v >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0f} B"


# Over 60 lines by its numpy docstring and signature; the body (one figure) is 29 lines.
def cost_vs_chunk(
    ax,
    geometry,
    fabric,
    *,
    m_q: float = 256,
    bw_gbps: float | None = 70.0,
    c_t_axis: Sequence[float] | np.ndarray | None = None,
    splice=None,
    fp8_fetch: bool = False,
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
        Default :data:`mqnc.cost.SPLICE_PAPER` (measured on H100, §7).
    fp8_fetch : bool
        Also draw fetch over the other cache format, dashed: the FP8 entry (DeepSeek-V3.2's
        656 B per token-layer at 512 + 64, ``cache_dtype="fp8_e4m3"``) beside a 16-bit
        geometry, or bf16 beside an FP8 one; the same splice profile (the measured bf16 one: a
        prediction for FP8). Needs ``d_c`` a multiple of 128.
    route_kwargs
        Passed to :func:`mqnc.cost.t_route` (``t_compute_us``, ``t_merge_us``, ...).
    """
    splice = SPLICE_PAPER if splice is None else splice
    c = np.geomspace(16, 8192, 200) if c_t_axis is None else np.asarray(c_t_axis, float)
    route = t_route(geometry, fabric, m_q, bw_gbps=bw_gbps, **route_kwargs).total
    fetch = t_fetch(geometry, fabric, c, splice=splice, bw_gbps=bw_gbps).total
    lo, hi = t_local_range(geometry, c)
    ax.plot(c, np.full_like(c, route), color=COLORS["route"], lw=2, label=f"route (M_q={m_q:g})")
    own = f", {geometry.kv_bytes_per_token_layer} B/token-layer" if fp8_fetch else ""
    ax.plot(c, fetch, color=COLORS["fetch"], lw=2, label=f"fetch (all-layer pull + splice{own})")
    if fp8_fetch:
        other = "bf16" if geometry.cache_dtype == "fp8_e4m3" else "fp8_e4m3"
        g2 = geometry.replace(cache_dtype=other)
        fetch2 = t_fetch(g2, fabric, c, splice=splice, bw_gbps=bw_gbps).total
        name = "FP8" if other == "fp8_e4m3" else other
        label = f"fetch, {name} cache ({g2.kv_bytes_per_token_layer} B/token-layer)"
        ax.plot(c, fetch2, color=COLORS["fetch"], lw=1.5, ls="--", label=label)
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
    readable_log_ticks(ax)
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
    readable_log_ticks(ax)
    ax.legend(loc="upper left", fontsize=8)
    if colorbar:
        ax.figure.colorbar(pcm, ax=ax, label="route wire-byte saving (%)")
    return pcm


def decision_map(ax, geometry, fabric, m_q_axis, c_t_axis, **kwargs: Any):
    """The argmin of total cost over ``(M_q, c_t)`` (§5.1; Fig. 3(b) on cost, not bytes).

    ``fabric`` is a :class:`~mqnc.cost.FabricProfile` or a :class:`~mqnc.cost.MachineProfile`;
    ``kwargs`` go to :func:`mqnc.cost.crossover_map` (``request=`` a
    :class:`~mqnc.cost.Request` template, or its fields and the profile's: splice, congestion,
    topk, ...).
    """
    from matplotlib.colors import ListedColormap  # here: optional, see the package docstring
    from matplotlib.patches import Patch

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
    readable_log_ticks(ax)
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    return grid


# Over 60 lines by its numpy docstring and signature; the body (one figure) is 28 lines.
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
    (:func:`mqnc.cost.bw_sweep`). The shaded green band is the span of the fabrics'
    route bandwidths (single-block effBW, Table 2), the dotted ticks their link peaks (what the
    bulk pull sees).

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    geometry : MLAGeometry
    fabric : FabricProfile or MachineProfile
        Probe and turnaround of the route (a profile: with its compute terms).
    bw_axis : array-like or None
        GB/s (default 0.2 .. 1000, log-spaced).
    m_q, c_t : float
        The request (the decode point: 256 rows, 2048 tokens).
    fabrics : iterable of FabricProfile or None
        For the band and ticks (default :data:`mqnc.cost.FABRICS`).
    kwargs
        Passed to :func:`mqnc.cost.bw_sweep` (``request=`` a :class:`~mqnc.cost.Request`
        template, or its fields and the profile's).
    """
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
    _link_peaks(ax, fabrics, bw, top)
    ax.set(
        xlabel="effective per-GPU-pair bandwidth (GB/s)",
        ylabel=f"cost at M_q={m_q:g}, c_t={c_t:g} (us)",
        title=f"(a) cost vs bandwidth (model), {geometry.name}",
    )
    readable_log_ticks(ax)
    ax.legend(fontsize=7, loc="lower left")
    return sweep


def _link_peaks(ax, fabrics, bw, top: float) -> None:
    """A dotted tick, with the fabric's name, at each link peak within the bandwidth axis; a
    name whose peak lies within 1.6x of the previous one's is written lower, so they do not
    overlap."""
    kw = dict(rotation=90, fontsize=6, va="top", ha="right", color="gray")
    peaks = sorted(
        (f.link_peak_gbps, f.name)
        for f in fabrics
        if f.link_peak_gbps and bw[0] <= f.link_peak_gbps <= bw[-1]
    )
    prev, low = None, False
    for peak, name in peaks:
        ax.axvline(peak, color="gray", ls=":", lw=1)
        low = (not low) if prev is not None and peak < 1.6 * prev else False
        ax.text(peak, top / (40 if low else 1.2), name, **kw)
        prev = peak
