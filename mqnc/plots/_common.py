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
    "try_draw",
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


def _title_suffix(records: Sequence[dict]) -> str:
    devs = ", ".join(_short_device(d) for d in _devices(records))
    backends = ", ".join(sorted({str(r.get("transport") or r.get("backend")) for r in records}))
    return f"\n{devs} [{backends}]"


def _cycle():
    return itertools.cycle([f"C{i}" for i in range(10)])
