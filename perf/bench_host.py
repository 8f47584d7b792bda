"""The host path against the machine's floors, in one interleaved run (§5.3: the software
around a route is part of its cost).

``python -m perf.bench_host [--transport loopback,gloo] [--no-kernel] [--breakdown | --launch]``
plus the flags every benchmark takes (``--quick --reps --warmup --out FILE | --record --check``,
:mod:`mqnc.measure.options`; ``--quick``: 20 repetitions, no real-kernel route). ``--launch``
times instead the host side of one kernel launch (:func:`launch`).

The paper's Python client added ~3.5 ms to every routed call against a 16 us fabric probe
(§5.3); this benchmark measures what this package's software adds, as ratios to floors
timed in the same run (every case once per repetition, in a fresh random order,
:func:`mqnc.measure.timing.interleaved_samples`), so that a shared machine's load falls on
floors and package alike:

floors (:mod:`mqnc.measure.floors`)
    ``cond``: a ``threading.Condition`` round trip between two threads (two hand-offs);
    ``cond_payload``: the same, each side copying M_q 256's bytes (the loopback bytes floor);
    ``socketpair``: 1 byte to a child process and back; ``gloo_1B``: a bare gloo send/recv
    round trip to a child process (receive always posted); ``gloo_payload``: the same with
    M_q 256's ROUTE out and PARTIAL back.
the package, per transport (:mod:`mqnc.measure.echo`, :mod:`mqnc.measure.holders`)
    ``echo_probe``, ``echo_route1``, ``echo_route256``: the echo fabric's probe and round trips
    of M_q 1 and 256 rows' bytes (the transport alone, what ``bench_route`` times);
    ``probe``: :meth:`Requester.probe` against a real :class:`Holder`; ``route1`` /
    ``route256``: :meth:`Requester.route` of M_q 1 (one head) and 256 (16 tokens x 16 heads)
    rows, the holder's kernel stubbed (:func:`mqnc.measure.holders.stub_attention`);
    ``route16_kernel``: M_q 16 through the real kernel (the Triton interpreter on a CPU) over
    a 64-token chunk; ``probe_ready``, ``route1_ready``, ``route256_ready``: the probe and the
    same routes against a :class:`~mqnc.measure.holders.ReadyHolder` (one reply per shape, no
    work per call: the requester's own path and the engine, whose ratios are the floors of the
    route goals whatever the holder does); ``holder4``: 4 requesters (threads of this process
    sharing one rank, one lane each) routing 5 x M_q 16 each to one holder (kernel stubbed):
    routes per second.
the machine's wake penalty (:func:`_wake_cases`)
    ``pack``: a route request of M_q 1 checked and packed; ``pack_twice``: two in a row (the
    second is warm); ``wake_pack``: one after a 150 us idle wait (``wake_only``: the wait
    alone). The ratio of the pack after the wait to the warm one says how much slower host
    work runs right after a wake, where every call's host work runs.

The goals (perf/speed_targets.py): loopback probe <= 3x ``cond``; gloo probe <= 2x ``gloo_1B``;
route1 <= 1.5x the probe; route256 <= 2x the probe plus the bytes at the floor's bandwidth
(``cond_payload - cond`` or ``gloo_payload - gloo_1B``). The routes less the echo round trips
of the same size give the cost model's host term (§5.3, :func:`mqnc.cost.fit_host`). Medians,
p90 and the ratios are printed and recorded (``bench="host"``: each case's p20/p50/p80 in us;
``bench="host_ratio"``: each ratio, ``unit`` ``"ratio"``, ``"routes/s"`` or ``"us"``), to the
git-ignored results file unless ``--out`` / ``--record`` say otherwise; ``--check`` holds the
ratios to the goals (``perf/speed_targets.py``). ``--breakdown`` instead times each stage of a call
(pack, hand-off, parse, holder work, reply) from the stamps of :mod:`mqnc.base.stamps`
(requester and holder put and wait fused: "put" is ~0 and the put's cost is in the hand-off
that follows it); it records nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from perf.speed_targets import TARGETS

ROUTE_BIG = (16, 16)  # B, H: M_q 256
HOLDER4_CALLS = 5
IDLE_S = 150e-6  # the wake-penalty cases' idle wait: about a loopback probe's round trip


def _wake_cases(g, q) -> dict:
    """The machine's wake penalty: one piece of the package's host work (a route's request,
    checked and packed: M_q 1) timed warm (the second of two in a row: ``pack_twice`` less
    ``pack``) and right after this thread blocked for :data:`IDLE_S` (``wake_pack`` less the
    wait alone, ``wake_only``). A call's host work always runs right after a wake (the holder's
    after the request's, the requester's after the reply's); on the 2-core VM a pack ran ~3x
    slower there than warm (the first run after the wait; the next ones were warm again), a
    cost no floor pays (a ``Condition`` round trip does no work after its wakes)."""
    import threading

    from mqnc.serving.compute import kernel_ops
    from mqnc.serving.records import ChunkInfo
    from mqnc.serving.route import route_request

    info, ops, idle = ChunkInfo(1, 64, 0, (1,)), kernel_ops("torch"), threading.Event()

    def pack():
        route_request(info, q, 0, None, None, geometry=g, rope=None, ops=ops, crc=False)[1](1, 1)

    def wake_pack():
        idle.wait(IDLE_S)
        pack()

    def pack_twice():
        pack()
        pack()

    return {
        "pack": pack,
        "pack_twice": pack_twice,
        "wake_only": lambda: idle.wait(IDLE_S),
        "wake_pack": wake_pack,
    }


def _route(req, chunk, q):
    return lambda: req.route(chunk, q, 0)


def _cases(args, stack: contextlib.ExitStack, g) -> dict:
    """Every timed callable by name (floors first)."""
    import torch

    from mqnc.measure.echo import HDR, EchoFabric
    from mqnc.measure.floors import ConditionPingPong, GlooEcho, SocketPairEcho
    from mqnc.measure.holders import HolderFabric

    m_big = ROUTE_BIG[0] * ROUTE_BIG[1]
    out_b, back_b = 96 + m_big * g.q_row_bytes, 96 + m_big * g.p_row_bytes
    cases = {}
    cond = stack.enter_context(contextlib.closing(ConditionPingPong()))
    cases["cond"] = cond.round_trip
    condp = stack.enter_context(contextlib.closing(ConditionPingPong(out_b, back_b)))
    cases["cond_payload"] = condp.round_trip
    gen = torch.Generator().manual_seed(0)

    def q_of(b, h):
        return torch.randn(b, h, g.d_qk, generator=gen).to(torch.bfloat16)

    cases.update(_wake_cases(g, q_of(1, 1)))

    for t in args.transports:
        if t == "gloo":
            sp = stack.enter_context(contextlib.closing(SocketPairEcho()))
            cases["socketpair"] = sp.round_trip
            ge = stack.enter_context(contextlib.closing(GlooEcho(max(out_b, back_b))))
            cases["gloo_1B"] = ge.round_trip
            msg, n = ge.message(out_b, back_b)
            cases["gloo_payload"] = lambda ge=ge, msg=msg, n=n: ge.round_trip(msg, n)
        big = HDR + m_big * max(g.q_row_bytes, g.p_row_bytes)
        echo = stack.enter_context(EchoFabric(t, holders=1, slot_bytes=big))
        cases[f"{t}.echo_probe"] = echo.probe
        for m in (1, m_big):
            msg = echo.route_message(m, g.q_row_bytes, g.p_row_bytes)
            cases[f"{t}.echo_route{m}"] = lambda echo=echo, msg=msg: echo.round_trip(1, msg)
        fab = stack.enter_context(HolderFabric(t, max_rows=m_big, stub_kernel=True, model=g))
        req = fab.requester
        cases[f"{t}.probe"] = lambda req=req, r=fab.holder_ranks[0]: req.probe(r)
        cases[f"{t}.route1"] = _route(req, 1, q_of(1, 1))
        cases[f"{t}.route256"] = _route(req, 1, q_of(*ROUTE_BIG))
        rf = stack.enter_context(HolderFabric(t, max_rows=m_big, ready=True, model=g))
        cases[f"{t}.probe_ready"] = lambda req=rf.requester: req.probe(1)
        cases[f"{t}.route1_ready"] = _route(rf.requester, 1, q_of(1, 1))
        cases[f"{t}.route256_ready"] = _route(rf.requester, 1, q_of(*ROUTE_BIG))
        if args.kernel:
            kf = stack.enter_context(HolderFabric(t, max_rows=g.heads, stub_kernel=False, model=g))
            cases[f"{t}.route16_kernel"] = _route(kf.requester, 1, q_of(1, g.heads))
        hf = stack.enter_context(HolderFabric(t, lanes=4, max_rows=g.heads, model=g))
        pool = stack.enter_context(ThreadPoolExecutor(4))
        qs = [q_of(1, g.heads) for _ in range(4)]

        def holder4(hf=hf, pool=pool, qs=qs):
            def one(i):
                for _ in range(HOLDER4_CALLS):
                    hf.requester.route(1, qs[i], 0)

            for f in [pool.submit(one, i) for i in range(4)]:
                f.result()

        cases[f"{t}.holder4"] = holder4
    return cases


def _stats(samples: dict) -> dict:
    out = {}
    for k, v in samples.items():
        a = np.asarray(v)
        p20, p50, p80, p90 = np.percentile(a, [20, 50, 80, 90])
        out[k] = dict(p20=float(p20), p50=float(p50), p80=float(p80), p90=float(p90))
    return out


def _ratios(p50: dict, transports) -> list[tuple[str, float, str]]:
    """``(what, value, goal)`` rows from the cases' medians."""
    rows = []

    def add(what, value, goal):
        rows.append((what, value, goal))

    # left out when noise swamps either difference (a short --quick run): never a NaN record
    warm, woken = p50["pack_twice"] - p50["pack"], p50["wake_pack"] - p50["wake_only"]
    if warm > 0 and woken > 0:
        add(f"host work after a {IDLE_S * 1e6:.0f} us idle wait / the same warm", woken / warm, "-")
    for t in transports:
        floor = "gloo_1B" if t == "gloo" else "cond"
        bytes_us = (
            p50["gloo_payload"] - p50["gloo_1B"]
            if t == "gloo"
            else p50["cond_payload"] - p50["cond"]
        )
        goal_probe = "<= 2" if t == "gloo" else "<= 3"
        add(f"{t}: Requester.probe / {floor}", p50[f"{t}.probe"] / p50[floor], goal_probe)
        add(f"{t}: echo probe / {floor}", p50[f"{t}.echo_probe"] / p50[floor], "-")
        add(f"{t}: route M_q 1 (stub) / probe", p50[f"{t}.route1"] / p50[f"{t}.probe"], "<= 1.5")
        budget = 2 * p50[f"{t}.probe"] + bytes_us
        add(f"{t}: route M_q 256 (stub) / (2 probe + bytes at floor BW)",
            p50[f"{t}.route256"] / budget, "<= 1")  # fmt: skip
        # the floors of the two goals above, against the ready holder's own probe (the same
        # threads: two holders' threads can land on the CPUs differently, which moves a ratio
        # across holders more than the software does): what the requester's route path and
        # the engine cost whatever the holder does
        ready = p50[f"{t}.probe_ready"]
        add(f"{t}: ready holder: route M_q 1 / probe", p50[f"{t}.route1_ready"] / ready,
            "- (floor)")  # fmt: skip
        add(f"{t}: ready holder: route M_q 256 / (2 probe + bytes)",
            p50[f"{t}.route256_ready"] / (2 * ready + bytes_us), "- (floor)")  # fmt: skip
        calls = 4 * HOLDER4_CALLS
        add(
            f"{t}: holder, 4 requesters: routes/s",
            calls / (p50[f"{t}.holder4"] * 1e-6),
            "2x before",
        )
        host = host_fit(p50, t)
        add(f"{t}: host overhead fit: fixed (us)", host.fixed_us, "(cost model)")
        add(f"{t}: host overhead fit: per row (us)", host.per_row_us, "(cost model)")
    return rows


