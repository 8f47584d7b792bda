"""The default dense decode path, checked and timed as users call it: exactness against fp64
first, then device time at the goal shapes, then the host time of a user's loop.

``python -m perf.bench_fastpath [--dry-run] [--only warm,exact,device,sparse,fp8,host]
[--jobs 16]`` with the flags every benchmark takes (``--reps --warmup --out FILE | --record
--check``);
``perf/gpu_fastpath.sh`` runs it on an H200 (one call) and its dry run on a CPU.

0. **warm**: every case below launched once by ``--jobs`` worker processes sharing Triton's
   on-disk cache, so that no compile (~30 s per specialisation of the Gluon kernel on the
   H200's host) lands in a timed call.

1. **exact** (bench ``fastpath_exact``): every case through the public default path
   (``mla_decode_partial``, FlashMLA's ``mla_decode_with_kvcache``, ``mla_decode_partial_csr``,
   a plan's ``run``, ``out=``, a CUDA-graph replay of a plan), compared with the fp64 reference
   (``mqnc.testing``'s ``("mla", bf16)`` / ``("mla_lse", fp32)`` bounds): 128 heads over lengths
   1 / 65 / 200, split and unsplit; 16, 64 and 100 heads (partial head blocks); FlashMLA's
   ``s_q`` 2 causal; CSR tables with and without ``kv_lens``; pages of 128; FlashInfer's split
   ``ckv`` / ``kpe`` layout by the table's choice and with the see-saw's split-cache variant
   forced (opt-in until such a record verifies it). Pools hold NaN past
   each length and tables -1 past each row's pages. Each record says the backend the dispatch
   table chose (``extra.backend``: ``gluon`` on an sm_90 with its evidence, else ``tl``), the
   kernel, and for the Gluon kernel its source fingerprint (``extra.fingerprint``, what
   ``mqnc.triton_kernels.evidence.VERIFIED`` records) and the Triton version; ``ok`` false on a
   mismatch (printed MISMATCH; the run then exits 1).
2. **device** (bench ``fastpath``): the default path's plan run, checks off, CUDA-graph timed
   over input sets larger than twice the L2 (``mqnc.measure.time_kernel``), at the goal shapes:
   H 128 B 64 c_t 8192, B 8 c_t 32768, B 128 c_t 4096; H 64 B 32 c_t 8192 (TFLOP/s, ``2 B H c_t
   (576 + 512)`` flops); H 16 B 16 / 64 c_t 32768 (TB/s of the bytes moved once); H 16 B 1 c_t
   2048 (decode and its split combine, us). Each timed case is first compared with fp64 on its
   first input set (a subset of rows, ``extra.vs_fp64``).
3. **sparse** (bench ``fastpath_sparse``, GPU only): top-2048 at H 128, B 1 / 8 / 64, the
   table's choice and the sparse gather see-saw forced (opt-in until these records verify it),
   each checked against fp64 on its first token, then CUDA-graph timed.
4. **fp8** (bench ``fastpath_fp8``, GPU only): DeepSeek-V3.2's 656-byte FP8 cache at the FP8
   goals' shapes (sparse top-2048 H 128 B 8 / 64; dense H 16 B 16 c_t 32768, H 128 B 64 c_t
   8192): the table's choice, the FP8 see-saw forced (opt-in until these records verify it)
   and the bf16 twin over the same values, each checked against fp64 over the dequantized
   cache first, then CUDA-graph timed. The exact stage runs the FP8 calls too (dense with
   lengths 0 / 1 / partial pages and ``s_q`` 2 causal, sparse with -1 slots, a partial top-k
   and an empty row, 0xFF bytes in every entry not attended), forced and by the table.
5. **host** (bench ``host_loop``): a user's loop, as a user writes it: 200 back-to-back calls on
   the same tensors, no sync between them, the host time per call (wall clock of the loop over
   its calls; the device queue absorbs the launches) and the process CPU time per call, for
   ``mla_decode_with_kvcache`` and ``mla_decode_partial`` with checks off and on, and
   ``plan.run``, at H 16 B 1 c_t 2048 and H 128 B 8 c_t 32768.

The goals are ``perf/speed_targets.py``'s ``FASTPATH_TARGETS`` (checked with ``--check``). The
dry run (``--dry-run``, the interpreter): the same cases and code at tiny sizes, the backend the
table picks there (``tl``), a few repetitions; it checks the wiring, the comparisons and the
records, not the Gluon kernel.
"""

from __future__ import annotations

import math
import os
import time

SCALE = 576**-0.5
DENSE = [  # (H, B, c_t, what the goal bounds)
    (128, 64, 8192, "tflops"),
    (128, 8, 32768, "tflops"),
    (128, 128, 4096, "tflops"),
    (64, 32, 8192, "tflops"),
    (16, 16, 32768, "tbps"),
    (16, 64, 32768, "tbps"),
    (16, 1, 2048, "us"),
]
HOST = [(16, 1, 2048), (128, 8, 32768)]


