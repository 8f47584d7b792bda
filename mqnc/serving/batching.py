"""The holder's dispatcher batching (§6.3): every waiting route request, one kernel call per
(layer, heads, dense or selection) group.

Dense rows of different chunks batch together through ``mla_decode_partial`` with one
block-table row per query token; selection rows through ``mla_sparse_partial`` with their
chunk-local indices mapped to pool slots; both are the pool's kernel ops
(:func:`mqnc.serving.compute.kernel_ops`: the Triton kernels or their fp64 references). Each
group's partial is cut back into its requests and answered as one collapsed ``(o, m, l)`` reply
each (§5.3).

Host work per call (the software around the kernel is part of every route's cost, §5.3): a
group's block table and lengths are built once with numpy and cached by the group's (chunk,
batch) make-up (a decode loop asks for the same tables every step); the kernels are called with
``check_inputs=False`` / ``check_indices=False`` (the holder built the tables and range-checked
the selections on receipt), so a group of a shape seen before launches the plan the Triton
op cached for that call signature (``triton_kernels._op.PlanCache``: no checks, no split
search; the same staged rows, tables, layer views and output buffers each step give the same
signature); each reply is packed from the kernel's ``lse`` with numpy on the
host (:func:`mqnc.transport.wire.pack_partial_lse`, which writes the wire's ``(m, l)``). The
kernels are attributes (:attr:`RouteBatcher.dense_kernel`,
:attr:`RouteBatcher.sparse_kernel`: the pool's ops unless set) so that a benchmark can stub
them and time the software alone.

Numbers are never dropped: a row that attended at least one entry but whose ``lse`` is not
finite (an overflow, a NaN input) is answered with a NaN ``lse``, never as an empty partial,
whatever the kernel wrote (the batcher tells the wire which rows had keys), so that a bad number
reaches the requester's merge, which rejects it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from mqnc.base import stamps
from mqnc.model.geometry import MLAGeometry
from mqnc.serving.pool import PagedPool
from mqnc.transport import wire

_TABLE_CACHE = 256  # cached block tables (group make-ups) before the cache is cleared

__all__ = ["HostedChunk", "RouteJob", "RouteBatcher"]


@dataclasses.dataclass(frozen=True)
class HostedChunk:
    """A chunk resident in the holder's pool.

    Attributes
    ----------
    chunk_id : int
    tokens : int
        ``c_t``.
    position : int
        Canonical position of its first token (where its RoPE was encoded).
    blocks : torch.Tensor
        ``[ceil(c_t / block_size)]`` int32 pool blocks, in token order.
    """

    chunk_id: int
    tokens: int
    position: int
    blocks: torch.Tensor

    def slots(self, block_size: int) -> np.ndarray:
        """Flat pool slots ``[tokens]`` int64 of the chunk's entries in a layer's token axis."""
        b = self.blocks.numpy().astype(np.int64)
        return (b[:, None] * block_size + np.arange(block_size)).reshape(-1)[: self.tokens]


@dataclasses.dataclass
class RouteJob:
    """One received route request: who asked (rank, lane), its header, rows and selection.

    ``q``: the rows' bytes, ``[batch, heads * width * itemsize]`` uint8 on the host (the
    header says their dtype; :func:`mqnc.transport.wire.query_arrays`); ``indices``: the
    selection ``[batch, topk]`` int32 on the host, or None."""

    src: int
    lane: int
    header: wire.Header
    q: np.ndarray
    indices: np.ndarray | None
    chunk: HostedChunk


class RouteBatcher:
    """Runs route requests in batches over a holder's pool and answers each one.

    ``reply(src, lane, buf, seq)`` puts an answer; ``error(src, lane, request_id, seq,
    message)`` answers with an ``ERROR``; ``stats`` is the holder's :class:`HolderStats`;
    ``crc``: whether replies carry a payload CRC. ``fold``: the ``B x H`` query rows of one
    request folded ``fold`` to a query row (they share each read of its chunk; zero rows pad
    the last; the device holder's pass packs rows alike, ``mqnc.triton_kernels.route.
    holder_pass``);
    ``num_splits``: the dense call's split count (None: its plan's). With both set as a device
    holder's (:attr:`~mqnc.serving.device_holder.DeviceHolder.fold`, ``.num_splits``) a dense
    answer is the pass's, bit for bit.
    """

    def __init__(
        self,
        pool: PagedPool,
        geometry: MLAGeometry,
        softmax_scale: float,
        stats,
        reply: Callable[[int, int, torch.Tensor, int], None],
        error: Callable[[int, int, int, int, str], None],
        name: str,
        crc: bool | None = None,
        fold: int | None = None,
        num_splits: int | None = None,
    ) -> None:
        self.pool = pool
        self.fold = fold
        self.num_splits = num_splits
        self.geometry = geometry
        self.softmax_scale = softmax_scale
        self.stats = stats
        self.crc = crc
        self._dense_kernel: Callable | None = None
        self._sparse_kernel: Callable | None = None
        self._reply = reply
        self._error = error
        self._name = name
        self._tables: dict[tuple, tuple] = {}
        self._layers = list(pool.kv.unbind(0))  # one view per layer, taken once
        self._cuda = pool.device.type == "cuda"
        self._staging: dict[tuple, tuple] = {}
        self._outs: dict[tuple, tuple] = {}
        self._slots: dict[int, np.ndarray] = {}

    @property
    def dense_kernel(self) -> Callable:
        """The dense partial-attention call: the pool's ``mla_decode_partial`` (read at each
        call, so that a changed ``pool.ops`` is seen) unless one was set (a benchmark's
        stub)."""
        return self._dense_kernel or self.pool.ops.mla_decode_partial

    @dense_kernel.setter
    def dense_kernel(self, fn: Callable | None) -> None:
        self._dense_kernel = fn

    @property
    def sparse_kernel(self) -> Callable:
        """The selection partial-attention call: the pool's ``mla_sparse_partial`` unless one
        was set."""
        return self._sparse_kernel or self.pool.ops.mla_sparse_partial

    @sparse_kernel.setter
    def sparse_kernel(self, fn: Callable | None) -> None:
        self._sparse_kernel = fn

    def answer(self, routes: list[RouteJob]) -> None:
        """One kernel call per group of ``routes``; a failed call fails its group only."""
        if len(routes) == 1:
            groups = {_group_of(routes[0]): routes}
        else:
            groups = defaultdict(list)
            for r in routes:
                groups[_group_of(r)].append(r)
        for (layer, heads, sparse, dtype, _width), group in groups.items():
            try:
                t0 = time.perf_counter_ns()
                rows = group[0].header.batch if len(group) == 1 else _rows_of(group)
                o, lse, host, views = self._outputs(rows, heads, dtype)
                if sparse:
                    keyed = self._sparse(group, layer, rows, (o, lse))
                else:
                    keyed = self._dense(group, layer, rows, (o, lse))
                if self._cuda:
                    torch.cuda.synchronize(self.pool.device)
                ns = time.perf_counter_ns() - t0
                if host[0] is not o:  # outputs on a device: one copy each to the host
                    host[0].copy_(o)
                    host[1].copy_(lse)
                if stamps.ON:
                    stamps.stamp("hold.computed")
            except Exception as exc:  # a kernel failure fails this batch's requests, not us
                for r in group:
                    h = r.header
                    why = f"{self._name}: partial attention failed: {exc}"
                    self._error(r.src, r.lane, h.request_id, h.seq, why)
                continue
            self.stats.kernel_calls += 1
            self.stats.batch_rows.append(rows * heads)
            self.stats.batch_requests.append(len(group))
            self._split_replies(group, views, dtype, ns, keyed)

    def _outputs(self, rows: int, heads: int, dtype: torch.dtype) -> tuple:
        """The kernel's outputs for a batch of ``rows`` tokens x ``heads`` in ``dtype``, kept per
        shape and reused (the kernels' ``out=``: no output allocation per call):
        ``(o [rows, heads, d_v], lse [rows, heads] float32)`` on the pool's device, their host
        copies (the same tensors on the CPU) and those as numpy views (``o``'s bytes ``[rows,
        heads * d_v * itemsize]`` uint8, ``lse``), from which the replies are packed with no
        torch call. A batch's replies are packed before the next batch runs (the holder answers
        one batch at a time)."""
        key = (rows, heads, dtype)
        got = self._outs.get(key)
        if got is None:
            if len(self._outs) >= _TABLE_CACHE:
                self._outs.clear()
            dev = self.pool.device
            o = torch.empty(rows, heads, self.geometry.d_v, dtype=dtype, device=dev)
            lse = torch.empty(rows, heads, dtype=torch.float32, device=dev)
            host = (o, lse) if dev.type == "cpu" else (o.cpu(), lse.cpu())
            views = (host[0].view(torch.uint8).numpy().reshape(rows, -1), host[1].numpy())
            got = self._outs[key] = (o, lse, host, views)
        return got

    def _split_replies(self, group: list[RouteJob], views, dtype, ns: int, keyed) -> None:
        ob, lse = views
        width = self.geometry.d_v
        b0 = 0
        for r in group:
            h = r.header
            b1 = b0 + h.batch
            try:
                buf = wire.pack_partial_lse(
                    ob[b0:b1],
                    lse[b0:b1],
                    keyed=None if keyed is None else keyed[b0:b1],
                    dtype=dtype,
                    width=width,
                    request_id=h.request_id,
                    seq=h.seq,
                    chunk_id=h.chunk_id,
                    layer=h.layer_lo,
                    holder_ns=ns,
                    crc=self.crc,
                    array=True,
                )
                if stamps.ON:
                    stamps.stamp("hold.packed")
                self.stats.routes += 1
                self.stats.answered[h.request_id] += 1
                self._reply(r.src, r.lane, buf, h.seq)
                if stamps.ON:
                    stamps.stamp("hold.put")
            except Exception as exc:  # e.g. a reply that does not fit the requester's slot
                self._error(r.src, r.lane, h.request_id, h.seq, f"{self._name}: {exc}")
            b0 = b1

    def _dense(self, group: list[RouteJob], layer: int, rows: int, out) -> np.ndarray | None:
        """The dense kernel's call on ``group`` into ``out``; returns which rows have keys
        (``[rows]`` bool) or None when all do."""
        q = self._rows(group, rows)
        if len(group) == 1:
            r = group[0]
            key = ((r.chunk.chunk_id, r.header.batch),)
        else:
            key = tuple((r.chunk.chunk_id, r.header.batch) for r in group)
        tables = self._tables.get(key)
        if tables is None:
            tables = self._dense_tables(group, rows)
            if len(self._tables) >= _TABLE_CACHE:
                self._tables.clear()
            self._tables[key] = tables
        block_table, seqlens, keyed = tables
        if self.fold is not None or self.num_splits is not None:
            return self._dense_folded(group, layer, q, out, keyed)
        got = self.dense_kernel(
            q,
            self._layers[layer],
            block_table,
            seqlens,
            softmax_scale=self.softmax_scale,
            d_v=self.geometry.d_v,
            check_inputs=False,
            out=out,
        )
        _written(got, out)
        return keyed

    def _dense_folded(self, group: list[RouteJob], layer: int, q, out, keyed):
        """The dense call with each request's ``B x H`` query rows folded ``fold`` to a query
        row (zero rows pad its last one) at ``num_splits``; the answer's rows copied back into
        ``out``."""
        heads, width = q.shape[1], q.shape[2]
        fold = self.fold or heads
        parts, tables, lens, b0 = [], [], [], 0
        blocks = max(max(int(r.chunk.blocks.numel()) for r in group), 1)
        for r in group:
            B = r.header.batch
            n = -(-(B * heads) // fold)
            rows = torch.zeros(n * fold, width, dtype=q.dtype, device=q.device)
            rows[: B * heads] = q[b0 : b0 + B].reshape(B * heads, width)
            parts.append(rows.view(n, fold, width))
            t = torch.zeros(n, blocks, dtype=torch.int32)
            t[:, : r.chunk.blocks.numel()] = r.chunk.blocks
            tables.append(t)
            lens.append(torch.full((n,), r.chunk.tokens, dtype=torch.int32))
            b0 += B
        dev = q.device
        o, lse = self.dense_kernel(
            torch.cat(parts),
            self._layers[layer],
            torch.cat(tables).to(dev),
            torch.cat(lens).to(dev),
            softmax_scale=self.softmax_scale,
            d_v=self.geometry.d_v,
            num_splits=self.num_splits,
            check_inputs=False,
        )
        o = o.reshape(-1, o.shape[2])
        lse = lse.reshape(-1)
        g0, b0 = 0, 0
        for part, r in zip(parts, group, strict=True):
            B = r.header.batch
            out[0][b0 : b0 + B] = o[g0 : g0 + B * heads].view(B, heads, -1)
            out[1][b0 : b0 + B] = lse[g0 : g0 + B * heads].view(B, heads)
            g0 += part.shape[0] * fold
            b0 += B
        return keyed

    def _rows(self, group: list[RouteJob], rows: int) -> torch.Tensor:
        """The group's query rows (``rows`` tokens) as one ``[rows, H, width]`` tensor on the
        pool's device: their bytes copied (numpy) into a staging buffer kept per shape, and on
        a GPU (any device but the CPU) copied to the device once per batch (no torch call per
        request on the host, where each cost a just-woken holder several microseconds; before,
        a tensor view per request and a ``torch.cat`` or a copy to the device per request). A
        buffer is reused by the next batch of its shape only after this batch's call returned
        (the holder answers one batch at a time, and a GPU call is synchronised before its
        reply is packed); the group shares one dtype and width (:func:`_group_of`)."""
        h = group[0].header
        key = (rows, h.heads, h.width, h.dtype)
        staged = self._staging.get(key)
        if staged is None:
            if len(self._staging) >= _TABLE_CACHE:
                self._staging.clear()
            host = torch.empty(rows, h.heads, h.width, dtype=h.dtype)
            on_host = self.pool.device.type == "cpu"
            dev = host if on_host else torch.empty_like(host, device=self.pool.device)
            staged = self._staging[key] = (
                host.view(torch.uint8).numpy().reshape(rows, -1),
                host,
                dev,
            )
        view, host, dev = staged
        if len(group) == 1:
            view[:] = group[0].q
        else:
            b0 = 0
            for r in group:
                b1 = b0 + r.header.batch
                view[b0:b1] = r.q
                b0 = b1
        if dev is not host:
            dev.copy_(host)
        return dev

    def _dense_tables(self, group: list[RouteJob], rows: int):
        """One block-table row per query token (the row's chunk's blocks), its length, and
        which rows have keys (``[rows]`` bool numpy, None when all do)."""
        width = max(max(int(r.chunk.blocks.numel()) for r in group), 1)
        table = np.zeros((rows, width), dtype=np.int32)
        lens = np.zeros(rows, dtype=np.int32)
        b0 = 0
        for r in group:
            b1 = b0 + r.header.batch
            blocks = r.chunk.blocks.numpy()
            table[b0:b1, : blocks.shape[0]] = blocks
            lens[b0:b1] = r.chunk.tokens
            b0 = b1
        dev = self.pool.device
        keyed = lens > 0
        return (
            torch.from_numpy(table).to(dev),
            torch.from_numpy(lens).to(dev),
            None if keyed.all() else keyed,
        )

    def _sparse(self, group: list[RouteJob], layer: int, rows: int, out) -> np.ndarray | None:
        """The selection kernel's call on ``group`` into ``out``; returns which rows have keys
        (``[rows]`` bool) or None when all do."""
        q = self._rows(group, rows)
        topk = max(r.header.topk for r in group)
        idx = np.full((rows, topk), -1, dtype=np.int32)
        b0 = 0
        for r in group:
            b1 = b0 + r.header.batch
            slots = self._slots.get(r.chunk.chunk_id)
            if slots is None:
                slots = self._slots[r.chunk.chunk_id] = r.chunk.slots(self.pool.block_size)
            local = r.indices
            idx[b0:b1, : local.shape[1]] = np.where(
                local >= 0, slots[np.maximum(local, 0)] if slots.size else -1, -1
            )
            b0 = b1
        keyed = (idx >= 0).any(axis=1)
        got = self.sparse_kernel(
            q,
            self._layers[layer],
            torch.from_numpy(idx).to(self.pool.device),
            softmax_scale=self.softmax_scale,
            d_v=self.geometry.d_v,
            check_indices=False,
            out=out,
        )
        _written(got, out)
        return None if keyed.all() else keyed


def _group_of(r: RouteJob) -> tuple:
    """What one kernel call needs alike: layer, heads, dense or selection, and the rows' dtype
    and width (their bytes are staged together, :meth:`RouteBatcher._rows`)."""
    h = r.header
    return h.layer_lo, h.heads, r.indices is not None, h.dtype, h.width


def _rows_of(group: list[RouteJob]) -> int:
    """Query tokens of a group (its requests' batches)."""
    return sum(r.header.batch for r in group)


def _written(got, out) -> None:
    """Make sure a kernel's outputs are in ``out``: a kernel set by hand (a benchmark's
    stand-in) that returned its own tensors instead has them copied in."""
    if got[0] is not out[0] or got[1] is not out[1]:
        with torch.no_grad():  # (the buffers never join an autograd graph)
            out[0].copy_(got[0])
            out[1].copy_(got[1])
