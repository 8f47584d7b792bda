"""``python -m perf.kernel_report``: the static performance report of the kernels at the goal
shapes (PREDICTIONS; ``--measured results.jsonl`` joins measured p50s). The report lives in
:mod:`mqnc.measure.kernel_report` (also ``mqnc kernel-report``); this is its benchmark-folder
entry point, which ``perf/gpu_check.sh`` runs."""

from mqnc.measure.kernel_report import main

if __name__ == "__main__":
    raise SystemExit(main())
