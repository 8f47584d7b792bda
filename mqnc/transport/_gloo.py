"""The two halves of the gloo engine (:mod:`mqnc.transport.torchdist`): what it receives and
what it sends, per peer.

Every message between two ranks is ONE gloo message: a 32-byte frame header
``[op u32, slot u32, seq u64, nbytes u64, status u64]`` (:data:`FRAME`) followed by the
``nbytes`` data bytes. One message per put (not a control word then the data, which gloo
delivers only once the receiver posts the second receive: half a round trip more).

Sizes. gloo aborts the receiving process (``std::terminate`` on its device thread: the
``op.preamble.length <= op.nbytes`` enforce of ``gloo/transport/tcp/pair.cc``, no Python code
runs) when a message is longer than the receive it lands in. So every receive here is
:data:`FRAME` ``+ slot_bytes`` bytes, the largest frame any member may send: the fabric agrees
on ``slot_bytes`` (and the frame protocol :data:`PROTOCOL`) in a handshake before the process
group is built (:func:`mqnc.transport.protocol.handshake`), and :meth:`Outbox.send` refuses a
frame past it. A frame that *claims* more than a slot (or a put or get of a slot its sender
does not feed) is dropped at the receiver and recorded: it costs that sender's request, never
the process. What gloo leaves open: a rank that bypasses this module and hands gloo a longer
message itself (``ProcessGroupGloo.send``) still aborts the receiver; ``torch.distributed``
authenticates nobody, so the members of a fabric are trusted not to (see docs/serving.md's
"Security and trust model").

:class:`Inbox` is the receiving half: one service thread per peer keeps two receives posted
(double-buffered, so a sender never waits for the thread to repost) into landing buffers of
``32 + slot_bytes`` bytes, and reposts into a third, spare one before it applies a message. A
put that lands is made visible by swapping the landing buffer with the slot's storage under the
signal board's lock (no copy), then raising the signal. A put is accepted only into a slot
whose source is the peer it came from (no rank writes another's lanes), and a get is answered
only from such a slot (no rank reads another's lanes: anything else is answered "refused",
status :data:`REFUSED`); anything else is dropped and recorded in :attr:`PeerState.errors`.

:class:`Outbox` is the sending half: ``send`` frames the message and hands it to gloo from the
calling thread (gloo sends are asynchronous; a stalled peer never blocks the caller). gloo
completes a send only when someone waits on it (``Work.is_completed`` stays False until
then), so one reaper thread per peer waits on the sends in order, woken once per batch
(:data:`REAP_BATCH` sends or :data:`REAP_BYTES` bytes) or by :meth:`Outbox.quiet`: it keeps
each message alive until gloo is done with it and sees a send fail.

:class:`PeerState` is what both halves know about the other ranks (who died and why, who said
goodbye, whether this rank is closing), guarded by a condition on the signal board's lock.
"""

from __future__ import annotations

import collections
import datetime
import struct
import threading
import time

import numpy as np
import torch

from mqnc.transport.protocol import PeerLost, TransportTimeout, host_bytes
from mqnc.transport.signals import SignalBoard

__all__ = [
    "PeerState", "Inbox", "Outbox", "FRAME", "PROTOCOL", "PUT", "GET", "GET_REPLY", "BARRIER",
    "CLOSE", "REFUSED",
]  # fmt: skip

FRAME = 32
_FRAME = struct.Struct("<IIQQQ")
TAG = 7
PUT, GET, GET_REPLY, BARRIER, CLOSE = 1, 2, 3, 4, 5  # frame ops
REFUSED = 1  # a GET_REPLY's status: the get was refused (the slot is not the getter's)
PROTOCOL = 2  # this frame layout and its ops (2: a status word, the get's source rule)
REAP_BATCH = 8
REAP_BYTES = 1 << 20


