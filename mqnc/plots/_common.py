"""What every figure shares: the paper's colours, the benchmarks' commands, record selection
and medians, saving and drawing with a fallback when records are missing."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "COLORS",
    "COMMANDS",
    "TRANSPORT_BENCHES",
    "MissingData",
    "benches",
    "save",
    "compact_png",
    "try_draw",
    "compact_number",
    "readable_log_ticks",
    "fit_legend",
    "wrapped_title",
    "devices_with",
    "draw_per_device",
    "try_draw_figure",
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
    "mla_decode": "python -m perf.bench_mla",
    "mla_sparse": "python -m perf.bench_mla",
}
"""The command that writes each bench's records (by default to the git-ignored
``perf/results/local.jsonl``; figures read it with ``MQNC_RESULTS=perf/results/local.jsonl``)."""

TRANSPORT_BENCHES = ("route", "probe", "route_fanout", "fetch", "holder", "congestion")
"""Benches drawn by the figure functions; everything else is a kernel benchmark."""

_UNIT_US = {"us": 1.0, "ms": 1e3, "s": 1e6, "ns": 1e-3}


class MissingData(LookupError):
    """No records to draw a figure from; ``command`` is what produces them."""

    def __init__(self, message: str, command: str | None = None):
        hint = f" (run `{command}`; read its records with MQNC_RESULTS=perf/results/local.jsonl)"
        super().__init__(message + (hint if command else ""))
        self.command = command


# ---- the results file's records ---------------------------------------------------------------


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


def compact_png(fig, dpi: int = 80, colors: int = 256) -> str:
    """``fig`` as a base64 PNG of at most ``colors`` colours (an adaptive palette, no
    dithering) at ``dpi``: what the notebooks store as a figure's output, about a third of a
    full-colour PNG's bytes. Register it as IPython's ``image/png`` formatter for matplotlib
    figures (the notebooks' first cell does)."""
    import base64
    import io

    from PIL import Image  # matplotlib's own dependency

    if not 1 <= colors <= 256:
        raise ValueError(f"colors: expected 1..256 (a PNG palette), got {colors}")
    if dpi <= 0:
        raise ValueError(f"dpi: expected > 0, got {dpi}")
    rgba = io.BytesIO()
    fig.savefig(rgba, format="png", dpi=dpi)
    rgba.seek(0)
    with Image.open(rgba) as img:
        palette = img.convert("RGB").quantize(colors, dither=Image.Dither.NONE)
    out = io.BytesIO()
    palette.save(out, format="png", optimize=True)
    return base64.b64encode(out.getvalue()).decode("ascii")


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
    import matplotlib.pyplot as plt  # here: an optional dependency, see the package docstring

    fig, ax = plt.subplots(figsize=figsize, constrained_layout=True)
    return _draw_saved(fig, ax, name, draw, args, kwargs, fig_dir)


def _title_suffix(records: Sequence[dict]) -> str:
    devs = ", ".join(_short_device(d) for d in _devices(records))
    backends = ", ".join(sorted({str(r.get("transport") or r.get("backend")) for r in records}))
    return f"\n{devs} [{backends}]"


def _cycle():
    return itertools.cycle([f"C{i}" for i in range(10)])


# ---- readable figures: ticks, legends, titles, one panel per device -----------------------------


def _log_subs(lo: float, hi: float) -> tuple[float, ...]:
    """Tick multiples per decade for a log axis spanning ``lo .. hi``: more when it spans less."""
    decades = np.log10(hi / lo) if lo > 0 and hi > lo else 0.0
    if decades < 0.8:
        return (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
    if decades < 2.2:
        return (1.0, 2.0, 5.0)
    return (1.0,)


def compact_number(v: float, unit: str = "") -> str:
    """``v`` in at most 4 characters plus an SI prefix: 0.5, 20, 300, 5k, 20M, 2G."""
    if v == 0:
        return "0" + unit
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0)):
        if abs(v) >= scale:
            return f"{v / scale:g}{prefix}{unit}"
    return f"{v:.3g}{unit}"


