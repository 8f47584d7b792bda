"""Where tensors live: the public launchers refuse a CPU tensor when the
kernels are compiled (one clear line, saying how to move the data or run interpreted), the
holder and requester put pools and queries on the device that runs the kernels, the
requester's merge time is the merge's, and fetch staging orders its side stream after the
producer's.

On a CPU machine "compiled" is had by unsetting ``TRITON_INTERPRET`` for the check alone (the
launchers read it when called; Triton itself stays interpreted, and nothing is launched), and
the GPU by a stand-in device: ``meta`` tensors for the pools, recorded calls for the streams.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from mqnc.base import runtime
from mqnc.model import PRESETS
from mqnc.serving import Holder, Partial, Requester, holder, requester
from mqnc.transport import LoopbackFabric, slot_bytes_for
from mqnc.triton_kernels import (
    merge_partials,
    merge_partials_into,
    mla_decode_partial,
    mla_sparse_partial,
    rope_rotate,
    rope_splice,
)
from mqnc.triton_kernels.mla.decode import plan_decode

GEOM = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=4)


def _rope():
    from mqnc.model import RopeSpec

    return RopeSpec.from_preset("deepseek-v2-lite")


def _calls():
    """One call of every public launcher, on valid CPU tensors."""
    q = torch.zeros(1, 4, 576)
    pool = torch.zeros(2, 16, 576)
    table = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.full((1,), 20, dtype=torch.int32)
    idx = torch.zeros(1, 8, dtype=torch.int32)
    o, lse = torch.zeros(2, 1, 4, 512), torch.zeros(2, 1, 4)
    chunk, kv = torch.zeros(2, 5, 576), torch.zeros(2, 1, 16, 576)
    slots = torch.arange(5)
    return {
        "mla_decode_partial": lambda: mla_decode_partial(q, pool, table, lens, softmax_scale=0.1),
        "mla_sparse_partial": lambda: mla_sparse_partial(q, pool, idx, softmax_scale=0.1),
        "merge_partials": lambda: merge_partials(o, lse, layout="MBHD"),
        "merge_partials_into": lambda: merge_partials_into(o[0], lse[0], o[1], lse[1]),
        "rope_splice": lambda: rope_splice(chunk, kv, slots, 3, _rope()),
        "rope_rotate": lambda: rope_rotate(q, 3, _rope()),
    }


@pytest.mark.parametrize("launcher", list(_calls()))
def test_launchers_reject_a_cpu_tensor_when_compiled(launcher, monkeypatch):
    """``TRITON_INTERPRET=0`` (every launch compiled): a CPU tensor is refused at once, in one
    line naming the argument and the two ways out (unset: CPU tensors interpret)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError) as info:
        _calls()[launcher]()
    msg = str(info.value)
    assert "\n" not in msg and "CPU tensor" in msg, msg
    assert "TRITON_INTERPRET=0" in msg and "unset TRITON_INTERPRET" in msg
    assert "mqnc.base.kernel_device()" in msg


def test_planning_takes_cpu_tensors_when_compiled(monkeypatch):
    """The sm_90 compile step plans launches on CPU tensors: the refusal is the launchers'
    alone, never the plan's."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # (what the compile step sets)
    q, pool = torch.zeros(1, 16, 576, dtype=torch.bfloat16), torch.zeros(4, 64, 576).bfloat16()
    table, lens = torch.zeros(1, 4, dtype=torch.int32), torch.full((1,), 256, dtype=torch.int32)
    plan = plan_decode(q, pool, table, lens, 0.1, 512, None)
    assert plan.launches and plan.o.device.type == "cpu"


@pytest.mark.parametrize(
    "interpret, cuda, want",
    [("1", True, "cpu"), ("1", False, "cpu"), ("", True, "cuda"), ("", False, "cpu")],
)
def test_kernel_device_follows_the_kernels(interpret, cuda, want, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert runtime.kernel_device() == torch.device(want)


def test_holder_and_requester_default_to_the_kernels_device(monkeypatch):
    """``device=None`` is :func:`mqnc.base.kernel_device` (the GPU when the kernels are
    compiled; ``meta`` stands for it here); an explicit ``device=`` wins."""
    fabric = LoopbackFabric(2, slot_bytes_for(GEOM, max_rows=8), lanes=1)
    gpu = torch.device("meta")
    monkeypatch.setattr(holder, "kernel_device", lambda: gpu)
    monkeypatch.setattr(requester, "kernel_device", lambda: gpu)
    h = Holder(fabric.endpoint(0), GEOM, softmax_scale=0.1, num_blocks=2)
    assert h.device == gpu and h.pool.device == gpu
    r = Requester(fabric.endpoint(1), GEOM, softmax_scale=0.1, pool_blocks=2)
    assert r.device == gpu and r.pool.device == gpu
    r = Requester(fabric.endpoint(1), GEOM, softmax_scale=0.1, pool_blocks=2, device="cpu")
    assert r.device == torch.device("cpu") and r.pool.device == torch.device("cpu")


def test_merge_time_brackets_the_merge_between_device_syncs(monkeypatch):
    """``merge_us`` is the merge until its result is ready: the device is synchronised before
    the clock starts and after the kernel is launched; the NaN check runs before, untimed."""
    events = []
    monkeypatch.setattr(requester, "synchronize", lambda device: events.append("sync"))

    def merge(o, lse, *, layout, check_lse=True):
        events.append(f"merge check_lse={check_lse} layout={layout}")
        return o[0], lse[0]

    ops = types.SimpleNamespace(merge_partials=merge)
    monkeypatch.setattr(requester, "kernel_ops", lambda kernels: ops)
    parts = [Partial(torch.zeros(1, 4, 512), torch.zeros(1, 4), "route", 0) for _ in range(2)]
    _, _, us = Requester.merge(parts)
    assert events == ["sync", "merge check_lse=False layout=MBHD", "sync"] and us >= 0
    parts[1].lse[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        Requester.merge(parts)


def test_runtime_synchronize_waits_for_a_cuda_device_only(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(device))
    runtime.synchronize("cpu")
    runtime.synchronize(torch.device("cuda", 0))
    assert seen == [torch.device("cuda", 0)]


def test_fetch_staging_stream_waits_for_the_producer(monkeypatch):
    """A staging stream gathers from the pool only after the producer's (current) stream:
    ``wait_stream`` before the side stream is entered (a race on a GPU otherwise)."""
    events = []

    class Stream:
        def __init__(self, name):
            self.name, self.device = name, torch.device("cuda", 0)

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("producer"))
    monkeypatch.setattr(
        torch.cuda, "stream", lambda s: events.append(f"enter {s.name}") or contextlib.nullcontext()
    )
    pool = holder._StagingPool.__new__(holder._StagingPool)
    pool.k, pool._streams, pool._next = 2, [Stream("s0"), Stream("s1")], 0
    for _ in range(3):
        with pool.stream():
            pass
    assert events == [
        "s0 waits for producer",
        "enter s0",
        "s1 waits for producer",
        "enter s1",
        "s0 waits for producer",
        "enter s0",
    ]