class PeerState:
    """The other ranks' liveness as this rank sees it, under :attr:`cond`.

    ``dead``: ranks whose connection broke (their waits raise :class:`PeerLost` at once);
    ``closed``: ranks that said goodbye; ``errors``: why a rank is dead, or what a rank sent
    that was dropped; ``closing``: this rank is shutting down (broken connections are then
    expected, not errors).
    """

    def __init__(self, board: SignalBoard) -> None:
        self.board = board
        self.cond = threading.Condition(board.lock)
        self.dead: set[int] = set()
        self.closed: set[int] = set()
        self.errors: dict[int, str] = {}
        self.closing = False

    def mark_dead(self, peer: int, why: str, *, first_reason: bool = False) -> None:
        """Record ``peer`` as dead (``why`` kept unless closing, or unless ``first_reason``
        and a reason is already known) and wake every waiter."""
        with self.cond:
            if not self.closing and not (first_reason and peer in self.errors):
                self.errors[peer] = why
            self.dead.add(peer)
            self.cond.notify_all()
        self.board.wake_all()

    def alive_or_raise(self, peer: int) -> None:
        if peer in self.dead:
            raise PeerLost(f"rank {peer} is gone ({self.errors.get(peer, 'connection closed')})")


class _Reaper:
    """Waits, in order, on the gloo sends to one peer (see the module docstring)."""

    def __init__(self, outbox: Outbox, peer: int) -> None:
        self.q: collections.deque = collections.deque()
        self.bytes = 0
        self.flush = False
        self.failed = False
        self._outbox = outbox
        self._peer = peer
        self.thread = threading.Thread(
            target=self._run, daemon=True, name=f"mqnc-torchdist-{outbox.rank}->{peer}"
        )
        self.thread.start()

    def _run(self) -> None:
        cond, peers = self._outbox.cond, self._outbox.peers
        while True:
            with cond:
                while True:
                    if self._peer in peers.dead:
                        self.failed = self.failed or bool(self.q)
                        self.q.clear()
                        cond.notify_all()
                        return
                    if self.q and (
                        self.flush or len(self.q) >= REAP_BATCH or self.bytes >= REAP_BYTES
                    ):
                        break
                    cond.wait()
                work, _, nbytes = self.q[0]
            try:
                work.wait(self._outbox.idle)
            except Exception as exc:
                why = f"send failed: {type(exc).__name__}: {exc}"
                peers.mark_dead(self._peer, why, first_reason=True)
                continue
            with cond:
                self.q.popleft()
                self.bytes -= nbytes
                if not self.q:
                    self.flush = False
                cond.notify_all()


