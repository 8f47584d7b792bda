"""Every transport engine through the same protocol tests (§3.1, §6; :mod:`mqnc.transport`).

Each engine of the registry (:data:`mqnc.transport.ENGINES`) is built by the registry's factory
and paired with an echo peer: rank 0 is this process' endpoint, rank 1 answers every request in
its inbox by putting the slot back into rank 0's reply slot, and dies when asked. An in-process
engine's peer is a thread (``open_fabric``); a cross-process engine's is a real process running
this file as a script (``connect`` on a ``TCPStore``), started once per module and engine. An
engine this machine cannot run (NVSHMEM without a GPU) is skipped, saying why.

The tests: a put + signal + wait round trip (the bytes, the signal, a one-sided get); a wait
that times out raises :class:`~mqnc.transport.TransportTimeout`, never early; a put into a slot
another rank feeds (and every other bad put) is refused at the sender, and the peer still
answers; a get obeys the same source rule (a rank reads only the slots it feeds, and its own);
a lost peer raises :class:`~mqnc.transport.PeerLost` at once, never a hang (engines
that cannot detect one say so in the registry). The peer-loss test kills the peer: it runs last,
and a test that finds its peer dead starts a new one.

Adding an engine: its module, its entry in :mod:`mqnc.transport.registry`, and its harness in
:data:`HARNESSES` below.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from mqnc.transport import (
    ENGINES,
    INBOX,
    REPLY,
    PeerLost,
    Transport,
    TransportTimeout,
    connect,
    free_port_store,
    names,
    open_fabric,
    unavailable,
)

SLOT = 4096
LANES = 2
STOP = 2**40  # a request with this sequence number asks the peer to close and stop
DIE = 2**41  # ... with this one (or higher), to die on the spot, as a crashed peer would
NEVER = 2**42  # a sequence number nobody puts
START_S = 120.0  # bound on a peer process' start (torch import and rendezvous on 2 loaded cores)


def echo(t: Transport, die) -> None:
    """Rank 1's loop: answer each request in the inbox rank 0 feeds with the whole slot, put
    back into rank 0's reply slot under the same sequence number; at :data:`STOP` close the
    endpoint and return, at :data:`DIE` call ``die()`` (no close)."""
    inbox, reply = t.layout.slot(INBOX, 0), t.layout.slot(REPLY, 1)
    seq = 0
    while True:
        try:
            seq = t.wait_signal(inbox, seq + 1, timeout=60.0)
        except TransportTimeout:
            continue
        except PeerLost:
            return
        if seq >= DIE:
            die()
            return
        if seq >= STOP:
            t.close()
            return
        t.put_signal(0, reply, t.read(inbox), seq)


class ThreadPeer:
    """An in-process engine: rank 1's echo in a thread of this process."""

    def __init__(self, name: str) -> None:
        self.fabric = open_fabric(name, 2, slot_bytes=SLOT, lanes=LANES)
        self.transport = self.fabric.endpoint(0)
        self.thread = threading.Thread(
            target=echo, args=(self.fabric.endpoint(1), lambda: self.fabric.kill(1)), daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.thread.join(30.0)
        self.transport.close()


class ProcessPeer:
    """A cross-process engine: rank 1's echo in a child process (this file as a script)."""

    def __init__(self, name: str) -> None:
        self.store = free_port_store(2, timeout_s=START_S)
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, __file__, name, "--port", str(self.store.port)]
        self.child = subprocess.Popen(cmd, env=env)
        try:
            self.transport = connect(name, 0, 2, self.store, slot_bytes=SLOT, lanes=LANES, device=0)
            self.transport.barrier(START_S)
        except BaseException:
            self.child.kill()
            self.child.wait(30)
            raise

    def close(self) -> None:
        try:
            self.child.wait(30)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait(30)
        self.transport.close()


HARNESSES = {"loopback": ThreadPeer, "gloo": ProcessPeer, "nvshmem": ProcessPeer}
"""The conformance parametrisation: how each engine of the registry gets its peer."""


