"""Packaging contract (DESIGN.md): the kernels install as ``mqnc.triton_kernels``; nothing
installs a top-level ``triton_kernels``; importing mqnc touches no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    # the dispatch table on this device: every op's backends, the dense decode's Gluon kernel
    # with its evidence and whether this device runs it
    rows = {(r["op"], r["backend"]): r for r in info["dispatch"]}
    assert ("mla_decode", "gluon") in rows and ("mla_decode", "tl") in rows
    assert {"mla_sparse", "merge", "splice"} <= {op for op, _ in rows}
    if not torch.cuda.is_available():
        assert "not on this device" in rows["mla_decode", "gluon"]["status"]


def test_wheel_ships_type_markers_and_an_spdx_license(tmp_path):
    """PEP 561 markers for both packages, the license as an SPDX expression (PEP 639), and a
    build without setuptools' deprecation warnings. Built from a copy of the sources, so the
    checkout gets no build/ folder."""
    import shutil
    import zipfile

    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 cannot build this pyproject")
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("mqnc", "triton_kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "deprecated" not in log.lower() and "License" not in log, log[-3000:]
    (wheel,) = (tmp_path / "dist").glob("mqnc-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {"mqnc/py.typed", "mqnc/triton_kernels/py.typed"} <= names
    assert "License-Expression: Apache-2.0" in meta


def test_a_checkout_named_mqnc_does_not_impersonate_the_package(tmp_path):
    """A script in the folder that holds a checkout named ``mqnc`` finds the checkout first on
    ``sys.path``: ``import mqnc`` gives a namespace package of the checkout's root, whose
    ``mqnc.triton_kernels`` is the checkout's kernel folder while the rest comes from wherever
    mqnc is installed. The kernels (and the package imported as ``mqnc.mqnc``) refuse that at
    import, naming the checkout and the fix; a top-level ``triton_kernels`` (Triton's own
    package's name) from the repository root is refused too; inside the checkout, ``import
    mqnc`` is the package."""
    clone = tmp_path / "mqnc"
    clone.mkdir()
    for name in ("mqnc", "triton_kernels"):
        (clone / name).symlink_to(ROOT / name, target_is_directory=True)
    script = tmp_path / "script.py"

    def run(code, cwd):  # a script beside the checkout; elsewhere, python -c in the folder
        script.write_text(code + "\n")
        argv = [str(script)] if cwd == tmp_path else ["-c", code]
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                              cwd=cwd, timeout=120)  # fmt: skip

    r = run("import mqnc; print(mqnc.__file__, list(mqnc.__path__))", tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["None", f"['{clone}']"], r  # namespace
    for code, name in (
        ("import mqnc.triton_kernels", "mqnc.triton_kernels"),
        ("from mqnc.triton_kernels import merge_partials", "mqnc.triton_kernels"),
        ("import mqnc.mqnc", "mqnc.mqnc"),
    ):
        r = run(code, tmp_path)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 1 and last.startswith(f"ImportError: {name}: "), (code, last)
        assert str(clone) in last and "Run " in last and "rename the checkout" in last, last
    r = run("import triton_kernels", ROOT)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "not Triton's top-level triton_kernels" in last, last
    r = run("import mqnc, mqnc.triton_kernels as k; print(mqnc.__file__, k.__name__)", clone)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(clone / "mqnc" / "__init__.py"), "mqnc.triton_kernels"]


def test_plain_make_installs_the_environment(tmp_path):
    """Plain ``make`` on a fresh clone is ``make venv``: a dry run (``make -n``, nothing runs)
    of the default goal against a venv that does not exist yet creates it *and* installs the
    package into it, not the bare interpreter alone."""
    import shutil

    make = shutil.which("make")
    if make is None:
        pytest.skip("no make on this machine")
    venv = tmp_path / "venv"
    r = subprocess.run([make, "-n", "-C", str(ROOT), f"VENV={venv}"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"-m venv {venv}" in r.stdout, r.stdout
    assert f"{venv}/bin/python -m pip install --quiet -e '.[test," in r.stdout, r.stdout
    assert f"touch {venv}/.mqnc-installed" in r.stdout, r.stdout
    assert not venv.exists()  # a dry run
    db = subprocess.run([make, "-pn", "-C", str(ROOT), f"VENV={venv}"],
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ".DEFAULT_GOAL := venv" in db.stdout.splitlines(), db.stdout[-2000:]
