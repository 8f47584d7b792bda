"""The wire format of probe, route and fetch: one contiguous byte buffer per message (§3.2, §5.3).

Every message is a fixed-layout little-endian header of :data:`HEADER_BYTES` bytes followed by
its payload; nothing on the data path is pickled. The header is checked on receipt (magic,
version, header CRC, kind, dtype, sizes, layer range, geometry) before any payload byte is
trusted, and a malformed message raises :class:`WireError` (a ``ValueError``) for that message
only: a holder answers it with an ``ERROR`` message and carries on.

Payloads (``rows = batch * heads``; dims from :class:`mqnc.model.MLAGeometry`):

============  ==========================================================================
kind          payload
============  ==========================================================================
``PROBE``     none (the header is the probe's one put; ``PROBE_ACK`` answers it)
``ROUTE``     query rows ``q [batch, heads, d_qk]`` in the wire dtype (``q`` = 1152 B per
              row for DeepSeek), then, under selection, ``indices [batch, topk]`` int32
              (chunk-local token indices, ``-1`` unused)
``PARTIAL``   the collapsed response (§5.3): ``o [batch, heads, d_v]`` in the wire dtype,
              then ``m [batch, heads]`` fp32, then ``l [batch, heads]`` fp32, one buffer
              (``p`` = 1032 B per row), one put instead of three
``FETCH``     none (chunk id and layer range are in the header)
``CHUNK``     ``kv [layer_hi - layer_lo, batch (= c_t tokens), d_qk]`` in the cache dtype,
              cached at canonical positions starting at ``position``
``ERROR``     a UTF-8 message naming what was wrong
``SHUTDOWN``  none
============  ==========================================================================

Header fields (struct format :data:`HEADER_FORMAT`, padded to 96 bytes so that every payload
starts 16-byte aligned): magic ``b"MQNC"``, version, kind, dtype code, flags, request id
(u64), sequence (u64, the transport slot's monotonically increasing number), chunk id (u64),
batch (u32), heads (u32), width (u32), layer_lo / layer_hi (u16, the half-open layer range),
topk (u32), payload bytes (u64), position (i64), holder nanoseconds (u64: the holder's compute
time, reported in a ``PARTIAL`` for the requester's cost record), payload CRC-32 (u32, when
flag bit 0 is set; buffers packed on a GPU skip it) and header CRC-32 (u32, over the header
with this field zeroed, padding included).
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import zlib

import torch

from mqnc.base.checks import is_int
from mqnc.model.geometry import PRESETS, MLAGeometry

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER_FORMAT",
    "HEADER_BYTES",
    "Kind",
    "Header",
    "WireError",
    "WIRE_DTYPES",
    "parse_header",
    "message_bytes",
    "pack_probe",
    "pack_query",
    "unpack_query",
    "pack_partial",
    "unpack_partial",
    "pack_fetch",
    "pack_chunk",
    "unpack_chunk",
    "pack_error",
    "unpack_error",
    "pack_shutdown",
    "peek_length",
    "read_message",
    "query_payload_bytes",
    "partial_payload_bytes",
    "chunk_payload_bytes",
]

MAGIC = b"MQNC"
VERSION = 1
HEADER_FORMAT = "<4sHHHHQQQIIIHHIQqQII"
_STRUCT = struct.Struct(HEADER_FORMAT)
HEADER_BYTES = 96
_CRC_OFFSET = _STRUCT.size - 4  # header CRC is the last field
FLAG_PAYLOAD_CRC = 1

if _STRUCT.size > HEADER_BYTES:  # pragma: no cover - layout invariant
    raise ImportError(f"wire header struct is {_STRUCT.size} B, more than {HEADER_BYTES}")


class Kind(enum.IntEnum):
    """Message kinds."""

    PROBE = 1
    PROBE_ACK = 2
    ROUTE = 3
    PARTIAL = 4
    FETCH = 5
    CHUNK = 6
    ERROR = 7
    SHUTDOWN = 8


#: Wire dtype codes (header field ``dtype``) and their torch dtypes.
WIRE_DTYPES: dict[int, torch.dtype] = {1: torch.bfloat16, 2: torch.float16, 3: torch.float32}
_DTYPE_CODES = {v: k for k, v in WIRE_DTYPES.items()}
_GEOMETRY_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class WireError(ValueError):
    """A malformed, truncated or inconsistent message. Raised before any payload is used."""


@dataclasses.dataclass(frozen=True)
class Header:
    """The fixed-layout header of one message (see the module docstring for each field)."""

    kind: Kind
    request_id: int = 0
    seq: int = 0
    chunk_id: int = 0
    batch: int = 0
    heads: int = 0
    width: int = 0
    layer_lo: int = 0
    layer_hi: int = 0
    topk: int = 0
    payload_bytes: int = 0
    position: int = 0
    holder_ns: int = 0
    dtype: torch.dtype = torch.bfloat16
    flags: int = 0
    payload_crc: int = 0

    @property
    def rows(self) -> int:
        """``M_q`` rows of a route or partial: ``batch * heads``."""
        return self.batch * self.heads

    @property
    def nbytes(self) -> int:
        """Header plus payload: the message's length in its buffer."""
        return HEADER_BYTES + self.payload_bytes

    def pack(self) -> bytes:
        """The header's :data:`HEADER_BYTES` bytes, header CRC included."""
        raw = bytearray(HEADER_BYTES)
        _STRUCT.pack_into(
            raw,
            0,
            MAGIC,
            VERSION,
            int(self.kind),
            _DTYPE_CODES[self.dtype],
            self.flags,
            self.request_id,
            self.seq,
            self.chunk_id,
            self.batch,
            self.heads,
            self.width,
            self.layer_lo,
            self.layer_hi,
            self.topk,
            self.payload_bytes,
            self.position,
            self.holder_ns,
            self.payload_crc,
            0,
        )
        struct.pack_into("<I", raw, _CRC_OFFSET, _header_crc(bytes(raw)))
        return bytes(raw)


