"""The device route timed: the host-free probe round trip, the route over M_q (H 16, c_t 2048;
and H 128), and N requesters at once (the fan-in elbow, §6.3's Fig. 4(b) with the transport in
it), all through the resident holder kernel (``mqnc.serving.device_holder``).

``python -m perf.bench_device_route [--out FILE | --record] [--reps N] [--dry-run] [--check]``
(the shared benchmark flags, :func:`mqnc.measure.options.bench_parser`; ``--quick`` is the dry
run's small sweep; ``--check`` exits with status 1 when, on a GPU, the probe's p50 is over
5 us or the route's at M_q 1 (H 16) over 20 us: the goals of ``docs/device-route.md``).

What is timed (a GPU): the requester's step for ``--layers`` layers, each layer one put
(``route.put``) and one wait-then-merge (``route.wait_merge``), captured once in a CUDA graph and
replayed: a replay is the only host call of a step, so ``extra.host_calls_per_layer`` is
``1 / layers`` (counted: graph replays over routed layers) and ``extra.host_free`` is true.
The holder is the two persistent kernels on their own streams (``ctas`` CTAs each), started
once. Each sample is ``--inner`` replays between two CUDA events, divided by the round trips
in them; p20 / p50 / p80 of ``--reps`` samples. Records: ``bench="probe"`` (a header-only
round trip, ``x`` 1), ``bench="route"`` (``x`` = M_q = tokens x heads; ``extra.heads``,
``extra.c_t``, ``extra.requesters``), ``transport`` = ``device-<backend>``. Every routed answer
is checked against fp64 on its first step within the bf16 bound (``extra.vs_fp64``: the worst
absolute error; a miss fails the run).

``--dry-run`` (a CPU machine): the same steps, tiny (c_t 128, 1 layer, M_q 16 at 16 heads with
N 1 and 2, M_q 128 at 128 heads), eager and interpreted, the holder one-shot between the puts
and the merges (no graph: every launch counted as a host call, ``extra.host_free`` false); its
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
from mqnc.model import PRESETS, RopeSpec
from mqnc.reference import partial_attention_reference
from mqnc.serving.device_holder import DeviceHolder
from mqnc.testing import TOLERANCES, assert_close
from mqnc.transport.device_route import LocalBackend, RouteClient, RouteLayout, allocate

CHUNK = 0


TARGETS_US = {"probe": 5.0, "route": 20.0}  # p50 goals on a GPU: probe; route at M_q 1, H 16


def _parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__, reps=20, warmup=1)
    ap.add_argument("--inner", type=int, default=20, help="graph replays per sample")
    ap.add_argument("--layers", type=int, default=4, help="routed layers per captured step")
    ap.add_argument("--ctas", type=int, default=8, help="CTAs per holder kernel")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, interpreted (a CPU)")
    ap.add_argument("--commit", default=None, help="the commit the records name")
    return ap


class Bench:
    """One holder (chunk of ``c_t`` tokens, ``heads`` heads) and one client on ``slots``."""

    def __init__(self, heads, c_t, slots, max_batch, layers, ctas, device, dry) -> None:
        geom = PRESETS["deepseek-v2-lite"].replace(layers=layers, heads=heads)
        self.scale = RopeSpec.from_preset("deepseek-v2-lite").softmax_scale
        self.geom, self.dry, self.device = geom, dry, torch.device(device)
        layout = RouteLayout(slots, max_batch, heads, max_topk=64)
        self.buf = allocate(layout, LocalBackend(device))
        blocks = -(-c_t // 64) + 1
        self.holder = DeviceHolder(self.buf, geom, softmax_scale=self.scale, num_blocks=blocks,
                                   ctas=ctas, max_chunks=1)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        self.kv = (0.5 * torch.randn(layers, c_t, geom.d_qk, generator=g)).to(torch.bfloat16)
        self.holder.add_chunk(CHUNK, self.kv.to(device))
        # bounds, never hangs: a reply waited for ~1-4 s of polls; the holder returns after
        # ~2**22 empty passes over its slots (tens of seconds idle) if the stop word is lost
        self.client = RouteClient(self.buf, LocalBackend(device), spins=1 << 22)
        self.routed = 0
        if not dry:
            self.holder.start(max_idle=1 << 22)

    def step(self, B, heads, requesters, probe=False, q=None):
        """Every layer: each requester's put, (dry: the one-shot holder), each merge."""
        outs = []
        for layer in range(self.geom.layers):
            for r in range(requesters):
                self.client.put(r, q[r], layer=layer, chunk=CHUNK, probe=probe)
            if self.dry:
                self.holder.serve_once()
            for r in range(requesters):
                outs.append(self.client.merge([r], 1 if probe else B, 1 if probe else heads))
            self.routed += requesters
        return outs

    def close(self) -> None:
        if not self.dry:
            self.holder.stop()


def _check(bench: Bench, q, outs, B, heads, requesters) -> float:
    """The routed answers against fp64 within the bf16 bound (an ``AssertionError`` if not);
    returns the worst absolute error."""
    tol = TOLERANCES[("mla", "bfloat16")]
    worst = 0.0
    for i, (o, _, status) in enumerate(outs):
        assert status.tolist() == [0], f"route failed: status {status.tolist()}"
        layer, r = divmod(i, requesters)
        keys = bench.kv[layer].to(bench.device).double()  # fp64 on the device: seconds saved
        valid = torch.ones(B, keys.shape[0], dtype=torch.bool, device=bench.device)
        o_ref, _ = partial_attention_reference(q[r], keys, valid, bench.scale)
        worst = max(worst, assert_close(o.cpu(), o_ref, tol, name="routed o").max_abs)
    return worst


