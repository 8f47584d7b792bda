# shellcheck shell=bash
# The prelude the prepared GPU scripts share (gpu_check.sh, gpu_gluon.sh, gpu_route.sh,
# gpu_tiles.sh), sourced first with the script's arguments: `source "$(dirname "$0")/gpu_common.sh"`.
#
# Sets: strict mode (set -uo pipefail; a failing command is the script's to count), ROOT (the
# repository root, also the working directory), DRY (1 under --dry-run, else 0), OUT (given,
# else a fresh temporary folder) and SITE (where mqnc is linked when pip cannot install it).
# Defines, for the scripts to call in their own order:
#   gpu_python       PY: given, else python3, and for the dry run the checkout's venv
#                    (.venv/bin/python, `make venv`) in place of python3 when there is one
#   gpu_interpreter  TRITON_INTERPRET=1 exported for the dry run, unset on the GPU
#   gpu_commit       MQNC_COMMIT: given, else .mqnc-commit (it travels with the device copy),
#                    else git's HEAD (gpu_check.sh has its own, which refuses a stale file)
#   gpu_install      on the GPU only, when mqnc does not import: the package installed offline,
#                    else linked into $SITE and put on PYTHONPATH (gpu_check.sh's install step)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-$(mktemp -d)}
SITE=${SITE:-/tmp/mqnc-site}

gpu_python() {
  PY=${PY:-python3}
  if ((DRY)) && [ "$PY" = python3 ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
}

gpu_interpreter() {
  if ((DRY)); then
    export TRITON_INTERPRET=1
  else
    unset TRITON_INTERPRET
  fi
}

gpu_commit() {
  if [ -z "${MQNC_COMMIT:-}" ]; then
    MQNC_COMMIT=$( (tr -d '[:space:]' <.mqnc-commit) 2>/dev/null || git rev-parse --short=12 HEAD)
  fi
}

gpu_install() {
  if ! ((DRY)) && ! "$PY" -c "import mqnc.triton_kernels" 2>/dev/null; then
    "$PY" -m pip install --no-index --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || {
      mkdir -p "$SITE/mqnc" && for f in mqnc/*; do ln -sfn "$ROOT/$f" "$SITE/mqnc/"; done &&
        ln -sfn "$ROOT/triton_kernels" "$SITE/mqnc/triton_kernels"
      export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    }
  fi
}
