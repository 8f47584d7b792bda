"""Benchmark the M-way merge (``merge_partials``) against the torch reference.

``python -m perf.bench_merge [--goals]`` with the flags every benchmark takes (``--quick --reps
--warmup --out FILE | --record --check``, :mod:`mqnc.measure.options`).

Sweeps M (partials: holders a query was routed to, §5.4 Fig. 4a's 1..8) and the rows B*H at the
production Dv = 512. Bytes moved once: M*B*H*(Dv*elt + 4) read + B*H*(Dv*elt + 4) written. On a
GPU it times the Triton kernel (CUDA events); on the CPU the torch fp32 reference path
(``backend=torch-reference``): interpreter timings say nothing about the kernel.

``--goals`` times issue 13's goal shapes instead (``_variants.GOALS``: M 8 over 256 rows,
<= 8 us, and the two-way fold, bf16 ``[M, 16, 16, 512]``), recording ``extra.shape`` for
``perf/kernel_report.py --measured``. Timing is ``mqnc.measure.time_fn`` (CUDA events around
each call); the later timing phase (issue 12 item 7) moves kernels to do_bench.
"""

from __future__ import annotations

from mqnc.base.runtime import use_interpreter_without_cuda
from mqnc.measure.options import bench_parser, finish, parse_bench_args
from perf.targets import TARGETS


def main(argv=None) -> int:
    ap = bench_parser(__doc__, reps="50 on a GPU, 10 on a CPU")
    ap.add_argument("--goals", action="store_true", help="issue 13's goal shapes instead")
    args = parse_bench_args(ap, argv)
    use_interpreter_without_cuda()
    import torch
    from tqdm import tqdm

    from mqnc.measure import record, time_fn
    from mqnc.reference import merge_reference

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    Ms = [1, 2, 4, 8] if not args.quick else [2, 8]
    rows = [16, 128, 1024, 16384] if not args.quick else [16, 1024]
    D = 512
    cases = [(M, R, 1, {}) for M in Ms for R in rows]  # (M, B, H, extra): rows as B, H = 1
    if args.goals:
        from mqnc.triton_kernels._variants import GOALS

        cases = [
            (s.M, s.B, s.H, {"shape": s.label, "goal": s.goal}) for s in GOALS if s.op == "merge"
        ]
    if cuda:
        from mqnc.triton_kernels import merge_partials

        fn, backend = (lambda o, l: merge_partials(o, l, check_lse=False)), "triton"
    else:
        fn = lambda o, l: merge_reference(o, l, dtype=torch.float32)  # noqa: E731
        backend = "torch-reference"
    for M, B, H, extra in tqdm(cases, desc="bench_merge"):
        R = B * H
        o = torch.randn(M, B, H, D, device=dev).to(dtype)
        lse = torch.randn(M, B, H, device=dev)
        elt = o.element_size()
        nbytes = M * R * (D * elt + 4) + R * (D * elt + 4)
        p = time_fn(
            lambda o=o, lse=lse: fn(o, lse),
            warmup=args.warmup,
            reps=args.reps or (50 if cuda else 10),
        )
        record(
            "merge",
            f"M={M}",
            R,
            p,
            x_name="rows",
            nbytes=nbytes,
            backend=backend,
            path=args.out,
            extra={"M": M, "Dv": D, "dtype": str(dtype)[6:], **extra},
        )
        print(f"merge M={M} rows={R}: p50 {p[1]:.1f} us ({nbytes / p[1] / 1e3:.2f} GB/s)")
    return finish(args, TARGETS)


if __name__ == "__main__":
    raise SystemExit(main())
