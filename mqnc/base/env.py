"""Every environment switch mqnc reads, listed and parsed here and nowhere else.

``TRITON_INTERPRET=1`` / ``0`` / unset
    How a launch runs. Unset (or empty): by its tensors' device, CUDA tensors compiled, any
    other device (CPU tensors) under Triton's CPU interpreter, whatever was imported first and
    whichever torch build (:func:`mqnc.triton_kernels._core.execution.interpreted`). ``1``:
    every launch interpreted (CUDA tensors too); the test suite and the CLI set it when no CUDA
    device exists, and importing ``mqnc.triton_kernels`` sets it when torch was built without
    CUDA (:mod:`mqnc.base.runtime`). ``0``: every launch compiled, CPU tensors refused (the
    compile-only sm_90 step). Interpreted launches take one process-wide lock and use their
    interpreter flags (:mod:`mqnc.triton_kernels._core.execution`).
``MQNC_POISON_OUTPUTS=1``
    Fill every output a kernel launcher allocates with NaN before the kernel writes it, so an
    element a kernel forgets to write fails the comparison. The test suite sets it.
``MQNC_RESULTS=FILE``
    The results file figures read and benchmarks append to when neither ``--out`` nor
    ``--record`` is given (unset: figures read the tracked ``perf/results/results.jsonl``,
    benchmarks write the git-ignored ``perf/results/local.jsonl``;
    :mod:`mqnc.measure.results_file`).
``NVSHMEM_LIB_DIR=DIR``
    Where the NVSHMEM engine looks first for ``libnvshmem_device*.bc``
    (:func:`mqnc.transport.nvshmem.device_library_path`).
``MQNC_COMMIT=SHA``
    The commit every benchmark record carries (:func:`mqnc.measure.results_file.git_commit`), for a
    copy of the repository without ``.git`` (a GPU machine's copy: ``perf/gpu_check.sh`` sets it
    from git or from the ``.mqnc-commit`` file that travels with the copy).
``MQNC_BACKEND=op=backend[,op=backend]``
    Force a backend for an op, e.g. ``mla_decode=tl`` (the portable kernel on a Hopper GPU too)
    or ``mla_decode=gluon`` (the Hopper kernel without its GPU evidence): what
    :func:`mqnc.triton_kernels.dispatch.force_backend` does in code
    (:mod:`mqnc.triton_kernels.dispatch`: the ops and backends).

Read elsewhere, not by the package: ``HYPOTHESIS_PROFILE`` (``correctness/conftest.py``:
``ci`` or ``thorough``), ``MQNC_FIG_DIR`` (the notebooks' figure folder), ``GLOO_SOCKET_IFNAME``
(set to ``lo`` by the gloo runs).
"""

from __future__ import annotations

import functools
import os

__all__ = [
    "TRITON_INTERPRET",
    "MQNC_POISON_OUTPUTS",
    "MQNC_RESULTS",
    "NVSHMEM_LIB_DIR",
    "MQNC_COMMIT",
    "MQNC_BACKEND",
    "flag",
    "interpreting",
    "interpret_choice",
    "poisoning",
    "results_file",
    "nvshmem_lib_dir",
    "commit",
    "backend_overrides",
]

TRITON_INTERPRET = "TRITON_INTERPRET"
MQNC_POISON_OUTPUTS = "MQNC_POISON_OUTPUTS"
MQNC_RESULTS = "MQNC_RESULTS"
NVSHMEM_LIB_DIR = "NVSHMEM_LIB_DIR"
MQNC_COMMIT = "MQNC_COMMIT"
MQNC_BACKEND = "MQNC_BACKEND"


def flag(name: str) -> bool:
    """A boolean switch: set to anything but ``""`` or ``"0"`` means on (Triton's own rule)."""
    return os.environ.get(name, "0") not in ("", "0")


def interpreting() -> bool:
    """True when every launch runs under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return flag(TRITON_INTERPRET)


def interpret_choice() -> bool | None:
    """``TRITON_INTERPRET`` as a choice: True (set, not ``"0"``: interpret every launch), False
    (``"0"``: compile every launch), None (unset or empty: each launch by its tensors'
    device)."""
    value = os.environ.get(TRITON_INTERPRET, "")
    return None if value == "" else value != "0"


def poisoning() -> bool:
    """True when kernel outputs are NaN-filled before the kernel writes them."""
    return flag(MQNC_POISON_OUTPUTS)


def results_file() -> str | None:
    """``$MQNC_RESULTS``, or None when unset or empty."""
    return os.environ.get(MQNC_RESULTS) or None


def nvshmem_lib_dir() -> str | None:
    """``$NVSHMEM_LIB_DIR``, or None when unset or empty."""
    return os.environ.get(NVSHMEM_LIB_DIR) or None


def commit() -> str | None:
    """``$MQNC_COMMIT``, or None when unset or empty."""
    return os.environ.get(MQNC_COMMIT) or None


def backend_overrides() -> dict[str, str]:
    """``$MQNC_BACKEND`` as ``{op: backend}`` (empty when unset); a ``ValueError`` naming the
    variable for a pair without ``=``. The names are checked where they are used."""
    return dict(_parse_overrides(os.environ.get(MQNC_BACKEND, "")))


@functools.lru_cache(maxsize=8)
def _parse_overrides(text: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        op, eq, backend = part.partition("=")
        if not eq or not op.strip() or not backend.strip():
            raise ValueError(
                f"{MQNC_BACKEND}: expected op=backend pairs, comma separated (such as "
                f"mla_decode=tl), got {text!r}"
            )
        pairs.append((op.strip(), backend.strip()))
    return tuple(pairs)
