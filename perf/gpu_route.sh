#!/usr/bin/env bash
# The device route on a lent GPU, one prepared call, and its dry run on a CPU machine:
#
#   bash perf/gpu_route.sh             on the GPU machine, from the repository root, $OUT set
#   bash perf/gpu_route.sh --dry-run   on a CPU machine: the same commands, interpreted, tiny
#
# Steps (docs/device-route.md):
#   0. perf.warmup --ops route: the route's own kernels (resident holder kernels, put, wait,
#      merge, the pass's take, gather and reply) compiled by 16 processes (not in the dry run:
#      test_compile_sm90 compiles the same launches);
#   1. perf.bench_device_route --check, after its warm-up (--warm-jobs 16: the attention,
#      splice and default-kernel specialisations the run, the tests and the demo compile, by 16
#      processes sharing Triton's cache): the host-free
#      probe round trip, the route over M_q 1..1024 at c_t 2048 (H 16, 4 layers a captured step)
#      and 1..1024 at c_t 8192, 16 requesters at once, H 128 at B 1 / 8, the holder's compute
#      against the default kernel, the fetch (pull and splice) of both chunks, every answer
#      checked against fp64 first; records ($OUT/results_route.jsonl, each with the commit)
#      with extra.host_free and extra.host_calls_per_layer; --check fails the step on a missed
#      goal (probe 5 us; route M_q 1, 16: 15 us; M_q 1024: 40 us; 16 x M_q 16: 60 us; holder
#      compute 1.5x the default kernel) or a crossover more than 15% from the predicate's, and
#      prints every crossover (the records are kept either way);
#   2. the proof, on the GPU (the suite runs it interpreted; not in the dry run):
#      correctness/test_device_route.py (the pass and the resident kernels against the
#      host-driven holder; bad headers, stop, sequence wrap, packing, the profile's fit);
#   3. the demo over the device route: mqnc demo --device-route (the demo's corpus, 16 chunks
#      of 256-512 tokens, 4 layers; its calibration measured there, each (chunk, agent) decided
#      by the predicate from it, each layer checked against fp64; $OUT/demo/device_route.json).
#
# Budget, 5 minutes on an H200 ($BUDGET_S, 300; the run fails past it), estimated (no run of
# this layout yet): install ~30 s; warm-up ~60 s (the see-saw's two specialisations ~30 s each,
# in parallel with the small kernels); ~30 timed steps of 20 samples of 20 graph replays, each
# with a holder restart and two captures (~0.5 s each: ~15 s); the proof's 27 tests (~60 s);
# the demo (~40 s).
source "$(dirname "$0")/gpu_common.sh"
gpu_python
BUDGET_S=${BUDGET_S:-300}
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
((DRY)) || step warmup "$PY" -m perf.warmup --ops route --jobs 16
step bench "$PY" -m perf.bench_device_route --out "$OUT/results_route.jsonl" \
  --commit "$MQNC_COMMIT" $( ((DRY)) && echo --dry-run --warm-jobs 1 || echo --warm-jobs 16 --check)
((DRY)) || step proof "$PY" -m pytest correctness/test_device_route.py -q -p no:cacheprovider
if ((DRY)); then # the demo's own test runs it interpreted (test_device_route)
  echo "demo skipped in the dry run" | tee -a "$OUT/summary.txt"
else
  step demo "$PY" -m mqnc demo --device-route --out "$OUT/demo"
fi
grep -c . "$OUT/results_route.jsonl" 2>/dev/null | sed 's/$/ records (results_route.jsonl)/'
echo "route run took ${SECONDS}s of ${BUDGET_S}s"
((SECONDS > BUDGET_S)) && ! ((DRY)) && { echo "OVER the ${BUDGET_S}s budget" && status=1; }
exit $status
