"""The NVSHMEM engine without a GPU: its device kernels compile for sm_90 exactly as their launches
compile, its device bitcode is found in every layout the wheels ship, and its bounded device-side
wait finds the awaited slots (interpreted).
The compile runs in a subprocess with ``TRITON_INTERPRET=0`` (compiled mode, even on a CPU-only
torch; the suite interprets kernels without a GPU) at the edge values of a real launch: PE 1
and sequence 1, the first put from PE 0 to PE 1, where Triton would turn an int equal to 1 into
a constexpr. It needs NVSHMEM's
device bitcode (``nvidia-nvshmem-cu13``, which ``make venv`` installs on a CPU machine through
the ``sm90`` extra); like every compile against that bitcode it is in the long tier (``make
test-long``; conftest's ``LONG_TIER``); ``make compat`` reruns this file under triton 3.6.0.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from mqnc.transport import nvshmem
from mqnc.transport.protocol import Transport, TransportTimeout

_REAL_NVSHMEM4PY_BITCODE = nvshmem._nvshmem4py_bitcode
_COMPILE = """
import json
from mqnc.transport.nvshmem import compile_device_kernels
print(json.dumps([compile_device_kernels(pe=1, seq=1), compile_device_kernels(pe=0, seq=7)]))
"""


@pytest.fixture(scope="module")
def compiled(nvshmem_device_bitcode) -> tuple[dict, dict]:
    """The engine's kernels compiled against the bitcode (``nvshmem_device_bitcode``: skipped
    where it is not installed, ``pip install 'mqnc[sm90]'``; in the long tier, conftest)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compiled mode (no launch), even on a CPU torch
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]
    edge, other = json.loads(r.stdout.strip().splitlines()[-1])
    return edge, other


@pytest.mark.parametrize("name", ["put_signal_block", "wait_until", "poll"])
def test_device_kernels_compile_at_edge_values_without_spills(compiled, name):
    edge, _ = compiled
    res = edge[name]
    print(f"{name} at PE 1, sequence 1: {res}")
    assert res["registers"] <= 255
    assert res["stack"] == 0 and res["local"] == 0, f"{name} spills: {res}"


def test_device_kernels_call_nvshmem(compiled):
    edge, _ = compiled
    assert edge["put_signal_block"]["calls"] == [
        "nvshmemx_putmem_signal_nbi_block",
        "nvshmem_quiet",
    ]
    assert edge["wait_until"]["calls"] == ["nvshmem_signal_wait_until"]
    assert edge["poll"]["calls"] == []


def test_one_compiled_kernel_for_every_pe_and_sequence(compiled):
    """No argument value is specialised: PE 0 / sequence 7 compiles to the very kernel of PE 1 /
    sequence 1, so one module registration (``cumodule_init``) serves every put."""
    edge, other = compiled
    assert {k: v["hash"] for k, v in edge.items()} == {k: v["hash"] for k, v in other.items()}


# ---- the device bitcode in the layouts the wheels ship ------------------------------------------


@pytest.fixture
def no_system_bitcode(monkeypatch, tmp_path):
    """Only the folders a test lays out: no $NVSHMEM_LIB_DIR, no nvshmem4py, no installed wheel."""
    monkeypatch.delenv("NVSHMEM_LIB_DIR", raising=False)
    monkeypatch.setattr(nvshmem, "_library_dirs", lambda: [str(tmp_path / "wheel")])
    monkeypatch.setattr(nvshmem, "_nvshmem4py_bitcode", lambda arch: None)
    (tmp_path / "wheel").mkdir()
    return tmp_path


def _touch(path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"BC")
    return str(path)


def test_bitcode_generic_file_of_nvshmem_345(no_system_bitcode):
    want = _touch(no_system_bitcode / "wheel" / "libnvshmem_device.bc")
    assert nvshmem.device_library_path(90) == want


def test_bitcode_per_arch_file_of_nvshmem_380(no_system_bitcode):
    want = _touch(no_system_bitcode / "wheel" / "libnvshmem_device_sm_90.bc")
    _touch(no_system_bitcode / "wheel" / "libnvshmem_device_sm_80.bc")
    assert nvshmem.device_library_path(90) == want


def test_bitcode_per_arch_file_preferred_to_the_generic_one(no_system_bitcode):
    _touch(no_system_bitcode / "wheel" / "libnvshmem_device.bc")
    want = _touch(no_system_bitcode / "wheel" / "libnvshmem_device_sm_90.bc")
    assert nvshmem.device_library_path(90) == want


