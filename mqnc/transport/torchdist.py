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
  :class:`~mqnc.transport.protocol.PeerLost` without waiting for their timeout;
- gloo moves contiguous tensors only; bf16 moves bit-exactly (the wire sends uint8 anyway);
- ports: a ``TCPStore`` created with port 0 picks a free port (``store.port``); tests set
  ``GLOO_SOCKET_IFNAME=lo``.

The process group is built directly (``ProcessGroupGloo(store, rank, world, timeout)``), not
through ``init_process_group``, so that no global default group is created (a test process
can hold several engines, and nothing else in the process is affected).

The two halves (per-peer service threads receiving, per-peer queues and sender threads
sending) are :mod:`mqnc.transport._gloo`; this module is the protocol on top of them.

NCCL is not used: the service-thread design needs a receive that a thread can block in for
an unbounded time per peer, which NCCL's GPU-stream semantics do not give; on GPUs the
NVSHMEM engine (:mod:`mqnc.transport.nvshmem`) is the one-sided path. CUDA tensors passed to
``put_signal`` are staged through host memory.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from mqnc.transport._gloo import BARRIER, CLOSE, GET, PUT, Inbox, Outbox, PeerState
from mqnc.transport.protocol import (
    PeerLost,
    SlotLayout,
    Transport,
    TransportError,
    TransportTimeout,
    check_message,
)

__all__ = ["TorchDistTransport", "free_port_store"]

# Process groups whose service threads may still be blocked in recv at close(): kept alive
# until the process exits, so that no destructor runs under a blocked C++ receive.
_RETIRED: list = []


def free_port_store(world_size: int, timeout_s: float = 60.0, host: str = "127.0.0.1"):
    """A master ``TCPStore`` on a free port (port 0): ``store.port`` is what workers join."""
    return dist.TCPStore(
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
        super().__init__(rank, SlotLayout(world_size, lanes), slot_bytes)
        if not dist.is_available() or not hasattr(dist, "ProcessGroupGloo"):
            raise RuntimeError("torchdist: this torch build has no gloo backend")
        self._pg = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, store),
            rank,
            world_size,
            datetime.timedelta(seconds=float(idle_timeout_s)),
        )
        self._peers = PeerState()
        self._cond = self._peers.cond  # every wait below is on the inbox's state
        self._outbox = Outbox(self._pg, rank, world_size, self._peers)
        self._inbox = Inbox(
            self._pg, rank, world_size, self.num_slots, slot_bytes, self._peers, self._outbox
        )
        self.errors = self._peers.errors
        self._get_lock = threading.Lock()
        self._get_token = 0
        self._barrier_epoch = 0

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
        store = dist.TCPStore(
            host,
            int(port),
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=store_timeout_s),
        )
        return cls(rank, world_size, store, **kwargs)

    # ---- the protocol -----------------------------------------------------------------------
    def quiet(self, timeout: float | None = None, peers=None) -> None:
        """Wait until every queued put (to ``peers``, default all) has been handed to gloo.

        Raises :class:`TransportTimeout` after ``timeout`` seconds (a stalled peer) and
        :class:`PeerLost` if a peer with undelivered puts died.
        """
        deadline = None if timeout is None else self._deadline(timeout)
        self._outbox.quiet(deadline, timeout, peers)

    def put_signal(self, peer: int, slot: int, data: torch.Tensor, seq: int) -> None:
        self.check_peer(peer)
        self._check_slot(slot)
        data = check_message(data, self.slot_bytes)
        if data.device.type != "cpu":
            data = data.cpu()
        if peer == self.rank:
            self._inbox.deliver(slot, data, seq)
            return
        self._peers.alive_or_raise(peer)
        self._outbox.send(peer, PUT, slot, int(seq), data)

    def signal(self, slot: int) -> int:
        return self._inbox.signals[self._check_slot(slot)]

    def wait_any(self, targets: dict[int, int], timeout: float) -> list[int]:
        for s in targets:
            self._check_slot(s)
        deadline = self._deadline(timeout)
        feeders = {self.layout.source_of(s) for s in targets}
        sources = feeders - {self.rank}
        with self._cond:
            while True:
                ready = [s for s, q in targets.items() if self._inbox.signals[s] >= q]
                if ready:
                    return ready
                gone = self._peers.dead | self._peers.closed
                if sources and sources <= gone and self.rank not in feeders:
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
            return self._inbox.heap[slot, :n].clone()

    def get(self, peer: int, slot: int, nbytes: int, timeout: float) -> torch.Tensor:
        self.check_peer(peer)
        self._check_slot(slot)
        if peer == self.rank:
            return self.read(slot, nbytes)
        deadline = self._deadline(timeout)
        self._peers.alive_or_raise(peer)
        with self._get_lock:
            self._get_token += 1
            token = self._get_token
        gets = self._inbox.gets
        with self._cond:
            gets[token] = None
        self._outbox.send(peer, GET, slot, token, None, count=int(nbytes))
        with self._cond:
            while gets.get(token) is None:
                if peer in self._peers.dead:
                    gets.pop(token, None)
                    raise PeerLost(f"rank {peer} died during a get")
                left = deadline - time.monotonic()
                if left <= 0:
                    gets.pop(token, None)
                    raise TransportTimeout(
                        f"rank {self.rank}: get from rank {peer} timed out after {timeout:.3g} s"
                    )
                self._cond.wait(left)
            data = gets.pop(token)
        return data[:nbytes]

    def barrier(self, timeout: float) -> None:
        deadline = self._deadline(timeout)
        self._barrier_epoch += 1
        epoch = self._barrier_epoch
        others = [p for p in range(self.world_size) if p != self.rank]
        for peer in others:
            self._peers.alive_or_raise(peer)
            self._outbox.send(peer, BARRIER, epoch, 0, None)
        with self._cond:
            while True:
                missing = [p for p in others if self._inbox.barrier_seen[p] < epoch]
                if not missing:
                    return
                dead = [p for p in missing if p in self._peers.dead]
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
        return peer not in self._peers.dead

    def close(self, timeout: float = 5.0) -> None:
        """Tell every live peer this rank is leaving and wait (briefly) for theirs."""
        if self._peers.closing:
            return
        self._peers.closing = True
        for peer in range(self.world_size):
            if peer != self.rank and peer not in self._peers.dead:
                try:
                    self._outbox.send(peer, CLOSE, 0, 0, None)
                except PeerLost:
                    pass
        try:
            self.quiet(timeout)
        except TransportError:
            pass  # a stalled or dead peer does not get our goodbye
        deadline = time.monotonic() + timeout
        for t in self._inbox.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        _RETIRED.append(self._pg)
