"""A holder's batched partial attention over N routed requesters (Fig. 4(b)) and its K-stream
staging pool for fetch replies (Fig. 5(b)).

``python -m perf.bench_holder [--n 1,8,32] [--heads 16,128] [--c-t 2048] [--streams 1,4,8,16]``
plus the flags every benchmark takes (``--quick --reps --warmup --out FILE | --record --check``,
:mod:`mqnc.measure.options`) and ``--tiny``.

What is timed (§6.2, §6.3):

- ``bench="holder"``, ``x_name="requesters"``, ``x`` = N in 1..256, ``variant`` =
  ``"h_q=<H> c_t=<c_t>"``: N requesters each route one decode token's ``H`` absorbed query
  rows to one holder, which answers them in ONE partial-attention call over its resident
  ``c_t``-token chunk (what :class:`mqnc.serving.Holder`'s dispatcher does: ``q [N, H, 576]``,
  one block-table row per requester, all pointing at the chunk). On a GPU the call is
  :func:`mqnc.triton_kernels.mla_decode_partial` (bf16, ``check_inputs=False`` as the holder
  calls it, ``backend="triton"``), timed by ``mqnc.measure.time_kernel``: input sets rotated
  past the L2, CUDA-graph replays between events, the host cost of a call beside it
  (``extra.timing``). ``--tiny`` (``perf/gpu_check.sh --dry-run``) runs N 1, 2 at c_t 128 with
  the kernel even without a GPU (interpreted).
  On the CPU the Triton kernel would run under the interpreter (timings of the interpreter
  say nothing about the kernel), and ``Holder``'s compute is not pluggable, so the CPU path
  times :func:`batched_partial_torch` directly (``backend="torch-reference"``): the same
  batched partial in torch fp32, the chunk's entries gathered once and one matmul for all
  ``N H`` rows (it agrees with the fp64 reference ``mla_decode_reference``; the smoke test
  checks it).
- ``bench="holder"``, ``variant="staging"``, ``x_name="streams"``, ``x`` = K in {1, 4, 8, 16}:
  GPU only. R concurrent fetch requests each stage one chunk (``c_t`` tokens x ``L`` layers,
  gathered from the holder's paged pool) into its own staging buffer with a device-to-device
  copy, the copies issued round-robin over a pool of K CUDA streams; timed from the first
  issue to the last copy's completion (per-batch p50; ``extra`` has the per-request time).
  On the CPU nothing is recorded for it (there are no streams to pool).
"""

from __future__ import annotations

from perf.speed_targets import TARGETS

N_FULL = [1, 2, 4, 8, 16, 32, 64, 128, 256]
N_QUICK = [1, 8, 32]
K_STREAMS = [1, 4, 8, 16]


def softmax_scale_of(geometry) -> float:
    """The model's softmax scale: its preset's RoPE spec's (YaRN's mscale included; for
    DeepSeek-V2-Lite ``192**-0.5 * 1.2608**2``, DESIGN.md), else ``(qk_nope + d_r)**-0.5``
    (a geometry from a config without a preset)."""
    from mqnc.model import RopeSpec

    try:
        return RopeSpec.from_preset(geometry.name).softmax_scale
    except ValueError:
        return (geometry.qk_nope_head_dim + geometry.d_r) ** -0.5


