"""``mqnc predict | crossover | presets``: the cost model and predicate from the shell.

- ``mqnc predict``: one (chunk, request) decision with every term (§5.1); ``--json`` for
  machines.
- ``mqnc crossover --out DIR``: the ``M_q x c_t`` wire-byte map of Fig. 3(b), the same grid on
  total cost, and the bandwidth sweep of Fig. 6(a), each as CSV (and PNG unless ``--no-png``).
- ``mqnc presets``: the model geometries and fabric profiles known by name.

Pure Python + numpy; matplotlib is imported only when ``crossover`` draws its PNGs.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import os

import numpy as np

from mqnc import plots
from mqnc.cost import (
    FABRICS,
    HOST_PAPER,
    PRIMITIVES,
    Congestion,
    Request,
    SpliceProfile,
    bw_sweep,
    crossover_map,
    decide,
    load_profile,
    t_local_range,
    wire_byte_saving,
)
from mqnc.measure.options import (
    hidden_alias,
    model_arg,
    nonnegative_float,
    positive_float,
    positive_int,
)
from mqnc.model.geometry import PRESETS

__all__ = ["register"]

log = logging.getLogger(__name__)


def _fabric_arg(text: str):
    """``--fabric``: a preset name or a profile JSON (any version :func:`load_profile` reads),
    as a :class:`~mqnc.cost.MachineProfile`."""
    try:
        return load_profile(text)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        why = str(exc)
        raise argparse.ArgumentTypeError(why if text in why else f"{text}: {why}") from None


# The options ``predict`` and ``crossover`` share: (flags, argparse keywords), in help order.
_MODEL = dict(
    type=model_arg,
    default="deepseek-v2-lite",
    metavar="NAME|CONFIG",
    help="model preset (mqnc presets) or a Hugging Face config.json (default deepseek-v2-lite)",
)
_ROUTE_OPTIONS = [
    ("--model", _MODEL),
    (
        "--fabric",
        dict(
            type=_fabric_arg,
            default="h100-ibgda",
            metavar="NAME|JSON",
            help="fabric preset (mqnc presets) or profile JSON (default h100-ibgda)",
        ),
    ),
    (
        "--c-us",
        dict(
            type=positive_float,
            help="re-prefill cost per token-layer in us (default 1.0; band 0.5-1.5)",
        ),
    ),
    (
        "--t-compute-us",
        dict(type=nonnegative_float, help="holder partial attention, us (default 15, §6.3)"),
    ),
    ("--t-merge-us", dict(type=nonnegative_float, help="merge, us (default 25)")),
    (
        "--splice-ms",
        dict(type=nonnegative_float, help="a flat splice in ms instead of the paper's profile"),
    ),
    (
        "--splice-from",
        dict(
            metavar="RESULTS",
            help="splice profile from a results file (bench 'splice', the records of --kv-dtype)",
        ),
    ),
    (
        "--splice-variant",
        dict(help="with --splice-from: the records of this variant (needed when several)"),
    ),
    (
        "--splice-device",
        dict(help="with --splice-from: the records of this device (needed when several)"),
    ),
    (
        "--splice-backend",
        dict(help="with --splice-from: the records of this backend (needed when several)"),
    ),
    (
        "--no-splice",
        dict(action="store_true", help="no splice (a true prefix at its cached position, §6.3)"),
    ),
    (
        "--topk",
        dict(
            type=positive_int,
            help="selection budget: fetch becomes a gather over --holders (§5.4)",
        ),
    ),
    ("--holders", dict(type=positive_int, default=1, help="holders the selection spans (1)")),
    (
        "--congestion-bw",
        dict(
            type=positive_float,
            metavar="FACTOR",
            help="multiply effective bandwidth by FACTOR > 0 (§8 (i))",
        ),
    ),
    (
        "--congestion-probe-us",
        dict(type=nonnegative_float, help="add this queueing to the probe, us (§8 (ii))"),
    ),
    (
        "--congestion-route-only",
        dict(action="store_true", help="congestion slows route's link but not fetch's pull"),
    ),
    (
        "--host-overhead",
        dict(action="store_true", help="add the paper's client host overhead to route (§5.3)"),
    ),
    ("--tp", dict(type=positive_int, default=1, help="tensor-parallel rank pairs (§8; 1)")),
    (
        "--kv-dtype",
        dict(
            choices=("bf16", "fp8"),
            default="bf16",
            help="the holders' cache format, b_KV of every fetch term: bf16 (the paper's, 1152 B "
            "per token-layer at 576 dims) or fp8 (DeepSeek-V3.2's 656 B entry, docs/fp8-cache.md)",
        ),
    ),
    (
        "--round-trips",
        dict(
            type=positive_int,
            default=1,
            help="sequential route round trips (L: per-layer routing; 1)",
        ),
    ),
]


def _route_options(p: argparse.ArgumentParser) -> None:
    for flag, kwargs in _ROUTE_OPTIONS:
        p.add_argument(flag, **kwargs)


def _resolve(args):
    """``(geometry, profile, request)`` from the options: the profile is ``--fabric``'s with
    the compute options applied (splice, c, compute, merge, host), the request ``--m-q`` /
    ``--c-t`` with the rest."""
    geometry, profile = args.model, args.fabric
    if args.kv_dtype == "fp8":
        try:
            geometry = geometry.replace(cache_dtype="fp8_e4m3")
        except ValueError as exc:
            raise ValueError(f"--kv-dtype fp8: {exc}") from None
    log.info(
        "model %s (q+p %d B per row), fabric %s", geometry.name, geometry.qp_row_bytes, profile.name
    )
    _check_flags(args)
    own = {}
    splice = "splice_fp8" if args.kv_dtype == "fp8" else "splice"  # (the cache's own splice)
    if args.splice_ms is not None:
        own[splice] = SpliceProfile.flat(args.splice_ms * 1e3)
    elif args.splice_from is not None:
        own[splice] = SpliceProfile.from_results(
            args.splice_from,
            variant=args.splice_variant,
            device=args.splice_device,
            backend=args.splice_backend,
            kv_dtype=args.kv_dtype,
        )
    if args.host_overhead:
        own["host"] = HOST_PAPER
    for name in ("c_us", "t_compute_us", "t_merge_us"):
        if getattr(args, name) is not None:
            own[name] = getattr(args, name)
    congestion = None
    if args.congestion_bw is not None or args.congestion_probe_us is not None:
        congestion = Congestion(
            bw_factor=1.0 if args.congestion_bw is None else args.congestion_bw,
            probe_add_us=args.congestion_probe_us or 0.0,
            on_fetch=not args.congestion_route_only,
        )
    request = Request(
        args.m_q,
        args.c_t,
        topk=args.topk,
        holders=args.holders,
        moved=not args.no_splice,
        tp=args.tp,
        round_trips=args.round_trips,
        congestion=congestion,
        allow=tuple(getattr(args, "allow", PRIMITIVES)),
    )
    return geometry, profile.replace(**own) if own else profile, request


def _check_flags(args) -> None:
    """At most one splice option; a flag that only qualifies another is an error without it,
    not silently ignored."""
    if (
        sum(
            x is not None and x is not False
            for x in (args.splice_ms, args.splice_from, args.no_splice or None)
        )
        > 1
    ):
        raise ValueError("splice: expected at most one of --splice-ms, --splice-from, --no-splice")
    for flag, given, needs, present in (
        ("--splice-variant", args.splice_variant, "--splice-from", args.splice_from),
        ("--splice-device", args.splice_device, "--splice-from", args.splice_from),
        ("--splice-backend", args.splice_backend, "--splice-from", args.splice_from),
        ("--holders", args.holders != 1, "--topk (it is the selection's fan-out)", args.topk),
        (
            "--congestion-route-only",
            args.congestion_route_only,
            "--congestion-bw or --congestion-probe-us",
            args.congestion_bw is not None or args.congestion_probe_us is not None,
        ),
    ):
        if given and not present:
            raise ValueError(f"{flag}: only means something with {needs}")


# ---- predict -----------------------------------------------------------------------------------


def _predict(args) -> int:
    geometry, profile, request = _resolve(args)
    d = decide(geometry, profile, request)
    print(json.dumps(d.to_dict(), indent=2) if args.json else d.explain())
    return 0


# ---- crossover ---------------------------------------------------------------------------------


def _logspace(lo: float, hi: float, n: int, flags: str) -> np.ndarray:
    if not 0 < lo < hi:
        raise ValueError(f"{flags}: expected 0 < min < max, got {lo:g}, {hi:g}")
    if n < 2:
        raise ValueError(f"--points: expected >= 2, got {n}")
    return np.geomspace(lo, hi, n)


def _write_csv(path: str, header: list[str], rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def _crossover(args) -> int:
    geometry, profile, request = _resolve(args)
    m_axis = _logspace(args.m_q_min, args.m_q_max, args.points, "--m-q-min/--m-q-max")
    c_axis = _logspace(args.c_t_min, args.c_t_max, args.points, "--c-t-min/--c-t-max")
    bw_axis = _logspace(args.bw_min, args.bw_max, args.points, "--bw-min/--bw-max")
    os.makedirs(args.out, exist_ok=True)
    grid = crossover_map(geometry, profile, m_axis, c_axis, request=request)
    sweep = bw_sweep(geometry, profile, bw_axis, m_q=args.m_q, c_t=args.c_t, request=request)
    written = [
        _wire_csv(args.out, geometry, m_axis, c_axis),
        _cost_csv(args.out, grid, m_axis, c_axis),
        _sweep_csv(args.out, sweep, bw_axis, t_local_range(geometry, args.c_t)),
    ]
    if not args.no_png:
        written += _plots(args, geometry, profile, m_axis, c_axis, bw_axis, request)
    for p in written:
        print(p)
    return 0


def _wire_csv(out: str, geometry, m_axis, c_axis) -> str:
    """Fig. 3(b): route's bytes against one layer's chunk over the ``(M_q, c_t)`` grid."""
    saving = wire_byte_saving(geometry, m_axis[:, None], c_axis[None, :])
    path = os.path.join(out, "fig3b_wire_bytes.csv")
    header = ["m_q", "c_t", "route_bytes_per_layer", "chunk_bytes_per_layer", "route_saving_pct"]
    q_p, b_kv = geometry.qp_row_bytes, geometry.kv_bytes_per_token_layer
    rows = (
        (m, c, m * q_p, c * b_kv, 100 * saving[i, j])
        for i, m in enumerate(m_axis)
        for j, c in enumerate(c_axis)
    )
    _write_csv(path, header, rows)
    return path


def _cost_csv(out: str, grid, m_axis, c_axis) -> str:
    """The same grid on total cost: every primitive, the choice and its margin."""
    path = os.path.join(out, "crossover_cost.csv")
    header = ["m_q", "c_t", "route_us", "fetch_us", "local_us", "primitive", "margin_us"]
    rows = (
        (
            m,
            c,
            grid.route_us[i, j],
            grid.fetch_us[i, j],
            grid.local_us[i, j],
            PRIMITIVES[grid.choice[i, j]],
            grid.margin_us[i, j],
        )
        for i, m in enumerate(m_axis)
        for j, c in enumerate(c_axis)
    )
    _write_csv(path, header, rows)
    return path


def _sweep_csv(out: str, sweep, bw_axis, local_band) -> str:
    """Fig. 6(a): every primitive against the effective bandwidth, local's band beside."""
    path = os.path.join(out, "fig6a_bw_sweep.csv")
    lo, hi = local_band
    header = ["bw_gbps", "route_us", "fetch_us", "local_us", "local_low_us", "local_high_us"]
    rows = (
        (
            b,
            sweep.route_us[i],
            sweep.fetch_us[i],
            sweep.local_us[i],
            lo,
            hi,
            PRIMITIVES[sweep.choice[i]],
        )
        for i, b in enumerate(bw_axis)
    )
    _write_csv(path, [*header, "primitive"], rows)
    return path


