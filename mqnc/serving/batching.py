"""The holder's dispatcher batching (§6.3): every waiting route request, one kernel call per
(layer, heads, dense or selection) group.

Dense rows of different chunks batch together through :func:`mla_decode_partial` with one
block-table row per query token; selection rows through :func:`mla_sparse_partial` with their
chunk-local indices mapped to pool slots. Each group's partial is cut back into its requests
and answered as one collapsed ``(o, m, l)`` reply each (§5.3).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from mqnc.model.geometry import MLAGeometry
from mqnc.serving.pool import PagedPool
from mqnc.transport import wire
from mqnc.triton_kernels.merge import ml_from_lse

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


@dataclasses.dataclass
class RouteJob:
    """One received route request: who asked (rank, lane), its header, rows and selection."""

    src: int
    lane: int
    header: wire.Header
    q: torch.Tensor
    indices: torch.Tensor | None
    chunk: HostedChunk


class RouteBatcher:
    """Runs route requests in batches over a holder's pool and answers each one.

    ``reply(src, lane, buf, seq)`` puts an answer; ``error(src, lane, request_id, seq,
    message)`` answers with an ``ERROR``; ``stats`` is the holder's :class:`HolderStats`.
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
    ) -> None:
        self.pool = pool
        self.geometry = geometry
        self.softmax_scale = softmax_scale
        self.stats = stats
        self._reply = reply
        self._error = error
        self._name = name

    def answer(self, routes: list[RouteJob]) -> None:
        """One kernel call per group of ``routes``; a failed call fails its group only."""
        groups: dict[tuple, list[RouteJob]] = defaultdict(list)
        for r in routes:
            groups[(r.header.layer_lo, r.header.heads, r.indices is not None)].append(r)
        for (layer, _heads, sparse), group in groups.items():
            try:
                t0 = time.perf_counter_ns()
                o, lse = self._sparse(group, layer) if sparse else self._dense(group, layer)
                if self.pool.device.type == "cuda":
                    torch.cuda.synchronize(self.pool.device)
                ns = time.perf_counter_ns() - t0
            except Exception as exc:  # a kernel failure fails this batch's requests, not us
                for r in group:
                    h = r.header
                    why = f"{self._name}: partial attention failed: {exc}"
                    self._error(r.src, r.lane, h.request_id, h.seq, why)
                continue
            self.stats.kernel_calls += 1
            self.stats.batch_rows.append(int(o.shape[0] * o.shape[1]))
            self.stats.batch_requests.append(len(group))
            self._split_replies(group, o, lse, ns)

    def _split_replies(self, group: list[RouteJob], o, lse, ns: int) -> None:
        m, l = ml_from_lse(lse)
        b0 = 0
        for r in group:
            h = r.header
            b1 = b0 + h.batch
            buf = wire.pack_partial(
                o[b0:b1].cpu(),
                m[b0:b1].cpu(),
                l[b0:b1].cpu(),
                request_id=h.request_id,
                seq=h.seq,
                chunk_id=h.chunk_id,
                layer=h.layer_lo,
                holder_ns=ns,
                geometry=self.geometry,
            )
            self.stats.routes += 1
            self.stats.answered[h.request_id] += 1
            self._reply(r.src, r.lane, buf, h.seq)
            b0 = b1

    def _dense(self, group: list[RouteJob], layer: int):
        q = torch.cat([r.q for r in group])
        max_blocks = max(int(r.chunk.blocks.numel()) for r in group)
        rows, lens = [], []
        for r in group:
            bt = torch.zeros(max_blocks, dtype=torch.int32)
            bt[: r.chunk.blocks.numel()] = r.chunk.blocks
            rows.append(bt[None].expand(r.header.batch, -1))
            lens += [r.chunk.tokens] * r.header.batch
        dev = self.pool.device
        block_table = torch.cat(rows).contiguous().to(dev)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
        # The table and lengths are the holder's own (hosted chunks' blocks): no host check.
        return self.pool.ops.mla_decode_partial(
            q,
            self.pool.kv[layer],
            block_table,
            seqlens,
            softmax_scale=self.softmax_scale,
            d_v=self.geometry.d_v,
            check_inputs=False,
        )

    def _sparse(self, group: list[RouteJob], layer: int):
        q = torch.cat([r.q for r in group])
        topk = max(r.header.topk for r in group)
        parts = []
        for r in group:
            pool_idx = self.pool.pool_indices(r.indices, r.chunk.blocks, r.chunk.tokens)
            pad = torch.full(
                (pool_idx.shape[0], topk), -1, dtype=torch.int64, device=pool_idx.device
            )
            pad[:, : pool_idx.shape[1]] = pool_idx
            parts.append(pad)
        indices = torch.cat(parts).to(torch.int32)
        # Chunk-local indices were range-checked on receipt (Holder._check_route) and mapped
        # to the chunk's own slots: no host check.
        return self.pool.ops.mla_sparse_partial(
            q,
            self.pool.kv[layer],
            indices,
            softmax_scale=self.softmax_scale,
            d_v=self.geometry.d_v,
            check_indices=False,
        )
