#!/usr/bin/env bash
# ONE prepared call for a lent H200 (see the device library's README, METHOD.md, HOPPER.md):
#   run it as   bash perf/gpu_check.sh   from the repository root, with $OUT set by the device tool.
#
# What it does, in priority order (each step has its own timeout, clamped to what is left of
# a total budget of $BUDGET seconds, default 450 = 7.5 min; a step that would get < 15 s is
# skipped; a failing step is logged and the script goes on):
#   install   the package, offline, into the machine's python3 (no registry there)
#   env       versions, device, interpreter mode            -> $OUT/env.json
#   copy      the device copy-bandwidth ceiling, FIRST (kernel GB/s are read against it)
#   tests     the test suite on the compiled bf16 path (TRITON_INTERPRET unset; the CPU-only
#             notebook test is left out)
#   bench_*   kernel benchmarks: merge, mla, splice (whichever exist)
#   holder    Fig. 4(b) holder batching with the Triton MLA kernel and Fig. 5(b) K-stream staging
#   nvshmem   route/probe over NVSHMEM with two PEs, if perf/gpu_check_nvshmem.py exists
#   route, fetch, congestion   the host-side transport benchmarks over gloo (--quick; records
#             carry extra.host_side = true: they time the host's TCP loopback, not the GPU)
#   calibrate a gloo fabric profile of this host                -> $OUT/logs (in logs.tgz)
# Results land in $OUT/results.jsonl (commit it under perf/results/ with the device name);
# per-step logs are packed into $OUT/logs.tgz (the device tool returns at most 8 files);
# $OUT/table.txt has one line per record; printed last: the records table (head), the tests'
# last lines and $OUT/summary.txt (every step's status and time).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
LOG="$OUT/logs"
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 MQNC_RESULTS="$OUT/results.jsonl" TRITON_DEFAULT_FP_FUSION=1
export GLOO_SOCKET_IFNAME=lo
unset TRITON_INTERPRET
PY=${PY:-python3}
BUDGET=${BUDGET:-450}
RESERVE=20 # kept for packing the logs and printing the table
T0=$SECONDS
status=0
: >"$OUT/summary.txt"

step() { # step NAME SECONDS CMD...
  local name=$1 secs=$2
  shift 2
  local left=$((BUDGET - RESERVE - (SECONDS - T0)))
  ((secs > left)) && secs=$left
  if ((secs < 15)); then
    printf '%-12s skipped (budget: %ss left)\n' "$name" "$left" | tee -a "$OUT/summary.txt"
    return
  fi
  local t=$SECONDS
  timeout -k 10 "$secs" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  local what=ok
  [ "$rc" = 0 ] || what=FAILED
  [ "$rc" = 124 ] && what="TIMEOUT (${secs}s)"
  printf '%-12s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t))" "$what" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || status=1
}

step install 90 "$PY" -m pip install --no-index --no-deps --no-build-isolation -q -e .
step env 30 "$PY" -m mqnc env --json
cp "$LOG/env.log" "$OUT/env.json" 2>/dev/null
step copy 45 "$PY" -m perf.bench_copy --gib 2
step tests 180 "$PY" -m pytest correctness -q -p no:cacheprovider --maxfail=10 \
  --ignore=correctness/test_notebooks.py
for bench in bench_merge bench_mla bench_splice; do
  [ -f "perf/$bench.py" ] && step "$bench" 60 "$PY" -m "perf.$bench"
done
step holder 60 "$PY" -m perf.bench_holder
if [ -f perf/gpu_check_nvshmem.py ]; then
  mkdir -p "$LOG/nvshmem"
  step nvshmem 90 "$PY" perf/gpu_check_nvshmem.py --out "$LOG/nvshmem"
fi
step route 45 "$PY" -m perf.bench_route --transport gloo --quick
step fetch 45 "$PY" -m perf.bench_fetch --transport gloo --quick
step congestion 45 "$PY" -m perf.bench_congestion --transport gloo --quick
step calibrate 30 "$PY" -m mqnc calibrate --transport gloo --quick --out "$LOG/fabric-gloo.json"

# The table: one line per record of this run (bench, variant, x, p50, GB/s, backend).
"$PY" - "$OUT/results.jsonl" >"$OUT/table.txt" 2>&1 <<'EOF'
import json, sys
try:
    recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except OSError as exc:
    print(f"no results: {exc}")
    raise SystemExit(0)
print(f"{len(recs)} records on {recs[0]['device'] if recs else '?'}")
print(f"{'bench':<13}{'variant':<26}{'x':>10}{'p50 us':>12}{'GB/s':>9}  backend/transport")
for r in recs:
    gbps = f"{r['gbps']:.1f}" if r.get("gbps") else ""
    x = r["x"] if not isinstance(r["x"], float) else f"{r['x']:g}"
    where = r.get("transport") or r.get("backend")
    print(f"{r['bench']:<13}{str(r['variant'])[:25]:<26}{x!s:>10}{r['p50']:>12.1f}{gbps:>9}  {where}")
EOF
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOG"
echo "---- records (first 80 lines; all in table.txt) ----"
head -n 80 "$OUT/table.txt"
echo "---- tests (last lines) ----"
tar xzf "$OUT/logs.tgz" -O logs/tests.log 2>/dev/null | tail -n 3
echo "---- summary: $((SECONDS - T0)) s of a $BUDGET s budget ----"
cat "$OUT/summary.txt"
exit $status