def host_fit(p50: dict, t: str):
    """§5.3's host term of this package on ``t``: routes through the holder and requester
    (kernel stubbed) less echo round trips of the same ``M_q`` (:func:`mqnc.cost.fit_host`)."""
    from mqnc.cost import fit_host

    m_big = ROUTE_BIG[0] * ROUTE_BIG[1]
    return fit_host([(m, p50[f"{t}.route{m}"], p50[f"{t}.echo_route{m}"]) for m in (1, m_big)])


def _print(stats: dict, rows, reps: int) -> None:
    print(f"\n{'case':<28} {'p50 us':>10} {'p90 us':>10}   ({reps} interleaved repetitions)")
    for k, s in stats.items():
        print(f"{k:<28} {s['p50']:>10.1f} {s['p90']:>10.1f}")
    print(f"\n{'ratio (medians, same run)':<62} {'value':>10}   goal")
    for what, value, goal in rows:
        print(f"{what:<62} {value:>10.2f}   {goal}")


def _record(stats: dict, rows, args, path) -> None:
    from mqnc.measure import record

    load = os.getloadavg()
    for k, s in stats.items():
        t = k.split(".")[0] if "." in k else "floor"
        record(
            "host",
            k,
            1,
            (s["p20"], s["p50"], s["p80"]),
            x_name="case",
            transport=None if t == "floor" else t,
            backend="host",
            extra=dict(p90=s["p90"], reps=args.reps, loadavg=load),
            path=path,
        )
    for what, value, goal in rows:
        record(
            "host_ratio",
            what,
            1,
            (value, value, value),
            x_name="case",
            unit="us" if "(us)" in what else "routes/s" if "routes/s" in what else "ratio",
            backend="host",
            extra=dict(goal=goal, reps=args.reps, loadavg=load),
            path=path,
        )


