#!/usr/bin/env bash
# A tile sweep of the partial-MLA kernels on a lent GPU, one prepared call (after gpu_check.sh
# has run once; the device library's README), and its dry run on a CPU machine:
#
#   bash perf/gpu_tiles.sh             on the GPU machine, from the repository root, $OUT set
#   bash perf/gpu_tiles.sh --dry-run   on a CPU machine: the same commands, interpreted, tiny
#
# Times the H 128 goal shapes (dense and sparse) once per candidate tile (perf.bench_mla --tiles:
# each tile's output first compared with the default tile's, which the GPU tier checks against
# fp64), between two copy-ceiling measurements (the GPU cold, then warm). The candidates are the
# tiles that compile without spills for sm_90 under triton 3.6.0 (the GPU's; 64x32w8s3 and sparse
# 64x16w8s5 spill under 3.9.0); the 64-head ones are the only ones whose SASS has HGMMA (wgmma).
# The first sweep (0054671) chose the tiles above 32 heads (``_mla_launch._WIDE``). Records: $OUT/results.jsonl, each with
# the commit ($MQNC_COMMIT, else .mqnc-commit, else git). Override the lists with $DENSE_TILES,
# $SPARSE_TILES, $DENSE_SHAPES.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-python3}
((DRY)) && [ "$PY" = python3 ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
SITE=${SITE:-/tmp/mqnc-site}
DENSE_TILES=${DENSE_TILES:-32x32w8s5,16x64w8s5,64x16w16s5,64x32w16s5,64x16w8s5,64x32w8s3}
SPARSE_TILES=${SPARSE_TILES:-32x16w8s5,16x32w8s5,64x16w16s5,64x16w8s5}
DENSE_SHAPES=${DENSE_SHAPES:-H=128 B=1 ct=8192,H=128 B=8 ct=32768,H=128 B=64 ct=8192}
if ((DRY)); then
  export TRITON_INTERPRET=1
  SIZE=(--tiny)
  GIB=0.01
  DENSE_SHAPES="H=16 B=1" # the only goal shapes --tiny has (cut to 128 entries)
  SPARSE_SHAPES="H=16 B=1"
else
  unset TRITON_INTERPRET
  SIZE=(--goals)
  GIB=4
  SPARSE_SHAPES="H=128"
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
echo "commit $MQNC_COMMIT; $([ "$DRY" = 1 ] && echo 'DRY RUN (interpreter, tiny sizes)' || echo 'GPU run')"
status=0
"$PY" -m perf.bench_copy --gib "$GIB" --out "$OUT/results.jsonl" || status=1
"$PY" -m perf.bench_mla "${SIZE[@]}" --only dense --shapes "$DENSE_SHAPES" \
  --tiles "$DENSE_TILES" --out "$OUT/results.jsonl" || status=1
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
grep -q '"ok": false' "$OUT/results.jsonl" && { echo "a tile MISMATCHED its default" && status=1; }
exit $status
