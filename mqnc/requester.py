"""The requester: probe, route, fetch and local, with the merge and a cost record per call.

The three primitives of §2.1 differ in what crosses the fabric (§3.1-§3.2):

- :meth:`Requester.route` sends ``M_q = B * H`` absorbed query rows of one layer to the chunk's
  holder, after rotating them by the opposite of the chunk's delta so that the holder attends
  at canonical positions (§3.2, :func:`mqnc.triton_kernels.rope_rotate`), waits (with a
  timeout) for the collapsed partial ``(o, m, l)`` (§5.3) and returns it as ``(o, lse)``;
  :meth:`Requester.route_many` fans one batch out to several holders (all sends first, then
  all waits) and merges the partials in one M-way merge (§3.3);
- :meth:`Requester.fetch` pulls all ``L`` layers of a chunk and splices them into the
  requester's own paged pool at its offset, re-rotating by ``delta`` (§2.2,
  :func:`mqnc.triton_kernels.rope_splice`); :meth:`Requester.attend_local` then attends there;
- :meth:`Requester.local` re-prefills a chunk through the model when one is given (§2.1);
- :meth:`Requester.probe` times the payload-free round trip (``T_probe``).

Every call appends a :class:`CostRecord` with its terms (probe, transfer, compute, return,
merge, splice, prefill; microseconds), the samples :func:`mqnc.costmodel.fit` consumes
(:meth:`Requester.cost_samples`).

Faults (§8's "every wait has a timeout"): a route or fetch that gets no answer within
``timeout_s`` raises :class:`RouteTimeout` naming the holder, chunk and request; a holder
known dead raises :class:`~mqnc.transport.PeerLost`; a holder's ``ERROR`` answer raises
:class:`RemoteError`. :meth:`Requester.attend` applies a policy (e.g. route, then fetch from a
replica, then local) over these failures. Replies carry the request id: a reply that is not
the awaited one (duplicate, late, or for an earlier timed-out request) is discarded, so no
request is answered twice and a late answer never lands in the wrong request.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence

import torch

from mqnc import wire
from mqnc.geometry import MLAGeometry
from mqnc.transport.base import INBOX, REPLY, PeerLost, Transport, TransportError, TransportTimeout

__all__ = [
    "ChunkInfo",
    "LocalChunk",
    "Partial",
    "CostRecord",
    "RouteTimeout",
    "RemoteError",
    "AllPrimitivesFailed",
    "Requester",
]


class RouteTimeout(TransportTimeout):
    """No answer from a holder within the configured bound."""


class RemoteError(TransportError, ValueError):
    """The holder answered with an ``ERROR`` message (bad request, unknown chunk, ...)."""


class AllPrimitivesFailed(TransportError):
    """Every primitive and replica the policy allowed failed; ``errors`` lists why."""

    def __init__(self, message: str, errors: list[tuple[str, int | None, BaseException]]):
        super().__init__(message)
        self.errors = errors


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    """Where a chunk lives: its id, length, canonical position and holders (replicas first
    to last in order of preference)."""

    chunk_id: int
    tokens: int
    position: int
    holders: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LocalChunk:
    """A chunk spliced into the requester's pool at ``offset`` (blocks int32, token order)."""

    chunk_id: int
    offset: int
    tokens: int
    blocks: torch.Tensor
    source: str  # "fetch" or "local"


@dataclasses.dataclass
class CostRecord:
    """The cost terms of one call (microseconds), for the cost model's fit (§4).

    ``probe_us`` is the measured round trip for a probe, and for a route the last probe of
    that holder (NaN when never probed). ``transfer_us``: pack + put of the request;
    ``compute_us``: the holder's kernel call (reported in the reply header; for a batched
    call, the whole batch's time); ``return_us``: from the put's completion to the reply's
    arrival, less ``compute_us``; ``merge_us``, ``splice_us``, ``prefill_us``: requester-side
    work; ``total_us``: the whole call.
    """

    primitive: str
    peer: int | None
    chunk_id: int | None
    layer: int | None
    m_q: int
    bytes_sent: int
    bytes_recv: int
    probe_us: float = math.nan
    transfer_us: float = 0.0
    compute_us: float = 0.0
    return_us: float = 0.0
    merge_us: float = 0.0
    splice_us: float = 0.0
    prefill_us: float = 0.0
    total_us: float = 0.0
    ok: bool = True
    error: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Partial:
    """A partial result: ``o [B, H, d_v]`` (q's dtype) and natural-log ``lse [B, H]`` fp32,
    with how it was obtained."""

    o: torch.Tensor
    lse: torch.Tensor
    primitive: str
    peer: int | None
    record: CostRecord | None = None


