"""One rank of a tensor-parallel holder instance (§8): it keeps its column slice of every chunk,
serves the query slices its paired requester ranks route to it, and completes the attention
with its group (partial scores, one all-reduce inside the instance, softmax and its slice of
``o``).

Fabric: every rank of every instance is one rank of one transport fabric, instance ``i``'s rank
``r`` at global rank ``i N + r`` (the same ``N`` on every instance). Requester rank ``r`` of any
instance routes only to holder rank ``r``; a ROUTE from a rank of another index is refused
(ranks of two groups mismatched).

Agreement before each reduction. A holder rank sees only its own requests; the group must run
the same reductions in the same order. Each service step every rank puts the requests it has
(up to :data:`AGREE_MAX`, smallest keys first: requester instance and request id) into its row
of a small int64 table, the group all-reduces the table (one collective: each rank's row is
its own, so the sum is the gather), and every rank decides from the same table:

- a key all ranks have, with equal fields (chunk, layer, batch, heads, top-k, width, dtype, the
  chunk's length, the selection's CRC) and accepted by all: run, in key order, batched by
  (layer, heads) into one scores launch, one reduction and one values launch per batch;
- a key all ranks have but with different fields, or refused by a rank (unknown chunk, index out
  of range): an ``ERROR`` to every paired requester rank, naming the field, both values and the
  ranks (the request was made by two requester ranks that disagree);
- a key some rank does not have yet: waits; after ``pair_timeout_s`` it is answered with an
  ``ERROR`` (its pair never arrived).

A ``PROBE`` is answered at once by the rank it reaches (a rank pair's payload-free round trip,
``T_probe``), without the group. A lost group member fails the reduction
(:class:`~mqnc.serving.tp_group.GroupLost`, bounded by the group's timeout); the rank then
answers every pending and later request with an ``ERROR`` naming the loss, so a requester rank
paired with a live holder rank gets a clear error at once, and one paired with the lost rank
gets the transport's ``PeerLost``: never a hang.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib

import numpy as np
import torch

import mqnc.triton_kernels.tp.scores  # noqa: F401  (registers the TP ops' triton side)
import mqnc.triton_kernels.tp.values  # noqa: F401
from mqnc.base.checks import check_int, check_number
from mqnc.serving.compute import check_kernels, kernel_ops
from mqnc.serving.holder import serve_in_thread
from mqnc.serving.pool import PagedPool
from mqnc.serving.tp_group import GroupLost, GroupReduce, TPPartition, check_tp_fabric
from mqnc.transport import wire
from mqnc.transport.protocol import (
    INBOX,
    REPLY,
    PeerLost,
    Transport,
    TransportError,
    TransportTimeout,
)

__all__ = ["TPHolder", "AGREE_MAX", "FIELDS", "PENDING_WAIT_S"]

AGREE_MAX = 32
PENDING_WAIT_S = 0.002  # a step's receive window while a route waits for its pairs
FIELDS = (
    "present", "instance", "request_id", "lane", "chunk_id", "tokens", "layer", "batch", "heads",
    "topk", "width", "dtype", "selection_crc", "refused",
)  # fmt: skip
_F = {name: i for i, name in enumerate(FIELDS)}
_DTYPE_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


@dataclasses.dataclass
class _Request:
    src: int
    lane: int
    h: wire.Header
    q: np.ndarray | None
    idx: np.ndarray | None
    tokens: int
    arrived: float
    refused: str | None = None

    def key(self, degree: int) -> tuple[int, int]:
        return (self.src // degree, self.h.request_id)

    def row(self, degree: int) -> list[int]:
        h = self.h
        crc = 0 if self.idx is None else zlib.crc32(self.idx.tobytes())
        rid = h.request_id if h.request_id < 2**63 else h.request_id - 2**64
        return [
            1, self.src // degree, rid, self.lane, h.chunk_id, self.tokens, h.layer_lo, h.batch,
            h.heads, h.topk, h.width, _DTYPE_CODE.get(h.dtype, 0), crc,
            int(self.refused is not None),
        ]  # fmt: skip


@dataclasses.dataclass
class _Chunk:
    chunk_id: int
    tokens: int
    position: int
    blocks: torch.Tensor


class TPHolder:
    """Rank ``rank`` of a TP holder instance: its column slice of every hosted chunk, served to
    its paired requester ranks, the attention completed with its group.

    Parameters
    ----------
    transport : Transport
        This rank's endpoint of the fabric (global rank ``instance * N + rank``).
    group : GroupReduce
        The instance's reduction (:class:`~mqnc.serving.tp_group.GlooGroup`, ``NcclGroup`` or a
        ``ThreadGroup`` member), of size ``N``, this rank's index ``rank``.
    partition : TPPartition
        The column partition (``N = partition.degree``).
    softmax_scale : float
    num_blocks, block_size : int
        The slice pool's capacity and page.
    dtype, device, kernels
        Cache dtype, where the pool lives, ``"triton"`` or ``"torch"`` kernels.
    pair_timeout_s : float
        How long a request waits for its pairs on the other ranks before it is refused.
    poll_s : float
        The longest one service step waits for a request (every step ends in the agreement
        collective, so the group steps together).
    """

    def __init__(
        self,
        transport: Transport,
        group: GroupReduce,
        partition: TPPartition,
        *,
        softmax_scale: float,
        num_blocks: int,
        block_size: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        kernels: str = "triton",
        pair_timeout_s: float = 10.0,
        poll_s: float = 0.02,
    ) -> None:
        n = check_tp_fabric(transport, partition)
        if group.size != n:
            raise ValueError(f"group: expected a group of the TP degree {n}, got size {group.size}")
        if transport.rank % n != group.rank:
            raise ValueError(
                f"group: global rank {transport.rank} is TP rank {transport.rank % n}, its group "
                f"says {group.rank}"
            )
        self.transport, self.group, self.partition = transport, group, partition
        self.rank, self.degree = group.rank, n
        self.geometry = partition.slice_geometry
        self.softmax_scale = check_number("softmax_scale", softmax_scale, positive=True)
        self.dtype = dtype
        self.ops = kernel_ops(check_kernels(kernels))
        self.pages = PagedPool(
            self.geometry.layers, num_blocks, block_size, partition.slice_width, dtype=dtype,
            device=device, kernels=kernels,
        )  # fmt: skip
        self.chunks: dict[int, _Chunk] = {}
        self.pair_timeout_s = check_number("pair_timeout_s", pair_timeout_s, positive=True)
        self.poll_s = check_number("poll_s", poll_s, positive=True)
        layout = transport.layout
        self._inboxes = [
            layout.slot(INBOX, s, lane)
            for s in range(layout.world_size)
            for lane in range(layout.lanes)
        ]
        self._last = {s: 0 for s in self._inboxes}
        self._pending: dict[tuple[int, int], _Request] = {}
        self._crc = not transport.in_process
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.stats = {"routes": 0, "reductions": 0, "errors": 0, "steps": 0}

    # ---- the slice pool ---------------------------------------------------------------------
    def add_chunk(self, chunk_id: int, kv_slice: torch.Tensor, position: int = 0) -> None:
        """Host this rank's slice ``kv_slice [L, c_t, d_qk / N]`` of a chunk
        (:meth:`TPPartition.slice` of the full chunk), cached at canonical positions from
        ``position``."""
        g, w = self.geometry, self.partition.slice_width
        if not isinstance(kv_slice, torch.Tensor):
            raise TypeError(f"kv_slice: expected a torch.Tensor, got {type(kv_slice).__name__}")
        if kv_slice.dim() != 3 or kv_slice.shape[0] != g.layers or kv_slice.shape[2] != w:
            raise ValueError(
                f"kv_slice: expected this rank's slice ({g.layers}, c_t, {w}) (d_qk / N for "
                f"N = {self.degree}), got {tuple(kv_slice.shape)}"
            )
        if kv_slice.dtype != self.dtype:
            raise TypeError(f"kv_slice: expected {self.dtype}, got {kv_slice.dtype}")
        if not bool(torch.isfinite(kv_slice).all()):
            bad = int((~torch.isfinite(kv_slice)).sum())
            raise ValueError(f"kv_slice: expected finite cache entries, got {bad} NaN or infinite")
        chunk_id = check_int("chunk_id", chunk_id, minimum=0)
        position = check_int("position", position, minimum=0)
        if chunk_id in self.chunks:
            raise ValueError(f"chunk_id: chunk {chunk_id} is already hosted")
        blocks = self.pages.alloc(kv_slice.shape[1])
        self.pages.write(blocks, kv_slice)
        blocks = torch.tensor(blocks, dtype=torch.int32)
        self.chunks[chunk_id] = _Chunk(chunk_id, kv_slice.shape[1], position, blocks)

    # ---- the service loop -------------------------------------------------------------------
    def start(self) -> TPHolder:
        """Serve in a background thread until :meth:`stop`."""
        self._thread = serve_in_thread(self, f"tp-holder-{self.transport.rank}")
        return self

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` (every rank of the group must be serving)."""
        try:
            while not self._stop.is_set():
                self.step(self.poll_s)
        finally:
            self.group.leave()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def step(self, timeout: float) -> None:
        """One service step: receive for up to ``timeout`` s, agree with the group, answer."""
        self.stats["steps"] += 1
        self._receive(timeout)
        if self.group.broken is not None:
            self._refuse_all(f"holder group broken ({self.group.broken})")
            return
        try:
            table = self._agree()
        except GroupLost as exc:
            self._refuse_all(str(exc))
            return
        run, refused = self._decide(table)
        for key, why in refused:
            self._answer_error(self._pending.pop(key), why)
        if run:
            self._run_batches([self._pending.pop(k) for k in run])
        now = time.monotonic()
        for key in [k for k, r in self._pending.items() if now - r.arrived > self.pair_timeout_s]:
            r = self._pending.pop(key)
            self._answer_error(
                r, f"request {key[1]}: its pair on the other ranks of the holder group did not "
                f"arrive within {self.pair_timeout_s:g} s (ranks of two groups mismatched?)",
            )  # fmt: skip

    # ---- receiving --------------------------------------------------------------------------
    def _receive(self, timeout: float) -> None:
        """Receive for up to ``timeout`` s, until a new route is pending: probes (and refused
        messages) are answered here and the wait goes on, so that a rank answering probes
        keeps its peers' step cadence instead of waiting for them in the agreement. With a
        route already pending (its pair not yet on every rank) the window is at most
        :data:`PENDING_WAIT_S`: the pair is likely on its way to the other ranks."""
        tr = self.transport
        if self._pending:
            timeout = min(timeout, PENDING_WAIT_S)
        deadline = time.monotonic() + timeout
        before = len(self._pending)
        while len(self._pending) == before:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            targets = {s: self._last[s] + 1 for s in self._inboxes}
            try:
                ready = tr.wait_any(targets, left)
            except (TransportTimeout, PeerLost):
                return
            for slot in ready:
                signal, buf = tr.read_message_host(slot)
                if signal <= self._last[slot]:
                    continue
                self._last[slot] = signal
                src, lane = tr.layout.source_of(slot), tr.layout.lane_of(slot)
                self._accept(src, lane, signal, buf)

    def _accept(self, src: int, lane: int, signal: int, buf) -> None:
        me = f"holder rank {self.rank} (global {self.transport.rank})"
        try:
            h = wire.parse_header(
                buf, geometry=self.geometry, expect=(wire.Kind.ROUTE, wire.Kind.PROBE),
                require_payload_crc=self._crc,
            )  # fmt: skip
        except wire.WireError as exc:
            why = f"{me}: {exc}"
            if "row width" in str(exc):
                why += (
                    f" (a TP-{self.degree} rank takes query slices of d_qk / {self.degree} = "
                    f"{self.partition.slice_width}: slices of different widths)"
                )
            self._put_error(src, lane, 0, signal, why)
            return
        if h.kind == wire.Kind.PROBE:  # answered at once: the pair's own round trip
            ack = wire.pack_probe(request_id=h.request_id, seq=h.seq, ack=True, array=True)
            self._put(src, lane, ack, h.seq)
            return
        if src % self.degree != self.rank:
            self._put_error(src, lane, h.request_id, h.seq, (
                f"{me}: ranks mismatched: requester TP rank {src % self.degree} (global {src}) "
                f"must route to holder rank {src % self.degree}, not {self.rank}"
            ))  # fmt: skip
            return
        chunk = self.chunks.get(h.chunk_id)
        q, idx = wire.query_arrays(buf, h)
        r = _Request(src, lane, h, q.copy(), None if idx is None else idx.copy(),
                     0 if chunk is None else chunk.tokens, time.monotonic())  # fmt: skip
        r.refused = self._refusal(r, chunk, me)
        key = r.key(self.degree)
        if key in self._pending:
            self._put_error(src, lane, h.request_id, h.seq, f"{me}: request {key[1]} is pending")
            return
        self._pending[key] = r

    def _refusal(self, r: _Request, chunk: _Chunk | None, me: str) -> str | None:
        h = r.h
        if chunk is None:
            return f"{me}: chunk {h.chunk_id} is not hosted here (have {sorted(self.chunks)})"
        if h.dtype != self.dtype:
            return f"{me}: q: expected {self.dtype} rows, got {h.dtype}"
        if not 1 <= h.heads <= self.geometry.heads:
            return f"{me}: heads: expected 1 <= heads <= {self.geometry.heads}, got {h.heads}"
        if r.idx is not None:
            bad = (r.idx < -1) | (r.idx >= chunk.tokens)
            if bad.any():
                return (
                    f"{me}: indices: expected chunk-local indices in [-1, {chunk.tokens}) for "
                    f"chunk {h.chunk_id}, got {r.idx[bad][:5].tolist()}"
                )
        return None

    # ---- agreement --------------------------------------------------------------------------
    def _agree(self) -> torch.Tensor:
        """The group's table ``[N, AGREE_MAX, len(FIELDS)]`` int64 (row ``r``: rank ``r``'s
        pending requests, smallest keys first)."""
        table = torch.zeros(self.degree, AGREE_MAX, len(FIELDS), dtype=torch.int64)
        for i, key in enumerate(sorted(self._pending)[:AGREE_MAX]):
            table[self.rank, i] = torch.tensor(self._pending[key].row(self.degree))
        device = self.group.device
        if device.type != "cpu":
            return self.group.all_reduce_sum(table.to(device)).cpu()
        return self.group.all_reduce_sum(table)

    def _decide(self, table: torch.Tensor) -> tuple[list, list]:
        """``(keys to run in order, [(key, why) to refuse])``: the same on every rank."""
        rows = table.tolist()
        seen: list[dict[tuple[int, int], list[int]]] = []
        for r in range(self.degree):
            seen.append({(e[1], e[2] % 2**64): e for e in rows[r] if e[0]})
        run, refused = [], []
        for key in sorted(set.intersection(*(set(s) for s in seen))):
            if key not in self._pending:
                continue
            entries = [s[key] for s in seen]
            why = _disagreement(entries, key)
            if why is None:
                run.append(key)
            else:
                refused.append((key, self._pending[key].refused or why))
        return run, refused

    # ---- computing --------------------------------------------------------------------------
    def _run_batches(self, requests: list[_Request]) -> None:
        """The agreed requests, in key order, one batch per (layer, heads): scores, the group's
        reduction, values, and the replies. A failure (a lost member, or anything a batch
        raises, after which the group can no longer be trusted to be in step) answers every
        request not yet answered with an ``ERROR`` naming it and leaves the group broken."""
        batches: dict[tuple[int, int], list[_Request]] = {}
        for r in requests:
            batches.setdefault((r.h.layer_lo, r.h.heads), []).append(r)
        left = list(batches.items())
        while left:
            (layer, heads), batch = left.pop(0)
            try:
                self._run_batch(layer, heads, batch)
            except Exception as exc:  # noqa: BLE001 - answered, never a silent drop
                why = str(exc) if isinstance(exc, GroupLost) else f"{type(exc).__name__}: {exc}"
                if self.group.broken is None:
                    self.group.broken = f"holder rank {self.rank} failed a batch ({why})"
                for r in [r for _, b in [((layer, heads), batch), *left] for r in b]:
                    self._answer_error(r, why)
                self._refuse_all(why)
                return

    def _run_batch(self, layer: int, heads: int, batch: list[_Request]) -> None:
        t0 = time.perf_counter_ns()
        q, slots = self._stage(batch, heads)
        pool = self.pages.kv[layer]
        d_v = self.partition.slice_latent
        s = self.ops.tp_partial_scores(q, pool, slots, d_v=d_v, check_slots=False)
        self.group.all_reduce_sum(s)
        self.stats["reductions"] += 1
        o, lse = self.ops.tp_partial_values(
            s, pool, slots, softmax_scale=self.softmax_scale, d_v=d_v, check_slots=False
        )
        self._reply(batch, o, lse, slots, time.perf_counter_ns() - t0)

    def _stage(self, batch: list[_Request], heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's query slices ``[sum B, heads, w]`` and their slots ``[sum B, T]`` int32
        (``T`` the longest; -1 pads)."""
        dev, w = self.pages.device, self.partition.slice_width
        qb = np.concatenate([r.q for r in batch])
        q = torch.from_numpy(qb).view(self.dtype).view(qb.shape[0], heads, w).to(dev)
        parts = []
        for r in batch:
            c = self.chunks[r.h.chunk_id]
            if r.idx is None:
                s = self.pages.slots(c.blocks, c.tokens).expand(r.h.batch, -1)
            else:
                s = self.pages.pool_indices(torch.from_numpy(r.idx), c.blocks, c.tokens)
            parts.append(s)
        T = max(p.shape[1] for p in parts)
        slots = torch.full((q.shape[0], T), -1, dtype=torch.int32, device=dev)
        b = 0
        for p in parts:
            slots[b : b + p.shape[0], : p.shape[1]] = p
            b += p.shape[0]
        return q, slots

    def _reply(self, batch, o, lse, slots, ns: int) -> None:
        o, lse = o.cpu(), lse.cpu().numpy()
        keyed = (slots >= 0).any(dim=1).cpu().numpy()
        b = 0
        for r in batch:
            h, e = r.h, b + r.h.batch
            buf = wire.pack_partial_lse(
                o[b:e].contiguous().view(torch.uint8).numpy().reshape(h.batch, -1),
                np.ascontiguousarray(lse[b:e]), keyed=keyed[b:e], dtype=self.dtype,
                width=self.partition.slice_latent, request_id=h.request_id, seq=h.seq,
                chunk_id=h.chunk_id, layer=h.layer_lo, holder_ns=ns, crc=self._crc, array=True,
            )  # fmt: skip
            self._put(r.src, r.lane, buf, h.seq)
            self.stats["routes"] += 1
            b = e

    # ---- answering --------------------------------------------------------------------------
    def _put(self, src: int, lane: int, buf, seq: int) -> None:
        try:
            self.transport.put_signal(src, self.transport.layout.slot(REPLY, self.transport.rank,
                                                                      lane), buf, seq)  # fmt: skip
        except TransportError:
            pass  # the requester is gone: its request times out there

    def _put_error(self, src: int, lane: int, request_id: int, seq: int, why: str) -> None:
        self.stats["errors"] += 1
        self._put(src, lane, wire.pack_error(why, request_id=request_id, seq=seq, array=True), seq)

    def _answer_error(self, r: _Request, why: str) -> None:
        self._put_error(r.src, r.lane, r.h.request_id, r.h.seq, why)

    def _refuse_all(self, why: str) -> None:
        for key in list(self._pending):
            self._answer_error(self._pending.pop(key), why)


def _disagreement(entries: list[list[int]], key: tuple[int, int]) -> str | None:
    """Why the ranks' entries for one request cannot run together, or None."""
    for r, e in enumerate(entries):
        if e[_F["refused"]]:
            return f"request {key[1]}: holder rank {r} refused its slice"
    for name in FIELDS[3:-1]:
        values = [e[_F[name]] for e in entries]
        if len(set(values)) > 1:
            said = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            return (
                f"request {key[1]}: ranks of two groups mismatched: the holder ranks received "
                f"different {name} ({said})"
            )
    return None
