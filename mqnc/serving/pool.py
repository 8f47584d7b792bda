"""A paged cache pool and the partial attention over it: the holder's pool of canonical
chunks and the requester's pool of fetched / re-prefilled ones (§2.2, §3.3).

A pool is ``[L, num_blocks, block_size, d_qk]``: a chunk occupies whole blocks (the same blocks
in every layer), token ``t`` of a chunk with blocks ``b`` sits at flat slot
``b[t // block_size] * block_size + t % block_size`` of a layer's ``[num_blocks * block_size,
d_qk]`` view. Blocks are taken from a free list; nothing here knows about chunks' positions.

A pool may keep FP8 entries (``fp8=`` the layout of ``mqnc.model.kv_format``: DeepSeek-V3.2's
656-byte entry): its storage is then ``[L, num_blocks, block_size, b_KV]`` uint8, 16-bit rows
written to it are quantized (``fp8_quantize``), FP8 entries (a fetched chunk) copied bit for
bit (their scales and latent bytes checked), a splice to a new offset rotates only the
entries' bf16 RoPE part (``rope_splice`` over uint8 entries), and the partial attention reads
the entries in place (``mla_decode_partial`` / ``mla_sparse_partial`` over the uint8 pool,
dequantized in registers to the query's dtype).
"""

from __future__ import annotations

import torch

import mqnc.triton_kernels.fp8.quant  # noqa: F401  (registers the FP8 ops' Triton implementation)
from mqnc.base.checks import check_int
from mqnc.model.kv_format import FP8Layout
from mqnc.serving.compute import kernel_ops
from mqnc.serving.records import ChunkInfo, LocalChunk
from mqnc.triton_kernels.fp8.quant import check_entries

__all__ = ["PagedPool", "LocalChunks", "flag_dropped"]


