"""What the serving primitives hand around: where a chunk lives, a chunk in a requester's pool,
a partial result, and the cost record of one call (§4's terms, for ``mqnc fit``)."""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = [
    "ChunkInfo",
    "LocalChunk",
    "Partial",
    "CostRecord",
    "cost_samples",
    "BoundedList",
    "RecentCounts",
]


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    """Where a chunk lives: its id, length, canonical position and holders (replicas first
    to last in order of preference), and what it holds when known: ``fingerprint``, a digest
    of the corpus' content up to the chunk's end (:meth:`mqnc.serving.Corpus.directory`; None
    when the corpus carries no token ids). Requester-side only: nothing of it goes on the wire."""

    chunk_id: int
    tokens: int
    position: int
    holders: tuple[int, ...]
    fingerprint: str | None = None

    def same_chunk(self, other: ChunkInfo) -> bool:
        """Both describe the same chunk: equal id, length, position and holders, and equal
        fingerprints where both have one."""
        where = (self.chunk_id, self.tokens, self.position, tuple(self.holders))
        if where != (other.chunk_id, other.tokens, other.position, tuple(other.holders)):
            return False
        return (
            None in (self.fingerprint, other.fingerprint) or self.fingerprint == other.fingerprint
        )


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
    that holder (NaN when never probed). ``transfer_us``: pack + put of the request (the
    packing alone for ``route``, ``probe`` and ``fetch``, whose put goes out fused with the
    wait for the reply, ``Transport.put_signal_wait``; ``route_many``'s puts are separate);
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

    def fail(self, exc: BaseException) -> None:
        """Mark the call failed with ``exc`` (its type and message kept in ``error``)."""
        self.ok = False
        self.error = f"{type(exc).__name__}: {exc}"


@dataclasses.dataclass
class Partial:
    """A partial result: ``o [B, H, d_v]`` (q's dtype) and natural-log ``lse [B, H]`` fp32,
    with how it was obtained."""

    o: torch.Tensor
    lse: torch.Tensor
    primitive: str
    peer: int | None
    record: CostRecord | None = None


def cost_samples(costs: list[CostRecord], primitive: str = "route") -> list[tuple[int, float]]:
    """``(M_q, total_us)`` of every successful call of ``primitive`` (for
    :func:`mqnc.cost.fit`)."""
    return [(c.m_q, c.total_us) for c in costs if c.primitive == primitive and c.ok]


class BoundedList(list):
    """A list that keeps its last ``cap`` items (a long-running requester's cost records, a
    holder's batch sizes: memory that must not grow for as long as the service runs):
    appending past ``2 * cap`` drops the oldest, so an append stays O(1) amortised and the list
    never holds more than ``2 * cap`` items. Every other list operation is a list's."""

    def __init__(self, cap: int, items=()) -> None:
        super().__init__(items)
        if not (isinstance(cap, int) and cap >= 1):
            raise ValueError(f"cap: expected an int >= 1, got {cap!r}")
        self.cap = cap

    def append(self, item) -> None:
        super().append(item)
        if len(self) > 2 * self.cap:
            del self[: len(self) - self.cap]


class RecentCounts(dict):
    """``{key: count}`` over the last ``cap`` keys counted (a holder's answers per request
    id): a missing key reads 0 (as ``defaultdict(int)``); past ``cap`` keys the oldest is
    forgotten, so the map stays bounded however long a holder serves."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def __missing__(self, key) -> int:
        return 0

    def __setitem__(self, key, value) -> None:
        if key not in self and len(self) >= self.cap:
            del self[next(iter(self))]
        super().__setitem__(key, value)
