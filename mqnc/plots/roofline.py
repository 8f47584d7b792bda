"""The kernels on a device's roofline, from the results file's records: achieved TFLOP/s
against arithmetic intensity (the attention kernels) and achieved TB/s per recorded shape
(every kernel that moves bytes: dense and sparse decode, splice, merge, copy), against the
device's spec, the measured ceilings and the anchors' published points.

What is read (only the records of ``device``, p50):

- ``bench`` "mla_decode" / "mla_sparse": FLOPs ``extra["flops"]`` when recorded, else
  ``2 B H n (576 + 512)`` (``n`` = ``x``: ``c_t`` dense, ``topk`` sparse; perf.bench_mla's
  count, times ``extra["s_q"]`` when recorded); bytes ``bytes``. A variant ``"...@tile"`` is a
  forced tile of a sweep and is drawn hollow.
- ``bench`` "splice", "merge": bytes only (TB/s panel).
- ``bench`` "ceiling" (variants "read", "read-tma", "copy": perf/bench_copy's kernels) and
  "copy" (torch's ``copy_``; or a kernel named in ``extra["kernel"]``): the measured ceilings,
  the median of each (:func:`ceilings`); any may be absent.

TB/s is ``bytes / p50`` (bytes as recorded: read plus written), TFLOP/s ``flops / p50``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from mqnc.cost.ceilings import memory_ceiling
from mqnc.plots._common import (
    COMMANDS,
    MissingData,
    _short_device,
    _us,
    readable_log_ticks,
    wrapped_title,
)

__all__ = [
    "DeviceSpec",
    "Anchor",
    "SPECS",
    "ANCHORS",
    "kernel_points",
    "ceilings",
    "roofline_device",
    "roofline",
]

D_QK, D_V = 576, 512
"""MLA's absorbed key and value widths (perf.bench_mla counts FLOPs with them)."""


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A device's published peaks: dense bf16 matrix throughput and HBM bandwidth."""

    name: str
    bf16_tflops: float
    hbm_tbps: float
    memory: str


SPECS = {
    "NVIDIA H200": DeviceSpec("H200 SXM", 989.0, 4.8, "HBM3e"),
    "NVIDIA H100 80GB HBM3": DeviceSpec("H100 SXM", 989.0, 3.35, "HBM3"),
    "NVIDIA H800": DeviceSpec("H800 SXM", 989.0, 3.35, "HBM3"),
}
"""Spec sheets by the device name the records carry (NVIDIA's datasheets: dense bf16 without
sparsity, HBM bandwidth)."""


@dataclasses.dataclass(frozen=True)
class Anchor:
    """A published number of another implementation, with its device and source. ``lo`` /
    ``hi`` bound a range (equal for one number); ``unit`` "TFLOP/s" or "TB/s"."""

    label: str
    lo: float
    hi: float
    unit: str
    device: str
    source: str


ANCHORS = (
    Anchor("FlashMLA dense", 660.0, 660.0, "TFLOP/s", "H800", "FlashMLA deep dive, 2025-04-22"),
    Anchor(
        "FlashInfer 396 / FlashMLA 386",
        386.0,
        396.0,
        "TFLOP/s",
        "H200",
        "github.com/tile-ai/tilelang/issues/1859, b 128, h 128",
    ),
    Anchor("FlagGems Triton MLA", 265.0, 285.0, "TFLOP/s", "H800", "FlagGems PR 510, 64 heads"),
    Anchor("FlashMLA dense, memory-bound", 3.0, 3.0, "TB/s", "H800", "FlashMLA README"),
)
"""The anchors' published points (each on its own device: an H800 has the H200's 989 TFLOP/s
bf16 peak but 3.35 TB/s of HBM3)."""

_KERNEL_BENCHES = ("mla_decode", "mla_sparse", "splice", "merge", "copy", "ceiling")
_MARKERS = {"dense": "o", "sparse": "D", "splice": "s", "merge": "^", "copy": "v"}
_COLORS = {16: "#1f77b4", 128: "#d62728", None: "#555555"}


def _flops(r: dict) -> float | None:
    extra = r.get("extra") or {}
    if extra.get("flops") is not None:
        return float(extra["flops"])
    if r.get("bench") not in ("mla_decode", "mla_sparse") or "B" not in extra or "H" not in extra:
        return None
    s_q = float(extra.get("s_q", 1))
    return 2.0 * float(extra["B"]) * float(extra["H"]) * s_q * float(r["x"]) * (D_QK + D_V)


