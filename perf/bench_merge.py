"""Benchmark the M-way merge (``merge_partials``) against the torch reference.

``python -m perf.bench_merge`` with the flags every benchmark takes (``--quick --reps --warmup
--out FILE | --record --check``, :mod:`mqnc.measure.options`).

Sweeps M (partials: holders a query was routed to, §5.4 Fig. 4a's 1..8) and the rows B*H at the
production Dv = 512. Bytes moved once: M*B*H*(Dv*elt + 4) read + B*H*(Dv*elt + 4) written. On a
GPU it times the Triton kernel (CUDA events); on the CPU the torch fp32 reference path
(``backend=torch-reference``): interpreter timings say nothing about the kernel.
"""

from __future__ import annotations

from mqnc.base.runtime import use_interpreter_without_cuda
from mqnc.measure.options import bench_parser, finish, parse_bench_args
from perf.targets import TARGETS


def main(argv=None) -> int:
    args = parse_bench_args(bench_parser(__doc__, reps="50 on a GPU, 10 on a CPU"), argv)
    use_interpreter_without_cuda()
    import torch
    from tqdm import tqdm

    from mqnc.measure import record, time_fn

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    Ms = [1, 2, 4, 8] if not args.quick else [2, 8]
    rows = [16, 128, 1024, 16384] if not args.quick else [16, 1024]
    D = 512
    if cuda:
        from mqnc.triton_kernels import merge_partials

        fn, backend = (lambda o, l: merge_partials(o, l, check_lse=False)), "triton"
    else:
        from mqnc.reference import merge_reference

        fn = lambda o, l: merge_reference(o, l, dtype=torch.float32)  # noqa: E731
        backend = "torch-reference"
    for M in tqdm(Ms, desc="bench_merge"):
        for R in rows:
            o = torch.randn(M, R, 1, D, device=dev).to(dtype)
            lse = torch.randn(M, R, 1, device=dev)
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
                extra={"M": M, "Dv": D, "dtype": str(dtype)[6:]},
            )
            print(f"merge M={M} rows={R}: p50 {p[1]:.1f} us ({nbytes / p[1] / 1e3:.2f} GB/s)")
    return finish(args, TARGETS)


if __name__ == "__main__":
    raise SystemExit(main())