class Pair:
    """Rank 0's endpoint and its echo peer on one engine, and the next sequence number."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seq = 0
        self.peer = None

    @property
    def t(self) -> Transport:
        """Rank 0's endpoint, with a live peer (a new one when the last was killed)."""
        if self.peer is not None and not self.peer.transport.peer_alive(1):
            self.close()
        if self.peer is None:
            self.peer = HARNESSES[self.name](self.name)
            self.seq = 0
        return self.peer.transport

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def kill_peer(self, seq: int = DIE) -> None:
        """Ask the peer to die (the next test starts a new one), or with :data:`STOP` to stop."""
        t = self.t
        t.put_signal(1, t.layout.slot(INBOX, 0), torch.zeros(1, dtype=torch.uint8), seq)

    def close(self) -> None:
        if self.peer is not None:
            if self.peer.transport.peer_alive(1):
                self.kill_peer(STOP)
            self.peer.close()
            self.peer = None


@pytest.fixture(scope="module", params=names())
def pair(request):
    why = unavailable(request.param)
    if why is not None:
        pytest.skip(f"transport {why}")
    p = Pair(request.param)
    yield p
    p.close()


def test_every_engine_has_a_harness():
    """A new engine in the registry is a new parametrisation here, never a silent omission."""
    assert set(HARNESSES) == set(ENGINES), "add the engine's harness to HARNESSES"


def test_put_signal_wait_round_trip(pair):
    """The bytes a put carries arrive exactly, the signal says so, a get reads the peer's slot."""
    t = pair.t
    inbox, reply = t.layout.slot(INBOX, 0), t.layout.slot(REPLY, 1)
    g = torch.Generator().manual_seed(0)
    for n in (1, 1000, SLOT):
        seq = pair.next_seq()
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        t.put_signal(1, inbox, data, seq)
        assert t.wait_signal(reply, seq, timeout=60.0) >= seq
        assert torch.equal(t.read(reply, n), data)
        assert torch.equal(t.get(1, inbox, n, timeout=60.0), data)  # one-sided read
        assert t.signal(reply) == seq
    seq = pair.next_seq()
    t.put_signal(1, inbox, data.flip(0).contiguous(), seq)
    assert t.wait_any({reply: seq, t.layout.slot(REPLY, 1, 1): 1}, timeout=60.0) == [reply]
    assert torch.equal(t.read(reply), data.flip(0))


def test_a_wait_times_out_within_its_bound(pair):
    """Nobody raises the awaited signal: the wait raises TransportTimeout, never early; a
    timeout that is not a positive number is a ValueError naming it."""
    t = pair.t
    reply = t.layout.slot(REPLY, 1)
    for wait in (
        lambda: t.wait_signal(reply, NEVER, timeout=0.2),
        lambda: t.wait_any({reply: NEVER}, timeout=0.2),
    ):
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout, match="within 0.2"):
            wait()
        assert time.monotonic() - t0 >= 0.2  # never early (no upper bound: a loaded box)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            t.wait_signal(reply, 1, timeout=bad)


def test_bad_puts_are_refused_at_the_sender(pair):
    """A put into a slot another rank feeds (the source check), to a rank or slot that does not
    exist, with a sequence number past u64 or a message past the slot, is refused before it
    leaves, naming the argument; the peer then still answers the next request."""
    t = pair.t
    theirs = t.layout.slot(INBOX, 1)  # fed by rank 1: rank 0 may not write it
    data = torch.ones(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="fed by rank 1"):
        t.put_signal(1, theirs, data, pair.seq + 1)
    with pytest.raises(ValueError, match="fed by rank 1"):
        t.put_signal(0, t.layout.slot(REPLY, 1), data, pair.seq + 1)
    with pytest.raises(ValueError, match="peer"):
        t.put_signal(2, t.layout.slot(INBOX, 0), data, pair.seq + 1)
    with pytest.raises(ValueError, match="slot"):
        t.put_signal(1, t.num_slots, data, pair.seq + 1)
    with pytest.raises(ValueError, match="seq"):
        t.put_signal(1, t.layout.slot(INBOX, 0), data, 2**64)
    with pytest.raises(ValueError, match=f"does not fit a slot of {SLOT} B"):
        t.put_signal(1, t.layout.slot(INBOX, 0), torch.zeros(SLOT + 1, dtype=torch.uint8), 1)
    with pytest.raises(TypeError, match="uint8"):
        t.put_signal(1, t.layout.slot(INBOX, 0), torch.zeros(8, dtype=torch.int32), 1)
    seq = pair.next_seq()
    t.put_signal(1, t.layout.slot(INBOX, 0), data, seq)
    reply = t.layout.slot(REPLY, 1)
    assert t.wait_signal(reply, seq, timeout=60.0) == seq  # nothing refused was delivered
    assert torch.equal(t.read(reply, 8), data)


