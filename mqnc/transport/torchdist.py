"""Multi-process engine over ``torch.distributed`` (gloo; CPU tensors, any machine).

One-sided put-with-signal emulated with two-sided messages: every rank runs one **service
thread per peer** that receives that peer's messages and turns them into the protocol's
effects (make the bytes the slot's content, then raise its signal; answer a ``get``; count a
barrier). A put is ONE gloo message (a 32-byte frame and the data) sent from the calling thread
into a receive the peer always keeps posted (:mod:`mqnc.transport._gloo`).

Facts this engine is built on (torch 2.13, gloo):

- a gloo wait that times out **closes the pair** ("Application timeout caused pair
  closure"): a timed wait cannot be used to poll, and ``Work.is_completed`` stays False until
  someone waits. So no gloo wait here has a short timeout: the service threads block in
  ``recv`` (bounded only by ``idle_timeout_s``, the process group's timeout, default 1 h,
  passed explicitly instead of gloo's 30 min default), a reaper thread per peer waits on the
  sends, and every user-facing timeout (``wait_signal``, ``get``, ``barrier``, ``quiet``) is a
  wait on local state;
- gloo's send is a rendezvous: the bytes move once the receiver has posted its receive, so
  each service thread keeps two receives posted (a put never waits for the receiver's thread);
- a peer process that dies closes its TCP connections: the service thread's ``recv`` raises
  at once, the peer is marked dead, and waits on slots it feeds raise
  :class:`~mqnc.transport.protocol.PeerLost` without waiting for their timeout;
- gloo moves contiguous tensors only; bf16 moves bit-exactly (the wire sends uint8 anyway);
- a message longer than the receive it lands in aborts the receiving process inside gloo
  (no exception reaches Python): before the process group is built the ranks agree, in a
  handshake on the store (:func:`~mqnc.transport.protocol.handshake`), on the slot size, the
  layout (world size, lanes) and the frame protocol, and refuse a mismatch naming both
  sides; every receive is then the largest frame any member may send, and the sender refuses
  a longer one (:mod:`mqnc.transport._gloo`). A member that bypasses the engine and hands
  gloo a longer message itself still aborts its receiver: members are trusted not to;
- ports and addresses: :func:`free_port_store` listens on the address it is given (a socket
  bound there, handed to the ``TCPStore``; the store's own default listens on every
  interface), and ``host=`` binds gloo's pairs to an address (:meth:`TorchDistTransport.connect`
  passes the store's). ``torch.distributed`` authenticates nobody: see docs/serving.md, "Security
  and trust model".

The process group is built directly (``ProcessGroupGloo(store, rank, world, options)``), not
through ``init_process_group``, so that no global default group is created (a test process
can hold several engines, and nothing else in the process is affected).

A rank that died cannot be replaced by a new process under the same rank: its peers' process
groups hold the dead pair (gloo has no reconnect). Start a new fabric (a new store prefix)
instead; a holder's replacement joins that.

NCCL is not used: the service-thread design needs a receive that a thread can block in for
an unbounded time per peer, which NCCL's GPU-stream semantics do not give; on GPUs the
NVSHMEM engine (:mod:`mqnc.transport.nvshmem`) is the one-sided path. CUDA tensors passed to
``put_signal`` are staged through host memory.
"""

from __future__ import annotations

import datetime
import re
import socket
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from mqnc.transport import wire
from mqnc.transport._gloo import (
    BARRIER,
    CLOSE,
    FRAME,
    GET,
    PROTOCOL,
    PUT,
    REFUSED,
    Inbox,
    Outbox,
    PeerState,
)
from mqnc.transport.protocol import (
    PeerLost,
    SlotLayout,
    Transport,
    TransportError,
    TransportTimeout,
    handshake,
    host_bytes,
)
from mqnc.transport.signals import SignalBoard

__all__ = ["TorchDistTransport", "free_port_store", "gloo_available"]

# Process groups whose service threads may still be blocked in recv at close(): kept alive
# until the process exits, so that no destructor runs under a blocked C++ receive.
_RETIRED: list = []


def gloo_available() -> bool:
    """True when this torch build has ``torch.distributed`` with the gloo backend."""
    return dist.is_available() and hasattr(dist, "ProcessGroupGloo")


