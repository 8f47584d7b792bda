"""Kernels on a machine without CUDA, called as a new user calls them.

In a fresh interpreter with ``TRITON_INTERPRET`` unset: on a CPU-only torch, importing
``mqnc.triton_kernels`` chooses Triton's interpreter itself, so the kernels' docstring examples
and the kernels' Python API example (docs/kernels.md) run as written (no "0 active drivers"); in
compiled mode (``TRITON_INTERPRET=0``), a CPU tensor is refused at once with the one line that
says what to set. Each check runs in a subprocess (the mode is fixed when Triton is imported).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CPU_ONLY_TORCH = torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def _run(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_changes)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )


_DOCTESTS = """
import doctest, os
import mqnc.triton_kernels as tk  # chooses the interpreter on a CPU-only torch
from mqnc.triton_kernels.merge import partials as merge
from mqnc.triton_kernels.mla import decode as mla_decode
from mqnc.triton_kernels.mla import sparse as mla_sparse
from mqnc.triton_kernels.splice import rotate as splice
assert os.environ.get("TRITON_INTERPRET") == "1", os.environ.get("TRITON_INTERPRET")
results = [doctest.testmod(m) for m in (merge, mla_decode, mla_sparse, splice)]  # each once
failed, tried = sum(r.failed for r in results), sum(r.attempted for r in results)
print("doctests", tried, "failed", failed)
raise SystemExit(1 if failed or not tried else 0)
"""


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="a CUDA build of torch: the choice is not made")
def test_docstring_examples_run_as_written_without_setup():
    r = _run(_DOCTESTS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "failed 0" in r.stdout


_CPU_TENSOR_IN_COMPILED_MODE = """
import torch
from mqnc.triton_kernels import mla_decode_partial
q, pool = torch.randn(1, 16, 576), torch.randn(1, 64, 576)
table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
try:
    mla_decode_partial(q, pool, table, lens, softmax_scale=0.1)
except ValueError as exc:
    print("REFUSED:", exc)
"""


def test_compiled_mode_refuses_cpu_tensors_with_one_line():
    r = _run(_CPU_TENSOR_IN_COMPILED_MODE, TRITON_INTERPRET="0")
    assert r.returncode == 0, r.stderr[-3000:]
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("REFUSED: q: expected a CUDA tensor"), r.stdout
    assert "TRITON_INTERPRET=1" in line and "active drivers" not in r.stdout + r.stderr


def readme_python_example() -> str:
    """The kernels' Python API example: the ```python block under "## Python API" of
    docs/kernels.md (the README links it)."""
    text = (ROOT / "docs" / "kernels.md").read_text()
    section = text.split("\n## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "one python block in docs/kernels.md's Python API section"
    return blocks[0]


def test_readme_python_example_runs_as_written():
    """The 15-line example runs in a fresh interpreter with no set-up (the GPU when there is
    one, else the CPU and the interpreter)."""
    code = readme_python_example()
    assert len(code.strip().splitlines()) <= 15
    r = _run(code)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "max_abs=" in r.stdout  # assert_close's statistics: the routed merge matched