class PagedPool:
    """Blocks of ``block_size`` cache entries, all ``layers`` layers at once.

    Parameters
    ----------
    layers, num_blocks, block_size, width : int
        ``L``, capacity in blocks, tokens per block (a power of two >= 16), ``d_qk``.
    dtype : torch.dtype
    device : torch.device or str
    kernels : {"triton", "torch"}
        Splice and partial attention by the Triton kernels or their torch references
        (:mod:`mqnc.serving.compute`).
    fp8 : mqnc.model.kv_format.FP8Layout or None
        Keep FP8 entries of this layout (``d_c + d_r == width``) instead of ``dtype`` rows;
        ``dtype`` is then the rows' dtype when attending (bf16 / fp32).

    Attributes
    ----------
    kv : torch.Tensor
        ``[layers, num_blocks, block_size, width]`` in ``dtype`` on ``device``; with ``fp8``,
        ``[layers, num_blocks, block_size, fp8.token_bytes]`` uint8 (a fresh pool's zero bytes
        are no valid entries: zero scales; only written slots are attended).
    """

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        width: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        kernels: str = "triton",
        fp8: FP8Layout | None = None,
    ) -> None:
        check_int("num_blocks", num_blocks, minimum=1)
        if check_int("block_size", block_size, minimum=16) & (block_size - 1):
            raise ValueError(f"block_size: expected a power of two >= 16, got {block_size}")
        if fp8 is not None and (not isinstance(fp8, FP8Layout) or fp8.d_c + fp8.d_r != width):
            raise ValueError(f"fp8: expected an FP8Layout of d_c + d_r = {width}, got {fp8!r}")
        self.block_size = block_size
        self.fp8 = fp8
        self.dtype = dtype
        self.width = width if fp8 is None else fp8.token_bytes
        self.device = torch.device(device)
        self.ops = kernel_ops(kernels)
        store = dtype if fp8 is None else torch.uint8
        self.kv = torch.zeros(
            layers, num_blocks, block_size, self.width, dtype=store, device=device
        )
        self._free = list(range(num_blocks))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def alloc(self, tokens: int, name: str = "kv") -> list[int]:
        """Take the blocks ``tokens`` entries need (a ``ValueError`` naming ``name`` if too few
        are free)."""
        nb = -(-tokens // self.block_size)
        if nb > len(self._free):
            raise ValueError(
                f"{name}: {tokens} tokens need {nb} blocks, only {len(self._free)} free"
            )
        return [self._free.pop(0) for _ in range(nb)]

    def free(self, blocks: list[int] | torch.Tensor) -> None:
        """Give ``blocks`` back to the free list (the entries are left as they are); a block
        out of range or already free is a ``ValueError``."""
        blocks = [int(b) for b in (blocks.tolist() if torch.is_tensor(blocks) else blocks)]
        free, n = set(self._free), self.kv.shape[1]
        bad = [b for b in blocks if not 0 <= b < n or b in free]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks: expected distinct taken blocks of [0, {n}), got {blocks}")
        self._free.extend(blocks)

    def reset(self) -> None:
        """Free every block (the entries are left as they are)."""
        self._free = list(range(self.kv.shape[1]))

    def slots(self, blocks: list[int] | torch.Tensor, tokens: int) -> torch.Tensor:
        """Flat slots ``[tokens]`` int64 of a chunk's entries in a layer's token axis."""
        b = torch.as_tensor(blocks, dtype=torch.int64).to(self.device)
        s = b[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)
        return s.reshape(-1)[:tokens]

    def write(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Copy ``kv [L, tokens, width]`` into the blocks, all layers (an FP8 pool: FP8 entries
        ``[L, tokens, b_KV]`` uint8 bit for bit, 16-bit rows quantized)."""
        flat = self.kv.view(self.kv.shape[0], -1, self.width)
        flat[:, self.slots(blocks, kv.shape[1])] = self._stored(kv.to(self.device))

    def _stored(self, kv: torch.Tensor) -> torch.Tensor:
        """``kv`` as this pool stores it: an FP8 pool quantizes float rows and copies entries
        whose scales are finite and > 0 and whose latent bytes are no NaN (checked here, where
        a chunk enters: one host sync)."""
        if self.fp8 is None or kv.dtype == torch.uint8:
            if kv.shape[-1] != self.width or (kv.dtype == torch.uint8) != (self.fp8 is not None):
                fmt = "fp8_e4m3 entries" if self.fp8 is not None else str(self.kv.dtype)[6:]
                short = self.fp8 is not None and kv.shape[-1] < self.width
                raise ValueError(
                    f"kv: expected [L, tokens, {self.width}] rows in this pool's format ({fmt}), "
                    f"got {tuple(kv.shape)} {str(kv.dtype)[6:]}"
                    + (" (scales missing?)" if short else "")
                )
            if self.fp8 is not None:
                self.check_entries(kv)
            return kv
        return self.ops.fp8_quantize(kv.contiguous(), self.fp8.d_c)

    def checked_chunk(self, kv: object, layers: int, d_qk: int, dtype: torch.dtype) -> torch.Tensor:
        """A chunk a holder takes in, checked: ``kv [layers, c_t, d_qk]`` rows of ``dtype``
        (finite), or for an FP8 pool its entries ``[layers, c_t, b_KV]`` as uint8 or
        ``float8_e4m3fn`` (the kernels' two views of them; checked by :meth:`check_entries`).
        Returns what :meth:`write` takes; a ``TypeError`` / ``ValueError`` names ``kv``, the
        shape or dtype expected and the one given."""
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"kv: expected a torch.Tensor, got {type(kv).__name__}")
        if self.fp8 is not None and kv.dtype == torch.float8_e4m3fn:
            kv = kv.view(torch.uint8)  # (FlashMLA's view of the same bytes)
        fp8 = self.fp8 is not None and kv.dtype == torch.uint8  # FP8 entries, not rows
        width = self.width if fp8 else d_qk
        if kv.dim() != 3 or kv.shape[0] != layers or kv.shape[2] != width:
            short = fp8 and kv.dim() == 3 and kv.shape[2] < width
            raise ValueError(
                f"kv: expected shape ({layers}, c_t, {width}), got {tuple(kv.shape)} "
                f"{str(kv.dtype)[6:]}" + (" (fp8_e4m3 entries: scales missing?)" if short else "")
            )
        if fp8:
            self.check_entries(kv)  # scales, NaN latent bytes, overflow, RoPE values
        elif kv.dtype != dtype:
            raise TypeError(f"kv: invalid dtype, expected {dtype}, got {kv.dtype}")
        elif not bool(torch.isfinite(kv).all()):
            bad = int((~torch.isfinite(kv)).sum())
            raise ValueError(f"kv: expected finite cache entries, got {bad} NaN or infinite")
        return kv

    def check_entries(self, kv: torch.Tensor, name: str = "kv") -> None:
        """FP8 entries ``kv [..., b_KV]`` uint8 of this pool's layout whose every scale is
        finite and > 0 and no latent byte a NaN (``0x7F`` / ``0xFF``), or a ``ValueError``
        naming ``name``, the entry and the scale (one host sync)."""
        check_entries(kv, self.fp8.d_c, self.fp8.d_r, name)

    def splice(self, blocks: list[int], kv: torch.Tensor, delta: int, rope) -> None:
        """Write ``kv [L, tokens, width]`` re-homed by ``delta`` positions (§2.2): a plain copy
        for ``delta == 0``, else :func:`mqnc.triton_kernels.rope_splice` (one launch; an FP8
        pool's entries keep their latent and scale bytes, only the bf16 RoPE part rotates)."""
        if delta == 0:
            self.write(blocks, kv)
            return
        if rope is None:
            raise ValueError("rope: splicing at a new offset needs rope= (a RopeSpec)")
        kv = self._stored(kv.to(self.device))
        slots = self.slots(blocks, kv.shape[1])
        self.ops.rope_splice(kv.contiguous(), self.kv, slots, int(delta), rope)

    def gather(self, blocks: torch.Tensor, tokens: int, layers: tuple[int, int]) -> torch.Tensor:
        """A chunk's entries ``[hi - lo, tokens, width]`` of layers ``[lo, hi)``."""
        lo, hi = layers
        flat = self.kv[lo:hi].reshape(hi - lo, -1, self.width)
        return flat[:, self.slots(blocks, tokens)]

    def pool_indices(self, indices: torch.Tensor, blocks: torch.Tensor, tokens: int):
        """Chunk-local selection indices ``[B, topk]`` (``-1`` unused, anything else outside
        ``[0, tokens)`` a ``ValueError``) as indices into a layer's flat token axis (int64,
        ``-1`` kept)."""
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise TypeError(f"indices: expected an integer dtype, got {indices.dtype}")
        bad = (indices < -1) | (indices >= tokens)
        if bool(bad.any()):
            raise ValueError(
                f"indices: expected chunk-local indices in [-1, {tokens}), got "
                f"{indices[bad][:5].tolist()}"
            )
        idx = indices.to(self.device, torch.int64)
        slots = self.slots(blocks, tokens)
        return torch.where(idx >= 0, slots[idx.clamp_min(0)], torch.full_like(idx, -1))

    def attend(
        self,
        q: torch.Tensor,
        layer: int,
        blocks: torch.Tensor,
        tokens: int,
        *,
        indices: torch.Tensor | None,
        softmax_scale: float,
        d_v: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of ``q [B, H, width]`` over one chunk in the pool: every entry
        (``indices`` None, :func:`mla_decode_partial`) or a chunk-local selection
        ``[B, topk]`` (:func:`mla_sparse_partial`). Returns ``(o [B, H, d_v], lse [B, H])``,
        natural-log ``lse`` in float32."""
        B = q.shape[0]
        cache = self.kv[layer]  # an FP8 pool's uint8 entries: the kernels read them in place
        if indices is None:
            table = blocks.to(self.device)[None].expand(B, -1).contiguous()
            lens = torch.full((B,), tokens, dtype=torch.int32, device=self.device)
            o, lse = self.ops.mla_decode_partial(
                q, cache, table, lens, softmax_scale=softmax_scale, d_v=d_v
            )
            keyed = torch.full((B,), tokens > 0, device=lse.device)
        else:
            idx = self.pool_indices(indices, blocks, tokens).to(torch.int32)
            o, lse = self.ops.mla_sparse_partial(
                q, cache, idx, softmax_scale=softmax_scale, d_v=d_v
            )
            keyed = (idx >= 0).any(dim=1).to(lse.device)
        return o, flag_dropped(lse, keyed)


def flag_dropped(lse: torch.Tensor, keyed: torch.Tensor) -> torch.Tensor:
    """``lse [B, H]`` with NaN where a row attended at least one entry (``keyed [B]``) but its
    ``lse`` is not finite: an overflow or a NaN input is reported, never read as an empty
    partial (which the merge would silently leave out)."""
    bad = ~torch.isfinite(lse) & keyed[:, None]
    return torch.where(bad, torch.full_like(lse, float("nan")), lse)


class LocalChunks:
    """A requester's chunks in its own paged pool: fetched (spliced to an offset) or
    re-prefilled, keyed by ``(chunk_id, offset)``.

    ``pool`` None (a requester without a pool) keeps nothing: :meth:`put` raises.
    """

    def __init__(self, pool: PagedPool | None) -> None:
        self.pool = pool
        self.chunks: dict[tuple[int, int], LocalChunk] = {}

    def _pool(self) -> PagedPool:
        if self.pool is None:
            raise ValueError("pool_blocks: this requester has no pool (pool_blocks=0)")
        return self.pool

    def put(
        self, info: ChunkInfo, offset: int, kv: torch.Tensor, *, delta: int, rope, source: str
    ) -> LocalChunk:
        """Write a chunk's ``kv [L, c_t, d_qk]`` into free blocks, re-homed by ``delta``
        (§2.2), and remember it at ``offset`` (replacing, and freeing, a copy already kept
        there). A write that fails keeps no block."""
        pool = self._pool()
        old = self.chunks.pop((info.chunk_id, offset), None)
        if old is not None:  # the same chunk at the same offset again: the new copy replaces it
            pool.free(old.blocks)
        blocks = pool.alloc(info.tokens, "pool")
        try:
            pool.splice(blocks, kv, delta, rope)
        except BaseException:
            pool.free(blocks)  # a failed write keeps nothing
            raise
        lc = LocalChunk(
            info.chunk_id, offset, info.tokens, torch.tensor(blocks, dtype=torch.int32), source
        )
        self.chunks[(info.chunk_id, offset)] = lc
        return lc

    def evict(self, chunk_id: int, offset: int) -> LocalChunk | None:
        """Forget the chunk kept at ``(chunk_id, offset)`` and free its blocks; returns it, or
        None if none was kept there."""
        lc = self.chunks.pop((chunk_id, offset), None)
        if lc is not None:
            self._pool().free(lc.blocks)
        return lc

    def attend(
        self, lc: LocalChunk, q: torch.Tensor, layer: int, indices, *, softmax_scale, d_v
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`PagedPool.attend` over one kept chunk."""
        return self._pool().attend(
            q, layer, lc.blocks, lc.tokens, indices=indices, softmax_scale=softmax_scale, d_v=d_v
        )

    def clear(self) -> None:
        """Forget every chunk and free the whole pool."""
        self.chunks.clear()
        if self.pool is not None:
            self.pool.reset()
