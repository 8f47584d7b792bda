#!/usr/bin/env bash
# ONE prepared call for a lent H200 (the device library's README, METHOD.md, HOPPER.md), and its
# dry run on a CPU machine:
#
#   bash perf/gpu_check.sh             on the GPU machine, from the repository root, $OUT set
#   bash perf/gpu_check.sh --dry-run   on a CPU machine: every step's real command, with the
#                                      interpreter and tiny sizes (correctness/test_gpu_check.py)
#   ONLY="install copy warmup bench_mla report tests" bash perf/gpu_check.sh    a subset of the steps
#
# Steps, in priority order, each with a cap (seconds; the caps sum to at most BUDGET - RESERVE,
# checked before anything runs; a step is clamped to what is left and skipped under 10 s; a
# failing step is logged and the script goes on; exit status 2 of a step means "skipped"):
#   install      the package, offline (no registry there; if pip cannot, mqnc is linked into
#                $SITE instead)
#   wheels       the carried wheels of .whl/ (perf/install_wheels.py: nvshmem4py, cuda.core /
#                cuda.pathfinder only if the image's are too old) into $SITE, on PYTHONPATH
#   env          versions, device, interpreter mode                      -> $OUT/env.json
#   copy         the memory ceilings, first (kernel GB/s are read against them): the Triton read
#                and copy kernels over 4 GiB and torch's copy_, clocks read before and after
#   warmup       every production kernel variant and the NVSHMEM kernels compiled into the
#                Triton cache by 16 processes, then every goal shape planned on the GPU
#   bench_merge, bench_mla, bench_splice   the kernel benchmarks over the production goal shapes
#                (the splice in bf16 and FP8: the FP8 cache's own splice profile, mqnc predict
#                --kv-dtype fp8 --splice-from)
#                (CUDA-graph replays over L2-rotated inputs; extra.timing says how)
#   bench_fp8    the FP8 cache's goal shapes (dense H 16 B 16 c_t 32768, sparse top-2048 H 128
#                B 8), each in bf16 and then FP8 (perf.bench_mla --kv-dtype both): the twins the
#                FP8 goals compare (perf/speed_targets.py, FP8_TARGETS)
#   launch       the host time of one launch of the holder's partial (dense H 16 B 1 c_t 2048):
#                eager call, plan.run, CUDA-graph replays of it and of a routed step
#                (perf.bench_host --launch)
#   report       mqnc/measure/kernel_report.py: predictions and the measured p50 in one table
#                (--kv-dtype both: the FP8 shapes too, each against its bf16 twin)
#   tests        the GPU test tier (pytest -m gpu: correctness/conftest.py's GPU_TIER list)
#   holder       Fig. 4(b) holder batching (the Triton kernel) and Fig. 5(b) K-stream staging
#   nvshmem      two NVSHMEM PEs on the one GPU: probe, route sweep, a routed partial's
#                exactness, host- and device-initiated puts (skipped without nvshmem4py)
#   route, fetch the host-side transport benchmarks over gloo (the host's TCP loopback)
# Results land in $OUT/results.jsonl: every benchmark step is given --out "$RESULTS" (the shared
# flag set of mqnc.measure.options), and $MQNC_RESULTS names the same file for anything that
# records without a flag, so nothing lands in the copy's perf/results/. Commit the records with
# the device name by appending them to perf/results/results.jsonl (what --record writes). Every
# record carries the commit ($MQNC_COMMIT: given, else the .mqnc-commit file that travels
# with the copy); per-step logs are packed into $OUT/logs.tgz (the device tool returns at most 8
# files); printed last: the kernel report, the tests' last lines, every speed target against
# this run's records (perf.speed_targets, met / MISSED; all in table.txt) and $OUT/summary.txt.
source "$(dirname "$0")/gpu_common.sh"
# the interpreter: $PY, else for the dry run the checkout's venv (`make venv`) when there is one
# (the system python3 of a CPU machine has no torch), else python3 (the GPU image's)
if [ -z "${PY:-}" ]; then
  PY=python3
  ((DRY)) && [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
BUDGET=${BUDGET:-450}
RESERVE=20 # kept for packing the logs and printing the tables

# ---- every step's cap and arguments, in one place (the GPU run | the dry run) -----------------
STEPS=(install wheels env copy warmup bench_merge bench_mla bench_fp8 bench_splice launch report
  tests holder nvshmem route fetch)
# (bench_mla measured 11 s, nvshmem 17 s and tests 32 s of their 60, 60 and 55 on the H200:
# launch's 20 s and the dry run's margin for env and report on a loaded 2-core machine, where
# they took 10 s and 30-40 s, come from them; bench_fp8's 25 s (a start, its FP8 compiles where
# the warm-up had none, two shapes in two formats) and the report's 5 s more for its FP8 shapes
# (+7 s here) from bench_mla (11 of 40), nvshmem (17 of 40) and bench_splice (6 of 30))
declare -A CAP=([install]=15 [wheels]=10 [env]=15 [copy]=25 [warmup]=50 [bench_merge]=20
  [bench_mla]=25 [bench_fp8]=25 [bench_splice]=20 [launch]=20 [report]=50 [tests]=50 [holder]=25
  [nvshmem]=35 [route]=20 [fetch]=25)
if ((DRY)); then
  export TRITON_INTERPRET=1 # every step but the compiling ones (warmup, report: =0) interprets
  PIP_DRY=(--dry-run)
  WHEEL_ARGS=(--dry-run)
  COPY_ARGS=(--gib 0.01)
  WARMUP_ARGS=(--jobs 2 --ops merge)
  BENCH_ARGS=(--goals --tiny)
  FP8_ARGS=(--goals --tiny --kv-dtype both) # the first goal shape of each op, cut
  LAUNCH_ARGS=(--reps 5 --warmup 1)
  REPORT_ARGS=(--kv-dtype both) # the goal shapes and the FP8 ones, each beside its bf16 twin
  TEST_ARGS=(--collect-only)
  HOLDER_ARGS=(--tiny)
  NVSHMEM_ARGS=(--transport gloo --tiny --timeout 30 --poll-spins 4096,64) # gloo: one run
  ROUTE_ARGS=(--transport gloo --quick --m-q 1,64 --reps 3 --warmup 1)
  FETCH_ARGS=(--transport gloo --quick --c-t 16 --max-holders 1 --topk 64 --m-q 32
    --pool-rows 256 --reps 3 --warmup 1)
else
  unset TRITON_INTERPRET
  PIP_DRY=()
  WHEEL_ARGS=()
  COPY_ARGS=(--gib 4)
  WARMUP_ARGS=(--jobs 16)
  BENCH_ARGS=(--goals)
  FP8_ARGS=(--goals --kv-dtype both --shapes "H=16 B=16 ct=32768,H=128 B=8 topk=2048")
  LAUNCH_ARGS=(--reps 200 --warmup 20)
  REPORT_ARGS=(--kv-dtype both)
  TEST_ARGS=()
  HOLDER_ARGS=()
  # two put paths at 4096 and at 64 rounds per device-side poll (each run ~7 s on the H200;
  # 12 s + 2 s of joins) in the cap; the default rounds first
  NVSHMEM_ARGS=(--quick --timeout 12 --poll-spins 4096,64)
  ROUTE_ARGS=(--transport gloo --quick)
  FETCH_ARGS=(--transport gloo --quick)
fi
# -------------------------------------------------------------------------------------------------

LOG="$OUT/logs"
mkdir -p "$LOG" "$SITE"
RESULTS="$OUT/results.jsonl" # where every record of this run goes: --out "$RESULTS" below
export PYTHONUNBUFFERED=1 MQNC_RESULTS="$RESULTS" TRITON_DEFAULT_FP_FUSION=1
export GLOO_SOCKET_IFNAME=lo
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# The commit: $MQNC_COMMIT, else .mqnc-commit (written here just before the device call), else
# git, else "unknown". The file comes before git: the device tool's copy carries the working tree
# with the .git of what has LANDED, so there git names an older commit than the tree it runs
# (seen: a tree at bb7e891 recorded as c1acbb2). The dry run, where git is right, refuses a
# .mqnc-commit that is not HEAD's, so a stale file never reaches the device.
GIT_HEAD=$(git rev-parse --short=12 HEAD 2>/dev/null || echo none)
if [ -z "${MQNC_COMMIT:-}" ]; then
  if [ -s .mqnc-commit ]; then
    MQNC_COMMIT=$(tr -d '[:space:]' <.mqnc-commit)
    if ((DRY)) && [ "$GIT_HEAD" != none ] && [ "$MQNC_COMMIT" != "$GIT_HEAD" ]; then
      echo ".mqnc-commit: expected HEAD's commit ${GIT_HEAD}, got ${MQNC_COMMIT};" \
        "run: git rev-parse --short=12 HEAD > .mqnc-commit" >&2
      exit 3
    fi
  elif [ "$GIT_HEAD" != none ]; then
    MQNC_COMMIT=$GIT_HEAD
  else
    MQNC_COMMIT=unknown
  fi
fi
export MQNC_COMMIT
T0=$SECONDS
status=0
: >"$OUT/summary.txt"

# ONLY="install warmup bench_mla" (names of STEPS, space- or comma-separated): run just those,
# e.g. a second call after the full check to measure a kernel change; every other step is
# logged as skipped. The caps still sum as for the full check.
if [ -n "${ONLY+set}" ]; then # commas, spaces, tabs, newlines: one space between names
  ONLY=$(printf '%s' "$ONLY" | tr -s ', \t\n' '    ')
  ONLY=${ONLY# } && ONLY=${ONLY% }
  if [ -z "$ONLY" ]; then
    echo "ONLY: expected step names out of ${STEPS[*]}, got none" >&2
    exit 3
  fi
fi
ONLY=${ONLY:-}
set -f # a name is a word, never a file pattern
for s in $ONLY; do
  if [ -z "${CAP[$s]:-}" ]; then
    echo "ONLY: expected step names out of ${STEPS[*]}, got '$s'" >&2
    exit 3
  fi
done
set +f
total=0
for s in "${STEPS[@]}"; do total=$((total + CAP[$s])); done
if ((total > BUDGET - RESERVE)); then
  echo "budget: the step caps sum to ${total} s > ${BUDGET} s - ${RESERVE} s reserved" >&2
  exit 3
fi
echo "budget: ${#STEPS[@]} steps, caps ${total} s + reserve ${RESERVE} s <= ${BUDGET} s;" \
  "commit ${MQNC_COMMIT} (git HEAD here: ${GIT_HEAD}); $([ "$DRY" = 1 ] && echo 'DRY RUN (interpreter, tiny sizes)' ||
    echo 'GPU run')" | tee -a "$OUT/summary.txt"

step() { # step NAME CMD...: run CMD under NAME's cap (clamped to the budget left)
  local name=$1 secs=${CAP[$1]}
  shift
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
    printf '%-13s skipped (not in ONLY)\n' "$name" | tee -a "$OUT/summary.txt"
    return
  fi
  local left=$((BUDGET - RESERVE - (SECONDS - T0)))
  ((secs > left)) && secs=$left
  if ((secs < 10)); then
    printf '%-13s skipped (budget: %ss left)\n' "$name" "$left" | tee -a "$OUT/summary.txt"
    return
  fi
  local t=$SECONDS
  timeout -k 5 "$secs" "$@" >"$LOG/$name.log" 2>&1
  local rc=$? what=ok
  case $rc in
  0) ;;
  2) what="skipped (see its log)" ;;
  124 | 137) what="TIMEOUT (cap ${secs}s)" ;;
  *) what=FAILED ;;
  esac
  printf '%-13s rc=%-3s %4ss of %4ss  %s\n' "$name" "$rc" "$((SECONDS - t))" "$secs" "$what" |
    tee -a "$OUT/summary.txt"
  last_rc=$rc
  case $rc in 0 | 2) ;; *) status=1 ;; esac
}