def _header_crc(raw: bytes) -> int:
    """CRC-32 of the whole 96-byte header (padding included) with the CRC field zeroed."""
    return zlib.crc32(raw[:_CRC_OFFSET] + b"\0\0\0\0" + raw[_CRC_OFFSET + 4 : HEADER_BYTES])


# ---- sizes (all derived from the geometry's dims, never typed in) --------------------------------


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def query_payload_bytes(batch: int, heads: int, width: int, topk: int, dtype: torch.dtype) -> int:
    """Bytes of a ``ROUTE`` payload: ``rows * q`` plus ``batch * topk`` int32 indices."""
    return batch * heads * width * _itemsize(dtype) + batch * topk * 4


def partial_payload_bytes(batch: int, heads: int, d_v: int, dtype: torch.dtype) -> int:
    """Bytes of a ``PARTIAL`` payload: ``rows * p`` with ``p = d_v * itemsize + 2 * 4``."""
    return batch * heads * (d_v * _itemsize(dtype) + 8)


def chunk_payload_bytes(layers: int, tokens: int, width: int, dtype: torch.dtype) -> int:
    """Bytes of a ``CHUNK`` payload: ``layers * tokens * b_KV``."""
    return layers * tokens * width * _itemsize(dtype)


def message_bytes(header: Header) -> int:
    """Length of the message ``header`` describes (header plus payload)."""
    return header.nbytes


def _expected_payload(h: Header) -> int | None:
    """Payload size the header's fields imply, or None where it is free-form (ERROR)."""
    if h.kind in (Kind.PROBE, Kind.PROBE_ACK, Kind.FETCH, Kind.SHUTDOWN):
        return 0
    if h.kind == Kind.ROUTE:
        return query_payload_bytes(h.batch, h.heads, h.width, h.topk, h.dtype)
    if h.kind == Kind.PARTIAL:
        return partial_payload_bytes(h.batch, h.heads, h.width, h.dtype)
    if h.kind == Kind.CHUNK:
        return chunk_payload_bytes(h.layer_hi - h.layer_lo, h.batch, h.width, h.dtype)
    return None


# ---- buffers -------------------------------------------------------------------------------------


def _check_buffer(buf: object) -> torch.Tensor:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"buf: expected a torch.Tensor of uint8, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise TypeError(f"buf: invalid dtype, expected uint8, got {str(buf.dtype)[6:]}")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"buf: expected a contiguous 1-D byte buffer, got shape {tuple(buf.shape)} "
            f"strides {buf.stride()}"
        )
    return buf


def _crc(buf: torch.Tensor) -> int:
    return zlib.crc32(buf.numpy()) if buf.numel() else 0


