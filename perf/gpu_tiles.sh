#!/usr/bin/env bash
# The tile sweep of the partial-MLA kernels at 128 heads on a lent GPU, one prepared call (after
# gpu_check.sh has run once; the device library's README), and its dry run on a CPU machine:
#
#   bash perf/gpu_tiles.sh             on the GPU machine, from the repository root, $OUT set
#   bash perf/gpu_tiles.sh --dry-run   on a CPU machine: the same commands, interpreted, tiny
#
# Times, once per candidate tile (``_mla_launch.SWEEP_TILES``: the tiles that compile without
# spills for sm_90 under triton 3.6.0, the GPU's, 64x64w8s3 among them; perf.bench_mla --tiles),
# dense H 128 at the goal shapes B 1 / 8 / 64 (c_t 8192 / 32768 / 8192) and FlashMLA's benchmark
# shape B 128 c_t 4096, and sparse top-2048 H 128 at B 1 / 8, between two copy-ceiling
# measurements (the GPU cold, then warm). Each tile's output is compared with the default tile's
# on the shape's first input set and, once per op, with fp64 on a small case (B 2, c_t 200;
# sparse top-100); a tile off either is printed MISMATCH and recorded ``ok: false``, and the run
# fails. Records ($OUT/results.jsonl, each with the commit: $MQNC_COMMIT, else .mqnc-commit,
# else git) carry ``extra.tile``, ``extra.tflops`` (FLOPs per query row 2 H c_t (576 + 512)),
# ``extra.vs_default`` and ``extra.vs_fp64``. Override the lists with $DENSE_TILES,
# $SPARSE_TILES, $DENSE_SHAPES, $MORE_DENSE.
#
# Budget, 8 minutes on an H200 ($BUDGET_S, 480; the run fails past it), estimated from the first
# sweep's records (perf/results/results.jsonl, commit 0054671, each record's ``date``): copy to
# copy 38 s for 24 timed tile records (10 tiles, 3 dense + 2 sparse shapes), ~1.6 s a record
# with its compiles, and ~10 s of start per bench process. Here 6 dense tiles x 4 shapes and 3
# sparse tiles x 2 shapes are 30 records (~50 s), 9 fp64 checks on small shapes (one compile
# each, ~3 s: ~30 s), FlashMLA's shape (604 MB of cache a call, ~2 ms at the old tiles' rate,
# 20 samples: < 1 s plus its input sets), 2 copies and 3 process starts (~40 s), the install
# step (~30 s): about 2.5 minutes, a third of the budget.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-python3}
((DRY)) && [ "$PY" = python3 ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
SITE=${SITE:-/tmp/mqnc-site}
BUDGET_S=${BUDGET_S:-480}
if ((DRY)); then
  export TRITON_INTERPRET=1
  SIZE=(--tiny)
  GIB=0.01
  DENSE_SHAPES="H=16 B=1" # the only goal shapes --tiny has (cut to 128 entries)
  SPARSE_SHAPES="H=16 B=1"
  MORE_DENSE=${MORE_DENSE:-H=40 B=1 ct=100}
else
  unset TRITON_INTERPRET
  SIZE=(--goals)
  GIB=4
  SPARSE_SHAPES="H=128"
  DENSE_SHAPES=${DENSE_SHAPES:-H=128 B=1 ct=8192,H=128 B=8 ct=32768,H=128 B=64 ct=8192}
  MORE_DENSE=${MORE_DENSE:-H=128 B=128 ct=4096}
fi
if [ -z "${MQNC_COMMIT:-}" ]; then
  MQNC_COMMIT=$( (tr -d '[:space:]' <.mqnc-commit) 2>/dev/null || git rev-parse --short=12 HEAD)
fi
export MQNC_COMMIT MQNC_RESULTS="$OUT/results.jsonl" PYTHONUNBUFFERED=1
if ! ((DRY)) && ! "$PY" -c "import mqnc.triton_kernels" 2>/dev/null; then # as gpu_check.sh's install step
  "$PY" -m pip install --no-index --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || {
    mkdir -p "$SITE/mqnc" && for f in mqnc/*; do ln -sfn "$ROOT/$f" "$SITE/mqnc/"; done &&
      ln -sfn "$ROOT/triton_kernels" "$SITE/mqnc/triton_kernels"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  }
fi
tiles() { # the candidates of one kind, from _mla_launch.SWEEP_TILES (one list for script and tests)
  "$PY" -c "import sys; from mqnc.triton_kernels._mla_launch import SWEEP_TILES as S
print(','.join(t.label for t in S[sys.argv[1]]))" "$1"
}
DENSE_TILES=${DENSE_TILES:-$(tiles dense)}
SPARSE_TILES=${SPARSE_TILES:-$(tiles sparse)}
[ -n "$DENSE_TILES" ] && [ -n "$SPARSE_TILES" ] || { echo "no candidate tiles" && exit 1; }
echo "commit $MQNC_COMMIT; $([ "$DRY" = 1 ] && echo 'DRY RUN (interpreter, tiny sizes)' || echo 'GPU run')"
echo "dense tiles $DENSE_TILES; sparse tiles $SPARSE_TILES; budget ${BUDGET_S}s"
status=0
"$PY" -m perf.bench_copy --gib "$GIB" --out "$OUT/results.jsonl" || status=1
"$PY" -m perf.bench_mla "${SIZE[@]}" --only dense --shapes "$DENSE_SHAPES" \
  --dense-shapes "$MORE_DENSE" --tiles "$DENSE_TILES" --out "$OUT/results.jsonl" || status=1
"$PY" -m perf.bench_mla "${SIZE[@]}" --only sparse --shapes "$SPARSE_SHAPES" \
  --tiles "$SPARSE_TILES" --out "$OUT/results.jsonl" || status=1
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
grep -q '"ok": false' "$OUT/results.jsonl" && { echo "a tile MISMATCHED its default or fp64" && status=1; }
echo "sweep took ${SECONDS}s of ${BUDGET_S}s"
((SECONDS > BUDGET_S)) && ! ((DRY)) && { echo "OVER the ${BUDGET_S}s budget" && status=1; }
exit $status
