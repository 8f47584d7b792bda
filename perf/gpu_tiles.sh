#!/usr/bin/env bash
# The tile sweep of the partial-MLA kernels at 128 heads on a lent GPU, one prepared call (after
# gpu_check.sh has run once; the device library's README), and its dry run on a CPU machine:
#
#   bash perf/gpu_tiles.sh             on the GPU machine, from the repository root, $OUT set
#   bash perf/gpu_tiles.sh --dry-run   on a CPU machine: the same commands, interpreted, tiny
#
# Candidates (every one exact against fp64 in the interpreter and spill-free for sm_90 under
# triton 3.6.0; docs/kernel-schedule.md): the classic tiles, the restructured kernels (``-pipe``:
# full tiles unmasked in a pipelined loop, the tail masked once; ``-tma``: TMA page boxes;
# sparse ``-pipe``), and at 16 heads (memory-bound) the two-CTA-per-SM tiles and the fused
# combine (``-fused``) for the one-row holder partial.
#
# Times, once per candidate tile (``mla.plan.SWEEP_TILES``: the tiles that compile without
# spills for sm_90 under triton 3.6.0, the GPU's, 64x64w8s3 among them; perf.bench_mla --tiles),
# dense H 128 at the goal shapes B 1 / 8 / 64 (c_t 8192 / 32768 / 8192) and FlashMLA's benchmark
# shape B 128 c_t 4096, and sparse top-2048 H 128 at B 1 / 8, between two copy-ceiling
# measurements (the GPU cold, then warm). Each tile's output is compared with the default tile's
# on the shape's first input set and, once per op, with fp64 on a small case (B 2, c_t 200;
# sparse top-100); a tile off either is printed MISMATCH and recorded ``ok: false``, and the run
# fails. Records ($OUT/results.jsonl, each with the commit: $MQNC_COMMIT, else .mqnc-commit,
# else git) carry ``extra.tile``, ``extra.tflops`` (FLOPs per query row 2 H c_t (576 + 512)),
# ``extra.vs_default`` and ``extra.vs_fp64``. Override the lists with $DENSE_TILES,
# $SPARSE_TILES, $DENSE_SHAPES, $MORE_DENSE, $DENSE16_TILES, $DENSE16_SHAPES.
#
# The 16-head section (``SWEEP_TILES["dense16"]``, after the 128-head ones): dense H 16 at
# B 16 c_t 32768 and B 64 c_t 32768 (memory-bound: GB/s in the records, against the copy
# ceilings measured around it) and B 1 c_t 2048 (the one-row holder partial, the eager call end
# to end: decode and combine, or the fused one launch), each tile against the default and fp64;
# its records go to $OUT/results_h16.jsonl (a second file, beside the 128-head sweep's).
#
# Budget, 8 minutes on an H200 ($BUDGET_S, 480; the run fails past it), estimated from the first
# sweep's records (perf/results/results.jsonl, commit 0054671, each record's ``date``): copy to
# copy 38 s for 24 timed tile records (10 tiles, 3 dense + 2 sparse shapes), ~1.6 s a record
# with its compiles, and ~10 s of start per bench process. Here 9 dense tiles x 4 shapes, 6
# sparse tiles x 2 shapes and 5 16-head tiles x 3 shapes are 63 records (~100 s), 20 fp64 checks
# on small shapes (one compile each, ~3 s: ~60 s), the largest inputs (FlashMLA's 604 MB a call;
# H 16 B 64 c_t 32768, 2.4 GB: one input set each, drawn on the device), 2 copies and 4 process
# starts (~50 s), the install step (~30 s): about 4 minutes, half the budget.
source "$(dirname "$0")/gpu_common.sh"
gpu_python
BUDGET_S=${BUDGET_S:-480}
if ((DRY)); then
  export TRITON_INTERPRET=1
  SIZE=(--tiny)
  GIB=0.01
  DENSE_SHAPES="H=16 B=1" # the only goal shapes --tiny has (cut to 128 entries)
  SPARSE_SHAPES="H=16 B=1"
  MORE_DENSE=${MORE_DENSE:-H=40 B=1 ct=100}
  DENSE16_SHAPES="H=16 B=1"
else
  unset TRITON_INTERPRET
  SIZE=(--goals)
  GIB=4
  SPARSE_SHAPES="H=128"
  DENSE_SHAPES=${DENSE_SHAPES:-H=128 B=1 ct=8192,H=128 B=8 ct=32768,H=128 B=64 ct=8192}
  MORE_DENSE=${MORE_DENSE:-H=128 B=128 ct=4096}
  DENSE16_SHAPES=${DENSE16_SHAPES:-H=16 B=16 ct=32768,H=16 B=64 ct=32768,H=16 B=1 ct=2048}