def _new_message(header: Header, device: torch.device | str | None) -> torch.Tensor:
    """A zeroed ``[nbytes]`` uint8 buffer (the header is written by :func:`_seal`)."""
    return torch.zeros(header.nbytes, dtype=torch.uint8, device=device)


def _seal(buf: torch.Tensor, header: Header) -> torch.Tensor:
    """Write the header (with the payload CRC when the buffer is host memory) into ``buf``."""
    if buf.device.type == "cpu":
        header = dataclasses.replace(
            header, flags=header.flags | FLAG_PAYLOAD_CRC, payload_crc=_crc(buf[HEADER_BYTES:])
        )
    raw = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
    buf[:HEADER_BYTES].copy_(raw)
    return buf


def _payload_view(buf: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape):
    part = buf[HEADER_BYTES + offset : HEADER_BYTES + offset + nbytes]
    return part.view(dtype).view(shape)


def _write(buf: torch.Tensor, offset: int, t: torch.Tensor) -> int:
    """Copy ``t``'s bytes into the payload at ``offset``; returns the next offset."""
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    buf[HEADER_BYTES + offset : HEADER_BYTES + offset + n].copy_(flat)
    return offset + n


# Over 60 lines by its numpy docstring (26); the body is the header's checks in order (37 lines).
def parse_header(
    buf: torch.Tensor,
    *,
    geometry: MLAGeometry | None = None,
    expect: Kind | tuple[Kind, ...] | None = None,
    check_payload: bool = True,
) -> Header:
    """Read and check the header of the message at the start of ``buf``.

    Parameters
    ----------
    buf : torch.Tensor
        ``[n]`` uint8, contiguous: a message, or a transport slot holding one (``n`` may exceed
        the message's length).
    geometry : MLAGeometry or None
        When given, the ``width`` and layer range must fit it (``d_qk`` for ROUTE and CHUNK,
        ``d_v`` for PARTIAL, layers within ``[0, geometry.layers]``).
    expect : Kind or tuple of Kind or None
        Accepted kinds (``ERROR`` is always accepted, so that a remote error reaches the
        caller).
    check_payload : bool
        Verify the payload CRC when the header carries one (host buffers only).

    Returns
    -------
    Header

    Raises
    ------
    WireError
        Truncated buffer, bad magic/version/CRC, unknown kind or dtype, payload size that does
        not match the fields, or fields that do not fit ``geometry``.
    """
    buf = _check_buffer(buf)
    if buf.numel() < HEADER_BYTES:
        raise WireError(
            f"buf: truncated message, expected at least {HEADER_BYTES} header bytes, "
            f"got {buf.numel()}"
        )
    h = _decode(bytes(buf[:HEADER_BYTES].cpu().numpy()))
    if expect is not None:
        kinds = (expect,) if isinstance(expect, Kind) else tuple(expect)
        if h.kind not in kinds and h.kind != Kind.ERROR:
            raise WireError(
                f"buf: unexpected message kind, expected {[k.name for k in kinds]}, "
                f"got {h.kind.name}"
            )
    if h.layer_hi < h.layer_lo:
        raise WireError(f"buf: bad layer range [{h.layer_lo}, {h.layer_hi})")
    want = _expected_payload(h)
    if want is not None and h.payload_bytes != want:
        raise WireError(
            f"buf: {h.kind.name} payload size mismatch, the header's fields imply {want} B, "
            f"the header says {h.payload_bytes} B"
        )
    if buf.numel() < h.nbytes:
        raise WireError(
            f"buf: truncated {h.kind.name} message, expected {h.nbytes} B "
            f"({HEADER_BYTES} header + {h.payload_bytes} payload), got {buf.numel()}"
        )
    if geometry is not None:
        _check_geometry(h, geometry)
    if check_payload and h.flags & FLAG_PAYLOAD_CRC and buf.device.type == "cpu":
        got = _crc(buf[HEADER_BYTES : h.nbytes])
        if got != h.payload_crc:
            raise WireError(
                f"buf: {h.kind.name} payload CRC mismatch (stored {h.payload_crc:#010x}, "
                f"computed {got:#010x}): corrupt payload"
            )
    return h


# The struct's fields after (magic, version, kind, dtype code), in order, as Header fields.
_FIELDS = (
    "flags",
    "request_id",
    "seq",
    "chunk_id",
    "batch",
    "heads",
    "width",
    "layer_lo",
    "layer_hi",
    "topk",
    "payload_bytes",
    "position",
    "holder_ns",
    "payload_crc",
)


