"""The notebooks execute (nbclient) and draw every figure they promise, so they never rot.

Each notebook runs in a fresh kernel of THIS interpreter (a kernel spec written to a temporary
folder: nothing is registered globally), with matplotlib's Agg backend, ``MQNC_FIG_DIR`` set so
that every figure is written as a PNG, and ``MQNC_RESULTS`` pointing at the results file under
test. ``02_measurements`` runs three times: on a synthetic results file holding every record
kind the figures read (generated here from the cost model with noise: the figures must all be
drawn), on one holding only kernel benchmarks (the transport figures must be reported missing
with the command that produces them) and on the repository's own results file.

Also checked: the notebooks are stored executed (``make notebooks``), every figure cell with its
image, each notebook under 1 MB, and their stored text outputs are current: the runs on the
repository's own results file print, cell by cell, what the stored notebooks hold (images are
not compared); and the plotting functions report missing data with
:class:`mqnc.plots.MissingData`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from mqnc import plots  # noqa: E402
from mqnc.cost import (  # noqa: E402
    GATHER_PAPER,
    Congestion,
    FabricProfile,  # noqa: E402
    t_route,
)
from mqnc.model import get_preset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TIMEOUT_S = 120
MAX_BYTES = 1_000_000
NOTEBOOK_NAMES = ["01_cost_model.ipynb", "02_measurements.ipynb"]

MODEL_FIGS = [
    "fig1a_payload",
    "fig1b_cost_vs_chunk",
    "fig3b_wire_saving",
    "fig3b_decision_map",
    "fig6a_bw_sweep",
]
TRANSPORT_FIGS = {
    "fig2b_route_fit": "perf.bench_route",
    "fig4a_gather_vs_route": "perf.bench_fetch",
    "fig4b_holder_compute": "perf.bench_holder",
    "fig7_congestion": "perf.bench_congestion",
}


# ---- synthetic results: drawn from the cost model with multiplicative noise ----------------------


def _rec(bench, variant, x, p50, *, x_name, rng, extra=None, backend="synthetic"):
    spread = 1.0 + 0.03 * rng.random()
    return dict(
        bench=bench,
        variant=variant,
        x=x,
        x_name=x_name,
        p20=p50 / spread,
        p50=p50,
        p80=p50 * spread,
        unit="us",
        bytes=None,
        gbps=None,
        device="Synthetic GPU",
        transport="synthetic",
        backend=backend,
        version="0",
        commit="0",
        date="2026-01-01T00:00:00+00:00",
        extra=extra or {},
    )


# Over 60 lines: one record-building block per figure the notebooks draw, in figure order.
def synthetic_records(
    *, transport: bool = True, kernels: bool = True, noise: float = 0.02, seed: int = 0
) -> list:
    """Records of every kind the figures read, from a known fabric plus ``noise`` (relative)."""
    rng = np.random.default_rng(seed)
    g = get_preset("deepseek-v2-lite")
    fab = FabricProfile("synthetic", t_probe_us=12.0, bw_gbps=20.0, turnaround_us=6.0)

    def noisy(v):
        return float(v * (1.0 + noise * rng.standard_normal()))

    out = []
    if transport:
        for m_q in (1, 4, 16, 64, 256, 1024, 4096):
            rt = t_route(g, fab, m_q).transport
            out.append(_rec("route", "loopback", m_q, noisy(rt), x_name="m_q", rng=rng))
            # Table 1's payload sweep at another row size
            qp = 900
            rt = fab.t_probe_us + fab.turnaround_us + m_q * qp / (fab.bw_gbps * 1e3)
            extra = {"qp_row_bytes": qp}
            out.append(
                _rec("route", "loopback", m_q, noisy(rt), x_name="m_q", rng=rng, extra=extra)
            )
        out.append(_rec("probe", "loopback", 1, noisy(fab.t_probe_us), x_name="bytes", rng=rng))
        for m in range(1, 8):
            gather = GATHER_PAPER.per_layer_us(g, 2048, m)
            out.append(
                _rec("fetch", "gather top-2048", m, noisy(gather), x_name="holders", rng=rng)
            )
            fan = t_route(g, fab, 256).transport + 5.0
            out.append(_rec("route_fanout", "M_q=256", m, noisy(fan), x_name="holders", rng=rng))
        for ct in (256, 2048):
            out.append(_rec("fetch", "contiguous", ct, noisy(3.0 * ct), x_name="c_t", rng=rng))
        for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            t = 20.0 + 1.5 * max(0, n - 8)
            out.append(_rec("holder", "dense c_t=2048", n, noisy(t), x_name="requesters", rng=rng))
        for k in (1, 4, 8, 16):
            out.append(
                _rec("holder", "staging pool", k, noisy(40.0 * k), x_name="streams", rng=rng)
            )
        cong = Congestion(bw_factor=0.45, probe_add_us=25.0)
        for k in (0, 1, 2, 3):
            c = cong if k == 3 else None
            probe = fab.t_probe_us + (c.probe_add_us if c else 0.0)
            out.append(_rec("congestion", "probe", k, noisy(probe), x_name="flows", rng=rng))
            for m_q in (256, 1024):
                rt = t_route(g, fab, m_q, congestion=c).transport
                out.append(_rec("congestion", f"M_q={m_q}", k, noisy(rt), x_name="flows", rng=rng))
    if kernels:  # on a device with a spec sheet, so that the roofline is drawn
        start = len(out)
        for m in (2, 8):
            for rows in (16, 1024, 16384):
                t = 5.0 + 0.01 * m * rows
                rec = _rec("merge", f"M={m}", rows, noisy(t), x_name="rows", rng=rng)
                out.append(dict(rec, backend="triton", bytes=(m + 1) * rows * 1032))
        for b in (1, 8):
            for ct in (2048, 8192):
                nbytes = b * ct * 1152
                rec = _rec(
                    "mla_decode",
                    f"H=16,B={b}",
                    ct,
                    noisy(2.0 + nbytes / 2e6),
                    x_name="ct",
                    rng=rng,
                    extra={"B": b, "H": 16},
                )
                out.append(dict(rec, backend="triton", bytes=nbytes))
        rec = _rec("copy", "d2d", 2**32, noisy(2**32 / 2.5e6), x_name="bytes", rng=rng)
        out.append(dict(rec, backend="torch", bytes=2**32))
        for ct in (55, 1024, 2048):
            out.append(
                _rec(
                    "splice",
                    "one-launch",
                    ct,
                    noisy(100 + ct),
                    x_name="ct",
                    rng=rng,
                    backend="triton",
                )
            )
            out[-1]["bytes"] = 27 * ct * 1152 * 2
        for r in out[start:]:
            r["device"] = "NVIDIA H200"
    return out


def _write(path: Path, records: list) -> Path:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


# ---- execution -------------------------------------------------------------------------------


def _kernel_manager(tmp: Path, env: dict):
    """A kernel manager for this interpreter, from a kernel spec in ``tmp`` (not registered)."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec_dir = tmp / "kernels" / "mqnc-test"
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "mqnc test",
        "language": "python",
        "env": env,
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp / "kernels")])
    found = ksm.get_kernel_spec("mqnc-test")
    if found.argv[0] != sys.executable:
        raise RuntimeError(f"kernel spec resolves to {found.argv[0]}, not {sys.executable}")
    return KernelManager(kernel_name="mqnc-test", kernel_spec_manager=ksm)


