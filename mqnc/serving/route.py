"""The route primitive's two ends on the requester (§3.2, §5.3): the request (query rows checked,
rotated by the opposite of the chunk's delta so that the holder stays position-oblivious,
packed) and the reply (the collapsed partial unpacked and checked against the request, its cost
terms filled in).

Numbers that cannot be attended are never dropped (a bad number must reach the caller, never
vanish as an empty partial): a query row with NaN or inf, or one whose scores overflow, comes
back with a NaN ``lse`` (the holder flags every row that attended an entry but has no finite
``lse``), which the merge rejects; a selection index outside ``[-1, c_t)`` is rejected before
any cast (an int64 ``2**32 + 5`` is not ``5``); a reply's ``(m, l)`` that is neither empty
(``l = 0``) nor finite (``m`` finite, ``l`` finite and positive) becomes a NaN ``lse`` too,
never an empty partial (:func:`mqnc.transport.wire.partial_lse`). (Checking q for finite
values here would cost more than the route: ``torch.isfinite`` over 256 bf16 rows takes ~1 ms
on a CPU.)
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import numpy as np
import torch

from mqnc.base.checks import check_int
from mqnc.model.geometry import MLAGeometry
from mqnc.serving.client import Pending, RemoteError
from mqnc.serving.records import ChunkInfo, CostRecord, Partial
from mqnc.transport import wire

__all__ = ["check_query", "check_selection", "lse_of_ml", "route_request", "route_reply"]


def check_query(q: object, geometry: MLAGeometry, dtype: torch.dtype) -> torch.Tensor:
    """``q`` as absorbed query rows ``[B, H, d_qk]`` in ``dtype`` (at least one), or a clear
    error."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    shape = q.shape  # read once (each torch attribute read costs a just-woken thread ~1 us)
    if len(shape) != 3 or shape[2] != geometry.d_qk:
        raise ValueError(f"q: expected shape (B, H, {geometry.d_qk}), got {tuple(shape)}")
    if q.dtype != dtype:
        raise TypeError(f"q: invalid dtype, expected {dtype}, got {q.dtype}")
    if shape[0] * shape[1] == 0:
        raise ValueError(f"q: expected at least one row, got shape {tuple(shape)}")
    return q


def check_selection(indices: object, batch: int, tokens: int) -> torch.Tensor:
    """A selection ``[batch, topk]`` of chunk-local indices in ``[-1, tokens)`` (``-1``
    unused) as int32 on the host, checked before the cast; an empty selection (``topk = 0``)
    becomes one unused slot per row (an empty partial, not dense attention)."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"indices: invalid dtype, expected an integer dtype, got {indices.dtype}")
    if indices.dim() != 2 or indices.shape[0] != batch:
        raise ValueError(f"indices: expected shape ({batch}, topk), got {tuple(indices.shape)}")
    if indices.shape[1] == 0:
        return torch.full((batch, 1), -1, dtype=torch.int32)
    bad = (indices < -1) | (indices >= tokens)
    if bool(bad.any()):
        raise ValueError(
            f"indices: expected chunk-local indices in [-1, {tokens}), got "
            f"{indices[bad][:5].tolist()}"
        )
    return indices.to(torch.int32).contiguous().cpu()


def lse_of_ml(m, l) -> torch.Tensor:
    """Deprecated: the wire's own :func:`mqnc.transport.wire.lse_of_stat` (a reply's ``lse``
    comes from :func:`mqnc.transport.wire.partial_lse`)."""
    warnings.warn(
        "mqnc.serving.route.lse_of_ml is deprecated: use mqnc.transport.wire.lse_of_stat "
        "(or wire.partial_lse for a reply)",
        DeprecationWarning,
        stacklevel=2,
    )
    return wire.lse_of_stat(m, l)


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
    crc: bool | None = None,
) -> tuple[int, Callable[[int, int], torch.Tensor]]:
    """Check a route of ``q`` (already checked by :func:`check_query`) over chunk ``info``
    and return ``(M_q, make)``: ``make(request_id, seq)`` packs the ``ROUTE`` message (the
    copy to the host included, so that it counts as transfer time; a payload CRC unless
    ``crc`` is False). ``ops`` runs the rotation (:func:`mqnc.serving.compute.kernel_ops`)."""
    if not (type(layer) is int and 0 <= layer < geometry.layers):  # else: an int-like, or why
        layer = check_int("layer", layer, minimum=0, below=geometry.layers)
    if offset is not None:  # an int: a float would be rotated by its truncation
        offset = check_int("offset", offset, minimum=0)
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
    B, H, _ = q.shape
    idx = None if indices is None else check_selection(indices, B, info.tokens)
    # The holder attends at canonical positions: rotate q by -(new - old) (§3.2).
    qr = ops.rope_rotate(q, -(offset - info.position), rope) if moved else q
    host = qr.is_cpu
    if not (host and qr.is_contiguous()):  # (even a no-op torch call costs on this path)
        qr = qr.contiguous()
    # the bytes of the rows and of the selection, checked above, packed unchecked (no second
    # check on the per-call path)
    qb = _row_bytes(qr, B) if host else None
    idxb = None if idx is None else idx.numpy()
    dtype, chunk_id = q.dtype, info.chunk_id
    flags = wire.format_flags(geometry)  # the holder refuses a route from another cache format

    def make(rid: int, seq: int) -> np.ndarray:
        return wire.pack_query_arrays(
            qb if host else _row_bytes(qr.cpu(), B),  # (a copy to the host is transfer time)
            idxb, dtype=dtype, heads=H, width=geometry.d_qk, request_id=rid, seq=seq,
            chunk_id=chunk_id, layer=layer, crc=crc, flags=flags,
            array=True,  # put as it is: no torch call on the way to the engine
        )  # fmt: skip

    return B * H, make


def _row_bytes(q: torch.Tensor, batch: int) -> np.ndarray:
    """The bytes of contiguous host rows ``[batch, H, D]``: ``[batch, H * D * itemsize]``
    uint8."""
    return q.view(torch.uint8).numpy().reshape(batch, -1)


def route_reply(
    p: Pending,
    h: wire.Header,
    buf: torch.Tensor,
    *,
    geometry: MLAGeometry,
    device,
    dtype: torch.dtype | None = None,
) -> Partial:
    """The partial in a ``PARTIAL`` reply to ``p`` (header ``h`` already checked by the
    client), its record's terms filled in: the holder's compute (from the header), the return
    (arrival less compute) and the whole call. A reply whose ``(batch, heads)`` is not the
    request's, or whose dtype is not ``dtype``, is a :class:`RemoteError`."""
    t_recv = time.perf_counter()
    if p.shape is not None and (h.batch, h.heads) != p.shape:
        raise RemoteError(
            f"holder {p.peer}: PARTIAL of shape ({h.batch}, {h.heads}) for a request of shape "
            f"{p.shape}"
        )
    if dtype is not None and h.dtype != dtype:
        raise RemoteError(f"holder {p.peer}: PARTIAL in {h.dtype} for a {dtype} request")
    o, lse = wire.partial_lse(buf, h)
    rec: CostRecord = p.record
    rec.bytes_recv = h.nbytes
    rec.compute_us = h.holder_ns / 1e3
    rec.return_us = max((t_recv - p.t_sent) * 1e6 - rec.compute_us, 0.0)
    rec.total_us = (t_recv - p.t0) * 1e6
    if device.type != "cpu":
        o, lse = o.to(device), lse.to(device)
    return Partial(o, lse, "route", p.peer, rec)
