"""The wire and the transport layer (§3.1-§3.2, §6): the bytes a message is, and the engines
that move them behind one protocol.

- :mod:`mqnc.transport.wire`: fixed-layout messages (probe, route rows, the collapsed partial,
  chunk, error), checked before any payload is trusted.
- :mod:`mqnc.transport.protocol`: the protocol (symmetric slots, put + signal, waits with
  timeouts, get, quiet, barrier, a put fused with its wait) and the slot layout.
- :mod:`mqnc.transport.signals`: a rank's signals and the threads waiting on them.
- :mod:`mqnc.transport.loopback`: in-process threads (unit tests, single-process demo).
- :mod:`mqnc.transport.torchdist`: multi-process over ``torch.distributed`` (gloo on CPU);
  its per-peer receiving and sending halves are :mod:`mqnc.transport._gloo`.
- :mod:`mqnc.transport.nvshmem`: GPU only, nvshmem4py; imported lazily (``import
  mqnc.transport.nvshmem`` never imports ``nvshmem.core``; creating an engine does).
"""

from __future__ import annotations

from mqnc.base.lazy import lazy_exports
from mqnc.model.geometry import MLAGeometry
from mqnc.transport import wire
from mqnc.transport.loopback import LoopbackFabric, LoopbackTransport
from mqnc.transport.protocol import (
    INBOX,
    REPLY,
    PeerLost,
    SlotLayout,
    Transport,
    TransportError,
    TransportTimeout,
    check_message,
)
from mqnc.transport.torchdist import TorchDistTransport, free_port_store

# The NVSHMEM engine's module imports triton (its device kernels): re-exported lazily.
__getattr__ = lazy_exports(
    __name__, {"NvshmemTransport": ".nvshmem", "nvshmem_available": ".nvshmem"}
)

__all__ = [
    "INBOX",
    "REPLY",
    "PeerLost",
    "SlotLayout",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "check_message",
    "wire",
    "LoopbackFabric",
    "LoopbackTransport",
    "TorchDistTransport",
    "free_port_store",
    "NvshmemTransport",
    "nvshmem_available",
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
    b = max_rows if max_batch is None else max_batch
    route = max_rows * geometry.q_row_bytes + b * max_topk * 4
    partial = max_rows * geometry.p_row_bytes
    layers = geometry.layers if fetch_layers is None else fetch_layers
    chunk = geometry.chunk_bytes(max_chunk_tokens, layers)
    return wire.HEADER_BYTES + max(route, partial, chunk, 4096)
