#!/usr/bin/env bash
# The Gluon MLA decode kernel's first GPU check (mqnc.triton_kernels.mla.gluon, opt-in and
# unverified until this runs), one prepared call for a lent H200, and its dry run on a CPU:
#
#   bash perf/gpu_gluon.sh             on the GPU machine, from the repository root, $OUT set
#   bash perf/gpu_gluon.sh --dry-run   on a CPU machine: the same steps, interpreted, tiny
#
# The default path is timed first, then each Gluon kernel is checked and timed in turn (see-saw
# last): a kernel that hangs, ended by the timeout, loses only its own and the later records.
#
# 1. Exactness against fp64 (mqnc.reference mla_decode_reference, mqnc.testing.assert_close at
#    the tolerance table's bf16 "mla" / fp32 "mla_lse" bounds), the three variants ("gluon":
#    schedule sync, block_n 64; "gluon128": each warpgroup its own page, one stage; "seesaw":
#    warp-specialized, FlashMLA's see-saw), split and unsplit (odd page counts leave a pair
#    without its second page): 128 heads over lengths
#    1 / 65 / 200 (seq len 1, a partial last page; the pool's entries past each length NaN and
#    its table's unused entries -1, neither may reach the output), 16 heads (a partial head
#    block), and s_q 2 causal (FlashMLA's MTP rule). A case off its bound prints MISMATCH and
#    the run fails.
# 2. Timing (mqnc.measure.time_kernel: CUDA-graph replays over L2-rotated input sets, p20 / p50
#    / p80), H 128 dense at B 64 c_t 8192, B 8 c_t 32768 and B 128 c_t 4096 (FlashMLA's), for
#    the kernels "gluon", "gluon128", "seesaw" and "tl" (the default path,
#    flashmla_api.mla_decode_with_kvcache), checks off. Records ($OUT/results.jsonl, with
#    device and commit: $MQNC_COMMIT, else .mqnc-commit, else git) carry extra.kernel,
#    extra.flops (2 B H c_t (576 + 512)), extra.tflops at the p50, extra.vs_tl (o and lse
#    against the default path on the first input set) and extra.vs_fp64 (that variant's
#    exactness step passed). The Gluon records are the evidence to switch the default on; the
#    script switches nothing.
#
# The dry run cannot run Gluon (no interpreter runs it): the "gluon" kernels are stood in by
# the default path (extra.standin "tl"), at 16 heads B 1 c_t 128, one exactness case each; it
# checks the wiring, the comparisons and the records' schema, not the Gluon kernel
# ($GLUON_DRY_OFF=1.01 scales the stand-in's o: its checks must then fail).
#
# Budget, 4 minutes on an H200 ($BUDGET_S, 240; the run fails past it), estimated: the install
# step ~30 s (as gpu_tiles.sh's), one process start with torch + triton ~10 s, compiles ~10 s a
# Gluon variant (6: three kernels x split / unsplit; the sm_90 compile here takes 6-7 s of CPU
# each, the see-saw's ~15 s) plus the default path's and the merge kernel's (~20 s), the
# exactness cases (12 small calls and fp64 references, < 5 s), the timing: 604 / 302 / 604 MB of
# cache a call, one input set each (twice the L2 is less than one set), 4 kernels x 3 shapes x
# 23 replays of at most ~2 ms (the default path's 85 TFLOP/s on 146 GFLOP) ~0.5 s, and ~3 s of
# input generation: about 2 minutes.
source "$(dirname "$0")/gpu_common.sh"
gpu_python
BUDGET_S=${BUDGET_S:-240}
gpu_interpreter
gpu_commit
export MQNC_COMMIT MQNC_RESULTS="$OUT/results.jsonl" PYTHONUNBUFFERED=1 GLUON_DRY=$DRY
gpu_install
echo "commit $MQNC_COMMIT; $( ((DRY)) && echo 'DRY RUN (interpreter, tiny, gluon stood in by tl)' || echo 'GPU run'); budget ${BUDGET_S}s"
status=0
# bounded: a kernel that hangs (an mbarrier never completing) ends the check, not the session
timeout -k 5 "$BUDGET_S" "$PY" - "$OUT/results.jsonl" <<'PY' || status=1
import math, os, sys
import torch
from mqnc.base.runtime import use_interpreter_without_cuda
use_interpreter_without_cuda()
from mqnc.measure import input_sets, l2_bytes, record, time_kernel
from mqnc.reference.attention_ref import mla_decode_reference
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.triton_kernels.adapters.flashmla import mla_decode_with_kvcache
from mqnc.triton_kernels.mla.gluon import mla_decode_gluon

