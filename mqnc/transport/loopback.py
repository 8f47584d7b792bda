"""In-process loopback engine: every rank's slots live in one process, ranks are threads.

For unit tests and the single-process demo. A put copies the bytes into the peer's slot and
raises its signal under the peer's lock (:class:`~mqnc.transport.signals.SignalBoard`), waking
only the threads that signal satisfies; waits have timeouts, so the semantics (and every
timeout) are those of the real engines without any network. The bytes never leave the process
(``in_process``): the holder and the requester skip the payload CRC here.
:meth:`LoopbackFabric.kill` marks a rank dead (puts to it and waits on slots it feeds raise
:class:`~mqnc.transport.protocol.PeerLost`), for fault tests.

Slots are a ``[num_slots, slot_bytes]`` uint8 tensor per rank, copied in and out through its
numpy view (one ``memcpy``, no torch dispatch per message); a put takes the host numpy array
the wire packs (``array=True``) as it is and :meth:`LoopbackTransport.read_message_host` gives
one back, so a message crosses no torch call between the packer and the parser.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from mqnc.transport import wire
from mqnc.transport.protocol import (
    PeerLost,
    SlotLayout,
    Transport,
    TransportTimeout,
    host_bytes,
)
from mqnc.transport.signals import SignalBoard

__all__ = ["LoopbackFabric", "LoopbackTransport"]


class LoopbackFabric:
    """The shared state of ``world_size`` in-process ranks.

    Parameters
    ----------
    world_size : int
    slot_bytes : int
        Bytes per slot (see :func:`mqnc.transport.slot_bytes_for`).
    lanes : int
        Slots per (channel, source) pair (see :class:`~mqnc.transport.protocol.SlotLayout`).
    """

    def __init__(self, world_size: int, slot_bytes: int, lanes: int = 1) -> None:
        self.layout = SlotLayout(world_size, lanes)
        self.slot_bytes = slot_bytes
        n = self.layout.num_slots
        self._heaps = [torch.zeros(n, slot_bytes, dtype=torch.uint8) for _ in range(world_size)]
        self._views = [h.numpy() for h in self._heaps]
        self._boards = [SignalBoard(n) for _ in range(world_size)]
        self._dead: set[int] = set()
        self._closed: set[int] = set()  # ranks whose endpoint closed (a goodbye: not alive)
        self._barrier = threading.Barrier(world_size)
        self.endpoints = [LoopbackTransport(self, r) for r in range(world_size)]

    def endpoint(self, rank: int) -> LoopbackTransport:
        return self.endpoints[rank]

    def kill(self, rank: int) -> None:
        """Mark ``rank`` dead: puts to it raise, waits on slots it feeds raise PeerLost."""
        self._dead.add(rank)
        for b in self._boards:
            b.wake_all()


class LoopbackTransport(Transport):
    """One rank of a :class:`LoopbackFabric`."""

    name = "loopback"
    in_process = True

    def __init__(self, fabric: LoopbackFabric, rank: int) -> None:
        super().__init__(rank, fabric.layout, fabric.slot_bytes)
        self._fabric = fabric
        self._board = fabric._boards[rank]
        self._view = fabric._views[rank]

    def _alive_or_raise(self, peer: int) -> None:
        if peer in self._fabric._dead:
            raise PeerLost(f"rank {peer} is dead (loopback fabric)")

    def put_signal(self, peer: int, slot: int, data: torch.Tensor, seq: int) -> None:
        data = self._check_put(peer, slot, data, seq)
        dead = self._fabric._dead
        if dead:
            self._alive_or_raise(self.rank)
            self._alive_or_raise(peer)
        src = host_bytes(data)
        board = self._fabric._boards[peer]
        with board.lock:
            self._fabric._views[peer][slot, : src.shape[0]] = src
            board.raise_locked(slot, seq)
        # (No time.sleep(0) to hand the GIL to the woken thread: measured slower here.)

    def put_signal_wait(
        self,
        peer: int,
        slot: int,
        data: torch.Tensor,
        seq: int,
        targets: dict[int, int],
        timeout: float,
    ) -> list[int]:
        data = self._check_put(peer, slot, data, seq)
        self._check_targets(targets)
        deadline = self._deadline(timeout)
        if self._fabric._dead:
            self._alive_or_raise(self.rank)
            self._alive_or_raise(peer)
        src = host_bytes(data)
        board, view = self._fabric._boards[peer], self._fabric._views[peer]

        def put() -> None:
            with board.lock:
                view[slot, : src.shape[0]] = src
                board.raise_locked(slot, seq)

        return self._board.wait_any(
            targets, deadline, check=self._check_dead, rank=self.rank, timeout=timeout, first=put
        )

    def signal(self, slot: int) -> int:
        return self._board.values[self._check_slot(slot)]

    def wait_any(self, targets: dict[int, int], timeout: float) -> list[int]:
        self._check_targets(targets)
        deadline = self._deadline(timeout)
        return self._board.wait_any(
            targets, deadline, check=self._check_dead, rank=self.rank, timeout=timeout
        )

    def _check_dead(self, targets: dict[int, int]) -> None:
        if not self._fabric._dead:
            return
        sources = {self.layout.source_of(s) for s in targets}
        if sources and sources <= self._fabric._dead:
            raise PeerLost(f"every awaited slot is fed by a dead rank ({sorted(sources)})")

    def read(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        self._check_slot(slot)
        n = self.slot_bytes if nbytes is None else self._check_nbytes(nbytes)
        with self._board.lock:
            return torch.from_numpy(self._view[slot, :n].copy())

    def read_message(self, slot: int) -> tuple[int, torch.Tensor]:
        signal, a = self.read_message_host(slot)
        return signal, torch.from_numpy(a)

    def read_message_host(self, slot: int) -> tuple[int, np.ndarray]:
        if not (type(slot) is int and 0 <= slot < self.layout.num_slots):
            self._check_slot(slot)
        row = self._view[slot]
        with self._board.lock:
            return self._board.values[slot], wire.copy_message(row, self.slot_bytes)

    def get(self, peer: int, slot: int, nbytes: int, timeout: float) -> torch.Tensor:
        n = self._check_get(peer, slot, nbytes)
        self._alive_or_raise(self.rank)
        self._alive_or_raise(peer)
        with self._fabric._boards[peer].lock:
            return torch.from_numpy(self._fabric._views[peer][slot, :n].copy())

    def barrier(self, timeout: float) -> None:
        try:
            self._fabric._barrier.wait(timeout)
        except threading.BrokenBarrierError:
            raise TransportTimeout(
                f"rank {self.rank}: barrier not reached within {timeout} s"
            ) from None

    def peer_alive(self, peer: int) -> bool:
        """False once ``peer`` is dead (killed) or its endpoint has closed."""
        return peer not in self._fabric._dead and peer not in self._fabric._closed

    def close(self) -> None:
        """This rank says goodbye: the others see it gone (:meth:`peer_alive`)."""
        self._fabric._closed.add(self.rank)
