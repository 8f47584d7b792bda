"""Speed of the closed-form predicate (its targets, perf/speed_targets.py: a scalar decision in
<= 20 us, a 1000 x 1000 ``M_q x c_t`` crossover grid in <= 0.2 s, on one CPU core).

Pure CPU work, so it is timed with ``time.perf_counter_ns`` whatever the machine (CUDA events
would time an idle stream); ``--pin`` restricts the process to one core first. Records
``bench="predicate"`` with variants ``scalar`` (x = 1 decision) and ``grid`` (x = grid points),
p20/p50/p80 in us, backend ``python`` / ``numpy``, the CPU model in ``extra``.

    python -m perf.bench_predicate --quick [--grid 1000] [--pin] [--check]

plus the flags every benchmark takes (``--quick --reps --warmup --out FILE | --record --check``,
:mod:`mqnc.measure.options`); ``--check`` exits 1 when a target is missed
(``perf/speed_targets.py``).
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np

from mqnc.cost import MachineProfile, Request, crossover_map, decide, get_fabric
from mqnc.measure import bench_parser, finish, parse_bench_args, positive_int, record
from mqnc.model import get_preset
from perf.speed_targets import TARGETS


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _time(fn, reps: int, warmup: int) -> tuple[float, float, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    p20, p50, p80 = np.percentile(samples, [20, 50, 80])
    return float(p20), float(p50), float(p80)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(
        __doc__,
        reps="20000 scalar decisions and 20 grids; --quick 2000 and 5",
        warmup="200 decisions, 1 grid",
    )
    ap.add_argument(
        "--grid", type=positive_int, default=1000, help="points per grid axis (default 1000)"
    )
    ap.add_argument("--pin", action="store_true", help="run on one CPU core (sched_setaffinity)")
    args = parse_bench_args(ap, argv)
    if args.pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    g, f = get_preset("deepseek-v2-lite"), get_fabric("h100-ibgda")
    profile, request = MachineProfile(f), Request(256, 2048)
    m_axis = np.geomspace(1, 8192, args.grid)
    c_axis = np.geomspace(16, 8192, args.grid)

    scalar = _time(
        lambda: decide(g, profile, request),
        reps=args.reps or (2000 if args.quick else 20000),
        warmup=200 if args.warmup is None else args.warmup,
    )
    grid = _time(
        lambda: crossover_map(g, profile, m_axis, c_axis),
        reps=args.reps or (5 if args.quick else 20),
        warmup=1 if args.warmup is None else args.warmup,
    )
    extra = dict(cpu=_cpu_model(), pinned=bool(args.pin), model=g.name, fabric=f.name)
    print(
        f"scalar decide:        p20 {scalar[0]:8.2f}  p50 {scalar[1]:8.2f}  p80 {scalar[2]:8.2f} us"
    )
    print(
        f"{args.grid}x{args.grid} grid:  p20 {grid[0] / 1e3:8.1f}  p50 {grid[1] / 1e3:8.1f}  "
        f"p80 {grid[2] / 1e3:8.1f} ms"
    )
    record(
        "predicate",
        "scalar",
        1,
        scalar,
        x_name="decisions",
        backend="python",
        extra=extra,
        path=args.out,
    )
    record(
        "predicate",
        "grid",
        args.grid * args.grid,
        grid,
        x_name="grid points",
        backend="numpy",
        extra=dict(extra, shape=[args.grid, args.grid]),
        path=args.out,
    )
    return finish(args, TARGETS)


if __name__ == "__main__":
    raise SystemExit(main())
