#!/usr/bin/env bash
# ONE prepared call for a lent H200 (see the device library's README, METHOD.md, HOPPER.md):
#   run it as   bash perf/gpu_check.sh   from the repository root, with $OUT set by the device tool.
# It installs the package offline into the machine's python3 (no registry there), records the
# environment, measures the copy-bandwidth ceiling first, runs the GPU test suite on the compiled
# bf16 path (not the interpreter), then the kernel benchmarks, then the NVSHMEM checks when
# present. Every step has its own timeout so the whole stays well inside 8 minutes; a failing
# step is logged and the script goes on. Results land in $OUT/results.jsonl (commit it under
# perf/results/ with the device name) and logs in $OUT/*.log; a short table is printed last.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MQNC_RESULTS="$OUT/results.jsonl" TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
PY=${PY:-python3}
status=0
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-14s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || status=1
}

step install 120 "$PY" -m pip install --no-index --no-deps --no-build-isolation -q -e .
step env 60 "$PY" -m mqnc env --json
step copy 60 "$PY" -m perf.bench_copy --gib 2
step tests 240 "$PY" -m pytest correctness -q -x -p no:cacheprovider
for bench in bench_merge bench_mla bench_splice; do
  [ -f "perf/$bench.py" ] && step "$bench" 120 "$PY" -m "perf.$bench"
done
[ -f perf/gpu_check_nvshmem.py ] && step nvshmem 120 "$PY" perf/gpu_check_nvshmem.py --out "$OUT"

cp "$OUT/env.log" "$OUT/env.json" 2>/dev/null
tail -n 3 "$OUT/tests.log"
cat "$OUT/summary.txt"
exit $status
