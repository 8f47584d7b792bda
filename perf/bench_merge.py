"""Benchmark the M-way merge (``merge_partials``) against the torch reference.

``python -m perf.bench_merge [--goals | --tiny]`` with the flags every benchmark takes
(``--quick --reps --warmup --out FILE | --record --check``, :mod:`mqnc.measure.options`).

Sweeps M (partials: holders a query was routed to, §5.4 Fig. 4a's 1..8) and the rows B*H at the
production Dv = 512. Bytes moved once: M*B*H*(Dv*elt + 4) read + B*H*(Dv*elt + 4) written. On a
GPU it times the Triton kernel; on the CPU the torch fp32 reference path
(``backend=torch-reference``): interpreter timings say nothing about the kernel.

``--goals`` times the production goal shapes instead (``sm90.variants.GOALS``: M 8 over 256 rows,
<= 8 us, and the two-way fold, bf16 ``[M, 16, 16, 512]``), recording ``extra.shape`` for
``mqnc/measure/kernel_report.py --measured``; ``--tiny`` (the dry run of ``perf/gpu_check.sh``)
times the goal shapes cut to 2 of their 16 tokens with the Triton kernel even without a GPU
(interpreted; by default two repetitions, no warm-up).

Timing is ``mqnc.measure.time_kernel`` (``extra.timing``): on a GPU the kernel (``check_lse``
off) over enough input sets that one pass moves twice the L2, replayed as one CUDA graph between
CUDA events, the host cost of a call beside it.
"""

from __future__ import annotations

from mqnc.base.runtime import use_interpreter_without_cuda
from mqnc.measure.options import bench_parser, finish, parse_bench_args
from perf.speed_targets import TARGETS


def main(argv=None) -> int:
    ap = bench_parser(
        __doc__,
        reps="20 on a GPU, 10 on a CPU, 2 with --tiny",
        warmup="3, 0 with --tiny",
        tiny=True,
    )
    ap.add_argument("--goals", action="store_true", help="the production goal shapes instead")
    args = parse_bench_args(ap, argv)
    use_interpreter_without_cuda()
    import torch
    from tqdm import tqdm

    from mqnc.measure import input_sets, l2_bytes, record, time_kernel
    from mqnc.reference import merge_reference

    cuda = torch.cuda.is_available()
    kernel = cuda or args.tiny  # the Triton kernel: compiled on a GPU, interpreted otherwise
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if kernel else torch.float32
    Ms = [1, 2, 4, 8] if not args.quick else [2, 8]
    rows = [16, 128, 1024, 16384] if not args.quick else [16, 1024]
    D = 512
    cases = [(M, R, 1, {}) for M in Ms for R in rows]  # (M, B, H, extra): rows as B, H = 1
    if args.goals or args.tiny:
        from mqnc.triton_kernels.sm90.variants import GOALS

        cases = [
            (s.M, s.B, s.H, {"shape": s.label, "goal": s.goal}) for s in GOALS if s.op == "merge"
        ]
        if args.tiny:  # two of the 16 tokens: 32 rows (the interpreter takes ~10 ms a row)
            cases = [(M, min(B, 2), H, {}) for M, B, H, _ in cases]
    if kernel:
        from mqnc.triton_kernels import merge_partials

        fn = lambda o, l: merge_partials(o, l, check_lse=False, layout="MBHD")  # noqa: E731
        backend = "triton" if cuda else "interpreter"
    else:
        fn = lambda o, l: merge_reference(o, l, dtype=torch.float32)  # noqa: E731
        backend = "torch-reference"
    reps = args.reps or (20 if cuda else (2 if args.tiny else 10))
    warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 3)
    l2 = l2_bytes(dev)
    for M, B, H, extra in tqdm(cases, desc="bench_merge"):
        R = B * H
        elt = torch.empty((), dtype=dtype).element_size()
        nbytes = M * R * (D * elt + 4) + R * (D * elt + 4)

        def make(M=M, B=B, H=H):
            o = torch.randn(M, B, H, D, device=dev).to(dtype)
            lse = torch.randn(M, B, H, device=dev)
            return lambda: fn(o, lse)

        calls = [make() for _ in range(input_sets(nbytes, l2))]
        t = time_kernel(
            calls, working_set_bytes=nbytes, warmup=warmup, reps=reps, cuda=cuda,
            checks="off" if kernel else "n/a",
        )  # fmt: skip
        record(
            "merge",
            f"M={M}",
            R,
            t.percentiles,
            x_name="rows",
            nbytes=nbytes,
            backend=backend,
            path=args.out,
            extra={"M": M, "Dv": D, "dtype": str(dtype)[6:], **extra, "timing": t.how},
        )
        print(f"merge M={M} rows={R}: p50 {t.p50:.1f} us ({nbytes / t.p50 / 1e3:.2f} GB/s)")
    return finish(args, TARGETS)


if __name__ == "__main__":
    raise SystemExit(main())