class Outbox:
    """Framed, asynchronous sends to each peer, reaped by one thread per peer."""

    def __init__(self, pg, rank: int, world_size: int, peers: PeerState, slot_bytes: int,
                 idle_timeout_s: float = 3600.0) -> None:  # fmt: skip
        self._pg = pg
        # a send's wait: the idle bound (the process group's own timeout bounds its forming)
        self.idle = datetime.timedelta(seconds=float(idle_timeout_s))
        self.rank = rank
        self.slot_bytes = slot_bytes  # no frame carries (or asks for) more: the receive's size
        self._world = world_size
        self.peers = peers
        self.cond = peers.cond
        self._locks = [threading.Lock() for _ in range(world_size)]
        self._reapers: list[_Reaper | None] = [None] * world_size

    def send(self, peer: int, op: int, slot: int, seq: int, data: torch.Tensor | np.ndarray | None,
             count: int = 0, status: int = 0) -> None:  # fmt: skip
        """Frame ``[op, slot, seq, n, status]`` and the ``n`` bytes of ``data`` (``n = count``
        for a get, which carries none) as one gloo message to ``peer``.

        Refuses (``ValueError``) an ``n`` past ``slot_bytes``: a longer message would abort
        the receiving process inside gloo (see the module docstring)."""
        src = None if data is None else host_bytes(data)
        n = count if src is None else src.shape[0]
        if n > self.slot_bytes:
            raise ValueError(
                f"{'count' if src is None else 'data'}: a frame of {n} B is past the fabric's "
                f"slot of {self.slot_bytes} B (a longer gloo message aborts its receiver)"
            )
        a = np.empty(FRAME + (0 if src is None else n), dtype=np.uint8)
        _FRAME.pack_into(a, 0, op, slot, seq, n, status)
        if src is not None and n:
            a[FRAME:] = src
        msg = torch.from_numpy(a)
        self.peers.alive_or_raise(peer)
        try:
            with self._locks[peer]:
                work = self._pg.send([msg], peer, TAG)
        except Exception as exc:  # the pair is closed: the peer died (maybe not yet seen)
            self.peers.mark_dead(
                peer, f"send failed: {type(exc).__name__}: {exc}", first_reason=True
            )
            raise PeerLost(f"rank {peer} is gone ({self.peers.errors.get(peer, exc)})") from None
        reaper = self._reapers[peer]
        with self.cond:
            if reaper is None:
                reaper = self._reapers[peer] = _Reaper(self, peer)
            reaper.q.append((work, msg, a.shape[0]))  # the message kept alive until sent
            reaper.bytes += a.shape[0]
            if len(reaper.q) >= REAP_BATCH or reaper.bytes >= REAP_BYTES:
                self.cond.notify_all()

    def quiet(self, deadline: float | None, timeout: float | None, peers=None) -> None:
        """Wait until every send (to ``peers``, default all) is complete.

        Raises :class:`TransportTimeout` at ``deadline`` (a stalled peer) and
        :class:`PeerLost` if a peer with undelivered sends died.
        """
        peers = range(self._world) if peers is None else peers
        reapers = [(p, self._reapers[p]) for p in peers if self._reapers[p] is not None]
        dead = self.peers.dead
        with self.cond:
            for _, r in reapers:
                r.flush = True
            self.cond.notify_all()
            while True:
                lost = [p for p, r in reapers if r.failed or (p in dead and r.q)]
                if lost:
                    raise PeerLost(f"rank {self.rank}: puts to ranks {lost} were not delivered")
                busy = [p for p, r in reapers if r.q]
                if not busy:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportTimeout(
                        f"rank {self.rank}: puts to ranks {busy} not delivered within "
                        f"{timeout:.3g} s (peer stalled)"
                    )
                self.cond.wait(left)


