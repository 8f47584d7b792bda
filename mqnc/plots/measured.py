"""The measurement figures (§4.3, §5.4, §6.3, §8), drawn from the results file's records, each
beside the model's fit: Fig. 2(b), 4(a), 4(b), 7, and any benchmark's p50 curves."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from mqnc.cost import SPLICE_PAPER, fit, fit_congestion, knee_fit, t_route
from mqnc.plots._common import (
    COLORS,
    COMMANDS,
    MissingData,
    _cycle,
    _devices,
    _group,
    _medians,
    _select,
    _short_device,
    _title_suffix,
    _us,
    fit_legend,
    readable_log_ticks,
    wrapped_title,
)

__all__ = ["route_round_trip", "gather_vs_route", "holder_compute", "congestion_plot", "bench_plot"]


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


# Over 60 lines by its numpy docstring (29) and signature; the body (one figure, one fit per
# curve) is 43 lines.
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
    turnaround (dotted) from :func:`mqnc.cost.fit`, MAPE over ``M_q >= 512`` in the legend;
    the amortised regime is shaded.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    records : sequence of dict
        The results file's records (``bench`` "route" and "probe" are read).
    geometry : MLAGeometry
        ``q + p`` of a row unless a record carries ``extra["qp_row_bytes"]``.
    fit_min_rows, amortised_min_rows : int
        As in :func:`mqnc.cost.fit`.
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
        _draw_route_fit(ax, np.geomspace(x[0], x[-1], 100), res, color, amortised_min_rows)
    if not fits:
        raise MissingData("route records span fewer than two M_q", COMMANDS["route"])
    ax.set(xscale="log", yscale="log")  # before reading the limits: a linear axis starts < 0
    right = ax.get_xlim()[1]
    if right > amortised_min_rows:
        ax.axvspan(amortised_min_rows, right, color="gray", alpha=0.1, zorder=0)
        ax.set_xlim(right=right)
    ax.set(xlabel="routed query rows $M_q$", ylabel="route round trip (us)")
    wrapped_title(
        ax,
        f"(b) route round trip vs model, q+p = {want} B"
        + _title_suffix([r for recs, _ in groups.values() for r in recs]),
    )
    readable_log_ticks(ax)
    fit_legend(ax)
    return fits


def _draw_route_fit(ax, xx, res, color, amortised_min_rows: int) -> None:
    """The two-constant model (solid) and, with a measured probe, the affine fit (dotted)."""
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


def gather_vs_route(ax, records: Sequence[dict]):
    """Fig. 4(a): fetch's scattered gather vs route's fan-out over ``M`` holders (§5.4).

    Measured medians (p20-p80 bars) of ``bench="fetch"`` with ``x_name="holders"`` per variant
    (red shades) and ``bench="route_fanout"`` (green); beside each, the model's fit: the
    gather's affine law ``M t_handshake + t_bytes`` (the constants of
    :class:`mqnc.cost.GatherProfile`) and an affine fit of the fan-out (flat when route
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
                fits[(bench, dev, variant)] = _draw_affine(ax, x, p50, color)
    ax.set(yscale="log", xlabel="holders M the selection spans", ylabel="time per layer (us)")
    wrapped_title(ax, "(a) gather vs route fan-out over holders" + _title_suffix(gather + fan))
    readable_log_ticks(ax)
    for recs, what, bench in ((gather, "gather", "fetch"), (fan, "route fan-out", "route_fanout")):
        if not recs:
            text = f"{what}: run `{COMMANDS[bench]}`"
            ax.text(0.02, 0.02, text, fontsize=7, transform=ax.transAxes)
    fit_legend(ax)
    return fits


def _draw_affine(ax, x, y, color) -> tuple[float, float]:
    """Least-squares line through ``(x, y)``, drawn dashed; ``(slope, intercept)``."""
    slope, icpt = np.polyfit(x, y, 1)
    xx = np.linspace(x[0], x[-1], 50)
    label = f"fit: {icpt:.3g} + {slope:.3g} us x M"
    ax.plot(xx, icpt + slope * xx, "--", color=color, lw=1, label=label)
    return float(slope), float(icpt)


def holder_compute(ax, records: Sequence[dict], *, splice_us: float | None = None):
    """Fig. 4(b): a holder's batched partial attention against ``N`` routed requesters (§6.3).

    Measured medians of ``bench="holder"`` with ``x_name="requesters"`` per variant, device and
    backend (compiled kernels, the interpreter and the torch references never pooled), with the
    flat-then-linear fit ``t_0 + s max(0, N - N_0)`` (the knee ``N_0`` chosen by least
    squares over the measured N); fetch's splice as the dashed reference (default: the paper's
    profile at 2048 tokens, :data:`mqnc.cost.SPLICE_PAPER`).

    Returns
    -------
    dict
        ``(device, variant, backend) -> (t0_us, slope_us_per_requester, knee_N)``.

    Raises
    ------
    MissingData
        No holder records.
    """
    recs = _select(records, "holder", "requesters")
    if not recs:
        raise MissingData(
            "no holder batching records (bench 'holder', x_name 'requesters')",
            COMMANDS["holder"],
        )
    fits = {}
    cycle = _cycle()
    many_dev = len(_devices(recs)) > 1
    many_backends = len({str(r.get("backend")) for r in recs}) > 1
    for (dev, variant, backend), grp in sorted(
        _group(
            recs, lambda r: (str(r.get("device")), str(r.get("variant")), str(r.get("backend")))
        ).items()
    ):
        x, p20, p50, p80 = _medians(grp)
        color = next(cycle)
        label = variant + (f" [{backend}]" if many_backends else "")
        label += f" ({_short_device(dev)})" if many_dev else ""
        ax.errorbar(x, p50, yerr=[p50 - p20, p80 - p50], fmt="o", color=color, ms=4, label=label)
        if x.size >= 3:
            t0, s, n0 = knee_fit(x, p50)
            fits[(dev, variant, backend)] = (t0, s, n0)
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
    )
    wrapped_title(ax, "(b) holder compute vs requesters" + _title_suffix(recs))
    readable_log_ticks(ax)
    fit_legend(ax)
    return fits


