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
              cached at canonical positions starting at ``position``; from a geometry whose
              ``cache_dtype`` is ``"fp8_e4m3"``, the FP8 entries ``[.., .., b_KV]`` uint8
              (656 B a token for 512 + 64: ``mqnc.model.kv_format``), dtype code 4, ``width``
              the entry's bytes
``ERROR``     a UTF-8 message naming what was wrong
``SHUTDOWN``  none
============  ==========================================================================

The partial's statistic is the wire's own business: the kernels write a natural-log ``lse`` and
the requester merges one, while the message carries ``(m, l)`` with ``lse = m + log(l)``. The
holder hands :func:`pack_partial_lse` its ``lse`` (and which rows had keys) and the requester
gets an ``lse`` back from :func:`partial_lse`; the two conversions, :func:`stat_of_lse` and
:func:`lse_of_stat`, live here and nowhere else. :func:`pack_partial`,
:func:`pack_partial_arrays`, :func:`unpack_partial`, :func:`partial_views` and
:func:`partial_arrays` are the format's own level (any ``(m, l)`` a peer may send: what a test
forges, what a reader checks).

Header fields (struct format :data:`HEADER_FORMAT`, padded to 96 bytes so that every payload
starts 16-byte aligned): magic ``b"MQNC"``, version, kind, dtype code, flags, request id
(u64), sequence (u64, the transport slot's monotonically increasing number), chunk id (u64),
batch (u32), heads (u32), width (u32), layer_lo / layer_hi (u16, the half-open layer range),
topk (u32), payload bytes (u64), position (i64), holder nanoseconds (u64: the holder's compute
time, reported in a ``PARTIAL`` for the requester's cost record), payload CRC-32 (u32, when
flag bit 0 is set; flag bits 1-3 say, on a ``ROUTE`` or ``FETCH``, the requester's cache
format: :func:`format_flags`, refused by a holder of another format) and header CRC-32 (u32,
over the header with this field zeroed, padding included).

Checksums. The header CRC is always written and always checked. The payload CRC is written
by default for host buffers (``crc=None``); a sender whose bytes never leave the process (the
loopback engine, ``Transport.in_process``) may pass ``crc=False``, and buffers packed on a GPU
skip it. Whether a payload must carry one is the receiver's decision, never the sender's flag:
``parse_header(..., require_payload_crc=True)`` (what the holder and the requester pass for
every engine whose bytes cross a process) rejects a host payload without it, so clearing the
flag bit and resealing the header does not switch the check off.

Speed (a route's software overhead is part of its cost, §5.3): every CRC-32 is ISA-L's
(``isal``, the ``fast`` extra: zlib's polynomial and values, ~20x faster on a route's payload)
when it is installed, zlib's otherwise; headers are packed and parsed in place with one
precompiled :class:`struct.Struct` over a numpy view of the buffer (no intermediate ``bytes``),
the header CRC is chained over the buffer without a copy, header-only messages are packed from a
template, and :class:`Header` is a ``NamedTuple``.
"""

from __future__ import annotations

import enum
import math
import struct
import zlib
from typing import NamedTuple

import numpy as np
import torch

try:  # ISA-L's CRC-32: zlib's polynomial and values, ~20x faster on a route's payload
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # zlib's (the `fast` extra installs isal)
    _crc32 = zlib.crc32

from mqnc.base.checks import is_int
from mqnc.model.geometry import PRESETS, MLAGeometry

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER_FORMAT",
    "HEADER_BYTES",
    "FLAG_PAYLOAD_CRC",
    "CACHE_FORMAT_CODES",
    "format_flags",
    "Kind",
    "Header",
    "WireError",
    "WIRE_DTYPES",
    "FP8_ENTRIES_CODE",
    "parse_header",
    "message_bytes",
    "pack_probe",
    "pack_query",
    "pack_query_arrays",
    "unpack_query",
    "pack_partial",
    "unpack_partial",
    "pack_partial_lse",
    "partial_lse",
    "stat_of_lse",
    "lse_of_stat",
    "pack_fetch",
    "pack_chunk",
    "unpack_chunk",
    "pack_error",
    "unpack_error",
    "pack_shutdown",
    "restamp",
    "peek_length",
    "check_host_array",
    "copy_message",
    "read_message",
    "query_payload_bytes",
    "partial_payload_bytes",
    "chunk_payload_bytes",
]

MAGIC = b"MQNC"
VERSION = 1
HEADER_FORMAT = "<4sHHHHQQQIIIHHIQqQII"
_STRUCT = struct.Struct(HEADER_FORMAT)
_CRC = struct.Struct("<I")
HEADER_BYTES = 96
# the writer's struct: the header's fields, then its zero padding (one pack writes all 96 bytes)
_STRUCT_PADDED = struct.Struct(f"{HEADER_FORMAT}{HEADER_BYTES - _STRUCT.size}x")
_CRC_OFFSET = _STRUCT.size - 4  # header CRC is the last field
_PAYLOAD_OFFSET = 14  # index of payload_bytes in the unpacked struct
_ZERO4 = bytes(4)
FLAG_PAYLOAD_CRC = 1
#: Flag bits 1-3: the cache format of the requester that sent a ``ROUTE`` or ``FETCH`` (0: not
#: said; 1 bf16, 2 fp16, 3 fp32, 4 fp8_e4m3), checked against the holder's geometry.
FORMAT_SHIFT = 1
_FORMAT_MASK = 0b111 << FORMAT_SHIFT
CACHE_FORMAT_CODES = {"bf16": 1, "fp16": 2, "fp32": 3, "fp8_e4m3": 4}
_FORMAT_NAMES = {v: k for k, v in CACHE_FORMAT_CODES.items()}

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


_KINDS = {int(k): k for k in Kind}
_QK_KINDS = (Kind.ROUTE, Kind.CHUNK)
#: Kinds whose header carries a layer range (non-empty; one layer for ROUTE and PARTIAL).
_LAYERED = (Kind.ROUTE, Kind.PARTIAL, Kind.FETCH, Kind.CHUNK)

#: Wire dtype codes (header field ``dtype``) and their torch dtypes.
WIRE_DTYPES: dict[int, torch.dtype] = {1: torch.bfloat16, 2: torch.float16, 3: torch.float32}
#: The dtype code of a ``CHUNK`` of FP8 cache entries (uint8 bytes, ``cache_dtype "fp8_e4m3"``).
FP8_ENTRIES_CODE = 4
_FP8 = "fp8_e4m3"
_HEADER_DTYPES = {**WIRE_DTYPES, FP8_ENTRIES_CODE: torch.uint8}
_DTYPE_CODES = {v: k for k, v in _HEADER_DTYPES.items()}
_FLOAT_DTYPES = tuple(WIRE_DTYPES.values())
_ITEMSIZE = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.uint8: 1}


class WireError(ValueError):
    """A malformed, truncated or inconsistent message. Raised before any payload is used."""


class Header(NamedTuple):
    """The fixed-layout header of one message (see the module docstring for each field).

    A ``NamedTuple`` (fields by name, as before; ``h._replace(...)`` for a changed copy): the
    fields after ``kind`` are in the struct's order.
    """

    kind: Kind
    dtype: torch.dtype = torch.bfloat16
    flags: int = 0
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
        raw = np.zeros(HEADER_BYTES, dtype=np.uint8)
        _write_header(raw, self)
        return raw.tobytes()


def _header_crc(raw) -> int:
    """CRC-32 of the whole 96-byte header (padding included) with the CRC field zeroed: chained
    over the buffer (``bytes`` or a uint8 numpy array) without copying it."""
    c = _crc32(raw[:_CRC_OFFSET])
    c = _crc32(_ZERO4, c)
    return _crc32(raw[_CRC_OFFSET + 4 : HEADER_BYTES], c)


def _write_header(a: np.ndarray, h: Header) -> None:
    """Pack ``h`` into the first 96 bytes of the host uint8 array ``a`` (CRC last)."""
    # Header's fields after kind and dtype are the struct's, in its order (CRC 0, then padding)
    _STRUCT_PADDED.pack_into(a, 0, MAGIC, VERSION, h[0], _DTYPE_CODES[h[1]], *h[2:], 0)
    # The CRC field is zero here: one CRC over the whole header equals the chained one of
    # _header_crc (which zeroes the field on the fly), with one call instead of three.
    _CRC.pack_into(a, _CRC_OFFSET, _crc32(a[:HEADER_BYTES]))


# ---- sizes (all derived from the geometry's dims, never typed in) --------------------------------


def _itemsize(dtype: torch.dtype) -> int:
    return _ITEMSIZE[dtype]


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
    k = h.kind
    if k in (Kind.PROBE, Kind.PROBE_ACK, Kind.FETCH, Kind.SHUTDOWN):
        return 0
    if k == Kind.ROUTE:
        return query_payload_bytes(h.batch, h.heads, h.width, h.topk, h.dtype)
    if k == Kind.PARTIAL:
        return partial_payload_bytes(h.batch, h.heads, h.width, h.dtype)
    if k == Kind.CHUNK:
        return chunk_payload_bytes(h.layer_hi - h.layer_lo, h.batch, h.width, h.dtype)
    return None


# ---- buffers -------------------------------------------------------------------------------------


def _check_buffer(buf: object) -> torch.Tensor:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(
            f"buf: expected a torch.Tensor or numpy array of uint8, got {type(buf).__name__}"
        )
    if buf.dtype != torch.uint8:
        raise TypeError(f"buf: invalid dtype, expected uint8, got {str(buf.dtype)[6:]}")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"buf: expected a contiguous 1-D byte buffer, got shape {tuple(buf.shape)} "
            f"strides {buf.stride()}"
        )
    return buf


def _new_message(nbytes: int, device) -> torch.Tensor:
    """An uninitialised ``[nbytes]`` uint8 buffer (every byte is written before it is sent)."""
    if device is None or str(device) == "cpu":
        return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes as a uint8 array (a view when it is contiguous)."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8).numpy()


def _assemble(h: Header, parts, device, out: torch.Tensor | None, crc: bool | None):
    """The message of header ``h`` whose payload is ``parts``' bytes in order (host tensors or
    uint8 arrays), in a new buffer on ``device`` or the prefix of ``out``; sealed."""
    nbytes = HEADER_BYTES + h.payload_bytes
    if out is None and (device is None or getattr(device, "type", device) == "cpu"):
        return _host_message(h, parts, crc)
    buf = _message_buffer(nbytes, out, device)
    host = buf.is_cpu
    a = buf.numpy() if host else None
    off = HEADER_BYTES
    for t in parts:
        if host and (isinstance(t, np.ndarray) or t.is_cpu):
            src = (t if isinstance(t, np.ndarray) else _bytes_of(t)).reshape(-1)
            a[off : off + src.shape[0]] = src
            off += src.shape[0]
        else:
            if isinstance(t, np.ndarray):
                t = torch.from_numpy(t)
            flat = t.contiguous().view(-1).view(torch.uint8)
            buf[off : off + flat.numel()].copy_(flat)
            off += flat.numel()
    return _seal(buf, h, crc, a)


def _host_message(h: Header, parts, crc: bool | None, array: bool = False):
    """A new host message of header ``h`` whose payload is ``parts``' bytes (host tensors or
    arrays), sealed: the fast path of every packer (numpy copies, one torch wrapper, none with
    ``array``: the uint8 array itself)."""
    a = np.empty(HEADER_BYTES + h.payload_bytes, dtype=np.uint8)
    off = HEADER_BYTES
    for t in parts:
        src = t if isinstance(t, np.ndarray) else _bytes_of(t if t.is_cpu else t.cpu())
        n = src.size
        a[off : off + n] = src.reshape(-1) if src.ndim != 1 else src
        off += n
    _seal_host(a, h, crc)
    return a if array else torch.from_numpy(a)


def _seal_host(a: np.ndarray, h: Header, crc: bool | None) -> None:
    """Write ``h`` into the host message ``a`` whose payload is in place: with the payload CRC
    (flag bit 0) unless ``crc`` is False or there is no payload (every host packer's seal)."""
    if crc is not False and h.payload_bytes:
        h = h._replace(
            flags=h.flags | FLAG_PAYLOAD_CRC,
            payload_crc=_crc32(a[HEADER_BYTES : HEADER_BYTES + h.payload_bytes]),
        )
    _write_header(a, h)


def _seal(buf: torch.Tensor, h: Header, crc: bool | None, a: np.ndarray | None = None):
    """Write the header into ``buf``: with the payload CRC (flag bit 0) for host buffers unless
    ``crc`` is False; never for device buffers (whose bytes would have to come to the host)."""
    if buf.is_cpu:
        _seal_host(buf.numpy() if a is None else a, h, crc)
        return buf
    raw = np.empty(HEADER_BYTES, dtype=np.uint8)
    _write_header(raw, h)
    buf[:HEADER_BYTES].copy_(torch.from_numpy(raw))
    return buf


def _header_only(h: Header, device, array: bool = False):
    """A message that is its header alone (probe, ack, fetch, shutdown); with ``array`` the
    host uint8 array itself."""
    if device is None or str(device) == "cpu":
        a = np.empty(HEADER_BYTES, dtype=np.uint8)
        _write_header(a, h)
        return a if array else torch.from_numpy(a)
    if array:
        _refuse_device_array(device)
    return _seal(_new_message(HEADER_BYTES, device), h, False)


def _refuse_device_array(device) -> None:
    """``array=True`` asks for a host numpy array: refused for a device message."""
    raise ValueError(f"array: a numpy array is a host message, got device={device!r}")


def _template(kind: Kind) -> np.ndarray:
    """A header-only message of ``kind`` with request id and seq 0 and its CRC field zeroed:
    :func:`pack_probe` copies it, packs the ids (:data:`_IDS` at :data:`_IDS_OFFSET`) and the
    CRC over all 96 bytes."""
    a = np.zeros(HEADER_BYTES, dtype=np.uint8)
    _write_header(a, Header(kind))
    a[_CRC_OFFSET : _CRC_OFFSET + 4] = 0
    return a


_IDS = struct.Struct("<QQ")  # request id, seq
_IDS_OFFSET = struct.calcsize("<4sHHHH")
_PROBE_TEMPLATE = (_template(Kind.PROBE), _template(Kind.PROBE_ACK))


def _payload_view(buf, offset: int, nbytes: int, dtype: torch.dtype, shape):
    start = HEADER_BYTES + offset
    if isinstance(buf, np.ndarray):  # a host array message: numpy slices, one torch wrapper
        a = buf[start : start + nbytes].view(_NP_VIEW[dtype])
        if not (a.flags.aligned and a.flags.writeable):  # as the tensor path clones: a copy
            a = a.copy()
        t = torch.from_numpy(a.reshape(shape))
        return t.view(dtype) if dtype is torch.bfloat16 else t
    aligned = (buf.storage_offset() + start) % _VIEW_ALIGN[dtype] == 0
    if aligned and buf.is_cpu:  # host: numpy slices, one torch wrapper (~1 us less per call)
        a = buf.numpy()[start : start + nbytes].view(_NP_VIEW[dtype]).reshape(shape)
        t = torch.from_numpy(a)
        return t.view(dtype) if dtype is torch.bfloat16 else t
    part = buf[start : start + nbytes]
    if not aligned:
        part = part.clone()  # a field at an offset its dtype cannot view in place (odd widths)
    return part.view(dtype).view(shape)


_VIEW_ALIGN = {
    torch.bfloat16: 2,
    torch.float16: 2,
    torch.float32: 4,
    torch.int32: 4,
    torch.uint8: 1,
}
# numpy dtypes of the same width (bf16 has none: its bits as int16, then a torch view)
_NP_VIEW = {torch.bfloat16: np.int16, torch.float16: np.float16, torch.float32: np.float32,
            torch.int32: np.int32, torch.uint8: np.uint8}  # fmt: skip


def _host_header(buf: torch.Tensor) -> np.ndarray:
    """The buffer's first bytes as a host uint8 array (a view for host buffers)."""
    if buf.is_cpu:
        return buf.numpy()
    return buf[:HEADER_BYTES].cpu().numpy()


def check_host_array(name: str, a: np.ndarray) -> np.ndarray:
    """``a`` if it is a contiguous 1-D uint8 array (a host message), else a ``TypeError``
    (dtype, dims) or ``ValueError`` (strides) naming ``name``: the one check of an array
    message, for the readers here and every engine's put."""
    if a.dtype != np.uint8 or a.ndim != 1:
        raise TypeError(f"{name}: expected a 1-D uint8 array, got dtype {a.dtype} shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(
            f"{name}: expected a contiguous array (messages are contiguous bytes), got strides "
            f"{a.strides}"
        )
    return a


def copy_message(row: np.ndarray, slot_bytes: int) -> np.ndarray:
    """A copy of the message at the start of a host slot ``row``: its header's length, or the
    whole slot (at most ``slot_bytes``) when that is not a valid one, so that the reader's
    check says why (the host engines' ``read_message_host``, under their slot lock)."""
    n = peek_length(row)  # reads the header's bytes only
    if n is None or n > slot_bytes:
        n = slot_bytes
    return row[:n].copy()


def _host_array(buf: object) -> np.ndarray | None:
    """A host uint8 array message as it is, a host uint8 tensor's bytes as a numpy view, or
    None when ``buf`` is anything else (a device tensor, another dtype, not 1-D contiguous:
    :func:`_check_buffer` says why)."""
    if isinstance(buf, np.ndarray):
        return check_host_array("buf", buf)
    if type(buf) is not torch.Tensor or buf.dtype != torch.uint8 or not buf.is_cpu:
        return None
    a = buf.numpy()
    return a if a.ndim == 1 and a.flags.c_contiguous else None


# Over 60 lines by its numpy docstring (33); the body is the header's checks in order (35 lines).
def parse_header(
    buf: torch.Tensor,
    *,
    geometry: MLAGeometry | None = None,
    expect: Kind | tuple[Kind, ...] | None = None,
    check_payload: bool = True,
    require_payload_crc: bool = False,
) -> Header:
    """Read and check the header of the message at the start of ``buf``.

    Parameters
    ----------
    buf : torch.Tensor or numpy.ndarray
        ``[n]`` uint8, contiguous: a message, or a transport slot holding one (``n`` may exceed
        the message's length); a host numpy array as the packers' ``array=True`` and
        :meth:`mqnc.transport.Transport.read_message_host` give one.
    geometry : MLAGeometry or None
        When given, the ``width`` and layer range must fit it (``d_qk`` for ROUTE and CHUNK,
        ``d_v`` for PARTIAL, layers within ``[0, geometry.layers]``).
    expect : Kind or tuple of Kind or None
        Accepted kinds (``ERROR`` is always accepted, so that a remote error reaches the
        caller).
    check_payload : bool
        Verify the payload CRC when the header carries one (host buffers only).
    require_payload_crc : bool
        Reject a host message with a payload but no payload CRC (what a receiver passes when
        the bytes crossed a process: the sender's flag cannot switch the check off).

    Returns
    -------
    Header

    Raises
    ------
    WireError
        Truncated buffer, bad magic/version/CRC, unknown kind or dtype, an empty (or, for
        ROUTE and PARTIAL, multi-layer) layer range, payload size that does not match the
        fields, a missing or wrong payload CRC, or fields that do not fit ``geometry``.
    """
    a = _host_array(buf)
    if a is not None:
        n = a.shape[0]
    else:
        buf = _check_buffer(buf)
        n = buf.numel()
        if n >= HEADER_BYTES:
            a = _host_header(buf)
    if n < HEADER_BYTES:
        raise WireError(
            f"buf: truncated message, expected at least {HEADER_BYTES} header bytes, got {n}"
        )
    h = _decode(a)
    if expect is not None and h.kind != expect and h.kind != Kind.ERROR:
        kinds = (expect,) if isinstance(expect, Kind) else tuple(expect)
        if h.kind not in kinds:
            raise WireError(
                f"buf: unexpected message kind, expected {[k.name for k in kinds]}, "
                f"got {h.kind.name}"
            )
    _check_layer_range(h)
    want = _expected_payload(h)
    if want is not None and h.payload_bytes != want:
        raise WireError(
            f"buf: {h.kind.name} payload size mismatch, the header's fields imply {want} B, "
            f"the header says {h.payload_bytes} B"
        )
    if n < HEADER_BYTES + h.payload_bytes:
        raise WireError(
            f"buf: truncated {h.kind.name} message, expected {h.nbytes} B "
            f"({HEADER_BYTES} header + {h.payload_bytes} payload), got {n}"
        )
    if geometry is not None:
        _check_geometry(h, geometry)
    if h.payload_bytes and a.shape[0] >= HEADER_BYTES + h.payload_bytes:  # host bytes
        _check_payload_crc(h, a, check_payload, require_payload_crc)
    return h


def _check_layer_range(h: Header) -> None:
    if h.layer_hi < h.layer_lo:
        raise WireError(f"buf: bad layer range [{h.layer_lo}, {h.layer_hi})")
    if h.kind in _LAYERED:
        if h.layer_hi == h.layer_lo:
            raise WireError(
                f"buf: {h.kind.name} with an empty layer range [{h.layer_lo}, {h.layer_hi})"
            )
        if h.kind in (Kind.ROUTE, Kind.PARTIAL) and h.layer_hi != h.layer_lo + 1:
            raise WireError(
                f"buf: {h.kind.name} layer range [{h.layer_lo}, {h.layer_hi}), expected one layer"
            )


def _check_payload_crc(h: Header, a: np.ndarray, check: bool, require: bool) -> None:
    if not h.flags & FLAG_PAYLOAD_CRC:
        if require:
            raise WireError(
                f"buf: {h.kind.name} payload without a payload CRC, and this receiver "
                "requires one (the bytes crossed a process)"
            )
        return
    if check or require:
        got = _crc32(a[HEADER_BYTES : HEADER_BYTES + h.payload_bytes])
        if got != h.payload_crc:
            raise WireError(
                f"buf: {h.kind.name} payload CRC mismatch (stored {h.payload_crc:#010x}, "
                f"computed {got:#010x}): corrupt payload"
            )


def _decode(raw) -> Header:
    """The header in ``raw`` (>= 96 bytes), after checking magic, version, CRC, kind and
    dtype."""
    f = _STRUCT.unpack_from(raw, 0)
    if f[0] != MAGIC:
        raise WireError(f"buf: bad magic, expected {MAGIC!r}, got {f[0]!r}")
    if f[1] != VERSION:
        raise WireError(f"buf: unsupported wire version, expected {VERSION}, got {f[1]}")
    crc = _header_crc(raw)
    if crc != f[18]:
        raise WireError(
            f"buf: header CRC mismatch (stored {f[18]:#010x}, computed {crc:#010x}): corrupt header"
        )
    kind = _KINDS.get(f[2])
    if kind is None:
        raise WireError(f"buf: unknown message kind {f[2]}")
    dtype = _HEADER_DTYPES.get(f[3])
    if dtype is None:
        raise WireError(f"buf: unknown dtype code {f[3]}, expected one of {sorted(_HEADER_DTYPES)}")
    if dtype is torch.uint8 and kind != Kind.CHUNK:
        raise WireError(
            f"buf: dtype code {FP8_ENTRIES_CODE} (FP8 cache entries) on a {kind.name} message; "
            "only a CHUNK carries them"
        )
    return Header._make((kind, dtype, *f[4:18]))


def _peek(a) -> int | None:
    """Length of the message whose header starts the host array / bytes ``a``, or None when
    it does not start with a header (magic or version wrong). The length is not trusted: the
    reader copies at most a slot, and :func:`parse_header` checks the header CRC."""
    if len(a) < HEADER_BYTES:
        return None
    f = _STRUCT.unpack_from(a, 0)
    if f[0] != MAGIC or f[1] != VERSION:
        return None
    return HEADER_BYTES + f[_PAYLOAD_OFFSET]


def peek_length(head) -> int | None:
    """Length of the message whose header starts ``head`` (a uint8 tensor, or a host uint8
    numpy array / ``bytes``, of >= 96 bytes), or None when it is not a header (magic or
    version wrong): read that much (at most a slot), then :func:`parse_header` checks
    everything, the header CRC first."""
    if isinstance(head, np.ndarray):
        return _peek(_host_array(head))
    if not isinstance(head, torch.Tensor):
        return _peek(head)
    head = _check_buffer(head)
    if head.numel() < HEADER_BYTES:
        return None
    return _peek(_host_header(head)[:HEADER_BYTES])


def read_message(transport, slot: int) -> torch.Tensor:
    """Copy the message in a local transport slot: its header first, then exactly its length
    (the whole slot when the header is not valid, so that the caller's check reports why).
    :meth:`mqnc.transport.Transport.read_message` gives the slot's signal with it."""
    return transport.read_message(slot)[1]


def _check_geometry(h: Header, g: MLAGeometry) -> None:
    want = g.d_v if h.kind == Kind.PARTIAL else g.d_qk if h.kind in _QK_KINDS else None
    if h.kind == Kind.CHUNK:
        _check_chunk_format(h, g)
        want = g.kv_bytes_per_token_layer if h.dtype is torch.uint8 else want
    elif h.kind in (Kind.ROUTE, Kind.FETCH):
        _check_request_format(h, g)
    if want is not None and h.width != want:
        raise WireError(
            f"buf: {h.kind.name} row width {h.width} does not fit geometry {g.name!r} "
            f"(expected {want})"
        )
    if h.kind in _LAYERED and h.layer_hi > g.layers:
        raise WireError(
            f"buf: layer range [{h.layer_lo}, {h.layer_hi}) outside geometry {g.name!r} "
            f"({g.layers} layers)"
        )


def format_flags(geometry: MLAGeometry | None) -> int:
    """The header flag bits that say a requester's cache format (``geometry.cache_dtype``;
    None: not said, 0): a ``ROUTE`` or ``FETCH`` carries them, and a holder whose geometry
    keeps another format refuses the request naming both."""
    if geometry is None:
        return 0
    return CACHE_FORMAT_CODES.get(geometry.cache_dtype, 0) << FORMAT_SHIFT


def _check_request_format(h: Header, g: MLAGeometry) -> None:
    """A ``ROUTE`` or ``FETCH`` from a requester that said its cache format (flag bits 1-3)
    must come from one that keeps the geometry's: an error naming both otherwise."""
    code = (h.flags & _FORMAT_MASK) >> FORMAT_SHIFT
    if not code:
        return  # not said (a packer given no geometry)
    sent = _FORMAT_NAMES.get(code)
    if sent is None:
        raise WireError(f"buf: unknown cache format code {code} in the {h.kind.name} flags")
    if (sent == _FP8) != (g.cache_dtype == _FP8):
        raise WireError(
            f"buf: cache format mismatch: the {h.kind.name} comes from a requester keeping a "
            f"{sent} cache, geometry {g.name!r} keeps a {g.cache_dtype} cache (holder and "
            "requester must keep one format)"
        )


def _check_chunk_format(h: Header, g: MLAGeometry) -> None:
    """A ``CHUNK``'s cache format against the geometry's: FP8 entries to a 16-bit cache, or
    16-bit rows to an FP8 one, is an error naming both (holder and requester disagree)."""
    fp8 = h.dtype is torch.uint8
    if fp8 != (g.cache_dtype == _FP8):
        sent = f"{_FP8} entries ({h.width} B a token)" if fp8 else f"{str(h.dtype)[6:]} rows"
        raise WireError(
            f"buf: cache format mismatch: the CHUNK carries {sent}, geometry {g.name!r} keeps a "
            f"{g.cache_dtype} cache (holder and requester must keep one format)"
        )


def _geometry(geometry: MLAGeometry | None) -> MLAGeometry:
    g = PRESETS["deepseek-v2-lite"] if geometry is None else geometry
    if not isinstance(g, MLAGeometry):
        raise TypeError(f"geometry: expected an MLAGeometry, got {type(g).__name__}")
    return g


_LIMITS = {"position": (-(2**63), 2**63 - 1), "layer": (0, 2**16 - 1)}


_U64 = 2**64


def _plain_ids(*ids) -> bool:
    """True when every id is a plain ``int`` in ``[0, 2**64)`` (the per-call path: no checks
    by name needed; anything else goes through :func:`_check_ids`)."""
    for v in ids:
        if type(v) is not int or not 0 <= v < _U64:
            return False
    return True


def _check_ids(**ids: int) -> None:
    for name, v in ids.items():
        if type(v) is not int and not is_int(v):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        lo, hi = _LIMITS.get(name, (0, 2**64 - 1))
        if not lo <= v <= hi:
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


def _message_buffer(nbytes: int, out: torch.Tensor | None, device) -> torch.Tensor:
    """A new buffer for a message of ``nbytes``, or the prefix of ``out`` (a staging slot)."""
    if out is None:
        return _new_message(nbytes, device)
    out = _check_buffer(out)
    if out.numel() < nbytes:
        raise ValueError(f"out: expected at least {nbytes} bytes, got {out.numel()}")
    return out[:nbytes]


def _check_layers(layers: tuple[int, int], g: MLAGeometry) -> tuple[int, int]:
    if type(layers) is tuple and len(layers) == 2:
        lo, hi = layers
        if type(lo) is int and type(hi) is int and 0 <= lo < hi <= g.layers:
            return lo, hi
    if not isinstance(layers, (tuple, list)) or len(layers) != 2:
        raise TypeError(f"layers: expected a (lo, hi) pair, got {layers!r}")
    if not all(is_int(x) for x in layers):  # a float or a bool is not cut to a layer
        raise TypeError(f"layers: expected a pair of ints, got {layers!r}")
    lo, hi = (int(x) for x in layers)
    if not 0 <= lo < hi <= g.layers:
        raise ValueError(f"layers: expected 0 <= lo < hi <= {g.layers}, got ({lo}, {hi})")
    return lo, hi


def _check_float(name: str, t: object, ndim: int, width: int | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name}: invalid dtype, expected one of (bfloat16, float16, float32), got "
            f"{str(t.dtype)[6:]}"
        )
    if t.dim() != ndim or (width is not None and t.shape[-1] != width):
        want = f"{ndim} dims" + ("" if width is None else f" with last dim {width}")
        raise ValueError(f"{name}: expected {want}, got shape {tuple(t.shape)}")
    return t


