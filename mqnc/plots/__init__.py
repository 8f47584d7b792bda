"""The paper's figures, drawn from this package's model and from the results file.

Every function draws ONE figure (or one panel) onto a matplotlib ``Axes`` it is given, from
model objects (:class:`~mqnc.model.MLAGeometry`, :class:`~mqnc.cost.FabricProfile`, the
predicate's grids) or from the records of ``perf/results/results.jsonl``; nothing is typed
in. The notebooks (``notebooks/01_cost_model.ipynb``, ``notebooks/02_measurements.ipynb``) and
the CLI call the same functions. matplotlib is an optional dependency (the ``notebooks`` extra):
it is imported inside the drawing functions only, so importing this package costs numpy and
nothing else (no torch: the records are read by :mod:`mqnc.measure.results_file`).

Modules: :mod:`mqnc.plots.cost_figures` (from the model), :mod:`mqnc.plots.measured` (from the
records), :mod:`mqnc.plots._common` (colours, commands, record selection, saving, and
:func:`compact_png`: the notebooks' stored figures).

Model figures (§4, §5, §8):

- :func:`payload_bars` Fig. 1(a): a routed row ``q + p`` against one layer's and all layers'
  ``c_KV`` chunk;
- :func:`cost_vs_chunk` Fig. 1(b): the three primitives against chunk size (local as the band
  over ``c`` in [0.5, 1.5] us per token-layer);
- :func:`wire_saving_map` Fig. 3(b): route's wire-byte saving over the ``(M_q, c_t)`` grid with
  the break-even line ``M_q = c_t b_KV / (q + p)``; :func:`decision_map` the argmin on total
  cost over the same grid;
- :func:`bw_sweep_plot` Fig. 6(a): cost against effective bandwidth at one request shape.

Measurement figures, from records (the long format of :mod:`mqnc.measure.results_file`). Each raises
:class:`MissingData` (with the command that produces the records) when there is nothing to
draw. The records they read:

- :func:`route_round_trip` Fig. 2(b): ``bench="route"``, ``x`` = M_q, ``p50`` the round trip
  (us), one curve per ``variant`` (transport) and device, ``extra["qp_row_bytes"]`` for the
  payload sweep; ``bench="probe"`` (same variant) the 1-byte ``sig_rt``. Fitted with
  :func:`mqnc.cost.fit` exactly as ``mqnc fit`` does.
- :func:`gather_vs_route` Fig. 4(a): ``bench="fetch"`` with ``x_name="holders"`` (the scattered
  gather over ``M`` holders, per layer) and ``bench="route_fanout"`` (``x`` = M, the route
  fan-out: sends plus the M-way merge). A separate bench name keeps the fan-out out of the
  M_q fit. Model: the gather's affine law of §5.4 (``M t_handshake + k b_KV / BW_gather``,
  least squares) and the route fan-out's flat line.
- :func:`holder_compute` Fig. 4(b): ``bench="holder"`` with ``x_name="requesters"`` (``x`` = N),
  fitted with the flat-then-linear law of §6.3 (``t_0 + s max(0, N - N_0)``,
  :func:`mqnc.cost.knee_fit`).
- :func:`congestion_plot` Fig. 7: ``bench="congestion"``, ``x`` = K concurrent flows, variant
  ``"probe"`` for the probe and the route round trip at ``extra["m_q"]`` (or a variant
  ``"M_q=256"``) otherwise. Model: :func:`mqnc.cost.fit_congestion` from the idle and the
  fully subscribed point at the largest M_q, predicting the other batches; one engine on one
  machine per figure (``transport=`` / ``device=`` choose when the records hold several).
- :func:`bench_plot`: any benchmark (merge, copy, mla, splice, predicate, ...): p50 against
  ``x`` per variant, p20-p80 shaded, for one device (:func:`draw_per_device` draws one panel
  per device: CPU and GPU timings never share an axis), device and backend in the title.

Results figures (whole figures, drawn into a ``Figure``; :func:`try_draw_figure`):

- :func:`roofline` (:mod:`mqnc.plots.roofline`): the kernels on the H200's roofline, achieved
  TFLOP/s and TB/s per recorded shape against the spec, the measured ceilings and the anchors'
  published points;
- :func:`route_vs_paper` (:mod:`mqnc.plots.paper_compare`): measured route, fetch and local
  costs against the paper's numbers and the cost model, one panel per device and transport.

``python -m mqnc.plots.docs_figures --out docs`` redraws the figures committed in ``docs/``
(docs/figures.md says what each shows). Every figure's log axes carry plain tick labels
(:func:`readable_log_ticks`), its legend fits (:func:`fit_legend`: outside the axes when long)
and its title wraps to the axes (:func:`wrapped_title`).
"""

from mqnc.measure.results_file import read_results, results_path
from mqnc.plots._common import (
    COLORS,
    COMMANDS,
    TRANSPORT_BENCHES,
    MissingData,
    benches,
    compact_number,
    compact_png,
    draw_per_device,
    fit_legend,
    readable_log_ticks,
    save,
    try_draw,
    try_draw_figure,
    wrapped_title,
)
from mqnc.plots.cost_figures import (
    bw_sweep_plot,
    cost_vs_chunk,
    decision_map,
    payload_bars,
    wire_saving_map,
)
from mqnc.plots.measured import (
    bench_plot,
    congestion_plot,
    gather_vs_route,
    holder_compute,
    route_round_trip,
)
from mqnc.plots.paper_compare import PAPER_POINTS, route_vs_paper
from mqnc.plots.roofline import ANCHORS, SPECS, kernel_points, roofline

__all__ = [
    "COLORS",
    "MissingData",
    "COMMANDS",
    "TRANSPORT_BENCHES",
    "results_path",
    "read_results",
    "benches",
    "save",
    "compact_png",
    "try_draw",
    "try_draw_figure",
    "draw_per_device",
    "compact_number",
    "readable_log_ticks",
    "fit_legend",
    "wrapped_title",
    "roofline",
    "kernel_points",
    "SPECS",
    "ANCHORS",
    "route_vs_paper",
    "PAPER_POINTS",
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
