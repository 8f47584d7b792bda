"""The figures render readably and plot the records' values.

For the results figures (the roofline, route / fetch / local against the paper), the per-device
bench panels and the demo's figure, on small synthetic records and on the repository's results
file: a non-empty PNG; every legend, title and tick label inside the figure; no two tick labels
of one axis overlapping (matplotlib's text extents after a draw); and the plotted points, read
back from the artists, equal to the values computed here in float64 from the records (TB/s =
bytes / p50, TFLOP/s = 2 B H n (576 + 512) / p50, the paper's printed numbers).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mqnc import plots  # noqa: E402
from mqnc.model import get_preset  # noqa: E402
from mqnc.plots.docs_figures import DOCS_FIGURES, draw_docs_figures  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPU = "NVIDIA H200"
CPU = "CPU: Test (2 cores)"
V2 = get_preset("deepseek-v2-lite")


def rec(bench, variant, x, p50, *, device=GPU, nbytes=None, extra=None, **kw):
    out = dict(
        bench=bench,
        variant=variant,
        x=x,
        x_name=kw.pop("x_name", "x"),
        p20=0.98 * p50,
        p50=p50,
        p80=1.03 * p50,
        unit="us",
        bytes=nbytes,
        device=device,
        transport=kw.pop("transport", None),
        backend=kw.pop("backend", "triton"),
        extra=extra or {},
    )
    out.update(kw)
    out["gbps"] = nbytes / p50 / 1e3 if nbytes else None  # as mqnc.measure.record writes it
    return out


def kernel_records(*, read_ceiling: bool = True) -> list[dict]:
    """Dense / sparse decode at 16 and 128 heads (one forced tile), splice, merge, copy_ and,
    optionally, a kernel-measured read ceiling."""
    out = []
    for heads in (16, 128):
        for b, ct, p50 in ((1, 2048, 12.5), (8, 32768, 140.0)):
            nbytes = b * ct * 1152 + b * heads * 2200
            out.append(
                rec(
                    "mla_decode",
                    f"H={heads},B={b}",
                    ct,
                    p50 * heads / 16,
                    nbytes=nbytes,
                    x_name="ct",
                    extra={"B": b, "H": heads},
                )
            )
        out.append(
            rec(
                "mla_sparse",
                f"H={heads},B=1",
                2048,
                20.0,
                nbytes=2_638_336,
                x_name="topk",
                extra={"B": 1, "H": heads},
            )
        )
    out.append(
        rec(
            "mla_decode",
            "H=128,B=8@64x32w8s3",
            32768,
            446.0,
            nbytes=304_222_208,
            x_name="ct",
            extra={"B": 8, "H": 128, "tile": "64x32w8s3"},
        )
    )
    out.append(rec("splice", "one-launch", 2048, 42.5, nbytes=127_401_984, x_name="ct"))
    out.append(rec("merge", "M=8", 256, 3.3, nbytes=2_368_512, x_name="rows"))
    out.append(rec("copy", "d2d", 2**33, 3167.8, nbytes=2**33, backend="torch"))
    if read_ceiling:  # perf/bench_copy's read kernel, and a copy record naming its kernel
        out.append(rec("ceiling", "read", 2**32, 1000.0, nbytes=2**32))
        out.append(rec("ceiling", "read-tma", 2**32, 950.0, nbytes=2**32))
        wrong = rec("ceiling", "read", 2**32, 10.0, nbytes=2**32, extra={"exact": False})
        out.append(wrong)  # a kernel that read wrongly measured nothing: left out
        out.append(rec("copy", "stream", 2**32, 1550.0, nbytes=2**32, extra={"kernel": "tma"}))
    return out


def transport_records(device: str = CPU, transport: str = "gloo") -> list[dict]:
    """A route sweep with its probe, a gather, a pull, holder and splice: every row of the
    paper comparison but local."""
    kw = dict(device=device, transport=transport, backend="host-echo")
    out = [rec("probe", transport, 1, 300.0, x_name="payload_bytes", **kw)]
    for m_q in (1, 64, 256, 1024, 4096):
        out.append(rec("route", transport, m_q, 300.0 + 0.4 * m_q, x_name="m_q", **kw))
    for m in (1, 7):
        out.append(rec("fetch", transport, m, 1500.0 * m, x_name="holders", **kw))
    out.append(rec("fetch", f"contiguous ({transport})", 2048, 30_000.0, x_name="c_t", **kw))
    for n in (1, 16, 256):
        out.append(
            rec(
                "holder",
                "h_q=16 c_t=2048",
                n,
                20.0 + n,
                device=device,
                x_name="requesters",
                extra={"heads": 16, "c_t": 2048},
            )
        )
    out.append(rec("splice", "torch", 2048, 250_000.0, device=device, backend="torch", x_name="ct"))
    return out


# ---- what readable means -----------------------------------------------------------------------


def _inside(bbox, frame, what: str, tol: float = 1.0) -> None:
    assert (
        bbox.x0 >= frame.x0 - tol
        and bbox.y0 >= frame.y0 - tol
        and bbox.x1 <= frame.x1 + tol
        and bbox.y1 <= frame.y1 + tol
    ), f"{what} {bbox} runs outside the figure {frame}"


def _tick_labels(axis, view) -> list:
    lo, hi = sorted(view)
    out = []
    for tick in axis.get_major_ticks() + axis.get_minor_ticks():
        label = tick.label1
        if not (label.get_visible() and label.get_text() and tick.get_visible()):
            continue
        if lo - 1e-9 * abs(lo) <= tick.get_loc() <= hi + 1e-9 * abs(hi):
            out.append(label)
    return out


def assert_readable(fig, png: Path | None = None) -> None:
    """Saved as a non-empty PNG (when ``png`` is given); after a draw at the figure's own dpi,
    legends, titles and tick labels inside the figure and no two tick labels of one axis
    overlapping."""
    if png is not None:
        fig.savefig(png)
        assert png.stat().st_size > 10_000, f"{png.name}: {png.stat().st_size} bytes"
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = fig.bbox
    texts = [(fig._suptitle, "suptitle")] if fig._suptitle is not None else []
    for i, legend in enumerate(fig.legends):
        _inside(legend.get_window_extent(renderer), frame, f"figure legend {i}")
    for n, ax in enumerate(fig.axes):
        if not ax.axison:
            continue
        texts.append((ax.title, f"axes {n} title"))
        if ax.get_legend() is not None:
            _inside(ax.get_legend().get_window_extent(renderer), frame, f"axes {n} legend")
        for axis, view in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            labels = _tick_labels(axis, view)
            boxes = [lab.get_window_extent(renderer) for lab in labels]
            for lab, box in zip(labels, boxes, strict=True):
                _inside(box, frame, f"axes {n} tick label {lab.get_text()!r}")
            order = sorted(range(len(boxes)), key=lambda i: (boxes[i].x0, boxes[i].y0))
            for a, b in zip(order, order[1:], strict=False):
                assert not boxes[a].shrunk(0.98, 0.98).overlaps(boxes[b].shrunk(0.98, 0.98)), (
                    f"axes {n}: tick labels {labels[a].get_text()!r} and "
                    f"{labels[b].get_text()!r} overlap"
                )
        notes = [t for t in ax.texts if t.get_visible() and t.get_text().strip()]
        boxes = [t.get_window_extent(renderer) for t in notes]
        for note, box in zip(notes, boxes, strict=True):
            _inside(box, ax.get_window_extent(renderer), f"axes {n} text {note.get_text()!r}")
        for i, j in itertools.combinations(range(len(notes)), 2):
            assert not boxes[i].shrunk(0.98, 0.98).overlaps(boxes[j].shrunk(0.98, 0.98)), (
                f"axes {n}: texts {notes[i].get_text()!r} and {notes[j].get_text()!r} overlap"
            )
    for text, what in texts:
        if text.get_text():
            _inside(text.get_window_extent(renderer), frame, what)


def _line(ax, *, label=None, gid=None):
    found = [
        ln
        for ln in ax.get_lines()
        if (label and ln.get_label() == label) or (gid and ln.get_gid() == gid)
    ]
    assert len(found) == 1, f"{label or gid}: {len(found)} lines"
    return found[0]


# ---- the roofline ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def roof():
    records = kernel_records()
    fig = plt.figure(figsize=(12.5, 6.4), layout="constrained")
    out = plots.roofline(fig, records)
    yield fig, out, records
    plt.close(fig)


def test_roofline_renders_readably(roof, tmp_path):
    fig, _, _ = roof
    assert_readable(fig, tmp_path / "roofline.png")


def test_roofline_points_are_the_records_values(roof):
    fig, out, records = roof
    ax_f, ax_b = fig.axes[:2]
    series = {
        "dense decode H 16": ("mla_decode", 16, False),
        "dense decode H 128": ("mla_decode", 128, False),
        "dense decode H 128, forced tiles": ("mla_decode", 128, True),
        "sparse decode H 128": ("mla_sparse", 128, False),
    }
    for name, (bench, heads, swept) in series.items():
        mine = [
            r
            for r in records
            if r["bench"] == bench and r["extra"]["H"] == heads and ("@" in r["variant"]) == swept
        ]
        tbps = np.array([r["bytes"] / r["p50"] / 1e6 for r in mine], dtype=np.float64)
        flops = np.array([2.0 * r["extra"]["B"] * heads * r["x"] * 1088 for r in mine])
        tflops = flops / np.array([r["p50"] for r in mine]) / 1e6
        ai = flops / np.array([r["bytes"] for r in mine], dtype=np.float64)
        line = _line(ax_b, label=name)
        np.testing.assert_allclose(line.get_xdata(), [r["bytes"] for r in mine], rtol=0)
        np.testing.assert_allclose(line.get_ydata(), tbps, rtol=1e-14)
        line = _line(ax_f, label=name)
        np.testing.assert_allclose(line.get_xdata(), ai, rtol=1e-14)
        np.testing.assert_allclose(line.get_ydata(), tflops, rtol=1e-14)
    for bench in ("splice", "merge"):
        (r,) = [r for r in records if r["bench"] == bench]
        line = _line(ax_b, label=f"{bench} [triton]")
        assert line.get_ydata()[0] == pytest.approx(r["bytes"] / r["p50"] / 1e6, rel=1e-14)
    assert out["spec"].bf16_tflops == 989.0 and out["spec"].hbm_tbps == 4.8


def test_roofline_ceilings_with_and_without_a_kernel_measured_one(roof):
    fig, out, _ = roof
    ax_b = fig.axes[1]
    expect = {
        "torch copy_": 2**33 / 3167.8 / 1e6,
        "Triton read kernel": 2**32 / 1000.0 / 1e6,
        "Triton read-tma kernel": 2**32 / 950.0 / 1e6,
        "tma (stream)": 2**32 / 1550.0 / 1e6,  # beside copy_: its label must move
    }
    assert out["ceilings"] == {k: pytest.approx(v, rel=1e-14) for k, v in expect.items()}
    for name, tbps in expect.items():
        assert _line(ax_b, gid=f"ceiling:{name}").get_ydata()[0] == pytest.approx(tbps, rel=1e-14)
    fig2 = plt.figure(figsize=(12.5, 6.4), layout="constrained")
    try:
        alone = plots.roofline(fig2, kernel_records(read_ceiling=False))
    finally:
        plt.close(fig2)
    assert list(alone["ceilings"]) == ["torch copy_"]


def test_roofline_refuses_what_it_cannot_draw():
    with pytest.raises(plots.MissingData, match="perf.bench_mla"):
        plots.roofline(None, transport_records())
    with pytest.raises(ValueError, match="spec"):
        plots.roofline(
            None, [dict(r, device="Other GPU") for r in kernel_records()], device="Other GPU"
        )


# ---- route / fetch / local against the paper -----------------------------------------------------


def test_route_vs_paper_renders_the_records_and_the_papers_numbers(tmp_path):
    records = transport_records() + transport_records(GPU, "nvshmem")
    fig = plt.figure(figsize=(13, 5), layout="constrained")
    try:
        out = plots.route_vs_paper(fig, records, V2)
        assert_readable(fig, tmp_path / "route_vs_paper.png")
        assert list(out) == [(GPU, "nvshmem", None), (CPU, "gloo", None)]
        ax = fig.axes[1]
        rows = [p.label for p in plots.PAPER_POINTS]
        expect = {  # row -> the record's p50 (float64, from the records above)
            "probe (1-byte round trip)": 300.0,
            "route round trip, M_q 1024": 300.0 + 0.4 * 1024,
            "holder partial, N <= 16 requesters": 36.0,
            "fetch gather top-2048, 7 holders (per layer)": 1500.0 * 7,
            "fetch splice, c_t 2048, 27 layers": 250_000.0,
        }
        for label, p50 in expect.items():
            i = rows.index(label)
            assert _line(ax, gid=f"measured:{i}").get_xdata()[0] == p50
            assert out[(CPU, "gloo", None)]["measured"][i] == p50
        local = rows.index("local re-prefill, c_t 2048")
        assert out[(CPU, "gloo", None)]["measured"][local] is None  # nothing recorded: no point
        for i, point in enumerate(plots.PAPER_POINTS):
            xs = _line(ax, gid=f"paper:{i}").get_xdata()
            assert xs[-1] == point.hi and (point.lo == 0 or xs[0] == point.lo)
        assert _line(ax, gid="paper:2").get_xdata()[0] == 115.8  # Table 1, M_q 1024
        # the fitted model recovers the generating line (300 us + 0.4 us per row)
        fitted = out[(CPU, "gloo", None)]["model_fitted"]
        assert fitted[rows.index("route round trip, M_q 4096")] == pytest.approx(1938.4, rel=1e-9)
    finally:
        plt.close(fig)


# ---- the model's figures (notebook 01) ----------------------------------------------------------


def test_model_figures_render_readably(tmp_path):
    from mqnc.cost import load_fabric

    fabric = load_fabric("h100-ibgda")
    m, c = np.geomspace(1, 8192, 24), np.geomspace(16, 8192, 24)
    cases = [
        ("fig1a", plots.payload_bars, (V2,), {}),
        ("fig1b", plots.cost_vs_chunk, (V2, fabric), dict(c_t_axis=c)),
        ("fig3b", plots.wire_saving_map, (V2,), dict(m_q_axis=m, c_t_axis=c)),
        ("decision", plots.decision_map, (V2, fabric, m, c), {}),
        ("fig6a", plots.bw_sweep_plot, (V2, fabric), dict(bw_axis=np.geomspace(0.2, 1000, 40))),
    ]
    for name, draw, args, kwargs in cases:
        fig, _ = plots.try_draw(name, draw, *args, **kwargs)
        try:
            assert_readable(fig, tmp_path / f"{name}.png")
        finally:
            plt.close(fig)


def test_cost_vs_chunk_draws_the_fp8_fetch_beside_bf16(tmp_path):
    """``fp8_fetch=True``: a dashed fetch line over the FP8 entry (656 B per token-layer)
    beside the bf16 one (1152 B), each the cost model's ``t_fetch`` of its geometry, the
    FP8 one below at every chunk size (less to pull, the same splice profile)."""
    from mqnc.cost import load_fabric, t_fetch

    fabric, c = load_fabric("h100-ibgda"), np.geomspace(16, 8192, 24)
    fig, ax = plt.subplots()
    try:
        plots.cost_vs_chunk(ax, V2, fabric, c_t_axis=c, fp8_fetch=True)
        bf16 = _line(ax, label="fetch (all-layer pull + splice, 1152 B/token-layer)")
        fp8 = _line(ax, label="fetch, FP8 cache (656 B/token-layer)")
        g8 = V2.replace(cache_dtype="fp8_e4m3")
        assert np.array_equal(fp8.get_ydata(), t_fetch(g8, fabric, c, bw_gbps=70.0).total)
        assert np.array_equal(bf16.get_ydata(), t_fetch(V2, fabric, c, bw_gbps=70.0).total)
        assert (fp8.get_ydata() < bf16.get_ydata()).all() and fp8.get_linestyle() == "--"
        assert_readable(fig, tmp_path / "fig1b_fp8.png")
    finally:
        plt.close(fig)


# ---- one panel per device, the demo's figure, the committed figures ------------------------------


def test_bench_panels_never_mix_devices(tmp_path):
    records = kernel_records() + [
        dict(r, device=CPU, backend="torch-reference")
        for r in kernel_records()
        if r["bench"] == "mla_decode"
    ]
    with pytest.raises(ValueError, match="2 devices"):
        plots.bench_plot(None, records, "mla_decode")
    fig, out = plots.draw_per_device(
        "bench_mla_decode", plots.bench_plot, records, "mla_decode", benches=("mla_decode",)
    )
    try:
        assert list(out) == [GPU, CPU]
        assert_readable(fig, tmp_path / "bench.png")
        xs, p50 = out[GPU][("H=16,B=8", "triton")]
        assert list(xs) == [32768.0] and list(p50) == [140.0]
    finally:
        plt.close(fig)


def test_demo_figure_ticks_do_not_collide(tmp_path, monkeypatch):
    """The demo's figure over the span that collided ("3x10^3 4x10^3"): plain labels, apart."""
    from mqnc.demo.report import plot

    rng = np.random.default_rng(0)
    rows = {}
    for prim, lo, hi in (("route", 2500.0, 40_000.0), ("fetch", 2600.0, 8000.0)):
        pred = np.geomspace(lo, hi, 30)
        calls = [dict(predicted=p, measured=p * (0.7 + 0.6 * rng.random())) for p in pred]
        rows[prim] = dict(count=len(calls), mape=0.17, per_call=calls)
    kept = []
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figure to read its text extents
    title = plot(rows, tmp_path / "demo.png", subtitle="CPU: Test (2 cores)\ngloo, kernels torch")
    monkeypatch.undo()
    (fig,) = kept
    try:
        assert title.startswith("mqnc demo: measured vs the cost model")
        assert_readable(fig, tmp_path / "demo_check.png")
        labels = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_text()]
        assert "5 ms" in labels and not any("times" in t or "^" in t for t in labels), labels
    finally:
        plt.close(fig)


def test_the_committed_figures_redraw_readably_from_the_results_file(tmp_path, monkeypatch):
    records = plots.read_results(ROOT / "perf" / "results" / "results.jsonl")
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    paths = draw_docs_figures(records, V2, tmp_path)
    monkeypatch.undo()
    try:
        assert sorted(paths) == sorted(DOCS_FIGURES)
        assert all(p is not None and p.stat().st_size > 10_000 for p in paths.values()), paths
        assert len(figs) == len(DOCS_FIGURES)
        for fig in figs:
            assert_readable(fig)  # written above by draw_docs_figures
    finally:
        for fig in figs:
            plt.close(fig)
    for name in DOCS_FIGURES:
        assert (ROOT / "docs" / f"{name}.png").exists(), f"docs/{name}.png not committed"
