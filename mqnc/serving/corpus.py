"""A shared context's latent cache as a corpus: chunks at canonical positions, placed on holders,
written once to a file that every holder loads its own chunks from.

A :class:`Corpus` is the cache entries ``[L, C, d_qk]`` (``[c_KV, k_pe]`` per token and layer,
``k_pe`` rotated at the token's canonical position, §2.1) of ``C`` context tokens, cut into
contiguous chunks, each placed on one or more holder ranks (replicas, in order of preference).
It knows nothing about the model that computed it (see :mod:`mqnc.integrations.hf` for a
Hugging Face DeepSeek model's prefill); it carries what a holder needs (geometry, softmax scale,
dtype, block size) and what a requester needs (the chunk directory, the RoPE spec to rotate
queries or splice at another offset, and free-form metadata such as the context's token ids
for a local re-prefill).

File format (no pickle, §3.2's rule for anything read from elsewhere): a JSON manifest

.. code-block:: text

    {"format": "mqnc-corpus", "version": 2, "tensors": "<name>.safetensors",
     "geometry": {...MLAGeometry fields...}, "softmax_scale": 0.1147, "dtype": "bfloat16",
     "block_size": 64, "rope": {...RopeSpec fields...} or null,
     "chunks": [{"chunk_id": 0, "start": 0, "tokens": 64, "position": 0, "holders": [1, 2],
                 "sha256": "<64 hex digits>"}, ...],
     "meta": {...}}

and a safetensors file beside it holding one tensor ``chunk.<id>`` ``[L, c_t, d_qk]`` per chunk,
so that a holder reads only its own chunks (written with ``safetensors``; read here by seeking
to the chunk's bytes, after the checks below).

FP8 corpora: a geometry whose ``cache_dtype`` is ``"fp8_e4m3"`` (DeepSeek-V3.2's 656-byte
entry, ``mqnc.model.kv_format``) keeps its chunks as those entries, ``[L, c_t, b_KV]`` uint8
(``U8`` in the file), while ``dtype`` stays the routed rows' (bf16); the manifest says
``"kv_format": "fp8_e4m3"`` beside the geometry (which carries it too: the two must agree), and
sizes and SHA-256 checks are the bf16 corpus' own.

Nothing read from the file is trusted before it is checked, and every error is one
``ValueError`` naming the file and the manifest entry (``chunks[i] (chunk_id c)``):

- the JSON (manifest and safetensors header) is refused when nested deeper than
  :data:`MAX_DEPTH` (a manifest is shallow; checked before the parser recurses) or when it holds
  a non-finite number (``NaN``, ``Infinity``, ``1e999``);
- every field is range-checked: ints are ints (never a float cut to one, nor a bool), token
  counts, starts and positions end below :data:`MAX_TOKENS` (the pools count tokens and address
  blocks in int32), the softmax scale is finite, positive and at most 4x the model's own
  (``qk_head_dim ** -0.5 * mscale ** 2``, from the RoPE spec when there is one), the block size
  a power of two no larger than the largest chunk needs (64 always allowed);
- when the ``.safetensors`` is beside the manifest (:meth:`Corpus.load`; a requester's machine
  may have only the manifest, and then its sizes are the manifest's), every chunk's dtype,
  shape and data offsets are checked against the file's header and size before anything is
  allocated, and :meth:`Corpus.make_holder` checks them again before it sizes its pool;
- every chunk read is checked against the manifest's SHA-256 of its bytes: a flipped byte is an
  error naming the file and the chunk, never a silently wrong cache.

Why SHA-256 (``hashlib``) and not the wire's CRC-32: a holder hashes its chunks once, when it
loads them (about 1.4 GB/s on this 2-core machine, against 16 GB/s for ISA-L's CRC-32: ~0.7 s
per GB of cache); in exchange a corruption of any size escapes only with probability 2^-256
(CRC-32: any burst up to 32 bits is caught, a longer one missed with 2^-32), and a manifest
obtained from a trusted place authenticates the tensors, which a CRC cannot (anyone can forge
one).

Versions: 2 carries the checksums (what :meth:`Corpus.save` writes). A version-1 manifest
(written before them) still loads, every size still checked against the file, with one
``UserWarning`` per load naming the file and saying that its chunks are not verified; saving it
again writes version 2 (the checksums then vouch for what was read, unverified).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import stat
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mqnc.base.checks import check_int, check_number, is_int
from mqnc.model.geometry import MLAGeometry
from mqnc.model.rope import RopeSpec, YarnScaling
from mqnc.serving.holder import Holder
from mqnc.serving.records import ChunkInfo
from mqnc.serving.requester import Requester
from mqnc.transport import slot_bytes_for

__all__ = [
    "ChunkSpec",
    "Corpus",
    "place_round_robin",
    "dtype_code",
    "FORMAT",
    "VERSION",
    "MAX_DEPTH",
    "MAX_TOKENS",
    "parse_json",
    "open_regular",
]

FORMAT = "mqnc-corpus"
VERSION = 2  # 2: a SHA-256 per chunk; 1 (no checksums) still loads, with a warning
MAX_DEPTH = 16  # JSON nesting a manifest or a safetensors header may have (they use 4)
MAX_TOKENS = 2**31 - 1  # token ends and positions: the pools count tokens in int32
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_CODES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8"}
_FP8 = "fp8_e4m3"
# a chunks' file header: ~120 B per chunk as the package writes it (name, dtype, shape, offsets),
# so 8 MiB holds ~70,000 chunks; safetensors' own bound (100 MB) is far past any corpus's
_HEADER_LIMIT = 8 * 2**20
_SHA256 = re.compile(r"[0-9a-f]{64}")


def dtype_code(dtype: torch.dtype, name: str = "dtype") -> str:
    """The :class:`~mqnc.model.MLAGeometry` code (``"bf16"``, ``"fp16"``, ``"fp32"``) of a
    cache dtype, or a ``TypeError`` naming ``name``."""
    try:
        return _DTYPE_CODES[dtype]
    except (KeyError, TypeError):
        raise TypeError(f"{name}: expected bfloat16, float16 or float32, got {dtype}") from None


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """One chunk: ``tokens`` entries from index ``start`` of the corpus' token axis, cached at
    canonical positions ``position .. position + tokens - 1``, held by ``holders`` (ranks, the
    first preferred)."""

    chunk_id: int
    start: int
    tokens: int
    position: int
    holders: tuple[int, ...]


def place_round_robin(n_chunks: int, holders: Sequence[int], replicas: int = 1) -> list[tuple]:
    """Chunk ``c`` on ``holders[c % M]`` and the ``replicas - 1`` holders after it (mod M)."""
    holders = [int(h) for h in holders]
    if not holders or len(set(holders)) != len(holders):
        raise ValueError(f"holders: expected distinct holder ranks, got {holders}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas:
        raise ValueError(f"replicas: expected an int >= 1, got {replicas!r}")
    if replicas > len(holders):
        raise ValueError(f"replicas: expected <= {len(holders)} (the holders), got {replicas}")
    m = len(holders)
    return [tuple(holders[(c + r) % m] for r in range(replicas)) for c in range(n_chunks)]


def _rope_to_dict(rope) -> dict | None:
    return None if rope is None else dataclasses.asdict(rope)


def _rope_from_dict(d: dict | None):
    if d is None:
        return None
    d = dict(d)
    yarn = d.pop("yarn", None)
    return RopeSpec(**d, yarn=None if yarn is None else YarnScaling(**yarn))


def _non_finite(text: str):
    raise ValueError(f"a non-finite number {text!r}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"a non-finite number {text!r}")
    return value


def parse_json(text: str, what: str) -> Any:
    """``text`` as JSON nested at most :data:`MAX_DEPTH` deep with finite numbers only; a
    ``ValueError`` naming ``what`` otherwise. Linear in ``text``: the standard library's
    parser (its C scanner ends deeper nesting than Python's recursion limit with a
    ``RecursionError``), then the depth counted over the parsed values without recursion."""
    too_deep = f"{what} is nested deeper than {MAX_DEPTH} levels (a manifest is shallow)"
    try:
        value = json.loads(text, parse_constant=_non_finite, parse_float=_finite_float)
    except RecursionError:
        raise ValueError(too_deep) from None
    except ValueError as exc:  # json.JSONDecodeError is one
        raise ValueError(f"{what} is not JSON ({exc})") from None
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                raise ValueError(too_deep)
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return value


def _chunk_entry(i: int, entry: Any, version: int) -> tuple[ChunkSpec, str | None]:
    """Manifest entry ``chunks[i]`` as a :class:`ChunkSpec` and its SHA-256 (None in v1)."""
    cid = entry.get("chunk_id") if isinstance(entry, dict) else None
    try:
        if not isinstance(entry, dict):
            raise ValueError(f"expected an object, got {type(entry).__name__}")
        cid = check_int("chunk_id", cid, minimum=0, below=2**63)
        start = check_int("start", entry.get("start"), minimum=0, below=MAX_TOKENS)
        tokens = check_int("tokens", entry.get("tokens"), minimum=1, below=MAX_TOKENS)
        position = check_int("position", entry.get("position"), minimum=0, below=MAX_TOKENS)
        holders = entry.get("holders")
        if (
            not isinstance(holders, list)
            or not holders
            or not all(is_int(h) and h >= 0 for h in holders)
            or len(set(holders)) != len(holders)
        ):
            raise ValueError(f"holders: expected distinct ranks (ints >= 0), got {holders!r}")
        sha = entry.get("sha256")
        if version >= 2 and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise ValueError(f"sha256: expected 64 hex digits (lower case), got {sha!r}")
    except ValueError as exc:
        raise ValueError(f"chunks[{i}] (chunk_id {cid!r}): {exc}") from None
    return ChunkSpec(cid, start, tokens, position, tuple(int(h) for h in holders)), sha


def _free_bytes(device: torch.device) -> int | None:
    """Bytes free on ``device`` (a CUDA device's, or the host's available memory), None when
    this system does not say."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:  # Linux: what the kernel says can be allocated without swapping (page cache included)
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def open_regular(path: Path, what: str):
    """``path`` opened for binary reading, if it is a regular, non-empty file (a symlink to
    one included); anything else (a FIFO, a device, a directory, an empty file) is a
    ``ValueError`` naming ``what`` and the kind, raised before any read could block: the file
    is opened without blocking and its kind read from the open descriptor (no window between a
    check and the open)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kinds = {stat.S_ISFIFO: "a FIFO", stat.S_ISDIR: "a directory",
                     stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
                     stat.S_ISSOCK: "a socket"}  # fmt: skip
            kind = next((k for f, k in kinds.items() if f(st.st_mode)), "not a regular file")
            raise ValueError(f"{what}: expected a regular file, got {kind} ({str(path)!r})")
        if st.st_size == 0:
            raise ValueError(f"{what}: expected a non-empty file, got an empty one ({str(path)!r})")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _file_header(path: Path) -> tuple[dict, int, int]:
    """A safetensors file's header, where its data starts and the file's size; the header's
    declared length is checked against the file before it is read."""
    try:
        with open_regular(path, "corpus: the chunks' file") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"corpus: {path}: {size} bytes, too short for a safetensors file")
            n = int.from_bytes(head, "little")
            if not 2 <= n <= size - 8:
                raise ValueError(
                    f"corpus: {path}: a header of {n} bytes declared, the file has {size} bytes"
                )
            if n > _HEADER_LIMIT:
                raise ValueError(
                    f"corpus: {path}: a header of {n} bytes declared, more than the "
                    f"{_HEADER_LIMIT} bytes a chunks' file's header may have (~120 B a chunk)"
                )
            text = f.read(n).decode("utf-8")
    except OSError as exc:
        raise ValueError(f"corpus: cannot read the chunks' file {str(path)!r} ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"corpus: {path}: the header is not JSON ({exc})") from None
    header = parse_json(text, f"corpus: {path}: the header")
    if not isinstance(header, dict):
        raise ValueError(f"corpus: {path}: the header is not a JSON object")
    return header, 8 + n, size


def _chunk_span(header: dict, data: int, size: int, c: ChunkSpec, corpus: Corpus, where: str):
    """Byte range ``[lo, hi)`` of chunk ``c``'s data in the file, its dtype, shape and offsets
    checked against the manifest and the file's size."""
    g, name = corpus.geometry, f"chunk.{c.chunk_id}"
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: the file holds no tensor {name!r}")
    want, code = [g.layers, c.tokens, corpus.entry_width], _ST_DTYPES[corpus.entry_dtype]
    shape, dtype = entry.get("shape"), entry.get("dtype")
    if shape != want or dtype != code:
        got = tuple(shape) if isinstance(shape, list) else shape
        raise ValueError(
            f"{where}: the manifest declares {tuple(want)} {code}, the file holds {got} {dtype}"
        )
    nbytes = math.prod(want) * corpus.entry_dtype.itemsize
    offsets = entry.get("data_offsets")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(is_int(o) and o >= 0 for o in offsets)
        and offsets[1] - offsets[0] == nbytes
    ):
        raise ValueError(f"{where}: data offsets {offsets!r} do not span its {nbytes} bytes")
    lo, hi = data + offsets[0], data + offsets[1]
    if hi > size:
        raise ValueError(
            f"{where}: its data ends at byte {hi}, past the end of the file ({size} bytes)"
        )
    return lo, hi


