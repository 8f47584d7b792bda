"""A requester's side of the wire protocol: lanes, request ids, one send and one wait (§3.1).

Every request to a holder takes one of the ``lanes`` slots the transport keeps per
(requester, holder) pair, the lane's next sequence number (signals only increase) and a
request id drawn at random (64 bits from the OS: unpredictable, so a stray or forged reply
cannot guess it). The lanes and sequence numbers belong to the **endpoint**, not to one
requester: every :class:`RequestClient` on the same transport object shares them (two
requesters on one endpoint never reuse a lane's sequence number, which would let one take the
other's reply). A lane's next sequence number also moves past its reply slot's signal, so a
signal pushed ahead (by a misbehaving holder) costs at most one timeout, never a lane.

:meth:`RequestClient.send` puts the packed message into the holder's inbox slot (the engine
sends it without waiting for delivery); :meth:`RequestClient.wait` waits, with a timeout, for
the reply in this rank's reply slot of that lane and returns it only if it answers this
request: its header's request id and sequence number are the request's, and its payload CRC
was checked whenever the bytes crossed a process (``Transport.in_process`` False).

Faults (§8's "every wait has a timeout"): no answer within ``timeout_s`` raises
:class:`RouteTimeout` naming the holder, chunk and request; a holder's ``ERROR`` answer, or a
malformed message under the request's own sequence number, raises :class:`RemoteError`; a
reply that is not the awaited one (duplicate, late, or for an earlier timed-out request) is
skipped. A put under the same sequence number does not raise a signal again, so after
skipping a message the wait re-reads the slot with a backoff (100 us doubling to 20 ms): it
never spins a core, and it still finds the real reply when it lands.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
import weakref
from collections.abc import Callable

import torch

from mqnc.base import stamps
from mqnc.model.geometry import MLAGeometry
from mqnc.serving.records import CostRecord
from mqnc.transport import wire
from mqnc.transport.protocol import (
    INBOX,
    REPLY,
    SEQ_LIMIT,
    Transport,
    TransportError,
    TransportTimeout,
)

__all__ = ["RouteTimeout", "RemoteError", "Pending", "RequestClient", "us_since"]

_BACKOFF_S = (1e-4, 2e-2)  # first and longest re-read interval after a skipped message


class RouteTimeout(TransportTimeout):
    """No answer from a holder within the configured bound."""


class RemoteError(TransportError, ValueError):
    """The holder answered with an ``ERROR`` message (bad request, unknown chunk, ...), or
    with a reply this request cannot use (malformed, wrong shape)."""


def us_since(t0: float) -> float:
    """Microseconds from ``t0`` (``time.perf_counter()``) to now."""
    return (time.perf_counter() - t0) * 1e6


@dataclasses.dataclass(slots=True)
class Pending:
    """A sent request: where its reply will land and what it is.

    ``shape`` is the ``(batch, heads)`` a ``PARTIAL`` reply must have (None: not a route).
    """

    peer: int
    lane: int
    seq: int
    request_id: int
    slot: int
    t0: float
    t_sent: float
    record: CostRecord
    expect: wire.Kind
    shape: tuple[int, int] | None = None
    t0_monotonic: float = 0.0


class _Lanes:
    """The lanes of one endpoint: free lanes per peer and each lane's last sequence number."""

    def __init__(self, transport: Transport) -> None:
        layout = transport.layout
        self.free = {p: list(range(layout.lanes)) for p in range(layout.world_size)}
        self.seq: dict[tuple[int, int], int] = {}
        self.cond = threading.Condition(threading.Lock())
        self.waiting = 0  # threads waiting in acquire for a free lane (release notifies them)
        self._ids: list[int] = []  # request ids drawn ahead from the OS (taken under cond)
        inbox = {lane: layout.slot(INBOX, transport.rank, lane) for lane in range(layout.lanes)}
        self.inbox = inbox
        self.reply = {
            (p, lane): layout.slot(REPLY, p, lane)
            for p in range(layout.world_size)
            for lane in range(layout.lanes)
        }

    def request_id(self) -> int:
        """A new request id (the caller holds :attr:`cond`): :func:`new_request_ids` draws
        them 256 at a time, one call to the OS's randomness instead of one per request."""
        if not self._ids:
            self._ids = new_request_ids(_ID_BATCH)
        return self._ids.pop()