def _series(r: dict) -> str:
    """The series a record belongs to: ``"dense H 16"``, ``"sparse H 128, forced tiles"``..."""
    bench = str(r.get("bench"))
    if bench in ("mla_decode", "mla_sparse"):
        kind = "dense" if bench == "mla_decode" else "sparse"
        heads = (r.get("extra") or {}).get("H", "?")
        swept = "@" in str(r.get("variant", ""))
        return f"{kind} decode H {heads}" + (", forced tiles" if swept else "")
    return f"{bench} [{r.get('backend')}]"


def kernel_points(records: Sequence[dict], device: str) -> dict[str, dict[str, np.ndarray]]:
    """The points the roofline draws, per series: ``{"tbps", "tflops" (NaN where no FLOPs),
    "ai" (FLOP per byte, NaN likewise), "bytes", "p50_us"}``, each in record order.

    Series: ``"dense decode H <heads>"`` / ``"sparse decode H <heads>"`` (forced tiles of a
    sweep apart: ``"..., forced tiles"``), ``"splice [backend]"``, ``"merge [backend]"``; copy
    records are ceilings
    (:func:`ceilings`), not points. Records without bytes are skipped (a copy of nothing
    bounds nothing)."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in records:
        if r.get("device") != device or r.get("bench") not in _KERNEL_BENCHES[:4]:
            continue
        if not r.get("bytes"):
            continue
        us = _us(r)
        flops = _flops(r)
        row = out.setdefault(
            _series(r), {k: [] for k in ("tbps", "tflops", "ai", "bytes", "p50_us")}
        )
        row["tbps"].append(float(r["bytes"]) / us / 1e6)
        row["tflops"].append(flops / us / 1e6 if flops else np.nan)
        row["ai"].append(flops / float(r["bytes"]) if flops else np.nan)
        row["bytes"].append(float(r["bytes"]))
        row["p50_us"].append(us)
    return {k: {f: np.asarray(v, float) for f, v in row.items()} for k, row in out.items()}


def ceilings(records: Sequence[dict], device: str) -> dict[str, float]:
    """Measured bandwidth ceilings of ``device`` in TB/s, each the median of its records read
    as :mod:`mqnc.cost.ceilings` reads them (``gbps``, a record with ``extra["exact"]`` False
    left out): ``"torch copy_"`` (bench ``copy``, backend torch), ``"Triton <variant> kernel"``
    per variant of bench ``ceiling`` (perf/bench_copy's streaming kernels: ``read``,
    ``read-tma``, ``copy``; the read ceiling the package uses is the larger read median,
    :func:`mqnc.cost.ceilings.memory_ceiling`), and any ``copy`` record naming its kernel in
    ``extra["kernel"]`` as ``"<kernel> (<variant>)"``. Only those recorded are present."""
    torch_copy = memory_ceiling(records, device).torch_copy_tbps
    out = {"torch copy_": float(torch_copy)} if torch_copy else {}
    found: dict[str, list[float]] = {}
    for r in records:
        extra = r.get("extra") or {}
        if r.get("device") != device or extra.get("exact") is False:
            continue
        if r.get("bench") == "ceiling" and r.get("backend") == "triton" and r.get("gbps"):
            found.setdefault(f"Triton {r.get('variant')} kernel", []).append(float(r["gbps"]) / 1e3)
        elif r.get("bench") == "copy" and extra.get("kernel") and r.get("bytes"):
            name = f"{extra['kernel']} ({r.get('variant')})"
            found.setdefault(name, []).append(float(r["bytes"]) / _us(r) / 1e6)
    out.update({name: float(np.median(v)) for name, v in sorted(found.items())})
    return out


def roofline_device(records: Sequence[dict]) -> str | None:
    """The device a roofline is drawn for by default: the one with a spec sheet
    (:data:`SPECS`) and the most kernel records; None when no such device has any."""
    counts: dict[str, int] = {}
    for r in records:
        if r.get("bench") in _KERNEL_BENCHES and str(r.get("device")) in SPECS:
            counts[str(r.get("device"))] = counts.get(str(r.get("device")), 0) + 1
    return max(sorted(counts), key=counts.__getitem__) if counts else None


def roofline(fig, records: Sequence[dict], *, device: str | None = None, spec=None):
    """Draw ``device``'s kernels on its roofline into ``fig`` (two panels side by side).

    (a) TFLOP/s against arithmetic intensity (FLOP per byte moved, log-log) for the attention
    kernels, under the spec's roof ``min(peak, AI x HBM)`` (solid) and the measured ceilings'
    roofs (dashed: torch ``copy_``; dotted: a kernel-measured ceiling when recorded), with the
    anchors' published TFLOP/s as labelled horizontal marks (their intensity is not published
    with them, so they span the panel's compute-bound end). (b) Achieved TB/s against bytes
    moved per call for every kernel, against the spec, the ceilings and the anchors' TB/s.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
        Drawn into (two subplots are added).
    records : sequence of dict
        The results file's records.
    device : str or None
        The records' ``device``; default :func:`roofline_device` (the device with a spec sheet
        and the most kernel records: the H200 in this repository's file).
    spec : DeviceSpec or None
        Default :data:`SPECS` ``[device]``.

    Returns
    -------
    dict
        ``{"points": kernel_points(...), "ceilings": ceilings(...), "spec": DeviceSpec}``.

    Raises
    ------
    MissingData
        No kernel records of ``device`` (or, with neither given, of a device with a spec).
    ValueError
        ``device`` has no spec in :data:`SPECS` and none is passed.
    """
    device = roofline_device(records) if device is None else device
    if device is None:
        raise MissingData(
            f"no kernel records of a device with a spec sheet ({', '.join(SPECS)}); pass "
            "device= and spec=",
            COMMANDS["mla_decode"],
        )
    points = kernel_points(records, device)
    if not points:
        raise MissingData(
            f"no kernel records (bench mla_decode, mla_sparse, splice, merge) of {device!r}",
            COMMANDS["mla_decode"],
        )
    spec = SPECS.get(device) if spec is None else spec
    if spec is None:
        raise ValueError(f"spec: no spec sheet for device {device!r}; pass spec=DeviceSpec(...)")
    ceils = ceilings(records, device)
    ax_f, ax_b = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.15, 1.0]})
    _flops_panel(ax_f, points, ceils, spec)
    _bytes_panel(ax_b, points, ceils, spec)
    handles: dict[str, object] = {}
    for ax in (ax_f, ax_b):
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.legend(
        list(handles.values()), list(handles), loc="outside lower center", ncol=3, fontsize=7
    )
    fig.suptitle(
        f"MLA kernels on the {spec.name} roofline ({_short_device(device)} records, p50)",
        fontsize=10,
    )
    return {"points": points, "ceilings": ceils, "spec": spec}


def _style(series: str) -> dict:
    kind = series.split()[0]
    if "[" in series and "triton" not in series:  # a torch or reference variant: hollow
        return dict(marker=_MARKERS.get(kind, "o"), color="0.45", mfc="none", ms=4, ls="none")
    heads = None
    if "H " in series:
        heads = int(series.split("H ")[1].split(",")[0])
    hollow = "forced tiles" in series
    color = _COLORS.get(heads, _COLORS[None])
    return dict(
        marker=_MARKERS.get(kind, "o"),
        color=color,
        mfc="none" if hollow else color,
        ms=4 if hollow else 4.5,
        ls="none",
        alpha=0.9,
    )


def _flops_panel(ax, points, ceils, spec: DeviceSpec) -> None:
    attn = {k: v for k, v in points.items() if np.isfinite(v["ai"]).any()}
    ais = np.concatenate([v["ai"][np.isfinite(v["ai"])] for v in attn.values()] or [[10.0]])
    ai = np.geomspace(max(1.0, ais.min() / 3), max(2e3, ais.max() * 4), 200)
    ax.plot(
        ai,
        np.minimum(spec.bf16_tflops, ai * spec.hbm_tbps),
        "k-",
        lw=1.4,
        label=f"spec: {spec.bf16_tflops:g} TFLOP/s bf16, {spec.hbm_tbps:g} TB/s {spec.memory}",
    )
    for name, tbps in sorted(ceils.items(), key=lambda kv: kv[1]):
        ls = _ceiling_style(name)
        ax.plot(
            ai,
            np.minimum(spec.bf16_tflops, ai * tbps),
            color="0.35",
            ls=ls,
            lw=1.1,
            label=f"measured {name}: {tbps:.2f} TB/s",
        )
    for name, v in sorted(attn.items()):
        ok = np.isfinite(v["ai"])
        ax.plot(v["ai"][ok], v["tflops"][ok], label=name, **_style(name))
    top = ai[-1]
    for a, color in zip(
        [a for a in ANCHORS if a.unit == "TFLOP/s"], ("C2", "C4", "C1"), strict=False
    ):
        x0 = top / 6
        if a.hi > a.lo:
            ax.fill_between([x0, top], a.lo, a.hi, color=color, alpha=0.35, lw=0)
        ax.hlines((a.lo + a.hi) / 2, x0, top, colors=color, lw=1.6)
        ax.text(
            top / 1.05,
            a.hi * 1.04,
            f"{a.label} ({a.device}; {a.source})",
            ha="right",
            va="bottom",
            fontsize=5.5,
            color=color,
            bbox=dict(fc="white", ec="none", alpha=0.8, pad=0.3),
        )
    ax.set(xscale="log", yscale="log", xlim=(ai[0], ai[-1]))
    ax.set_ylim(
        bottom=max(0.05, np.nanmin([np.nanmin(v["tflops"]) for v in attn.values()]) / 3)
        if attn
        else 0.1,
        top=spec.bf16_tflops * 2.2,
    )
    ax.set(xlabel="arithmetic intensity (FLOP per byte moved)", ylabel="achieved TFLOP/s")
    wrapped_title(ax, "(a) attention kernels: TFLOP/s vs intensity")
    readable_log_ticks(ax)


def _bytes_panel(ax, points, ceils, spec: DeviceSpec) -> None:
    for name, v in sorted(points.items()):
        ax.plot(v["bytes"], v["tbps"], label=name, **_style(name))
    ax.axhline(spec.hbm_tbps, color="k", lw=1.4)
    ax.text(
        1.0,
        spec.hbm_tbps,
        f" {spec.memory} spec {spec.hbm_tbps:g} TB/s",
        fontsize=6,
        transform=ax.get_yaxis_transform(),
        va="bottom",
        ha="right",
    )
    labels = []  # (TB/s, text, colour) of the lines labelled at the left edge
    for name, tbps in sorted(ceils.items(), key=lambda kv: kv[1]):
        ax.axhline(tbps, color="0.35", ls=_ceiling_style(name), lw=1.1, gid=f"ceiling:{name}")
        labels.append((tbps, f"{name} {tbps:.2f}", "0.25"))
    for a in (a for a in ANCHORS if a.unit == "TB/s"):
        ax.axhline(a.lo, color="C2", lw=1.2, ls=(0, (5, 2)))
        labels.append((a.lo, f"{a.label} {a.lo:g} {a.unit} ({a.device}; {a.source})", "C2"))
    top = spec.hbm_tbps * 1.12
    ax.set(xscale="log", ylim=(0, top))
    for y, text, color in _placed(labels, 0.04 * top):
        ax.text(
            0.0,
            y,
            f" {text}",
            transform=ax.get_yaxis_transform(),
            fontsize=6,
            va="bottom",
            ha="left",
            color=color,
        )
    pct = spec.hbm_tbps / 100.0
    right = ax.secondary_yaxis("right", functions=(lambda t: t / pct, lambda p: p * pct))
    right.set_ylabel(f"% of the {spec.memory} spec", fontsize=8)
    ax.set(xlabel="bytes moved per call (read + written)", ylabel="achieved TB/s")
    wrapped_title(ax, "(b) every kernel: bandwidth vs bytes per call")
    readable_log_ticks(ax, "x", fmt=lambda v: _bytes(v))


def _placed(labels: list[tuple[float, str, str]], gap: float) -> list[tuple[float, str, str]]:
    """The labels, sorted by their line's height, each moved up until it sits at least ``gap``
    above the one below it (so that two close ceilings' labels do not overlap)."""
    out: list[tuple[float, str, str]] = []
    for y, text, color in sorted(labels):
        if out and y < out[-1][0] + gap:
            y = out[-1][0] + gap
        out.append((y, text, color))
    return out


def _bytes(v: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= scale:
            return f"{v / scale:g} {unit}"
    return f"{v:g} B"


def _ceiling_style(name: str):
    """A ceiling's line style: torch ``copy_`` dashed, the read kernel dotted, the copy kernel
    dash-dotted, any other densely dotted."""
    styles = {
        "torch copy_": "--",
        "Triton read kernel": ":",
        "Triton read-tma kernel": (0, (3, 1, 1, 1, 1, 1)),
        "Triton copy kernel": "-.",
    }
    return styles.get(name, (0, (1, 1)))