def _pool(lengths, page, gen, dtype, device, poison=True):
    """A shuffled paged pool: NaN past each length, table -1 past each row's pages."""
    import torch

    pages = [max(math.ceil(n / page), 0) for n in lengths]
    n_blocks = sum(pages) + 1
    pool = torch.randn(n_blocks, page, 576, generator=gen).to(dtype)
    perm = torch.randperm(n_blocks, generator=gen)
    table = torch.full((len(lengths), max(max(pages), 1)), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(lengths):
        for j in range(pages[b]):
            table[b, j] = int(perm[k])
            if poison and (j + 1) * page > n:
                pool[int(perm[k]), n - j * page :] = float("nan")
            k += 1
    if poison:
        for blk in perm[k:].tolist():
            pool[blk] = float("nan")
    lens = torch.tensor(lengths, dtype=torch.int32)
    return pool.to(device), table.to(device), lens.to(device)


def _reference(q, pool, table, lens, s_q=1, causal=False):
    """fp64 ``(o [R, H, 512], lse [R, H])`` of rows ``q [R, H, 576]`` (``s_q`` rows a
    sequence; FlashMLA's causal rule)."""
    import torch

    from mqnc.reference.attention_ref import mla_decode_reference

    R = q.shape[0]
    rows = torch.arange(R, device=q.device)
    n = lens.long()[rows // s_q] - ((s_q - 1 - rows % s_q) if causal else 0)
    safe = torch.where(table < 0, torch.zeros_like(table), table)
    return mla_decode_reference(
        q.double(), pool.double(), safe[rows // s_q], n.clamp(min=0).to(torch.int32), SCALE
    )


def _compare(o, lse, ref) -> tuple[bool, str]:
    """Both outputs against fp64 at the tolerance table's bounds: (ok, what was seen)."""
    import torch

    from mqnc.testing import assert_close, tolerance

    try:
        so = assert_close(o.float(), ref[0], tolerance("mla", torch.bfloat16), name="o")
        sl = assert_close(lse.float(), ref[1], tolerance("mla_lse", "float32"), name="lse")
    except AssertionError as exc:
        return False, str(exc).splitlines()[0][:300]
    return True, f"o {so}; lse {sl}"


def _facts(plan) -> dict:
    """What a record says of the path that ran: backend, kernel, fingerprint, Triton."""
    import triton

    from mqnc.triton_kernels import evidence

    backend = getattr(plan, "backend", "tl")
    facts = {"backend": backend, "triton": triton.__version__}
    kernel = getattr(plan, "kernel", None)
    if backend == "gluon" and kernel in evidence.KERNELS:
        facts["kernel"] = kernel
        facts["fingerprint"] = evidence.current_fingerprint(kernel)
    return facts


def exact_specs(dry: bool, cuda: bool) -> list[dict]:
    """The exactness cases as data (module docstring; what :func:`build` makes and the warm-up
    workers rebuild): ``kind`` (``partial``, ``flashmla``, ``csr``, ``plan``, ``out``,
    ``graph``), heads, lengths, splits, page, ``s_q``, ``kv_lens``."""
    heads = [16, 64] if dry else [128, 16, 64, 100]
    lengths = (1, 70) if dry else (1, 65, 200)
    specs = [dict(kind="partial", H=H, lengths=lengths, splits=s) for H in heads for s in (None, 3)]
    H = heads[0]
    specs += [
        dict(kind="flashmla", H=H, lengths=(1, 129), s_q=2),
        dict(kind="csr", H=H, lengths=(130, 64, 0), kv_lens=True),
        dict(kind="csr", H=H, lengths=(128, 64, 0), kv_lens=False),
        dict(kind="plan", H=H, lengths=(300, 1, 128), page=128),
        dict(kind="plan", H=H, lengths=lengths),
        dict(kind="out", H=H, lengths=lengths),
    ]
    # FlashInfer's layout (split ckv / kpe, CSR): the table's choice, then the see-saw's split
    # variant forced (opt-in until these records verify it: they carry its fingerprint)
    for forced in (None, "gluon") if cuda else (None,):  # (the dry run has no Gluon to force)
        specs.append(dict(kind="flashinfer", H=H, lengths=(130, 64, 1), forced=forced))
    # sparse top-k: the table's choice (tl), then the gather see-saw forced (opt-in): -1 slots,
    # a partial top-k, an all-empty row, NaN in every unselected slot
    for forced in (None, "gluon") if cuda else (None,):
        for sH, topk, sp in ((H, 2048 if not dry else 128, None), (16, 300, 3)):
            specs.append(dict(kind="sparse", H=sH, lengths=(topk, topk // 2, 0), splits=sp,
                              forced=forced))  # fmt: skip
    # DeepSeek-V3.2's FP8 cache (656-byte entries, 0xFF bytes in every entry not attended):
    # the table's choice, then the FP8 see-saw forced (opt-in): dense with lengths 0 / 1 / a
    # partial page, s_q 2 causal; sparse with -1 slots, a partial top-k and an all-empty row
    for forced in (None, "gluon") if cuda else (None,):
        specs.append(dict(kind="fp8_dense", H=H, lengths=lengths + (0,), forced=forced))
        specs.append(dict(kind="fp8_dense", H=16, lengths=(1, 129), s_q=2, splits=3,
                          forced=forced))  # fmt: skip
        for sH, topk, sp in ((H, 2048 if not dry else 128, None), (16, 300, 3)):
            specs.append(dict(kind="fp8_sparse", H=sH, lengths=(topk, topk // 2, 0), splits=sp,
                              forced=forced))  # fmt: skip
    if cuda:
        specs.append(dict(kind="graph", H=H, lengths=lengths))
    return specs


def label(spec: dict) -> str:
    """A case's name in the records."""
    parts = [spec["kind"], f"H={spec['H']}", "lens=" + ",".join(map(str, spec["lengths"]))]
    for key in ("splits", "page", "s_q", "kv_lens", "forced"):
        if key in spec:
            parts.append(f"{key}={spec[key]}")
    return " ".join(parts)


def build(spec: dict, device, gen):
    """``(run() -> (o [R, H, 512], lse [R, H]), fp64 reference, plan)`` of one case, through
    the public default path."""
    import torch

    from mqnc.triton_kernels import (
        mla_decode_partial,
        mla_decode_partial_csr,
        plan_mla_decode,
        plan_mla_decode_csr,
    )
    from mqnc.triton_kernels.adapters.flashmla import (
        mla_decode_with_kvcache,
        plan_mla_with_kvcache,
    )

    kind, H, lengths, s_q = spec["kind"], spec["H"], list(spec["lengths"]), spec.get("s_q", 1)
    if kind == "sparse":
        return _sparse_case(spec, device, gen)
    if kind.startswith("fp8_"):
        return _fp8_case(spec, device, gen)
    pool, table, lens = _pool(lengths, spec.get("page", 64), gen, torch.bfloat16, device)
    R = len(lengths) * s_q
    q = torch.randn(R, H, 576, generator=gen).to(device, torch.bfloat16)
    ref = _reference(q, pool, table, lens, s_q=s_q, causal=s_q > 1)
    kw = dict(softmax_scale=SCALE)
    if kind == "partial":
        kw["num_splits"] = spec["splits"]
        plan = plan_mla_decode(q, pool, table, lens, **kw)
        return lambda: mla_decode_partial(q, pool, table, lens, **kw), ref, plan
    if kind == "flashmla":
        q4, cache = q.view(len(lengths), s_q, H, 576), pool[:, :, None]
        plan = plan_mla_with_kvcache(q4, cache, table, lens, causal=True, **kw).plan

        def flashmla():
            o, lse = mla_decode_with_kvcache(q4, cache, table, lens, causal=True, **kw)
            return o.reshape(R, H, 512), lse.transpose(1, 2).reshape(R, H)

        return flashmla, ref, plan
    if kind == "flashinfer":
        return _flashinfer_case(q, pool, table, lens, spec.get("forced"), device)
    if kind == "csr":
        counts = [math.ceil(n / 64) for n in lengths]
        indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        indices = torch.cat([table[b, :c].cpu() for b, c in enumerate(counts)]).to(torch.int32)
        indptr, indices = indptr.to(device), indices.to(device)
        kvl = lens if spec["kv_lens"] else None
        plan = plan_mla_decode_csr(q, pool, indptr, indices, kvl, **kw)
        return lambda: mla_decode_partial_csr(q, pool, indptr, indices, kvl, **kw), ref, plan
    plan = plan_mla_decode(q, pool, table, lens, check_inputs=False, **kw)
    q2 = torch.randn(q.shape, generator=gen).to(device, torch.bfloat16)
    ref = _reference(q2, pool, table, lens)
    if kind == "plan":
        return lambda: plan.run(q2, pool, table, lens), ref, plan
    if kind == "out":
        out = (torch.empty(R, H, 512, dtype=torch.bfloat16, device=device),
               torch.empty(R, H, dtype=torch.float32, device=device))  # fmt: skip
        return lambda: plan.run(q2, pool, table, lens, out=out), ref, plan
    return _graph_case(plan, q, q2, pool, table, lens), ref, plan


def _flashinfer_case(q, pool, table, lens, forced, device):
    """FlashInfer's MLA call over the pool split into ``ckv`` / ``kpe`` (own tensors, not views)
    and a CSR table, the query as ``q_nope`` / ``q_pe``; ``forced``: the backend forced while
    planning (None: the table's)."""
    import contextlib

    import torch

    from mqnc.triton_kernels.adapters.flashinfer import plan_mla_paged_attention
    from mqnc.triton_kernels.dispatch import force_backend

    counts = [math.ceil(int(n) / 64) for n in lens.tolist()]
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat([table[b, :c].cpu() for b, c in enumerate(counts)]).to(torch.int32)
    indptr, indices = indptr.to(device), indices.to(device)
    ckv, kpe = pool[..., :512].contiguous(), pool[..., 512:].contiguous()
    q_nope, q_pe = q[..., :512].contiguous(), q[..., 512:].contiguous()
    ref = _reference(q, pool, table, lens)
    with force_backend("mla_decode", forced) if forced else contextlib.nullcontext():
        fplan = plan_mla_paged_attention(
            q_nope, q_pe, ckv, kpe, indptr, indices, lens, sm_scale=SCALE, return_lse=True,
            return_lse_base_on_e=True,
        )  # fmt: skip
    run = lambda: fplan.run(q_nope, q_pe, ckv, kpe, indptr, indices, lens)  # noqa: E731
    return run, ref, fplan.plan


def _sparse_selection(B, topk, counts, tokens, gen):
    """``[B, topk]`` int32 indices drawn without replacement, row ``b``'s first ``counts[b]``
    valid (the rest -1, with -1 also at every fifth slot: unused slots among the selection)."""
    import torch

    rows = []
    for n in counts:
        idx = torch.randperm(tokens, generator=gen)[:topk]
        keep = (torch.arange(topk) < n) & (torch.arange(topk) % 5 != 4)
        rows.append(torch.where(keep, idx, torch.full_like(idx, -1)))
    return torch.stack(rows).to(torch.int32)


def _sparse_case(spec, device, gen):
    """A sparse top-k call (``lengths``: each row's valid count of a top-k the first length
    wide), NaN in every unselected slot of the pool; ``forced``: the backend forced."""
    import contextlib

    import torch

    from mqnc.reference import mla_sparse_reference
    from mqnc.triton_kernels import plan_mla_sparse
    from mqnc.triton_kernels.dispatch import force_backend

    counts, H = list(spec["lengths"]), spec["H"]
    topk = max(counts[0], 1)
    blocks = math.ceil(topk / 64) * 2 + 2
    idx = _sparse_selection(len(counts), topk, counts, blocks * 64, gen)
    flat = torch.full((blocks * 64, 576), float("nan"))
    sel = idx[idx >= 0].long().unique()
    flat[sel] = torch.randn(sel.numel(), 576, generator=gen)
    pool = flat.view(blocks, 64, 576).to(device, torch.bfloat16)
    q = torch.randn(len(counts), H, 576, generator=gen).to(device, torch.bfloat16)
    idx = idx.to(device)
    ref = mla_sparse_reference(q.double(), pool.double(), idx, SCALE)
    kw = dict(softmax_scale=SCALE, num_splits=spec.get("splits"))
    forced = spec.get("forced")
    with force_backend("mla_sparse", forced) if forced else contextlib.nullcontext():
        plan = plan_mla_sparse(q, pool, idx, **kw)
    return lambda: plan.run(q, pool, idx), ref, plan


def _fp8_entries(rows):
    """``rows [..., 576]`` (NaN rows: not attended) as 656-byte FP8 entries (uint8), every
    byte of a NaN row 0xFF (NaN latent, scales and RoPE: a read of it poisons the output)."""
    import torch

    from mqnc.triton_kernels.fp8.quant import fp8_quantize

    flat = rows.reshape(-1, 576)
    used = torch.isfinite(flat).all(-1)
    entries = torch.full((flat.shape[0], 656), 0xFF, dtype=torch.uint8, device=flat.device)
    if bool(used.any()):
        entries[used] = fp8_quantize(flat[used].to(torch.bfloat16), 512)
    return entries.view(*rows.shape[:-1], 656)


def _fp8_case(spec, device, gen):
    """An FP8 call (``fp8_dense``: a padded table, lengths ``lengths``, ``s_q`` tokens causal;
    ``fp8_sparse``: as :func:`_sparse_case`), compared with fp64 over the dequantized cache;
    ``forced``: the backend forced while planning."""
    import contextlib

    import torch

    from mqnc.reference import mla_sparse_reference
    from mqnc.reference.attention_ref import dequantized_cache
    from mqnc.triton_kernels import plan_mla_decode, plan_mla_sparse
    from mqnc.triton_kernels.adapters.flashmla import plan_mla_with_kvcache
    from mqnc.triton_kernels.dispatch import force_backend

    H, forced, kw = spec["H"], spec.get("forced"), dict(softmax_scale=SCALE)
    kw["num_splits"] = spec.get("splits")
    if spec["kind"] == "fp8_sparse":
        counts = list(spec["lengths"])
        topk = max(counts[0], 1)
        blocks = math.ceil(topk / 64) * 2 + 2
        idx = _sparse_selection(len(counts), topk, counts, blocks * 64, gen)
        flat = torch.full((blocks * 64, 576), float("nan"))
        sel = idx[idx >= 0].long().unique()
        flat[sel] = torch.randn(sel.numel(), 576, generator=gen)
        pool = _fp8_entries(flat.to(device)).view(blocks, 64, 656)
        q = torch.randn(len(counts), H, 576, generator=gen).to(device, torch.bfloat16)
        idx = idx.to(device)
        rows = dequantized_cache(pool, 512, torch.float64)
        ref = mla_sparse_reference(q.double(), rows, idx, SCALE)
        with force_backend("mla_sparse", forced) if forced else contextlib.nullcontext():
            plan = plan_mla_sparse(q, pool, idx, **kw)
        return lambda: plan.run(q, pool, idx), ref, plan
    lengths, s_q = list(spec["lengths"]), spec.get("s_q", 1)
    bf, table, lens = _pool(lengths, 64, gen, torch.float32, device)
    pool = _fp8_entries(bf)
    q = torch.randn(len(lengths) * s_q, H, 576, generator=gen).to(device, torch.bfloat16)
    ref = _reference(q, dequantized_cache(pool, 512, torch.float64), table, lens, s_q, s_q > 1)
    if s_q == 1:
        with force_backend("mla_decode", forced) if forced else contextlib.nullcontext():
            plan = plan_mla_decode(q, pool, table, lens, **kw)
        return lambda: plan.run(q, pool, table, lens), ref, plan
    # FlashMLA's MTP call: q [b, s_q, h, 576], k_cache [blocks, 64, 1, 656] float8_e4m3fn
    q4, cache = q.view(len(lengths), s_q, H, 576), pool.view(torch.float8_e4m3fn)[:, :, None]
    with force_backend("mla_decode", forced) if forced else contextlib.nullcontext():
        fplan = plan_mla_with_kvcache(q4, cache, table, lens, causal=True, is_fp8_kvcache=True,
                                      **kw)  # fmt: skip

    def run():
        o, lse = fplan.run(q4, cache, table, lens)
        return o.reshape(-1, H, 512), lse.transpose(1, 2).reshape(-1, H)

    return run, ref, fplan.plan


def _graph_case(plan, q, q2, pool, table, lens):
    """A plan's run captured in a CUDA graph on a static query buffer (made from ``q``); the
    case's call refills it with ``q2`` and replays."""
    import torch

    static = q.clone()
    plan.run(static, pool, table, lens)  # (warm: compiled before the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan.run(static, pool, table, lens)

    def run():
        static.copy_(q2)
        graph.replay()
        return out

    return run


def exact(args, device, record) -> bool:
    """Every exactness case (module docstring); True when all pass."""
    import torch

    gen = torch.Generator().manual_seed(0)
    ok_all = True
    # the dry run's planted wrong answer (correctness/test_gpu_check.py): o scaled by this
    off = float(os.environ.get("FASTPATH_DRY_OFF") or 1.0) if args.dry_run else 1.0
    for spec in exact_specs(args.dry_run, device.type == "cuda"):
        run, ref, plan = build(spec, device, gen)
        o, lse = run()
        o = o * off if off != 1.0 else o
        ok, seen = _compare(o, lse, ref)
        ok_all &= ok
        facts = _facts(plan)
        print(f"{'' if ok else 'MISMATCH '}{label(spec)} [{facts['backend']}]: {seen}")
        extra = dict(ok=ok, vs_fp64=dict(ok=ok, seen=seen), spec=spec, **facts)
        record("fastpath_exact", label(spec), 1, (0.0, 0.0, 0.0), x_name="case",
               backend=facts["backend"], extra=extra)  # fmt: skip
    return ok_all


def _dense_inputs(B, H, ct, device, gen):
    """Unpoisoned FlashMLA-layout inputs drawn on ``device``: each token its own ``ct``
    entries in shuffled 64-entry pages."""
    import torch

    pages = math.ceil(ct / 64)
    pool = torch.randn(B * pages, 64, 576, device=device, generator=gen).to(torch.bfloat16)
    table = torch.randperm(B * pages, device=device, generator=gen).to(torch.int32)
    q = torch.randn(B, H, 576, device=device, generator=gen).to(torch.bfloat16)
    lens = torch.full((B,), ct, dtype=torch.int32, device=device)
    return q, pool, table.view(B, pages), lens


def device_times(args, dev, record) -> bool:
    """The goal shapes' device time on the default path (module docstring); True when every
    shape's first input set matched fp64 on its first token."""
    import torch

    from mqnc.measure import input_sets, l2_bytes, time_kernel
    from mqnc.triton_kernels import plan_mla_decode
    from perf.speed_targets import dense_bytes

    cuda = dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    shapes = DENSE if not args.dry_run else [(16, 1, 128, "us"), (64, 2, 128, "tflops")]
    l2 = l2_bytes(dev) if cuda else 0
    ok_all = True
    for H, B, ct, metric in shapes:
        nbytes = dense_bytes(B, H, ct)
        sets = [_dense_inputs(B, H, ct, dev, gen) for _ in range(input_sets(nbytes, l2))]
        plans = [plan_mla_decode(*s, softmax_scale=SCALE, check_inputs=False) for s in sets]
        q, pool, table, lens = sets[0]
        o, lse = plans[0].run(*sets[0])
        ok, seen = _compare(o[:1], lse[:1], _reference(q[:1], pool, table[:1], lens[:1]))
        ok_all &= ok
        calls = [lambda p=p, s=s: p.run(*s) for p, s in zip(plans, sets, strict=True)]
        t = time_kernel(calls, working_set_bytes=nbytes, warmup=args.warmup, reps=args.reps,
                        cuda=cuda, checks="off")  # fmt: skip
        flops = 2 * B * H * ct * (576 + 512)
        extra = dict(B=B, H=H, page=64, shape=f"H={H} B={B} ct={ct}", goal_metric=metric,
                     flops=flops, tflops=flops / (t.p50 * 1e6), tbps=nbytes / (t.p50 * 1e6),
                     num_splits=plans[0].num_splits, ok=ok, vs_fp64=dict(ok=ok, seen=seen),
                     timing=t.how, **_facts(plans[0]))  # fmt: skip
        print(f"{'' if ok else 'MISMATCH '}H={H} B={B} ct={ct} [{extra['backend']}]: p50 "
              f"{t.p50:.1f} us, {extra['tflops']:.1f} TFLOP/s, {extra['tbps']:.2f} TB/s, "
              f"splits {plans[0].num_splits}")  # fmt: skip
        record("fastpath", f"H={H},B={B}", ct, t.percentiles, x_name="ct", nbytes=nbytes,
               backend="triton" if cuda else "interpreter", extra=extra)  # fmt: skip
        del sets, plans, calls
    return ok_all


SPARSE = [(128, 1, 2048), (128, 8, 2048), (128, 64, 2048)]  # (H, B, top-k)


def _sparse_inputs(B, H, topk, dev, gen):
    """A sparse call's inputs on ``dev``: each token's ``topk`` entries drawn at random from a
    pool of ``16 B x topk`` (its own and others')."""
    import torch

    tokens = 16 * B * topk
    pool = torch.randn(tokens // 64, 64, 576, device=dev, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, tokens, (B, topk), device=dev, generator=gen, dtype=torch.int32)
    q = torch.randn(B, H, 576, device=dev, generator=gen).to(torch.bfloat16)
    return q, pool, idx


def sparse_times(args, dev, record) -> bool:
    """Sparse top-2048 at H 128, B 1 / 8 / 64: the table's choice and the gather see-saw forced
    (opt-in until these records verify it), each first checked against fp64 on its first token,
    then CUDA-graph timed over input sets larger than twice the L2 (bench ``fastpath_sparse``,
    variant ``H=..,B=..@default`` / ``@gluon``; FLOPs ``2 B H top-k (576 + 512)``). GPU only:
    off a GPU there is no Gluon to force, and the default path's sparse kernel is timed by
    ``perf.bench_mla``."""
    import contextlib

    import torch

    from mqnc.measure import input_sets, l2_bytes, time_kernel
    from mqnc.reference import mla_sparse_reference
    from mqnc.triton_kernels import plan_mla_sparse
    from mqnc.triton_kernels.dispatch import force_backend

    if dev.type != "cuda":
        print("sparse: no GPU, nothing to force (the default path is timed by perf.bench_mla)")
        return True
    gen = torch.Generator(device=dev).manual_seed(4)
    ok_all = True
    for H, B, topk in SPARSE:
        nbytes = B * topk * 1152 + B * H * (1152 + 1028)
        sets = [
            _sparse_inputs(B, H, topk, dev, gen) for _ in range(input_sets(nbytes, l2_bytes(dev)))
        ]
        for which in ("default", "gluon"):
            forcing = (
                force_backend("mla_sparse", "gluon")
                if which == "gluon"
                else contextlib.nullcontext()
            )
            with forcing:
                plans = [
                    plan_mla_sparse(*s, softmax_scale=SCALE, check_indices=False) for s in sets
                ]
            q, pool, idx = sets[0]
            o, lse = plans[0].run(*sets[0])
            ref = mla_sparse_reference(q[:1].double(), pool.double(), idx[:1], SCALE)
            ok, seen = _compare(o[:1], lse[:1], ref)
            ok_all &= ok
            calls = [lambda p=p, s=s: p.run(*s) for p, s in zip(plans, sets, strict=True)]
            t = time_kernel(calls, working_set_bytes=nbytes, warmup=args.warmup, reps=args.reps,
                            cuda=True, checks="off")  # fmt: skip
            flops = 2 * B * H * topk * (576 + 512)
            extra = dict(B=B, H=H, topk=topk, shape=f"H={H} B={B} topk={topk}", flops=flops,
                         tflops=flops / (t.p50 * 1e6), num_splits=plans[0].num_splits, ok=ok,
                         vs_fp64=dict(ok=ok, seen=seen), timing=t.how,
                         **_facts(plans[0]))  # fmt: skip
            print(f"{'' if ok else 'MISMATCH '}sparse H={H} B={B} top-{topk} @{which} "
                  f"[{extra['backend']}]: p50 {t.p50:.1f} us, "
                  f"{extra['tflops']:.1f} TFLOP/s")  # fmt: skip
            record("fastpath_sparse", f"H={H},B={B}@{which}", topk, t.percentiles, x_name="topk",
                   nbytes=nbytes, backend="triton", extra=extra)  # fmt: skip
        del sets, plans, calls
    return ok_all


FP8 = [("sparse", 128, 8, 2048), ("sparse", 128, 64, 2048), ("dense", 16, 16, 32768),
       ("dense", 128, 64, 8192)]  # (kind, H, B, top-k or c_t): the FP8 goals' shapes  # fmt: skip


def _fp8_plans(kind, which, inputs):
    """One input set's plan at one variant: ``default`` (the FP8 cache, the table's choice),
    ``gluon`` (the FP8 see-saw forced) or ``bf16`` (the bf16 twin, the table's choice)."""
    import contextlib

    from mqnc.triton_kernels import plan_mla_decode, plan_mla_sparse
    from mqnc.triton_kernels.dispatch import force_backend

    fp8, bf16 = inputs
    args = bf16 if which == "bf16" else fp8
    op = "mla_sparse" if kind == "sparse" else "mla_decode"
    with force_backend(op, "gluon") if which == "gluon" else contextlib.nullcontext():
        if kind == "sparse":
            return plan_mla_sparse(*args, softmax_scale=SCALE, check_indices=False), args
        return plan_mla_decode(*args, softmax_scale=SCALE, check_inputs=False), args


def _fp8_inputs(kind, H, B, n, dev, gen):
    """``(fp8 inputs, their bf16 twin)``: the same query, table and values, the cache as
    656-byte FP8 entries and as the bf16 rows they dequantize to."""
    from mqnc.reference.attention_ref import dequantized_cache

    if kind == "sparse":
        q, pool, idx = _sparse_inputs(B, H, n, dev, gen)
        entries = _fp8_entries(pool)
        return (q, entries, idx), (q, dequantized_cache(entries, 512, q.dtype), idx)
    q, pool, table, lens = _dense_inputs(B, H, n, dev, gen)
    entries = _fp8_entries(pool)
    return (q, entries, table, lens), (q, dequantized_cache(entries, 512, q.dtype), table, lens)


def fp8_times(args, dev, record) -> bool:
    """DeepSeek-V3.2's FP8 cache at the goals' shapes (``FP8``): the FP8 call by the table's
    choice (``@default``), the FP8 see-saw forced (``@gluon``, opt-in until these records
    verify it) and the bf16 twin (``@bf16``, the same values dequantized, the table's choice),
    each first checked against fp64 over the dequantized cache on its first token, then
    CUDA-graph timed over input sets larger than twice the L2 (bench ``fastpath_fp8``, variant
    ``{kind} H=..,B=..@..``, ``extra.kv_dtype`` fp8 / bf16: the FP8 goals compare the twins).
    GPU only (the dry run's FP8 calls are the exact stage's)."""
    import torch

    from mqnc.measure import input_sets, l2_bytes, time_kernel
    from mqnc.reference import mla_sparse_reference
    from mqnc.reference.attention_ref import dequantized_cache

    if dev.type != "cuda":
        print("fp8: no GPU, nothing to force (the exact stage ran the FP8 calls)")
        return True
    gen = torch.Generator(device=dev).manual_seed(5)
    ok_all = True
    for kind, H, B, n in FP8:
        fp8_bytes = B * n * 656 + B * H * (1152 + 1028)
        sets = [_fp8_inputs(kind, H, B, n, dev, gen)
                for _ in range(input_sets(fp8_bytes, l2_bytes(dev)))]  # fmt: skip
        for which in ("default", "gluon", "bf16"):
            planned = [_fp8_plans(kind, which, s) for s in sets]
            plans = [p for p, _ in planned]
            args0 = planned[0][1]
            o, lse = plans[0].run(*args0)
            fp8 = sets[0][0]
            rows = dequantized_cache(fp8[1], 512, torch.float64)
            if kind == "sparse":
                ref = mla_sparse_reference(fp8[0][:1].double(), rows, fp8[2][:1], SCALE)
            else:
                ref = _reference(fp8[0][:1], rows, fp8[2][:1], fp8[3][:1])
            ok, seen = _compare(o[:1], lse[:1], ref)
            ok_all &= ok
            calls = [lambda p=p, a=a: p.run(*a) for p, a in planned]
            nbytes = fp8_bytes if which != "bf16" else B * n * 1152 + B * H * (1152 + 1028)
            t = time_kernel(calls, working_set_bytes=nbytes, warmup=args.warmup, reps=args.reps,
                            cuda=True, checks="off")  # fmt: skip
            flops = 2 * B * H * n * (576 + 512)
            extra = dict(kind=kind, B=B, H=H, shape=f"{kind} H={H} B={B} n={n}", flops=flops,
                         tflops=flops / (t.p50 * 1e6), tbps=nbytes / (t.p50 * 1e6),
                         kv_dtype="bf16" if which == "bf16" else "fp8", variant_of=which,
                         num_splits=plans[0].num_splits, ok=ok, vs_fp64=dict(ok=ok, seen=seen),
                         timing=t.how, **_facts(plans[0]))  # fmt: skip
            print(f"{'' if ok else 'MISMATCH '}fp8 {kind} H={H} B={B} n={n} @{which} "
                  f"[{extra['backend']}]: p50 {t.p50:.1f} us, {extra['tflops']:.1f} TFLOP/s, "
                  f"{extra['tbps']:.2f} TB/s")  # fmt: skip
            record("fastpath_fp8", f"{kind} H={H},B={B}@{which}", n, t.percentiles,
                   x_name="topk" if kind == "sparse" else "ct", nbytes=nbytes, backend="triton",
                   extra=extra)  # fmt: skip
            del planned, plans, calls
        del sets
    return ok_all


def host_cases(H, B, ct, dev, gen) -> tuple[dict, object]:
    """The calls a user's loop makes at one shape (module docstring), and the plan they use."""
    from mqnc.triton_kernels import mla_decode_partial, plan_mla_decode
    from mqnc.triton_kernels.adapters.flashmla import mla_decode_with_kvcache

    q, pool, table, lens = _dense_inputs(B, H, ct, dev, gen)
    q4, cache4 = q.view(B, 1, H, 576), pool[:, :, None]
    plan = plan_mla_decode(q, pool, table, lens, softmax_scale=SCALE, check_inputs=False)
    flashmla = lambda c: (
        lambda: mla_decode_with_kvcache(  # noqa: E731
            q4, cache4, table, lens, softmax_scale=SCALE, check_inputs=c
        )
    )
    partial = lambda c: (
        lambda: mla_decode_partial(  # noqa: E731
            q, pool, table, lens, softmax_scale=SCALE, check_inputs=c
        )
    )
    cases = {
        "mla_decode_with_kvcache checks=off": flashmla(False),
        "mla_decode_with_kvcache checks=on": flashmla(True),
        "mla_decode_partial checks=off": partial(False),
        "mla_decode_partial checks=on": partial(True),
        "plan.run": lambda: plan.run(q, pool, table, lens),
    }
    return cases, plan


def host_loops(args, dev, record) -> None:
    """A user's loop per call and shape (module docstring): ``loops`` loops of ``calls``
    back-to-back calls each, host and CPU microseconds per call, p20 / p50 / p80 over loops."""
    import numpy as np
    import torch

    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(2)
    shapes = HOST if not args.dry_run else [(16, 1, 128)]
    calls, loops = (200, max(args.reps, 5)) if not args.dry_run else (3, 2)
    for H, B, ct in shapes:
        cases, plan = host_cases(H, B, ct, dev, gen)
        for name, fn in cases.items():
            for _ in range(max(args.warmup, 1)):
                fn()
            sync()
            wall, cpu = [], []
            for _ in range(loops):
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(calls):
                    fn()
                t1, c1 = time.perf_counter(), time.process_time()
                sync()
                wall.append((t1 - t0) / calls * 1e6)
                cpu.append((c1 - c0) / calls * 1e6)
            pw = tuple(float(x) for x in np.percentile(wall, [20, 50, 80]))
            pc = tuple(float(x) for x in np.percentile(cpu, [20, 50, 80]))
            print(f"host loop H={H} B={B} ct={ct} {name:<36} {pw[1]:8.1f} us a call "
                  f"(CPU {pc[1]:.1f} us)")  # fmt: skip
            extra = dict(case=name, calls=calls, loops=loops, cpu_us=pc, B=B, H=H, ct=ct,
                         shape=f"H={H} B={B} ct={ct}", **_facts(plan))  # fmt: skip
            record("host_loop", f"{name} H={H},B={B},ct={ct}", 1, pw, x_name="call",
                   backend="triton" if cuda else "interpreter", extra=extra)  # fmt: skip
        del cases, plan


def warm_specs(dry: bool, cuda: bool) -> list[dict]:
    """Every case the run will launch, as data a worker process rebuilds: the exactness cases
    (the graph case replays the plan case's launches), the device shapes, the host shapes."""
    specs = [s for s in exact_specs(dry, cuda) if s["kind"] != "graph"]
    dense = DENSE if not dry else [(16, 1, 128, "us")]
    specs += [dict(kind="dense", H=H, B=B, ct=ct) for H, B, ct, _ in dense]
    specs += [dict(kind="host", H=H, B=B, ct=ct) for H, B, ct in (HOST if not dry else [])]
    if cuda:  # (the sparse and FP8 timings' plans, every variant)
        specs += [dict(kind="sparse_timing", H=H, B=B, topk=k) for H, B, k in SPARSE]
        specs += [dict(kind="fp8_timing", what=w, H=H, B=B, n=n) for w, H, B, n in FP8]
    return specs


def warm_one(spec: dict) -> tuple[str, float, str | None]:
    """Launch one case once (a worker process): its kernels compiled into Triton's on-disk
    cache, as the run will launch them. ``(what, seconds, error)``."""
    t0 = time.perf_counter()
    try:
        import torch

        from mqnc.triton_kernels import plan_mla_decode

        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        gen = torch.Generator(device=dev).manual_seed(3)
        if spec["kind"] == "dense":
            args = _dense_inputs(spec["B"], spec["H"], spec["ct"], dev, gen)
            plan_mla_decode(*args, softmax_scale=SCALE, check_inputs=False).run(*args)
        elif spec["kind"] == "host":
            for fn in host_cases(spec["H"], spec["B"], spec["ct"], dev, gen)[0].values():
                fn()
        elif spec["kind"] == "fp8_timing":
            gen = torch.Generator(device=dev).manual_seed(5)
            inputs = _fp8_inputs(spec["what"], spec["H"], spec["B"], spec["n"], dev, gen)
            for which in ("default", "gluon", "bf16"):
                plan, args = _fp8_plans(spec["what"], which, inputs)
                plan.run(*args)
        elif spec["kind"] == "sparse_timing":
            from mqnc.triton_kernels import plan_mla_sparse
            from mqnc.triton_kernels.dispatch import force_backend

            args = _sparse_inputs(spec["B"], spec["H"], spec["topk"], dev, gen)
            plan_mla_sparse(*args, softmax_scale=SCALE, check_indices=False).run(*args)
            with force_backend("mla_sparse", "gluon"):
                plan = plan_mla_sparse(*args, softmax_scale=SCALE, check_indices=False)
            plan.run(*args)
        else:
            build(spec, dev, torch.Generator().manual_seed(3))[0]()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return str(spec), time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - reported per case, the others go on
        return str(spec), time.perf_counter() - t0, f"{type(exc).__name__}: {str(exc)[:300]}"


def warm(args, dev) -> bool:
    """Every case launched once by ``--jobs`` worker processes sharing Triton's cache (the
    Gluon kernel's specialisations take ~30 s each to compile on the H200's host), before
    anything is timed; in-process and the first case only for the dry run."""
    specs = warm_specs(args.dry_run, dev.type == "cuda")
    jobs = 1 if args.dry_run else args.jobs
    return warm_in_parallel(warm_one, specs[: 1 if args.dry_run else None], jobs, "cases")


def warm_in_parallel(fn, specs: list, jobs: int, noun: str) -> bool:
    """``fn(spec) -> (what, seconds, error)`` for every spec, by ``jobs`` worker processes
    sharing Triton's on-disk cache (in-process for ``jobs <= 1``); each printed, then
    ``warm: N <noun>, F failed``; False if any failed (``bench_device_route`` warms alike)."""
    import concurrent.futures
    import multiprocessing

    t0 = time.perf_counter()
    if jobs <= 1:
        results = [fn(s) for s in specs]
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            results = list(pool.map(fn, specs))
    for what, secs, err in results:
        print(f"warm {secs:6.1f} s  {'ok    ' if err is None else 'FAILED'}  {what} {err or ''}")
    failed = sum(err is not None for _, _, err in results)
    print(f"warm: {len(results)} {noun}, {failed} failed, {time.perf_counter() - t0:.1f} s")
    return not failed


def main(argv=None) -> int:
    from mqnc.measure.options import bench_parser, choice_list, finish, parse_bench_args

    parts = ("warm", "exact", "device", "sparse", "fp8", "host")
    ap = bench_parser(__doc__, reps="20 (device), loops of the host loop; 2 dry", warmup="3")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, a few repetitions")
    ap.add_argument("--only", type=choice_list(parts), default=list(parts),
                    help="the parts to run, in this order (comma list)")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=16, help="warm-up worker processes")
    args = parse_bench_args(ap, argv)
    args.reps = args.reps or (2 if args.dry_run else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 3)
    from mqnc.base.runtime import use_interpreter_without_cuda

    use_interpreter_without_cuda()
    import functools

    import torch

    from mqnc.measure import record
    from perf.speed_targets import FASTPATH_TARGETS

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rec = functools.partial(record, path=args.out)
    ok = True
    if "warm" in args.only:
        ok &= warm(args, dev)
    if "exact" in args.only:
        ok &= exact(args, dev, rec)
    if "device" in args.only:
        ok &= device_times(args, dev, rec)
    if "sparse" in args.only:
        ok &= sparse_times(args, dev, rec)
    if "fp8" in args.only:
        ok &= fp8_times(args, dev, rec)
    if "host" in args.only:
        host_loops(args, dev, rec)
    status = finish(args, FASTPATH_TARGETS)
    return status if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