def readable_log_ticks(ax, axis: str = "both", fmt: Callable[[float], str] = compact_number):
    """Major ticks of a log axis at 1, 2, 5 x 10^k (at 10^k alone over many decades; more
    multiples over less than a decade), labelled plainly by ``fmt`` ("5k", "20"), minor ticks
    unlabelled: no "3x10^3 4x10^3" pairs that collide. Call after the limits are final."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for name in ("x", "y") if axis == "both" else (axis,):
        target = ax.xaxis if name == "x" else ax.yaxis
        if target.get_scale() != "log":
            continue
        lo, hi = sorted(ax.get_xlim() if name == "x" else ax.get_ylim())
        target.set_major_locator(LogLocator(base=10, subs=_log_subs(lo, hi), numticks=12))
        target.set_major_formatter(FuncFormatter(lambda v, _pos: fmt(v)))
        target.set_minor_formatter(NullFormatter())


def fit_legend(ax, *, max_inside: int = 5, fontsize: float = 6.5, **kwargs: Any):
    """The axes' legend where it fits: inside ("best") with at most ``max_inside`` entries,
    else outside the axes on the right (in columns of at most 22 entries), which constrained
    layout makes room for. Returns the legend (None when nothing is labelled)."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return None
    if len(handles) <= max_inside:
        return ax.legend(handles, labels, fontsize=fontsize, loc="best", **kwargs)
    ncol = -(-len(handles) // 22)
    return ax.legend(
        handles,
        labels,
        fontsize=fontsize,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0.0,
        ncol=ncol,
        **kwargs,
    )


def wrapped_title(ax, text: str, *, fontsize: float = 9.0) -> None:
    """``ax``'s title with each line wrapped to the axes' width, so that no title runs past
    the figure's edge (constrained layout makes room for the lines, not for their width)."""
    import textwrap

    width_in = ax.get_position().width * ax.figure.get_figwidth()
    chars = max(24, int(width_in * 72 / (0.55 * fontsize)))
    lines = [w for line in text.split("\n") for w in (textwrap.wrap(line, chars) or [""])]
    ax.set_title("\n".join(lines), fontsize=fontsize)


def devices_with(records: Iterable[dict], benches_: Sequence[str]) -> list[str]:
    """The devices holding records of any of ``benches_``, GPUs first, then by name."""
    devs = {str(r.get("device", "?")) for r in records if r.get("bench") in benches_}
    return sorted(devs, key=lambda d: (d.startswith("CPU"), d))


def draw_per_device(
    name: str,
    draw: Callable[..., Any],
    records: Sequence[dict],
    *args: Any,
    benches: Sequence[str],
    fig_dir: str | os.PathLike | None = None,
    panel_size: tuple[float, float] = (6.4, 4.2),
    **kwargs: Any,
):
    """One panel per device that holds records of ``benches`` (GPUs first): each panel is
    ``draw(ax, that_device's_records, *args, **kwargs)``, so CPU and GPU timings never share
    an axis. Saved as ``name`` like :func:`try_draw`; when no device has records, or every
    panel's records are missing, prints what is missing instead.

    Returns
    -------
    (Figure, dict) or (None, None)
        The figure and ``{device: what draw returned}`` (a panel whose records are missing
        says so in the panel and is absent from the dict).
    """
    import matplotlib.pyplot as plt  # here: an optional dependency, see the package docstring

    devices = devices_with(records, benches)
    if not devices:
        missing = MissingData(f"no records of bench {benches[0]!r}", COMMANDS.get(benches[0]))
        print(f"{name}: not drawn: {missing}")
        return None, None
    w, h = panel_size
    fig, axes = plt.subplots(
        len(devices), 1, figsize=(w, h * len(devices)), constrained_layout=True, squeeze=False
    )
    out, missing = {}, []
    for ax, dev in zip(axes[:, 0], devices, strict=True):
        mine = [r for r in records if str(r.get("device", "?")) == dev]
        try:
            out[dev] = draw(ax, mine, *args, **kwargs)
        except MissingData as exc:
            missing.append(str(exc))
            ax.set_axis_off()
            ax.text(0.5, 0.5, f"{_short_device(dev)}: {exc}", ha="center", wrap=True, fontsize=7)
    if not out:
        return _not_drawn(fig, name, "; ".join(missing))
    return _saved(fig, name, fig_dir, out)


def try_draw_figure(
    name: str,
    draw: Callable[..., Any],
    *args: Any,
    fig_dir: str | os.PathLike | None = None,
    figsize: tuple[float, float] = (12.0, 6.0),
    **kwargs: Any,
):
    """:func:`try_draw` for a function that draws a whole figure (several panels):
    ``draw(fig, *args, **kwargs)`` on a new constrained-layout figure.

    Returns
    -------
    (Figure, object) or (None, None)
    """
    import matplotlib.pyplot as plt  # here: an optional dependency, see the package docstring

    fig = plt.figure(figsize=figsize, layout="constrained")
    return _draw_saved(fig, fig, name, draw, args, kwargs, fig_dir)


def _draw_saved(fig, target, name: str, draw: Callable[..., Any], args, kwargs, fig_dir):
    """``draw(target, *args, **kwargs)``, then ``fig`` saved as ``name`` (:func:`save`); on
    :class:`MissingData` the figure is closed and what is missing printed instead. Returns
    ``(fig, what draw returned)`` or ``(None, None)``: :func:`try_draw`'s and
    :func:`try_draw_figure`'s common end."""
    try:
        result = draw(target, *args, **kwargs)
    except MissingData as exc:
        return _not_drawn(fig, name, exc)
    return _saved(fig, name, fig_dir, result)


def _not_drawn(fig, name: str, why) -> tuple[None, None]:
    """Close ``fig`` and print why ``name`` was not drawn; returns ``(None, None)``."""
    import matplotlib.pyplot as plt  # here: an optional dependency, see the package docstring

    plt.close(fig)
    print(f"{name}: not drawn: {why}")
    return None, None


def _saved(fig, name: str, fig_dir, result):
    """Save ``fig`` as ``name`` (:func:`save`), print where; returns ``(fig, result)``."""
    path = save(fig, name, fig_dir)
    if path is not None:
        print(f"{name}: wrote {path}")
    return fig, result
