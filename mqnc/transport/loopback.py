"""In-process loopback engine: every rank's slots live in one process, ranks are threads.

For unit tests and the single-process demo. A put copies the bytes into the peer's slot and
raises its signal under the peer's lock; waits are condition-variable waits with timeouts, so
the semantics (and every timeout) are those of the real engines without any network.
:meth:`LoopbackFabric.kill` marks a rank dead (puts to it and waits on slots it feeds raise
:class:`~mqnc.transport.protocol.PeerLost`), for fault tests.
"""

from __future__ import annotations

import threading
import time

import torch

from mqnc.transport.protocol import (
    PeerLost,
    SlotLayout,
    Transport,
    TransportTimeout,
    check_message,
)

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
        self._signals = [[0] * n for _ in range(world_size)]
        self._conds = [threading.Condition() for _ in range(world_size)]
        self._dead: set[int] = set()
        self._barrier = threading.Barrier(world_size)
        self.endpoints = [LoopbackTransport(self, r) for r in range(world_size)]

    def endpoint(self, rank: int) -> LoopbackTransport:
        return self.endpoints[rank]

    def kill(self, rank: int) -> None:
        """Mark ``rank`` dead: puts to it raise, waits on slots it feeds raise PeerLost."""
        self._dead.add(rank)
        for c in self._conds:
            with c:
                c.notify_all()


class LoopbackTransport(Transport):
    """One rank of a :class:`LoopbackFabric`."""

    name = "loopback"

    def __init__(self, fabric: LoopbackFabric, rank: int) -> None:
        super().__init__(rank, fabric.layout, fabric.slot_bytes)
        self._fabric = fabric

    def _alive_or_raise(self, peer: int) -> None:
        if peer in self._fabric._dead:
            raise PeerLost(f"rank {peer} is dead (loopback fabric)")

    def put_signal(self, peer: int, slot: int, data: torch.Tensor, seq: int) -> None:
        self.check_peer(peer)
        self._check_slot(slot)
        data = check_message(data, self.slot_bytes)
        self._alive_or_raise(self.rank)
        self._alive_or_raise(peer)
        f = self._fabric
        cond = f._conds[peer]
        with cond:
            f._heaps[peer][slot, : data.numel()].copy_(data.cpu())
            sig = f._signals[peer]
            sig[slot] = max(sig[slot], int(seq))
            cond.notify_all()

    def signal(self, slot: int) -> int:
        return self._fabric._signals[self.rank][self._check_slot(slot)]

    def wait_any(self, targets: dict[int, int], timeout: float) -> list[int]:
        for s in targets:
            self._check_slot(s)
        deadline = self._deadline(timeout)
        f = self._fabric
        cond, sig = f._conds[self.rank], f._signals[self.rank]
        with cond:
            while True:
                ready = [s for s, q in targets.items() if sig[s] >= q]
                if ready:
                    return ready
                sources = {self.layout.source_of(s) for s in targets}
                if sources and sources <= f._dead:
                    raise PeerLost(f"every awaited slot is fed by a dead rank ({sorted(sources)})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout(
                        f"rank {self.rank}: no signal on slots {sorted(targets)} within "
                        f"{timeout:.3g} s"
                    )
                cond.wait(left)

    def read(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        self._check_slot(slot)
        n = self.slot_bytes if nbytes is None else int(nbytes)
        with self._fabric._conds[self.rank]:
            return self._fabric._heaps[self.rank][slot, :n].clone()

    def get(self, peer: int, slot: int, nbytes: int, timeout: float) -> torch.Tensor:
        self.check_peer(peer)
        self._check_slot(slot)
        self._alive_or_raise(peer)
        with self._fabric._conds[peer]:
            return self._fabric._heaps[peer][slot, : int(nbytes)].clone()

    def barrier(self, timeout: float) -> None:
        try:
            self._fabric._barrier.wait(timeout)
        except threading.BrokenBarrierError:
            raise TransportTimeout(
                f"rank {self.rank}: barrier not reached within {timeout} s"
            ) from None

    def peer_alive(self, peer: int) -> bool:
        return peer not in self._fabric._dead
