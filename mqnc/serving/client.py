"""A requester's side of the wire protocol: lanes, request ids, one send and one wait (§3.1).

Every request to a holder takes one of the ``lanes`` slots the transport keeps per
(requester, holder) pair, the lane's next sequence number (signals only increase) and a request
id unique to this requester (``rank << 48 | n``). :meth:`RequestClient.send` puts the packed
message into the holder's inbox slot; :meth:`RequestClient.wait` waits, with a timeout, for the
reply in this rank's reply slot of that lane and returns it only if it is the awaited one.

Faults (§8's "every wait has a timeout"): no answer within ``timeout_s`` raises
:class:`RouteTimeout` naming the holder, chunk and request; a holder's ``ERROR`` answer raises
:class:`RemoteError`; a reply that is not the awaited one (duplicate, late, or for an earlier
timed-out request) is discarded, so no request is answered twice and a late answer never
lands in the wrong request.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import torch

from mqnc.model.geometry import MLAGeometry
from mqnc.serving.records import CostRecord
from mqnc.transport import wire
from mqnc.transport.protocol import INBOX, REPLY, Transport, TransportError, TransportTimeout

__all__ = ["RouteTimeout", "RemoteError", "Pending", "RequestClient", "us_since"]


class RouteTimeout(TransportTimeout):
    """No answer from a holder within the configured bound."""


class RemoteError(TransportError, ValueError):
    """The holder answered with an ``ERROR`` message (bad request, unknown chunk, ...)."""


def us_since(t0: float) -> float:
    """Microseconds from ``t0`` (``time.perf_counter()``) to now."""
    return (time.perf_counter() - t0) * 1e6


@dataclasses.dataclass
class Pending:
    """A sent request: where its reply will land and what it is."""

    peer: int
    lane: int
    seq: int
    request_id: int
    slot: int
    t0: float
    t_sent: float
    record: CostRecord
    expect: wire.Kind


class RequestClient:
    """Lanes, request ids, send and wait for one requester rank.

    Parameters
    ----------
    transport : Transport
        This rank's endpoint.
    geometry : MLAGeometry
        Dims every reply is checked against.
    timeout_s : float
        Bound on taking a lane, on delivering a request and on waiting for its reply.
    """

    def __init__(self, transport: Transport, geometry: MLAGeometry, timeout_s: float) -> None:
        self.transport = transport
        self.geometry = geometry
        self.timeout_s = timeout_s
        layout = transport.layout
        self._lanes_free = {p: list(range(layout.lanes)) for p in range(layout.world_size)}
        self._seq: dict[tuple[int, int], int] = {}
        self._lock = threading.Condition()
        self._next_id = 1

    @property
    def rank(self) -> int:
        return self.transport.rank

    # ---- lanes and request ids ---------------------------------------------------------------
    def acquire(self, peer: int, deadline: float) -> tuple[int, int, int]:
        """A free lane to ``peer``, its next sequence number and a new request id."""
        with self._lock:
            while not self._lanes_free[peer]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RouteTimeout(
                        f"requester {self.rank}: no free lane to holder {peer} within "
                        f"{self.timeout_s:.3g} s"
                    )
                self._lock.wait(left)
            lane = self._lanes_free[peer].pop(0)
            seq = self._seq.get((peer, lane), 0) + 1
            self._seq[(peer, lane)] = seq
            rid = (self.rank << 48) | self._next_id
            self._next_id += 1
            return lane, seq, rid

    def release(self, peer: int, lane: int) -> None:
        with self._lock:
            self._lanes_free[peer].append(lane)
            self._lock.notify_all()

    # ---- send and wait -----------------------------------------------------------------------
    def send(
        self,
        peer: int,
        kind: wire.Kind,
        make: Callable[[int, int], torch.Tensor],
        record: CostRecord,
    ) -> Pending:
        """Pack (``make(request_id, seq)``) and put a request expecting a ``kind`` reply; its
        pack + put time is ``record.transfer_us``. On failure the lane is released and a
        delivery timeout becomes :class:`RouteTimeout`."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        lane, seq, rid = self.acquire(peer, deadline)
        try:
            buf = make(rid, seq)
            record.bytes_sent = int(buf.numel())
            inbox = self.transport.layout.slot(INBOX, self.rank, lane)
            self.transport.put_signal(peer, inbox, buf, seq)
            self.transport.quiet(timeout=max(deadline - time.monotonic(), 1e-3), peers=[peer])
        except BaseException as exc:
            self.release(peer, lane)
            if isinstance(exc, TransportTimeout):
                raise RouteTimeout(
                    f"requester {self.rank}: the request to holder {peer} (chunk "
                    f"{record.chunk_id}) was not taken within {self.timeout_s:.3g} s ({exc})"
                ) from None
            raise
        t_sent = time.perf_counter()
        record.transfer_us = (t_sent - t0) * 1e6
        slot = self.transport.layout.slot(REPLY, peer, lane)
        return Pending(peer, lane, seq, rid, slot, t0, t_sent, record, kind)

    def wait(self, p: Pending, deadline: float) -> tuple[wire.Header, torch.Tensor]:
        """Wait for the reply to ``p``; discard any reply that is not for it."""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout("deadline")
                self.transport.wait_signal(p.slot, p.seq, left)
                buf = wire.read_message(self.transport, p.slot)
                h = self._parse(p, buf)
                if h is not None:
                    return h, buf
                time.sleep(1e-4)  # a torn, stale, duplicate or late copy: wait for the real one
        except TransportTimeout:
            p.record.ok = False
            raise RouteTimeout(
                f"requester {self.rank}: no {p.expect.name} reply from holder "
                f"{p.peer} (chunk {p.record.chunk_id}, layer {p.record.layer}, request "
                f"{p.request_id:#x}, {p.record.m_q} rows) within {self.timeout_s:.3g} s"
            ) from None
        finally:
            self.release(p.peer, p.lane)

    def _parse(self, p: Pending, buf: torch.Tensor) -> wire.Header | None:
        """The reply's header if ``buf`` is the reply to ``p``; None for a copy to skip."""
        try:
            h = wire.parse_header(buf, geometry=self.geometry, expect=p.expect)
        except wire.WireError as exc:
            if self.transport.signal(p.slot) > p.seq:
                raise RemoteError(f"holder {p.peer}: malformed reply ({exc})") from exc
            return None  # a torn or stale copy
        if h.kind == wire.Kind.ERROR and h.request_id in (0, p.request_id) and h.seq == p.seq:
            raise RemoteError(f"holder {p.peer}: {wire.unpack_error(buf)[1]}")
        if h.request_id == p.request_id and h.seq == p.seq:
            return h
        return None  # a duplicate or late reply for another request: harmless

    def post(self, peer: int, make: Callable[[int, int], torch.Tensor]) -> None:
        """Put a message that gets no answer (``SHUTDOWN``), within the timeout."""
        lane, seq, rid = self.acquire(peer, time.monotonic() + self.timeout_s)
        try:
            inbox = self.transport.layout.slot(INBOX, self.rank, lane)
            self.transport.put_signal(peer, inbox, make(rid, seq), seq)
            self.transport.quiet(timeout=self.timeout_s, peers=[peer])
        finally:
            self.release(peer, lane)
