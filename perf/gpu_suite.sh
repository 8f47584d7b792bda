#!/usr/bin/env bash
# The whole test suite on a lent GPU, compiled, one prepared call per shard, and its dry run:
#
#   SHARD=1/3 bash perf/gpu_suite.sh   on the GPU machine, from the repository root, $OUT set:
#                                      the suite's test files, shard 1 of 3 (by file, round robin
#                                      over the sorted list), compiled (TRITON_INTERPRET unset),
#                                      on $WORKERS pytest-xdist workers, within $BUDGET_S
#   bash perf/gpu_suite.sh --dry-run   on a CPU machine: the list of every test the GPU run would
#                                      run ($OUT/suite_tests.txt, one node id a line, and the
#                                      shard of each file in $OUT/suite_shards.txt), collected
#                                      as pytest collects them, nothing run
#
# Every test takes its device from mqnc.testing.default_device() (the GPU when the kernels are
# compiled and CUDA exists), so on the GPU the same tests run compiled; a test that needs the
# interpreter (its bf16 software rounding, a launch lock) skips itself there and says why. The
# long tier (the GPU scripts' dry runs, the planted defects, the NVSHMEM compiles) is left out:
# it rehearses CPU-side work. The NVSHMEM engine's conformance cases run when the carried wheels
# (.whl/, nvshmem4py) install. Results: $OUT/junit.xml (every test's outcome), $OUT/summary.txt
# (pytest's last lines), $OUT/logs/suite.log.
#
# Budget: $BUDGET_S (540) per shard; compiles dominate (~30 s per specialization of a large kernel
# on the H200): perf/warmup.py compiles the production variants first, in parallel.
source "$(dirname "$0")/gpu_common.sh"
gpu_python
BUDGET_S=${BUDGET_S:-540}
WORKERS=${WORKERS:-8}
SHARD=${SHARD:-1/1}
mkdir -p "$OUT/logs"
gpu_interpreter
gpu_commit
export MQNC_COMMIT PYTHONUNBUFFERED=1
gpu_install
k=${SHARD%/*}
n=${SHARD#*/}
if ! [[ $k =~ ^[0-9]+$ && $n =~ ^[0-9]+$ ]] || ((k < 1 || k > n)); then
  echo "SHARD: expected k/n with 1 <= k <= n, got $SHARD" >&2
  exit 2
fi
# the suite's files, sorted; shard k takes every n-th from the k-th
mapfile -t FILES < <(cd correctness && ls test_*.py | sort)
SHARD_FILES=()
for i in "${!FILES[@]}"; do
  ((i % n == k - 1)) && SHARD_FILES+=("correctness/${FILES[$i]}")
done
if ((DRY)); then
  for i in "${!FILES[@]}"; do echo "$((i % n + 1)) ${FILES[$i]}"; done >"$OUT/suite_shards.txt"
  "$PY" -m pytest correctness --collect-only -q -p no:cacheprovider -m "not long" 2>&1 |
    grep '::' >"$OUT/suite_tests.txt"
  echo "DRY RUN: $(wc -l <"$OUT/suite_tests.txt") tests the GPU run would run compiled" \
    "(shard $SHARD: ${#SHARD_FILES[@]} of ${#FILES[@]} files)" | tee "$OUT/summary.txt"
  exit 0
fi
echo "commit $MQNC_COMMIT; GPU run, shard $SHARD (${#SHARD_FILES[@]} files); budget ${BUDGET_S}s"
# the carried wheels (nvshmem4py, ...; perf/install_wheels.py) on PYTHONPATH, so that the NVSHMEM
# engine's conformance cases run instead of skipping
mkdir -p "$SITE" && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m perf.install_wheels --wheels .whl --target "$SITE" >"$OUT/logs/wheels.log" 2>&1
echo "wheels rc=$? ${SECONDS}s" | tee -a "$OUT/summary.txt"
TRITON_INTERPRET=0 timeout $((BUDGET_S / 3)) "$PY" -m perf.warmup >"$OUT/logs/warmup.log" 2>&1
echo "warmup rc=$? ${SECONDS}s" | tee -a "$OUT/summary.txt"
timeout $((BUDGET_S - SECONDS)) "$PY" -m pytest "${SHARD_FILES[@]}" -q -p no:cacheprovider \
  -m "not long" -n "$WORKERS" --dist loadfile --junitxml "$OUT/junit.xml" >"$OUT/logs/suite.log" 2>&1
rc=$?
tail -15 "$OUT/logs/suite.log" | tee -a "$OUT/summary.txt"
echo "suite shard $SHARD rc=$rc ${SECONDS}s of ${BUDGET_S}s" | tee -a "$OUT/summary.txt"
exit $rc