_MQ = re.compile(r"m_?q\s*=\s*(\d+)", re.IGNORECASE)


def _m_q_of(r: dict) -> float | None:
    extra = r.get("extra") or {}
    if extra.get("m_q") is not None:
        return float(extra["m_q"])
    m = _MQ.search(str(r.get("variant", "")))
    return float(m.group(1)) if m else None


def congestion_plot(
    ax,
    records: Sequence[dict],
    geometry,
    *,
    splice_us: float | None = None,
    fabric=None,
    transport: str | None = None,
    device: str | None = None,
):
    """Fig. 7: route round trip and probe under ``K`` concurrent route flows on one link (§8),
    for one engine on one machine: ``transport`` / ``device`` select them (needed when the
    records hold several: a median across engines is no engine's, and neither is a fit to it).

    Measured medians of ``bench="congestion"`` (``x`` = K): the probe (variant ``"probe"``) and
    the round trip at each ``M_q``. The model (crosses): idle constants from the ``K = 0``
    round trips (:func:`mqnc.cost.fit` with the K = 0 probe), congested ones from
    :func:`mqnc.cost.fit_congestion` at the largest ``M_q`` and the largest K; the other
    batches' congested round trips are predictions. The splice is the dashed reference.

    Returns
    -------
    Congestion or None
        The fitted congestion (None when the records do not allow the fit).

    Raises
    ------
    MissingData
        No congestion records (of ``transport`` / ``device`` when given).
    ValueError
        Records of several (device, transport) pairs and no ``transport`` / ``device`` that
        picks one.
    """
    recs = [
        r
        for r in _select(records, "congestion")
        if (transport is None or r.get("transport") == transport)
        and (device is None or r.get("device") == device)
    ]
    if not recs:
        which = "".join(
            f" {k}={v!r}" for k, v in (("transport", transport), ("device", device)) if v
        )
        raise MissingData(
            f"no congestion records (bench 'congestion'){which}", COMMANDS["congestion"]
        )
    pairs = sorted({(str(r.get("device")), str(r.get("transport"))) for r in recs})
    if len(pairs) > 1:
        raise ValueError(
            f"transport, device: the congestion records are of {len(pairs)} (device, transport) "
            f"pairs {pairs}; pass transport= (and device=) to draw one"
        )
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
    ks = sorted({float(r["x"]) for r in recs})
    congestion = None
    if probe and len(routes) >= 2 and len(ks) >= 2:
        congestion = _congestion_model(ax, probe, routes, (ks[0], ks[-1]), colors, geometry, fabric)
    splice = SPLICE_PAPER.at(2048) if splice_us is None else splice_us
    ax.axhline(splice, color=COLORS["fetch"], ls="--", lw=1, label=f"fetch splice {splice:.0f} us")
    ax.set(
        yscale="log",
        xlabel="concurrent route flows K sharing the link",
        ylabel="round trip (us)",
        xticks=ks,
    )
    wrapped_title(ax, "route under self-congestion (Fig. 7)" + _title_suffix(recs))
    readable_log_ticks(ax, "y")
    fit_legend(ax)
    return congestion