def run_notebook(name: str, tmp: Path, *, results: Path | None) -> tuple[Path, str]:
    """Execute ``notebooks/name`` with figures written to ``tmp/figs``; returns that folder and
    the text of every stream output (the executed notebook is in ``EXECUTED[name]``)."""
    fig_dir = tmp / "figs"
    env = {"MPLBACKEND": "Agg", "MQNC_FIG_DIR": str(fig_dir), "IPYTHONDIR": str(tmp / "ipython")}
    if results is not None:
        env["MQNC_RESULTS"] = str(results)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    km = _kernel_manager(tmp, env)
    # The default results path must come from the notebook; connection files go to tmp.
    # The kernel inherits this environment: the notebooks' own variables are unset (defaults),
    # as when the stored outputs were made.
    ours = ("MQNC_RESULTS", "MQNC_MODEL", "MQNC_FABRIC", "MQNC_FIG_DIR")
    saved = {k: os.environ.get(k) for k in (*ours, "JUPYTER_RUNTIME_DIR")}
    for k in ours:
        os.environ.pop(k, None)
    os.environ["JUPYTER_RUNTIME_DIR"] = str(tmp / "runtime")
    try:
        client = nbclient.NotebookClient(
            nb,
            km=km,
            timeout=TIMEOUT_S,
            resources={"metadata": {"path": str(NOTEBOOKS)}},
        )
        client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    EXECUTED[name] = nb
    text = "\n".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream"
    )
    return fig_dir, text


