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
- :mod:`mqnc.transport.registry`: the engines by name (every ``--transport``, option parser,
  demo and the service read them) and the factory that builds one (:func:`open_fabric` for
  in-process engines, :func:`connect` for one rank of a cross-process engine), importing the
  engine's module only then. Torch-free, as is this package's import: the protocol, the engines
  and the wire above are re-exported on first use.
"""

from __future__ import annotations

import importlib

from mqnc.base.lazy import lazy_exports
from mqnc.model.geometry import MLAGeometry
from mqnc.transport.registry import (
    AUTO,
    ENGINES,
    Engine,
    connect,
    describe,
    engine,
    names,
    open_fabric,
    select,
    unavailable,
)

# Everything that imports torch (the protocol, the engines, the wire) is re-exported lazily, so
# that the registry above is read without torch (``mqnc --help``, the option parsers).
_LAZY = {
    **dict.fromkeys(
        ("INBOX", "REPLY", "PeerLost", "SlotLayout", "Transport", "TransportError",
         "TransportTimeout", "check_message"),
        ".protocol",
    ),
    "LoopbackFabric": ".loopback",
    "LoopbackTransport": ".loopback",
    "TorchDistTransport": ".torchdist",
    "free_port_store": ".torchdist",
    "NvshmemTransport": ".nvshmem",  # imports triton (its device kernels)
    "nvshmem_available": ".nvshmem",
}  # fmt: skip
_SUBMODULES = ("wire", "protocol", "signals", "loopback", "torchdist", "nvshmem")
_names = lazy_exports(__name__, _LAZY)


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:  # ``mqnc.transport.wire`` after a bare ``import mqnc.transport``
        return importlib.import_module(f"{__name__}.{name}")
    return _names(name)


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
    "AUTO",
    "ENGINES",
    "Engine",
    "connect",
    "describe",
    "engine",
    "names",
    "open_fabric",
    "select",
    "unavailable",
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
    from mqnc.transport import wire

    b = max_rows if max_batch is None else max_batch
    route = max_rows * geometry.q_row_bytes + b * max_topk * 4
    partial = max_rows * geometry.p_row_bytes
    layers = geometry.layers if fetch_layers is None else fetch_layers
    chunk = geometry.chunk_bytes(max_chunk_tokens, layers)
    return wire.HEADER_BYTES + max(route, partial, chunk, 4096)