def _congestion_model(ax, probe, routes, ks, colors, geometry, fabric):
    """Fit the idle fabric (unless given) and the congestion at the largest ``M_q`` from the
    idle (``ks[0]``) and fully subscribed (``ks[1]``) medians; draw the model's round trips as
    crosses. Returns the :class:`~mqnc.cost.Congestion`, or None when it cannot be fitted."""
    k0, k1 = ks

    def at(grp, k):
        vals = [_us(r) for r in grp if float(r["x"]) == k]
        return float(np.median(vals)) if vals else None

    p_idle, p_cong = at(probe, k0), at(probe, k1)
    idle = [(m, at(g, k0)) for m, g in routes.items() if at(g, k0) is not None]
    m_big = max(routes)
    rt_idle, rt_cong = at(routes[m_big], k0), at(routes[m_big], k1)
    if None in (p_idle, p_cong, rt_idle, rt_cong) or len(idle) < 2:
        return None
    fab, congestion = fabric, None
    try:
        if fab is None:
            res = fit(idle, qp_row_bytes=geometry.qp_row_bytes, probe_us=p_idle, fit_min_rows=1)
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
    return congestion


def _pct(r: dict, key: str) -> float:
    return float(r["p50"] if r.get(key) is None else r[key])


_TAG_MARKERS = ("s", "^", "D", "v", "P", "X", "*", "<", ">", "h")


def _split_variant(variant: str) -> tuple[str, str]:
    """``"H=128,B=8@64x32w8s3"`` -> ``("H=128,B=8", "64x32w8s3")``; no ``@``: ``(variant, "")``."""
    base, _, tag = variant.partition("@")
    return base, tag


