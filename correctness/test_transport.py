"""The transport protocol: loopback semantics, and the gloo engine across real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mqnc.transport import (
    INBOX,
    REPLY,
    LoopbackFabric,
    PeerLost,
    SlotLayout,
    TransportTimeout,
)

WORKER = Path(__file__).with_name("test_multiprocess.py")


def test_slot_layout_is_a_bijection():
    lay = SlotLayout(world_size=5, lanes=3)
    seen = set()
    for ch in (INBOX, REPLY):
        for src in range(5):
            for lane in range(3):
                s = lay.slot(ch, src, lane)
                assert (lay.channel_of(s), lay.source_of(s), lay.lane_of(s)) == (ch, src, lane)
                seen.add(s)
    assert seen == set(range(lay.num_slots))
    with pytest.raises(ValueError, match="source"):
        lay.slot(INBOX, 5)
    with pytest.raises(ValueError, match="lanes"):
        SlotLayout(2, 0)


def test_put_signal_read_get_and_monotonic_signals():
    fab = LoopbackFabric(2, slot_bytes=256, lanes=3)  # 12 slots
    a, b = fab.endpoints
    slot = fab.layout.slot(INBOX, 0, 1)  # a slot rank 0 feeds
    data = torch.arange(100, dtype=torch.uint8)
    a.put_signal(1, slot, data, seq=5)
    assert b.wait_signal(slot, 5, timeout=1.0) == 5
    assert torch.equal(b.read(slot, 100), data)
    assert torch.equal(a.get(1, slot, 100, timeout=1.0), data)
    a.put_signal(1, slot, data.flip(0), seq=2)  # a late, lower sequence number
    assert b.signal(slot) == 5  # never moves a signal back
    assert b.wait_any({slot: 5, slot + 1: 1}, timeout=1.0) == [slot]


def test_a_host_array_is_a_message_too():
    """A put takes a host uint8 numpy array (the wire's ``array=True``) as it takes a tensor,
    with the same checks by name; ``read_message_host`` gives the message back as an array,
    ``read_message`` as a tensor, the same bytes and signal."""
    from mqnc.transport import wire

    fab = LoopbackFabric(2, slot_bytes=256)
    a, b = fab.endpoints
    slot = fab.layout.slot(INBOX, 0)
    msg = wire.pack_error("x" * 40, request_id=3, seq=4, array=True)
    a.put_signal(1, slot, msg, seq=4)
    sig, got = b.read_message_host(slot)
    assert sig == 4 and type(got) is np.ndarray and bytes(got) == bytes(msg)
    sig, t = b.read_message(slot)
    assert sig == 4 and type(t) is torch.Tensor and bytes(t.numpy()) == bytes(msg)
    got[:] = 0  # a copy, not the slot
    assert bytes(b.read_message_host(slot)[1]) == bytes(msg)
    with pytest.raises(ValueError, match="does not fit a slot of 256 B"):
        a.put_signal(1, slot, np.zeros(300, np.uint8), 5)
    with pytest.raises(TypeError, match="data: expected a 1-D uint8 array, got dtype int32"):
        a.put_signal(1, slot, np.zeros(10, np.int32), 5)
    with pytest.raises(TypeError, match="data: expected a 1-D uint8 array"):
        a.put_signal(1, slot, np.zeros((2, 5), np.uint8), 5)
    with pytest.raises(ValueError, match="data: expected a contiguous array"):
        a.put_signal(1, slot, np.zeros(20, np.uint8)[::2], 5)
    with pytest.raises(TypeError, match="data: expected a torch.Tensor or numpy array"):
        a.put_signal(1, slot, b"bytes", 5)

    class Sub(np.ndarray):
        pass

    a.put_signal(1, slot, np.arange(7, dtype=np.uint8).view(Sub), 6)  # a subclass is an array
    assert b.read_message_host(slot)[1][:7].tolist() == list(range(7))
    assert b.signal(slot) == 6  # nothing refused was written, the subclass was


def test_wait_times_out_within_the_bound():
    fab = LoopbackFabric(2, slot_bytes=256)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match="within 0.2"):
        fab.endpoints[0].wait_signal(0, 1, timeout=0.2)
    assert time.monotonic() - t0 >= 0.2  # never early (no upper bound: CI is a loaded box)
    with pytest.raises(ValueError, match="timeout"):
        fab.endpoints[0].wait_signal(0, 1, timeout=0)


def test_put_argument_errors():
    fab = LoopbackFabric(2, slot_bytes=128)
    a = fab.endpoints[0]
    with pytest.raises(ValueError, match="does not fit a slot of 128 B"):
        a.put_signal(1, 0, torch.zeros(200, dtype=torch.uint8), 1)
    with pytest.raises(TypeError, match="uint8"):
        a.put_signal(1, 0, torch.zeros(10, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="contiguous"):
        a.put_signal(1, 0, torch.zeros(20, dtype=torch.uint8)[::2], 1)
    with pytest.raises(ValueError, match="peer"):
        a.put_signal(2, 0, torch.zeros(2, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match="slot"):
        a.put_signal(1, a.num_slots, torch.zeros(2, dtype=torch.uint8), 1)
    # Rank 0 may write only the slots it feeds (no rank writes another's lanes).
    with pytest.raises(ValueError, match="fed by rank 1"):
        a.put_signal(1, fab.layout.slot(REPLY, 1), torch.zeros(2, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match="seq"):
        a.put_signal(1, 0, torch.zeros(2, dtype=torch.uint8), 2**64)
    # a read's or get's byte count is an int within the slot, never cut to fit
    for n, err in ((-16, ValueError), (129, ValueError), (3.9, ValueError), (True, ValueError)):
        with pytest.raises(err, match="nbytes"):
            a.get(1, 0, n, timeout=1.0)
        with pytest.raises(err, match="nbytes"):
            a.read(0, n)
    assert a.get(1, 0, 128, timeout=1.0).numel() == 128 and a.read(0, 0).numel() == 0
    fab.kill(0)
    with pytest.raises(PeerLost):
        a.get(1, 0, 8, timeout=1.0)  # a dead rank reads nothing


def test_dead_rank_is_reported():
    fab = LoopbackFabric(3, slot_bytes=128)
    fab.kill(2)
    with pytest.raises(PeerLost):
        fab.endpoints[0].put_signal(2, 0, torch.zeros(4, dtype=torch.uint8), 1)
    reply_from_2 = fab.layout.slot(REPLY, 2)
    with pytest.raises(PeerLost):  # at once, not after the timeout
        fab.endpoints[0].wait_signal(reply_from_2, 1, timeout=30.0)


def test_waiter_wakes_on_a_put_from_another_thread():
    fab = LoopbackFabric(2, slot_bytes=128)
    got = []
    t = threading.Thread(target=lambda: got.append(fab.endpoints[1].wait_signal(0, 1, 5.0)))
    t.start()
    fab.endpoints[0].put_signal(1, 0, torch.ones(4, dtype=torch.uint8), 1)
    t.join(30.0)
    assert got == [1]


def test_barrier_threads():
    fab = LoopbackFabric(3, slot_bytes=128)
    ts = [threading.Thread(target=e.barrier, args=(5.0,)) for e in fab.endpoints]
    for t in ts:
        t.start()
    for t in ts:
        t.join(5.0)
    assert not any(t.is_alive() for t in ts)


def _env():
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    return env


def test_torchdist_engine_across_processes():
    """A second process echoes puts back; get, barrier and a dead peer over real gloo."""
    from mqnc.transport.torchdist import TorchDistTransport, free_port_store

    store = free_port_store(2)
    child = subprocess.Popen(
        [
            sys.executable,
            str(WORKER),
            "echo",
            "--rank",
            "1",
            "--world",
            "2",
            "--port",
            str(store.port),
        ],
        env=_env(),
    )
    t = None
    try:
        t = TorchDistTransport(0, 2, store, slot_bytes=4096, lanes=1, idle_timeout_s=120)
        t.barrier(60.0)
        inbox, reply = t.layout.slot(INBOX, 0), t.layout.slot(REPLY, 1)
        for seq in (1, 2, 3):
            data = torch.randint(0, 256, (1000 + seq,), dtype=torch.uint8)
            t.put_signal(1, inbox, data, seq)
            assert t.wait_signal(reply, seq, timeout=20.0) >= seq
            assert torch.equal(t.read(reply, data.numel()), data)  # bytes moved exactly
            # one-sided read of the peer's inbox slot holds what was put there
            assert torch.equal(t.get(1, inbox, data.numel(), timeout=20.0), data)
        with pytest.raises(TransportTimeout):  # nobody puts 99: times out, whatever the load
            t.wait_signal(reply, 99, timeout=0.3)
        t.put_signal(1, inbox, torch.zeros(1, dtype=torch.uint8), 100)  # asks the echo to die
        with pytest.raises(PeerLost, match="gone"):  # the closed connection, not the timeout
            t.wait_signal(reply, 101, timeout=600.0)
        assert not t.peer_alive(1)
    finally:
        if t is not None:
            t.close(timeout=1.0)
        child.kill()
        child.wait(30)


def test_the_handshake_refuses_a_mismatch_naming_both_sides():
    """Every rank publishes its terms and compares every other's: a mismatch (two slot sizes,
    lanes, a caller's term) is a ValueError naming the term and both ranks' values, on each
    rank; a term that is no JSON value is a TypeError; a rank that never comes is a
    TransportError within the store's timeout."""
    import datetime

    import torch.distributed as dist

    from mqnc.transport.protocol import TransportError, handshake

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    terms = {"slot_bytes": 4096, "lanes": 2, "geometry": [576, 512]}
    handshake(dist.PrefixStore("ok", store), 0, 1, terms)  # alone: nothing to compare
    bad = dist.PrefixStore("bad", store)
    bad.set("terms/1", '{"slot_bytes": 8192, "lanes": 2, "geometry": [576, 256]}')  # rank 1's
    with pytest.raises(ValueError) as exc:
        handshake(bad, 0, 2, terms)
    said = str(exc.value)
    assert "slot_bytes: rank 0 (this one) has 4096, rank 1 has 8192" in said, said
    assert "geometry: rank 0 (this one) has [576, 512], rank 1 has [576, 256]" in said, said
    assert "lanes:" not in said  # the terms they agree on are not named
    with pytest.raises(TypeError, match="terms"):
        handshake(dist.PrefixStore("json", store), 0, 1, {"slot_bytes": object()})
    store.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(TransportError, match="no terms from rank 1"):
        handshake(dist.PrefixStore("alone", store), 0, 2, terms)


def test_nvshmem_engine_is_lazy_and_gpu_only():
    """Importing the NVSHMEM engine loads neither nvshmem4py nor CUDA; creating one off a GPU
    says why it cannot run."""
    code = (
        "import sys, torch; import mqnc.transport.nvshmem as m; "
        "assert 'nvshmem' not in sys.modules and 'nvshmem.core' not in sys.modules; "
        "print(m.nvshmem_available())"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    if r.stdout.strip() == "False" and not torch.cuda.is_available():
        from mqnc.transport.nvshmem import NvshmemTransport

        with pytest.raises(RuntimeError, match="CUDA device"):
            NvshmemTransport(0, 2, None, slot_bytes=4096)


def test_nvshmem_device_kernels_compile_for_sm90(nvshmem_device_bitcode):
    """The device-initiated put-with-signal, signal wait and bounded poll kernels compile for
    sm_90 against NVSHMEM's device bitcode and call the NVSHMEM functions (§3.2). Long tier
    (``nvshmem_device_bitcode``: the bitcode's link, ~3 s of a CPU a kernel)."""
    code = (
        "import json; from mqnc.transport.nvshmem import compile_device_kernels; "
        "print(json.dumps(compile_device_kernels(90)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["put_signal_block"]["calls"] == ["nvshmemx_putmem_signal_nbi_block", "nvshmem_quiet"]
    assert res["wait_until"]["calls"] == ["nvshmem_signal_wait_until"]
    assert all(v["cubin_bytes"] > 0 for v in res.values())


def test_nvshmem_engine_host_side_keeps_the_protocol(monkeypatch):
    """The NVSHMEM engine's host Python on fakes (no GPU here): a put only into a slot of this
    rank's with a valid sequence number (int64 signals: < 2**63), waits on valid targets, a
    0-byte put as the signal alone, one staging region's copy and put as one step under a
    lock, and nothing once closed."""
    import contextlib

    from mqnc.transport import nvshmem
    from mqnc.transport.protocol import INBOX, TransportError

    calls = []

    class NV:
        class SignalOp:
            SIGNAL_SET = 9

        def put_signal(self, dst, src, sig, val, op, remote_pe, stream):
            calls.append(("put_signal", dst[2], src[2], val, remote_pe))

        def signal_op(self, sig, val, op, remote_pe, stream):
            calls.append(("signal_op", val, remote_pe))

    class Buf:
        @staticmethod
        def from_handle(ptr, n):
            return ("buf", ptr, n)

    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    t = nvshmem.NvshmemTransport.__new__(nvshmem.NvshmemTransport)
    nvshmem.Transport.__init__(t, 0, SlotLayout(3, 1), 128)
    n = t.layout.num_slots
    t._nv, t._Buffer, t._stream, t.device_put, t._closed = NV(), Buf, None, False, False
    t._heap, t._stage = (torch.zeros(n * 128, dtype=torch.uint8) for _ in range(2))
    t._sig = torch.zeros(n, dtype=torch.int64)
    t._put_lock = nvshmem.threading.Lock()
    mine, theirs = t.layout.slot(INBOX, 0), t.layout.slot(INBOX, 1)
    data = torch.arange(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="fed by rank 1"):
        t.put_signal(1, theirs, data, 1)
    with pytest.raises(ValueError, match="fed by rank 1"):  # a get: the same source rule
        t.get(1, theirs, 8, timeout=1.0)
    for seq in (-1, 2.7, True, 2**64):
        with pytest.raises(ValueError, match="seq"):
            t.put_signal(1, mine, data, seq)
    with pytest.raises(ValueError, match=r"seq: expected an int in \[0, 2\*\*63\)"):
        t.put_signal(1, mine, data, 2**63)
    t.put_signal(2, mine, data, 7)
    assert calls[-1] == ("put_signal", 100, 100, 7, 2)
    off = mine * 128
    t._stage.zero_()
    t.put_signal(2, mine, np.arange(50, dtype=np.uint8)[::-1].copy(), 8)  # a host array message
    assert calls[-1] == ("put_signal", 50, 50, 8, 2)
    assert t._stage[off : off + 50].tolist() == list(range(49, -1, -1))  # staged, then put
    t.put_signal(1, mine, torch.empty(0, dtype=torch.uint8), 9)
    assert calls[-1] == ("signal_op", 9, 1)  # no byte of the peer's slot moved
    with pytest.raises(ValueError, match="seq"):
        t.wait_any({mine: 2**63}, timeout=1.0)
    with pytest.raises(ValueError, match="slot"):
        t.wait_any({n: 1}, timeout=1.0)
    t._closed = True
    with pytest.raises(TransportError, match="closed"):
        t.put_signal(1, mine, data, 10)
    with pytest.raises(TransportError, match="closed"):
        t.signal(mine)


# ---- the registry (mqnc.transport.registry): names, contexts, the factory, the auto policy ----


def test_the_registry_names_every_engine_and_where_it_runs():
    """Names in registry order, the views by context, and a name that is not an engine (the
    service's policy ``auto`` included) refused naming the argument, expected and received."""
    from mqnc.transport import AUTO, ENGINES, engine, names

    assert names() == tuple(ENGINES) == ("loopback", "gloo", "nvshmem")
    assert names(in_process=True) == ("loopback",)
    assert names(in_process=False) == ("gloo", "nvshmem")
    assert names(needs_gpu=False) == ("loopback", "gloo")
    assert names(in_process=False, auto=True) == (AUTO, "gloo", "nvshmem")
    assert [e.name for e in ENGINES.values() if e.exit_directly] == ["gloo"]
    assert all(e.summary and "\n" not in e.summary for e in ENGINES.values())
    for bad in ("auto", "ucx", 3, None):
        with pytest.raises(ValueError, match=r"transport: expected one of \('loopback', 'gloo', "):
            engine(bad)
    with pytest.raises(ValueError, match="kind: expected one of"):
        engine("x", argument="kind")


def test_the_registry_and_the_front_ends_load_no_torch():
    """The registry, the option parsers, the demo's configuration and every ``--transport``
    flag read the names without torch (``mqnc --help``); the engines load on first use."""
    code = (
        "import sys; import mqnc.transport as t; import mqnc.measure.options, mqnc.demo.config; "
        "from mqnc.cli import build_parser; build_parser(); "
        "bad = [m for m in ('torch', 'triton') if m in sys.modules]; assert not bad, bad; "
        "assert t.names() == ('loopback', 'gloo', 'nvshmem'); "
        "assert t.LoopbackFabric.__module__ == 'mqnc.transport.loopback'; "
        "assert 'torch' in sys.modules and 'mqnc.transport.nvshmem' not in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_every_front_end_reads_the_registry():
    """Every ``--transport`` choice, option parser, demo configuration and the service are the
    registry's names, by the context each runs in."""
    import argparse

    from mqnc.cli import build_parser
    from mqnc.cli import cmd_serve as cli_serve
    from mqnc.demo import config
    from mqnc.measure import TRANSPORTS, echo, options
    from mqnc.serving import local, service
    from mqnc.transport import names

    assert TRANSPORTS == options.TRANSPORTS == echo.TRANSPORTS == names()
    assert config.TRANSPORTS == tuple(sorted(names()))
    assert config.HF_TRANSPORTS == tuple(sorted(names(needs_gpu=False)))
    assert local.LOCAL_TRANSPORTS == names(needs_gpu=False)
    assert service.TRANSPORTS == cli_serve.TRANSPORTS == names(in_process=False, auto=True)
    assert options.transport_list("gloo,loopback") == ["gloo", "loopback"]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {  # every --transport that picks an engine (mqnc fit's filters record variants)
        cmd: a
        for cmd, p in sub.choices.items()
        for a in p._actions
        if "--transport" in a.option_strings and a.choices is not None
    }
    assert set(flags) == {"calibrate", "demo", "serve"}
    assert tuple(flags["calibrate"].choices) == names()
    assert tuple(flags["demo"].choices) == config.TRANSPORTS
    assert tuple(flags["serve"].choices) == service.TRANSPORTS
    for cmd in ("demo", "serve"):  # --help describes each choice from the registry
        assert all(f"{c}: " in flags[cmd].help for c in flags[cmd].choices), cmd


def test_the_factory_builds_each_kind_and_refuses_the_other():
    """``open_fabric`` builds every rank of an in-process engine, ``connect`` one rank of a
    cross-process engine; each refuses the other kind, saying which to use."""
    from mqnc.transport import LoopbackTransport, connect, open_fabric

    fab = open_fabric("loopback", 3, slot_bytes=256, lanes=2)
    assert [type(e) for e in fab.endpoints] == [LoopbackTransport] * 3
    assert fab.endpoint(2).rank == 2 and fab.layout.num_slots == 12 and fab.endpoints[0].in_process
    with pytest.raises(ValueError, match="runs every rank in this process.*open_fabric"):
        connect("loopback", 0, 2, None, slot_bytes=256)
    with pytest.raises(ValueError, match="runs one rank per process.*connect"):
        open_fabric("gloo", 2, slot_bytes=256)
    with pytest.raises(ValueError, match="transport: expected one of"):
        open_fabric("infiniband", 2, slot_bytes=256)


def test_auto_is_the_services_policy_not_an_engine(monkeypatch):
    """``auto`` resolves to the GPU engine across processes when it runs here, else the CPU
    one; an engine's name is itself; with no engine that runs, the error names every reason."""
    from mqnc.transport import ENGINES, registry, select, unavailable

    assert select("gloo") == "gloo" and select("loopback") == "loopback"
    assert select("auto") == ("nvshmem" if unavailable("nvshmem") is None else "gloo")
    if not torch.cuda.is_available():
        assert "needs a CUDA device" in unavailable("nvshmem")
    assert unavailable("loopback") is None and unavailable("gloo") is None
    with pytest.raises(ValueError, match="transport: expected one of"):
        select("ucx")
    monkeypatch.setattr(registry.Engine, "unavailable", lambda self: f"no {self.name} here")
    with pytest.raises(RuntimeError, match="transport: 'auto' found no engine") as exc:
        select("auto")
    assert "(no nvshmem here; no gloo here)" in str(exc.value)  # GPU engines first
    monkeypatch.undo()
    assert ENGINES["nvshmem"].needs_gpu and not ENGINES["nvshmem"].detects_peer_loss
