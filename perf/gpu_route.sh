#!/usr/bin/env bash
# The device route on a lent GPU, one prepared call, and its dry run on a CPU machine:
#
#   bash perf/gpu_route.sh             on the GPU machine, from the repository root, $OUT set
#   bash perf/gpu_route.sh --dry-run   on a CPU machine: the same commands, interpreted, tiny
#
# Steps (docs/device-route.md):
#   1. the proof, on the GPU (the suite runs it interpreted; not in the dry run):
#      correctness/test_device_route.py (the holder kernel one-shot against the host-driven
#      holder, bit for bit; bad headers, stop, sequence wrap);
#   2. perf.bench_device_route: the host-free probe round trip, the route at M_q 16..1024 (H 16,
#      c_t 2048, 4 layers a captured step) and 1 (one head), H 128 at B 1 / 8, N requesters
#      2..16 (the fan-in elbow), each answer checked against fp64 first; records
#      ($OUT/results_route.jsonl, each with the commit) bench "probe" / "route", transport
#      "device-local", extra.host_free, extra.host_calls_per_layer (graph replays over routed
#      layers, counted);
#   3. the demo over the device route: mqnc demo --device-route (the demo's corpus, 16 chunks of
#      256-512 tokens, 4 layers, each layer checked against fp64; $OUT/demo/device_route.json).
#
# Budget, 4 minutes on an H200 ($BUDGET_S, 240; the run fails past it), estimated (no run yet):
# ~30 s of compiles (the holder kernels, put and merge, twice: 16 and 128 heads), 14 route
# points and a probe at 20 samples of 20 graph replays of a 4-layer step (each replay < 1 ms
# expected: well under 10 s), two holders' set-up (the split tables: ~65 plans each, ~5 s),
# the proof's 7 tests on the GPU (~20 s), the demo (~60 s).
source "$(dirname "$0")/gpu_common.sh"
gpu_python
BUDGET_S=${BUDGET_S:-240}
mkdir -p "$OUT/logs"
gpu_interpreter
gpu_commit
export MQNC_COMMIT PYTHONUNBUFFERED=1
gpu_install
echo "commit $MQNC_COMMIT; $([ "$DRY" = 1 ] && echo 'DRY RUN (interpreter, tiny sizes)' || echo 'GPU run'); budget ${BUDGET_S}s"
status=0
step() { # name, command...: logged to $OUT/logs/<name>.log, one line in $OUT/summary.txt
  local name=$1 t0=$SECONDS rc
  shift
  "$@" >"$OUT/logs/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  ((rc == 0)) || { tail -20 "$OUT/logs/$name.log" && status=1; }
}
((DRY)) || step proof "$PY" -m pytest correctness/test_device_route.py -q -p no:cacheprovider
step bench "$PY" -m perf.bench_device_route --out "$OUT/results_route.jsonl" \
  --commit "$MQNC_COMMIT" $( ((DRY)) && echo --dry-run)
if ((DRY)); then # the demo's own test runs it interpreted (test_device_route)
  echo "demo skipped in the dry run" | tee -a "$OUT/summary.txt"
else
  step demo "$PY" -m mqnc demo --device-route --out "$OUT/demo"
fi
grep -c . "$OUT/results_route.jsonl" 2>/dev/null | sed 's/$/ records (results_route.jsonl)/'
echo "route run took ${SECONDS}s of ${BUDGET_S}s"
((SECONDS > BUDGET_S)) && ! ((DRY)) && { echo "OVER the ${BUDGET_S}s budget" && status=1; }
exit $status