fi
gpu_commit
export MQNC_COMMIT MQNC_RESULTS="$OUT/results.jsonl" PYTHONUNBUFFERED=1
gpu_install
tiles() { # the candidates of one kind, from _mla_launch.SWEEP_TILES (one list for script and tests)
  "$PY" -c "import sys; from mqnc.triton_kernels.mla.plan import SWEEP_TILES as S
print(','.join(t.label for t in S[sys.argv[1]]))" "$1"
}
DENSE_TILES=${DENSE_TILES:-$(tiles dense)}
SPARSE_TILES=${SPARSE_TILES:-$(tiles sparse)}
DENSE16_TILES=${DENSE16_TILES:-$(tiles dense16)}
[ -n "$DENSE_TILES" ] && [ -n "$SPARSE_TILES" ] && [ -n "$DENSE16_TILES" ] ||
  { echo "no candidate tiles" && exit 1; }
echo "commit $MQNC_COMMIT; $([ "$DRY" = 1 ] && echo 'DRY RUN (interpreter, tiny sizes)' || echo 'GPU run')"
echo "dense tiles $DENSE_TILES; sparse tiles $SPARSE_TILES; 16-head tiles $DENSE16_TILES"
echo "budget ${BUDGET_S}s"
status=0
"$PY" -m perf.bench_copy --gib "$GIB" --out "$OUT/results.jsonl" || status=1
"$PY" -m perf.bench_mla "${SIZE[@]}" --only dense --shapes "$DENSE_SHAPES" \
  --dense-shapes "$MORE_DENSE" --tiles "$DENSE_TILES" --out "$OUT/results.jsonl" || status=1
"$PY" -m perf.bench_mla "${SIZE[@]}" --only sparse --shapes "$SPARSE_SHAPES" \
  --tiles "$SPARSE_TILES" --out "$OUT/results.jsonl" || status=1
"$PY" -m perf.bench_mla "${SIZE[@]}" --only dense --shapes "$DENSE16_SHAPES" \
  --tiles "$DENSE16_TILES" --out "$OUT/results_h16.jsonl" || status=1
"$PY" -m perf.bench_copy --gib "$GIB" --out "$OUT/results.jsonl" || status=1
# fp32 caches launch (16 x 16 on 16 warps at 128 registers) and match fp64, dense and sparse
"$PY" - <<'PY' || status=1
import torch
from mqnc.base.runtime import use_interpreter_without_cuda
use_interpreter_without_cuda()
from mqnc.reference.attention_ref import mla_decode_reference, mla_sparse_reference
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.triton_kernels import mla_decode_partial, mla_sparse_partial
dev, g = default_device(), torch.Generator().manual_seed(0)
B, H, ct = 2, 128, 256
q = torch.randn(B, H, 576, generator=g).to(dev)
pool = torch.randn(B * ct // 64, 64, 576, generator=g).to(dev)
table = torch.arange(B * ct // 64, dtype=torch.int32).view(B, -1).to(dev)
lens = torch.full((B,), ct, dtype=torch.int32, device=dev)
idx = torch.randperm(B * ct, generator=g)[: B * 64].view(B, 64).to(torch.int32).to(dev)
for name, got, ref in (
    ("dense", mla_decode_partial(q, pool, table, lens, softmax_scale=0.1),
     mla_decode_reference(q.double(), pool.double(), table, lens, 0.1)),
    ("sparse", mla_sparse_partial(q, pool, idx, softmax_scale=0.1),
     mla_sparse_reference(q.double(), pool.double(), idx, 0.1)),
):
    s = assert_close(got[0], ref[0], tolerance("mla", "float32"), name=f"fp32 {name} o")
    assert_close(got[1], ref[1], tolerance("mla_lse", "float32"), name=f"fp32 {name} lse")
    print(f"fp32 cache {name} H {H} vs fp64: {s}")
PY
grep -c . "$OUT/results.jsonl" | sed 's/$/ records/'
grep -c . "$OUT/results_h16.jsonl" | sed 's/$/ records at 16 heads (results_h16.jsonl)/'
grep -q '"ok": false' "$OUT/results.jsonl" "$OUT/results_h16.jsonl" &&
  { echo "a tile MISMATCHED its default or fp64" && status=1; }
echo "sweep took ${SECONDS}s of ${BUDGET_S}s"
((SECONDS > BUDGET_S)) && ! ((DRY)) && { echo "OVER the ${BUDGET_S}s budget" && status=1; }
exit $status
