"""The figures committed in ``docs/``, redrawn from a results file:
``python -m mqnc.plots.docs_figures --out docs [--results FILE]``.

Writes ``results_roofline.png`` (:func:`mqnc.plots.roofline`), ``route_vs_paper.png``
(:func:`mqnc.plots.route_vs_paper`), ``bench_mla_decode.png`` (:func:`mqnc.plots.bench_plot`,
one panel per device) and ``fig2b_route_round_trip_cpu.png`` (:func:`mqnc.plots.route_round_trip`
over the CPU's records). A figure whose records are absent is reported, not drawn. The demo's
figure is drawn by the demo (``mqnc.demo.report.plot``; docs/figures.md has the command).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mqnc.measure.results_file import read_results, results_path
from mqnc.plots._common import devices_with, draw_per_device, try_draw, try_draw_figure
from mqnc.plots.measured import bench_plot, route_round_trip
from mqnc.plots.paper_compare import paper_panels, route_vs_paper
from mqnc.plots.roofline import roofline

__all__ = ["DOCS_FIGURES", "draw_docs_figures", "main"]

DOCS_FIGURES = (
    "results_roofline",
    "route_vs_paper",
    "bench_mla_decode",
    "fig2b_route_round_trip_cpu",
)
"""The names (``.png``) :func:`draw_docs_figures` writes."""


def draw_docs_figures(records, geometry, out: str | os.PathLike) -> dict[str, Path | None]:
    """Draw every figure of :data:`DOCS_FIGURES` from ``records`` into ``out``; returns
    ``{name: path written, or None when its records are missing}``."""
    import matplotlib.pyplot as plt  # here: an optional dependency, see the package docstring

    out = Path(out)
    n_panels = max(1, len(paper_panels(records)))
    drawn = {
        "results_roofline": try_draw_figure(
            "results_roofline", roofline, records, fig_dir=out, figsize=(12.5, 6.4)
        )[0],
        "route_vs_paper": try_draw_figure(
            "route_vs_paper",
            route_vs_paper,
            records,
            geometry,
            fig_dir=out,
            figsize=(13.0, 1.0 + 3.3 * -(-n_panels // 2)),
        )[0],
        "bench_mla_decode": draw_per_device(
            "bench_mla_decode",
            bench_plot,
            records,
            "mla_decode",
            benches=("mla_decode",),
            fig_dir=out,
            panel_size=(8.5, 4.6),
        )[0],
    }
    cpu = [d for d in devices_with(records, ("route",)) if d.startswith("CPU")]
    cpu_recs = [r for r in records if str(r.get("device")) in cpu[:1]]
    drawn["fig2b_route_round_trip_cpu"] = try_draw(
        "fig2b_route_round_trip_cpu",
        route_round_trip,
        cpu_recs,
        geometry,
        fig_dir=out,
        figsize=(9.0, 5.0),
    )[0]
    paths = {}
    for name, fig in drawn.items():
        paths[name] = out / f"{name}.png" if fig is not None else None
        if fig is not None:
            plt.close(fig)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder the PNGs are written to")
    ap.add_argument(
        "--results",
        default=None,
        help="results file (default: $MQNC_RESULTS, else perf/results/results.jsonl)",
    )
    ap.add_argument("--model", default="deepseek-v2-lite", help="geometry preset")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    from mqnc.model import get_preset

    path = args.results or results_path()
    paths = draw_docs_figures(read_results(path), get_preset(args.model), args.out)
    missing = [n for n, p in paths.items() if p is None]
    print(f"{path}: {len(paths) - len(missing)} of {len(paths)} figures written to {args.out}")
    return 1 if len(missing) == len(paths) else 0


if __name__ == "__main__":
    raise SystemExit(main())