def test_bitcode_env_dir_first(no_system_bitcode, monkeypatch):
    _touch(no_system_bitcode / "wheel" / "libnvshmem_device_sm_90.bc")
    want = _touch(no_system_bitcode / "env" / "libnvshmem_device.bc")
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(no_system_bitcode / "env"))
    assert nvshmem.device_library_path(90) == want


def test_bitcode_what_nvshmem4py_reports_before_the_wheel_folders(no_system_bitcode, monkeypatch):
    """nvshmem4py 0.4.1's ``find_device_bitcode_library(arch=)`` is asked (the real
    ``_nvshmem4py_bitcode``, with a stand-in ``nvshmem.core``), before any folder is searched."""
    _touch(no_system_bitcode / "wheel" / "libnvshmem_device.bc")
    reported = _touch(no_system_bitcode / "nv4py" / "lib" / "libnvshmem_device_sm_90.bc")
    asked = []

    def find_device_bitcode_library(arch=None):
        asked.append(arch)
        if arch not in ("90", 90):
            raise RuntimeError("no such file")
        return reported

    core = types.ModuleType("nvshmem.core")
    core.find_device_bitcode_library = find_device_bitcode_library
    pkg = types.ModuleType("nvshmem")
    pkg.core = core
    monkeypatch.setitem(sys.modules, "nvshmem", pkg)
    monkeypatch.setitem(sys.modules, "nvshmem.core", core)
    monkeypatch.setattr(nvshmem, "_nvshmem4py_bitcode", _REAL_NVSHMEM4PY_BITCODE)
    assert nvshmem.device_library_path(90) == reported
    assert asked == [90]


def test_bitcode_missing_names_what_was_searched(no_system_bitcode):
    with pytest.raises(RuntimeError, match=r"libnvshmem_device_sm_90\.bc.*NVSHMEM_LIB_DIR"):
        nvshmem.device_library_path(90)


# ---- the bounded device-side wait (interpreted on CPU tensors) ---------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors: the interpreted kernel")
def test_poll_returns_the_awaited_values_of_one_and_several_slots():
    sig = torch.tensor([0, 5, 2, 9, 0, 0, 0, 0], dtype=torch.int64)
    assert nvshmem.poll_signals(sig, {1: 5}, spins=1000) == {1: 5}
    assert nvshmem.poll_signals(sig, {1: 5, 2: 3, 3: 10}, spins=1000) == {1: 5, 2: 2, 3: 9}
    # nothing ready: the kernel gives up after its bounded spins and reports what it saw
    assert nvshmem.poll_signals(sig, {2: 3, 0: 1}, spins=3) == {2: 2, 0: 0}


class _FakePE:
    """The state ``NvshmemTransport.wait_any`` reads, on CPU tensors (no NVSHMEM, no GPU)."""

    rank = 0
    poll_spins = 4
    _wait_stream = None
    _closed = False
    _deadline = staticmethod(Transport._deadline)
    _check_targets = Transport._check_targets
    _open = nvshmem.NvshmemTransport._open

    def __init__(self, values):
        self._sig = torch.tensor(values, dtype=torch.int64)
        self.wait_paths = collections.Counter()
        self.layout = collections.namedtuple("Layout", "num_slots")(len(values))

    def _check_slot(self, slot):
        if not 0 <= slot < self._sig.numel():
            raise ValueError(f"slot: expected a slot in [0, {self._sig.numel()}), got {slot}")
        return slot


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors: the interpreted kernel")
def test_wait_any_is_device_side_for_one_and_several_slots_and_records_the_path():
    pe = _FakePE([0, 3, 0, 7])
    wait_any = nvshmem.NvshmemTransport.wait_any
    assert wait_any(pe, {1: 3}, timeout=5.0) == [1]
    assert wait_any(pe, {0: 1, 2: 1, 3: 7}, timeout=5.0) == [3]
    assert pe.wait_paths == {"device-poll[1]": 1, "device-poll[n]": 1}
    with pytest.raises(TransportTimeout, match=r"slots \[0, 2\]"):
        wait_any(pe, {0: 1, 2: 1}, timeout=0.05)
    with pytest.raises(ValueError, match="slot"):
        wait_any(pe, {9: 1}, timeout=1.0)
