"""Packaging contract (DESIGN.md): the kernels install as ``mqnc.triton_kernels``; nothing
installs a top-level ``triton_kernels``; importing mqnc touches no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd="/",
        env={**os.environ, **env},
        timeout=300,
    )


def test_kernels_import_as_mqnc_triton_kernels():
    r = _run("import mqnc.triton_kernels as k, os; print(os.path.dirname(k.__file__))")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve() == (ROOT / "triton_kernels").resolve()


def test_top_level_triton_kernels_is_not_this_package():
    r = _run(
        "import importlib.util as u; s = u.find_spec('triton_kernels');"
        "print('' if s is None else (s.origin or list(s.submodule_search_locations)))"
    )
    assert r.returncode == 0, r.stderr
    assert str(ROOT / "triton_kernels") not in r.stdout


def test_import_probes_no_gpu_and_no_triton():
    """``import mqnc`` (and its pure-Python modules) must not initialise CUDA or import triton."""
    r = _run(
        "import sys, mqnc, mqnc.base, mqnc.model, mqnc.cost, mqnc.testing, mqnc.cli;"
        "import torch; print(torch.cuda.is_initialized(), 'triton' in sys.modules)"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_mqnc_env_reports_versions_and_mode():
    r = subprocess.run(
        [sys.executable, "-m", "mqnc", "env", "--json"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    for key in ("python", "torch", "triton", "mqnc", "nvshmem4py", "device", "kernels"):
        assert key in info
    assert info["kernels"] in ("interpreted", "compiled")
    import torch

    if not torch.cuda.is_available():
        assert info["kernels"] == "interpreted"
