"""Every kernel compiles for sm_90 (the lent H200) at its production block sizes in bf16, with
no register spills, without a GPU: the interpreter accepts code the GPU compiler rejects.

The compile runs in a subprocess with ``TRITON_INTERPRET`` unset (the suite interprets kernels
when there is no GPU, and interpreted functions cannot be compiled).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

from mqnc.triton_kernels import KERNEL_MODULES


def _spec_names():
    for module in KERNEL_MODULES:
        for spec in importlib.import_module(f"mqnc.triton_kernels.{module}").compile_specs():
            yield spec["name"], tuple(spec.get("expect_mma", ()))


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-m", "mqnc.triton_kernels._compile", "90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return {k["name"]: k for k in json.loads(r.stdout)}


@pytest.mark.parametrize("name, expect_mma", [pytest.param(n, m, id=n) for n, m in _spec_names()])
def test_compiles_for_sm90_without_spills(compiled, name, expect_mma):
    res = compiled[name]
    assert res["ok"], res.get("error")
    print(
        f"{name}: {res['registers']} regs, stack {res['stack']}, local {res['local']}, "
        f"shared {res['shared']} B, mma {res['mma']}"
    )
    assert res["registers"] <= 255
    assert res["stack"] == 0 and res["local"] == 0, (
        f"{name} spills: stack {res['stack']}, local {res['local']}"
    )
    for op in expect_mma:
        assert op in res["mma"], f"{name}: expected {op} in its SASS, found {res['mma']}"
