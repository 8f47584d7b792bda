"""Multi-process engine over ``torch.distributed`` (gloo; CPU tensors, any machine).

One-sided put-with-signal emulated with two-sided messages: every rank runs one **service
thread per peer** that receives that peer's messages and turns them into the protocol's
effects (write the bytes into the local slot, then raise its signal; answer a ``get``; count a
barrier). The requester side of a put is a ``send`` of a 4-word control message
``[op, slot, seq, nbytes]`` followed by the bytes.

Facts this engine is built on (torch 2.13, gloo):

- a gloo wait that times out **closes the pair** ("Application timeout caused pair
  closure"): a timed wait cannot be used to poll. So no gloo wait here has a short timeout:
  the service threads block in ``recv`` (bounded only by ``idle_timeout_s``, the process
  group's timeout, default 1 h, passed explicitly instead of gloo's 30 min default), and
  every user-facing timeout (``wait_signal``, ``get``, ``barrier``) is a condition-variable
  wait on local state;
- a peer process that dies closes its TCP connections: the service thread's ``recv`` raises
  at once, the peer is marked dead, and waits on slots it feeds raise
  :class:`~mqnc.transport.base.PeerLost` without waiting for their timeout;
- gloo moves contiguous tensors only; bf16 moves bit-exactly (the wire sends uint8 anyway);
- ports: a ``TCPStore`` created with port 0 picks a free port (``store.port``); tests set
  ``GLOO_SOCKET_IFNAME=lo``.

The process group is built directly (``ProcessGroupGloo(store, rank, world, timeout)``), not
through ``init_process_group``, so that no global default group is created (a test process
can hold several engines, and nothing else in the process is affected).

NCCL is not used: the service-thread design needs a receive that a thread can block in for
an unbounded time per peer, which NCCL's GPU-stream semantics do not give; on GPUs the
NVSHMEM engine (:mod:`mqnc.transport.nvshmem`) is the one-sided path. CUDA tensors passed to
``put_signal`` are staged through host memory.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time

import torch

from mqnc.transport.base import (
    PeerLost,
    SlotLayout,
    Transport,
    TransportError,
    TransportTimeout,
    check_message,
)

__all__ = ["TorchDistTransport", "free_port_store"]

_PUT, _GET, _GET_REPLY, _BARRIER, _CLOSE = 1, 2, 3, 4, 5
_TAG_CTRL, _TAG_DATA = 0, 1
# Process groups whose service threads may still be blocked in recv at close(): kept alive
# until the process exits, so that no destructor runs under a blocked C++ receive.
_RETIRED: list = []


def free_port_store(world_size: int, timeout_s: float = 60.0, host: str = "127.0.0.1"):
    """A master ``TCPStore`` on a free port (port 0): ``store.port`` is what workers join."""
    from torch.distributed import TCPStore

    return TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class TorchDistTransport(Transport):
    """One rank of the gloo engine.

    Parameters
    ----------
    rank, world_size : int
    store : torch.distributed.Store
        Rendezvous store shared by all ranks (e.g. a ``TCPStore``; see
        :func:`free_port_store`). A ``PrefixStore`` with ``prefix`` is layered on it.
    slot_bytes : int
        Bytes per slot (see :func:`mqnc.transport.slot_bytes_for`); the same on every rank.
    lanes : int
        Slots per (channel, source) pair.
    idle_timeout_s : float
        The process group's timeout: the longest a service thread may sit in one ``recv``
        (an idle link) before gloo gives up on the pair. User-facing waits have their own,
        short timeouts.
    prefix : str
        Store namespace (several engines may share one store).
    """

    name = "torchdist"

    def __init__(
        self,
        rank: int,
        world_size: int,
        store,
        *,
        slot_bytes: int,
        lanes: int = 1,
        idle_timeout_s: float = 3600.0,
        prefix: str = "mqnc",
    ) -> None:
        import torch.distributed as dist

        super().__init__(rank, SlotLayout(world_size, lanes), slot_bytes)
        if not dist.is_available() or not hasattr(dist, "ProcessGroupGloo"):
            raise RuntimeError("torchdist: this torch build has no gloo backend")
        self._pg = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, store),
            rank,
            world_size,
            datetime.timedelta(seconds=float(idle_timeout_s)),
        )
        n = self.layout.num_slots
        self._heap = torch.zeros(n, slot_bytes, dtype=torch.uint8)
        self._signals = [0] * n
        self._cond = threading.Condition()
        self._dead: set[int] = set()
        self._closed_peers: set[int] = set()
        self._closing = False
        self._queues = [collections.deque() for _ in range(world_size)]
        self._pending = [0] * world_size
        self._undelivered = [False] * world_size
        self._senders: list[threading.Thread | None] = [None] * world_size
        self._get_lock = threading.Lock()
        self._get_token = 0
        self._gets: dict[int, torch.Tensor | BaseException | None] = {}
        self._barrier_epoch = 0
        self._barrier_seen = [0] * world_size
        self.errors: dict[int, str] = {}
        self._threads = []
        for peer in range(world_size):
            if peer == rank:
                continue
            t = threading.Thread(
                target=self._serve_peer,
                args=(peer,),
                daemon=True,
                name=f"mqnc-torchdist-{rank}<-{peer}",
            )
            t.start()
            self._threads.append(t)

    @classmethod
    def connect(
        cls,
        rank: int,
        world_size: int,
        port: int,
        *,
        host: str = "127.0.0.1",
        store_timeout_s: float = 60.0,
        **kwargs,
    ) -> TorchDistTransport:
        """Join the ``TCPStore`` at ``host:port`` as a client and build the engine."""
        from torch.distributed import TCPStore

        store = TCPStore(
            host,
            int(port),
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=store_timeout_s),
        )
        return cls(rank, world_size, store, **kwargs)

    # ---- service threads --------------------------------------------------------------------
    def _serve_peer(self, peer: int) -> None:
        ctrl = torch.zeros(4, dtype=torch.int64)
        try:
            while True:
                self._pg.recv([ctrl], peer, _TAG_CTRL).wait()
                op, a, b, nbytes = (int(x) for x in ctrl.tolist())
                if op == _PUT:
                    self._on_put(peer, a, b, nbytes)
                elif op == _GET:
                    self._on_get(peer, a, b, nbytes)
                elif op == _GET_REPLY:
                    data = torch.empty(nbytes, dtype=torch.uint8)
                    if nbytes:
                        self._pg.recv([data], peer, _TAG_DATA).wait()
                    with self._cond:
                        self._gets[a] = data
                        self._cond.notify_all()
                elif op == _BARRIER:
                    with self._cond:
                        self._barrier_seen[peer] = max(self._barrier_seen[peer], a)
                        self._cond.notify_all()
                elif op == _CLOSE:
                    with self._cond:
                        self._closed_peers.add(peer)
                        self._cond.notify_all()
                    return
                else:
                    raise TransportError(f"unknown control op {op} from rank {peer}")
        except Exception as exc:  # the connection closed (peer died) or the link broke
            with self._cond:
                if not self._closing:
                    self.errors[peer] = f"{type(exc).__name__}: {exc}"
                self._dead.add(peer)
                self._cond.notify_all()

    def _on_put(self, peer: int, slot: int, seq: int, nbytes: int) -> None:
        ok = 0 <= slot < self.num_slots and 0 <= nbytes <= self.slot_bytes
        if not ok:  # drain the bytes to keep the stream in step, then drop the message
            if nbytes:
                self._pg.recv([torch.empty(nbytes, dtype=torch.uint8)], peer, _TAG_DATA).wait()
            self.errors[peer] = f"bad put (slot {slot}, {nbytes} B) from rank {peer} dropped"
            return
        with self._cond:
            if nbytes:
                self._pg.recv([self._heap[slot, :nbytes]], peer, _TAG_DATA).wait()
            self._signals[slot] = max(self._signals[slot], seq)
            self._cond.notify_all()

    def _on_get(self, peer: int, slot: int, token: int, nbytes: int) -> None:
        nbytes = max(0, min(nbytes, self.slot_bytes))
        with self._cond:
            data = self._heap[slot, :nbytes].clone() if 0 <= slot < self.num_slots else None
        if data is None:
            data = torch.empty(0, dtype=torch.uint8)
        self._send(peer, _GET_REPLY, token, 0, data)

    # ---- sending ----------------------------------------------------------------------------
    # Puts are non-blocking (as NVSHMEM's ``put_signal_nbi``): one sender thread per peer
    # drains a queue, so that a stalled peer (one whose service thread does not post its
    # receive) blocks that thread only, never the caller; ``quiet(timeout)`` waits for delivery.
    def _send(
        self, peer: int, op: int, a: int, b: int, data: torch.Tensor | None, count: int = 0
    ) -> None:
        """Queue control word ``[op, a, b, n]`` and, for a put or a get reply, the ``n`` bytes
        (``n = count`` for a get, which carries no bytes)."""
        n = count if data is None else int(data.numel())
        ctrl = torch.tensor([op, a, b, n], dtype=torch.int64)
        with self._cond:
            if peer in self._dead:
                raise PeerLost(
                    f"rank {peer} is gone ({self.errors.get(peer, 'connection closed')})"
                )
            self._pending[peer] += 1
            self._queues[peer].append((ctrl, data if data is not None and n else None))
            if self._senders[peer] is None:
                t = threading.Thread(
                    target=self._sender,
                    args=(peer,),
                    daemon=True,
                    name=f"mqnc-torchdist-{self.rank}->{peer}",
                )
                self._senders[peer] = t
                t.start()
            self._cond.notify_all()

    def _sender(self, peer: int) -> None:
        while True:
            with self._cond:
                while not self._queues[peer] and peer not in self._dead:
                    self._cond.wait()
                if peer in self._dead:
                    self._undelivered[peer] = self._pending[peer] > 0
                    self._queues[peer].clear()
                    self._pending[peer] = 0
                    self._cond.notify_all()
                    return
                ctrl, data = self._queues[peer].popleft()
            try:
                self._pg.send([ctrl], peer, _TAG_CTRL).wait()
                if data is not None:
                    self._pg.send([data], peer, _TAG_DATA).wait()
            except Exception as exc:
                with self._cond:
                    if not self._closing:
                        self.errors.setdefault(peer, f"send failed: {type(exc).__name__}: {exc}")
                    self._dead.add(peer)
                    self._cond.notify_all()
                continue
            with self._cond:
                self._pending[peer] -= 1
                self._cond.notify_all()

    def quiet(self, timeout: float | None = None, peers=None) -> None:
        """Wait until every queued put (to ``peers``, default all) has been handed to gloo.

        Raises :class:`TransportTimeout` after ``timeout`` seconds (a stalled peer) and
        :class:`PeerLost` if a peer with undelivered puts died.
        """
        deadline = None if timeout is None else self._deadline(timeout)
        peers = range(self.world_size) if peers is None else peers
        with self._cond:
            while True:
                busy = [p for p in peers if self._pending[p] > 0 and p not in self._dead]
                lost = [p for p in peers if p in self._dead and self._undelivered[p]]
                if lost:
                    raise PeerLost(f"rank {self.rank}: puts to ranks {lost} were not delivered")
                if not busy:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportTimeout(
                        f"rank {self.rank}: puts to ranks {busy} not delivered within "
                        f"{timeout:.3g} s (peer stalled)"
                    )
                self._cond.wait(left)

    def _alive_or_raise(self, peer: int) -> None:
        if peer in self._dead:
            raise PeerLost(f"rank {peer} is gone ({self.errors.get(peer, 'connection closed')})")

    # ---- the protocol -----------------------------------------------------------------------
    def put_signal(self, peer: int, slot: int, data: torch.Tensor, seq: int) -> None:
        self._check_peer(peer)
        self._check_slot(slot)
        data = check_message(data, self.slot_bytes)
        if data.device.type != "cpu":
            data = data.cpu()
        if peer == self.rank:
            with self._cond:
                self._heap[slot, : data.numel()].copy_(data)
                self._signals[slot] = max(self._signals[slot], int(seq))
                self._cond.notify_all()
            return
        self._alive_or_raise(peer)
        self._send(peer, _PUT, slot, int(seq), data)

    def signal(self, slot: int) -> int:
        return self._signals[self._check_slot(slot)]

    def wait_any(self, targets: dict[int, int], timeout: float) -> list[int]:
        for s in targets:
            self._check_slot(s)
        deadline = self._deadline(timeout)
        with self._cond:
            while True:
                ready = [s for s, q in targets.items() if self._signals[s] >= q]
                if ready:
                    return ready
                sources = {self.layout.source_of(s) for s in targets} - {self.rank}
                gone = self._dead | self._closed_peers
                if (
                    sources
                    and sources <= gone
                    and (self.rank not in {self.layout.source_of(s) for s in targets})
                ):
                    raise PeerLost(
                        f"rank {self.rank}: every awaited slot is fed by a rank that is gone "
                        f"({sorted(sources)}: "
                        f"{'; '.join(self.errors.get(p, 'closed') for p in sorted(sources))})"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout(
                        f"rank {self.rank}: no signal on slots {sorted(targets)} within "
                        f"{timeout:.3g} s"
                    )
                self._cond.wait(left)

    def read(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        self._check_slot(slot)
        n = self.slot_bytes if nbytes is None else int(nbytes)
        with self._cond:
            return self._heap[slot, :n].clone()

    def get(self, peer: int, slot: int, nbytes: int, timeout: float) -> torch.Tensor:
        self._check_peer(peer)
        self._check_slot(slot)
        if peer == self.rank:
            return self.read(slot, nbytes)
        deadline = self._deadline(timeout)
        self._alive_or_raise(peer)
        with self._get_lock:
            self._get_token += 1
            token = self._get_token
        with self._cond:
            self._gets[token] = None
        self._send(peer, _GET, slot, token, None, count=int(nbytes))
        return self._await_get(peer, token, deadline, timeout, nbytes)

    def _await_get(self, peer, token, deadline, timeout, nbytes) -> torch.Tensor:
        with self._cond:
            while self._gets.get(token) is None:
                if peer in self._dead:
                    self._gets.pop(token, None)
                    raise PeerLost(f"rank {peer} died during a get")
                left = deadline - time.monotonic()
                if left <= 0:
                    self._gets.pop(token, None)
                    raise TransportTimeout(
                        f"rank {self.rank}: get from rank {peer} timed out after {timeout:.3g} s"
                    )
                self._cond.wait(left)
            data = self._gets.pop(token)
        return data[:nbytes]

    def barrier(self, timeout: float) -> None:
        deadline = self._deadline(timeout)
        self._barrier_epoch += 1
        epoch = self._barrier_epoch
        for peer in range(self.world_size):
            if peer != self.rank:
                self._alive_or_raise(peer)
                self._send(peer, _BARRIER, epoch, 0, None)
        with self._cond:
            while True:
                missing = [
                    p
                    for p in range(self.world_size)
                    if p != self.rank and self._barrier_seen[p] < epoch
                ]
                if not missing:
                    return
                dead = [p for p in missing if p in self._dead]
                if dead:
                    raise PeerLost(f"rank {self.rank}: ranks {dead} died before the barrier")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout(
                        f"rank {self.rank}: barrier {epoch} not reached by ranks {missing} "
                        f"within {timeout:.3g} s"
                    )
                self._cond.wait(left)

    def peer_alive(self, peer: int) -> bool:
        return peer not in self._dead

    def close(self, timeout: float = 5.0) -> None:
        """Tell every live peer this rank is leaving and wait (briefly) for theirs."""
        if self._closing:
            return
        self._closing = True
        for peer in range(self.world_size):
            if peer != self.rank and peer not in self._dead:
                try:
                    self._send(peer, _CLOSE, 0, 0, None)
                except PeerLost:
                    pass
        try:
            self.quiet(timeout)
        except TransportError:
            pass  # a stalled or dead peer does not get our goodbye
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        _RETIRED.append(self._pg)
