"""Benchmark the delta-rotation splice (§2.2, §7): one launch for all layers vs one per layer.

The paper measured fetch's splice at 2.77/2.78/2.91/3.06 ms for c_t = 55/1024/2048/4096 on an
H100 (DeepSeek-V2-Lite, L = 27), ~80% of it a launch-bound per-layer delta-rotation kernel.
This bench times, in the same run and on the same inputs (bf16, 576 = 512 + 64, YaRN
frequencies, per-token delta, scattered slots):

``one-launch``   :func:`mqnc.triton_kernels.splice.rotate.rope_splice` over all L layers.
``per-layer``    the same kernel launched once per layer (the paper's structure).
``persistent``   the persistent-grid candidate (:func:`mqnc.triton_kernels.splice.rotate.
                 persistent_splice`: SMs x 4 programs striding over the (token tile, layer)
                 pairs), the same pool bit for bit; ``extra.candidate_of`` names the goal shape.
``torch``        the torch path (cos/sin table from float64 angles, gather-rotate-scatter),
                 batched over layers; ``torch-per-layer`` the same, one layer at a time.

On a GPU the Triton variants run compiled; on a CPU they run under the interpreter at the
smallest size only (c_t = 55), and the torch variants at every size. ``bytes`` is what the
splice must move: each entry read once and written once, ``2 * L * c_t * 576 * 2`` bytes. The
goal on an H200: 27 layers x 2048 tokens in <= 60 us (>= 50x under ~3 ms).

Usage: ``python -m perf.bench_splice [--goals | --tiny] [--c-t 55,2048] [--layers 27]`` with the
flags every benchmark takes (``--quick --reps --warmup --out FILE | --record --check``,
:mod:`mqnc.measure.options`).

``--kv-dtype fp8`` splices FP8 entries instead (DeepSeek-V3.2's 656 bytes, docs/fp8-cache.md:
the chunk quantized from the same bf16 draw; latent and scales copied bit for bit, only the bf16
RoPE part rotated), ``both`` each point in bf16 and then in FP8: records carry
``extra.kv_dtype`` and ``extra.entry_bytes``, their variant gains ``,fp8``, ``bytes`` count 656
per entry (``2 * L * c_t * 656``), an FP8 goal record's ``extra.shape`` is the goal's label with
`` fp8``. The torch variants splice the entries read as bf16 (``splice.rotate.fp8_entry_views``: the
prefix is 264 bf16 values copied, the last 64 rotated), the same torch code.

``--goals`` times the production goal shapes (``sm90.variants.GOALS``: 27 layers x 2048 tokens, one
int delta for the chunk as the requester's fetch does, and one delta per token), recording
``extra.shape`` for ``mqnc/measure/kernel_report.py --measured``; ``--tiny`` (the dry run of
``perf/gpu_check.sh``) cuts them to 2 layers x 55 tokens, where the Triton variants run
interpreted without a GPU.

Timing is ``mqnc.measure.time_kernel`` (``extra.timing``): on a GPU each variant (checks off,
``validate=False``) over enough input sets that one pass moves twice the L2 (the goal shape's
127 MB needs one), captured in one CUDA graph and replayed between CUDA events (the torch
variants, whose calls copy index tables to the device, by ``do_bench``); the host cost of a
call beside it.
"""

from __future__ import annotations

from mqnc.base.runtime import use_interpreter_without_cuda
from mqnc.measure.options import (
    bench_parser,
    finish,
    hidden_alias,
    int_list,
    parse_bench_args,
    positive_int,
)
from mqnc.model.kv_format import kv_bytes_per_token
from perf.speed_targets import TARGETS

PAPER_SPLICE_US = {55: 2770.0, 1024: 2780.0, 2048: 2910.0, 4096: 3060.0}  # §7, H100
D_QK, D_V = 576, 512
FP8_ENTRY = kv_bytes_per_token("fp8_e4m3", D_V, D_QK - D_V)  # 656 B: DeepSeek-V3.2's entry
KV_DTYPES = {"bf16": ("bf16",), "fp8": ("fp8",), "both": ("bf16", "fp8")}
BLOCK_SIZE = 64
TINY_LAYERS, TINY_CT = 2, 55  # --tiny: the dry run's cut of a goal shape


def splice_torch(chunk, pool, slot_mapping, delta, rope, per_layer: bool = False):
    """The splice in torch ops: float64 angles -> float32 cos/sin, rotate, scatter. FP8
    entries (uint8) are spliced as the bf16 rows they read as (prefix copied, RoPE rotated)."""
    import torch

    if chunk.dtype == torch.uint8:
        splice_torch(chunk.view(torch.bfloat16), pool.view(torch.bfloat16), slot_mapping, delta,
                     rope, per_layer)  # fmt: skip
        return pool

    L, ct, D = chunk.shape
    d_c = D - rope.rope_dim
    first, second = rope.pair_indices()
    i1 = torch.tensor(first, device=chunk.device) + d_c
    i2 = torch.tensor(second, device=chunk.device) + d_c
    freq = torch.tensor(rope.inv_freq, dtype=torch.float64, device=chunk.device)
    flat = pool.view(L, -1, D)

    def one(src, dst):
        d = (
            delta
            if isinstance(delta, torch.Tensor)
            else torch.full((ct,), delta, device=src.device)
        )
        ang = d.to(torch.float64)[:, None] * freq
        c, s = torch.cos(ang).float(), torch.sin(ang).float()
        x1, x2 = src[..., i1].float(), src[..., i2].float()
        rows = src.clone()
        rows[..., i1] = (x1 * c - x2 * s).to(src.dtype)
        rows[..., i2] = (x2 * c + x1 * s).to(src.dtype)
        dst[..., slot_mapping, :] = rows

    if per_layer:
        for layer in range(L):
            one(chunk[layer], flat[layer])
    else:
        one(chunk, flat)
    return pool


