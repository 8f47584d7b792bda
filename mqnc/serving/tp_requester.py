"""One rank of a tensor-parallel requester instance (§8): it routes its query slice to its
paired holder rank and receives its slice of ``o`` and the row's ``lse``.

Requester rank ``r`` of a TP-``N`` instance holds the columns :class:`TPPartition` gives rank
``r`` of each absorbed query row (``d_qk / N`` of them), sends only those to holder rank ``r``
of the holder instance (global rank ``instance N + r``) in the package's wire format (a ROUTE
message checked on receipt against the slice geometry, payload CRC across processes) and waits,
bounded, for the PARTIAL: ``o [B, H, d_c / N]`` and ``lse [B, H]`` (natural log; the same on
every rank of the pair). Partials from several holder instances merge exactly as single-rank
partials do (``merge_partials`` on each rank's slice: the weights depend on ``lse`` only).

The ranks of a requester instance issue the same routes in the same order (one program, ``N``
ranks), so their request ids agree: the holder group pairs its ranks' requests by (requester
instance, request id) and refuses a request whose ranks disagree. Request ids and sequence
numbers belong to the **endpoint**, not to one ``TPRequester`` (as ``client.py``'s lanes do for
single-rank routes): a second requester on the same endpoints, or one made again after a
restart of its object, continues where the first left off (a fresh one numbering from 1 again
was answered with the first one's earlier reply by the holder's duplicate rule), and a lane's
next sequence number moves past its reply slot's signal.

Faults: a reply that does not come within ``timeout_s`` is a
:class:`~mqnc.transport.protocol.TransportTimeout`; a holder rank lost mid-route is a
:class:`~mqnc.transport.protocol.PeerLost` at once (its connection closed) on the rank paired
with it, and an ``ERROR`` naming the loss (a :class:`~mqnc.serving.client.RemoteError`) on the
ranks paired with its surviving group members. Each names the holder rank, the request and the
chunk.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch

from mqnc.base.checks import check_int, check_number
from mqnc.serving.client import RemoteError
from mqnc.serving.compute import kernel_ops
from mqnc.serving.route import check_selection
from mqnc.serving.tp_group import TPPartition, check_tp_fabric
from mqnc.transport import wire
from mqnc.transport.protocol import INBOX, REPLY, PeerLost, Transport, TransportTimeout

__all__ = ["TPRequester", "payload_bytes"]


class _EndpointNumbers:
    """The route ids and each (holder, lane)'s last sequence number of one endpoint."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.route_id = 0  # route ids: the same sequence on every rank of the instance
        self.probe_id = 2**63  # probe ids, apart from the route ids
        self.seq: dict[tuple[int, int], int] = {}


_ENDPOINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENDPOINTS_LOCK = threading.Lock()


def _numbers_of(transport: Transport) -> _EndpointNumbers:
    with _ENDPOINTS_LOCK:
        numbers = _ENDPOINTS.get(transport)
        if numbers is None:
            numbers = _ENDPOINTS[transport] = _EndpointNumbers()
        return numbers


