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

Every call appends a :class:`~mqnc.serving.records.CostRecord` with its terms (probe, transfer,
compute, return, merge, splice, prefill; microseconds), the samples :func:`mqnc.cost.fit`
consumes (:meth:`Requester.cost_samples`).

The pieces, one module each: lanes, request ids, send and wait
(:mod:`mqnc.serving.client`, whose docstring says how faults surface); the route request and
reply (:mod:`mqnc.serving.route`); the paged pool of fetched and re-prefilled chunks
(:mod:`mqnc.serving.pool`); the fallback policy of :meth:`Requester.attend`
(:mod:`mqnc.serving.policy`); the records (:mod:`mqnc.serving.records`).

The kernels are imported with this module: on a CPU-only machine choose the interpreter first
(:func:`mqnc.base.use_interpreter_without_cuda`, as the CLI and the test suite do).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from mqnc.base import stamps
from mqnc.base.checks import check_int, check_number
from mqnc.base.runtime import kernel_device, synchronize
from mqnc.model.geometry import MLAGeometry
from mqnc.serving import policy
from mqnc.serving.client import Pending, RemoteError, RequestClient, us_since
from mqnc.serving.compute import check_kernels, kernel_ops
from mqnc.serving.pool import LocalChunks, PagedPool
from mqnc.serving.records import (
    BoundedList,
    ChunkInfo,
    CostRecord,
    LocalChunk,
    Partial,
    cost_samples,
)
from mqnc.serving.route import check_query, route_reply, route_request
from mqnc.transport import wire
from mqnc.transport.protocol import Transport

__all__ = ["Requester"]


class _Calls:
    """The requester's calls through its client, each with its cost record.

    A failure is recorded before it propagates: the record is marked failed and kept in
    ``costs``, and its holder is suspected (skipped by :meth:`Requester.attend` for a while).
    """

    def __init__(self, client: RequestClient, costs: list, suspects: policy.Suspects) -> None:
        self.client = client
        self.costs = costs
        self.suspects = suspects

    def send(self, peer, kind, make, record: CostRecord, shape=None) -> Pending:
        """Send a request; its reply is awaited later (``client.wait``)."""
        try:
            return self.client.send(peer, kind, make, record, shape)
        except BaseException as exc:
            self.fail(record, exc)
            raise

    def call(self, peer, kind, make, record: CostRecord, shape=None):
        """Send and wait for the reply: ``(pending, header, buf, t_recv)``."""
        try:
            p, h, buf = self.client.call(peer, kind, make, record, shape)
        except BaseException as exc:
            self.fail(record, exc)
            raise
        return p, h, buf, time.perf_counter()

    def fail(self, record: CostRecord, exc: BaseException) -> None:
        """Record a failed call and suspect its holder."""
        record.fail(exc)
        self.costs.append(record)
        if record.peer is not None:
            self.suspects.mark(record.peer)


def _check_chunk(geometry: MLAGeometry, peer: int, info: ChunkInfo, h: wire.Header) -> None:
    """A CHUNK reply must be the chunk asked for: all layers, the directory's length and
    canonical position (a one-layer reply is not broadcast into every layer)."""
    got = (h.chunk_id, h.layer_lo, h.layer_hi, h.batch, h.position)
    want = (info.chunk_id, 0, geometry.layers, info.tokens, info.position)
    if got != want:
        raise RemoteError(
            f"holder {peer}: chunk {h.chunk_id} with layers [{h.layer_lo}, {h.layer_hi}), "
            f"{h.batch} tokens at position {h.position}; asked for chunk {info.chunk_id}, "
            f"layers [0, {geometry.layers}), {info.tokens} tokens at {info.position}"
        )


