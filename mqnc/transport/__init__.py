"""Transport engines behind one protocol (§3.1, §6): loopback, torch.distributed, NVSHMEM.

- :mod:`mqnc.transport.base`: the protocol (symmetric slots, put + signal, waits with
  timeouts, get, quiet, barrier) and the slot layout.
- :mod:`mqnc.transport.loopback`: in-process threads (unit tests, single-process demo).
- :mod:`mqnc.transport.torchdist`: multi-process over ``torch.distributed`` (gloo on CPU).
- :mod:`mqnc.transport.nvshmem`: GPU only, nvshmem4py; imported lazily (``import
  mqnc.transport.nvshmem`` never imports ``nvshmem.core``; creating an engine does).
"""

from __future__ import annotations

from mqnc.geometry import MLAGeometry
from mqnc.transport.base import (
    INBOX,
    REPLY,
    PeerLost,
    SlotLayout,
    Transport,
    TransportError,
    TransportTimeout,
)
from mqnc.transport.loopback import LoopbackFabric, LoopbackTransport

__all__ = [
    "INBOX",
    "REPLY",
    "PeerLost",
    "SlotLayout",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "LoopbackFabric",
    "LoopbackTransport",
    "slot_bytes_for",
]


def slot_bytes_for(
    geometry: MLAGeometry,
    *,
    max_rows: int,
    max_topk: int = 0,
    max_batch: int | None = None,
    max_chunk_tokens: int = 0,
    fetch_layers: int | None = None,
) -> int:
    """Slot capacity for the largest message a session sends (sizes from the geometry).

    Parameters
    ----------
    geometry : MLAGeometry
    max_rows : int
        Largest routed ``M_q = B * H`` (a ``ROUTE`` is ``M_q * q`` bytes, its ``PARTIAL``
        ``M_q * p``).
    max_topk, max_batch : int
        Largest selection per query token and query-token count ``B`` (for the indices).
    max_chunk_tokens : int
        Largest chunk a ``fetch`` pulls (0: no fetches).
    fetch_layers : int or None
        Layers per fetch (default all ``L``).
    """
    from mqnc.wire import HEADER_BYTES

    b = max_rows if max_batch is None else max_batch
    route = max_rows * geometry.q_row_bytes + b * max_topk * 4
    partial = max_rows * geometry.p_row_bytes
    layers = geometry.layers if fetch_layers is None else fetch_layers
    chunk = geometry.chunk_bytes(max_chunk_tokens, layers)
    return HEADER_BYTES + max(route, partial, chunk, 4096)