class TPRequester:
    """Rank ``rank`` of a TP requester instance.

    Parameters
    ----------
    transport : Transport
        This rank's endpoint (global rank ``instance * N + rank``).
    partition : TPPartition
        The column partition, the same as the holders'.
    dtype : torch.dtype
        The wire dtype of the query slices (the holders' cache dtype).
    timeout_s : float
        The longest a route waits for its reply.
    """

    def __init__(
        self,
        transport: Transport,
        partition: TPPartition,
        *,
        dtype: torch.dtype = torch.bfloat16,
        timeout_s: float = 30.0,
        lane: int = 0,
    ) -> None:
        n = check_tp_fabric(transport, partition)
        self.transport, self.partition = transport, partition
        self.degree, self.rank = n, transport.rank % n
        self.geometry = partition.slice_geometry
        self.dtype = dtype
        self.timeout_s = check_number("timeout_s", timeout_s, positive=True)
        self.lane = check_int("lane", lane, minimum=0, below=transport.layout.lanes)
        self._crc = not transport.in_process
        self._numbers = _numbers_of(transport)  # ids and sequence numbers: the endpoint's
        self.last_bytes = (0, 0)  # (sent, received) of the last route, headers included
        self.last_holder_ns = 0  # the holder's time on the last route (its reply's holder_ns)

    def holder_rank(self, instance: int) -> int:
        """The global rank of this rank's pair in holder instance ``instance``."""
        check_int("instance", instance, minimum=0, below=self.transport.world_size // self.degree)
        return instance * self.degree + self.rank

    def route(
        self,
        instance: int,
        chunk_id: int,
        q_slice: torch.Tensor,
        layer: int,
        indices: torch.Tensor | None = None,
        *,
        tokens: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route this rank's query slice over chunk ``chunk_id`` of holder instance
        ``instance`` (dense, or the selection ``indices``); returns ``(o [B, H, d_c / N] in the
        wire dtype, lse [B, H] float32)``, natural-log ``lse``.

        Parameters
        ----------
        q_slice : torch.Tensor
            ``[B, H, d_qk / N]``: this rank's columns of the absorbed query rows
            (:meth:`TPPartition.slice`), already rotated for the chunk's offset.
        indices : torch.Tensor or None
            ``[B, topk]`` chunk-local selection (``-1`` unused), the same on every rank.
        tokens : int or None
            The chunk's length, to check ``indices`` here (the holder checks them anyway).
        """
        peer = self.holder_rank(instance)
        q = self._check_slice(q_slice)
        B, H, w = q.shape
        idx = None
        if indices is not None:
            idx = check_selection(indices, B, 2**31 - 1 if tokens is None else tokens).numpy()
        rid, seq = self._next_numbers(peer, route=True)
        msg = wire.pack_query_arrays(
            q.cpu().contiguous().view(torch.uint8).numpy().reshape(B, -1), idx, dtype=self.dtype,
            heads=H, width=w, request_id=rid, seq=seq, chunk_id=chunk_id, layer=layer,
            crc=self._crc, array=True,
        )  # fmt: skip
        what = f"route {rid} of chunk {chunk_id} to holder rank {self.rank} (global {peer})"
        h, buf = self._call(peer, msg, seq, wire.Kind.PARTIAL, what)
        if h.kind == wire.Kind.ERROR:
            raise RemoteError(f"{what}: {wire.unpack_error(buf)[1]}")
        if h.request_id != rid or (h.batch, h.heads) != (B, H):
            raise RemoteError(
                f"{what}: reply for request {h.request_id} of shape ({h.batch}, {h.heads})"
            )
        o, lse = wire.partial_lse(buf, h)
        self.last_bytes = (int(msg.shape[0]), h.nbytes)
        self.last_holder_ns = h.holder_ns
        return o.clone(), lse

    def probe(self, instance: int) -> float:
        """Payload-free round trip (a header-only put and its acknowledgement) to this rank's
        pair in holder instance ``instance``, in microseconds (``T_probe`` of the pair)."""
        peer = self.holder_rank(instance)
        pid, seq = self._next_numbers(peer, route=False)  # (the route ids stay in step)
        msg = wire.pack_probe(request_id=pid, seq=seq, array=True)
        t0 = time.perf_counter()
        what = f"probe of holder rank {self.rank} (global {peer})"
        h, buf = self._call(peer, msg, seq, wire.Kind.PROBE_ACK, what)
        if h.kind == wire.Kind.ERROR:
            raise RemoteError(f"{what}: {wire.unpack_error(buf)[1]}")
        return (time.perf_counter() - t0) * 1e6

    def _next_numbers(self, peer: int, *, route: bool) -> tuple[int, int]:
        """The next request id (a route's, or a probe's) and ``peer``'s lane's next sequence
        number, from the endpoint's counters: past every number taken on this endpoint and past
        the reply slot's signal."""
        n = self._numbers
        reply = self.transport.layout.slot(REPLY, peer, self.lane)
        with n.lock:
            if route:
                n.route_id += 1
                rid = n.route_id
            else:
                n.probe_id += 1
                rid = n.probe_id
            key = (peer, self.lane)
            seq = max(n.seq.get(key, 0), self.transport.signal(reply)) + 1
            n.seq[key] = seq
        return rid, seq

    def _call(self, peer: int, msg, seq: int, expect: wire.Kind, what: str):
        """Put ``msg`` in ``peer``'s inbox and wait (bounded) for the reply of sequence
        ``seq``: ``(header, buffer)``, the header checked (an ``ERROR`` is returned as one)."""
        tr = self.transport
        reply = tr.layout.slot(REPLY, peer, self.lane)
        deadline = time.monotonic() + self.timeout_s
        try:
            tr.put_signal(peer, tr.layout.slot(INBOX, tr.rank, self.lane), msg, seq)
            tr.wait_signal(reply, seq, max(deadline - time.monotonic(), 1e-3))
            _, buf = tr.read_message_host(reply)
            h = wire.parse_header(
                buf, geometry=self.geometry, expect=expect, require_payload_crc=self._crc
            )
            if h.seq != seq:  # (the slot's signal passed this request's: not its reply)
                raise RemoteError(
                    f"{what}: the reply slot holds sequence {h.seq}, this request's is {seq}"
                )
            return h, buf
        except PeerLost as exc:
            raise PeerLost(f"{what}: the holder rank was lost mid-route ({exc})") from None
        except TransportTimeout as exc:
            raise TransportTimeout(
                f"{what}: no reply within {self.timeout_s:g} s ({exc})"
            ) from None

    def merge_slices(
        self, partials: list[tuple[torch.Tensor, torch.Tensor]], kernels: str = "triton"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(o, lse)`` slices from several holder instances merged into one
        (``merge_partials``, exactly as single-rank partials merge: the weights depend on
        ``lse`` alone, the same on every rank)."""
        ops = kernel_ops(kernels)
        o = torch.stack([o for o, _ in partials])
        lse = torch.stack([lse for _, lse in partials])
        return ops.merge_partials(o, lse, layout="MBHD")

    def _check_slice(self, q: object) -> torch.Tensor:
        w = self.partition.slice_width
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q_slice: expected a torch.Tensor, got {type(q).__name__}")
        if q.dim() != 3 or q.shape[2] != w or q.shape[0] * q.shape[1] == 0:
            raise ValueError(
                f"q_slice: expected this rank's slice (B, H, {w}) (d_qk / N for N = "
                f"{self.degree}; slices of different widths cannot pair), got {tuple(q.shape)}"
            )
        if q.dtype != self.dtype:
            raise TypeError(f"q_slice: invalid dtype, expected {self.dtype}, got {q.dtype}")
        return q


def payload_bytes(partition: TPPartition, rows: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(query, partial)`` payload bytes one rank moves for ``rows`` routed rows (headers not
    included): ``rows d_qk / N`` query values and ``rows (d_c / N)`` values plus 8 B of
    ``(m, l)`` a row."""
    w, dv = partition.slice_width, partition.slice_latent
    q = wire.query_payload_bytes(rows, 1, w, 0, dtype)
    p = wire.partial_payload_bytes(rows, 1, dv, dtype)
    return q, p
