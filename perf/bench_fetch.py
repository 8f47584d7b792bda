"""Fetch's pull: the contiguous chunk pull and the scattered gather over M holders (Fig. 4(a)),
beside route's fan-out to the same M holders.

``python -m perf.bench_fetch [--transport loopback,gloo] [--c-t 64,256] [--max-holders 7]
[--topk 2048] [--m-q 256] [--pool-rows 16384]`` plus the flags every benchmark takes
(``--quick --reps --warmup --out FILE | --record --check``, :mod:`mqnc.measure.options`).

What is timed (§5.4, Fig. 4(a)), through :class:`mqnc.measure.echo.EchoFabric`:

- ``bench="fetch"``, ``variant="contiguous (<transport>)"``, ``x`` = c_t: one request, the
  holder returns a contiguous chunk of ``c_t`` tokens x all ``L`` layers (``c_t L b_KV``
  bytes, the coalesced bulk pull ``T_pull``; no splice);
- ``bench="fetch"``, ``x_name="holders"``, ``variant`` = transport, ``x`` = M in 1..7: a
  ``k``-entry selected set (default top-2048) spread evenly over M holders, pulled **one
  holder at a time** (the paper's serial gather): each holder receives its entries' int32
  indices, gathers those rows of one layer (``index_select`` over its ``[rows, 576]`` bf16
  pool) and returns them. Per layer, as Fig. 4(a) plots it (the full pull is L times this);
- ``bench="route_fanout"``, ``x_name="holders"``, ``x`` = M: the same request routed instead:
  ``M_q`` query rows put to all M holders first, all M partial replies awaited, then the
  M-way merge of ``[M, B, H, 512]`` partials (torch fp32 on the CPU, ``merge_partials`` on a
  GPU). The holders run no attention (that is ``bench_holder``).

Host wall clock, warm-up first, p20/p50/p80.
"""

from __future__ import annotations

from mqnc import measure as H
from perf.speed_targets import TARGETS

CT_FULL = [64, 256, 1024, 2048]
CT_QUICK = [64, 256]


def _merge_fn(m: int, m_q: int, geometry):
    """The requester's M-way merge of ``m`` partials of ``m_q`` rows (data is synthetic)."""
    import torch

    heads = geometry.heads if m_q % geometry.heads == 0 else 1
    b = m_q // heads
    if torch.cuda.is_available():
        from mqnc.triton_kernels import merge_partials

        o = torch.randn(m, b, heads, geometry.d_v, device="cuda").to(torch.bfloat16)
        lse = torch.randn(m, b, heads, device="cuda")

        def run():
            merge_partials(o, lse, check_lse=False, layout="MBHD")
            torch.cuda.synchronize()

        return run, "triton merge"
    from mqnc.reference import merge_reference

    o = torch.randn(m, b, heads, geometry.d_v)
    lse = torch.randn(m, b, heads)
    return (lambda: merge_reference(o, lse, dtype=torch.float32)), "torch merge"


def main(argv=None) -> int:
    ap = H.bench_parser(__doc__, reps=20, transports=True)
    ap.add_argument(
        "--c-t", type=H.int_list, default=None, help="contiguous chunk sizes (64,256,1024,2048)"
    )
    H.hidden_alias(ap, "--ct", "c_t", type=H.int_list)
    ap.add_argument(
        "--max-holders", type=H.positive_int, default=None, help="M up to this (7; --quick 3)"
    )
    ap.add_argument(
        "--topk", type=H.positive_int, default=2048, help="selected entries gathered (2048)"
    )
    ap.add_argument(
        "--m-q", type=H.positive_int, default=256, help="routed rows of the fan-out (256)"
    )
    ap.add_argument(
        "--pool-rows", type=H.positive_int, default=16384, help="rows per holder's pool (16384)"
    )
    args = H.parse_bench_args(ap, argv)
    H.one_intra_op_thread()
    import torch

    g = args.model
    cts = args.c_t or (CT_QUICK if args.quick else CT_FULL)
    max_m = args.max_holders or (3 if args.quick else 7)
    if not 1 <= max_m <= 64:
        ap.error(f"argument --max-holders: expected 1..64, got {max_m}")
    if args.topk < max_m:
        ap.error(f"argument --topk: expected >= --max-holders ({max_m}), got {args.topk}")
    gen = torch.Generator().manual_seed(0)
    for name in args.transport:
        try:
            _contiguous(name, g, cts, args)
        except H.Unavailable as exc:
            print(f"bench_fetch: skipped: {exc}")
            continue
        _over_holders(name, g, max_m, args, gen)
    return H.finish(args, TARGETS)