def _check_error_reply(h: Header, buf: torch.Tensor, what: str) -> None:
    if h.kind == Kind.ERROR:
        raise WireError(f"{what} for request {h.request_id}: {unpack_error(buf)[1]}")


# ---- probe ---------------------------------------------------------------------------------------


def pack_probe(
    *, request_id: int, seq: int, ack: bool = False, device=None, array: bool = False
) -> torch.Tensor | np.ndarray:
    """A ``PROBE`` (or ``PROBE_ACK``) message: the header alone, ``[96]`` uint8; with
    ``array`` a host numpy array (what the holder and the requester put: no torch call on the
    per-call path; every engine's put and every reader here take either)."""
    if not (type(request_id) is int and type(seq) is int and 0 <= request_id < _U64 > seq >= 0):
        _check_ids(request_id=request_id, seq=seq)
    if device is None:  # the per-call path: the header in a template's copy
        # (restamp's steps for a template whose CRC field is zero, inline: a probe's hot path)
        a = _PROBE_TEMPLATE[1 if ack else 0].copy()
        _IDS.pack_into(a, _IDS_OFFSET, request_id, seq)
        _CRC.pack_into(a, _CRC_OFFSET, _crc32(a))
        return a if array else torch.from_numpy(a)
    h = Header(Kind.PROBE_ACK if ack else Kind.PROBE, request_id=request_id, seq=seq)
    return _header_only(h, device, array)