def holder_inputs(n: int, heads: int, c_t: int, geometry, *, device="cpu", dtype=None, seed=0):
    """The holder's batched call for ``n`` requesters over one resident chunk.

    Returns
    -------
    (q, kv_pool, block_table, cache_seqlens)
        ``q [n, heads, d_qk]``, ``kv_pool [num_blocks, 64, d_qk]`` (entries N(0, 0.25)),
        ``block_table [n, ceil(c_t / 64)]`` int32 (every row the chunk's blocks) and
        ``cache_seqlens [n]`` int32 (= c_t).
    """
    import torch

    dtype = dtype or (torch.bfloat16 if device != "cpu" else torch.float32)
    g = torch.Generator().manual_seed(seed)
    block = 64
    nb = -(-c_t // block)
    pool = (0.5 * torch.randn(nb + 1, block, geometry.d_qk, generator=g)).to(dtype)
    q = torch.randn(n, heads, geometry.d_qk, generator=g).to(dtype)
    # The chunk sits in blocks 1..nb (block 0 unused), as a pool with other tenants would.
    bt = torch.arange(1, nb + 1, dtype=torch.int32)[None].expand(n, -1).contiguous()
    lens = torch.full((n,), c_t, dtype=torch.int32)
    return q.to(device), pool.to(device), bt.to(device), lens.to(device)


def batched_partial_torch(q, kv_pool, block_table, cache_seqlens, softmax_scale, d_v=512):
    """The holder's batched partial in torch fp32 when every row attends the same chunk.

    ``q [N, H, d_qk]``; all rows of ``block_table`` equal and all ``cache_seqlens`` equal (the
    Fig. 4(b) workload; a ValueError otherwise). Returns ``o [N, H, d_v]`` and natural-log
    ``lse [N, H]``, float32.
    """
    import torch

    if not bool((block_table == block_table[:1]).all()) or not bool(
        (cache_seqlens == cache_seqlens[:1]).all()
    ):
        raise ValueError("block_table: expected every requester to attend the same chunk")
    n, h, d = q.shape
    c_t = int(cache_seqlens[0])
    kv = kv_pool[block_table[0].long()].reshape(-1, d)[:c_t].float()
    s = (q.reshape(n * h, d).float() @ kv.T) * softmax_scale
    lse = torch.logsumexp(s, dim=1)
    o = torch.exp(s - lse[:, None]) @ kv[:, :d_v]
    return o.reshape(n, h, d_v), lse.reshape(n, h)


def _staging(args, geometry, out) -> None:
    import torch

    from mqnc.measure import record

    if not torch.cuda.is_available():
        print(
            "bench_holder: staging pool not measured: the K-stream pool stages fetch replies "
            "with device-to-device copies on K CUDA streams (§6.2); this machine has no CUDA "
            "device, so there is nothing to pool (no records written)"
        )
        return
    g = geometry
    c_t, requests = args.staging_c_t, args.requests
    nb = -(-c_t // 64)
    pool = torch.randn(g.layers, nb * 4, 64, g.d_qk, device="cuda").to(torch.bfloat16)
    blocks = torch.randperm(nb * 4, device="cuda")[:nb]
    staged = [
        torch.empty(g.layers, nb, 64, g.d_qk, device="cuda", dtype=torch.bfloat16)
        for _ in range(requests)
    ]
    nbytes = requests * 2 * g.layers * nb * 64 * g.d_qk * 2
    for k in args.streams:
        streams = [torch.cuda.Stream() for _ in range(k)]

        def run(streams=streams):
            main = torch.cuda.current_stream()
            for i, dst in enumerate(staged):
                s = streams[i % len(streams)]
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    torch.index_select(pool, 1, blocks, out=dst)
            for s in streams:
                main.wait_stream(s)

        from mqnc.measure import time_fn

        p = time_fn(run, warmup=args.warmup, reps=args.reps)  # CUDA events around each batch
        record(
            "holder",
            "staging",
            k,
            p,
            x_name="streams",
            nbytes=nbytes,
            backend="torch-cuda",
            extra={
                "requests": requests,
                "c_t": c_t,
                "layers": g.layers,
                "per_request_p50_us": p[1] / requests,
                "what": "R chunk stagings (paged gather, D2D) round-robin over K streams",
                "timing": {"method": "cuda-events", "samples": args.reps, "what": "one batch"},
            },
            path=out,
        )
        print(
            f"staging K={k}: {requests} requests p50 {p[1]:.0f} us ({nbytes / p[1] / 1e3:.0f} GB/s)"
        )


def _parser():
    """The command line: every benchmark's flags, then the two sweeps' and the model's."""
    from mqnc import measure as H

    ap = H.bench_parser(
        __doc__,
        reps="50 on a GPU, 5 on a CPU, 3 with --quick, 2 with --tiny",
        warmup="3 on a GPU, 1 on a CPU, 0 with --tiny",
        tiny=True,
    )
    ap.add_argument("--n", type=H.int_list, default=None, help="requesters N (1,2,4,...,256)")
    ap.add_argument(
        "--heads", type=H.int_list, default=None, help="h_q per requester (16; GPU: 16,128)"
    )
    ap.add_argument("--c-t", type=H.positive_int, default=2048, help="resident chunk tokens (2048)")
    H.hidden_alias(ap, "--ct", "c_t", type=H.positive_int)
    ap.add_argument(
        "--streams", type=H.int_list, default=K_STREAMS, help="staging pool sizes K (GPU only)"
    )
    ap.add_argument(
        "--requests", type=H.positive_int, default=32, help="concurrent fetches staged (32)"
    )
    ap.add_argument(
        "--staging-c-t", type=H.positive_int, default=2048, help="tokens per staged chunk (2048)"
    )
    H.hidden_alias(ap, "--staging-ct", "staging_c_t", type=H.positive_int)
    ap.add_argument(
        "--model",
        type=H.model_arg,
        default="deepseek-v2-lite",
        metavar="NAME|CONFIG",
        help="model preset or Hugging Face config.json (deepseek-v2-lite)",
    )
    return ap


def _batched_call(g, cuda: bool, kernel: bool):
    """The holder's batched partial ``call(q, pool, bt, lens)`` and its backend name: the
    Triton kernel (compiled on a GPU, interpreted otherwise), else the torch fp32 one."""
    scale = softmax_scale_of(g)
    if kernel:
        from mqnc.triton_kernels.mla.decode import mla_decode_partial

        def call(q, pool, bt, lens):
            return mla_decode_partial(
                q, pool, bt, lens, softmax_scale=scale, d_v=g.d_v, check_inputs=False
            )

        return call, "triton" if cuda else "interpreter"

    def call(q, pool, bt, lens):
        return batched_partial_torch(q, pool, bt, lens, scale, g.d_v)

    return call, "torch-reference"


def _requesters(args, g, cuda: bool) -> None:
    """Fig. 4(b): one record per (heads, N) of the holder's batched call over N requesters."""
    import torch
    from tqdm import tqdm

    from mqnc.measure import input_sets, l2_bytes, record, time_kernel

    ns = args.n or (N_QUICK if args.quick else N_FULL)
    heads = args.heads or ([16, 128] if cuda else [16])
    kernel = cuda or args.tiny
    call, backend = _batched_call(g, cuda, kernel)
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if kernel else torch.float32
    l2 = l2_bytes(dev)
    for h in heads:
        for n in tqdm(ns, desc=f"bench_holder h_q={h}"):
            nbytes = args.c_t * g.kv_bytes_per_token_layer + n * h * g.qp_row_bytes
            calls = []
            for i in range(input_sets(nbytes, l2)):
                x = holder_inputs(n, h, args.c_t, g, device=dev, dtype=dtype, seed=i)
                calls.append(lambda x=x: call(*x))
            t = time_kernel(
                calls,
                working_set_bytes=nbytes,
                warmup=args.warmup,
                reps=args.reps,
                cuda=cuda,
                checks="off" if kernel else "n/a",
            )
            record(
                "holder",
                f"h_q={h} c_t={args.c_t}",
                n,
                t.percentiles,
                x_name="requesters",
                nbytes=nbytes,
                backend=backend,
                extra={
                    "heads": h,
                    "c_t": args.c_t,
                    "rows": n * h,
                    "dtype": str(dtype)[6:],
                    "timing": t.how,
                },
                path=args.out,
            )
            print(f"holder h_q={h} N={n}: p50 {t.p50:.0f} us [{backend}]")


def main(argv=None) -> int:
    from mqnc import measure as H

    args = H.parse_bench_args(_parser(), argv)
    if args.tiny:  # the dry run: N 1, 2 at c_t 128, the kernel
        args.n, args.heads, args.c_t = args.n or [1, 2], args.heads or [16], 128
    from mqnc.base.runtime import use_interpreter_without_cuda

    use_interpreter_without_cuda()
    import torch

    cuda = torch.cuda.is_available()
    args.reps = args.reps or (50 if cuda else (2 if args.tiny else (3 if args.quick else 5)))
    if args.warmup is None:
        args.warmup = 0 if args.tiny else (3 if cuda else 1)
    _requesters(args, args.model, cuda)
    _staging(args, args.model, args.out)
    return H.finish(args, TARGETS)


if __name__ == "__main__":
    raise SystemExit(main())