STAGE_NAMES = {
    "req.packed": "pack (requester)",
    "req.put": "put (requester)",
    "hold.woke": "hand-off to holder",
    "hold.parsed": "read + parse (holder)",
    "hold.computed": "holder work (checks, tables, kernel)",
    "hold.packed": "pack reply (holder)",
    "hold.put": "put reply (holder)",
    "req.woke": "hand-off back",
    "req.parsed": "read + parse (requester)",
    "req.done": "unpack + record (requester)",
}


def _calls(stamps: list[tuple[str, int]]) -> list[dict[str, int]]:
    """Split time-sorted stamps into calls at each ``req.start``: ``[{stage: ns}]``."""
    calls: list[dict[str, int]] = []
    for name, ns in sorted(stamps, key=lambda x: x[1]):
        if name == "req.start":
            calls.append({name: ns})
        elif calls and name not in calls[-1]:
            calls[-1][name] = ns
    return [c for c in calls if "req.done" in c]


def breakdown(args, g, calls: int = 200) -> None:
    """Median time per stage of sequential calls (probe, route M_q 1 and 256, kernel stubbed)."""
    import torch

    from mqnc.base import stamps
    from mqnc.base.stamps import STAGES
    from mqnc.measure.holders import HolderFabric

    gen = torch.Generator().manual_seed(0)
    qs = {
        "route1": torch.randn(1, 1, g.d_qk, generator=gen).to(torch.bfloat16),
        "route256": torch.randn(*ROUTE_BIG, g.d_qk, generator=gen).to(torch.bfloat16),
    }
    for t in args.transports:
        with HolderFabric(t, max_rows=ROUTE_BIG[0] * ROUTE_BIG[1], stamps=True, model=g) as fab:
            req, peer = fab.requester, fab.holder_ranks[0]
            fns = {"probe": lambda req=req, peer=peer: req.probe(peer)}
            fns.update({k: (lambda q=q, req=req: req.route(1, q, 0)) for k, q in qs.items()})
            for fn in fns.values():
                for _ in range(args.warmup):
                    fn()
            stamps.enable()
            stamps.take()
            for _ in range(calls):
                for fn in fns.values():
                    fn()
            mine = stamps.take()
            stamps.enable(False)
        rows = _calls(mine + fab.holder_stamps)
        print(f"\n{t}: median us per stage over {calls} sequential calls of each (kernel stubbed)")
        print(f"{'stage':<40}" + "".join(f"{k:>12}" for k in fns))
        per = {k: rows[i :: len(fns)] for i, k in enumerate(fns)}
        for a, b in zip(STAGES, STAGES[1:], strict=False):
            cells = []
            for k in fns:
                d = [(c[b] - c[a]) / 1e3 for c in per[k] if a in c and b in c]
                cells.append(f"{np.median(d):>12.1f}" if d else f"{'-':>12}")
            print(f"{STAGE_NAMES[b]:<40}" + "".join(cells))
        tot = [np.median([(c["req.done"] - c["req.start"]) / 1e3 for c in per[k]]) for k in fns]
        print(f"{'total':<40}" + "".join(f"{x:>12.1f}" for x in tot))


