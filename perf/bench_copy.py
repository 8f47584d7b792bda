"""The device's copy-bandwidth ceiling, measured first so kernel GB/s can be read against it.

``python -m perf.bench_copy [--gib 2]``: a device-to-device ``copy_`` of a large buffer, counting
bytes read plus bytes written (METHOD.md's ceiling). On the CPU it measures host memcpy.
Timing is ``mqnc.measure.time_kernel`` (one input set: 2 x 2 GiB is far past the L2; CUDA-graph
replays between events, recorded as ``extra.timing``).
"""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="buffer size in GiB")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
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
    t = time_kernel([lambda: dst.copy_(src)], working_set_bytes=nbytes, warmup=3, reps=20)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
