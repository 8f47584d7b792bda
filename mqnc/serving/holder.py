"""The holder: owns chunks in a paged pool and serves probe, route and fetch (§3.1-§3.2, §6).

A holder keeps the canonical ``c_KV`` of its chunks at their canonical positions in a paged pool
``[L, num_blocks, block_size, d_qk]`` and answers, over a :class:`~mqnc.transport.Transport`:

- ``PROBE``: a header-only acknowledgement (the protocol probe, ``T_probe``);
- ``ROUTE``: the absorbed query rows of one layer; answered with the collapsed partial
  ``(o, m, l)`` in one buffer (§5.3). **Dispatcher batching** (§6.3): every route request
  that is waiting when the dispatcher wakes (all requesters, all lanes) is grouped by layer and
  kind, and each group runs as ONE partial-attention kernel call: dense rows through
  ``mla_decode_partial`` with one block-table row per query token (different chunks batch
  together), selection rows through ``mla_sparse_partial`` with chunk-local indices mapped to
  pool slots. The holder is position-oblivious: requesters rotate their queries (§3.2);
- ``FETCH``: all (or a range of) layers of a chunk, gathered from the pool and staged into the
  reply through a pool of ``K`` CUDA streams on a GPU (§6.2's K-stream staging; on the CPU the
  staging copy is a plain copy);
- ``SHUTDOWN``: stop the service loop.

The batching itself is :mod:`mqnc.serving.batching`, the paged pool :mod:`mqnc.serving.pool`.

A holder of a geometry whose ``cache_dtype`` is ``"fp8_e4m3"`` keeps its chunks as FP8 entries
(DeepSeek-V3.2's 656 bytes, ``mqnc.model.kv_format``; rows added are quantized, entries added
are checked): routes (dense and selection) run the same partial-attention kernels over the
uint8 pool, which read the entries in place; a fetch answers with the entries. A ROUTE or
FETCH whose requester said another cache format (``wire.format_flags``) is refused naming
both.

Robustness (a peer may be broken or hostile; no request of one may stop the service for the
others): every message's header is checked before its payload is used
(:func:`mqnc.transport.wire.parse_header`; the payload CRC is required whenever the bytes
crossed a process); a malformed message, a bad request (unknown chunk, index out of range, a
head count of 0 or above the model's, more rows or a wider selection than the holder's limits
``max_rows`` / ``max_topk``, an empty layer range) or any exception raised while serving one
request is answered with an ``ERROR`` message for that request alone: the service never stops
for one request. A message's header sequence number must be the one its slot was signalled
with (a message cannot claim a number its writer did not put). Each inbox slot is answered in
increasing sequence order and at most once per sequence number (a duplicated request is
dropped), so no request is answered twice. Only the ranks in ``shutdown_from`` (rank 0 by
default) may stop the holder with a ``SHUTDOWN``; any other rank's gets an ``ERROR``. What the
holder remembers per request (``stats.answered``) and per batch is bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Collection

import torch

from mqnc.base import stamps
from mqnc.base.checks import check_int, check_number
from mqnc.base.runtime import kernel_device
from mqnc.model.geometry import MLAGeometry
from mqnc.serving.batching import HostedChunk, RouteBatcher, RouteJob
from mqnc.serving.compute import check_kernels
from mqnc.serving.pool import PagedPool
from mqnc.serving.records import BoundedList, RecentCounts
from mqnc.transport import wire
from mqnc.transport.protocol import (
    INBOX,
    REPLY,
    PeerLost,
    Transport,
    TransportError,
    TransportTimeout,
    check_message,
)

__all__ = ["HostedChunk", "Holder", "HolderStats", "serve_in_thread"]


_KEEP_BATCHES = 10_000  # batch sizes kept (at least; at most twice that)
_KEEP_ANSWERED = 100_000  # request ids whose answer count is kept


def serve_in_thread(server, name: str) -> threading.Thread:
    """Start ``server.serve_forever()`` in a daemon thread called ``name`` and return it.

    Whatever the loop raises is recorded as ``server.failure`` for its owner (the thread must
    not die silently). Used by :class:`Holder` and :class:`~mqnc.serving.tp_holder.TPHolder`.
    """

    def run() -> None:
        try:
            server.serve_forever()
        except BaseException as exc:  # recorded for the owner
            server.failure = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


@dataclasses.dataclass
class HolderStats:
    """What a holder did: for tests, benchmarks and the cost model's fit.

    ``batch_rows`` / ``batch_requests`` keep the last 10,000 kernel calls (at least) and
    ``answered`` (answers per request id, 0 for an unknown id) the last 100,000 request ids:
    a holder that serves for days does not grow without bound.
    """

    probes: int = 0
    routes: int = 0
    fetches: int = 0
    errors: int = 0
    duplicates: int = 0
    kernel_calls: int = 0
    batch_rows: list[int] = dataclasses.field(default_factory=lambda: BoundedList(_KEEP_BATCHES))
    batch_requests: list[int] = dataclasses.field(
        default_factory=lambda: BoundedList(_KEEP_BATCHES)
    )
    answered: dict[int, int] = dataclasses.field(
        default_factory=lambda: RecentCounts(_KEEP_ANSWERED)
    )


class _StagingPool:
    """K CUDA streams that stage fetch replies (§6.2); inline copies on the CPU."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.k = check_int("streams", k, minimum=1)
        self._streams = (
            [torch.cuda.Stream(device=device) for _ in range(k)] if device.type == "cuda" else []
        )
        self._next = 0

    def stream(self):
        if not self._streams:
            return contextlib.nullcontext(None)
        s = self._streams[self._next % self.k]
        self._next += 1
        # The pool is written on the producer's (current) stream: gather only after it.
        s.wait_stream(torch.cuda.current_stream(s.device))
        return torch.cuda.stream(s)