def _contiguous(name: str, g, cts: list[int], args) -> None:
    """1) contiguous pull of c_t tokens x L layers from one holder."""
    from tqdm import tqdm

    from mqnc.measure import record, time_fn

    chunk_max = g.chunk_bytes(max(cts))
    fabric = H.EchoFabric(name, holders=1, slot_bytes=H.HDR + chunk_max, chunk_bytes=chunk_max)
    with fabric:
        for ct in tqdm(cts, desc=f"bench_fetch[{name}] contiguous"):
            nbytes = g.chunk_bytes(ct)
            msg = fabric.message(H.OP_CHUNK, H.HDR, nbytes)
            p = time_fn(
                lambda msg=msg, fabric=fabric: fabric.round_trip(1, msg),
                warmup=args.warmup,
                reps=args.reps,
                cuda=False,
            )
            record(
                "fetch",
                f"contiguous ({name})",
                ct,
                p,
                x_name="c_t",
                nbytes=nbytes,
                transport=name,
                backend="host-echo",
                extra=H.host_extra(fabric, layers=g.layers, what="all-layer chunk pull"),
                path=args.out,
            )
            print(f"{name} contiguous c_t={ct}: p50 {p[1]:.0f} us ({nbytes / 1e6:.1f} MB)")


def _over_holders(name: str, g, max_m: int, args, gen) -> None:
    """2) scattered gather over M holders vs 3) route fan-out to the same M holders."""
    from tqdm import tqdm

    from mqnc.measure import time_fn

    rows = args.m_q * max(g.q_row_bytes, g.p_row_bytes)  # the query out and the partial back
    slot = H.HDR + max(args.topk * g.kv_bytes_per_token_layer, rows)
    with H.EchoFabric(name, holders=max_m, slot_bytes=slot, pool_rows=args.pool_rows) as fab:
        route_msg = fab.route_message(args.m_q, g.q_row_bytes, g.p_row_bytes)
        for m in tqdm(range(1, max_m + 1), desc=f"bench_fetch[{name}] holders"):
            msgs = _gather_messages(fab, m, args, gen)

            def gather(msgs=msgs, m=m):
                for peer, msg in zip(range(1, m + 1), msgs, strict=True):
                    fab.round_trip(peer, msg)  # serial: one holder at a time

            p = time_fn(gather, warmup=args.warmup, reps=args.reps, cuda=False)
            merge, merge_name = _merge_fn(m, args.m_q, g)

            def fanout(m=m, merge=merge, route_msg=route_msg):
                pending = [fab.send(peer, route_msg) for peer in range(1, m + 1)]
                for pend in pending:
                    fab.wait(pend)
                merge()

            pf = time_fn(fanout, warmup=args.warmup, reps=args.reps, cuda=False)
            _record_holders(fab, name, m, p, pf, merge_name, g, args)
            print(
                f"{name} M={m}: gather top-{args.topk} p50 {p[1]:.0f} us; route fan-out "
                f"(M_q={args.m_q}) + merge p50 {pf[1]:.0f} us"
            )


def _gather_messages(fab, m: int, args, gen) -> list:
    """One gather request per holder: ``topk`` random rows split as evenly as possible."""
    import torch

    counts = [args.topk // m + (i < args.topk % m) for i in range(m)]
    return [
        fab.message(
            H.OP_GATHER, H.HDR, n, indices=torch.randint(0, args.pool_rows, (n,), generator=gen)
        )
        for n in counts
    ]


def _record_holders(fab, name: str, m: int, p, pf, merge_name: str, g, args) -> None:
    from mqnc.measure import record

    record(
        "fetch",
        name,
        m,
        p,
        x_name="holders",
        nbytes=args.topk * g.kv_bytes_per_token_layer,
        transport=name,
        backend="host-echo",
        extra=H.host_extra(fab, topk=args.topk, layers=1, what="serial gather, per layer"),
        path=args.out,
    )
    record(
        "route_fanout",
        name,
        m,
        pf,
        x_name="holders",
        nbytes=m * args.m_q * g.qp_row_bytes,
        transport=name,
        backend="host-echo",
        extra=H.host_extra(fab, m_q=args.m_q, merge=merge_name),
        path=args.out,
    )


if __name__ == "__main__":
    H.exit_process(main())