EXECUTED: dict = {}
"""The last execution of each notebook, with its outputs."""

_DRAWS = re.compile(r"\b(try_draw|draw)\(")


def assert_figure_cells_hold_images(name: str) -> None:
    """Every code cell that draws (calls ``draw(`` / ``try_draw(``) is tagged ``figure``, and
    every ``figure`` cell's outputs hold an ``image/png``: the executed notebook keeps its
    images (``%matplotlib inline``), even under ``MPLBACKEND=Agg``."""
    nb = EXECUTED[name]
    figure_cells = 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tagged = "figure" in cell.metadata.get("tags", [])
        draws = bool(_DRAWS.search(cell.source)) and "def draw(" not in cell.source
        assert tagged == draws, f"{name} cell {i}: tagged {tagged}, draws {draws}"
        if tagged:
            figure_cells += 1
            kinds = [k for out in cell.outputs for k in out.get("data", {})]
            assert "image/png" in kinds, f"{name} cell {i}: no image/png in its outputs {kinds}"
    assert figure_cells >= 4, f"{name}: only {figure_cells} figure cells"


_WROTE = re.compile(r"^\S+: wrote .*\n?", re.M)
"""The line a figure saved to ``MQNC_FIG_DIR`` prints (the stored run sets no folder)."""


def _stdout_per_cell(nb) -> list[str]:
    return [
        "".join(
            out.get("text", "")
            for out in cell.get("outputs", [])
            if out.get("output_type") == "stream" and out.get("name") == "stdout"
        )
        for cell in nb.cells
        if cell.cell_type == "code"
    ]


def assert_stored_outputs_current(name: str) -> None:
    """The stored notebook's text outputs are what the last execution of ``name`` (on the
    repository's results file, default model and fabric) printed, cell by cell, less the lines
    that name the temporary figure folder; images are not compared."""
    stored = _stdout_per_cell(nbformat.read(NOTEBOOKS / name, as_version=4))
    fresh = [_WROTE.sub("", text) for text in _stdout_per_cell(EXECUTED[name])]
    assert len(stored) == len(fresh), f"{name}: {len(stored)} stored cells, {len(fresh)} run"
    for i, (old, new) in enumerate(zip(stored, fresh, strict=True)):
        assert old == new, (
            f"notebooks/{name} code cell {i}: the stored output is stale; rerun `make notebooks`"
            f"\n--- stored\n{old}\n--- now\n{new}"
        )