def launch(args) -> int:
    """``--launch``: the host time of each way to launch the holder's partial (dense H 16, B 1,
    c_t 2048; :mod:`mqnc.measure.launch_host`), recorded as ``bench="host_launch"`` (variant:
    the case and the shape; ``backend`` ``triton``, or ``host`` for the stubbed cases); on a
    GPU also the partial's device time with its combine launched plainly and with PDL
    (``bench="mla_decode"``, variant ``H=16,B=1 combine=plain|pdl``, ``extra.combine``)."""
    import torch

    from mqnc.measure import record
    from mqnc.measure.launch_host import (
        LaunchShape,
        combine_pdl_times,
        host_times,
        launch_cases,
    )
    from mqnc.measure.options import finish

    shape = LaunchShape()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = launch_cases(shape, device)
    times = host_times(cases, reps=args.reps, warmup=args.warmup)
    print(f"host time of one launch, {shape.label} ({args.reps} calls, p50 us):")
    for name, pct in times.items():
        print(f"  {name:<22} {pct[1]:>9.1f}")
        stub = cases[name][1]
        record(
            "host_launch",
            f"{name} {shape.label}",
            1,
            pct,
            x_name="call",
            backend="host" if stub else "triton",
            extra=dict(case=name, stubbed=stub, reps=args.reps, shape=shape.label),
            path=args.out,
        )
    if device != "cuda":
        print("  (no GPU: the real launches, the graph replays and the PDL combine not measured)")
        return finish(args, TARGETS)
    for name, t in combine_pdl_times(shape, reps=args.reps, warmup=args.warmup).items():
        print(f"  device time, combine {name:<6} {t.p50:>9.2f} us")
        record(
            "mla_decode",
            f"H={shape.H},B={shape.B} combine={name}",
            shape.ct,
            t.percentiles,
            x_name="ct",
            backend="triton",
            extra=dict(timing=t.how, combine=name, shape=f"combine {name} {shape.label}"),
            path=args.out,
        )
    return finish(args, TARGETS)