class Inbox:
    """This rank's slots, signals, get replies and barrier counts, fed by one service thread
    per peer; slots and signals are guarded by ``board.lock`` (the rest by ``peers.cond``,
    the same lock)."""

    def __init__(self, pg, rank: int, world_size: int, layout, slot_bytes: int,
                 peers: PeerState, outbox: Outbox) -> None:  # fmt: skip
        self._pg = pg
        self._idle = outbox.idle  # a receive's wait on an idle link
        self._rank = rank
        self._peers = peers
        self._outbox = outbox
        self.board = peers.board
        self.cond = peers.cond
        self.layout = layout
        self.slot_bytes = slot_bytes
        # Each slot's storage is a landing buffer: frame + data (swapped in, never copied), as
        # a (tensor gloo receives into, its numpy view) pair: no torch call per message.
        self.slots = [_landing(slot_bytes) for _ in range(layout.num_slots)]
        self.views = [a[FRAME:] for _, a in self.slots]
        self.gets: dict[int, torch.Tensor | None] = {}
        self.barrier_seen = [0] * world_size
        self.threads = [
            threading.Thread(
                target=self._serve_peer,
                args=(peer,),
                daemon=True,
                name=f"mqnc-torchdist-{rank}<-{peer}",
            )  # fmt: skip
            for peer in range(world_size)
            if peer != rank
        ]
        for t in self.threads:
            t.start()

    def deliver(self, slot: int, data: torch.Tensor | np.ndarray, seq: int) -> None:
        """A put to this rank itself: copy the bytes, then raise the signal."""
        src = host_bytes(data)
        with self.board.lock:
            self.views[slot][: src.shape[0]] = src
            self.board.raise_locked(slot, seq)

    def _serve_peer(self, peer: int) -> None:
        """Two receives always posted, and a spare landing buffer: when one completes, the
        next receive is posted into the spare first and the message applied after, so that
        the thread its signal wakes does not wait (for the GIL) through the repost.
        The applied message hands back the buffer it freed (the slot's old storage for a
        put, its own for anything else): the next spare."""
        pg = self._pg
        bufs = [_landing(self.slot_bytes) for _ in range(3)]
        spare = bufs.pop()
        works = [pg.recv([t], peer, TAG) for t, _ in bufs]
        i = 0
        try:
            while True:
                works[i].wait(self._idle)
                got = bufs[i]
                op, slot, seq, n, status = _FRAME.unpack_from(got[1], 0)
                if op == CLOSE:
                    with self.cond:
                        self._peers.closed.add(peer)
                        self.cond.notify_all()
                    self.board.wake_all()
                    return
                bufs[i], works[i] = spare, pg.recv([spare[0]], peer, TAG)
                spare = self._on_message(peer, op, slot, seq, n, status, got)
                i ^= 1
        except Exception as exc:  # the connection closed (peer died) or the link broke
            self._peers.mark_dead(peer, f"{type(exc).__name__}: {exc}")

    def _on_message(self, peer: int, op: int, slot: int, seq: int, n: int, status: int,
                    buf: tuple):  # fmt: skip
        """Apply one message (``buf``: its landing buffer, a (tensor, numpy view) pair);
        returns the buffer to post the next receive into."""
        if op == PUT:
            return self._on_put(peer, slot, seq, n, buf)
        if op == GET:
            self._on_get(peer, slot, seq, n)
        elif op == GET_REPLY:
            if status == REFUSED:
                data = REFUSED
            else:
                data = torch.from_numpy(buf[1][FRAME : FRAME + min(n, self.slot_bytes)].copy())
            with self.cond:
                if seq in self.gets:
                    self.gets[seq] = data
                self.cond.notify_all()
        elif op == BARRIER:
            with self.cond:
                self.barrier_seen[peer] = max(self.barrier_seen[peer], seq)
                self.cond.notify_all()
        else:
            self._drop(peer, f"unknown frame op {op}")
        return buf

    def _on_get(self, peer: int, slot: int, token: int, n: int) -> None:
        """Answer a get of ``n`` bytes of ``slot``: only from a slot ``peer`` feeds (the
        source rule of puts), else "refused" (and recorded)."""
        lay = self.layout
        if not 0 <= slot < lay.num_slots or lay.source_of(slot) != peer or n > self.slot_bytes:
            why = (
                f"slot {slot} is fed by rank {lay.source_of(slot)}"
                if 0 <= slot < lay.num_slots
                else f"slot {slot} out of range"
            )
            self._drop(peer, f"get of {n} B from slot {slot} ({why})")
            self._outbox.send(peer, GET_REPLY, 0, token, _EMPTY, status=REFUSED)
            return
        with self.board.lock:
            data = torch.from_numpy(self.views[slot][:n].copy())
        self._outbox.send(peer, GET_REPLY, 0, token, data)

    def _on_put(self, peer: int, slot: int, seq: int, n: int, buf: tuple):
        lay = self.layout
        if not 0 <= slot < lay.num_slots or lay.source_of(slot) != peer or n > self.slot_bytes:
            why = (
                f"slot {slot} is fed by rank {lay.source_of(slot)}"
                if 0 <= slot < lay.num_slots
                else f"slot {slot} out of range"
            )
            self._drop(peer, f"put of {n} B into slot {slot} ({why})")
            return buf
        with self.board.lock:
            old = self.slots[slot]
            self.slots[slot] = buf
            self.views[slot] = buf[1][FRAME:]
            self.board.raise_locked(slot, seq)
        return old

    def _drop(self, peer: int, what: str) -> None:
        with self.cond:
            self._peers.errors[peer] = f"dropped from rank {peer}: {what}"


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _landing(slot_bytes: int) -> tuple[torch.Tensor, np.ndarray]:
    """A landing buffer of one frame and ``slot_bytes`` data bytes: the tensor gloo receives
    into and its numpy view (zeroed: a slot never read before holds no stale bytes)."""
    t = torch.zeros(FRAME + slot_bytes, dtype=torch.uint8)
    return t, t.numpy()