def _check_entries(entries, g: MLAGeometry, dtype: torch.dtype, width: int, end: int) -> None:
    """A corpus' in-memory ``entries [L, C, width]`` in ``dtype`` (FP8: uint8 entries of
    ``b_KV`` bytes) holding at least ``end`` tokens."""
    fp8 = g.cache_dtype == _FP8
    if entries.dim() != 3 or entries.shape[0] != g.layers or entries.shape[2] != width:
        raise ValueError(
            f"entries: expected shape ({g.layers}, C, {width}), got {tuple(entries.shape)}"
            + (f" ({_FP8} entries of {width} B)" if fp8 else "")
        )
    if entries.dtype != dtype:
        raise TypeError(
            f"entries: invalid dtype, expected {dtype}, got {entries.dtype}"
            + (f" (geometry.cache_dtype is {_FP8})" if fp8 else "")
        )
    if end > entries.shape[1]:
        raise ValueError(
            f"chunks: the last chunk ends at token {end}, entries hold {entries.shape[1]}"
        )


class Corpus:
    """Chunks of one context's latent cache, their placement and what holders need to serve them.

    Parameters
    ----------
    geometry : MLAGeometry
        Dims (``layers``, ``d_qk``, ``d_v``) of the model that wrote the cache.
    softmax_scale : float
        The model's attention scale (holders attend with it).
    chunks : sequence of ChunkSpec
        Contiguous, non-overlapping chunks of the token axis.
    dtype : torch.dtype
        Cache dtype (bf16, fp16 or fp32): the holders' pool dtype and the routed rows' dtype
        (an FP8 corpus: the routed rows' and the dequantized rows' dtype).
    entries : torch.Tensor or None
        ``[L, C, d_qk]`` in ``dtype``, the whole cache in memory (``geometry.cache_dtype``
        ``"fp8_e4m3"``: its FP8 entries ``[L, C, b_KV]`` uint8); None for a corpus loaded from
        a file (chunks are read on demand).
    rope : mqnc.model.RopeSpec or None
        The model's RoPE (frequencies, pair layout): what a requester needs to route or fetch a
        chunk at another offset than its canonical position.
    block_size : int
        Holders' pool page (tokens).
    meta : dict
        JSON-able free-form data (model name, the context's token ids, the prefill's time).
    """

    def __init__(
        self,
        geometry: MLAGeometry,
        softmax_scale: float,
        chunks: Sequence[ChunkSpec],
        *,
        dtype: torch.dtype,
        entries: torch.Tensor | None = None,
        rope=None,
        block_size: int = 64,
        meta: dict[str, Any] | None = None,
        path: str | Path | None = None,
    ) -> None:
        if not isinstance(geometry, MLAGeometry):
            raise TypeError(f"geometry: expected an MLAGeometry, got {type(geometry).__name__}")
        dtype_code(dtype)
        self.geometry = geometry
        self.softmax_scale = check_number("softmax_scale", softmax_scale, positive=True)
        # 4x the model's own scale: a larger one is no model's, and overflows scores
        limit = 4 * getattr(rope, "softmax_scale", geometry.qk_head_dim**-0.5)
        if self.softmax_scale > limit:
            raise ValueError(
                f"softmax_scale: expected a finite number in (0, {limit:.6g}] (4x the model's "
                f"qk_head_dim ** -0.5 * mscale ** 2), got {softmax_scale!r}"
            )
        self.dtype = dtype
        self.rope = rope
        self.meta = dict(meta or {})
        self.path = None if path is None else Path(path)
        self.chunks = {c.chunk_id: c for c in chunks}
        self._sha256: dict[int, str] = {}  # chunk id -> checksum, from a version-2 manifest
        self._spans: tuple[dict[int, tuple[int, int]], int] | None = None  # in the file, size
        if len(self.chunks) != len(chunks) or not chunks:
            raise ValueError(
                f"chunks: expected distinct chunk ids, got {[c.chunk_id for c in chunks]}"
            )
        for c in chunks:
            if not (is_int(c.tokens) and is_int(c.start) and is_int(c.position)):
                raise ValueError(f"chunks: chunk {c.chunk_id}: expected int fields, got {c}")
            if c.tokens < 1 or c.start < 0 or c.position < 0 or not c.holders:
                raise ValueError(f"chunks: chunk {c.chunk_id} needs >= 1 token and a holder: {c}")
            if max(c.start, c.position) + c.tokens > MAX_TOKENS:
                raise ValueError(
                    f"chunks: chunk {c.chunk_id} ends past token {MAX_TOKENS} (the pools' int32 "
                    f"limit): {c}"
                )
        spans = sorted((c.start, c.start + c.tokens, c.chunk_id) for c in chunks)
        most = 1 << (max(c.tokens for c in chunks) - 1).bit_length()
        if check_int("block_size", block_size, minimum=16) & (block_size - 1):
            raise ValueError(f"block_size: expected a power of two >= 16, got {block_size!r}")
        if block_size > max(64, most):  # a page past the largest chunk only wastes pool
            raise ValueError(
                f"block_size: expected a power of two in [16, {max(64, most)}] (the largest "
                f"chunk's tokens, rounded up), got {block_size}"
            )
        self.block_size = int(block_size)
        for (_, hi, a), (lo, _, b) in zip(spans[:-1], spans[1:], strict=True):
            if lo < hi:
                raise ValueError(f"chunks: chunks {a} and {b} overlap on the token axis")
        if entries is not None:
            _check_entries(entries, geometry, self.entry_dtype, self.entry_width, spans[-1][1])
        elif self.path is None:
            raise ValueError("entries: expected the cache tensor or a corpus file (path=)")
        self.entries = entries

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def partition(
        cls,
        entries: torch.Tensor,
        geometry: MLAGeometry,
        softmax_scale: float,
        *,
        chunk_tokens: int,
        holders: Sequence[int],
        replicas: int = 1,
        position: int = 0,
        **kwargs,
    ) -> Corpus:
        """Cut ``entries [L, C, d_qk]`` (token ``t`` cached at position ``position + t``) into
        chunks of ``chunk_tokens`` (the last may be shorter), placed round robin on ``holders``
        with ``replicas`` copies each (:func:`place_round_robin`)."""
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: expected an int >= 1, got {chunk_tokens!r}")
        position = check_int("position", position, minimum=0)
        C = int(entries.shape[1])
        starts = list(range(0, C, chunk_tokens))
        places = place_round_robin(len(starts), holders, replicas)
        chunks = [
            ChunkSpec(i, s, min(chunk_tokens, C - s), position + s, places[i])
            for i, s in enumerate(starts)
        ]
        # FP8 entries (uint8): the routed rows default to bf16
        kwargs.setdefault(
            "dtype", torch.bfloat16 if entries.dtype == torch.uint8 else entries.dtype
        )
        return cls(geometry, softmax_scale, chunks, entries=entries, **kwargs)

    # ---- queries ----------------------------------------------------------------------------
    @property
    def entry_dtype(self) -> torch.dtype:
        """The chunks' stored dtype: uint8 for FP8 entries, else :attr:`dtype`."""
        return torch.uint8 if self.geometry.cache_dtype == _FP8 else self.dtype

    @property
    def entry_width(self) -> int:
        """A stored entry's last dim: ``b_KV`` bytes for FP8 entries (656), else ``d_qk``."""
        g = self.geometry
        return g.kv_bytes_per_token_layer if g.cache_dtype == _FP8 else g.d_qk

    @property
    def tokens(self) -> int:
        """Context tokens covered by the chunks."""
        return sum(c.tokens for c in self.chunks.values())

    @property
    def position(self) -> int:
        """Canonical position of the first chunk's first token."""
        return min(c.position for c in self.chunks.values())

    @property
    def holder_ranks(self) -> list[int]:
        """Every rank that holds at least one chunk, sorted."""
        return sorted({h for c in self.chunks.values() for h in c.holders})

    def chunks_on(self, rank: int) -> list[ChunkSpec]:
        """The chunks ``rank`` holds, by id."""
        return [c for _, c in sorted(self.chunks.items()) if rank in c.holders]

    def directory(self) -> list:
        """One :class:`mqnc.serving.ChunkInfo` per chunk (what a requester registers), with a
        fingerprint of what it holds when ``meta`` has the context's ``token_ids``: the SHA-256
        of the model's ``model_type`` and ``name_or_path`` and the token ids up to the chunk's
        end (a chunk's cache depends on every token before it). It tells two corpora of other
        tokens apart; two models of one name with other weights look alike."""
        prints = _fingerprints(self)
        return [
            ChunkInfo(c.chunk_id, c.tokens, c.position, c.holders, prints.get(c.chunk_id))
            for _, c in sorted(self.chunks.items())
        ]

    def chunk_digests(self) -> dict[int, str]:
        """Each chunk's SHA-256 (hex) over its cache bytes, by chunk id: the checksums of the
        version-2 manifest it was loaded from or saved to, else computed from the chunks (a
        corpus held in memory, or read from a version-1 manifest: every chunk is read once)."""
        if set(self._sha256) >= set(self.chunks):
            return {cid: self._sha256[cid] for cid in sorted(self.chunks)}
        return {
            cid: hashlib.sha256(
                self.chunk_kv(cid).contiguous().cpu().view(torch.uint8).numpy()
            ).hexdigest()
            for cid in sorted(self.chunks)
        }

    def chunk_kv(self, chunk_id: int) -> torch.Tensor:
        """The cache of one chunk, ``[L, c_t, d_qk]`` in :attr:`dtype` (FP8: its entries
        ``[L, c_t, b_KV]`` uint8)."""
        try:
            c = self.chunks[chunk_id]
        except KeyError:
            raise KeyError(f"chunk_id: no chunk {chunk_id} (have {sorted(self.chunks)})") from None
        if self.entries is not None:
            return self.entries[:, c.start : c.start + c.tokens]
        spans, size = self._file_spans()
        lo, hi = spans[chunk_id]
        path, where = self._tensor_path(), self._where(chunk_id)
        buf = bytearray(hi - lo)  # checked against the file's header and size
        try:
            with open_regular(path, "corpus: the chunks' file") as f:
                now = f.seek(0, 2)
                if now != size:
                    raise ValueError(
                        f"{where}: the file changed since it was checked ({now} bytes, was {size})"
                    )
                f.seek(lo)
                got = f.readinto(buf)
        except OSError as exc:
            raise ValueError(f"{where}: cannot read the chunk ({exc})") from None
        if got != hi - lo:
            raise ValueError(f"{where}: read {got} of its {hi - lo} bytes")
        want = self._sha256.get(chunk_id)
        if want is not None and hashlib.sha256(buf).hexdigest() != want:
            raise ValueError(
                f"{where}: checksum mismatch (the SHA-256 of its bytes is not the manifest's): "
                "the file is corrupt or not the one the manifest was written with"
            )
        g = self.geometry
        return torch.frombuffer(buf, dtype=self.entry_dtype).view(
            g.layers, c.tokens, self.entry_width
        )

    def _where(self, chunk_id: int) -> str:
        """``corpus: <file>: chunks[i] (chunk_id c) of <manifest>``: what an error names."""
        i = sorted(self.chunks).index(chunk_id)
        name = "" if self.path is None else f" of {self.path.name}"
        return f"corpus: {self._tensor_path()}: chunks[{i}] (chunk_id {chunk_id}){name}"

    def _file_spans(self) -> tuple[dict[int, tuple[int, int]], int]:
        """Every chunk's byte range in the ``.safetensors`` file and the file's size, each
        chunk's dtype, shape and offsets checked against the manifest and the file (once)."""
        if self._spans is None:
            header, data, size = _file_header(self._tensor_path())
            spans = {
                cid: _chunk_span(header, data, size, c, self, self._where(cid))
                for cid, c in sorted(self.chunks.items())
            }
            order = sorted((lo, hi, cid) for cid, (lo, hi) in spans.items())
            for (_, hi, a), (lo, _, b) in zip(order[:-1], order[1:], strict=True):
                if lo < hi:
                    raise ValueError(f"{self._where(b)}: its data overlaps chunk {a}'s")
            self._spans = spans, size
        return self._spans

    def slot_bytes(self, max_rows: int) -> int:
        """Transport slot size for routes of up to ``max_rows`` rows and fetches of any chunk."""
        code = dtype_code(self.dtype)
        cache = self.geometry.cache_dtype if self.geometry.cache_dtype == _FP8 else code
        return slot_bytes_for(
            self.geometry.replace(cache_dtype=cache, wire_dtype=code),
            max_rows=max_rows,
            max_chunk_tokens=max(c.tokens for c in self.chunks.values()),
        )

    def make_holder(self, transport, **holder_kwargs):
        """A :class:`mqnc.serving.Holder` on ``transport`` with this rank's chunks in its pool
        (``holder_kwargs``: ``device``, ``kernels``, ``batch_window_s``, ...)."""
        mine = self.chunks_on(transport.rank)
        if holder_kwargs.get("kernels", "triton") == "triton":
            self.geometry.check_triton()  # a width the kernels cannot run, named before the pool
        if self.entries is None:
            self._file_spans()  # every declared size checked against the file before the pool
        blocks = sum(-(-c.tokens // self.block_size) for c in mine) or 1
        holder = Holder(
            transport,
            self.geometry,
            softmax_scale=self.softmax_scale,
            num_blocks=blocks,
            block_size=self.block_size,
            dtype=self.dtype,
            **holder_kwargs,
        )
        for c in mine:
            holder.add_chunk(c.chunk_id, self.chunk_kv(c.chunk_id), c.position)
        return holder

    def make_requester(self, transport, **requester_kwargs):
        """A :class:`mqnc.serving.Requester` on ``transport`` with this corpus' directory
        registered, its RoPE spec, dtype and block size, and a pool with room for every chunk
        twice (fetched and re-prefilled) plus one (``requester_kwargs``: ``timeout_s``,
        ``kernels``, ``device``, ``model``, ...)."""
        blocks = [-(-c.tokens // self.block_size) for c in self.chunks.values()]
        pool_blocks = 2 * sum(blocks) + max(blocks)
        _check_pool_fits(self, pool_blocks, requester_kwargs.get("device", "cpu"))
        requester_kwargs.setdefault("rope", self.rope)
        req = Requester(
            transport,
            self.geometry,
            softmax_scale=self.softmax_scale,
            pool_blocks=pool_blocks,
            block_size=self.block_size,
            dtype=self.dtype,
            **requester_kwargs,
        )
        for info in self.directory():
            req.register(info)
        return req

    # ---- the file ---------------------------------------------------------------------------
    def _tensor_path(self) -> Path:
        return self.path.with_suffix(".safetensors")

    def save(self, path: str | Path) -> Path:
        """Write the manifest to ``path`` (``.json``) and the chunks to the ``.safetensors``
        beside it; returns the manifest's path."""
        from safetensors.torch import save_file

        path = Path(path)
        if path.suffix != ".json":
            raise ValueError(f"path: expected a .json manifest path, got {str(path)!r}")
        tensors = {
            f"chunk.{cid}": self.chunk_kv(cid).contiguous().cpu() for cid in sorted(self.chunks)
        }
        sums = {
            name: hashlib.sha256(t.view(torch.uint8).numpy()).hexdigest()
            for name, t in tensors.items()
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path.with_suffix(".safetensors")))
        manifest = dict(
            format=FORMAT,
            version=VERSION,
            tensors=path.with_suffix(".safetensors").name,
            geometry=dataclasses.asdict(self.geometry),
            kv_format=self.geometry.cache_dtype,
            softmax_scale=self.softmax_scale,
            dtype=str(self.dtype).replace("torch.", ""),
            block_size=self.block_size,
            rope=_rope_to_dict(self.rope),
            chunks=[
                dict(
                    dataclasses.asdict(c),
                    holders=list(c.holders),
                    sha256=sums[f"chunk.{c.chunk_id}"],
                )
                for _, c in sorted(self.chunks.items())
            ],
            meta=self.meta,
        )
        path.write_text(json.dumps(manifest, indent=1))
        self.path, self._spans = path, None  # chunks are read from the new file from now on
        self._sha256 = {int(k.split(".")[1]): v for k, v in sums.items()}
        return path

    @classmethod
    def load(cls, path: str | Path) -> Corpus:
        """Read a manifest written by :meth:`save` (the chunks stay on disk until asked for).

        Every field is checked (module docstring) and, when the ``.safetensors`` is beside the
        manifest, every chunk's dtype, shape and offsets against its header and size; a
        version-1 manifest (no checksums) loads with one ``UserWarning``. Any error is one
        ``ValueError`` naming the file and the manifest entry.
        """
        path = Path(path)
        try:
            with open_regular(path, "corpus: the manifest") as f:
                text = f.read().decode("utf-8")
            m = parse_json(text, "the text")
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(
                f"corpus: cannot read {str(path)!r} as a JSON manifest ({exc})"
            ) from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ValueError(
                f"corpus: {str(path)!r} is not an {FORMAT} manifest "
                f"(format {m.get('format') if isinstance(m, dict) else None!r})"
            )
        version = m.get("version")
        if not is_int(version) or version not in (1, VERSION):
            raise ValueError(
                f"corpus: {str(path)!r} is an {FORMAT} manifest of version {version!r}; this "
                f"reader reads versions 1 (no checksums) and {VERSION}"
            )
        corpus, sums = _from_manifest(m, path, version)
        if version == 1:
            warnings.warn(
                f"corpus: {path} is a version-1 manifest with no chunk checksums: its chunks "
                "are loaded unverified (their sizes are still checked against the file); save "
                "it again (Corpus.save) to write version 2 with checksums",
                UserWarning,
                stacklevel=2,
            )
        corpus._sha256 = sums
        if corpus._tensor_path().exists():  # a requester's machine may have only the manifest
            corpus._file_spans()
        return corpus


def _from_manifest(m: dict, path: Path, version: int) -> tuple[Corpus, dict[int, str]]:
    """The corpus a parsed manifest describes, and its checksums by chunk id."""
    bad = f"corpus: malformed manifest {str(path)!r}"
    if m.get("dtype") not in _DTYPES:
        raise ValueError(
            f"{bad} (dtype: expected one of {sorted(_DTYPES)}, got {m.get('dtype')!r})"
        )
    if m.get("tensors") != path.with_suffix(".safetensors").name:
        raise ValueError(
            f"corpus: tensors expected {path.with_suffix('.safetensors').name!r} beside the "
            f"manifest {str(path)!r}, got {m.get('tensors')!r}"
        )
    try:
        entries = m["chunks"]
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"chunks: expected a non-empty list, got {entries!r:.40}")
        parsed = [_chunk_entry(i, e, version) for i, e in enumerate(entries)]
        for key in ("geometry", "rope", "meta"):
            if not isinstance(m.get(key, {}), dict | None):
                raise TypeError(f"{key}: expected an object, got {type(m[key]).__name__}")
        geometry = MLAGeometry(**m["geometry"])
        fmt = m.get("kv_format", geometry.cache_dtype)
        if fmt != geometry.cache_dtype:
            raise ValueError(
                f"kv_format: {fmt!r} disagrees with the geometry's cache_dtype "
                f"{geometry.cache_dtype!r}"
            )
        corpus = Corpus(
            geometry,
            m["softmax_scale"],
            [c for c, _ in parsed],
            dtype=_DTYPES[m["dtype"]],
            rope=_rope_from_dict(m.get("rope")),
            block_size=m.get("block_size", 64),
            meta=m.get("meta") or {},
            path=path,
        )
    except KeyError as exc:
        raise ValueError(f"{bad} (no {exc})") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{bad} ({exc})") from None
    return corpus, {c.chunk_id: sha for c, sha in parsed if sha is not None}


def _check_pool_fits(corpus: Corpus, pool_blocks: int, device) -> None:
    """A requester's pool of ``pool_blocks`` blocks for ``corpus``'s chunks fits the memory
    ``device`` has free (a manifest's declared token counts size it before any chunk is read);
    a ``ValueError`` naming the largest chunk's ``tokens`` field otherwise. No check where the
    free memory cannot be read."""
    g = corpus.geometry
    entry = g.kv_bytes_per_token_layer if g.cache_dtype == _FP8 else g.d_qk * corpus.dtype.itemsize
    need = pool_blocks * corpus.block_size * g.layers * entry
    free = _free_bytes(torch.device(device))
    if free is None or need <= free:
        return
    big = max(corpus.chunks.values(), key=lambda c: c.tokens)
    i = sorted(corpus.chunks).index(big.chunk_id)
    raise ValueError(
        f"corpus: a requester's pool for these chunks needs {need / 2**30:.3g} GiB (room "
        f"for every chunk twice plus the largest; chunks[{i}] (chunk_id {big.chunk_id}) "
        f"declares tokens={big.tokens}), more than the {free / 2**30:.3g} GiB free on "
        f"{device}: check the manifest's tokens fields"
    )


def _fingerprints(corpus: Corpus) -> dict[int, str]:
    """Each chunk's prompt fingerprint (a SHA-256 over the model's name and the token ids up
    to the chunk's end), by chunk id; none when the corpus's meta lacks the token ids."""
    ids = corpus.meta.get("token_ids")
    if not isinstance(ids, list) or len(ids) < max(
        c.start + c.tokens for c in corpus.chunks.values()
    ):
        return {}
    h = hashlib.sha256(
        json.dumps([corpus.meta.get("model_type"), corpus.meta.get("name_or_path")]).encode()
    )
    out, done = {}, 0
    for c in sorted(corpus.chunks.values(), key=lambda c: c.start + c.tokens):
        end = c.start + c.tokens
        h.update(json.dumps(ids[done:end]).encode())
        done = end
        out[c.chunk_id] = h.copy().hexdigest()
    return out
