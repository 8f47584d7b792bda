"""Route under self-congestion: K concurrent route flows sharing one link (Fig. 7).

``python -m perf.bench_congestion [--transport loopback,gloo] [--k 0,1,2,3] [--m-q 256,1024]
[--background-m-q 1024]`` plus the flags every benchmark takes (``--quick --reps --warmup
--out FILE | --record --check``, :mod:`mqnc.measure.options`).

What is timed (§8, Fig. 7), through :class:`mqnc.measure.echo.EchoFabric` with one echo holder and
``1 + max(K)`` lanes: K background flows (threads of the requester process, each on its own
lane) run route round trips of ``--background-m-q`` rows (1024) back to back; meanwhile the
foreground flow on lane 0 times the probe (``sig_rt``) and the route round trip at each
``M_q`` (256 and 1024, the paper's two batches). All flows share the requester's link to the
holder (on gloo one TCP pair and its send lock, on loopback the holder's memory and the
interpreter lock), the analogue of the paper's K flows on one NDR-200 uplink.

Records: ``bench="congestion"``, ``x`` = K in {0, 1, 2, 3}, ``variant="probe"`` for the probe
and ``variant="M_q=<m>"`` (with ``extra["m_q"]``) for the round trips; ``transport`` names the
engine. Host wall clock, warm-up first, p20/p50/p80.
"""

from __future__ import annotations

import threading

from mqnc import measure as H
from perf.speed_targets import TARGETS


# Over 60 lines: one sweep whose background flows, timing and records share their loop state;
# split, each piece would take most of it as arguments.
def _sweep(fabric: H.EchoFabric, g, ks: list[int], m_qs: list[int], args) -> None:
    """Time the probe and each foreground M_q under K = each of ``ks`` background flows."""
    from tqdm import tqdm

    from mqnc.measure import record, time_fn

    name = fabric.name
    bg_msg = fabric.route_message(args.background_m_q, g.q_row_bytes, g.p_row_bytes)
    fg = {m: fabric.route_message(m, g.q_row_bytes, g.p_row_bytes) for m in m_qs}
    for k in tqdm(ks, desc=f"bench_congestion[{name}]"):
        stop = threading.Event()
        done = [0] * k
        errors: list[BaseException] = []

        def flow(lane, stop=stop, done=done, errors=errors):
            try:
                while not stop.is_set():
                    fabric.round_trip(1, bg_msg, lane)
                    done[lane - 1] += 1
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=flow, args=(i + 1,), daemon=True) for i in range(k)]
        for t in threads:
            t.start()
        try:
            extra = H.host_extra(fabric, k=k, background_m_q=args.background_m_q)
            p = time_fn(lambda: fabric.probe(1, 0), warmup=args.warmup, reps=args.reps, cuda=False)
            record(
                "congestion",
                "probe",
                k,
                p,
                x_name="flows",
                nbytes=2,
                transport=name,
                backend="host-echo",
                extra=extra,
                path=args.out,
            )
            line = [f"probe {p[1]:.0f}"]
            for m, msg in fg.items():
                p = time_fn(
                    lambda msg=msg: fabric.round_trip(1, msg, 0),
                    warmup=args.warmup,
                    reps=args.reps,
                    cuda=False,
                )
                record(
                    "congestion",
                    f"M_q={m}",
                    k,
                    p,
                    x_name="flows",
                    nbytes=m * g.qp_row_bytes,
                    transport=name,
                    backend="host-echo",
                    extra={**extra, "m_q": m},
                    path=args.out,
                )
                line.append(f"M_q={m} {p[1]:.0f}")
        finally:
            stop.set()
            for t in threads:
                t.join(fabric.timeout_s)
        if errors:
            raise errors[0]
        print(f"{name} K={k}: p50 (us) {', '.join(line)}; background trips {sum(done)}")


def main(argv=None) -> int:
    ap = H.bench_parser(__doc__, reps=20, transports=True)
    ap.add_argument(
        "--k",
        type=H.nonnegative_int_list,
        default=None,
        help="concurrent background flows (0,1,2,3; --quick 0,1,3)",
    )
    ap.add_argument(
        "--m-q", type=H.int_list, default=[256, 1024], help="foreground route batches (256,1024)"
    )
    ap.add_argument(
        "--background-m-q",
        type=H.positive_int,
        default=1024,
        help="rows per background trip (1024)",
    )
    args = H.parse_bench_args(ap, argv)
    H.one_intra_op_thread()
    g = args.model
    ks = args.k or ([0, 1, 3] if args.quick else [0, 1, 2, 3])
    m_qs = args.m_q
    biggest = max([*m_qs, args.background_m_q]) * max(g.q_row_bytes, g.p_row_bytes)
    for name in args.transport:
        try:
            fabric = H.EchoFabric(name, holders=1, lanes=1 + max(ks), slot_bytes=H.HDR + biggest)
        except H.Unavailable as exc:
            print(f"bench_congestion: skipped: {exc}")
            continue
        with fabric:
            _sweep(fabric, g, ks, m_qs, args)
    return H.finish(args, TARGETS)


if __name__ == "__main__":
    H.exit_process(main())