def restamp(a: np.ndarray, *, request_id: int, seq: int) -> np.ndarray:
    """A copy of the sealed host message ``a`` (a uint8 array) under new ids: the
    request id and sequence number packed in, the header CRC resealed, the payload and its CRC
    as they were (the ids are not checked: the caller's own): how a benchmark's ready holder
    answers every route with one reply per shape (:class:`mqnc.measure.holders.ReadyHolder`).
    :func:`pack_probe` does the same to its template inline."""
    out = a.copy()
    _IDS.pack_into(out, _IDS_OFFSET, request_id, seq)
    _CRC.pack_into(out, _CRC_OFFSET, 0)
    _CRC.pack_into(out, _CRC_OFFSET, _crc32(out[:HEADER_BYTES]))
    return out


def pack_shutdown(
    *, request_id: int = 0, seq: int = 0, device=None, array: bool = False
) -> torch.Tensor | np.ndarray:
    """A ``SHUTDOWN`` message (asks a holder's service loop to stop); ``array`` as in
    :func:`pack_probe`."""
    _check_ids(request_id=request_id, seq=seq)
    return _header_only(Header(Kind.SHUTDOWN, request_id=request_id, seq=seq), device, array)


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
    crc: bool | None = None,
    array: bool = False,
) -> torch.Tensor | np.ndarray:
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
    crc : bool or None
        Payload CRC: None (default) for host buffers, False to skip it (bytes that never leave
        the process).
    array : bool
        Return a host numpy array instead of a tensor (``q`` on the host; what the requester
        puts: no torch call between the packer and the engine).

    Returns
    -------
    torch.Tensor or numpy.ndarray
        ``[96 + B * H * q_row_bytes + B * topk * 4]`` uint8 on ``q``'s device.
    """
    g = _geometry(geometry)
    _check_float("q", q, 3, g.d_qk)
    if not (_plain_ids(request_id, seq, chunk_id) and type(layer) is int and layer < 2**16 - 1):
        _check_ids(request_id=request_id, seq=seq, chunk_id=chunk_id, layer=layer)
    if not 0 <= layer < g.layers:  # named as the caller wrote it, not as the header's range
        raise ValueError(f"layer: expected 0 <= layer < {g.layers}, got {layer}")
    lo, hi = _check_layers((layer, layer + 1), g)
    B, H, D = q.shape
    topk = 0 if indices is None else _check_indices(indices, q)
    nbytes = query_payload_bytes(B, H, D, topk, q.dtype)
    flags = format_flags(geometry)
    h = Header(Kind.ROUTE, q.dtype, flags, request_id, seq, chunk_id, B, H, D, lo, hi, topk, nbytes)
    parts = (q, indices) if topk else (q,)
    if array:
        if not q.is_cpu:
            _refuse_device_array(q.device)
        return _host_message(h, parts, crc, array=True)
    return _assemble(h, parts, q.device, None, crc)


def pack_query_arrays(
    q: np.ndarray,
    indices: np.ndarray | None,
    *,
    dtype: torch.dtype,
    heads: int,
    width: int,
    request_id: int,
    seq: int,
    chunk_id: int,
    layer: int,
    crc: bool | None,
    array: bool = False,
    flags: int = 0,
) -> torch.Tensor | np.ndarray:
    """The requester's fast path of :func:`pack_query` (as :func:`pack_partial_arrays` is the
    holder's): ``q`` as the uint8 bytes of ``[B, heads, width]`` rows in ``dtype`` (shape
    ``[B, heads * width * itemsize]``), ``indices`` ``[B, topk]`` int32 or None, on the host.
    The values of the rows and of the selection were checked by the caller
    (:func:`mqnc.serving.route.route_request`); their arrays' dtypes and sizes, the ids and the
    layer are checked here; ``array`` as in :func:`pack_probe`; ``flags`` the requester's
    :func:`format_flags`."""
    if not (_plain_ids(request_id, seq, chunk_id) and type(layer) is int and layer < 2**16 - 1):
        _check_ids(request_id=request_id, seq=seq, chunk_id=chunk_id, layer=layer)
    if not 0 <= layer < 2**16 - 1:  # the header's range is [layer, layer + 1), u16
        raise ValueError(f"layer: expected an int in [0, {2**16 - 2}], got {layer}")
    if q.dtype != np.uint8 or q.ndim != 2:
        raise TypeError(f"q: expected the rows' bytes [B, n] uint8, got {q.dtype} {q.shape}")
    if indices is not None and (indices.dtype != np.int32 or indices.ndim != 2):
        raise TypeError(
            f"indices: expected [B, topk] int32, got {indices.dtype} of shape {indices.shape}"
        )
    B, nq = q.shape[0], q.size
    topk = 0 if indices is None else indices.shape[1]
    nbytes = query_payload_bytes(B, heads, width, topk, dtype)
    if nq + B * topk * 4 != nbytes or (topk and indices.shape[0] != B):
        raise ValueError(f"q, indices: {nq + B * topk * 4} B, expected {nbytes} B")
    a = np.empty(HEADER_BYTES + nbytes, dtype=np.uint8)
    end = HEADER_BYTES + nq
    a[HEADER_BYTES:end] = q.reshape(-1)
    if topk:
        a[end:].view(np.int32)[:] = indices.reshape(-1)
    h = Header(
        Kind.ROUTE, dtype, flags & _FORMAT_MASK, request_id, seq, chunk_id, B, heads, width,
        layer, layer + 1, topk, nbytes,
    )  # fmt: skip
    _seal_host(a, h, crc)
    return a if array else torch.from_numpy(a)


def unpack_query(
    buf: torch.Tensor, *, geometry: MLAGeometry | None = None, require_payload_crc: bool = False
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
    h = parse_header(
        buf, geometry=geometry, expect=Kind.ROUTE, require_payload_crc=require_payload_crc
    )
    if h.kind == Kind.ERROR:
        raise WireError(f"buf: expected a ROUTE message, got ERROR: {unpack_error(buf)[1]}")
    return h, *query_views(buf, h)


def query_views(buf: torch.Tensor, h: Header) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(q [B, H, width], indices [B, topk] or None)``: views into a ROUTE message whose
    header ``h`` :func:`parse_header` has checked."""
    nq = h.rows * h.width * _itemsize(h.dtype)
    q = _payload_view(buf, 0, nq, h.dtype, (h.batch, h.heads, h.width))
    idx = None
    if h.topk:
        idx = _payload_view(buf, nq, h.batch * h.topk * 4, torch.int32, (h.batch, h.topk))
    return q, idx


