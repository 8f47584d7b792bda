"""Kernels on a machine without CUDA, called as a new user calls them.

In a fresh interpreter with ``TRITON_INTERPRET`` unset: on a CPU-only torch, importing
``mqnc.triton_kernels`` chooses Triton's interpreter itself, so the kernels' docstring examples
and the kernels' Python API example (docs/kernels.md) run as written (no "0 active drivers");
whatever was imported first (transformers, ``torch._dynamo``, triton) and whichever torch build,
CPU tensors run interpreted, launch by launch, and the README's first example matches fp64; in
compiled mode (``TRITON_INTERPRET=0``), a CPU tensor is refused at once with the one line that
says what to change. Each check runs in a subprocess (what was imported first is the point).
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
    assert "unset TRITON_INTERPRET" in line and "active drivers" not in r.stdout + r.stderr


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


def readme_first_example() -> str:
    """The README's first ```python block (the kernels in FlashMLA's layout)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks and "mla_decode_with_kvcache" in blocks[0], "README's first example moved"
    return blocks[0]


# what runs after the README's example: the merged routes against fp64 (the example itself
# compares them with the one call, both the kernel's), and proof of the path it took
_AGAINST_FP64 = """
import os
import torch
from mqnc.reference.attention_ref import mla_decode_reference
from mqnc.testing import assert_close, tolerance
from mqnc.triton_kernels.mla import decode
assert dev == "cpu", dev
ref_o, ref_lse = mla_decode_reference(q[:, 0].double(), k_cache[:, :, 0].double(), table, lens,
                                      0.1147)
assert_close(o, ref_o, tolerance("mla", torch.float32))
assert_close(lse, ref_lse, tolerance("mla_lse", torch.float32))
print("MODE", os.environ.get("TRITON_INTERPRET"), type(decode._mla_decode_kernel).__name__)
"""

_FIRST = {
    # what a researcher's script may import before mqnc: each brings triton in, compiled
    "transformers, torch._dynamo, triton": (
        "from transformers import DeepseekV2ForCausalLM\nimport torch._dynamo\nimport triton\n"
    ),
    # the interpreter asked for after triton was imported: Triton's own helpers stay compiled
    "TRITON_INTERPRET=1 after triton": (
        "import os, triton\nos.environ['TRITON_INTERPRET'] = '1'\n"
    ),
    # a CUDA build of torch on a machine without a GPU: nothing is set at import
    "a CUDA build of torch": (
        "import torch\ntorch.version.cuda = '12.8'  # as a CUDA build reports it\n"
    ),
}
_MODES = {
    "transformers, torch._dynamo, triton": "MODE None JITFunction",
    "TRITON_INTERPRET=1 after triton": "MODE 1 InterpretedFunction",
    "a CUDA build of torch": "MODE None JITFunction",
}


@pytest.mark.parametrize("first", sorted(_FIRST))
def test_readme_first_example_runs_on_cpu_whatever_was_imported_first(first):
    """README example 1 on CPU tensors, after ``first``: exact against fp64, and the kernels
    took the path under test (compiled-built kernels interpreted launch by launch, or an
    interpreted kernel calling Triton's compiled-built helpers)."""
    r = _run(_FIRST[first] + readme_first_example() + _AGAINST_FP64)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == _MODES[first], r.stdout[-2000:]
