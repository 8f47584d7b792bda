"""The requester's fallback policy: attend one chunk by the first primitive that succeeds,
over the chunk's replicas, skipping holders that failed recently (§8: a request is never
silently dropped).

``route`` and ``fetch`` try each holder of the chunk in turn (holders that failed within
``suspect_s`` are skipped unless none is left); ``local`` needs the requester's model. A chunk
already fetched or re-prefilled at the offset is attended locally at once (unless the caller
passes ``held=False``: a route it asked for goes to a holder).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from mqnc.base.checks import check_int
from mqnc.serving.records import Partial
from mqnc.transport.protocol import PeerLost, TransportError

__all__ = ["AllPrimitivesFailed", "Suspects", "attend_with_fallback", "PRIMITIVES"]

PRIMITIVES = ("route", "fetch", "local")


class AllPrimitivesFailed(TransportError):
    """Every primitive and replica the policy allowed failed; ``errors`` lists why."""

    def __init__(self, message: str, errors: list[tuple[str, int | None, BaseException]]):
        super().__init__(message)
        self.errors = errors


class Suspects:
    """Holders that failed recently: skipped for ``suspect_s`` seconds after a failure."""

    def __init__(self, suspect_s: float) -> None:
        self.suspect_s = float(suspect_s)
        self._until: dict[int, float] = {}

    def mark(self, peer: int) -> None:
        self._until[peer] = time.monotonic() + self.suspect_s

    def healthy(self, holders: Sequence[int]) -> list[int]:
        """``holders`` without the suspects, or all of them when every one is suspect."""
        now = time.monotonic()
        ok = [h for h in holders if self._until.get(h, 0.0) <= now]
        return ok or list(holders)


def attend_with_fallback(
    req,
    chunk_id: int,
    q: torch.Tensor,
    layer: int,
    *,
    offset: int | None,
    indices: torch.Tensor | None,
    order: Sequence[str],
    held: bool = True,
) -> Partial:
    """:meth:`mqnc.serving.Requester.attend` (see there); ``req`` is the requester."""
    bad = [p for p in order if p not in PRIMITIVES]
    if bad:
        raise ValueError(f"order: expected 'route', 'fetch' or 'local', got {bad[0]!r}")
    info = req.lookup(chunk_id)
    if offset is None or indices is not None:
        off = info.position
    else:
        off = check_int("offset", offset, minimum=0)
    if held and (chunk_id, off) in req.local_chunks:
        return req.attend_local(req.local_chunks[(chunk_id, off)], q, layer, indices=indices)
    peers = req.suspects.healthy(info.holders)
    errors: list[tuple[str, int | None, BaseException]] = []
    for prim in order:
        if prim == "local":
            if req.model is None:
                continue
            try:
                return req.attend_local(req.local(chunk_id, offset=off), q, layer, indices=indices)
            except (TransportError, ValueError) as exc:
                errors.append(("local", None, exc))
            continue
        for peer in peers:
            try:
                if prim == "route":
                    route_offset = None if indices is not None else offset
                    return req.route(
                        chunk_id, q, layer, offset=route_offset, indices=indices, peer=peer
                    )
                part = req.attend_local(
                    req.fetch(chunk_id, offset=off, peer=peer), q, layer, indices=indices
                )
                part.peer = peer
                return part
            except (TransportError, PeerLost) as exc:
                errors.append((prim, peer, exc))
    lines = "; ".join(f"{p}@{r}: {e}" for p, r, e in errors)
    raise AllPrimitivesFailed(f"chunk {chunk_id}: every primitive failed ({lines})", errors)