def query_arrays(buf, h: Header) -> tuple[np.ndarray, np.ndarray | None]:
    """``(q_bytes [B, H * width * itemsize] uint8, indices [B, topk] int32 or None)``: numpy
    views into a host ROUTE message (array or host tensor) whose header ``h``
    :func:`parse_header` has checked: the rows' bytes and the selection without a torch call
    (the holder copies the rows into its staging buffer)."""
    a = _host_array(buf)
    if a is None:
        raise ValueError("buf: expected a host message (a uint8 numpy array or host tensor)")
    nq = h.rows * h.width * _itemsize(h.dtype)
    q = a[HEADER_BYTES : HEADER_BYTES + nq].reshape(h.batch, -1)
    idx = None
    if h.topk:
        start = HEADER_BYTES + nq
        idx = a[start : start + h.batch * h.topk * 4].view(np.int32).reshape(h.batch, h.topk)
    return q, idx


# ---- route: the collapsed response ---------------------------------------------------------------


# Over 60 lines by its numpy docstring (24) and signature; the body is 18 lines.
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
    crc: bool | None = None,
) -> torch.Tensor:
    """Pack a partial ``(o, m, l)`` as ONE contiguous ``PARTIAL`` message (§5.3).

    Parameters
    ----------
    o : torch.Tensor
        ``[B, H, d_v]`` partial output (512 wide), bf16 / fp16 / fp32.
    m, l : torch.Tensor
        ``[B, H]`` float32 running max and softmax denominator (``lse = m + log(l)``, natural
        log; ``l = 0`` for an empty partial). :func:`stat_of_lse` converts; a holder packs
        its ``lse`` with :func:`pack_partial_lse`.
    request_id, seq, chunk_id, layer : int
        Echoed from the ``ROUTE`` this answers.
    holder_ns : int
        The holder's compute time for this partial's kernel call (for the cost record).
    out : torch.Tensor or None
        A ``[n >= 96 + B * H * p_row_bytes]`` uint8 buffer to pack into (a staging slot);
        a new one is allocated when None.
    crc : bool or None
        As in :func:`pack_query`.

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
    nbytes = partial_payload_bytes(B, H, Dv, o.dtype)
    h = Header(
        Kind.PARTIAL, o.dtype, 0, request_id, seq, chunk_id, B, H, Dv, lo, hi, 0, nbytes,
        0, holder_ns,
    )  # fmt: skip
    return _assemble(h, (o, m, l), o.device, out, crc)


def unpack_partial(
    buf: torch.Tensor, *, geometry: MLAGeometry | None = None, require_payload_crc: bool = False
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
    h = parse_header(
        buf, geometry=geometry, expect=Kind.PARTIAL, require_payload_crc=require_payload_crc
    )
    _check_error_reply(h, buf, "remote error")
    return h, *partial_views(buf, h)


def partial_views(buf: torch.Tensor, h: Header):
    """``(o [B, H, width], m [B, H], l [B, H])``: views into a PARTIAL message whose header
    ``h`` :func:`parse_header` has checked."""
    no = h.rows * h.width * _itemsize(h.dtype)
    o = _payload_view(buf, 0, no, h.dtype, (h.batch, h.heads, h.width))
    m = _payload_view(buf, no, h.rows * 4, torch.float32, (h.batch, h.heads))
    l = _payload_view(buf, no + h.rows * 4, h.rows * 4, torch.float32, (h.batch, h.heads))
    return o, m, l


def partial_arrays(buf: torch.Tensor, h: Header):
    """As :func:`partial_views` for a host message, with ``m`` and ``l`` as float32 numpy
    arrays ``[B, H]`` (copies: the requester's host path, no torch op per statistic)."""
    no = h.rows * h.width * _itemsize(h.dtype)
    o = _payload_view(buf, 0, no, h.dtype, (h.batch, h.heads, h.width))
    start = HEADER_BYTES + no
    ml = (buf if isinstance(buf, np.ndarray) else buf.numpy())[start : start + 8 * h.rows]
    ml = (ml if start % 4 == 0 else ml.copy()).view(np.float32)
    return o, ml[: h.rows].reshape(h.batch, h.heads), ml[h.rows :].reshape(h.batch, h.heads)


def all_finite(a: np.ndarray) -> bool:
    """True when every element of the float array ``a`` is finite (one scalar read for one
    element: a numpy reduction costs ~1.5 us, and a route of one row pays it per side)."""
    return math.isfinite(a.item()) if a.size == 1 else math.isfinite(float(a.sum()))


def all_equal(a: np.ndarray, value) -> bool:
    """True when every element of ``a`` equals ``value`` (the one-element case read alone)."""
    return a.item() == value if a.size == 1 else bool((a == value).all())


def pack_partial_arrays(
    o: np.ndarray,
    m: np.ndarray,
    l: np.ndarray,
    *,
    dtype: torch.dtype,
    width: int,
    request_id: int,
    seq: int,
    chunk_id: int,
    layer: int,
    holder_ns: int,
    crc: bool | None,
    array: bool = False,
) -> torch.Tensor | np.ndarray:
    """The holder's fast path of :func:`pack_partial`: ``o`` as the uint8 bytes of
    ``[B, H, width]`` values in ``dtype`` (shape ``[B, H * width * itemsize]``), ``m`` and
    ``l`` float32 ``[B, H]`` numpy arrays, all on the host (no argument checks beyond the
    sizes: the holder made them); ``array`` as in :func:`pack_probe`."""
    B, H = m.shape
    nbytes = partial_payload_bytes(B, H, width, dtype)
    rows, no = B * H, o.size
    if no + m.nbytes + l.nbytes != nbytes or l.shape != (B, H):
        raise ValueError(f"o, m, l: {no + m.nbytes + l.nbytes} B, expected {nbytes} B")
    # the three copies straight into the message (no generic loop over parts: fewer Python
    # steps on the holder's per-reply path)
    a = np.empty(HEADER_BYTES + nbytes, dtype=np.uint8)
    end = HEADER_BYTES + no
    a[HEADER_BYTES:end] = o.reshape(-1)
    ml = a[end:].view(np.float32)
    ml[:rows] = m.reshape(-1)
    ml[rows:] = l.reshape(-1)
    h = Header(
        Kind.PARTIAL, dtype, 0, request_id, seq, chunk_id, B, H, width, layer, layer + 1, 0,
        nbytes, 0, holder_ns,
    )  # fmt: skip
    _seal_host(a, h, crc)
    return a if array else torch.from_numpy(a)


# ---- route: the partial's statistic (a natural-log lse in, a natural-log lse out) ----------------

_ONES_CACHE = 256  # cached arrays of ones (one per reply shape) before the cache is cleared
_ONES: dict[tuple[int, ...], np.ndarray] = {}


def _ones(shape: tuple[int, ...]) -> np.ndarray:
    """A read-only float32 array of ones of ``shape`` (cached: ``np.ones`` is a Python-level
    function, ~3 us a reply)."""
    a = _ONES.get(shape)
    if a is None:
        if len(_ONES) >= _ONES_CACHE:
            _ONES.clear()
        a = _ONES[shape] = np.ones(shape, dtype=np.float32)
        a.flags.writeable = False
    return a


def stat_of_lse(lse: np.ndarray, keyed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The wire statistic ``(m, l)`` ``[B, H]`` float32 of a partial's natural-log ``lse``
    (``[B, H]`` float32 on the host): what :func:`pack_partial_lse` writes.

    ``(lse, 1)`` for a row with keys and a finite ``lse``; ``(0, 0)`` (an empty partial) for a
    row without keys (``keyed[b]`` False; ``keyed`` None: every row has keys); ``(NaN, 1)`` for
    a row with keys whose ``lse`` is not finite (an overflow or a NaN input is reported, never
    read as an empty partial). The usual case returns ``lse`` itself as ``m``.
    """
    if keyed is None:
        if all_finite(lse):  # usual: every row has keys and a finite lse
            return lse, _ones(lse.shape)
        keyed = np.ones(lse.shape[0], dtype=bool)
    with_keys = keyed[:, None]
    m = np.where(with_keys, np.where(np.isfinite(lse), lse, np.nan), 0.0).astype(np.float32)
    l = np.where(with_keys, 1.0, 0.0).astype(np.float32) * np.ones_like(m)
    return m, l


def lse_of_stat(m, l) -> torch.Tensor:
    """Natural-log ``lse [B, H]`` float32 (a host tensor) of a wire statistic ``(m, l)`` (host
    tensors or float32 arrays, as a peer sent them): what :func:`partial_lse` returns.

    ``-inf`` where ``l = 0`` (empty), ``m + log(l)`` where ``m`` is finite and ``l`` finite and
    positive, NaN anywhere else (a forged or corrupt pair is never a silent "empty"). A
    holder's usual ``(lse, 1)`` gives ``m`` itself.
    """
    mn = m if isinstance(m, np.ndarray) else m.numpy()
    ln = l if isinstance(l, np.ndarray) else l.numpy()
    if all_finite(mn) and all_equal(ln, 1):  # a holder's usual (lse, 1)
        return torch.from_numpy(mn)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = mn + np.log(ln)
        lse = np.where(np.isfinite(lse) & np.isfinite(mn) & np.isfinite(ln), lse, np.nan)
    lse = np.where(ln == 0, -np.inf, lse).astype(np.float32, copy=False)
    return torch.from_numpy(lse)


def pack_partial_lse(
    o: np.ndarray,
    lse: np.ndarray,
    *,
    keyed: np.ndarray | None = None,
    dtype: torch.dtype,
    width: int,
    request_id: int,
    seq: int,
    chunk_id: int,
    layer: int,
    holder_ns: int,
    crc: bool | None,
    array: bool = False,
) -> torch.Tensor | np.ndarray:
    """The holder's reply: :func:`pack_partial_arrays` of a kernel's natural-log ``lse``.

    ``o`` as in :func:`pack_partial_arrays` (the uint8 bytes of ``[B, H, width]`` values in
    ``dtype``); ``lse`` ``[B, H]`` float32 on the host; ``keyed`` ``[B]`` bool (which rows
    attended at least one entry) or None (every row did). The statistic written is
    :func:`stat_of_lse`'s; :func:`partial_lse` reads it back as the same ``lse`` (bit for bit
    where it is finite, ``-inf`` for a row without keys, NaN for a row with keys but no finite
    ``lse``).
    """
    if not isinstance(lse, np.ndarray) or lse.dtype != np.float32 or lse.ndim != 2:
        arr = isinstance(lse, np.ndarray)
        got = f"{lse.dtype} of shape {lse.shape}" if arr else type(lse).__name__
        raise TypeError(f"lse: expected a [B, H] float32 numpy array, got {got}")
    if keyed is not None:
        if not isinstance(keyed, np.ndarray) or keyed.dtype != np.bool_:
            got = keyed.dtype if isinstance(keyed, np.ndarray) else type(keyed).__name__
            raise TypeError(f"keyed: expected a [B] bool numpy array or None, got {got}")
        if keyed.shape != lse.shape[:1]:
            raise ValueError(f"keyed: expected [{lse.shape[0]}] bool, got shape {keyed.shape}")
    m, l = stat_of_lse(lse, keyed)
    return pack_partial_arrays(
        o, m, l, dtype=dtype, width=width, request_id=request_id, seq=seq, chunk_id=chunk_id,
        layer=layer, holder_ns=holder_ns, crc=crc, array=array,
    )  # fmt: skip


def partial_lse(buf, h: Header) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, H, width], lse [B, H])`` of a PARTIAL message whose header ``h``
    :func:`parse_header` has checked: ``o`` in the wire dtype (a view into ``buf``, on its
    device), ``lse`` natural-log float32 on the host (:func:`lse_of_stat` of the message's
    ``(m, l)``, read with numpy: no torch op per statistic for a host message)."""
    if isinstance(buf, np.ndarray) or buf.is_cpu:
        o, m, l = partial_arrays(buf, h)
    else:  # a device message: its 8 bytes a row of statistic come to the host
        o, m, l = partial_views(buf, h)
        m, l = m.cpu().numpy(), l.cpu().numpy()
    return o, lse_of_stat(m, l)


# ---- fetch ---------------------------------------------------------------------------------------


def pack_fetch(
    *,
    request_id: int,
    seq: int,
    chunk_id: int,
    layers: tuple[int, int] | None = None,
    geometry: MLAGeometry | None = None,
    device=None,
    array: bool = False,
) -> torch.Tensor | np.ndarray:
    """A ``FETCH`` request for layers ``[lo, hi)`` of a chunk (default: all ``L``, §2.2);
    ``array`` as in :func:`pack_probe`. A ``geometry`` given says the requester's cache format
    (:func:`format_flags`): a holder keeping another refuses the fetch naming both."""
    g = _geometry(geometry)
    _check_ids(request_id=request_id, seq=seq, chunk_id=chunk_id)
    lo, hi = _check_layers((0, g.layers) if layers is None else layers, g)
    h = Header(
        Kind.FETCH, flags=format_flags(geometry), request_id=request_id, seq=seq,
        chunk_id=chunk_id, layer_lo=lo, layer_hi=hi,
    )  # fmt: skip
    return _header_only(h, device, array)


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
    crc: bool | None = None,
) -> torch.Tensor:
    """Pack a chunk's cache entries ``kv [n_layers, c_t, d_qk]`` as one ``CHUNK`` message
    (a geometry whose ``cache_dtype`` is ``"fp8_e4m3"``: its FP8 entries ``[n_layers, c_t,
    b_KV]`` uint8, 656 B a token for 512 + 64, as ``fp8_quantize`` writes them).

    ``position`` is the canonical position of the chunk's first token (the splice's ``old``
    position, §2.2); ``layers`` the half-open range the ``n_layers`` slices cover; ``crc`` as
    in :func:`pack_query`.
    """
    g = _geometry(geometry)
    _check_chunk_entries(kv, g)
    lo, hi = _check_layers(layers, g)
    if kv.shape[0] != hi - lo:
        raise ValueError(f"kv: expected {hi - lo} layers (range [{lo}, {hi})), got {kv.shape[0]}")
    _check_ids(request_id=request_id, seq=seq, chunk_id=chunk_id, position=position)
    nl, ct, D = kv.shape
    nbytes = chunk_payload_bytes(nl, ct, D, kv.dtype)
    h = Header(
        Kind.CHUNK, kv.dtype, 0, request_id, seq, chunk_id, ct, 0, D, lo, hi, 0, nbytes, position
    )
    return _assemble(h, (kv,), kv.device, out, crc)