# The public facade of the primitives (probe, route / route_many, fetch, local, attend), each
# method one primitive's own sequence (record, send, wait, unpack) with its numpy-style
# docstring. The parts with a job of their own are elsewhere: the recorded calls (_Calls);
# lanes, request ids and waits (client); the route's request and reply (route); the pool
# (pool); the fallback policy (policy) and the records (records).
class Requester:
    """Probe, route, fetch and local over a transport, merging partials as they come back.

    Parameters
    ----------
    transport : Transport
        This rank's endpoint.
    geometry : MLAGeometry
    softmax_scale : float
        The model's scale (for local attention over fetched chunks).
    rope : mqnc.model.RopeSpec or None
        Needed for a route or fetch whose offset differs from the chunk's canonical position.
    timeout_s : float
        Bound on every wait for a holder's answer.
    pool_blocks : int
        Capacity of the requester's own paged pool (blocks per layer) for fetched / local
        chunks; 0 disables fetch and local.
    block_size : int
    dtype : torch.dtype
        Query and cache dtype (bf16). With a geometry whose ``cache_dtype`` is ``"fp8_e4m3"``
        the pool keeps FP8 entries (fetched ones spliced as entries, re-prefilled rows
        quantized) and ``dtype`` is the queries' and partials'.
    device : torch.device or str or None
        Where queries, partials and the pool live; None: :func:`mqnc.base.kernel_device` (the
        GPU when the kernels are compiled and CUDA exists, else the CPU).
    model : callable or None
        ``model(chunk_id, offset) -> kv [L, c_t, d_qk]``: re-prefills a chunk at ``offset``
        (what :meth:`local` runs).
    suspect_s : float
        After a holder fails, skip it in :meth:`attend` for this long.
    max_records : int
        :attr:`costs` keeps (at least) the last ``max_records`` cost records and at most
        twice that (a long-running requester's memory stays bounded).
    kernels : {"triton", "torch"}
        Merge, query rotation, splice and attention over the pool by the Triton kernels or
        their torch references (:mod:`mqnc.serving.compute`).
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
        device: torch.device | str | None = None,
        model: Callable[[int, int], torch.Tensor] | None = None,
        suspect_s: float = 30.0,
        max_records: int = 100_000,
        kernels: str = "triton",
    ) -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"transport: expected a Transport, got {type(transport).__name__}")
        if not isinstance(geometry, MLAGeometry):
            raise TypeError(f"geometry: expected an MLAGeometry, got {type(geometry).__name__}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        self.transport = transport
        self.geometry = geometry
        self.softmax_scale = check_number("softmax_scale", softmax_scale, positive=True)
        self.rope = rope
        self.client = RequestClient(transport, geometry, float(timeout_s))
        self.dtype = dtype
        self.device = kernel_device() if device is None else torch.device(device)
        self.model = model
        self.kernels = check_kernels(kernels)
        self.ops = kernel_ops(kernels)
        self.suspects = policy.Suspects(suspect_s)
        self.directory: dict[int, ChunkInfo] = {}
        self.costs: list[CostRecord] = BoundedList(max_records)
        self.last_probe_us: dict[int, float] = {}
        self._calls = _Calls(self.client, self.costs, self.suspects)
        self.kept = LocalChunks(
            PagedPool(
                geometry.layers,
                pool_blocks,
                block_size,
                geometry.d_qk,
                dtype=dtype,
                device=self.device,
                kernels=kernels,
                fp8=geometry.fp8_layout,  # fetched FP8 chunks are kept as FP8 entries
            )
            if pool_blocks
            else None
        )

    @property
    def timeout_s(self) -> float:
        return self.client.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.client.timeout_s = float(value)

    @property
    def pool(self) -> torch.Tensor | None:
        """The pool of fetched / re-prefilled chunks ``[L, pool_blocks, block_size, d_qk]``."""
        return None if self.kept.pool is None else self.kept.pool.kv

    @property
    def local_chunks(self) -> dict[tuple[int, int], LocalChunk]:
        """Fetched / re-prefilled chunks by ``(chunk_id, offset)``."""
        return self.kept.chunks

    # ---- directory ---------------------------------------------------------------------------
    def register(self, info: ChunkInfo) -> None:
        """Add a chunk to the directory (id -> length, canonical position, holders)."""
        if not isinstance(info, ChunkInfo):
            raise TypeError(f"info: expected a ChunkInfo, got {type(info).__name__}")
        for h in info.holders:
            self.transport.check_peer(h)
        self.directory[info.chunk_id] = info

    def lookup(self, chunk_id: int) -> ChunkInfo:
        """The directory's entry for ``chunk_id`` (a ``KeyError`` listing the known ones)."""
        try:
            return self.directory[chunk_id]
        except KeyError:
            raise KeyError(
                f"chunk_id: chunk {chunk_id} is not in the directory (known: "
                f"{sorted(self.directory)})"
            ) from None

    # ---- probe -------------------------------------------------------------------------------
    def probe(self, peer: int) -> float:
        """Payload-free round trip to ``peer`` (a header-only put + signal each way); returns
        microseconds and records it (``T_probe``)."""
        if stamps.ON:
            stamps.stamp("req.start")
        self.transport.check_peer(peer)
        rec = CostRecord("probe", peer, None, None, 0, 0, 0)
        make = lambda rid, seq: wire.pack_probe(request_id=rid, seq=seq, array=True)  # noqa: E731
        p, _, _, t_recv = self._calls.call(peer, wire.Kind.PROBE_ACK, make, rec)
        rec.bytes_recv = wire.HEADER_BYTES
        rec.probe_us = rec.total_us = (t_recv - p.t0) * 1e6
        self.last_probe_us[peer] = rec.total_us
        self.costs.append(rec)
        if stamps.ON:
            stamps.stamp("req.done")
        return rec.total_us

    # ---- route -------------------------------------------------------------------------------
    def _prepare_route(self, chunk_id, q, layer, offset, indices, peer):
        """The checked route of ``q``: ``(peer, make, record, (B, H))``."""
        info = self.lookup(chunk_id)
        q = check_query(q, self.geometry, self.dtype)
        if not (q.is_cpu and self.device.type == "cpu"):  # a no-op .to is still a torch call
            q = q.to(self.device)  # rotated on this device
        peer = info.holders[0] if peer is None else self.transport.check_peer(peer)
        m_q, make = route_request(
            info, q, layer, offset, indices, geometry=self.geometry, rope=self.rope,
            ops=self.ops, crc=self.client.crc,
        )  # fmt: skip
        probe = self.last_probe_us.get(peer, math.nan)
        rec = CostRecord("route", peer, chunk_id, layer, m_q, 0, 0, probe_us=probe)
        return peer, make, rec, (q.shape[0], q.shape[1])

    def _start_route(self, chunk_id, q, layer, offset, indices, peer) -> Pending:
        peer, make, rec, shape = self._prepare_route(chunk_id, q, layer, offset, indices, peer)
        return self._calls.send(peer, wire.Kind.PARTIAL, make, rec, shape)

    def _finish_route(self, p: Pending, deadline: float, reply=None) -> Partial:
        h, buf = self.client.wait(p, deadline) if reply is None else reply
        part = route_reply(p, h, buf, geometry=self.geometry, device=self.device, dtype=self.dtype)
        self.costs.append(part.record)
        return part

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
        if stamps.ON:
            stamps.stamp("req.start")
        peer, make, rec, shape = self._prepare_route(chunk_id, q, layer, offset, indices, peer)
        p, h, buf, _ = self._calls.call(peer, wire.Kind.PARTIAL, make, rec, shape)
        try:
            part = self._finish_route(p, 0.0, (h, buf))
        except BaseException as exc:
            self._calls.fail(p.record, exc)
            raise
        if stamps.ON:
            stamps.stamp("req.done")
        return part

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
        pending: list[Pending] = []
        errors: list[BaseException] = []
        for r in requests:
            args = (r["chunk_id"], r["q"], r["layer"], r.get("offset"), r.get("indices"))
            try:
                pending.append(self._start_route(*args, r.get("peer")))
            except BaseException as exc:
                errors.append(exc)
        deadline = time.monotonic() + self.timeout_s
        parts: list[Partial] = []
        for p in pending:
            try:
                parts.append(self._finish_route(p, deadline))
            except BaseException as exc:
                self._calls.fail(p.record, exc)
                errors.append(exc)
        if errors:
            raise errors[0]
        if not merge:
            return parts
        o, lse, merge_us = self.merge(parts, kernels=self.kernels)
        for part in parts:
            part.record.merge_us = merge_us
        return o, lse

    @staticmethod
    def merge(
        parts: Sequence[Partial], *, kernels: str = "triton"
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """M-way merge of partials over disjoint key sets: ``(o, lse, microseconds)``.

        The microseconds are the merge's call until its result is ready (on a GPU the device
        is synchronised before and after it); the NaN check of the partials' ``lse`` (a host
        sync) runs before, untimed."""
        if not parts:
            raise ValueError("parts: expected at least one partial, got 0")
        shapes = {(tuple(p.o.shape), tuple(p.lse.shape)) for p in parts}
        if len(shapes) != 1:
            raise ValueError(
                f"parts: expected partials of one shape (o [B, H, d_v], lse [B, H]), got "
                f"{sorted(shapes)}"
            )
        o, lse = torch.stack([p.o for p in parts]), torch.stack([p.lse for p in parts])
        if torch.isnan(lse).any():
            raise ValueError("parts: expected no NaN log-sum-exp values in the partials")
        synchronize(o.device)
        t0 = time.perf_counter()
        o, lse = kernel_ops(kernels).merge_partials(o, lse, check_lse=False, layout="MBHD")
        synchronize(o.device)
        return o, lse, us_since(t0)

    # ---- fetch and local: chunks in this requester's pool ------------------------------------
    def fetch(
        self, chunk_id: int, *, offset: int | None = None, peer: int | None = None
    ) -> LocalChunk:
        """Pull all ``L`` layers of a chunk and splice them into this requester's pool at
        ``offset`` (default: the canonical position), rotating by ``offset - position``
        (§2.2). A chunk already spliced at that offset is reused."""
        info = self.lookup(chunk_id)
        offset = info.position if offset is None else check_int("offset", offset, minimum=0)
        if (chunk_id, offset) in self.local_chunks:
            return self.local_chunks[(chunk_id, offset)]
        if offset != info.position and self.rope is None:  # refused before the pull, not after
            raise ValueError(
                f"offset: chunk {chunk_id} is cached at {info.position}; splicing it to {offset} "
                "needs rope= (a RopeSpec)"
            )
        peer = info.holders[0] if peer is None else self.transport.check_peer(peer)
        probe = self.last_probe_us.get(peer, math.nan)
        rec = CostRecord("fetch", peer, chunk_id, None, 0, 0, 0, probe_us=probe)

        def make(rid, seq):
            return wire.pack_fetch(
                request_id=rid, seq=seq, chunk_id=chunk_id, geometry=self.geometry, array=True
            )

        p, h, buf, t_recv = self._calls.call(peer, wire.Kind.CHUNK, make, rec)
        try:
            _, kv = wire.unpack_chunk(
                buf, geometry=self.geometry, require_payload_crc=self.client.crc
            )
            _check_chunk(self.geometry, peer, info, h)
            rec.bytes_recv = h.nbytes
            rec.return_us = (t_recv - p.t_sent) * 1e6
            t0 = time.perf_counter()
            try:
                lc = self.kept.put(
                    info, offset, kv, delta=offset - info.position, rope=self.rope, source="fetch"
                )
            except ValueError as exc:  # the holder's entries refused by the pool: name it
                if not str(exc).startswith("kv"):
                    raise
                raise ValueError(f"holder {peer}: chunk {chunk_id}: {exc}") from None
            rec.splice_us = us_since(t0)
            rec.total_us = us_since(p.t0)
        except BaseException as exc:
            self._calls.fail(rec, exc)
            raise
        self.costs.append(rec)
        return lc

    def local(self, chunk_id: int, *, offset: int | None = None) -> LocalChunk:
        """Re-prefill a chunk through ``model`` at ``offset`` and write it into the pool."""
        if self.model is None:
            raise ValueError("model: local needs a model (model(chunk_id, offset) -> kv)")
        info = self.lookup(chunk_id)
        offset = info.position if offset is None else check_int("offset", offset, minimum=0)
        known = self.local_chunks.get((chunk_id, offset))
        if known is not None and known.source == "local":
            return known
        rec = CostRecord("local", None, chunk_id, None, 0, 0, 0)
        t0 = time.perf_counter()
        kv = self.model(chunk_id, offset)
        rec.prefill_us = us_since(t0)
        g = self.geometry
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != (g.layers, info.tokens, g.d_qk):
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ValueError(
                f"model: expected kv of shape ({g.layers}, {info.tokens}, {g.d_qk}), got {got}"
            )
        kv = kv.to(self.device, self.dtype)
        lc = self.kept.put(info, offset, kv, delta=0, rope=self.rope, source="local")
        rec.total_us = us_since(t0)
        self.costs.append(rec)
        return lc

    def evict_local(self, chunk_id: int, offset: int | None = None) -> bool:
        """Forget the copy of ``chunk_id`` fetched or re-prefilled at ``offset`` (default: the
        canonical position) and free its pool blocks; False if none was kept there."""
        info = self.lookup(chunk_id)
        offset = info.position if offset is None else check_int("offset", offset, minimum=0)
        return self.kept.evict(chunk_id, offset) is not None

    def clear_local(self) -> None:
        """Forget every fetched and re-prefilled chunk and free the whole pool."""
        self.kept.clear()

    def attend_local(
        self, lc: LocalChunk, q: torch.Tensor, layer: int, *, indices: torch.Tensor | None = None
    ) -> Partial:
        """Partial attention of ``q [B, H, d_qk]`` over a chunk in this requester's pool."""
        q = check_query(q, self.geometry, self.dtype).to(self.device)
        d_v = self.geometry.d_v
        o, lse = self.kept.attend(lc, q, layer, indices, softmax_scale=self.softmax_scale, d_v=d_v)
        return Partial(o, lse, lc.source, None)

    # ---- policy, records, shutdown -----------------------------------------------------------
    def attend(
        self,
        chunk_id: int,
        q: torch.Tensor,
        layer: int,
        *,
        offset: int | None = None,
        indices: torch.Tensor | None = None,
        order: Sequence[str] = ("route", "fetch", "local"),
        held: bool = True,
    ) -> Partial:
        """Attend one chunk by the first primitive in ``order`` that succeeds
        (:mod:`mqnc.serving.policy`).

        ``route`` and ``fetch`` try each holder of the chunk in turn (skipping holders that
        failed within ``suspect_s``, unless none is left); ``local`` needs ``model``. A chunk
        already fetched or re-prefilled at ``offset`` is attended locally at once, unless
        ``held`` is False: then ``order`` is followed (a route goes to a holder; a fetch or a
        local primitive still attends the copy the pool holds). Raises
        :class:`~mqnc.serving.policy.AllPrimitivesFailed` listing every failure.
        """
        return policy.attend_with_fallback(
            self, chunk_id, q, layer, offset=offset, indices=indices, order=order, held=held
        )

    def cost_samples(self, primitive: str = "route") -> list[tuple[int, float]]:
        """``(M_q, total_us)`` of every successful call of ``primitive`` (for
        :func:`mqnc.cost.fit`)."""
        return cost_samples(self.costs, primitive)

    def shutdown(self, peer: int) -> None:
        """Ask holder ``peer`` to stop serving (no answer is awaited)."""
        self.client.post(
            peer, lambda rid, seq: wire.pack_shutdown(request_id=rid, seq=seq, array=True)
        )