def test_a_get_obeys_the_source_rule_of_puts(pair):
    """A get of a peer's slot that this rank does not feed (another rank's requests, or the
    answers it was sent) is refused at the getter, naming the slot's source, as such a put is;
    a get of a slot it feeds, or of any slot of its own, reads it; the peer still answers."""
    t = pair.t
    lay = t.layout
    inbox, reply = lay.slot(INBOX, 0), lay.slot(REPLY, 1)
    data = torch.arange(16, dtype=torch.uint8)
    seq = pair.next_seq()
    t.put_signal(1, inbox, data, seq)
    assert t.wait_signal(reply, seq, timeout=60.0) == seq
    for theirs in (lay.slot(INBOX, 1), lay.slot(REPLY, 1), lay.slot(INBOX, 1, 1)):
        with pytest.raises(ValueError, match="fed by rank 1"):
            t.get(1, theirs, 8, timeout=60.0)
    assert torch.equal(t.get(1, inbox, 16, timeout=60.0), data)  # its own request
    assert torch.equal(t.get(0, reply, 16, timeout=60.0), data)  # a slot of its own
    seq = pair.next_seq()
    t.put_signal(1, inbox, data.flip(0).contiguous(), seq)
    assert t.wait_signal(reply, seq, timeout=60.0) == seq


def test_a_peer_that_closes_is_gone(pair):
    """A peer that closes its endpoint cleanly (a goodbye, not a crash) is no longer alive: a
    holder waiting for its requesters to be done or gone stops waiting for it (a requester's
    ``done`` key overwritten by another process must not keep a holder serving forever)."""
    t = pair.t
    pair.kill_peer(STOP)
    deadline = time.monotonic() + 30.0
    while t.peer_alive(1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not t.peer_alive(1)


def test_a_lost_peer_raises_peer_lost_and_never_hangs(pair):
    """The peer dies: a wait on a slot it feeds raises PeerLost at once (well inside its
    60 s timeout), and the endpoint reports the peer dead. Runs last: it kills the peer."""
    if not ENGINES[pair.name].detects_peer_loss:
        pytest.skip(
            f"transport {pair.name!r} cannot detect a lost peer (no connection whose closing "
            "says so); its waits are bounded by their timeout"
        )
    t = pair.t
    pair.kill_peer()
    t0 = time.monotonic()
    with pytest.raises(PeerLost):
        t.wait_signal(t.layout.slot(REPLY, 1), DIE, timeout=60.0)
    assert time.monotonic() - t0 < 60.0
    deadline = time.monotonic() + 30.0
    while t.peer_alive(1) and time.monotonic() < deadline:  # a process' death shows at once
        time.sleep(0.01)
    assert not t.peer_alive(1)


def _peer_main(name: str, port: int) -> None:
    """A cross-process engine's rank 1 (this file run as a script)."""
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=False)
    t = connect(name, 1, 2, store, slot_bytes=SLOT, lanes=LANES, device=0)
    t.barrier(START_S)
    echo(t, lambda: os._exit(0))  # DIE: as a crashed peer would, no close, no goodbye
    os._exit(0)  # STOP: closed; no gloo destructor at interpreter exit


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=names(in_process=False))
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    _peer_main(a.engine, a.port)