def free_port_store(world_size: int, timeout_s: float = 60.0, host: str = "127.0.0.1"):
    """A master ``TCPStore`` listening on ``host`` (default the loopback interface only) at a
    free port: ``store.port`` is what workers join.

    The store's own listener binds every interface whatever host it is given; here a socket
    bound to ``host`` is handed to it (``master_listen_fd``), so that nothing outside that
    address can reach it (a store accepts any client: see the trust model in docs/serving.md).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=sock.detach(),
        )
    finally:
        sock.close()


def _process_group(store, prefix: str, rank: int, world_size: int, host, timeout_s: float):
    """The gloo process group, formed within ``timeout_s`` (its pairs connecting through the
    store); a rank that never connects is a ``TransportTimeout`` naming it (the store keys
    gloo waited for end in the missing ranks)."""
    timeout = datetime.timedelta(seconds=float(timeout_s))
    if host is None:
        opts = timeout
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    try:
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, opts)
    except Exception as exc:  # (DistStoreError: "wait timeout ..., keys: /prefix/0/<rank>")
        keys = re.search(r"keys?:\s*(.*)", str(exc))
        missing = (
            sorted({int(k) for k in re.findall(r"/(\d+)\b(?![/\d])", keys.group(1))})
            if keys
            else []
        )
        who = f"rank(s) {missing}" if missing else "a rank"
        raise TransportTimeout(
            f"rank {rank}: the gloo process group did not form within {timeout_s:g} s: "
            f"{who} passed the handshake and never connected (left, or stalled); "
            f"gloo: {str(exc).splitlines()[0][:300]}"
        ) from None


class TorchDistTransport(Transport):
    """One rank of the gloo engine.

    Parameters
    ----------
    rank, world_size : int
    store : torch.distributed.Store
        Rendezvous store shared by all ranks (e.g. a ``TCPStore``; see
        :func:`free_port_store`). A ``PrefixStore`` with ``prefix`` is layered on it.
    slot_bytes : int
        Bytes per slot (see :func:`mqnc.transport.slot_bytes_for`); the same on every rank:
        the ranks agree on it (and on ``lanes``, the world size and the frame protocol) in a
        handshake on the store before the process group is built, and every rank refuses a
        mismatch (``ValueError`` naming the term and both ranks' values).
    lanes : int
        Slots per (channel, source) pair.
    agree : mapping or None
        Further terms (JSON values) every rank must be built with, checked in the same
        handshake (e.g. the model geometry the slots were sized from).
    idle_timeout_s : float
        The longest a service thread may sit in one ``recv`` (an idle link) or a send may take
        before the pair is given up. User-facing waits have their own, short timeouts.
    connect_timeout_s : float
        The longest the process group may take to form once every rank has passed the
        handshake (its pairs connecting through the store): a rank that passed it and then left
        ends the build with a ``TransportTimeout`` naming it, instead of holding every other
        rank for ``idle_timeout_s``.
    prefix : str
        Store namespace (several engines may share one store).
    host : str or None
        Address gloo's pairs listen on (``"127.0.0.1"``: this machine only); None keeps
        torch's default (``GLOO_SOCKET_IFNAME``, else the host name's address).
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
        connect_timeout_s: float = 300.0,
        prefix: str = "mqnc",
        host: str | None = None,
        agree=None,
    ) -> None:
        super().__init__(rank, SlotLayout(world_size, lanes), slot_bytes)
        if not gloo_available():
            raise RuntimeError("torchdist: this torch build has no gloo backend")
        terms = {
            "engine": self.name,
            "protocol": PROTOCOL,
            "wire": wire.VERSION,
            "frame_bytes": FRAME,
            "world_size": world_size,
            "lanes": lanes,
            "slot_bytes": slot_bytes,
        }
        if agree is not None:
            clash = sorted(set(agree) & set(terms))
            if clash:
                raise ValueError(f"agree: the engine's own terms {clash} are not the caller's")
            terms.update(agree)
        handshake(dist.PrefixStore(f"{prefix}/handshake", store), rank, world_size, terms)
        self._pg = _process_group(store, prefix, rank, world_size, host, connect_timeout_s)
        self._board = SignalBoard(self.num_slots)
        self._peers = PeerState(self._board)
        self._cond = self._peers.cond  # get and barrier waits; signal waits are the board's
        self._outbox = Outbox(self._pg, rank, world_size, self._peers, slot_bytes, idle_timeout_s)
        self._inbox = Inbox(
            self._pg, rank, world_size, self.layout, slot_bytes, self._peers, self._outbox
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
        """Join the ``TCPStore`` at ``host:port`` as a client and build the engine (gloo's
        pairs bound to ``host`` too, unless ``kwargs`` names another ``host``)."""
        store = dist.TCPStore(
            host,
            int(port),
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=store_timeout_s),
        )
        kwargs.setdefault("host", host)
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
        data = host_bytes(self._check_put(peer, slot, data, seq))
        if peer == self.rank:
            self._inbox.deliver(slot, data, seq)
            return
        self._outbox.send(peer, PUT, slot, seq, data)

    def signal(self, slot: int) -> int:
        return self._board.values[self._check_slot(slot)]

    def wait_any(self, targets: dict[int, int], timeout: float) -> list[int]:
        self._check_targets(targets)
        deadline = self._deadline(timeout)
        return self._board.wait_any(
            targets, deadline, check=self._check_gone, rank=self.rank, timeout=timeout
        )

    def _check_gone(self, targets: dict[int, int]) -> None:
        if not (self._peers.dead or self._peers.closed):
            return
        feeders = {self.layout.source_of(s) for s in targets}
        sources = feeders - {self.rank}
        gone = self._peers.dead | self._peers.closed
        if sources and sources <= gone and self.rank not in feeders:
            why = "; ".join(self.errors.get(p, "closed") for p in sorted(sources))
            raise PeerLost(
                f"rank {self.rank}: every awaited slot is fed by a rank that is gone "
                f"({sorted(sources)}: {why})"
            )

    def read(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        self._check_slot(slot)
        n = self.slot_bytes if nbytes is None else self._check_nbytes(nbytes)
        with self._board.lock:
            return torch.from_numpy(self._inbox.views[slot][:n].copy())

    def read_message(self, slot: int) -> tuple[int, torch.Tensor]:
        signal, a = self.read_message_host(slot)
        return signal, torch.from_numpy(a)

    def read_message_host(self, slot: int) -> tuple[int, np.ndarray]:
        if not (type(slot) is int and 0 <= slot < self.layout.num_slots):
            self._check_slot(slot)
        with self._board.lock:
            row = self._inbox.views[slot]
            return self._board.values[slot], wire.copy_message(row, self.slot_bytes)

    def get(self, peer: int, slot: int, nbytes: int, timeout: float) -> torch.Tensor:
        n = self._check_get(peer, slot, nbytes)  # before a token is registered
        if peer == self.rank:
            return self.read(slot, n)
        return self._get_remote(peer, slot, n, timeout)

    def _get_remote(self, peer: int, slot: int, n: int, timeout: float) -> torch.Tensor:
        """A get's round trip (the arguments checked): a GET frame, then its reply; a reply
        "refused" (the peer's source rule) is a :class:`TransportError`."""
        deadline = self._deadline(timeout)
        self._peers.alive_or_raise(peer)
        with self._get_lock:
            self._get_token += 1
            token = self._get_token
        gets = self._inbox.gets
        with self._cond:
            gets[token] = None
        self._outbox.send(peer, GET, slot, token, None, count=n)
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
        if isinstance(data, int) and data == REFUSED:
            raise TransportError(
                f"rank {peer} refused rank {self.rank}'s get of slot {slot} (fed by rank "
                f"{self.layout.source_of(slot)}: a rank reads only the slots it feeds)"
            )
        return data[:n]

    def barrier(self, timeout: float) -> None:
        deadline = self._deadline(timeout)
        self._barrier_epoch += 1
        epoch = self._barrier_epoch
        others = [p for p in range(self.world_size) if p != self.rank]
        for peer in others:
            self._peers.alive_or_raise(peer)
            self._outbox.send(peer, BARRIER, 0, epoch, None)
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
        """False once ``peer`` is dead (its connection broke) or has closed (said goodbye)."""
        return peer not in self._peers.dead and peer not in self._peers.closed

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
