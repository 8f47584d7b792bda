"""The two halves of the gloo engine (:mod:`mqnc.transport.torchdist`): what it receives and
what it sends, each peer over its own threads.

:class:`Inbox` is the receiving half: one service thread per peer blocks in ``recv`` and turns
that peer's messages into the protocol's effects (write the bytes into the local slot, then
raise its signal; answer a ``get``; count a barrier).

:class:`Outbox` is the sending half. Puts are non-blocking (as NVSHMEM's
``put_signal_nbi``): one sender thread per peer drains a queue, so that a stalled peer (one
whose service thread does not post its receive) blocks that thread only, never the caller;
:meth:`Outbox.quiet` waits for delivery with a timeout.

:class:`PeerState` is what both halves of the engine know about the other ranks (who died and
why, who said goodbye, whether this rank is closing), guarded by the one condition variable the
engine's waits use.
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from mqnc.transport.protocol import PeerLost, TransportError, TransportTimeout

__all__ = ["PeerState", "Inbox", "Outbox", "PUT", "GET", "GET_REPLY", "BARRIER", "CLOSE"]

TAG_CTRL, TAG_DATA = 0, 1
PUT, GET, GET_REPLY, BARRIER, CLOSE = 1, 2, 3, 4, 5  # control ops


class PeerState:
    """The other ranks' liveness as this rank sees it, under :attr:`cond`.

    ``dead``: ranks whose connection broke (their waits raise :class:`PeerLost` at once);
    ``closed``: ranks that said goodbye; ``errors``: why a rank is dead; ``closing``: this rank
    is shutting down (broken connections are then expected, not errors).
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
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

    def alive_or_raise(self, peer: int) -> None:
        if peer in self.dead:
            raise PeerLost(f"rank {peer} is gone ({self.errors.get(peer, 'connection closed')})")


class Outbox:
    """Queued sends of control words ``[op, a, b, n]`` (and ``n`` data bytes) to each peer."""

    def __init__(self, pg, rank: int, world_size: int, peers: PeerState) -> None:
        self._pg = pg
        self._rank = rank
        self._world = world_size
        self._peers = peers
        self._queues = [collections.deque() for _ in range(world_size)]
        self._pending = [0] * world_size
        self._undelivered = [False] * world_size
        self._senders: list[threading.Thread | None] = [None] * world_size

    def send(
        self, peer: int, op: int, a: int, b: int, data: torch.Tensor | None, count: int = 0
    ) -> None:
        """Queue control word ``[op, a, b, n]`` and, for a put or a get reply, the ``n`` bytes
        (``n = count`` for a get, which carries no bytes)."""
        n = count if data is None else int(data.numel())
        ctrl = torch.tensor([op, a, b, n], dtype=torch.int64)
        cond = self._peers.cond
        with cond:
            self._peers.alive_or_raise(peer)
            self._pending[peer] += 1
            self._queues[peer].append((ctrl, data if data is not None and n else None))
            if self._senders[peer] is None:
                t = threading.Thread(
                    target=self._sender,
                    args=(peer,),
                    daemon=True,
                    name=f"mqnc-torchdist-{self._rank}->{peer}",
                )
                self._senders[peer] = t
                t.start()
            cond.notify_all()

    def _sender(self, peer: int) -> None:
        cond = self._peers.cond
        while True:
            with cond:
                while not self._queues[peer] and peer not in self._peers.dead:
                    cond.wait()
                if peer in self._peers.dead:
                    self._undelivered[peer] = self._pending[peer] > 0
                    self._queues[peer].clear()
                    self._pending[peer] = 0
                    cond.notify_all()
                    return
                ctrl, data = self._queues[peer].popleft()
            try:
                self._pg.send([ctrl], peer, TAG_CTRL).wait()
                if data is not None:
                    self._pg.send([data], peer, TAG_DATA).wait()
            except Exception as exc:
                why = f"send failed: {type(exc).__name__}: {exc}"
                self._peers.mark_dead(peer, why, first_reason=True)
                continue
            with cond:
                self._pending[peer] -= 1
                cond.notify_all()

    def quiet(self, deadline: float | None, timeout: float | None, peers=None) -> None:
        """Wait until every queued send (to ``peers``, default all) has been handed to gloo.

        Raises :class:`TransportTimeout` at ``deadline`` (a stalled peer) and
        :class:`PeerLost` if a peer with undelivered sends died.
        """
        peers = range(self._world) if peers is None else peers
        cond, dead = self._peers.cond, self._peers.dead
        with cond:
            while True:
                busy = [p for p in peers if self._pending[p] > 0 and p not in dead]
                lost = [p for p in peers if p in dead and self._undelivered[p]]
                if lost:
                    raise PeerLost(f"rank {self._rank}: puts to ranks {lost} were not delivered")
                if not busy:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportTimeout(
                        f"rank {self._rank}: puts to ranks {busy} not delivered within "
                        f"{timeout:.3g} s (peer stalled)"
                    )
                cond.wait(left)