def assert_png(path: Path) -> None:
    """The PNG exists, is not tiny, and is not a blank canvas."""
    import matplotlib.image as mpimg

    assert path.exists(), f"figure not written: {path.name}"
    assert path.stat().st_size > 8_000, f"{path.name}: only {path.stat().st_size} bytes"
    img = mpimg.imread(path)
    rgb = img[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.05, f"{path.name}: looks blank (pixel std {rgb.std():.3f})"
    # more than background, text and a single line: a figure uses several colours (each
    # 8-bit RGB triple packed into one integer: np.unique over rows was seconds per figure)
    q = (rgb * 255).astype(np.uint8).astype(np.uint32)
    colours = np.unique((q[:, 0] << 16) | (q[:, 1] << 8) | q[:, 2])
    assert len(colours) > 50, f"{path.name}: too plain"


# ---- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_stored_executed_with_their_figures(name):
    """A reader on the web sees every figure: the notebook is stored executed, top to bottom
    in one run, without errors, every ``figure`` cell holding an ``image/png``; under
    :data:`MAX_BYTES`, and naming no clone's absolute path."""
    path = NOTEBOOKS / name
    assert path.stat().st_size < MAX_BYTES, f"{name}: {path.stat().st_size} bytes"
    assert str(ROOT) not in path.read_text(), f"{name}: stores this clone's path"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{name}: not stored executed: {counts}"
    for i, cell in enumerate(code):
        kinds = {out.output_type for out in cell.outputs}
        assert "error" not in kinds, f"{name} code cell {i}: stored with an error"
        if "figure" in cell.metadata.get("tags", []):
            images = [
                out.data["image/png"] for out in cell.outputs if "image/png" in out.get("data", {})
            ]
            assert images, f"{name} code cell {i}: a figure cell stored without its image"


def test_cost_model_notebook(tmp_path):
    fig_dir, text = run_notebook("01_cost_model.ipynb", tmp_path, results=None)
    for fig in MODEL_FIGS:
        assert_png(fig_dir / f"{fig}.png")
    assert "not drawn" not in text
    assert_figure_cells_hold_images("01_cost_model.ipynb")
    assert_stored_outputs_current("01_cost_model.ipynb")


def test_measurements_notebook_draws_every_figure(tmp_path):
    results = _write(tmp_path / "results.jsonl", synthetic_records())
    fig_dir, text = run_notebook("02_measurements.ipynb", tmp_path, results=results)
    expected = [
        *TRANSPORT_FIGS,
        "fig2b_route_fit_qp900",
        "bench_merge",
        "bench_splice",
        "bench_fetch_other",
        "bench_holder_other",
        "bench_mla_decode",
        "results_roofline",
        "route_vs_paper",
    ]
    for fig in expected:
        assert_png(fig_dir / f"{fig}.png")
    assert "not drawn" not in text
    assert re.search(r"missing: nothing", text)
    assert_figure_cells_hold_images("02_measurements.ipynb")


def test_measurements_notebook_reports_missing_records(tmp_path):
    results = _write(tmp_path / "results.jsonl", synthetic_records(transport=False))
    fig_dir, text = run_notebook("02_measurements.ipynb", tmp_path, results=results)
    for fig, command in TRANSPORT_FIGS.items():
        assert not (fig_dir / f"{fig}.png").exists()
        line = next((ln for ln in text.splitlines() if ln.startswith(f"{fig}: not drawn")), None)
        assert line is not None, f"{fig}: absence not reported"
        assert f"python -m {command}" in line, line
    for fig in ("bench_merge", "bench_splice"):
        assert_png(fig_dir / f"{fig}.png")


def test_measurements_notebook_on_repository_results(tmp_path):
    """The committed results file (found from notebooks/ without MQNC_RESULTS): every bench in
    it is drawn, every transport figure is drawn or reported missing."""
    records = plots.read_results(ROOT / "perf" / "results" / "results.jsonl")
    fig_dir, text = run_notebook("02_measurements.ipynb", tmp_path, results=None)
    # named by its path in the repository, so that the stored outputs name no clone
    assert f"perf/results/results.jsonl: {len(records)} records" in text
    for bench in plots.benches(records):
        if bench not in plots.TRANSPORT_BENCHES:
            assert_png(fig_dir / f"bench_{bench}.png")
    for fig in ("results_roofline", "route_vs_paper"):
        assert_png(fig_dir / f"{fig}.png")
    engines = sorted({str(r.get("transport")) for r in records if r.get("bench") == "congestion"})
    for fig in TRANSPORT_FIGS:
        if fig == "fig7_congestion" and len(engines) > 1:  # one figure per engine
            for t in engines:
                name = f"{fig}_{t}"
                assert (fig_dir / f"{name}.png").exists() or f"{name}: not drawn" in text
            continue
        assert (fig_dir / f"{fig}.png").exists() or f"{fig}: not drawn" in text
    assert_stored_outputs_current("02_measurements.ipynb")


def test_compact_png_is_a_small_palette_png():
    """The notebooks' stored figures: a palette PNG of at most 256 colours, smaller than the
    full-colour one; bad arguments are refused by name."""
    import base64
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    fig, ax = plt.subplots(figsize=(4, 3))
    try:
        x = np.linspace(0, 6, 200)
        for k in range(6):
            ax.plot(x, np.sin(x + k), label=f"k={k}")
        ax.legend()
        small = base64.b64decode(plots.compact_png(fig, dpi=80))
        full = io.BytesIO()
        fig.savefig(full, format="png", dpi=80)
        with pytest.raises(ValueError, match="colors"):
            plots.compact_png(fig, colors=300)
        with pytest.raises(ValueError, match="dpi"):
            plots.compact_png(fig, dpi=0)
    finally:
        plt.close(fig)
    with Image.open(io.BytesIO(small)) as img:
        assert img.format == "PNG" and img.mode == "P"
        assert img.size == (320, 240)
        assert len(img.getcolors(256) or []) > 8  # the lines' colours survive
    assert len(small) < len(full.getvalue())


def test_plots_missing_data_names_the_command():
    g = get_preset("deepseek-v2-lite")
    only_kernels = synthetic_records(transport=False)
    cases = [
        (plots.route_round_trip, (only_kernels, g), "perf.bench_route"),
        (plots.gather_vs_route, (only_kernels,), "perf.bench_fetch"),
        (plots.holder_compute, (only_kernels,), "perf.bench_holder"),
        (plots.congestion_plot, (only_kernels, g), "perf.bench_congestion"),
        (plots.bench_plot, (only_kernels, "merge_nope"), "merge_nope"),
    ]
    for fn, args, needle in cases:
        with pytest.raises(plots.MissingData, match=re.escape(needle)):
            fn(None, *args)  # raises before touching the axes


def test_congestion_is_drawn_per_engine_never_across_engines():
    """Fig. 7 over the records of two engines: a median across them would be no engine's,
    so one must be chosen (``transport=``); each one's fit is that engine's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = get_preset("deepseek-v2-lite")
    one = [r for r in synthetic_records(kernels=False, noise=0.0) if r["bench"] == "congestion"]
    slow = [
        dict(r, transport="gloo", p20=10 * r["p20"], p50=10 * r["p50"], p80=10 * r["p80"])
        for r in one
    ]
    both = one + slow
    with pytest.raises(ValueError, match=r"2 \(device, transport\) pairs"):
        plots.congestion_plot(None, both, g)
    with pytest.raises(plots.MissingData, match="transport='ethernet'"):
        plots.congestion_plot(None, both, g, transport="ethernet")
    fig, ax = plt.subplots()
    try:
        fast = plots.congestion_plot(ax, both, g, transport="synthetic")
        alone = plots.congestion_plot(ax, one, g)
    finally:
        plt.close(fig)
    assert fast == alone  # the other engine's records changed nothing
    assert fast.bw_factor == pytest.approx(0.45, rel=0.02)


def test_route_fit_recovers_the_generating_fabric():
    """Fig. 2(b)'s fit, read back from the synthetic records: the generating constants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = get_preset("deepseek-v2-lite")
    fig, ax = plt.subplots()
    fits = plots.route_round_trip(ax, synthetic_records(kernels=False, noise=0.002), g)
    plt.close(fig)
    ((key, res),) = fits.items()
    assert key == ("Synthetic GPU", "loopback", g.qp_row_bytes)
    assert res.probe_measured
    assert res.bw_gbps == pytest.approx(20.0, rel=0.01)
    assert res.t_probe_us == pytest.approx(12.0, rel=0.01)
    assert res.turnaround_us == pytest.approx(6.0, abs=1.0)