DRY, OUT = os.environ["GLUON_DRY"] == "1", sys.argv[1]
SCALE, dev, gen = 576**-0.5, default_device(), torch.Generator().manual_seed(0)
CUDA = dev.type == "cuda"
KERNELS = ("gluon", "gluon128", "seesaw", "tl")

OFF = float(os.environ.get("GLUON_DRY_OFF") or 1.0) if DRY else 1.0  # the test's wrong kernel

def call(kernel, q, kv, table, lens, causal=False, num_splits=None, check=True):
    if kernel == "tl" or DRY:  # the dry run stands the default path in for Gluon
        o, lse = mla_decode_with_kvcache(q, kv, table, lens, softmax_scale=SCALE, causal=causal,
                                         num_splits=num_splits, check_inputs=check)
        return (o, lse) if kernel == "tl" else (o * OFF, lse)
    return mla_decode_gluon(q, kv, table, lens, softmax_scale=SCALE, causal=causal,
                            num_splits=num_splits, block_n=128 if kernel == "gluon128" else 64,
                            schedule="seesaw" if kernel == "seesaw" else "sync",
                            check_inputs=check)

def case(B, H, lens, s_q=1, poison=True):
    """FlashMLA-layout inputs: pages shuffled, entries past each length NaN, unused table -1."""
    pages = max(math.ceil(max(lens) / 64), 1)
    kv = torch.randn(B * pages, 64, 1, 576, generator=gen).to(torch.bfloat16)
    table = torch.randperm(B * pages, generator=gen).to(torch.int32).view(B, pages)
    for b, n in enumerate(lens):
        if poison:
            for t in range(n, pages * 64):
                kv[table[b, t // 64], t % 64] = float("nan")
            table[b, math.ceil(n / 64):] = -1
    q = torch.randn(B, s_q, H, 576, generator=gen).to(torch.bfloat16)
    lens = torch.tensor(lens, dtype=torch.int32)
    return q.to(dev), kv.to(dev), table.to(dev), lens.to(dev)

def vs_fp64(kernel, q, kv, table, lens, causal, num_splits):
    B, s_q, H, _ = q.shape
    o, lse = call(kernel, q, kv, table, lens, causal, num_splits)
    rows = torch.arange(B * s_q, device=dev)
    n = lens.long()[rows // s_q] - ((s_q - 1 - rows % s_q) if causal else 0)
    safe = torch.where(table < 0, torch.zeros_like(table), table)
    ref = mla_decode_reference(q.reshape(B * s_q, H, 576).double(), kv[:, :, 0].double(),
                               safe[rows // s_q], n.clamp(min=0).to(torch.int32), SCALE)
    so = assert_close(o.reshape(B * s_q, H, 512), ref[0], tolerance("mla", torch.bfloat16), name="o")
    sl = assert_close(lse.transpose(1, 2).reshape(B * s_q, H), ref[1],
                      tolerance("mla_lse", "float32"), name="lse")
    return so, sl

cases = [("H=16 lens=1,70", dict(B=2, H=16, lens=[1, 70]), False, None)]
if not DRY:
    cases = [("H=128 lens=1,65,200", dict(B=3, H=128, lens=[1, 65, 200]), False, None),
             ("H=128 lens=1,65,200 splits=3", dict(B=3, H=128, lens=[1, 65, 200]), False, 3),
             ("H=16 lens=130", dict(B=1, H=16, lens=[130]), False, 1),
             ("H=128 s_q=2 causal lens=1,129", dict(B=2, H=128, lens=[1, 129], s_q=2), True, 2)]
def exactness(kernel):
    """Every case against fp64; True when all pass (the dry run checks its stand-in once)."""
    ok = True
    for label, kw, causal, splits in cases:
        try:
            so, sl = vs_fp64(kernel, *case(**kw), causal, splits)
            print(f"{kernel} vs fp64 {label}: o {so}; lse {sl}")
        except Exception as exc:  # noqa: BLE001 - reported, the run fails
            ok = False
            print(f"MISMATCH {kernel} vs fp64 {label}: {str(exc).splitlines()[0][:300]}")
    return ok

shapes = [(1, 16, 128)] if DRY else [(64, 128, 8192), (8, 128, 32768), (128, 128, 4096)]
reps, warmup = (1, 0) if DRY else (20, 3)
l2 = l2_bytes(dev) if CUDA else 0
inputs = {}  # per shape: its input sets and the default path's output on the first

def timed(kernel, B, H, ct, fp64):
    nbytes = B * ct * 576 * 2 + B * H * (576 * 2 + 512 * 2 + 4)
    if (B, H, ct) not in inputs:
        sets = [case(B, H, [ct] * B, poison=False) for _ in range(input_sets(nbytes, l2))]
        inputs[B, H, ct] = sets, call("tl", *sets[0], check=False)
    sets, ref = inputs[B, H, ct]
    flops = 2 * B * H * ct * (576 + 512)
    o, lse = call(kernel, *sets[0], check=False)
    o_rel = float((o.float() - ref[0].float()).abs().max() / ref[0].float().abs().max())
    lse_abs = float((lse - ref[1]).abs().max())
    vs_tl = {"o_rel_max": o_rel, "lse_max_abs": lse_abs,
             "ok": bool(torch.isfinite(o).all()) and o_rel <= 2**-6 and lse_abs <= 1e-3}
    calls = [lambda s=s, k=kernel: call(k, *s, check=False) for s in sets]
    t = time_kernel(calls, working_set_bytes=nbytes, warmup=warmup, reps=reps,
                    cuda=CUDA, checks="off")
    extra = {"B": B, "H": H, "page": 64, "shape": f"H={H} B={B} ct={ct}", "kernel": kernel,
             "flops": flops, "tflops": flops / (t.p50 * 1e6), "vs_tl": vs_tl,
             "vs_fp64": {"ok": fp64}, "dtype": "bfloat16", "timing": t.how}
    if DRY and kernel != "tl":
        extra["standin"] = "tl"
    extra["ok"] = vs_tl["ok"] and fp64
    backend = "interpreter" if not CUDA else ("triton" if kernel == "tl" else "gluon")
    record("mla_decode_gluon", f"H={H},B={B}@{kernel}", ct, t.percentiles, x_name="ct",
           nbytes=nbytes, backend=backend, path=OUT, extra=extra)
    tag = "" if extra["ok"] else "  MISMATCH"
    print(f"{kernel:9s} H={H} B={B} ct={ct}: p50 {t.p50:.1f} us, "
          f"{extra['tflops']:.1f} TFLOP/s, vs tl {o_rel:.2e} / {lse_abs:.2e}{tag}")

# the default path first, then each Gluon kernel checked and timed in turn, the riskiest last:
# a kernel that hangs (ended by the timeout) loses only its own records and the later ones'
fp64_ok = {}
for kernel in ("tl", *KERNELS[:3]):
    if kernel != "tl":
        fp64_ok[kernel] = fp64_ok["gluon"] if DRY and kernel != "gluon" else exactness(kernel)
    for B, H, ct in shapes:
        timed(kernel, B, H, ct, fp64_ok.get(kernel, True))
sys.exit(0 if all(fp64_ok.values()) else 1)
PY
grep -c . "$OUT/results.jsonl" | sed 's/$/ records/'
grep -q '"ok": false' "$OUT/results.jsonl" && { echo "a kernel MISMATCHED fp64 or the default path" && status=1; }
echo "gluon check took ${SECONDS}s of ${BUDGET_S}s"
((SECONDS > BUDGET_S)) && ! ((DRY)) && { echo "OVER the ${BUDGET_S}s budget" && status=1; }
exit $status