last_rc=0
step install "$PY" -m pip install --no-index --no-deps --no-build-isolation -q "${PIP_DRY[@]}" -e .
if ((last_rc != 0)) && ((!DRY)); then # mqnc importable through links: mqnc/* + triton_kernels
  mkdir -p "$SITE/mqnc" && for f in mqnc/*; do ln -sfn "$ROOT/$f" "$SITE/mqnc/"; done &&
    ln -sfn "$ROOT/triton_kernels" "$SITE/mqnc/triton_kernels" &&
    echo "install       fallback: mqnc linked into $SITE" | tee -a "$OUT/summary.txt"
fi
step wheels "$PY" -m perf.install_wheels --wheels .whl --target "$SITE" "${WHEEL_ARGS[@]}"
# stdout alone into env.json (a warning on stderr stays in env.log: the JSON stays JSON)
step env sh -c '"$0" -m mqnc env --json >"$1"' "$PY" "$OUT/env.json"
step copy "$PY" -m perf.bench_copy "${COPY_ARGS[@]}" --out "$RESULTS"
step warmup env TRITON_INTERPRET=0 "$PY" -m perf.warmup "${WARMUP_ARGS[@]}"
step bench_merge "$PY" -m perf.bench_merge "${BENCH_ARGS[@]}" --out "$RESULTS"
step bench_mla "$PY" -m perf.bench_mla "${BENCH_ARGS[@]}" --out "$RESULTS"
step bench_fp8 "$PY" -m perf.bench_mla "${FP8_ARGS[@]}" --out "$RESULTS"
step bench_splice "$PY" -m perf.bench_splice "${BENCH_ARGS[@]}" --kv-dtype both --out "$RESULTS"
step launch "$PY" -m perf.bench_host --launch "${LAUNCH_ARGS[@]}" --out "$RESULTS"
step report env TRITON_INTERPRET=0 "$PY" -m mqnc.measure.kernel_report "${REPORT_ARGS[@]}" \
  --measured "$RESULTS" --out "$OUT/kernel_report.jsonl"
step tests "$PY" -m pytest correctness -m gpu -q -p no:cacheprovider "${TEST_ARGS[@]}"
step holder "$PY" -m perf.bench_holder "${HOLDER_ARGS[@]}" --out "$RESULTS"
step nvshmem "$PY" -m perf.gpu_check_nvshmem "${NVSHMEM_ARGS[@]}" --out "$RESULTS"
step route "$PY" -m perf.bench_route "${ROUTE_ARGS[@]}" --out "$RESULTS"
step fetch "$PY" -m perf.bench_fetch "${FETCH_ARGS[@]}" --out "$RESULTS"

# The records table: one line per record of this run (bench, variant, x, p50, GB/s, how timed).
"$PY" - "$RESULTS" >"$OUT/table.txt" 2>&1 <<'EOF'
import json, sys
try:
    recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except OSError as exc:
    print(f"no results: {exc}")
    raise SystemExit(0)
print(f"{len(recs)} records on {recs[0]['device'] if recs else '?'}")
print(f"{'bench':<13}{'variant':<26}{'x':>10}{'p50 us':>12}{'GB/s':>9}{'%read':>7}{'%spec':>7}"
      "  backend   timing")
def pct(e, k):
    return f"{e[k]:.0f}" if isinstance(e.get(k), (int, float)) else ""
for r in recs:
    gbps = f"{r['gbps']:.1f}" if r.get("gbps") else ""
    x = r["x"] if not isinstance(r["x"], float) else f"{r['x']:g}"
    e = r.get("extra") or {}
    how = e.get("timing", {}).get("method", "")
    where = r.get("transport") or r.get("backend")
    print(f"{r['bench']:<13}{str(r['variant'])[:25]:<26}{x!s:>10}{r['p50']:>12.1f}{gbps:>9}"
          f"{pct(e, 'pct_of_read'):>7}{pct(e, 'pct_of_spec'):>7}  {where:<9} {how}")
EOF
# every speed target against this run's records (met / MISSED / not measured), after the table
"$PY" -m perf.speed_targets "$RESULTS" >>"$OUT/table.txt" 2>&1
cp "$LOG/report.log" "$OUT/kernel_report.txt" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOG"
# the device tool brings back at most 8 files of $OUT: more would be left behind unsaid
nfiles=$(find "$OUT" -path "$SITE" -prune -o -type f -print | wc -l)
if ((nfiles > 8)); then
  echo "files in \$OUT: $nfiles > 8 (the device tool returns 8): TOO MANY" | tee -a "$OUT/summary.txt"
  status=1
fi
echo "---- records (first 40 lines; all in table.txt) ----"
head -n 40 "$OUT/table.txt"
echo "---- kernel report, shapes (predicted vs measured; all in kernel_report.txt) ----"
grep -A 81 '^| shape | goal' "$OUT/kernel_report.txt" 2>/dev/null | head -n 82
grep -A 7 '^| FP8 shape' "$OUT/kernel_report.txt" 2>/dev/null
echo "---- tests (last lines) ----"
tar xzf "$OUT/logs.tgz" -O logs/tests.log 2>/dev/null | tail -n 5
echo "---- goals met / MISSED in this run's records (every target in table.txt) ----"
sed -n '/^targets against /,$p' "$OUT/table.txt" | grep -E '^targets against| (met|MISSED)$|checked, ' |
  head -n 60
echo "---- summary: $((SECONDS - T0)) s of a $BUDGET s budget ----"
cat "$OUT/summary.txt"
exit $status
