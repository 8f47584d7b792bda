"""fp64 references of partial absorbed-MLA attention, dense paged and sparse top-k.

Kernels: ``mqnc.triton_kernels.mla.decode`` and ``mqnc.triton_kernels.mla.sparse``.

Every query row (token ``b``, head ``h``) is ``d_qk = d_c + d_r`` wide (576 for DeepSeek); a
cache entry is one ``d_qk`` vector per token shared by all heads, whose first ``d_v`` dims are
also the value. For a key set ``K_b``::

    s[b, h, j] = softmax_scale * <q[b, h], kv[j]>          j in K_b
    lse[b, h]  = log(sum_j exp(s[b, h, j]))               natural log; -inf if K_b is empty
    o[b, h]    = sum_j exp(s[b, h, j] - lse[b, h]) * kv[j, :d_v]        0 if K_b is empty

An FP8 cache (``mqnc.model.kv_format``: uint8 entries, or float8_e4m3fn viewed so) is attended
as its dequantized rows (:func:`dequantized_cache`: ``fp8_ref``'s dequantization, the product
rounded to float32, then to the query's dtype, the kernels' dot operand), so the references
above apply unchanged; the quantization error against the original rows is ``fp8_ref``'s
bound, never part of an attention kernel's.
"""

from __future__ import annotations

import torch
from einops import einsum, repeat

from mqnc.reference.fp8_ref import fp8_dequantize_reference

__all__ = [
    "partial_attention_reference",
    "mla_decode_reference",
    "mla_sparse_reference",
    "dequantized_cache",
    "is_fp8_cache",
]

_FP8_DTYPES = (torch.uint8, torch.float8_e4m3fn)
_GROUP = 128


def is_fp8_cache(kv_pool: object) -> bool:
    """Whether ``kv_pool`` holds FP8 entries (its dtype uint8 or float8_e4m3fn)."""
    return isinstance(kv_pool, torch.Tensor) and kv_pool.dtype in _FP8_DTYPES


def dequantized_cache(
    kv_pool: torch.Tensor,
    d_v: int,
    dtype: torch.dtype,
    kpe_pool: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rows an attention kernel attends over an FP8 cache.

    Parameters
    ----------
    kv_pool : torch.Tensor
        ``[..., d_v + 4 d_v / 128 + 2 d_r]`` uint8 (or float8_e4m3fn) FP8 entries; with
        ``kpe_pool``: ``[..., d_v + 4 d_v / 128]`` (latent and scales only).
    d_v : int
        Latent width ``d_c`` (the value width), a multiple of 128.
    dtype : torch.dtype
        The query's dtype: each latent value ``fp8 * scale`` is rounded to float32 (exact for
        a power-of-two scale), then to ``dtype``; the RoPE part converted to ``dtype``.
    kpe_pool : torch.Tensor or None
        ``[..., d_r]`` bfloat16 RoPE rows (FlashInfer's split ``kpe``).

    Returns
    -------
    torch.Tensor
        ``[..., d_v + d_r]`` in ``dtype``; an entry with a scale that is not finite and > 0 or
        a NaN latent byte (a pool's unused entry may hold anything) is a row of NaN, which the
        references never attend unless asked to (the kernels refuse such an entry by name).
    """
    entries = kv_pool.view(torch.uint8)
    if kpe_pool is not None:
        entries = torch.cat([entries, kpe_pool.contiguous().view(torch.uint8)], dim=-1)
    G = d_v // _GROUP
    d_r = (entries.shape[-1] - d_v - 4 * G) // 2
    scale = entries[..., d_v : d_v + 4 * G].contiguous().view(torch.float32)
    bad = ~(torch.isfinite(scale) & (scale > 0)).all(-1)
    bad |= ((entries[..., :d_v] & 0x7F) == 0x7F).any(-1)
    placeholder = torch.zeros_like(entries[..., :1].expand(entries.shape))
    placeholder[..., d_v : d_v + 4 * G] = torch.ones(G).view(torch.uint8).to(entries.device)
    entries = torch.where(bad[..., None], placeholder, entries)
    rows = fp8_dequantize_reference(entries, d_v, d_r, torch.float32).to(dtype)
    return rows.masked_fill(bad[..., None], float("nan"))


def partial_attention_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    valid: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query token over its own valid subset of a key set, in float64.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, H, d_qk]`` absorbed query rows, any float dtype.
    kv : torch.Tensor
        ``[B, N, d_qk]`` (per-token key sets) or ``[N, d_qk]`` (one set for all tokens).
    valid : torch.Tensor
        ``[B, N]`` bool: which entries each query token attends.
    softmax_scale : float
        The model's scale (DeepSeek with YaRN: ``192**-0.5 * mscale**2``).
    d_v : int
        Value width: the first ``d_v`` dims of each entry.

    Returns
    -------
    o : ``[B, H, d_v]`` float64; lse : ``[B, H]`` float64 (natural log).
    """
    q = q.to(torch.float64)
    kv = kv.to(torch.float64)
    if kv.dim() == 2:  # one key set for every query token (a view, not a copy)
        kv = repeat(kv, "n d -> b n d", b=q.shape[0])
    # Masked entries may hold NaN (the tests poison padding): zero them before any product.
    kv = torch.where(valid[..., None], kv, torch.zeros_like(kv))
    s = einsum(q, kv, "b h d, b n d -> b h n") * softmax_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    o = einsum(p, kv[..., :d_v], "b h n, b n d -> b h d")
    return o, lse


def mla_decode_reference(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense partial attention over a paged pool, in float64.

    ``kv_pool [num_blocks, block_size, d_qk]``; token ``t`` of query token ``b`` lives at
    ``kv_pool[block_table[b, t // block_size], t % block_size]`` for ``t < cache_seqlens[b]``.
    Returns ``o [B, H, d_v]`` and natural-log ``lse [B, H]``, float64.
    """
    num_blocks, block_size, d_qk = kv_pool.shape
    B = q.shape[0]
    max_len = int(cache_seqlens.max()) if B else 0
    t = torch.arange(max_len, device=kv_pool.device)
    valid = t[None, :] < cache_seqlens[:, None].to(t.device).long()
    # Table entries past a row's length are never read (they may hold anything, e.g. -1).
    blocks = block_table.long()[:, (t // block_size)]
    blocks = torch.where(valid, blocks, torch.zeros_like(blocks))
    slots = blocks * block_size + (t % block_size)[None, :]
    kv = kv_pool.reshape(num_blocks * block_size, d_qk)[slots]
    return partial_attention_reference(q, kv, valid, softmax_scale, d_v)


def mla_sparse_reference(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse top-k partial attention, in float64.

    ``indices [B, topk]`` int address the pool's flattened token axis
    (``kv_pool.reshape(-1, d_qk)``); ``-1`` marks an unused slot. Entries are attended at their
    canonical positions (no rotation). Returns ``o [B, H, d_v]``, ``lse [B, H]`` float64.
    """
    d_qk = kv_pool.shape[-1]
    flat = kv_pool.reshape(-1, d_qk)
    valid = indices >= 0
    kv = flat[torch.where(valid, indices, torch.zeros_like(indices)).long()]
    return partial_attention_reference(q, kv, valid, softmax_scale, d_v)