_ID_BATCH = 256
_ENDPOINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENDPOINTS_LOCK = threading.Lock()


def _lanes_of(transport: Transport) -> _Lanes:
    with _ENDPOINTS_LOCK:
        lanes = _ENDPOINTS.get(transport)
        if lanes is None:
            lanes = _ENDPOINTS[transport] = _Lanes(transport)
        return lanes


def new_request_id() -> int:
    """A random, non-zero 64-bit request id (``secrets``: the OS's randomness)."""
    return secrets.randbits(64) or 1


def new_request_ids(n: int) -> list[int]:
    """``n`` random, non-zero 64-bit request ids from one read of the OS's randomness."""
    raw = secrets.token_bytes(8 * n)
    return [int.from_bytes(raw[i : i + 8], "little") or 1 for i in range(0, 8 * n, 8)]


class RequestClient:
    """Lanes, request ids, send and wait for one requester rank.

    Parameters
    ----------
    transport : Transport
        This rank's endpoint (its lanes are shared with every client on it).
    geometry : MLAGeometry
        Dims every reply is checked against.
    timeout_s : float
        Bound on taking a lane and on waiting for a reply.
    """

    def __init__(self, transport: Transport, geometry: MLAGeometry, timeout_s: float) -> None:
        self.transport = transport
        self.geometry = geometry
        self.timeout_s = timeout_s
        self.crc = not transport.in_process
        self._lanes = _lanes_of(transport)
        self._layout = transport.layout

    @property
    def rank(self) -> int:
        return self.transport.rank

    # ---- lanes and request ids ---------------------------------------------------------------
    def acquire(self, peer: int, deadline: float) -> tuple[int, int, int]:
        """A free lane to ``peer``, its next sequence number and a new request id."""
        lanes = self._lanes
        with lanes.cond:
            free = lanes.free[peer]
            while not free:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RouteTimeout(
                        f"requester {self.rank}: no free lane to holder {peer} within "
                        f"{self.timeout_s:.3g} s"
                    )
                lanes.waiting += 1
                try:
                    lanes.cond.wait(left)
                finally:
                    lanes.waiting -= 1
            lane = free.pop(0)
            reply_signal = self.transport.signal(lanes.reply[(peer, lane)])
            seq = max(lanes.seq.get((peer, lane), 0), reply_signal) + 1
            if seq >= SEQ_LIMIT:
                free.append(lane)
                raise TransportError(
                    f"requester {self.rank}: holder {peer} pushed lane {lane}'s reply signal to "
                    f"{reply_signal}, the end of the sequence space: the lane is unusable"
                )
            lanes.seq[(peer, lane)] = seq
            return lane, seq, lanes.request_id()

    def release(self, peer: int, lane: int) -> None:
        lanes = self._lanes
        with lanes.cond:
            lanes.free[peer].append(lane)
            if lanes.waiting:
                lanes.cond.notify()

    # ---- send and wait -----------------------------------------------------------------------
    def send(
        self,
        peer: int,
        kind: wire.Kind,
        make: Callable[[int, int], torch.Tensor],
        record: CostRecord,
        shape: tuple[int, int] | None = None,
    ) -> Pending:
        """Pack (``make(request_id, seq)``) and put a request expecting a ``kind`` reply; its
        pack + put time is ``record.transfer_us``. On failure the lane is released."""
        t0, t0_mono = time.perf_counter(), time.monotonic()
        lane, seq, rid = self.acquire(peer, t0_mono + self.timeout_s)
        try:
            buf = make(rid, seq)
            record.bytes_sent = len(buf)
            if stamps.ON:
                stamps.stamp("req.packed")
            self.transport.put_signal(peer, self._lanes.inbox[lane], buf, seq)
            if stamps.ON:
                stamps.stamp("req.put")
        except BaseException:
            self.release(peer, lane)
            raise
        t_sent = time.perf_counter()
        record.transfer_us = (t_sent - t0) * 1e6
        slot = self._lanes.reply[(peer, lane)]
        return Pending(peer, lane, seq, rid, slot, t0, t_sent, record, kind, shape, t0_mono)

    def call(
        self,
        peer: int,
        kind: wire.Kind,
        make: Callable[[int, int], torch.Tensor],
        record: CostRecord,
        shape: tuple[int, int] | None = None,
    ) -> tuple[Pending, wire.Header, torch.Tensor]:
        """:meth:`send` and :meth:`wait` as one request: ``(pending, header, buf)``. The put and
        the wait for its reply go to the engine together (``Transport.put_signal_wait``), so
        that the holder the put wakes runs at once; ``record.transfer_us`` is then the packing
        time (the put belongs to the round trip)."""
        t0, t0_mono = time.perf_counter(), time.monotonic()
        deadline = t0_mono + self.timeout_s
        lane, seq, rid = self.acquire(peer, deadline)
        slot = self._lanes.reply[(peer, lane)]
        try:
            buf = make(rid, seq)
        except BaseException:
            self.release(peer, lane)
            raise
        record.bytes_sent = len(buf)
        t_sent = time.perf_counter()
        record.transfer_us = (t_sent - t0) * 1e6
        p = Pending(peer, lane, seq, rid, slot, t0, t_sent, record, kind, shape, t0_mono)
        if stamps.ON:
            stamps.stamp("req.packed")
            stamps.stamp("req.put")
        try:
            self.transport.put_signal_wait(
                peer, self._lanes.inbox[lane], buf, seq, {slot: seq}, self.timeout_s
            )
        except TransportTimeout:
            pass  # no reply: wait() raises RouteTimeout with the request's details
        except BaseException:
            self.release(peer, lane)
            raise
        return (p, *self.wait(p, deadline))

    def wait(self, p: Pending, deadline: float) -> tuple[wire.Header, torch.Tensor]:
        """Wait for the reply to ``p``; skip any message that does not answer it."""
        tr = self.transport
        pause = _BACKOFF_S[0]
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout("deadline")
                if tr.signal(p.slot) < p.seq:
                    tr.wait_signal(p.slot, p.seq, left)
                if stamps.ON:
                    stamps.stamp("req.woke")
                signal, buf = tr.read_message_host(p.slot)
                h = self._parse(p, signal, buf)
                if h is not None:
                    if stamps.ON:
                        stamps.stamp("req.parsed")
                    return h, buf
                time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
                pause = min(2 * pause, _BACKOFF_S[1])
        except TransportTimeout:
            p.record.ok = False
            raise RouteTimeout(
                f"requester {self.rank}: no {p.expect.name} reply from holder "
                f"{p.peer} (chunk {p.record.chunk_id}, layer {p.record.layer}, request "
                f"{p.request_id:#x}, {p.record.m_q} rows) within {self.timeout_s:.3g} s"
            ) from None
        finally:
            self.release(p.peer, p.lane)

    def _parse(self, p: Pending, signal: int, buf: torch.Tensor) -> wire.Header | None:
        """The reply's header if ``buf`` answers ``p``; None for a message to skip."""
        try:
            h = wire.parse_header(
                buf, geometry=self.geometry, expect=p.expect, require_payload_crc=self.crc
            )
        except wire.WireError as exc:
            if signal == p.seq:  # the message written under this request's number is bad
                raise RemoteError(f"holder {p.peer}: malformed reply ({exc})") from exc
            return None  # a later write's debris: the reply may still land
        if h.seq != p.seq:
            return None  # a late reply to an earlier request, or a later write
        if h.kind == wire.Kind.ERROR and h.request_id in (0, p.request_id):
            raise RemoteError(f"holder {p.peer}: {wire.unpack_error(buf)[1]}")
        if h.request_id != p.request_id:
            return None  # a duplicate or stray message under this number
        return h

    def post(self, peer: int, make: Callable[[int, int], torch.Tensor]) -> None:
        """Put a message that gets no answer (``SHUTDOWN``), delivered within the timeout."""
        lane, seq, rid = self.acquire(peer, time.monotonic() + self.timeout_s)
        try:
            inbox = self._layout.slot(INBOX, self.rank, lane)
            self.transport.put_signal(peer, inbox, make(rid, seq), seq)
            self.transport.quiet(timeout=self.timeout_s, peers=[peer])
        finally:
            self.release(peer, lane)