def run(
    ct_list,
    layers: int,
    quick: bool,
    record_results: bool = True,
    delta_kind: str = "[T]",
    shape="",
    kv: str = "bf16",
    **timing,
) -> list[dict]:
    """Time every variant at each c_t over a cache of format ``kv`` (``"bf16"``, ``"fp8"``);
    ``timing``: ``path`` (results file), ``reps``, ``warmup`` (None: the defaults in
    ``_bench_ct``)."""
    use_interpreter_without_cuda()
    import torch

    from mqnc.model import RopeSpec

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    rope = RopeSpec.from_preset("deepseek-v2-lite")
    out = []
    for ct in ct_list:
        out += _bench_ct(
            ct, layers, quick, record_results, device, cuda, rope, delta_kind, shape, kv, **timing
        )
    return out


def _fp8(rows, kernel: bool):
    """Cache rows ``[..., 576]`` as FP8 entries ``[..., 656]`` uint8 (the Triton quantizer when
    the kernels run, else its fp64 reference: the same bytes)."""
    if kernel:
        from mqnc.triton_kernels.fp8.quant import fp8_quantize

        return fp8_quantize(rows, D_V)
    from mqnc.reference.fp8_ref import fp8_quantize_reference

    return fp8_quantize_reference(rows, D_V)


