"""Tensor-parallel rank pairing (§8): wire bytes per rank and in aggregate, and the round trip,
at TP degree N = 1, 2, 4 on gloo processes (2 instances x N ranks).

``python -m perf.bench_tp [--degrees 1,2,4] [--m-q 16,256] [--tokens 64]`` plus the flags every
benchmark takes (``--quick --reps --warmup --out FILE | --record --check``).

Set-up (:class:`mqnc.serving.tp_process.TPCluster`): instance 0 is a requester group of N ranks
(one gloo transport each, threads of this process), instance 1 a holder group of N processes
(each keeps its ``d_qk / N`` columns of one chunk of ``--tokens`` tokens, the holder group's
score reduction over a gloo group). One timed call: every requester rank routes its query slice
of ``M_q = B x 16`` rows (DeepSeek-V2-Lite's row, bf16) to its paired holder rank at once (one
thread each) and waits for its slice of ``o`` and the row's ``lse``; the time is the slowest
rank's, host wall clock. The holder computes with the torch references (``--kernels``), so the
round trip is transport, agreement, reduction and a small fp64 computation; the holder's own
time is recorded in ``extra["holder_us"]`` (p50 of the replies' ``holder_ns``).

Records: ``bench="tp_probe"`` (``variant=f"gloo-tp{N}"``), requester rank 0's payload-free
round trip to its pair (a header each way, answered by the holder rank without its group);
``bench="tp_route"`` (``variant=f"gloo-tp{N}"``, ``x = M_q``): p20/p50/p80 of the round trip;
``bytes``: the wire bytes one rank pair moves (request and reply, headers included);
``extra``: ``degree``, ``rank_bytes`` (that), ``aggregate_bytes`` (all N pairs),
``rank_fraction`` (``rank_bytes`` over the N = 1 pair's: the paper's 1/N, 50% at N = 2),
``query_payload`` / ``partial_payload`` (one rank's payloads) and ``holder_us``.
:func:`mqnc.cost.calibration_fits.fit_tp` fits the cost model's TP term from these records.
All processes share this machine's cores: the round trips measure gloo on one host, not a
fabric.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
import torch

from mqnc import measure as H
from mqnc.cost.calibration_fits import fit_tp
from mqnc.transport import slot_bytes_for, wire

DEGREES = [1, 2, 4]
M_Q_FULL = [16, 256]
M_Q_QUICK = [16]


def _point(cluster, q, reps: int, warmup: int) -> tuple[tuple[float, float, float], list, float]:
    """``(percentiles, last replies, holder p50 us)`` of ``reps`` paired routes of ``q``."""
    times, holder = [], []
    got = None
    for i in range(warmup + reps):
        t0 = time.perf_counter_ns()
        got = cluster.route_all(1, 0, q, 0)
        dt = (time.perf_counter_ns() - t0) / 1e3
        bad = [x for x in got if isinstance(x, BaseException)]
        if bad:
            raise bad[0]
        if i >= warmup:
            times.append(dt)
            holder.append(max(r.last_holder_ns for r in cluster.requesters) / 1e3)
    p = np.percentile(times, [20, 50, 80])
    return (float(p[0]), float(p[1]), float(p[2])), got, float(np.median(holder))


def _probe(cluster, n: int, args) -> None:
    """Record requester rank 0's payload-free round trip to its pair (``T_probe``)."""
    req = cluster.requesters[0]
    for _ in range(args.warmup):
        req.probe(1)
    us = [req.probe(1) for _ in range(args.reps)]
    pct = tuple(float(x) for x in np.percentile(us, [20, 50, 80]))
    H.record(
        "tp_probe", f"gloo-tp{n}", 1, pct, x_name="bytes", nbytes=2 * wire.HEADER_BYTES,
        transport="torchdist", backend="none", extra=dict(degree=n), path=args.out,
    )  # fmt: skip
    print(f"TP {n}: probe p50 {pct[1]:.0f} us")