def _check_chunk_entries(kv: object, g: MLAGeometry) -> None:
    """``kv`` in the geometry's cache format: float rows ``[.., .., d_qk]``, or for
    ``"fp8_e4m3"`` uint8 entries ``[.., .., b_KV]``; a format mismatch names both."""
    fp8 = g.cache_dtype == _FP8
    if isinstance(kv, torch.Tensor) and (kv.dtype is torch.uint8) != fp8:
        sent = f"uint8 ({_FP8} entries)" if kv.dtype is torch.uint8 else str(kv.dtype)[6:]
        raise ValueError(
            f"kv: cache format mismatch: got {sent}, geometry {g.name!r} keeps a {g.cache_dtype} "
            "cache" + (" (quantize the rows with fp8_quantize first)" if fp8 else "")
        )
    if not fp8:
        _check_float("kv", kv, 3, g.d_qk)
    elif kv.dim() != 3 or kv.shape[-1] != g.kv_bytes_per_token_layer:
        raise ValueError(
            f"kv: expected 3 dims with last dim {g.kv_bytes_per_token_layer} ({_FP8} entries of "
            f"geometry {g.name!r}), got shape {tuple(kv.shape)}"
        )


def unpack_chunk(
    buf: torch.Tensor, *, geometry: MLAGeometry | None = None, require_payload_crc: bool = False
) -> tuple[Header, torch.Tensor]:
    """Check and unpack a ``CHUNK`` message: ``(header, kv [n_layers, c_t, d_qk])`` (a view;
    FP8 entries: ``[n_layers, c_t, b_KV]`` uint8)."""
    h = parse_header(
        buf, geometry=geometry, expect=Kind.CHUNK, require_payload_crc=require_payload_crc
    )
    _check_error_reply(h, buf, "remote error")
    nl = h.layer_hi - h.layer_lo
    kv = _payload_view(buf, 0, h.payload_bytes, h.dtype, (nl, h.batch, h.width))
    return h, kv


# ---- errors --------------------------------------------------------------------------------------


def pack_error(
    message: str, *, request_id: int, seq: int, chunk_id: int = 0, array: bool = False
) -> torch.Tensor | np.ndarray:
    """An ``ERROR`` message answering request ``request_id`` (UTF-8 text, at most 4 KiB);
    ``array`` as in :func:`pack_probe`."""
    _check_ids(request_id=request_id, seq=seq, chunk_id=chunk_id)
    data = str(message).encode("utf-8", errors="replace")[:4096]
    h = Header(
        Kind.ERROR, request_id=request_id, seq=seq, chunk_id=chunk_id, payload_bytes=len(data)
    )
    return _host_message(h, (np.frombuffer(data, dtype=np.uint8),), None, array)


def unpack_error(buf: torch.Tensor) -> tuple[Header, str]:
    """Check and unpack an ``ERROR`` message: ``(header, text)``."""
    h = parse_header(buf, expect=Kind.ERROR)
    raw = buf[HEADER_BYTES : h.nbytes]
    raw = raw if isinstance(raw, np.ndarray) else raw.cpu().numpy()
    text = bytes(raw).decode("utf-8", errors="replace")
    return h, text