@dataclasses.dataclass
class _Pending:
    peer: int
    lane: int
    seq: int
    request_id: int
    slot: int
    t0: float
    t_sent: float
    record: CostRecord
    expect: wire.Kind


def _us(t: float) -> float:
    return t * 1e6


class Requester:
    """Probe, route, fetch and local over a transport, merging partials as they come back.

    Parameters
    ----------
    transport : Transport
        This rank's endpoint.
    geometry : MLAGeometry
    softmax_scale : float
        The model's scale (for local attention over fetched chunks).
    rope : mqnc.rope.RopeSpec or None
        Needed for a route or fetch whose offset differs from the chunk's canonical position.
    timeout_s : float
        Bound on every wait for a holder's answer.
    pool_blocks : int
        Capacity of the requester's own paged pool (blocks per layer) for fetched / local
        chunks; 0 disables fetch and local.
    block_size : int
    dtype : torch.dtype
        Query and cache dtype (bf16).
    device : torch.device or str
    model : callable or None
        ``model(chunk_id, offset) -> kv [L, c_t, d_qk]``: re-prefills a chunk at ``offset``
        (what :meth:`local` runs).
    suspect_s : float
        After a holder fails, skip it in :meth:`attend` for this long.
    """

    def __init__(
        self,
        transport: Transport,
        geometry: MLAGeometry,
        *,
        softmax_scale: float,
        rope=None,
        timeout_s: float = 5.0,
        pool_blocks: int = 0,
        block_size: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        model: Callable[[int, int], torch.Tensor] | None = None,
        suspect_s: float = 30.0,
    ) -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"transport: expected a Transport, got {type(transport).__name__}")
        if not isinstance(geometry, MLAGeometry):
            raise TypeError(f"geometry: expected an MLAGeometry, got {type(geometry).__name__}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        self.transport = transport
        self.geometry = geometry
        self.softmax_scale = float(softmax_scale)
        self.rope = rope
        self.timeout_s = float(timeout_s)
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.model = model
        self.suspect_s = float(suspect_s)
        self.directory: dict[int, ChunkInfo] = {}
        self.costs: list[CostRecord] = []
        self.last_probe_us: dict[int, float] = {}
        self._suspect: dict[int, float] = {}
        layout = transport.layout
        self._lanes_free = {p: list(range(layout.lanes)) for p in range(layout.world_size)}
        self._seq: dict[tuple[int, int], int] = {}
        self._lock = threading.Condition()
        self._next_id = 1
        self.pool = (
            torch.zeros(
                geometry.layers,
                pool_blocks,
                block_size,
                geometry.d_qk,
                dtype=dtype,
                device=self.device,
            )
            if pool_blocks
            else None
        )
        self._free = list(range(pool_blocks))
        self.local_chunks: dict[tuple[int, int], LocalChunk] = {}

    # ---- directory ---------------------------------------------------------------------------
    def register(self, info: ChunkInfo) -> None:
        """Add a chunk to the directory (id -> length, canonical position, holders)."""
        if not isinstance(info, ChunkInfo):
            raise TypeError(f"info: expected a ChunkInfo, got {type(info).__name__}")
        for h in info.holders:
            self.transport._check_peer(h)
        self.directory[info.chunk_id] = info

    def _info(self, chunk_id: int) -> ChunkInfo:
        try:
            return self.directory[chunk_id]
        except KeyError:
            raise KeyError(
                f"chunk_id: chunk {chunk_id} is not in the directory (known: "
                f"{sorted(self.directory)})"
            ) from None

    # ---- lanes and request ids ---------------------------------------------------------------
    def _acquire(self, peer: int, deadline: float) -> tuple[int, int, int]:
        with self._lock:
            while not self._lanes_free[peer]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RouteTimeout(
                        f"requester {self.transport.rank}: no free lane to holder {peer} within "
                        f"{self.timeout_s:.3g} s"
                    )
                self._lock.wait(left)
            lane = self._lanes_free[peer].pop(0)
            seq = self._seq.get((peer, lane), 0) + 1
            self._seq[(peer, lane)] = seq
            rid = (self.transport.rank << 48) | self._next_id
            self._next_id += 1
            return lane, seq, rid

    def _release(self, peer: int, lane: int) -> None:
        with self._lock:
            self._lanes_free[peer].append(lane)
            self._lock.notify_all()

    def _send(
        self,
        peer: int,
        kind: wire.Kind,
        make: Callable[[int, int], torch.Tensor],
        record: CostRecord,
    ) -> _Pending:
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        lane, seq, rid = self._acquire(peer, deadline)
        try:
            buf = make(rid, seq)
            record.bytes_sent = int(buf.numel())
            inbox = self.transport.layout.slot(INBOX, self.transport.rank, lane)
            self.transport.put_signal(peer, inbox, buf, seq)
            self.transport.quiet(timeout=max(deadline - time.monotonic(), 1e-3), peers=[peer])
        except BaseException as exc:
            self._release(peer, lane)
            if isinstance(exc, TransportTimeout):
                exc = RouteTimeout(
                    f"requester {self.transport.rank}: the request to holder {peer} (chunk "
                    f"{record.chunk_id}) was not taken within {self.timeout_s:.3g} s ({exc})"
                )
            self._fail(record, exc)
            raise exc from None
        t_sent = time.perf_counter()
        record.transfer_us = _us(t_sent - t0)
        slot = self.transport.layout.slot(REPLY, peer, lane)
        return _Pending(peer, lane, seq, rid, slot, t0, t_sent, record, kind)

    def _wait(self, p: _Pending, deadline: float) -> tuple[wire.Header, torch.Tensor]:
        """Wait for the reply to ``p``; discard any reply that is not for it."""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout("deadline")
                self.transport.wait_signal(p.slot, p.seq, left)
                buf = wire.read_message(self.transport, p.slot)
                try:
                    h = wire.parse_header(buf, geometry=self.geometry, expect=p.expect)
                except wire.WireError as exc:
                    if self.transport.signal(p.slot) > p.seq:
                        raise RemoteError(f"holder {p.peer}: malformed reply ({exc})") from exc
                    time.sleep(1e-4)  # a torn or stale copy: wait for the real reply
                    continue
                if (
                    h.kind == wire.Kind.ERROR
                    and h.request_id in (0, p.request_id)
                    and (h.seq == p.seq)
                ):
                    raise RemoteError(f"holder {p.peer}: {wire.unpack_error(buf)[1]}")
                if h.request_id == p.request_id and h.seq == p.seq:
                    return h, buf
                # A duplicate or late reply for another request: harmless, keep waiting.
                time.sleep(1e-4)
        except TransportTimeout:
            p.record.ok = False
            raise RouteTimeout(
                f"requester {self.transport.rank}: no {p.expect.name} reply from holder "
                f"{p.peer} (chunk {p.record.chunk_id}, layer {p.record.layer}, request "
                f"{p.request_id:#x}, {p.record.m_q} rows) within {self.timeout_s:.3g} s"
            ) from None
        finally:
            self._release(p.peer, p.lane)

    def _fail(self, record: CostRecord, exc: BaseException) -> None:
        record.ok = False
        record.error = f"{type(exc).__name__}: {exc}"
        self.costs.append(record)
        if record.peer is not None:
            self._suspect[record.peer] = time.monotonic() + self.suspect_s

    # ---- probe -------------------------------------------------------------------------------
    def probe(self, peer: int) -> float:
        """Payload-free round trip to ``peer`` (a header-only put + signal each way); returns
        microseconds and records it (``T_probe``)."""
        self.transport._check_peer(peer)
        rec = CostRecord("probe", peer, None, None, 0, 0, 0)
        p = self._send(
            peer,
            wire.Kind.PROBE_ACK,
            lambda rid, seq: wire.pack_probe(request_id=rid, seq=seq),
            rec,
        )
        try:
            h, _ = self._wait(p, time.monotonic() + self.timeout_s)
        except BaseException as exc:
            self._fail(rec, exc)
            raise
        rt = _us(time.perf_counter() - p.t0)
        rec.bytes_recv = wire.HEADER_BYTES
        rec.probe_us = rec.total_us = rt
        self.last_probe_us[peer] = rt
        self.costs.append(rec)
        return rt

    # ---- route -------------------------------------------------------------------------------
    def _rotate(self, q: torch.Tensor, info: ChunkInfo, offset: int | None) -> torch.Tensor:
        if offset is None or offset == info.position:
            return q
        if self.rope is None:
            raise ValueError(
                f"offset: chunk {info.chunk_id} is seen at offset {offset} but cached at "
                f"{info.position}; rotating the query needs rope= (a RopeSpec)"
            )
        from mqnc.triton_kernels.splice import rope_rotate

        # The holder attends at canonical positions: rotate q by -(new - old) (§3.2).
        return rope_rotate(q, -(int(offset) - info.position), self.rope)

    def _check_q(self, q: object) -> torch.Tensor:
        g = self.geometry
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
        if q.dim() != 3 or q.shape[2] != g.d_qk:
            raise ValueError(f"q: expected shape (B, H, {g.d_qk}), got {tuple(q.shape)}")
        if q.dtype != self.dtype:
            raise TypeError(f"q: invalid dtype, expected {self.dtype}, got {q.dtype}")
        return q

    def _start_route(self, chunk_id, q, layer, offset, indices, peer) -> _Pending:
        info = self._info(chunk_id)
        q = self._check_q(q)
        if not 0 <= layer < self.geometry.layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.geometry.layers}, got {layer}")
        peer = info.holders[0] if peer is None else self.transport._check_peer(peer)
        if indices is not None and offset is not None and offset != info.position:
            raise ValueError(
                "offset: a selection (indices) attends entries at their canonical positions "
                "(§5.4); pass offset=None"
            )
        rec = CostRecord(
            "route",
            peer,
            chunk_id,
            layer,
            q.shape[0] * q.shape[1],
            0,
            0,
            probe_us=self.last_probe_us.get(peer, math.nan),
        )
        qr = self._rotate(q, info, offset).contiguous()
        idx = None if indices is None else indices.to(torch.int32).contiguous().cpu()

        def make(rid, seq):
            return wire.pack_query(
                qr.cpu(),
                request_id=rid,
                seq=seq,
                chunk_id=chunk_id,
                layer=layer,
                indices=idx,
                geometry=self.geometry,
            )

        return self._send(peer, wire.Kind.PARTIAL, make, rec)

    def _finish_route(self, p: _Pending, deadline: float) -> Partial:
        h, buf = self._wait(p, deadline)
        t_recv = time.perf_counter()
        _, o, m, l = wire.unpack_partial(buf, geometry=self.geometry)
        from mqnc.triton_kernels.merge import lse_from_ml

        rec = p.record
        rec.bytes_recv = h.nbytes
        rec.compute_us = h.holder_ns / 1e3
        rec.return_us = max(_us(t_recv - p.t_sent) - rec.compute_us, 0.0)
        rec.total_us = _us(t_recv - p.t0)
        self.costs.append(rec)
        return Partial(
            o.to(self.device).clone(), lse_from_ml(m, l).to(self.device), "route", p.peer, rec
        )

    def route(
        self,
        chunk_id: int,
        q: torch.Tensor,
        layer: int,
        *,
        offset: int | None = None,
        indices: torch.Tensor | None = None,
        peer: int | None = None,
    ) -> Partial:
        """Route ``M_q = B * H`` query rows of one layer to a holder of ``chunk_id``.

        Parameters
        ----------
        chunk_id : int
            A chunk in the directory.
        q : torch.Tensor
            ``[B, H, d_qk]`` absorbed query rows at the requester's positions, in ``dtype``.
        layer : int
            Which layer's cache to attend.
        offset : int or None
            Position of the chunk's first token in the requester's sequence; q is rotated by
            ``-(offset - position)`` before sending (§3.2). None: the canonical position.
        indices : torch.Tensor or None
            ``[B, topk]`` int chunk-local token indices of a selection (§5.4; ``-1`` unused);
            attended at canonical positions (no rotation).
        peer : int or None
            Holder to ask (default: the first in the chunk's holder list).

        Returns
        -------
        Partial
            ``o [B, H, d_v]`` in q's dtype, natural-log ``lse [B, H]`` float32.

        Raises
        ------
        RouteTimeout, PeerLost, RemoteError
        """
        p = self._start_route(chunk_id, q, layer, offset, indices, peer)
        try:
            return self._finish_route(p, time.monotonic() + self.timeout_s)
        except BaseException as exc:
            self._fail(p.record, exc)
            raise

    def route_many(
        self,
        requests: Sequence[dict],
        *,
        merge: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor] | list[Partial]:
        """Fan one query batch out to several holders and merge (§3.3, Fig. 4(a)).

        ``requests`` are keyword dicts of :meth:`route` (``chunk_id``, ``q``, ``layer`` and
        optionally ``offset``, ``indices``, ``peer``). All are sent before any is awaited.
        With ``merge`` (and the same ``[B, H]`` in every request) returns the M-way merged
        ``(o, lse)`` (one merge kernel call, its time recorded as ``merge_us`` in every
        record); otherwise the list of partials. Any failure raises after every reply has
        been awaited or timed out (no lane is left waiting).
        """
        pending: list[_Pending] = []
        errors: list[BaseException] = []
        for r in requests:
            try:
                pending.append(
                    self._start_route(
                        r["chunk_id"],
                        r["q"],
                        r["layer"],
                        r.get("offset"),
                        r.get("indices"),
                        r.get("peer"),
                    )
                )
            except BaseException as exc:
                errors.append(exc)
        deadline = time.monotonic() + self.timeout_s
        parts: list[Partial] = []
        for p in pending:
            try:
                parts.append(self._finish_route(p, deadline))
            except BaseException as exc:
                self._fail(p.record, exc)
                errors.append(exc)
        if errors:
            raise errors[0]
        if not merge:
            return parts
        o, lse, merge_us = self.merge(parts)
        for part in parts:
            part.record.merge_us = merge_us
        return o, lse

    @staticmethod
    def merge(parts: Sequence[Partial]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """M-way merge of partials over disjoint key sets: ``(o, lse, microseconds)``."""
        from mqnc.triton_kernels.merge import merge_partials

        t0 = time.perf_counter()
        o, lse = merge_partials(
            torch.stack([p.o for p in parts]), torch.stack([p.lse for p in parts])
        )
        return o, lse, _us(time.perf_counter() - t0)

    # ---- fetch and local ---------------------------------------------------------------------
    def _alloc(self, tokens: int) -> list[int]:
        if self.pool is None:
            raise ValueError("pool_blocks: this requester has no pool (pool_blocks=0)")
        nb = -(-tokens // self.block_size)
        if nb > len(self._free):
            raise ValueError(f"pool: {tokens} tokens need {nb} blocks, {len(self._free)} free")
        return [self._free.pop(0) for _ in range(nb)]

    def _slots(self, blocks: list[int], tokens: int) -> torch.Tensor:
        b = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        s = b[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)
        return s.reshape(-1)[:tokens]

    def fetch(
        self, chunk_id: int, *, offset: int | None = None, peer: int | None = None
    ) -> LocalChunk:
        """Pull all ``L`` layers of a chunk and splice them into this requester's pool at
        ``offset`` (default: the canonical position), rotating by ``offset - position``
        (§2.2). A chunk already spliced at that offset is reused."""
        info = self._info(chunk_id)
        offset = info.position if offset is None else int(offset)
        key = (chunk_id, offset)
        if key in self.local_chunks:
            return self.local_chunks[key]
        peer = info.holders[0] if peer is None else self.transport._check_peer(peer)
        rec = CostRecord(
            "fetch", peer, chunk_id, None, 0, 0, 0, probe_us=self.last_probe_us.get(peer, math.nan)
        )

        def make(rid, seq):
            return wire.pack_fetch(
                request_id=rid, seq=seq, chunk_id=chunk_id, geometry=self.geometry
            )

        p = self._send(peer, wire.Kind.CHUNK, make, rec)
        try:
            h, buf = self._wait(p, time.monotonic() + self.timeout_s)
            t_recv = time.perf_counter()
            _, kv = wire.unpack_chunk(buf, geometry=self.geometry)
            if kv.shape[1] != info.tokens or h.position != info.position:
                raise RemoteError(
                    f"holder {peer}: chunk {chunk_id} has {kv.shape[1]} tokens at position "
                    f"{h.position}, the directory says {info.tokens} at {info.position}"
                )
            rec.bytes_recv = h.nbytes
            rec.return_us = _us(t_recv - p.t_sent)
            blocks = self._alloc(info.tokens)
            t0 = time.perf_counter()
            self._splice(kv.to(self.device), blocks, offset - info.position)
            rec.splice_us = _us(time.perf_counter() - t0)
            rec.total_us = _us(time.perf_counter() - p.t0)
        except BaseException as exc:
            self._fail(rec, exc)
            raise
        self.costs.append(rec)
        lc = LocalChunk(
            chunk_id, offset, info.tokens, torch.tensor(blocks, dtype=torch.int32), "fetch"
        )
        self.local_chunks[key] = lc
        return lc

    def _splice(self, kv: torch.Tensor, blocks: list[int], delta: int) -> None:
        slots = self._slots(blocks, kv.shape[1])
        if delta == 0:
            flat = self.pool.view(self.geometry.layers, -1, self.geometry.d_qk)
            flat[:, slots] = kv
            return
        if self.rope is None:
            raise ValueError("rope: splicing at a new offset needs rope= (a RopeSpec)")
        from mqnc.triton_kernels.splice import rope_splice

        rope_splice(kv.contiguous(), self.pool, slots, int(delta), self.rope)

    def local(self, chunk_id: int, *, offset: int | None = None) -> LocalChunk:
        """Re-prefill a chunk through ``model`` at ``offset`` and write it into the pool."""
        if self.model is None:
            raise ValueError("model: local needs a model (model(chunk_id, offset) -> kv)")
        info = self._info(chunk_id)
        offset = info.position if offset is None else int(offset)
        key = (chunk_id, offset)
        if key in self.local_chunks and self.local_chunks[key].source == "local":
            return self.local_chunks[key]
        rec = CostRecord("local", None, chunk_id, None, 0, 0, 0)
        t0 = time.perf_counter()
        kv = self.model(chunk_id, offset)
        rec.prefill_us = _us(time.perf_counter() - t0)
        g = self.geometry
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != (g.layers, info.tokens, g.d_qk):
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ValueError(
                f"model: expected kv of shape ({g.layers}, {info.tokens}, {g.d_qk}), got {got}"
            )
        blocks = self._alloc(info.tokens)
        self._splice(kv.to(self.device, self.dtype), blocks, 0)
        rec.total_us = _us(time.perf_counter() - t0)
        self.costs.append(rec)
        lc = LocalChunk(
            chunk_id, offset, info.tokens, torch.tensor(blocks, dtype=torch.int32), "local"
        )
        self.local_chunks[key] = lc
        return lc

    def attend_local(
        self, lc: LocalChunk, q: torch.Tensor, layer: int, *, indices: torch.Tensor | None = None
    ) -> Partial:
        """Partial attention of ``q [B, H, d_qk]`` over a chunk in this requester's pool."""
        q = self._check_q(q).to(self.device)
        B = q.shape[0]
        if indices is None:
            from mqnc.triton_kernels.mla_decode import mla_decode_partial

            bt = lc.blocks.to(self.device)[None].expand(B, -1).contiguous()
            lens = torch.full((B,), lc.tokens, dtype=torch.int32, device=self.device)
            o, lse = mla_decode_partial(
                q,
                self.pool[layer],
                bt,
                lens,
                softmax_scale=self.softmax_scale,
                d_v=self.geometry.d_v,
            )
        else:
            from mqnc.triton_kernels.mla_sparse import mla_sparse_partial

            idx = indices.to(self.device, torch.int64)
            slots = self._slots(lc.blocks.tolist(), lc.tokens)
            pool_idx = torch.where(idx >= 0, slots[idx.clamp_min(0)], torch.full_like(idx, -1))
            o, lse = mla_sparse_partial(
                q,
                self.pool[layer],
                pool_idx.to(torch.int32),
                softmax_scale=self.softmax_scale,
                d_v=self.geometry.d_v,
            )
        return Partial(o, lse, lc.source, None)

    # ---- policy ------------------------------------------------------------------------------
    def attend(
        self,
        chunk_id: int,
        q: torch.Tensor,
        layer: int,
        *,
        offset: int | None = None,
        indices: torch.Tensor | None = None,
        order: Sequence[str] = ("route", "fetch", "local"),
    ) -> Partial:
        """Attend one chunk by the first primitive in ``order`` that succeeds.

        ``route`` and ``fetch`` try each holder of the chunk in turn (skipping holders that
        failed within ``suspect_s``, unless none is left); ``local`` needs ``model``. A chunk
        already fetched or re-prefilled at ``offset`` is attended locally at once. Raises
        :class:`AllPrimitivesFailed` listing every failure.
        """
        info = self._info(chunk_id)
        off = info.position if offset is None else int(offset)
        if indices is not None:
            off = info.position
        if (chunk_id, off) in self.local_chunks:
            return self.attend_local(self.local_chunks[(chunk_id, off)], q, layer, indices=indices)
        now = time.monotonic()
        healthy = [h for h in info.holders if self._suspect.get(h, 0.0) <= now]
        peers = healthy or list(info.holders)
        errors: list[tuple[str, int | None, BaseException]] = []
        for prim in order:
            if prim not in ("route", "fetch", "local"):
                raise ValueError(f"order: expected 'route', 'fetch' or 'local', got {prim!r}")
            if prim == "local":
                if self.model is None:
                    continue
                try:
                    lc = self.local(chunk_id, offset=off)
                    return self.attend_local(lc, q, layer, indices=indices)
                except (TransportError, ValueError) as exc:
                    errors.append(("local", None, exc))
                continue
            for peer in peers:
                try:
                    if prim == "route":
                        return self.route(
                            chunk_id,
                            q,
                            layer,
                            offset=None if indices is not None else offset,
                            indices=indices,
                            peer=peer,
                        )
                    lc = self.fetch(chunk_id, offset=off, peer=peer)
                    part = self.attend_local(lc, q, layer, indices=indices)
                    part.peer = peer
                    return part
                except (TransportError, PeerLost) as exc:
                    errors.append((prim, peer, exc))
        lines = "; ".join(f"{p}@{r}: {e}" for p, r, e in errors)
        raise AllPrimitivesFailed(f"chunk {chunk_id}: every primitive failed ({lines})", errors)

    # ---- cost samples ------------------------------------------------------------------------
    def cost_samples(self, primitive: str = "route") -> list[tuple[int, float]]:
        """``(M_q, total_us)`` of every successful call of ``primitive`` (for
        :func:`mqnc.costmodel.fit`)."""
        return [(c.m_q, c.total_us) for c in self.costs if c.primitive == primitive and c.ok]

    def shutdown(self, peer: int) -> None:
        """Ask holder ``peer`` to stop serving (no answer is awaited)."""
        lane, seq, rid = self._acquire(peer, time.monotonic() + self.timeout_s)
        try:
            inbox = self.transport.layout.slot(INBOX, self.transport.rank, lane)
            self.transport.put_signal(peer, inbox, wire.pack_shutdown(request_id=rid, seq=seq), seq)
            self.transport.quiet(timeout=self.timeout_s, peers=[peer])
        finally:
            self._release(peer, lane)