def _plots(args, geometry, profile, m_axis, c_axis, bw_axis, request) -> list[str]:
    """The two PNGs, drawn by the same :mod:`mqnc.plots` functions the notebooks use."""
    import matplotlib  # here: an optional dependency (the notebooks extra), only for PNGs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    plots.wire_saving_map(axes[0], geometry, m_q_axis=m_axis, c_t_axis=c_axis)
    plots.decision_map(axes[1], geometry, profile, m_axis, c_axis, request=request)
    crossover = os.path.join(args.out, "fig3b_crossover.png")
    fig.savefig(crossover, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.2), constrained_layout=True)
    plots.bw_sweep_plot(
        ax, geometry, profile, bw_axis=bw_axis, m_q=args.m_q, c_t=args.c_t, request=request
    )
    sweep = os.path.join(args.out, "fig6a_bw_sweep.png")
    fig.savefig(sweep, dpi=120)
    plt.close(fig)
    return [crossover, sweep]


# ---- presets -----------------------------------------------------------------------------------


def _presets(args) -> int:
    models = PRESETS
    if args.json:
        print(
            json.dumps(
                {
                    "models": {
                        n: dict(
                            dataclasses.asdict(g),
                            d_qk=g.d_qk,
                            d_v=g.d_v,
                            qp_row_bytes=g.qp_row_bytes,
                            kv_bytes_per_token_layer=g.kv_bytes_per_token_layer,
                        )
                        for n, g in models.items()
                    },
                    "fabrics": {n: f.to_dict() for n, f in FABRICS.items()},
                },
                indent=2,
            )
        )
        return 0
    print("models")
    print(
        f"  {'name':<20} {'d_qk':>5} {'d_v':>4} {'heads':>5} {'L':>3} {'q+p (B)':>8} "
        f"{'b_KV (B)':>8} {'top-k':>6}"
    )
    for n, g in models.items():
        print(
            f"  {n:<20} {g.d_qk:>5} {g.d_v:>4} {g.heads:>5} {g.layers:>3} {g.qp_row_bytes:>8} "
            f"{g.kv_bytes_per_token_layer:>8} {g.topk if g.topk else '-':>6}"
        )
    print("fabrics (paper Table 2)")
    print(
        f"  {'name':<20} {'T_probe':>8} {'BW':>6} {'peak':>6} {'turn':>5} {'MAPE>=512':>9} "
        f"{'full':>5}  description"
    )
    for n, f in FABRICS.items():
        peak = f"{f.link_peak_gbps:6.0f}" if f.link_peak_gbps else f"{'-':>6}"
        print(
            f"  {n:<20} {f.t_probe_us:8.1f} {f.bw_gbps:6.1f} {peak} {f.turnaround_us:5.1f} "
            f"{_pct(f.mape_amortised):>9} {_pct(f.mape_full):>5}  {f.description}"
        )
    print("  (T_probe, turnaround in us; BW, peak in GB/s)")
    return 0


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _primitives(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or any(v not in PRIMITIVES for v in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated names out of {','.join(PRIMITIVES)}, each once, got {text!r}"
        )
    return names


def register(subparsers) -> None:
    """Add ``predict``, ``crossover`` and ``presets`` to the ``mqnc`` command."""
    _register_predict(subparsers)
    _register_crossover(subparsers)
    p = subparsers.add_parser(
        "presets",
        help="list model geometries and fabric profiles",
        description="List the model geometries (published Hugging Face configs) and the "
        "fabric profiles (the paper's Table 2) that --model and --fabric take by name.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_presets)


def _register_predict(subparsers) -> None:
    p = subparsers.add_parser(
        "predict",
        help="route / fetch / local decision with every term",
        description="Price route, fetch and local for one (chunk, request) with the cost "
        "model of §4 and pick the cheapest (§5.1); every term is printed.",
    )
    p.add_argument(
        "--m-q", type=positive_float, default=256.0, help="routed query rows M_q (default 256)"
    )
    hidden_alias(p, "--mq", "m_q", type=positive_float)
    p.add_argument(
        "--c-t", type=positive_float, default=2048.0, help="chunk tokens c_t (default 2048)"
    )
    hidden_alias(p, "--ct", "c_t", type=positive_float)
    p.add_argument(
        "--allow",
        type=_primitives,
        default=list(PRIMITIVES),
        metavar="NAMES",
        help="comma-separated primitives available (default route,fetch,local)",
    )
    _route_options(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_predict)


def _register_crossover(subparsers) -> None:
    p = subparsers.add_parser(
        "crossover",
        help="write the Fig. 3(b) map and Fig. 6(a) sweep",
        description="Write the M_q x c_t wire-byte map of Fig. 3(b), the same grid on total "
        "cost, and the bandwidth sweep of Fig. 6(a), as CSV and PNG files in --out.",
    )
    p.add_argument("--out", required=True, help="output folder for the CSV and PNG files")
    p.add_argument("--points", type=positive_int, default=64, help="points per axis (default 64)")
    for flag, old, default, what in (
        ("--m-q-min", "--mq-min", 1.0, "smallest M_q"),
        ("--m-q-max", "--mq-max", 8192.0, "largest M_q"),
        ("--c-t-min", "--ct-min", 16.0, "smallest c_t"),
        ("--c-t-max", "--ct-max", 8192.0, "largest c_t"),
    ):
        dest = flag[2:].replace("-", "_")
        p.add_argument(flag, type=positive_float, default=default, help=f"{what} ({default:g})")
        hidden_alias(p, old, dest, type=positive_float)
    p.add_argument("--bw-min", type=positive_float, default=0.2, help="GB/s (default 0.2)")
    p.add_argument("--bw-max", type=positive_float, default=1000.0, help="GB/s (default 1000)")
    p.add_argument(
        "--m-q", type=positive_float, default=256.0, help="M_q of the bandwidth sweep (256)"
    )
    hidden_alias(p, "--mq", "m_q", type=positive_float)
    p.add_argument(
        "--c-t", type=positive_float, default=2048.0, help="c_t of the bandwidth sweep (2048)"
    )
    hidden_alias(p, "--ct", "c_t", type=positive_float)
    p.add_argument("--no-png", action="store_true", help="CSV only (no matplotlib)")
    _route_options(p)
    p.set_defaults(func=_crossover)
