"""The device route timed against the device fetch on one GPU: the host-free probe round trip,
the route over M_q at c_t 2048 and 8192 (H 16; and H 128), N requesters at once (the fan-in
elbow, §6.3's Fig. 4(b) with the transport in it), the holder's compute against the default
kernel at the same shape, and the fetch (pull and splice) of the same chunks: the measured
route / fetch crossover in M_q, and the predicate's from the profile fitted to these records
(``mqnc.cost.device_profile``).

``python -m perf.bench_device_route [--out FILE | --record] [--reps N] [--dry-run] [--check]
[--warm-jobs N]`` (the shared benchmark flags, :func:`mqnc.measure.options.bench_parser`;
``--quick`` is the dry run; ``--schedule resident`` times the resident holder kernels instead
of the pass; ``--warm-jobs N``: first compile the attention, splice and default-kernel
specialisations the run, the device-route tests and the demo launch, by ``N`` worker
processes sharing Triton's on-disk cache (the see-saw's take ~30 s each on the H200's host;
:func:`warm_specs`; the route's own kernels: ``python -m perf.warmup --ops route``);
``--check`` exits with status 1 when, on a GPU, a goal of :data:`TARGETS_US` is missed or a
measured crossover is more than 15% from the predicate's: docs/device-route.md).

What is timed (a GPU; ``mqnc.measure.route_rig``): each step is ``--layers`` layers captured
once in a CUDA graph and replayed between CUDA events, so ``extra.host_calls_per_layer`` is
graph replays over routed layers and ``extra.host_free`` is true. The holder is started once
(the pass's graph replayed by its thread; no resident sparse kernel). p20 / p50 / p80 of
``--reps`` samples of ``--inner`` replays. Records (``transport`` ``device-local``):

- ``bench="probe"``: a header-only round trip (``x`` 1);
- ``bench="route"``: ``x`` = M_q = tokens x heads, the round trip per routed layer
  (``extra.heads``, ``extra.c_t``, ``extra.requesters``, ``extra.vs_fp64``: every answer checked
  against fp64 first; a miss fails the run);
- ``bench="holder_attend"`` / ``bench="default_attend"``: the pass's attention alone (the
  holder's compute at M_q 1024) and ``mla_decode_partial`` at the unfolded shape (64 tokens x
  16 heads over the chunk), ``x`` = M_q;
- ``bench="fetch"``: ``x`` = c_t, the pull and splice of all layers per layer
  (``extra.pull_us``, ``extra.splice_us`` per layer, ``extra.vs_fp64`` of the spliced pool).

``--dry-run`` (a CPU machine): the same steps, tiny (c_t 128 and 256, 1 layer, M_q 16 at 16
heads with N 1 and 2, M_q 128 at 128 heads), eager and interpreted, the holder one-shot
between the puts and the merges (every launch a host call, ``extra.host_free`` false); its
records show the shapes, never a speed.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch

from mqnc.cost.results_reader import read_jsonl
from mqnc.measure.options import bench_parser, parse_bench_args
from mqnc.measure.route_rig import RouteRig, time_step

TARGETS_US = {
    # (bench, M_q or None for any, requesters): p50 goal, us (docs/device-route.md)
    ("probe", 1, 1): 5.0,
    ("route", 1, 1): 15.0,
    ("route", 16, 1): 15.0,
    ("route", 1024, 1): 40.0,
    ("route", 16, 16): 60.0,
}
"""p50 goals on a GPU, at H 16 and c_t 2048: probe, route at M_q 1, 16 and 1024, 16 requesters
of M_q 16 at once."""
ATTEND_RATIO = 1.5  # the holder's compute within 1.5x of the default kernel at the same shape
CROSSOVER_TOL = 0.15  # the measured route / fetch crossover within 15% of the predicate's


def _parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__, reps=20, warmup=1)
    ap.add_argument("--inner", type=int, default=20, help="graph replays per sample")
    ap.add_argument("--layers", type=int, default=4, help="routed layers per captured step")
    ap.add_argument("--ctas", type=int, default=8, help="CTAs per resident holder kernel")
    ap.add_argument("--schedule", choices=("pass", "resident"), default="pass",
                    help="the holder's dense schedule")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, interpreted (a CPU)")
    ap.add_argument("--warm-jobs", type=int, default=0,
                    help="compile first, by this many processes (0: no warm-up)")  # fmt: skip
    ap.add_argument("--commit", default=None, help="the commit the records name")
    return ap


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"


class _Records:
    def __init__(self, args, commit: str) -> None:
        self.args, self.commit = args, commit

    def write(self, bench_name: str, x, pct, rig: RouteRig, units, calls, **extra) -> dict:
        rec = dict(
            bench=bench_name, variant=f"device-route-{self.args.schedule}", x=x,
            x_name={"fetch": "c_t", "probe": "bytes"}.get(bench_name, "M_q"),
            p20=pct[0], p50=pct[1], p80=pct[2], unit="us", transport="device-local",
            backend="triton", device=_device_name(rig.device), commit=self.commit,
            date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            extra=dict(host_free=not rig.dry, host_calls_per_layer=calls / units,
                       layers=rig.geom.layers, schedule=self.args.schedule,
                       fold=rig.holder.fold, **extra),
        )  # fmt: skip
        line = json.dumps(rec)
        print(line, flush=True)
        if self.args.out:
            with open(self.args.out, "a") as f:
                f.write(line + "\n")
        return rec


def _rows(B: int, hq: int, n: int, device) -> list[torch.Tensor]:
    return [
        (0.5 * torch.randn(B, hq, 576, generator=torch.Generator().manual_seed(r)))
        .to(torch.bfloat16)
        .to(device)
        for r in range(n)
    ]


def _route_points(rig: RouteRig, points, rec: _Records, heads: int) -> None:
    """Route records at ``points`` (tokens, requesters, query heads); the first step of each
    checked against fp64. ``extra.heads`` is the holder's, ``extra.query_heads`` the rows'."""
    a = rec.args
    for B, n, hq in points:
        q = _rows(B, hq, n, rig.device)
        worst = rig.check_route(q, rig.route_step(B, hq, n, q), B, hq, n)
        step = functools.partial(rig.route_step, B, hq, n, q)
        pct, units, calls = time_step(rig, step, a.reps, a.inner, rig.geom.layers * n, a.warmup)
        rec.write("route", B * hq, pct, rig, units, calls, heads=heads, query_heads=hq,
                  c_t=rig.c_t, requesters=n, tokens=B, vs_fp64=worst, ctas=a.ctas,
                  num_splits=rig.holder.num_splits)  # fmt: skip


def _attend_points(rig: RouteRig, rec: _Records, B: int) -> None:
    """The holder's compute (the pass's attention, left as the last ``B``-token route set its
    lengths) and the default kernel at the unfolded shape, ``B`` tokens x 16 heads."""
    a = rec.args
    pct, units, calls = time_step(rig, rig.attend_step, a.reps, a.inner, 1, a.warmup)
    rec.write("holder_attend", B * 16, pct, rig, units, calls, heads=16, c_t=rig.c_t, tokens=B,
              num_splits=rig.holder.num_splits)  # fmt: skip
    q = _rows(B, 16, 1, rig.device)[0]
    pct, units, calls = time_step(rig, functools.partial(rig.default_step, q), a.reps, a.inner,
                                  1, a.warmup)  # fmt: skip
    rec.write("default_attend", B * 16, pct, rig, units, calls, heads=16, c_t=rig.c_t, tokens=B)


def _fetch_point(rig: RouteRig, rec: _Records) -> None:
    """The fetch of the rig's chunk (pull and splice, all layers), per layer; the pull and the
    splice alone beside it."""
    a = rec.args
    rig.fetch_step()
    worst = rig.check_fetch()
    L = rig.geom.layers
    pct, units, calls = time_step(rig, rig.fetch_step, a.reps, a.inner, L, a.warmup)
    parts = {}
    for name, fn in (("pull_us", rig.pull_step), ("splice_us", rig.splice_step)):
        parts[name] = time_step(rig, fn, a.reps, a.inner, L, a.warmup)[0][1]
    rec.write("fetch", rig.c_t, pct, rig, units, calls, heads=rig.geom.heads, c_t=rig.c_t,
              vs_fp64=worst, entry_bytes=rig.geom.d_qk * 2, **parts)  # fmt: skip


def main(argv=None) -> int:
    args = parse_bench_args(_parser(), argv)
    dry = args.dry_run or args.quick
    if not dry and not torch.cuda.is_available():
        print("bench_device_route: needs a GPU (or --dry-run)", file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    if dry:
        args.reps, args.inner, args.layers, args.ctas = 1, 1, 1, 2
    rec = _Records(args, args.commit or "unknown")
    if args.warm_jobs > 0 and not warm(args.warm_jobs, dry):
        return 1
    c_ts = (128, 256) if dry else (2048, 8192)
    # (tokens, requesters, query heads): M_q 1 (one head), 16..1024, then N requesters at once
    sizes = [(1, 1, 16)] if dry else [(1, 1, 1)] + [(2**i, 1, 16) for i in range(7)]
    fan_in = [(1, 2, 16)] if dry else [(1, n, 16) for n in (2, 4, 8, 16)]
    coarse = [(1, 1, 16)] if dry else [(1, 1, 1), (1, 1, 16), (4, 1, 16), (16, 1, 16),
                                        (64, 1, 16)]  # fmt: skip
    wide = [(1, 1, 128)] if dry else [(1, 1, 128), (8, 1, 128)]
    slots, max_b = (2, 1) if dry else (16, 64)
    rig_kw = dict(device=device, dry=dry, ctas=args.ctas, schedule=args.schedule)
    for c_t in c_ts:
        rig = RouteRig.random(16, c_t, slots, max_b, args.layers, **rig_kw)
        try:
            if c_t == c_ts[0]:
                q = [torch.zeros(1, 1, 576, dtype=torch.bfloat16, device=device)]
                step = functools.partial(rig.route_step, 1, 1, 1, q, True)
                pct, units, calls = time_step(rig, step, args.reps, args.inner, args.layers,
                                              args.warmup)  # fmt: skip
                rec.write("probe", 1, pct, rig, units, calls, heads=16, c_t=c_t, ctas=args.ctas)
                _route_points(rig, sizes, rec, 16)
                if args.schedule == "pass":
                    _attend_points(rig, rec, sizes[-1][0])
                _route_points(rig, fan_in, rec, 16)
            else:
                _route_points(rig, coarse, rec, 16)
            _fetch_point(rig, rec)
        finally:
            rig.close()
    rig = RouteRig.random(128, c_ts[0], slots, 1 if dry else 8, args.layers, **rig_kw)
    try:
        _route_points(rig, wide, rec, 128)
    finally:
        rig.close()
    return _missed(args.out, args.results_lines) if args.check and not dry else 0


def warm_specs(dry: bool) -> list[dict]:
    """What the run, ``correctness/test_device_route.py`` and ``mqnc demo --device-route``
    compile besides the route's own kernels (``python -m perf.warmup --ops route``), as data a
    worker process rebuilds: the pass's attention over 128-row folded rows at the run's, the
    tests' and the demo's shapes (split and not: the see-saw's two specialisations on an H200);
    the default kernel at the unfolded shape; the splice."""
    if dry:
        return [dict(kind="pass", G=1, c_t=128, splits=None)]
    specs = [dict(kind="pass", G=8, c_t=c_t, splits=None) for c_t in (512, 2048, 8192)]
    specs += [dict(kind="pass", G=2, c_t=200, splits=3), dict(kind="default", B=64, c_t=2048)]
    return specs + [dict(kind="splice", c_t=2048)]


def warm_one(spec: dict) -> tuple[str, float, str | None]:
    """Compile one spec of :func:`warm_specs` (a worker process): ``(what, seconds, error)``."""
    t0 = time.perf_counter()
    try:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        g = torch.Generator().manual_seed(0)
        if spec["kind"] in ("pass", "default"):
            from mqnc.triton_kernels import mla_decode_partial, plan_mla_decode

            n = -(-spec["c_t"] // 64)
            pool = (0.5 * torch.randn(n + 1, 64, 576, generator=g)).bfloat16().to(dev)
            rows, heads = (spec["G"], 128) if spec["kind"] == "pass" else (spec["B"], 16)
            q = torch.zeros(rows, heads, 576, dtype=torch.bfloat16, device=dev)
            table = torch.arange(n, dtype=torch.int32, device=dev)[None].repeat(rows, 1)
            lens = torch.full((rows,), spec["c_t"], dtype=torch.int32, device=dev)
            if spec["kind"] == "pass":
                plan = plan_mla_decode(q, pool, table, lens, softmax_scale=0.1,
                                       num_splits=spec["splits"])  # fmt: skip
                plan.run(q, pool, table, lens)
            else:
                mla_decode_partial(q, pool, table, lens, softmax_scale=0.1)
        else:
            from mqnc.model import RopeSpec
            from mqnc.triton_kernels import rope_splice

            chunk = torch.zeros(4, spec["c_t"], 576, dtype=torch.bfloat16, device=dev)
            pool = torch.zeros(4, spec["c_t"] // 64 + 1, 64, 576, dtype=torch.bfloat16,
                               device=dev)  # fmt: skip
            slots = torch.arange(spec["c_t"], dtype=torch.int64, device=dev)
            rope_splice(chunk, pool, slots, 7, RopeSpec.from_preset("deepseek-v2-lite"))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return str(spec), time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - reported per spec, the others go on
        return str(spec), time.perf_counter() - t0, f"{type(exc).__name__}: {str(exc)[:300]}"


def warm(jobs: int, dry: bool) -> bool:
    """Every spec of :func:`warm_specs` compiled by ``jobs`` worker processes sharing Triton's
    cache (in-process for the dry run); each printed; False if any failed."""
    from perf.bench_fastpath import warm_in_parallel

    return warm_in_parallel(warm_one, warm_specs(dry), 1 if dry else jobs, "specs")


def _missed(out: str, skip: int) -> int:
    """``--check``: 1 when this run misses a goal of :data:`TARGETS_US` (H 16, c_t 2048), the
    holder's compute is over :data:`ATTEND_RATIO` times the default kernel's, or a measured
    route / fetch crossover is more than :data:`CROSSOVER_TOL` from the predicate's; each miss
    named on stderr."""
    from mqnc.cost.device_profile import crossovers

    recs = read_jsonl(out)[skip:]
    missed = []
    for r in recs:
        extra = r.get("extra") or {}
        if extra.get("heads", 16) != 16 or extra.get("c_t", 2048) != 2048:
            continue
        key = (r["bench"], r["x"], extra.get("requesters", 1))
        if key in TARGETS_US and r["p50"] > TARGETS_US[key]:
            what = f"{r['bench']} M_q {r['x']}" + (f" x {key[2]}" if key[2] > 1 else "")
            missed.append(f"{what} p50 {r['p50']:.2f} us > {TARGETS_US[key]}")
    attend = {r["bench"]: r["p50"] for r in recs if r["bench"].endswith("_attend")}
    if len(attend) == 2 and attend["holder_attend"] > ATTEND_RATIO * attend["default_attend"]:
        missed.append(f"holder_attend p50 {attend['holder_attend']:.2f} us > {ATTEND_RATIO} x "
                      f"default_attend {attend['default_attend']:.2f} us")  # fmt: skip
    for c in crossovers(recs):
        print(f"crossover at c_t {c.c_t}: {c.describe()}")
        if not c.agrees(CROSSOVER_TOL):
            missed.append(f"crossover at c_t {c.c_t}: {c.describe()}")
    for line in missed:
        print(f"missed: {line}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
