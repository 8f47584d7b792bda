"""The route primitive's two ends on the requester (§3.2, §5.3): the request (query rows checked,
rotated by the opposite of the chunk's delta so that the holder stays position-oblivious,
packed) and the reply (the collapsed partial unpacked, its cost terms filled in)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mqnc.model.geometry import MLAGeometry
from mqnc.serving.client import Pending
from mqnc.serving.records import ChunkInfo, CostRecord, Partial
from mqnc.transport import wire
from mqnc.triton_kernels.merge import lse_from_ml

__all__ = ["check_query", "route_request", "route_reply"]


def check_query(q: object, geometry: MLAGeometry, dtype: torch.dtype) -> torch.Tensor:
    """``q`` as absorbed query rows ``[B, H, d_qk]`` in ``dtype``, or a clear error."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3 or q.shape[2] != geometry.d_qk:
        raise ValueError(f"q: expected shape (B, H, {geometry.d_qk}), got {tuple(q.shape)}")
    if q.dtype != dtype:
        raise TypeError(f"q: invalid dtype, expected {dtype}, got {q.dtype}")
    return q


def route_request(
    info: ChunkInfo,
    q: torch.Tensor,
    layer: int,
    offset: int | None,
    indices: torch.Tensor | None,
    *,
    geometry: MLAGeometry,
    rope,
    ops,
) -> tuple[int, Callable[[int, int], torch.Tensor]]:
    """Check a route of ``q`` (already checked by :func:`check_query`) over chunk ``info``
    and return ``(M_q, make)``: ``make(request_id, seq)`` packs the ``ROUTE`` message (the
    copy to the host included, so that it counts as transfer time). ``ops`` runs the rotation
    (:func:`mqnc.serving.compute.kernel_ops`)."""
    if not 0 <= layer < geometry.layers:
        raise ValueError(f"layer: expected 0 <= layer < {geometry.layers}, got {layer}")
    moved = offset is not None and offset != info.position
    if indices is not None and moved:
        raise ValueError(
            "offset: a selection (indices) attends entries at their canonical positions "
            "(§5.4); pass offset=None"
        )
    if moved and rope is None:
        raise ValueError(
            f"offset: chunk {info.chunk_id} is seen at offset {offset} but cached at "
            f"{info.position}; rotating the query needs rope= (a RopeSpec)"
        )
    # The holder attends at canonical positions: rotate q by -(new - old) (§3.2).
    qr = ops.rope_rotate(q, -(int(offset) - info.position), rope) if moved else q
    qr = qr.contiguous()
    idx = None if indices is None else indices.to(torch.int32).contiguous().cpu()

    def make(rid: int, seq: int) -> torch.Tensor:
        return wire.pack_query(
            qr.cpu(),
            request_id=rid,
            seq=seq,
            chunk_id=info.chunk_id,
            layer=layer,
            indices=idx,
            geometry=geometry,
        )

    return q.shape[0] * q.shape[1], make


def route_reply(
    p: Pending, h: wire.Header, buf: torch.Tensor, *, geometry: MLAGeometry, device
) -> Partial:
    """The partial in a ``PARTIAL`` reply to ``p``, its record's terms filled in: the holder's
    compute (from the header), the return (arrival less compute) and the whole call."""
    t_recv = time.perf_counter()
    _, o, m, l = wire.unpack_partial(buf, geometry=geometry)
    rec: CostRecord = p.record
    rec.bytes_recv = h.nbytes
    rec.compute_us = h.holder_ns / 1e3
    rec.return_us = max((t_recv - p.t_sent) * 1e6 - rec.compute_us, 0.0)
    rec.total_us = (t_recv - p.t0) * 1e6
    o, lse = o.to(device).clone(), lse_from_ml(m, l).to(device)
    return Partial(o, lse, "route", p.peer, rec)