def _inputs(ct, layers, device, seed, delta_kind, kv="bf16", kernel=False):
    """One input set: chunk ``[L, ct, 576]`` bf16 (``kv`` "fp8": ``[L, ct, 656]`` uint8 FP8
    entries of the same draw), pool (twice the blocks), scattered slots, per-token delta (or
    one int for the chunk, the requester's fetch)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    chunk = torch.randn(layers, ct, 576, generator=g).to(torch.bfloat16).to(device)
    num_blocks = 2 * (-(-ct // BLOCK_SIZE))
    if kv == "fp8":
        chunk = _fp8(chunk, kernel)
    pool = torch.zeros(layers, num_blocks, BLOCK_SIZE, chunk.shape[-1], dtype=chunk.dtype,
                       device=device)  # fmt: skip
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:ct].to(device)
    delta = torch.randint(-100_000, 100_000, (ct,), generator=g).to(device)
    if delta_kind == "int":
        delta = int(delta[0])
    return chunk, pool, slots, delta


def _variants(rope, layers, triton_backend):
    """``{name: (backend, fn(chunk, pool, slots, delta))}``: the Triton variants when
    ``triton_backend`` is given, and the torch ones."""
    from mqnc.triton_kernels.splice.rotate import persistent_splice, rope_splice

    variants = {}
    if triton_backend:
        variants["one-launch"] = (
            triton_backend,
            lambda c, p, s, d: rope_splice(c, p, s, d, rope, validate=False),
        )

        def per_layer(c, p, s, d):
            for layer in range(layers):
                rope_splice(c[layer : layer + 1], p[layer : layer + 1], s, d, rope, validate=False)

        variants["per-layer"] = (triton_backend, per_layer)

        def persistent(c, p, s, d):
            with persistent_splice():
                rope_splice(c, p, s, d, rope, validate=False)

        variants["persistent"] = (triton_backend, persistent)
    variants["torch"] = ("torch", lambda c, p, s, d: splice_torch(c, p, s, d, rope))
    variants["torch-per-layer"] = (
        "torch",
        lambda c, p, s, d: splice_torch(c, p, s, d, rope, per_layer=True),
    )
    return variants


def _check_same_pool(variants, inputs) -> None:
    """Correctness of what is timed: every variant must produce the same pool."""
    import torch

    chunk, pool, slots, delta = inputs
    pools = {}
    for name, (_, fn) in variants.items():
        pool.zero_()
        fn(chunk, pool, slots, delta)
        pools[name] = pool.clone()
    ref = pools["torch"]
    rows = (lambda p: p.view(torch.bfloat16)) if pool.dtype == torch.uint8 else (lambda p: p)
    keep = rows(ref).shape[-1] - 64  # bf16 values copied: latent (FP8: latent and scales)
    for name, p in pools.items():
        if not torch.equal(
            rows(p)[..., :keep].view(torch.int16), rows(ref)[..., :keep].view(torch.int16)
        ):
            raise AssertionError(f"{name}: latent dims differ from the torch path (bit for bit)")
        err = (rows(p)[..., keep:].float() - rows(ref)[..., keep:].float()).abs().max().item()
        if err > 0.0625:  # one bf16 ulp at |x| < 8 (two independent roundings)
            raise AssertionError(f"{name}: rope dims differ from the torch path by {err}")


def _bench_ct(
    ct,
    layers,
    quick,
    record_results,
    device,
    cuda,
    rope,
    delta_kind="[T]",
    shape="",
    kv="bf16",
    path=None,
    reps=None,
    warmup=None,
) -> list[dict]:
    from mqnc.base.runtime import kernel_mode
    from mqnc.measure import input_sets, l2_bytes, record, time_kernel

    entry = FP8_ENTRY if kv == "fp8" else 576 * 2
    nbytes = 2 * layers * ct * entry
    backend = None
    if cuda or ct <= 64:
        backend = "triton" if kernel_mode() == "compiled" else "interpreter"
    variants = _variants(rope, layers, backend)
    n_sets = input_sets(nbytes, l2_bytes(device))
    sets = [_inputs(ct, layers, device, ct + i, delta_kind, kv, cuda) for i in range(n_sets)]
    _check_same_pool(variants, sets[0])

    interp = not cuda
    reps = reps or (3 if (quick or interp) else 20)
    if warmup is None:
        warmup = 0 if interp else (1 if quick else 3)
    out, times = [], {}
    for name, (backend, fn) in variants.items():
        calls = [lambda fn=fn, x=x: fn(*x) for x in sets]
        if backend == "interpreter":  # seconds per call: the correctness call warmed it up
            times[name] = (backend, time_kernel(calls, warmup=0, reps=1, cuda=False))
        else:  # the torch variants copy index tables to the device: not capturable
            t = time_kernel(calls, working_set_bytes=nbytes, warmup=warmup, reps=reps, cuda=cuda,
                            graph=backend != "torch", checks="off")  # fmt: skip
            times[name] = (backend, t)
    for name, (backend, t) in times.items():
        base = times["torch-per-layer" if backend == "torch" else "per-layer"][1]
        extra = {
            "layers": layers,
            "dtype": "bf16",
            "kv_dtype": kv,
            "entry_bytes": entry,
            "delta": "per-token" if delta_kind != "int" else "int",
            **({"shape": shape} if shape and name == "one-launch" else {}),
            **({"candidate_of": shape} if shape and name == "persistent" else {}),
            "block_size": BLOCK_SIZE,
            "speedup_vs_per_layer": base.p50 / t.p50,
            "paper_us_h100": PAPER_SPLICE_US.get(ct),
            "timing": t.how,
        }
        variant = name + (",fp8" if kv == "fp8" else "")
        rec = dict(
            bench="splice", variant=variant, x=ct, p=t.percentiles, backend=backend, extra=extra
        )
        if record_results:
            record(
                "splice",
                variant,
                ct,
                t.percentiles,
                x_name="ct",
                nbytes=nbytes,
                backend=backend,
                extra=extra,
                path=path,
            )
        out.append(rec)
        gbps = nbytes / (t.p50 * 1e-6) / 1e9
        print(
            f"ct={ct:5d} L={layers} {variant:20s} [{backend:11s}] p50 {t.p50:10.1f} us  "
            f"{gbps:7.2f} GB/s  x{extra['speedup_vs_per_layer']:.2f} vs per-layer"
        )
    return out


def main(argv=None) -> int:
    p = bench_parser(
        __doc__,
        reps="20 on a GPU, 3 on a CPU or with --quick",
        warmup="3 on a GPU, 1 with --quick, 0 on a CPU",
        tiny=True,
    )
    p.add_argument("--c-t", type=int_list, default=[55, 1024, 2048, 4096], help="chunk tokens")
    hidden_alias(p, "--ct", "c_t", type=int_list)
    p.add_argument("--layers", type=positive_int, default=27)
    p.add_argument("--goals", action="store_true", help="the production goal shapes instead")
    p.add_argument(
        "--kv-dtype",
        choices=tuple(KV_DTYPES),
        default="bf16",
        help="the cache format: bf16, fp8 (DeepSeek-V3.2's 656-byte entries: latent and scales "
        "copied, RoPE rotated) or both",
    )
    args = parse_bench_args(p, argv)
    timing = dict(path=args.out, reps=args.reps, warmup=args.warmup)
    use_interpreter_without_cuda()  # before the goal shapes import triton
    for kv in KV_DTYPES[args.kv_dtype]:
        if not (args.goals or args.tiny):
            run(args.c_t, args.layers, args.quick, kv=kv, **timing)
            continue
        from mqnc.triton_kernels.sm90.variants import GOALS

        for s in (s for s in GOALS if s.op == "splice"):
            ct, L = (min(s.ct, TINY_CT), min(s.L, TINY_LAYERS)) if args.tiny else (s.ct, s.L)
            label = "" if args.tiny else s.label + (" fp8" if kv == "fp8" else "")
            run([ct], L, args.quick, delta_kind=s.delta, shape=label, kv=kv, **timing)
    return finish(args, TARGETS)


if __name__ == "__main__":
    raise SystemExit(main())
