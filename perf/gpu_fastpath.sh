#!/usr/bin/env bash
# The default dense decode path on an H200, in one prepared call (perf/bench_fastpath.py), and
# its dry run on a CPU:
#
#   bash perf/gpu_fastpath.sh             on the GPU machine, from the repository root, $OUT set
#   bash perf/gpu_fastpath.sh --dry-run   on a CPU machine: the same steps, interpreted, tiny
#
# What it answers (perf/speed_targets.py FASTPATH_TARGETS, printed met / MISSED at the end):
# 0. warm: every case launched once by 16 worker processes (the see-saw's specialisations
#    compile in parallel into Triton's cache; none lands in a timed call);
# 1. exact: the public default path (mla_decode_partial, FlashMLA's mla_decode_with_kvcache,
#    CSR tables, pages of 128, s_q 2 causal, 16 / 64 / 100 / 128 heads, split and unsplit,
#    plan.run, out=, a CUDA-graph replay) against fp64; each record names the backend the
#    dispatch table chose and, for the Gluon kernel, its source fingerprint (what
#    mqnc.triton_kernels.evidence.VERIFIED records once this passes);
# 2. device: H 128 B 64 c_t 8192, B 8 c_t 32768, B 128 c_t 4096, H 64 B 32 c_t 8192 (TFLOP/s),
#    H 16 B 16 / 64 c_t 32768 (TB/s), H 16 B 1 c_t 2048 (decode + combine, us): CUDA-graph
#    replays over input sets larger than twice the L2, each shape's first set checked against
#    fp64 first;
# 3. sparse: top-2048 at H 128, B 1 / 8 / 64, the table's choice and the gather see-saw
#    forced (opt-in until these records verify it), each checked against fp64 first;
# 4. fp8: DeepSeek-V3.2's 656-byte FP8 cache (sparse top-2048 H 128 B 8 / 64; dense H 16 B 16
#    c_t 32768, H 128 B 64 c_t 8192): the table's choice, the FP8 see-saw forced (opt-in until
#    these records verify it) and the bf16 twin, each checked against fp64 over the dequantized
#    cache first; the exact stage runs the FP8 calls forced and by the table (0xFF bytes in
#    every entry not attended, -1 slots, partial top-k, empty rows, s_q 2 causal);
# 5. host: a user's loop of 200 back-to-back calls (FlashMLA's call and mla_decode_partial,
#    checks off and on; plan.run) at H 16 B 1 c_t 2048 and H 128 B 8 c_t 32768.
# Records: $OUT/results.jsonl (with device and commit: $MQNC_COMMIT, else .mqnc-commit, else
# git); append them to perf/results/results.jsonl. A mismatch prints MISMATCH and fails the run.
#
# Budget, 7 minutes on an H200 ($BUDGET_S, 420): install ~30 s; warm ~160 s (16 processes,
# ~45 cases, each process ~10 s to start and import, the see-saws' ~17 specialisations at
# ~30-45 s each in parallel, the tl and merge kernels' in seconds); exact ~30 s (fp64 references
# on the GPU); device ~40 s (7 shapes, 20 replays each, input generation on the GPU); sparse
# ~20 s (3 shapes x 2 backends); fp8 ~40 s (4 shapes x 3 variants, the pools quantized on the
# GPU); host ~30 s (10 loops of 200 calls, 5 cases, 2 shapes; the checked calls sync per call).
source "$(dirname "$0")/gpu_common.sh"
gpu_python
BUDGET_S=${BUDGET_S:-420}
gpu_interpreter
gpu_commit
export MQNC_COMMIT MQNC_RESULTS="$OUT/results.jsonl" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
gpu_install
echo "commit $MQNC_COMMIT; $( ((DRY)) && echo 'DRY RUN (interpreter, tiny)' || echo 'GPU run'); budget ${BUDGET_S}s"
status=0
args=(--out "$OUT/results.jsonl")
((DRY)) && args+=(--dry-run)
timeout -k 5 "$BUDGET_S" "$PY" -m perf.bench_fastpath "${args[@]}" || status=1
grep -c . "$OUT/results.jsonl" | sed 's/$/ records/'
grep -q '"ok": false' "$OUT/results.jsonl" && { echo "a case MISMATCHED fp64" && status=1; }
echo "fast-path check took ${SECONDS}s of ${BUDGET_S}s"
((SECONDS > BUDGET_S)) && ! ((DRY)) && { echo "OVER the ${BUDGET_S}s budget" && status=1; }
exit $status