class _Outbox:
    """A holder's replies: put at once, or deferred and fused with the next wait.

    In :meth:`Holder.serve_forever` each step's last reply goes out with the next step's wait
    (``Transport.put_signal_wait``): the requester it wakes runs at once. A reply that cannot be
    delivered is dropped (the requester is gone; its request times out there).
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        layout = transport.layout
        self._slots = [layout.slot(REPLY, transport.rank, lane) for lane in range(layout.lanes)]
        self._deferred: tuple | None = None
        self.defer = False

    def reply(self, src: int, lane: int, buf: torch.Tensor, seq: int) -> None:
        """Answer on ``src``'s reply slot of ``lane``: when deferring, the previous answer goes
        out now and this one with the next wait."""
        check_message(buf, self.transport.slot_bytes)  # a reply too big is an ERROR now
        reply = (src, self._slots[lane], buf, seq)
        if not self.defer:
            self._put(*reply)
            return
        self.flush()
        self._deferred = reply

    def wait(self, targets: dict[int, int], timeout: float) -> list[int]:
        """Wait for requests on ``targets``; a deferred reply is put first, fused with the wait."""
        tr, deferred = self.transport, self._deferred
        if deferred is None:
            return tr.wait_any(targets, timeout)
        self._deferred = None
        try:
            return tr.put_signal_wait(*deferred, targets, timeout)
        except PeerLost:
            if tr.peer_alive(deferred[0]):
                raise  # every requester is gone
            return tr.wait_any(targets, timeout)  # only the one that asked

    def flush(self) -> None:
        """Put the deferred reply, if any."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._put(*deferred)

    def _put(self, src: int, slot: int, buf: torch.Tensor, seq: int) -> None:
        try:
            # Non-blocking on the gloo engine (a stalled requester must not stall the holder).
            self.transport.put_signal(src, slot, buf, seq)
        except TransportError:
            pass  # the requester is gone; its request cannot be answered (it times out there)


def _limit(name: str, value: int | None, default: int) -> int:
    """A request limit: ``default`` for None; an explicit 0 is an error, not "the default"."""
    return default if value is None else check_int(name, value, minimum=1)