def main(argv=None) -> int:
    from mqnc.measure.options import bench_parser, finish, parse_bench_args

    ap = bench_parser(__doc__, reps="400; --quick: 20", warmup="20; --quick: 2", transports=True)
    ap.set_defaults(transport=["loopback", "gloo"])
    ap.add_argument("--no-kernel", dest="kernel", action="store_false",
                    help="skip the real-kernel route (interpreted on a CPU: slow; --quick "
                    "skips it too)")  # fmt: skip
    ap.add_argument("--breakdown", action="store_true", help="per-stage times instead")
    ap.add_argument("--launch", action="store_true",
                    help="host time of a kernel launch instead: eager call, plan.run, CUDA-graph "
                    "replays (mqnc.measure.launch_host)")  # fmt: skip
    args = parse_bench_args(ap, argv)
    bad = [t for t in args.transport if t not in ("loopback", "gloo")]
    if bad:
        ap.error(f"--transport: expected loopback and/or gloo, got {','.join(args.transport)}")
    args.reps = args.reps or (20 if args.quick else 400)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 20)
    args.kernel = args.kernel and not args.quick
    args.transports = args.transport
    from mqnc.base.runtime import use_interpreter_without_cuda

    use_interpreter_without_cuda()
    from mqnc.measure.timing import interleaved_samples, one_intra_op_thread

    one_intra_op_thread()
    g = args.model
    if args.launch:
        return launch(args)
    if args.breakdown:
        breakdown(args, g)
        return finish(args)
    t0 = time.monotonic()
    load0 = os.getloadavg()
    with contextlib.ExitStack() as stack:
        cases = _cases(args, stack, g)
        samples = interleaved_samples(cases, warmup=args.warmup, reps=args.reps)
    stats = _stats(samples)
    rows = _ratios({k: s["p50"] for k, s in stats.items()}, args.transports)
    _print(stats, rows, args.reps)
    load1 = os.getloadavg()
    print(f"\nload average before {load0[0]:.2f}, after {load1[0]:.2f} (1 min; "
          f"{os.cpu_count()} cores); {time.monotonic() - t0:.0f} s")  # fmt: skip
    _record(stats, rows, args, args.out)
    return finish(args, TARGETS)


if __name__ == "__main__":
    from mqnc.measure.ranks import exit_process

    exit_process(main())