def _decode(raw: bytes) -> Header:
    """The header in ``raw`` (96 bytes), after checking magic, version, CRC, kind and dtype."""
    magic, version, kind, dtype_code, *rest, header_crc = _STRUCT.unpack_from(raw, 0)
    if magic != MAGIC:
        raise WireError(f"buf: bad magic, expected {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise WireError(f"buf: unsupported wire version, expected {VERSION}, got {version}")
    if _header_crc(raw) != header_crc:
        raise WireError(
            f"buf: header CRC mismatch (stored {header_crc:#010x}, computed "
            f"{_header_crc(raw):#010x}): corrupt header"
        )
    try:
        kind = Kind(kind)
    except ValueError:
        raise WireError(f"buf: unknown message kind {kind}") from None
    if dtype_code not in WIRE_DTYPES:
        raise WireError(
            f"buf: unknown dtype code {dtype_code}, expected one of {sorted(WIRE_DTYPES)}"
        )
    return Header(kind=kind, dtype=WIRE_DTYPES[dtype_code], **dict(zip(_FIELDS, rest, strict=True)))


def peek_length(head: torch.Tensor) -> int | None:
    """Length of the message whose header starts ``head`` (>= 96 bytes), or None when the
    header is not valid (magic, version or header CRC wrong): read that much, then
    :func:`parse_header` checks everything."""
    head = _check_buffer(head)
    if head.numel() < HEADER_BYTES:
        return None
    raw = bytes(head[:HEADER_BYTES].cpu().numpy())
    fields = _STRUCT.unpack_from(raw, 0)
    if fields[0] != MAGIC or fields[1] != VERSION or _header_crc(raw) != fields[-1]:
        return None
    return HEADER_BYTES + int(fields[14])


def read_message(transport, slot: int) -> torch.Tensor:
    """Copy the message in a local transport slot: its header first, then exactly its length
    (the whole slot when the header is not valid, so that the caller's check reports why)."""
    n = peek_length(transport.read(slot, HEADER_BYTES))
    if n is None or n > transport.slot_bytes:
        return transport.read(slot)
    return transport.read(slot, n)


def _check_geometry(h: Header, g: MLAGeometry) -> None:
    want = {Kind.ROUTE: g.d_qk, Kind.CHUNK: g.d_qk, Kind.PARTIAL: g.d_v}.get(h.kind)
    if want is not None and h.width != want:
        raise WireError(
            f"buf: {h.kind.name} row width {h.width} does not fit geometry {g.name!r} "
            f"(expected {want})"
        )
    if h.kind in (Kind.ROUTE, Kind.PARTIAL, Kind.FETCH, Kind.CHUNK) and h.layer_hi > g.layers:
        raise WireError(
            f"buf: layer range [{h.layer_lo}, {h.layer_hi}) outside geometry {g.name!r} "
            f"({g.layers} layers)"
        )


def _geometry(geometry: MLAGeometry | None) -> MLAGeometry:
    g = PRESETS["deepseek-v2-lite"] if geometry is None else geometry
    if not isinstance(g, MLAGeometry):
        raise TypeError(f"geometry: expected an MLAGeometry, got {type(g).__name__}")
    return g


def _check_ids(**ids: int) -> None:
    limits = {"position": (-(2**63), 2**63 - 1), "layer": (0, 2**16 - 1)}
    for name, v in ids.items():
        if not is_int(v):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        lo, hi = limits.get(name, (0, 2**64 - 1))
        if not lo <= int(v) <= hi:
            raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {v}")


def _check_indices(indices: object, q: torch.Tensor) -> int:
    """A route's selection ``[B, topk]`` int32 on q's device; returns ``topk``."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices: invalid dtype, expected int32, got {str(indices.dtype)[6:]}")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(
            f"indices: expected shape ({q.shape[0]}, topk), got {tuple(indices.shape)}"
        )
    if indices.device != q.device:
        raise ValueError(f"indices: expected device {q.device} (as q), got {indices.device}")
    return indices.shape[1]


def _check_stat(name: str, t: object, batch: int, heads: int) -> None:
    """A partial's ``m`` or ``l``: ``[batch, heads]`` float32."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name}: invalid dtype, expected float32, got {str(t.dtype)[6:]}")
    if tuple(t.shape) != (batch, heads):
        raise ValueError(f"{name}: expected shape ({batch}, {heads}), got {tuple(t.shape)}")


def _message_buffer(h: Header, out: torch.Tensor | None, device) -> torch.Tensor:
    """A new zeroed buffer for ``h``'s message, or the prefix of ``out`` (a staging slot)."""
    if out is None:
        return _new_message(h, device)
    out = _check_buffer(out)
    if out.numel() < h.nbytes:
        raise ValueError(f"out: expected at least {h.nbytes} bytes, got {out.numel()}")
    return out[: h.nbytes]


def _check_layers(layers: tuple[int, int], g: MLAGeometry) -> tuple[int, int]:
    if not isinstance(layers, (tuple, list)) or len(layers) != 2:
        raise TypeError(f"layers: expected a (lo, hi) pair, got {layers!r}")
    lo, hi = (int(x) for x in layers)
    if not 0 <= lo < hi <= g.layers:
        raise ValueError(f"layers: expected 0 <= lo < hi <= {g.layers}, got ({lo}, {hi})")
    return lo, hi


def _check_float(name: str, t: object, ndim: int, width: int | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPE_CODES:
        raise TypeError(
            f"{name}: invalid dtype, expected one of (bfloat16, float16, float32), got "
            f"{str(t.dtype)[6:]}"
        )
    if t.dim() != ndim or (width is not None and t.shape[-1] != width):
        want = f"{ndim} dims" + ("" if width is None else f" with last dim {width}")
        raise ValueError(f"{name}: expected {want}, got shape {tuple(t.shape)}")
    return t


# ---- probe ---------------------------------------------------------------------------------------


def pack_probe(*, request_id: int, seq: int, ack: bool = False, device=None) -> torch.Tensor:
    """A ``PROBE`` (or ``PROBE_ACK``) message: the header alone, ``[96]`` uint8."""
    _check_ids(request_id=request_id, seq=seq)
    h = Header(Kind.PROBE_ACK if ack else Kind.PROBE, request_id=request_id, seq=seq)
    return _seal(_new_message(h, device), h)


def pack_shutdown(*, request_id: int = 0, seq: int = 0, device=None) -> torch.Tensor:
    """A ``SHUTDOWN`` message (asks a holder's service loop to stop)."""
    _check_ids(request_id=request_id, seq=seq)
    h = Header(Kind.SHUTDOWN, request_id=request_id, seq=seq)
    return _seal(_new_message(h, device), h)


# ---- route: query rows ---------------------------------------------------------------------------


def pack_query(
    q: torch.Tensor,
    *,
    request_id: int,
    seq: int,
    chunk_id: int,
    layer: int,
    indices: torch.Tensor | None = None,
    geometry: MLAGeometry | None = None,
) -> torch.Tensor:
    """Pack ``M_q = B * H`` absorbed query rows (and a selection) into one ``ROUTE`` message.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, H, d_qk]`` query rows (576 wide for DeepSeek), bf16 / fp16 / fp32, already
        rotated by the opposite of the chunk's delta (§3.2): the holder is position-oblivious.
    request_id, seq, chunk_id : int
        Request id (echoed by the holder), the slot's sequence number, the chunk to attend.
    layer : int
        The layer whose cache the rows attend (the header carries ``[layer, layer + 1)``).
    indices : torch.Tensor or None
        ``[B, topk]`` int32 chunk-local token indices (``-1`` unused) for selection (§5.4);
        None for dense attention over the whole chunk.
    geometry : MLAGeometry or None
        Dims (default DeepSeek-V2-Lite); ``q``'s last dim must be ``d_qk``.

    Returns
    -------
    torch.Tensor
        ``[96 + B * H * q_row_bytes + B * topk * 4]`` uint8 on ``q``'s device.
    """
    g = _geometry(geometry)
    _check_float("q", q, 3, g.d_qk)
    _check_ids(request_id=request_id, seq=seq, chunk_id=chunk_id, layer=layer)
    lo, hi = _check_layers((layer, layer + 1), g)
    B, H, D = q.shape
    topk = 0 if indices is None else _check_indices(indices, q)
    h = Header(
        Kind.ROUTE,
        request_id=request_id,
        seq=seq,
        chunk_id=chunk_id,
        batch=B,
        heads=H,
        width=D,
        layer_lo=lo,
        layer_hi=hi,
        topk=topk,
        payload_bytes=query_payload_bytes(B, H, D, topk, q.dtype),
        dtype=q.dtype,
    )
    buf = _new_message(h, q.device)
    off = _write(buf, 0, q)
    if topk:
        _write(buf, off, indices)
    return _seal(buf, h)


def unpack_query(
    buf: torch.Tensor, *, geometry: MLAGeometry | None = None
) -> tuple[Header, torch.Tensor, torch.Tensor | None]:
    """Check and unpack a ``ROUTE`` message.

    Returns
    -------
    header : Header
    q : torch.Tensor
        ``[B, H, d_qk]`` in the wire dtype, a view into ``buf``.
    indices : torch.Tensor or None
        ``[B, topk]`` int32 view, or None for dense.
    """
    h = parse_header(buf, geometry=geometry, expect=Kind.ROUTE)
    if h.kind == Kind.ERROR:
        raise WireError(f"buf: expected a ROUTE message, got ERROR: {unpack_error(buf)[1]}")
    nq = h.rows * h.width * _itemsize(h.dtype)
    q = _payload_view(buf, 0, nq, h.dtype, (h.batch, h.heads, h.width))
    idx = None
    if h.topk:
        idx = _payload_view(buf, nq, h.batch * h.topk * 4, torch.int32, (h.batch, h.topk))
    return h, q, idx


# ---- route: the collapsed response ---------------------------------------------------------------


# Over 60 lines by its numpy docstring (22) and signature; the body is 26 lines.
def pack_partial(
    o: torch.Tensor,
    m: torch.Tensor,
    l: torch.Tensor,
    *,
    request_id: int,
    seq: int,
    chunk_id: int = 0,
    layer: int = 0,
    holder_ns: int = 0,
    geometry: MLAGeometry | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack a partial ``(o, m, l)`` as ONE contiguous ``PARTIAL`` message (§5.3).

    Parameters
    ----------
    o : torch.Tensor
        ``[B, H, d_v]`` partial output (512 wide), bf16 / fp16 / fp32.
    m, l : torch.Tensor
        ``[B, H]`` float32 running max and softmax denominator (``lse = m + log(l)``, natural
        log; ``l = 0`` for an empty partial). ``mqnc.triton_kernels.ml_from_lse`` converts.
    request_id, seq, chunk_id, layer : int
        Echoed from the ``ROUTE`` this answers.
    holder_ns : int
        The holder's compute time for this partial's kernel call (for the cost record).
    out : torch.Tensor or None
        A ``[n >= 96 + B * H * p_row_bytes]`` uint8 buffer to pack into (a staging slot);
        a new one is allocated when None.

    Returns
    -------
    torch.Tensor
        ``[96 + B * H * p_row_bytes]`` uint8 (a prefix view of ``out`` when given).
    """
    g = _geometry(geometry)
    _check_float("o", o, 3, g.d_v)
    B, H, Dv = o.shape
    _check_stat("m", m, B, H)
    _check_stat("l", l, B, H)
    _check_ids(request_id=request_id, seq=seq, chunk_id=chunk_id, layer=layer, holder_ns=holder_ns)
    lo, hi = _check_layers((layer, layer + 1), g)
    h = Header(
        Kind.PARTIAL,
        request_id=request_id,
        seq=seq,
        chunk_id=chunk_id,
        batch=B,
        heads=H,
        width=Dv,
        layer_lo=lo,
        layer_hi=hi,
        payload_bytes=partial_payload_bytes(B, H, Dv, o.dtype),
        holder_ns=holder_ns,
        dtype=o.dtype,
    )
    buf = _message_buffer(h, out, o.device)
    off = _write(buf, 0, o)
    off = _write(buf, off, m)
    _write(buf, off, l)
    return _seal(buf, h)


def unpack_partial(
    buf: torch.Tensor, *, geometry: MLAGeometry | None = None
) -> tuple[Header, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check and unpack a ``PARTIAL`` message.

    Returns
    -------
    header : Header
    o : torch.Tensor
        ``[B, H, d_v]`` in the wire dtype (view into ``buf``).
    m, l : torch.Tensor
        ``[B, H]`` float32 (views into ``buf``).

    Raises
    ------
    WireError
        Malformed message, or an ``ERROR`` message (its text in the exception).
    """
    h = parse_header(buf, geometry=geometry, expect=Kind.PARTIAL)
    if h.kind == Kind.ERROR:
        raise WireError(f"remote error for request {h.request_id}: {unpack_error(buf)[1]}")
    no = h.rows * h.width * _itemsize(h.dtype)
    o = _payload_view(buf, 0, no, h.dtype, (h.batch, h.heads, h.width))
    m = _payload_view(buf, no, h.rows * 4, torch.float32, (h.batch, h.heads))
    l = _payload_view(buf, no + h.rows * 4, h.rows * 4, torch.float32, (h.batch, h.heads))
    return h, o, m, l


# ---- fetch ---------------------------------------------------------------------------------------


def pack_fetch(
    *,
    request_id: int,
    seq: int,
    chunk_id: int,
    layers: tuple[int, int] | None = None,
    geometry: MLAGeometry | None = None,
    device=None,
) -> torch.Tensor:
    """A ``FETCH`` request for layers ``[lo, hi)`` of a chunk (default: all ``L``, §2.2)."""
    g = _geometry(geometry)
    _check_ids(request_id=request_id, seq=seq, chunk_id=chunk_id)
    lo, hi = _check_layers((0, g.layers) if layers is None else layers, g)
    h = Header(
        Kind.FETCH, request_id=request_id, seq=seq, chunk_id=chunk_id, layer_lo=lo, layer_hi=hi
    )
    return _seal(_new_message(h, device), h)


def pack_chunk(
    kv: torch.Tensor,
    *,
    request_id: int,
    seq: int,
    chunk_id: int,
    layers: tuple[int, int],
    position: int,
    geometry: MLAGeometry | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack a chunk's cache entries ``kv [n_layers, c_t, d_qk]`` as one ``CHUNK`` message.

    ``position`` is the canonical position of the chunk's first token (the splice's ``old``
    position, §2.2); ``layers`` the half-open range the ``n_layers`` slices cover.
    """
    g = _geometry(geometry)
    _check_float("kv", kv, 3, g.d_qk)
    lo, hi = _check_layers(layers, g)
    if kv.shape[0] != hi - lo:
        raise ValueError(f"kv: expected {hi - lo} layers (range [{lo}, {hi})), got {kv.shape[0]}")
    _check_ids(request_id=request_id, seq=seq, chunk_id=chunk_id, position=position)
    nl, ct, D = kv.shape
    h = Header(
        Kind.CHUNK,
        request_id=request_id,
        seq=seq,
        chunk_id=chunk_id,
        batch=ct,
        width=D,
        layer_lo=lo,
        layer_hi=hi,
        payload_bytes=chunk_payload_bytes(nl, ct, D, kv.dtype),
        position=position,
        dtype=kv.dtype,
    )
    buf = _message_buffer(h, out, kv.device)
    _write(buf, 0, kv)
    return _seal(buf, h)


def unpack_chunk(
    buf: torch.Tensor, *, geometry: MLAGeometry | None = None
) -> tuple[Header, torch.Tensor]:
    """Check and unpack a ``CHUNK`` message: ``(header, kv [n_layers, c_t, d_qk])`` (a view)."""
    h = parse_header(buf, geometry=geometry, expect=Kind.CHUNK)
    if h.kind == Kind.ERROR:
        raise WireError(f"remote error for request {h.request_id}: {unpack_error(buf)[1]}")
    nl = h.layer_hi - h.layer_lo
    kv = _payload_view(buf, 0, h.payload_bytes, h.dtype, (nl, h.batch, h.width))
    return h, kv


# ---- errors --------------------------------------------------------------------------------------


def pack_error(message: str, *, request_id: int, seq: int, chunk_id: int = 0) -> torch.Tensor:
    """An ``ERROR`` message answering request ``request_id`` (UTF-8 text, at most 4 KiB)."""
    _check_ids(request_id=request_id, seq=seq, chunk_id=chunk_id)
    data = str(message).encode("utf-8", errors="replace")[:4096]
    h = Header(
        Kind.ERROR, request_id=request_id, seq=seq, chunk_id=chunk_id, payload_bytes=len(data)
    )
    buf = _new_message(h, None)
    if data:
        buf[HEADER_BYTES:].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return _seal(buf, h)


def unpack_error(buf: torch.Tensor) -> tuple[Header, str]:
    """Check and unpack an ``ERROR`` message: ``(header, text)``."""
    h = parse_header(buf, expect=Kind.ERROR)
    text = bytes(buf[HEADER_BYTES : h.nbytes].cpu().numpy()).decode("utf-8", errors="replace")
    return h, text
