"""The transport protocol every engine implements (§3.1, §6 of the paper).

One small protocol, modelled on NVSHMEM's one-sided put-with-signal:

- every rank owns ``num_slots`` **symmetric slots** of ``slot_bytes`` bytes each (the same
  index means the same slot on every rank) and one 64-bit **signal** per slot;
- ``put_signal(peer, slot, data, seq)`` writes ``data`` into ``peer``'s slot and then raises
  ``peer``'s signal of that slot to ``seq``. Signals are **monotonically increasing sequence
  numbers** (never reset): a waiter waits for ``signal >= seq`` (NVSHMEM's ``CMP_GE``);
- ``wait_signal(slot, seq, timeout)`` / ``wait_any`` wait on local signals, always with a
  timeout, raising :class:`TransportTimeout`; a wait on a slot fed by a peer that is known
  dead raises :class:`PeerLost` at once;
- ``read(slot)`` copies a local slot out, ``get(peer, slot)`` reads a peer's slot one-sidedly;
- ``quiet()`` completes this rank's outstanding puts; ``barrier(timeout)`` synchronises all.

Slot layout. Slots are addressed by (channel, source rank, lane): channel ``INBOX`` receives
requests (probe, route, fetch) from ``source``, channel ``REPLY`` receives the answers to this
rank's requests from ``source``; ``lanes`` independent slots per (channel, source) pair let one
requester keep several requests to one holder in flight. ``slot = (channel * world + source) *
lanes + lane``. Each slot has exactly one writer (its source rank), so a slot never sees two
writers race.

Ordering and duplicates. The software engines store ``max(signal, seq)`` (a late, lower
sequence number never moves a signal back); NVSHMEM's ``SET`` is used with the same effect
because a holder answers each slot in increasing sequence order and drops a request whose
sequence number it has already answered. Request ids in the wire header (:mod:`mqnc.transport.wire`)
let a requester discard any reply that is not the one it waits for.

Writers and readers. Rank ``r`` may write only the slots whose source is ``r``
(``layout.source_of(slot) == r``): a put to any other slot is a ``ValueError`` at the sender,
and the torchdist engine also drops (and records) such a put at the receiver, so no rank can
write into the lanes of another (a misbehaving or hostile peer cannot answer for someone else).
A ``get`` obeys the same rule: rank ``r`` may read a peer's slot only where ``r`` feeds it (its
own requests in the peer's inbox, its own answers in the peer's reply lanes), and any slot of
its own; a get of another rank's lanes (another requester's query rows, the partials answered
to it) is a ``ValueError`` at the sender, and the torchdist engine refuses it at the peer too
(:class:`TransportError` at the getter).
:meth:`Transport.read_message` reads a slot's message together with the signal it was written
under, so that a reader can tie the message's sequence number to it.

Sequence numbers are u64 (``0 <= seq < 2**64``), as in the wire header.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import json
import math
import time
from collections.abc import Mapping

import numpy as np
import torch

from mqnc.base.checks import check_int, check_number
from mqnc.transport.wire import check_host_array

__all__ = [
    "SEQ_LIMIT",
    "INBOX",
    "REPLY",
    "TransportError",
    "TransportTimeout",
    "PeerLost",
    "SlotLayout",
    "Transport",
    "check_message",
    "handshake",
    "host_bytes",
    "as_tensor",
]

INBOX = 0
REPLY = 1
SEQ_LIMIT = 2**64


class TransportError(RuntimeError):
    """A transport-level failure (peer gone, protocol violation)."""


class TransportTimeout(TransportError, TimeoutError):
    """A wait ran past its timeout."""


class PeerLost(TransportError):
    """The peer feeding a slot is known to be dead (its connection closed)."""


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Slot indices of the (channel, source, lane) addressing scheme."""

    world_size: int
    lanes: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "lanes"):
            check_int(name, getattr(self, name), minimum=1)

    @functools.cached_property
    def num_slots(self) -> int:  # cached: every put and wait checks against it
        return 2 * self.world_size * self.lanes

    def slot(self, channel: int, source: int, lane: int = 0) -> int:
        if channel not in (INBOX, REPLY):
            raise ValueError(f"channel: expected INBOX (0) or REPLY (1), got {channel!r}")
        if not 0 <= source < self.world_size:
            raise ValueError(f"source: expected a rank in [0, {self.world_size}), got {source}")
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane: expected a lane in [0, {self.lanes}), got {lane}")
        return (channel * self.world_size + source) * self.lanes + lane

    def source_of(self, slot: int) -> int:
        return (slot // self.lanes) % self.world_size

    def channel_of(self, slot: int) -> int:
        return slot // (self.world_size * self.lanes)

    def lane_of(self, slot: int) -> int:
        return slot % self.lanes


def check_message(data: object, slot_bytes: int) -> torch.Tensor | np.ndarray:
    """A put's payload: a contiguous 1-D uint8 tensor, or host numpy array, of at most
    ``slot_bytes`` bytes.

    A numpy array is what the holder and the requester put on the host (the wire's packers with
    ``array=True``): every engine takes one, and the host engines copy it without a torch call
    (the host path's speed: on this 2-core VM each torch call a thread makes right after a
    hand-off cost tens of microseconds, and a loopback round trip made about eight per
    side)."""
    if isinstance(data, np.ndarray):
        check_host_array("data", data)
        if data.shape[0] > slot_bytes:
            raise ValueError(
                f"data: message of {data.shape[0]} B does not fit a slot of {slot_bytes} B "
                "(size the transport with mqnc.transport.slot_bytes_for)"
            )
        return data
    if not isinstance(data, torch.Tensor):
        raise TypeError(
            f"data: expected a torch.Tensor or numpy array of uint8, got {type(data).__name__}"
        )
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(
            f"data: expected a 1-D uint8 tensor, got dtype {str(data.dtype)[6:]} shape "
            f"{tuple(data.shape)}"
        )
    if not data.is_contiguous():
        raise ValueError("data: expected a contiguous tensor (gloo and RMA move contiguous bytes)")
    if data.numel() > slot_bytes:
        raise ValueError(
            f"data: message of {data.numel()} B does not fit a slot of {slot_bytes} B "
            "(size the transport with mqnc.transport.slot_bytes_for)"
        )
    return data


def handshake(store, rank: int, world_size: int, terms: Mapping[str, object]) -> None:
    """Agree on ``terms`` with every other rank of a fabric before it is built.

    Each rank publishes its ``terms`` (slot size, lanes, frame protocol, ...: JSON values) under
    ``terms/<rank>`` in ``store`` (a ``torch.distributed`` store, namespaced by the caller) and
    reads every other rank's, waiting up to the store's timeout. Every rank compares them all,
    so a mismatch is refused on every rank, before anything is sent.

    Raises
    ------
    ValueError
        A term on which some rank differs, naming the term, this rank's value and the other's
        (e.g. two ``slot_bytes`` from two ``--max-rows``).
    TypeError
        A term that is not a JSON value.
    TransportError
        A rank that did not publish its terms within the store's timeout.
    """
    try:
        mine = json.loads(json.dumps(dict(terms), sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"terms: expected JSON values, got {terms!r} ({exc})") from None
    store.set(f"terms/{rank}", json.dumps(mine, sort_keys=True))
    for peer in range(world_size):
        if peer == rank:
            continue
        try:
            theirs = json.loads(store.get(f"terms/{peer}"))
        except Exception as exc:  # the store's timeout (a rank that never came)
            raise TransportError(
                f"handshake: rank {rank} got no terms from rank {peer} "
                f"({type(exc).__name__}: {exc})"
            ) from None
        diff = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        if diff:
            said = "; ".join(
                f"{k}: rank {rank} (this one) has {mine.get(k)!r}, rank {peer} has "
                f"{theirs.get(k)!r}"
                for k in diff
            )
            raise ValueError(
                f"fabric: the ranks disagree ({said}); every rank of a fabric must be built "
                "with the same slot size, layout and protocol (the same --max-rows, lanes and "
                "package version)"
            )


def host_bytes(data: torch.Tensor | np.ndarray) -> np.ndarray:
    """A checked message's bytes on the host as a uint8 array (the array itself, or a host
    tensor's numpy view, or a device tensor's copy)."""
    if isinstance(data, np.ndarray):
        return data
    return (data if data.is_cpu else data.cpu()).numpy()


def as_tensor(data: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A checked message as a torch tensor (a host array wrapped without a copy)."""
    return torch.from_numpy(data) if isinstance(data, np.ndarray) else data


class Transport(abc.ABC):
    """One rank's endpoint of a symmetric-slot, put-with-signal fabric.

    Attributes
    ----------
    rank, world_size : int
    layout : SlotLayout
        Slot addressing (``layout.num_slots`` slots per rank).
    slot_bytes : int
        Capacity of every slot.
    name : str
        Engine name (``"loopback"``, ``"torchdist"``, ``"nvshmem"``), recorded with results.
    in_process : bool
        True when every rank is in this process (loopback): the bytes of a put never leave
        it, so a payload CRC is optional (the holder and the requester skip it); False for
        every engine whose bytes cross a process or a network (they require one).
    """

    name = "abstract"
    in_process = False

    def __init__(self, rank: int, layout: SlotLayout, slot_bytes: int) -> None:
        check_int("rank", rank, minimum=0, below=layout.world_size)
        check_int("slot_bytes", slot_bytes, minimum=96)  # one wire header
        self.rank = rank
        self.layout = layout
        self.world_size = layout.world_size
        self.slot_bytes = slot_bytes

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    def _check_slot(self, slot: int) -> int:
        if type(slot) is int and 0 <= slot < self.layout.num_slots:
            return slot
        return check_int("slot", slot, minimum=0, below=self.num_slots)

    def _check_nbytes(self, nbytes: object) -> int:
        """A read's or get's byte count: an int in ``[0, slot_bytes]`` (never cut to fit)."""
        if type(nbytes) is int and 0 <= nbytes <= self.slot_bytes:
            return nbytes
        return check_int("nbytes", nbytes, minimum=0, below=self.slot_bytes + 1)

    def check_peer(self, peer: int) -> int:
        """``peer`` if it is a rank of this fabric, else a ``ValueError`` naming it."""
        if type(peer) is int and 0 <= peer < self.world_size:
            return peer
        return check_int("peer", peer, minimum=0, below=self.world_size)

    def _check_put(self, peer: int, slot: int, data: object, seq: int) -> torch.Tensor:
        """The checks every engine's ``put_signal`` makes: a rank of the fabric, a slot this
        rank may write (its source is this rank), a message that fits, a u64 ``seq``."""
        self.check_peer(peer)
        if not (type(slot) is int and 0 <= slot < self.layout.num_slots):
            self._check_slot(slot)
        if self.layout.source_of(slot) != self.rank:
            raise ValueError(
                f"slot: rank {self.rank} may write only the slots whose source is itself; slot "
                f"{slot} is fed by rank {self.layout.source_of(slot)}"
            )
        if not (type(seq) is int and 0 <= seq < SEQ_LIMIT):
            check_int("seq", seq, minimum=0, below=SEQ_LIMIT)
        return check_message(data, self.slot_bytes)

    def _check_get(self, peer: int, slot: int, nbytes: object) -> int:
        """The checks every engine's ``get`` makes (the source rule of puts, for reads): a rank
        of the fabric, a slot of this rank's own or one this rank feeds on ``peer``, a byte
        count within the slot; returns the byte count."""
        self.check_peer(peer)
        self._check_slot(slot)
        if peer != self.rank and self.layout.source_of(slot) != self.rank:
            raise ValueError(
                f"slot: rank {self.rank} may get only its own slots and the slots it feeds; "
                f"slot {slot} of rank {peer} is fed by rank {self.layout.source_of(slot)}"
            )
        return self._check_nbytes(nbytes)

    # ---- the protocol -------------------------------------------------------------------------
    @abc.abstractmethod
    def put_signal(self, peer: int, slot: int, data: torch.Tensor, seq: int) -> None:
        """Write ``data`` (``[n]`` uint8 tensor or host numpy array, ``n <= slot_bytes``) into
        ``peer``'s ``slot``, then raise ``peer``'s signal of ``slot`` to ``seq``. May return
        before delivery; ``quiet`` completes it."""

    @abc.abstractmethod
    def signal(self, slot: int) -> int:
        """The current value of this rank's signal of ``slot``."""

    @abc.abstractmethod
    def wait_any(self, targets: dict[int, int], timeout: float) -> list[int]:
        """Wait until at least one ``signal(slot) >= seq`` for ``(slot, seq)`` in ``targets``;
        return every slot that satisfies it. Raises :class:`TransportTimeout` after
        ``timeout`` seconds, :class:`PeerLost` when every awaited slot's source is dead."""

    def put_signal_wait(
        self,
        peer: int,
        slot: int,
        data: torch.Tensor,
        seq: int,
        targets: dict[int, int],
        timeout: float,
    ) -> list[int]:
        """``put_signal(peer, slot, data, seq)``, then ``wait_any(targets, timeout)``: a
        request and the wait for its answer as one call. The loopback engine registers the wait
        before the put lands, so that the thread the put wakes runs at once; this
        generic form (every other engine) is the two calls in order."""
        self.put_signal(peer, slot, data, seq)
        return self.wait_any(targets, timeout)

    def wait_signal(self, slot: int, seq: int, timeout: float) -> int:
        """Wait until ``signal(slot) >= seq``; returns the signal value."""
        self.wait_any({slot: seq}, timeout)
        return self.signal(slot)

    def _check_targets(self, targets: dict[int, int]) -> None:
        n = self.layout.num_slots
        for s, q in targets.items():
            if not (type(s) is int and 0 <= s < n):
                self._check_slot(s)
            if type(q) is not int:
                check_int("seq", q)

    @abc.abstractmethod
    def read(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """A copy of the first ``nbytes`` (default all) bytes of this rank's ``slot``."""

    def read_message(self, slot: int) -> tuple[int, torch.Tensor]:
        """``(signal, message)``: a copy of the message in this rank's ``slot`` (its header,
        then exactly the length the header gives; the whole slot when the header is not a
        valid one, so that the reader's check says why) and the slot's signal, read together.

        This generic form reads the signal before and after the copy and retries (a few
        times) when a put landed in between; the software engines read both under one lock.
        """
        from mqnc.transport import wire

        self._check_slot(slot)
        for _ in range(8):
            before = self.signal(slot)
            n = wire.peek_length(self.read(slot, wire.HEADER_BYTES))
            buf = self.read(slot, n if n is not None and n <= self.slot_bytes else None)
            if self.signal(slot) == before:
                return before, buf
        return self.signal(slot), buf

    def read_message_host(self, slot: int) -> tuple[int, torch.Tensor | np.ndarray]:
        """:meth:`read_message` as a host uint8 numpy array where the engine keeps its slots
        on the host (loopback, torchdist: no torch call on the reader's path); this
        generic form returns :meth:`read_message`'s tensor as it is (every function of
        :mod:`mqnc.transport.wire` that reads a message takes either)."""
        return self.read_message(slot)

    @abc.abstractmethod
    def get(self, peer: int, slot: int, nbytes: int, timeout: float) -> torch.Tensor:
        """One-sided read of the first ``nbytes`` bytes of ``peer``'s ``slot`` (a slot this
        rank feeds there, or any slot of its own: see the module's "Writers and readers")."""

    def quiet(self, timeout: float | None = None, peers=None) -> None:  # noqa: B027
        """Complete this rank's outstanding puts (to ``peers``, default all) within
        ``timeout`` seconds (None: no bound), else raise :class:`TransportTimeout`; a no-op
        for engines whose puts complete before ``put_signal`` returns (loopback)."""

    @abc.abstractmethod
    def barrier(self, timeout: float) -> None:
        """Wait until every rank has entered the barrier (raises on timeout)."""

    def peer_alive(self, peer: int) -> bool:
        """False once ``peer`` is known dead (its connection closed)."""
        return True

    def close(self) -> None:  # noqa: B027 - engines with resources override it
        """Release the endpoint (idempotent)."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _deadline(timeout: float) -> float:
        if type(timeout) is float and 0 < timeout < math.inf:
            return time.monotonic() + timeout
        return time.monotonic() + check_number("timeout", timeout, positive=True)