class Holder:
    """Serve route / fetch / probe for the chunks in a paged pool.

    Parameters
    ----------
    transport : Transport
        This rank's endpoint.
    geometry : MLAGeometry
        Dims (``d_qk``, ``d_v``, ``layers``).
    softmax_scale : float
        The model's scale (DeepSeek with YaRN: ``192**-0.5 * mscale**2``).
    num_blocks : int
        Pool capacity in blocks (per layer).
    block_size : int
        Tokens per block (64; a power of two >= 16).
    dtype : torch.dtype
        Cache dtype (bf16; fp16 / fp32 accepted). Routed rows must arrive in this dtype. With
        an FP8 geometry the cache keeps FP8 entries and ``dtype`` is the routed rows' (and the
        partials') dtype.
    device : torch.device or str or None
        Where the pool lives and the kernels run; None: :func:`mqnc.base.kernel_device` (the
        GPU when the kernels are compiled and CUDA exists, else the CPU).
    streams : int
        ``K``, the staging stream pool of fetch replies on a GPU (8 is the paper's elbow).
    batch_window_s : float
        After a wake-up, wait this long for more requests before running the batch (0: batch
        exactly what is already waiting).
    poll_s : float
        The service loop's wait granularity (how often it checks for ``stop()``).
    max_rows : int or None
        Most query rows ``B * H`` one ROUTE may ask for (default: what a slot can carry,
        ``slot_bytes // q_row_bytes``): a header cannot make the holder allocate more.
    max_topk : int or None
        Widest selection one ROUTE may carry (default: what a slot can carry).
    shutdown_from : collection of int or None
        Ranks whose ``SHUTDOWN`` stops the holder (default rank 0, the launcher's rank in
        every runner here); None lets any rank stop it.
    kernels : {"triton", "torch"}
        Partial attention by the Triton kernels or their torch references
        (:mod:`mqnc.serving.compute`).
    fold, num_splits : int or None
        Dense rows folded ``fold`` to a query row and the dense call's split count
        (:class:`~mqnc.serving.batching.RouteBatcher`; None: one query row per token, the
        plan's split count): a device holder's ``fold`` and ``num_splits`` make this holder's
        dense answers its pass's, bit for bit.
    """

    def __init__(
        self,
        transport: Transport,
        geometry: MLAGeometry,
        *,
        softmax_scale: float,
        num_blocks: int,
        block_size: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        streams: int = 8,
        batch_window_s: float = 0.0,
        poll_s: float = 0.05,
        max_rows: int | None = None,
        max_topk: int | None = None,
        shutdown_from: Collection[int] | None = (0,),
        kernels: str = "triton",
        fold: int | None = None,
        num_splits: int | None = None,
    ) -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"transport: expected a Transport, got {type(transport).__name__}")
        if not isinstance(geometry, MLAGeometry):
            raise TypeError(f"geometry: expected an MLAGeometry, got {type(geometry).__name__}")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {dtype}")
        self.transport = transport
        self.geometry = geometry
        self.softmax_scale = check_number("softmax_scale", softmax_scale, positive=True)
        self.block_size = block_size
        self.dtype = dtype
        self.device = kernel_device() if device is None else torch.device(device)
        self.batch_window_s = check_number("batch_window_s", batch_window_s, nonnegative=True)
        self.poll_s = check_number("poll_s", poll_s, positive=True)
        self._me = f"holder {transport.rank}"  # names this holder in its ERROR answers
        self.kernels = check_kernels(kernels)
        self.pages = PagedPool(
            geometry.layers,
            num_blocks,
            block_size,
            geometry.d_qk,
            dtype=dtype,
            device=self.device,
            kernels=kernels,
            fp8=geometry.fp8_layout,  # an fp8_e4m3 geometry: FP8 entries (docs/fp8-cache.md)
        )
        self.pool = self.pages.kv
        self.chunks: dict[int, HostedChunk] = {}
        self._staging = _StagingPool(streams, self.device)
        layout = transport.layout
        self._inboxes = [
            layout.slot(INBOX, src, lane)
            for src in range(layout.world_size)
            for lane in range(layout.lanes)
        ]
        self._src_lane = {s: (layout.source_of(s), layout.lane_of(s)) for s in self._inboxes}
        self._last_seq = {s: 0 for s in self._inboxes}
        self._targets = {s: 1 for s in self._inboxes}
        self._outbox = _Outbox(transport)
        self._crc = not transport.in_process
        slot_rows = max(transport.slot_bytes - wire.HEADER_BYTES, 0)  # None: what a slot holds
        self.max_rows = _limit("max_rows", max_rows, max(slot_rows // geometry.q_row_bytes, 1))
        self.max_topk = _limit("max_topk", max_topk, max(slot_rows // 4, 1))
        self.shutdown_from = None if shutdown_from is None else frozenset(shutdown_from)
        self.stats = HolderStats()
        self._batcher = RouteBatcher(
            self.pages, geometry, self.softmax_scale, self.stats, self._outbox.reply, self._error,
            self._me, crc=self._crc,
            fold=None if fold is None else check_int("fold", fold, minimum=1),
            num_splits=None if num_splits is None else check_int("num_splits", num_splits,
                                                                 minimum=1),
        )  # fmt: skip
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    # ---- the pool ---------------------------------------------------------------------------
    def add_chunk(self, chunk_id: int, kv: torch.Tensor, position: int = 0) -> HostedChunk:
        """Copy a chunk's cache ``kv [L, c_t, d_qk]`` (canonical positions from ``position``)
        into free pool blocks."""
        g = self.geometry
        position = check_int("position", position, minimum=0)
        kv = self.pages.checked_chunk(kv, g.layers, g.d_qk, self.dtype)
        if chunk_id in self.chunks:
            raise ValueError(f"chunk_id: chunk {chunk_id} is already hosted")
        blocks = self.pages.alloc(kv.shape[1])
        self.pages.write(blocks, kv)
        blocks = torch.tensor(blocks, dtype=torch.int32)
        c = HostedChunk(chunk_id, kv.shape[1], position, blocks)
        self.chunks[chunk_id] = c
        return c

    def chunk_kv(self, chunk_id: int, layers: tuple[int, int] | None = None) -> torch.Tensor:
        """Gather a hosted chunk's entries ``[n_layers, c_t, d_qk]`` from the pool."""
        c = self.chunks[chunk_id]
        return self.pages.gather(c.blocks, c.tokens, layers or (0, self.geometry.layers))

    # ---- the service loop -------------------------------------------------------------------
    def start(self) -> Holder:
        """Serve in a background thread until :meth:`stop` or a ``SHUTDOWN`` message."""
        if self._thread is not None:
            raise RuntimeError("holder: already started")
        self._thread = serve_in_thread(self, f"holder-{self.transport.rank}")
        return self

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` or a ``SHUTDOWN`` message (in the calling thread).

        Each step's last reply goes out with the next step's wait
        (``Transport.put_signal_wait``): the requester it wakes runs at once."""
        self._outbox.defer = True
        try:
            while not self._stop.is_set():
                self._step(self.poll_s)
        finally:
            self._outbox.defer = False
            self._outbox.flush()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the service loop and join its thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TransportTimeout(f"holder: service thread did not stop within {timeout} s")
            self._thread = None

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def serve_once(self, timeout: float) -> int:
        """One dispatcher step: wait up to ``timeout`` s for requests, then answer all that
        are waiting (routes batched). Returns the number of messages handled."""
        handled = self._step(timeout)
        self._outbox.flush()
        return handled

    def _step(self, timeout: float) -> int:
        tr = self.transport
        try:
            ready = self._outbox.wait(self._targets, timeout)
        except PeerLost:
            # Every requester is gone: nothing can arrive any more.
            self._stop.set()
            return 0
        except TransportTimeout:
            return 0
        if stamps.ON:
            stamps.stamp("hold.woke")
        if self.batch_window_s > 0:
            time.sleep(self.batch_window_s)
            ready = [s for s in self._inboxes if tr.signal(s) >= self._targets[s]]
        routes: list[RouteJob] = []
        handled = 0
        for slot in ready:
            handled += self._receive(slot, routes)
        if routes:
            self._batcher.answer(routes)
        return handled

    # ---- receiving --------------------------------------------------------------------------
    def _error(self, src: int, lane: int, request_id: int, seq: int, message: str) -> None:
        self.stats.errors += 1
        err = wire.pack_error(message, request_id=request_id, seq=seq, array=True)
        self._outbox.reply(src, lane, err, seq)

    def _receive(self, slot: int, routes: list[RouteJob]) -> int:
        src, lane = self._src_lane[slot]
        signal, buf = self.transport.read_message_host(slot)
        last = self._last_seq[slot]
        if signal <= last:
            return 0  # nothing new on this slot
        self._last_seq[slot] = signal
        self._targets[slot] = signal + 1
        me = self._me
        try:
            h = wire.parse_header(buf, geometry=self.geometry, require_payload_crc=self._crc)
        except wire.WireError as exc:
            # The request id cannot be trusted; answer on the slot's sequence number.
            self._error(src, lane, 0, signal, f"{me}: {exc}")
            return 1
        if h.seq <= last:
            self.stats.duplicates += 1  # already answered: a duplicate or late copy
            return 0
        if h.seq != signal:
            why = f"{me}: header sequence number {h.seq} is not the slot's signal {signal}"
            self._error(src, lane, 0, signal, why)
            return 1
        if stamps.ON:
            stamps.stamp("hold.parsed")
        try:
            self._dispatch(src, lane, h, buf, routes)
        except (wire.WireError, ValueError, TypeError, KeyError) as exc:
            self._error(src, lane, h.request_id, h.seq, f"{me}: {exc}")
        except Exception as exc:  # noqa: BLE001 - no request may stop the service
            self._error(src, lane, h.request_id, h.seq, f"{me}: {type(exc).__name__}: {exc}")
        return 1

    def _dispatch(self, src: int, lane: int, h: wire.Header, buf, routes) -> None:
        kind = h.kind
        if kind == wire.Kind.ROUTE:
            routes.append(self._check_route(src, lane, h, buf))
        elif kind == wire.Kind.PROBE:
            self.stats.probes += 1
            if stamps.ON:
                stamps.stamp("hold.computed")
            ack = wire.pack_probe(request_id=h.request_id, seq=h.seq, ack=True, array=True)
            if stamps.ON:
                stamps.stamp("hold.packed")
            self._outbox.reply(src, lane, ack, h.seq)
            if stamps.ON:
                stamps.stamp("hold.put")
        elif kind == wire.Kind.FETCH:
            self._answer_fetch(src, lane, h)
        elif kind == wire.Kind.SHUTDOWN:
            if self.shutdown_from is not None and src not in self.shutdown_from:
                raise ValueError(
                    f"SHUTDOWN: rank {src} may not stop this holder (allowed: "
                    f"{sorted(self.shutdown_from)})"
                )
            self._stop.set()
        else:
            raise wire.WireError(f"holder cannot serve a {kind.name} message")

    def _check_route(self, src: int, lane: int, h: wire.Header, buf: torch.Tensor) -> RouteJob:
        if h.chunk_id not in self.chunks:
            raise KeyError(f"chunk {h.chunk_id} is not hosted here (have {sorted(self.chunks)})")
        if h.dtype != self.dtype:
            raise wire.WireError(f"q: expected {self.dtype} rows, got {h.dtype}")
        if not (1 <= h.heads <= self.geometry.heads and h.batch >= 1):
            raise ValueError(
                f"heads: expected 1 <= heads <= {self.geometry.heads} and batch >= 1, got "
                f"{h.heads} heads x {h.batch} tokens"
            )
        if h.rows > self.max_rows or h.topk > self.max_topk:
            raise ValueError(
                f"rows: at most {self.max_rows} rows and {self.max_topk} selected entries per "
                f"request here, got {h.rows} rows and {h.topk}"
            )
        c = self.chunks[h.chunk_id]
        q, idx = wire.query_arrays(buf, h)  # numpy: the batcher stages the rows, no torch call
        if idx is not None:
            bad = (idx < -1) | (idx >= c.tokens)
            if bad.any():
                raise ValueError(
                    f"indices: expected chunk-local indices in [-1, {c.tokens}) for chunk "
                    f"{c.chunk_id}, got {idx[bad][:5].tolist()}"
                )
        return RouteJob(src, lane, h, q, idx, c)

    # ---- fetch ------------------------------------------------------------------------------
    def _answer_fetch(self, src: int, lane: int, h: wire.Header) -> None:
        if h.chunk_id not in self.chunks:
            raise KeyError(f"chunk {h.chunk_id} is not hosted here (have {sorted(self.chunks)})")
        c = self.chunks[h.chunk_id]
        need = wire.HEADER_BYTES + wire.chunk_payload_bytes(
            h.layer_hi - h.layer_lo, c.tokens, self.pages.width, self.pages.kv.dtype
        )
        if need > self.transport.slot_bytes:
            raise ValueError(
                f"layers: chunk {c.chunk_id}'s layers [{h.layer_lo}, {h.layer_hi}) are {need} B, "
                f"more than a slot's {self.transport.slot_bytes} B"
            )
        with self._staging.stream():
            kv = self.chunk_kv(h.chunk_id, (h.layer_lo, h.layer_hi))
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        buf = wire.pack_chunk(
            kv.cpu(),
            request_id=h.request_id,
            seq=h.seq,
            chunk_id=h.chunk_id,
            layers=(h.layer_lo, h.layer_hi),
            position=c.position,
            geometry=self.geometry,
            crc=self._crc,
        )
        self.stats.fetches += 1
        self.stats.answered[h.request_id] += 1
        self._outbox.reply(src, lane, buf, h.seq)