def bench_plot(ax, records: Sequence[dict], bench: str, *, reference=None):
    """A benchmark's p50 against ``x`` per variant, p20-p80 shaded, for ONE device (draw
    several with :func:`mqnc.plots.draw_per_device`: CPU and GPU timings never share an axis).

    A variant ``"base@tag"`` (a forced tile of a sweep: ``"H=128,B=8@64x32w8s3"``) is drawn in
    its base's colour with one marker per tag and no line, so the legend lists bases and tags,
    not every pair. The title names the bench, the device and the backends (``triton``,
    ``interpreter``, ``torch-reference``...), so interpreter timings are never mistaken for
    kernel timings. For ``bench="splice"`` the cost model's splice profile
    (:data:`mqnc.cost.SPLICE_PAPER`, H100) is drawn dashed, or ``reference`` (a
    ``SpliceProfile``) when given.

    Returns
    -------
    dict
        ``(variant, backend) -> (x, p50)`` arrays as drawn.

    Raises
    ------
    MissingData
        No records of ``bench``.
    ValueError
        The records of ``bench`` are of several devices.
    """
    recs = [r for r in records if r.get("bench") == bench]
    if not recs:
        raise MissingData(f"no records of bench {bench!r}", COMMANDS.get(bench))
    devices = _devices(recs)
    if len(devices) > 1:
        raise ValueError(
            f"records: bench {bench!r} holds records of {len(devices)} devices {devices}; "
            "expected one (draw one panel per device with mqnc.plots.draw_per_device)"
        )
    units = sorted({str(r.get("unit", "us")) for r in recs})
    x_names = sorted({str(r.get("x_name", "x")) for r in recs})
    groups = _group(recs, lambda r: (str(r.get("variant")), str(r.get("backend"))))
    bases = sorted({(_split_variant(v)[0], b) for v, b in groups}, key=_natural)
    tags = sorted({_split_variant(v)[1] for v, _ in groups} - {""}, key=_natural)
    color = _family_colors(bases)
    many_backends = len({b for _, b in bases}) > 1
    drawn = {}
    for (variant, backend), grp in sorted(groups.items(), key=lambda kv: _natural(kv[0])):
        base, tag = _split_variant(variant)
        xs = np.array(sorted({float(r["x"]) for r in grp}))
        p20, p50, p80 = (
            np.array([np.median([_pct(r, k) for r in grp if float(r["x"]) == x]) for x in xs])
            for k in ("p20", "p50", "p80")
        )
        c = color[(base, backend)]
        drawn[(variant, backend)] = (xs, p50)
        if tag:
            marker = _TAG_MARKERS[tags.index(tag) % len(_TAG_MARKERS)]
            ax.plot(xs, p50, marker, color=c, ms=5, mfc="none", mew=1.2)
            continue
        label = base + (f" [{backend}]" if many_backends else "")
        ax.plot(xs, p50, "o-", color=c, ms=3.5, lw=1.2, label=label)
        if xs.size > 1:
            ax.fill_between(xs, p20, p80, color=c, alpha=0.2)
    for i, tag in enumerate(tags):
        marker = _TAG_MARKERS[i % len(_TAG_MARKERS)]
        ax.plot([], [], marker, color="0.3", mfc="none", mew=1.2, label=f"@{tag} (forced tile)")
    if bench == "splice":
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
    )
    backends = ", ".join(sorted({b for _, b in bases}))
    wrapped_title(ax, f"bench {bench!r}\n{_short_device(devices[0])} [{backends}]")
    readable_log_ticks(ax)
    fit_legend(ax)
    return drawn


def _natural(key) -> tuple:
    """Sort key that orders ``"H=16,B=8"`` before ``"H=16,B=16"`` and ``"H=128"`` after both."""
    text = str(key)
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text))


_FAMILY_MAPS = ("Blues", "Oranges", "Greens", "Purples", "Reds", "Greys")


def _family_colors(bases: Sequence[tuple[str, str]]) -> dict:
    """A colour per ``(base, backend)``: the tab10 cycle for up to 10, else one colour map per
    family (the base's first comma-separated field, ``"H=16"``) shaded along the family, so
    16 curves of two head counts read as two families rather than a repeating cycle."""
    if len(bases) <= 10:
        cycle = _cycle()
        return {key: next(cycle) for key in bases}
    import matplotlib

    families: dict[str, list] = {}
    for key in bases:
        families.setdefault(key[0].split(",")[0], []).append(key)
    out = {}
    for i, members in enumerate(families.values()):
        cmap = matplotlib.colormaps[_FAMILY_MAPS[i % len(_FAMILY_MAPS)]]
        for j, key in enumerate(members):
            out[key] = cmap(0.4 + 0.55 * j / max(1, len(members) - 1))
    return out
