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

    {"format": "mqnc-corpus", "version": 1, "tensors": "<name>.safetensors",
     "geometry": {...MLAGeometry fields...}, "softmax_scale": 0.1147, "dtype": "bfloat16",
     "block_size": 64, "rope": {...RopeSpec fields...} or null,
     "chunks": [{"chunk_id": 0, "start": 0, "tokens": 64, "position": 0, "holders": [1, 2]}, ...],
     "meta": {...}}

and a safetensors file beside it holding one tensor ``chunk.<id>`` ``[L, c_t, d_qk]`` per chunk,
so that a holder reads only its own chunks (``safetensors.safe_open`` maps the file lazily).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mqnc.base.checks import check_int, check_number
from mqnc.model.geometry import MLAGeometry
from mqnc.model.rope import RopeSpec, YarnScaling
from mqnc.serving.holder import Holder
from mqnc.serving.records import ChunkInfo
from mqnc.serving.requester import Requester
from mqnc.transport import slot_bytes_for

__all__ = ["ChunkSpec", "Corpus", "place_round_robin", "dtype_code", "FORMAT", "VERSION"]

FORMAT = "mqnc-corpus"
VERSION = 1
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_CODES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


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
        Cache dtype (bf16, fp16 or fp32): the holders' pool dtype and the routed rows' dtype.
    entries : torch.Tensor or None
        ``[L, C, d_qk]`` in ``dtype``, the whole cache in memory; None for a corpus loaded from a
        file (chunks are read on demand).
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
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size: expected a power of two >= 16, got {block_size}")
        self.geometry = geometry
        self.softmax_scale = check_number("softmax_scale", softmax_scale, positive=True)
        self.dtype = dtype
        self.rope = rope
        self.block_size = int(block_size)
        self.meta = dict(meta or {})
        self.path = None if path is None else Path(path)
        self.chunks = {c.chunk_id: c for c in chunks}
        if len(self.chunks) != len(chunks) or not chunks:
            raise ValueError(
                f"chunks: expected distinct chunk ids, got {[c.chunk_id for c in chunks]}"
            )
        spans = sorted((c.start, c.start + c.tokens, c.chunk_id) for c in chunks)
        for c in chunks:
            if c.tokens < 1 or c.start < 0 or not c.holders:
                raise ValueError(f"chunks: chunk {c.chunk_id} needs >= 1 token and a holder: {c}")
        for (_, hi, a), (lo, _, b) in zip(spans[:-1], spans[1:], strict=True):
            if lo < hi:
                raise ValueError(f"chunks: chunks {a} and {b} overlap on the token axis")
        if entries is not None:
            g = geometry
            if entries.dim() != 3 or entries.shape[0] != g.layers or entries.shape[2] != g.d_qk:
                raise ValueError(
                    f"entries: expected shape ({g.layers}, C, {g.d_qk}), got {tuple(entries.shape)}"
                )
            if entries.dtype != dtype:
                raise TypeError(f"entries: invalid dtype, expected {dtype}, got {entries.dtype}")
            if spans[-1][1] > entries.shape[1]:
                raise ValueError(
                    f"chunks: the last chunk ends at token {spans[-1][1]}, entries hold "
                    f"{entries.shape[1]}"
                )
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
        kwargs.setdefault("dtype", entries.dtype)
        return cls(geometry, softmax_scale, chunks, entries=entries, **kwargs)

    # ---- queries ----------------------------------------------------------------------------
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
        prints = self._fingerprints()
        return [
            ChunkInfo(c.chunk_id, c.tokens, c.position, c.holders, prints.get(c.chunk_id))
            for _, c in sorted(self.chunks.items())
        ]

    def _fingerprints(self) -> dict[int, str]:
        ids = self.meta.get("token_ids")
        if not isinstance(ids, list) or len(ids) < max(
            c.start + c.tokens for c in self.chunks.values()
        ):
            return {}
        h = hashlib.sha256(
            json.dumps([self.meta.get("model_type"), self.meta.get("name_or_path")]).encode()
        )
        out, done = {}, 0
        for c in sorted(self.chunks.values(), key=lambda c: c.start + c.tokens):
            end = c.start + c.tokens
            h.update(json.dumps(ids[done:end]).encode())
            done = end
            out[c.chunk_id] = h.copy().hexdigest()
        return out

    def chunk_kv(self, chunk_id: int) -> torch.Tensor:
        """The cache of one chunk, ``[L, c_t, d_qk]`` in :attr:`dtype`."""
        try:
            c = self.chunks[chunk_id]
        except KeyError:
            raise KeyError(f"chunk_id: no chunk {chunk_id} (have {sorted(self.chunks)})") from None
        if self.entries is not None:
            return self.entries[:, c.start : c.start + c.tokens]
        from safetensors import safe_open

        with safe_open(str(self._tensor_path()), framework="pt") as f:
            kv = f.get_tensor(f"chunk.{chunk_id}")
        g = self.geometry
        if tuple(kv.shape) != (g.layers, c.tokens, g.d_qk) or kv.dtype != self.dtype:
            raise ValueError(
                f"{self._tensor_path()}: chunk.{chunk_id} is {tuple(kv.shape)} {kv.dtype}, the "
                f"manifest says ({g.layers}, {c.tokens}, {g.d_qk}) {self.dtype}"
            )
        return kv

    def slot_bytes(self, max_rows: int) -> int:
        """Transport slot size for routes of up to ``max_rows`` rows and fetches of any chunk."""
        code = dtype_code(self.dtype)
        return slot_bytes_for(
            self.geometry.replace(cache_dtype=code, wire_dtype=code),
            max_rows=max_rows,
            max_chunk_tokens=max(c.tokens for c in self.chunks.values()),
        )

    def make_holder(self, transport, **holder_kwargs):
        """A :class:`mqnc.serving.Holder` on ``transport`` with this rank's chunks in its pool
        (``holder_kwargs``: ``device``, ``kernels``, ``batch_window_s``, ...)."""
        mine = self.chunks_on(transport.rank)
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
        requester_kwargs.setdefault("rope", self.rope)
        req = Requester(
            transport,
            self.geometry,
            softmax_scale=self.softmax_scale,
            pool_blocks=2 * sum(blocks) + max(blocks),
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
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path.with_suffix(".safetensors")))
        manifest = dict(
            format=FORMAT,
            version=VERSION,
            tensors=path.with_suffix(".safetensors").name,
            geometry=dataclasses.asdict(self.geometry),
            softmax_scale=self.softmax_scale,
            dtype=str(self.dtype).replace("torch.", ""),
            block_size=self.block_size,
            rope=_rope_to_dict(self.rope),
            chunks=[
                dict(dataclasses.asdict(c), holders=list(c.holders))
                for _, c in sorted(self.chunks.items())
            ],
            meta=self.meta,
        )
        path.write_text(json.dumps(manifest, indent=1))
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | Path) -> Corpus:
        """Read a manifest written by :meth:`save` (the chunks stay on disk until asked for)."""
        path = Path(path)
        try:
            m = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"corpus: cannot read {str(path)!r} as a JSON manifest ({exc})"
            ) from None
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
            raise ValueError(
                f"corpus: {str(path)!r} is not an {FORMAT} v{VERSION} manifest "
                f"(format {m.get('format') if isinstance(m, dict) else None!r})"
            )
        if m.get("dtype") not in _DTYPES:
            raise ValueError(
                f"corpus: dtype expected one of {sorted(_DTYPES)}, got {m.get('dtype')!r}"
            )
        if m.get("tensors") != path.with_suffix(".safetensors").name:
            raise ValueError(
                f"corpus: tensors expected {path.with_suffix('.safetensors').name!r} beside the "
                f"manifest, got {m.get('tensors')!r}"
            )
        try:
            chunks = [
                ChunkSpec(
                    int(c["chunk_id"]),
                    int(c["start"]),
                    int(c["tokens"]),
                    int(c["position"]),
                    tuple(int(h) for h in c["holders"]),
                )
                for c in m["chunks"]
            ]
            geometry = MLAGeometry(**m["geometry"])
            rope = _rope_from_dict(m.get("rope"))
            scale = check_number("softmax_scale", m["softmax_scale"], positive=True)
            block_size = check_int("block_size", m.get("block_size", 64), minimum=1)
            dtype = _DTYPES[m["dtype"]]
        except KeyError as exc:
            raise ValueError(f"corpus: malformed manifest {str(path)!r} (no {exc})") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"corpus: malformed manifest {str(path)!r} ({exc})") from None
        return cls(
            geometry,
            scale,
            chunks,
            dtype=dtype,
            rope=rope,
            block_size=block_size,
            meta=m.get("meta") or {},
            path=path,
        )
