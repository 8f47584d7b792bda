"""Route's transport term: the probe (``sig_rt``) and the round trip (``full_rt``) over M_q.

``python -m perf.bench_route [--transport loopback,gloo] [--m-q 1,64,1024] [--payloads 2184]``
plus the flags every benchmark takes (``--quick --reps --warmup --out FILE | --record --check``,
:mod:`mqnc.measure.options`).

What is timed (§3.2, §4.3, Table 1), on each transport named, through
:class:`mqnc.measure.echo.EchoFabric` (rank 0 this process, one echo holder;
the sweep itself is :func:`mqnc.measure.sweep.route_sweep`, which ``mqnc calibrate`` runs too):

- ``bench="probe"``: a 1-byte put + signal answered by a 1-byte put + signal (the protocol
  probe ``sig_rt``); ``x`` = 1 byte;
- ``bench="route"``: ``M_q q`` bytes put with a signal, ``M_q p`` bytes put back with a signal
  (``full_rt``); ``x`` = M_q in {1, 4, 16, ..., 4096}; the holder runs no attention (the
  compute term is ``bench_holder``'s), so this is exactly the term the cost model's
  ``T_probe + M_q (q + p) / BW`` describes. ``extra["qp_row_bytes"]`` is the row size: the
  real MLA row of the geometry (``q + p`` = 2184 B for DeepSeek-V2-Lite) and the payload sweep
  of Table 1 (900, 4368, 8736 B/row, split into ``q`` and ``p`` in the geometry's proportion).

``variant`` is the transport name, which is how ``mqnc fit`` and ``mqnc.plots`` pair a route
sweep with its probe. Timings are host wall clock (``time.perf_counter_ns``), warm-up first,
all points timed round-robin (``mqnc.measure.timing.time_interleaved``: drift of a shared machine
falls on every point alike),
p20/p50/p80 of ``--reps`` repetitions.
"""

from __future__ import annotations

from mqnc import measure as H
from mqnc.cost import fit
from mqnc.measure.sweep import route_sweep
from perf.speed_targets import TARGETS

M_Q_FULL = [1, 4, 16, 64, 256, 1024, 4096]
M_Q_QUICK = [1, 64, 1024]
PAYLOADS = [900, 2184, 4368, 8736]


def main(argv=None) -> int:
    ap = H.bench_parser(__doc__, reps=20, transports=True)
    ap.add_argument(
        "--m-q", type=H.int_list, default=None, help="comma-separated M_q (1,4,16,...,4096)"
    )
    ap.add_argument(
        "--payloads",
        type=H.int_list,
        default=None,
        help="comma-separated q+p bytes/row (900,2184,4368,8736; --quick: the model's row)",
    )
    args = H.parse_bench_args(ap, argv)
    H.one_intra_op_thread()
    geometry = args.model
    m_qs = args.m_q or (M_Q_QUICK if args.quick else M_Q_FULL)
    payloads = args.payloads or ([geometry.qp_row_bytes] if args.quick else PAYLOADS)
    biggest = max(max(H.split_row_bytes(qp, geometry)) for qp in payloads) * max(m_qs)
    for name in args.transport:
        try:
            fabric = H.EchoFabric(name, holders=1, slot_bytes=H.HDR + biggest)
        except H.Unavailable as exc:
            print(f"bench_route: skipped: {exc}")
            continue
        with fabric:
            probe, sweeps = route_sweep(
                fabric, geometry, m_qs, payloads, reps=args.reps, warmup=args.warmup, out=args.out
            )
        print(f"{name}: probe p50 {probe[1]:.1f} us")
        for qp, pts in sweeps.items():
            line = ", ".join(f"{m}: {us:.0f}" for m, us in pts)
            msg = f"{name} q+p={qp} B: round trip p50 (us) by M_q {{{line}}}"
            if len({m for m, _ in pts}) >= 2:
                try:
                    res = fit(pts, qp_row_bytes=qp, probe_us=probe[1])
                    msg += (
                        f"; fit BW {res.bw_gbps:.3g} GB/s, turnaround {res.turnaround_us:.1f} "
                        f"us, MAPE {100 * res.mape_amortised:.0f}% (M_q>=512)"
                    )
                except ValueError as exc:
                    msg += f"; no fit ({exc})"
            print(msg)
    return H.finish(args, TARGETS)


if __name__ == "__main__":
    H.exit_process(main())