def _time(bench: Bench, fn, reps: int, inner: int, trips: int, warmup: int = 1) -> tuple:
    """p20/p50/p80 microseconds per round trip: a CUDA graph of ``fn`` replayed ``inner``
    times per sample (GPU), or ``fn`` eager once per sample (dry run)."""
    samples = []
    if bench.dry:  # host calls counted as made: every launch
        before = bench.client.launches + bench.holder.launches
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6 / trips)
        return _pct(samples), trips * reps, bench.client.launches + bench.holder.launches - before
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()  # warm (compiled, the holder answering)
    side.synchronize()  # (a stream, never the device: the holder kernels never finish)
    # torch.cuda.graph synchronizes the device when it begins: the resident holder stops for
    # the capture (which runs nothing) and starts again before the replays
    bench.holder.stop()
    with torch.cuda.graph(graph):
        fn()
    bench.holder.start(max_idle=1 << 22)
    replays = 0
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            graph.replay()
        b.record()
        b.synchronize()
        replays += inner
        samples.append(a.elapsed_time(b) * 1e3 / (inner * trips))
    return _pct(samples), trips * reps * inner, replays


def _pct(xs) -> tuple:
    t = torch.tensor(xs, dtype=torch.float64)
    return tuple(float(torch.quantile(t, p)) for p in (0.2, 0.5, 0.8))


def _record(out, bench_name, x, pct, bench: Bench, routed, calls, extra, commit) -> dict:
    rec = dict(
        bench=bench_name, variant="device-route", x=x, x_name="M_q" if x > 1 else "bytes",
        p20=pct[0], p50=pct[1], p80=pct[2], unit="us", transport="device-local",
        backend="triton", device=_device_name(bench.device), commit=commit,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        extra=dict(host_free=not bench.dry, host_calls_per_layer=calls / routed, **extra),
    )  # fmt: skip
    line = json.dumps(rec)
    print(line)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    return rec


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"


def _sweep(bench: Bench, heads, points, args, commit, c_t) -> None:
    """Route records at ``points`` (tokens, requesters, query heads); the first step of each
    checked against fp64. ``extra.heads`` is the holder's, ``extra.query_heads`` the rows'."""
    for B, n, hq in points:
        q = [
            (0.5 * torch.randn(B, hq, 576, generator=torch.Generator().manual_seed(r)))
            .to(torch.bfloat16)
            .to(bench.device)
            for r in range(n)
        ]
        worst = _check(bench, q, bench.step(B, hq, n, q=q), B, hq, n)
        trips = bench.geom.layers * n
        step = functools.partial(bench.step, B, hq, n, q=q)
        pct, routed, calls = _time(bench, step, args.reps, args.inner, trips, args.warmup)
        extra = dict(heads=heads, query_heads=hq, c_t=c_t, requesters=n, tokens=B,
                     vs_fp64=worst, layers=bench.geom.layers, ctas=args.ctas)  # fmt: skip
        _record(args.out, "route", B * hq, pct, bench, routed, calls, extra, commit)


def main(argv=None) -> int:
    args = parse_bench_args(_parser(), argv)
    dry = args.dry_run or args.quick
    if not dry and not torch.cuda.is_available():
        print("bench_device_route: needs a GPU (or --dry-run)", file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    if dry:
        args.reps, args.inner, args.layers, args.ctas = 1, 1, 1, 2
    commit = args.commit or "unknown"
    c_t = 128 if dry else 2048
    # (tokens, requesters, query heads): M_q 1 (one head), 16..1024, then N requesters at once
    sizes = [(1, 1, 16)] if dry else [(1, 1, 1)] + [(2**i, 1, 16) for i in range(7)]
    fan_in = [(1, 2, 16)] if dry else [(1, n, 16) for n in (2, 4, 8, 16)]
    wide = [(1, 1, 128)] if dry else [(1, 1, 128), (8, 1, 128)]
    for heads, max_b, points in ((16, 64, sizes + fan_in), (128, 8, wide)):
        bench = Bench(heads, c_t, 16 if not dry else 2, max_b if not dry else 1, args.layers,
                      args.ctas, device, dry)  # fmt: skip
        try:
            if heads == 16:
                q = [torch.zeros(1, 1, 576, dtype=torch.bfloat16, device=device)]
                step = functools.partial(bench.step, 1, 1, 1, True, q)
                pct, routed, calls = _time(
                    bench, step, args.reps, args.inner, bench.geom.layers, args.warmup
                )
                extra = dict(heads=heads, layers=bench.geom.layers, ctas=args.ctas)
                _record(args.out, "probe", 1, pct, bench, routed, calls, extra, commit)
            _sweep(bench, heads, points, args, commit, c_t)
        finally:
            bench.close()
    return _missed(args.out, args.results_lines) if args.check and not dry else 0


def _missed(out: str, skip: int) -> int:
    """``--check``: 1 when this run's probe or M_q 1 (H 16) route p50 misses its goal."""
    missed = []
    for rec in read_jsonl(out)[skip:]:
        extra = rec.get("extra") or {}
        if rec["bench"] == "route" and (rec["x"] != 1 or extra.get("heads") != 16):
            continue
        if rec["bench"] in TARGETS_US and rec["p50"] > TARGETS_US[rec["bench"]]:
            missed.append(f"{rec['bench']} p50 {rec['p50']:.2f} us > {TARGETS_US[rec['bench']]}")
    for line in missed:
        print(f"missed: {line}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