def _degree(n: int, args, geometry, m_qs: list[int], base: dict) -> None:
    """Start 2 instances x ``n`` ranks, time every ``M_q``, record."""
    from mqnc.serving.tp_group import TPPartition
    from mqnc.serving.tp_process import TPCluster
    from mqnc.serving.tp_requester import payload_bytes

    part = TPPartition(geometry, n)
    g = torch.Generator().manual_seed(n)
    kv = (0.5 * torch.randn(geometry.layers, args.tokens, geometry.d_qk, generator=g)).bfloat16()
    slot = slot_bytes_for(geometry, max_rows=max(m_qs))
    with tempfile.TemporaryDirectory() as tmp:
        cluster = TPCluster(
            part, {0: kv}, tmp, scale=0.1, slot_bytes=slot, kernels=args.kernels,
            num_blocks=-(-args.tokens // 16), timeout_s=60.0,
        )  # fmt: skip
        try:
            _probe(cluster, n, args)
            for m_q in m_qs:
                q = (0.5 * torch.randn(m_q // geometry.heads, geometry.heads, geometry.d_qk,
                                       generator=g)).bfloat16()  # fmt: skip
                pct, _, holder_us = _point(cluster, q, args.reps, args.warmup)
                qb, pb = payload_bytes(part, m_q, torch.bfloat16)
                rank_bytes = 2 * wire.HEADER_BYTES + qb + pb
                base.setdefault(m_q, rank_bytes)
                extra = dict(
                    degree=n, rank_bytes=rank_bytes, aggregate_bytes=n * rank_bytes,
                    rank_fraction=rank_bytes / base[m_q], query_payload=qb, partial_payload=pb,
                    holder_us=holder_us, tokens=args.tokens, kernels=args.kernels,
                )  # fmt: skip
                H.record("tp_route", f"gloo-tp{n}", m_q, pct, x_name="M_q", nbytes=rank_bytes,
                         transport="torchdist", backend=f"{args.kernels}-reference"
                         if args.kernels == "torch" else args.kernels, extra=extra,
                         path=args.out)  # fmt: skip
                print(
                    f"TP {n}: M_q {m_q}: round trip p50 {pct[1]:.0f} us (holder {holder_us:.0f}"
                    f" us); per rank {rank_bytes} B ({100 * extra['rank_fraction']:.1f}% of "
                    f"TP 1), aggregate {n * rank_bytes} B"
                )
        finally:
            cluster.close()


def main(argv=None) -> int:
    ap = H.bench_parser(__doc__, reps=20, warmup=3)
    ap.add_argument("--degrees", type=H.int_list, default=None, help="TP degrees (1,2,4)")
    ap.add_argument("--m-q", type=H.int_list, default=None, help="routed rows (16,256)")
    ap.add_argument("--tokens", type=H.positive_int, default=64, help="chunk tokens (64)")
    ap.add_argument("--kernels", choices=("torch", "triton"), default="torch")
    args = H.parse_bench_args(ap, argv)
    H.one_intra_op_thread()
    from mqnc.model import get_preset

    geometry = get_preset("deepseek-v2-lite")
    degrees = args.degrees or ([1, 2] if args.quick else DEGREES)
    m_qs = args.m_q or (M_Q_QUICK if args.quick else M_Q_FULL)
    bad = [m for m in m_qs if m % geometry.heads]
    if bad:
        ap.error(f"--m-q: expected multiples of the {geometry.heads} heads, got {bad}")
    base: dict[int, int] = {}
    for n in sorted(degrees):
        _degree(n, args, geometry, m_qs, base)
    recs = [r for r in H.read_results(args.out) if r["bench"] == "tp_route"]
    try:
        print(fit_tp(recs[-len(degrees) * len(m_qs) :]).summary())
    except ValueError as exc:
        print(f"bench_tp: no TP fit ({exc})")
    return H.finish(args)


if __name__ == "__main__":
    H.exit_process(main())
