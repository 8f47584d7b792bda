"""The device's copy-bandwidth ceiling, measured first so kernel GB/s can be read against it.

``python -m perf.bench_copy [--gib 2]`` (``--quick``: 0.25 GiB) with the flags every benchmark
takes (``--reps --warmup --out FILE | --record --check``, :mod:`mqnc.measure.options`): a
device-to-device ``copy_`` of a large buffer, counting bytes read plus bytes written
(METHOD.md's ceiling). On the CPU it measures host memcpy. Timing is
``mqnc.measure.time_kernel`` (one input set: 2 x 2 GiB is far past the L2; CUDA-graph replays
between events, recorded as ``extra.timing``).
"""

from __future__ import annotations

from mqnc.measure.options import bench_parser, finish, parse_bench_args, positive_float
from perf.speed_targets import TARGETS


def main(argv=None) -> int:
    ap = bench_parser(__doc__, reps=20)
    ap.add_argument("--gib", type=positive_float, default=None, help="buffer GiB (2; --quick 0.25)")
    args = parse_bench_args(ap, argv)
    args.gib = args.gib or (0.25 if args.quick else 2.0)
    import torch

    from mqnc.measure import record, time_kernel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = int(args.gib * 2**30) // 2
    src = (
        torch.randn(n, device=dev).to(torch.bfloat16)
        if dev == "cuda"
        else torch.empty(n, dtype=torch.bfloat16)
    )
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    t = time_kernel(
        [lambda: dst.copy_(src)], working_set_bytes=nbytes, warmup=args.warmup, reps=args.reps
    )
    rec = record(
        "copy",
        "d2d" if dev == "cuda" else "host",
        nbytes,
        t.percentiles,
        x_name="bytes",
        nbytes=nbytes,
        backend="torch",
        path=args.out,
        extra={"timing": t.how},
    )
    print(
        f"copy ceiling: {rec['gbps']:.0f} GB/s (read + write, {args.gib} GiB, p50 {t.p50:.0f} us)"
    )
    return finish(args, TARGETS)


if __name__ == "__main__":
    raise SystemExit(main())