class Inbox:
    """This rank's slots, signals, get replies and barrier counts, fed by one service thread
    per peer; every field is guarded by ``peers.cond``."""

    def __init__(
        self,
        pg,
        rank: int,
        world_size: int,
        num_slots: int,
        slot_bytes: int,
        peers: PeerState,
        outbox: Outbox,
    ) -> None:
        self._pg = pg
        self._peers = peers
        self._outbox = outbox
        self.cond = peers.cond
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.heap = torch.zeros(num_slots, slot_bytes, dtype=torch.uint8)
        self.signals = [0] * num_slots
        self.gets: dict[int, torch.Tensor | None] = {}
        self.barrier_seen = [0] * world_size
        self.threads = [
            threading.Thread(
                target=self._serve_peer,
                args=(peer,),
                daemon=True,
                name=f"mqnc-torchdist-{rank}<-{peer}",
            )
            for peer in range(world_size)
            if peer != rank
        ]
        for t in self.threads:
            t.start()

    def deliver(self, slot: int, data: torch.Tensor, seq: int) -> None:
        """A put to this rank itself: write the bytes, then raise the signal."""
        with self.cond:
            self.heap[slot, : data.numel()].copy_(data)
            self.signals[slot] = max(self.signals[slot], int(seq))
            self.cond.notify_all()

    def _serve_peer(self, peer: int) -> None:
        ctrl = torch.zeros(4, dtype=torch.int64)
        try:
            while True:
                self._pg.recv([ctrl], peer, TAG_CTRL).wait()
                op, a, b, nbytes = (int(x) for x in ctrl.tolist())
                if op == CLOSE:
                    with self.cond:
                        self._peers.closed.add(peer)
                        self.cond.notify_all()
                    return
                self._on_message(peer, op, a, b, nbytes)
        except Exception as exc:  # the connection closed (peer died) or the link broke
            self._peers.mark_dead(peer, f"{type(exc).__name__}: {exc}")

    def _on_message(self, peer: int, op: int, a: int, b: int, nbytes: int) -> None:
        if op == PUT:
            self._on_put(peer, a, b, nbytes)
        elif op == GET:
            self._on_get(peer, a, b, nbytes)
        elif op == GET_REPLY:
            data = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                self._pg.recv([data], peer, TAG_DATA).wait()
            with self.cond:
                self.gets[a] = data
                self.cond.notify_all()
        elif op == BARRIER:
            with self.cond:
                self.barrier_seen[peer] = max(self.barrier_seen[peer], a)
                self.cond.notify_all()
        else:
            raise TransportError(f"unknown control op {op} from rank {peer}")

    def _on_put(self, peer: int, slot: int, seq: int, nbytes: int) -> None:
        ok = 0 <= slot < self.num_slots and 0 <= nbytes <= self.slot_bytes
        if not ok:  # drain the bytes to keep the stream in step, then drop the message
            if nbytes:
                self._pg.recv([torch.empty(nbytes, dtype=torch.uint8)], peer, TAG_DATA).wait()
            self._peers.errors[peer] = f"bad put (slot {slot}, {nbytes} B) from rank {peer} dropped"
            return
        with self.cond:
            if nbytes:
                self._pg.recv([self.heap[slot, :nbytes]], peer, TAG_DATA).wait()
            self.signals[slot] = max(self.signals[slot], seq)
            self.cond.notify_all()

    def _on_get(self, peer: int, slot: int, token: int, nbytes: int) -> None:
        nbytes = max(0, min(nbytes, self.slot_bytes))
        with self.cond:
            data = self.heap[slot, :nbytes].clone() if 0 <= slot < self.num_slots else None
        if data is None:
            data = torch.empty(0, dtype=torch.uint8)
        self._outbox.send(peer, GET_REPLY, token, 0, data)
