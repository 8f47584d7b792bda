"""fp64 references of a tensor-parallel holder rank's attention (§8): partial scores over a
column slice of the cache, and softmax times a value slice given the group's summed scores.

Kernels: ``mqnc.triton_kernels.tp.scores`` and ``mqnc.triton_kernels.tp.values``.

A slice row is ``d_v + d_pe`` wide (the rank's latent dims, then its RoPE dims); entries are
addressed by flat pool slots ``slots [B, T]`` (``-1``: unused)::

    s[b, h, t] = <q[b, h], kv[slots[b, t]]>        (-inf where slots[b, t] = -1)
    lse[b, h]  = log(sum_t exp(scale * s[b, h, t]))              natural log; -inf if empty
    o[b, h]    = sum_t exp(scale * s[b, h, t] - lse[b, h]) * kv[slots[b, t], :d_v]

Summed over the ``N`` slices of a partition, the scores are the single-rank ``<q, k>``; the
``o`` slices side by side are the single-rank ``o`` (:func:`tp_route_reference` checks the
whole path in fp64).
"""

from __future__ import annotations

import torch
from einops import einsum

__all__ = ["tp_scores_reference", "tp_values_reference", "tp_route_reference"]


def _rows(kv_pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [B, T, width] float64, valid [B, T] bool)`` of the slots (unused ones as 0)."""
    flat = kv_pool.reshape(-1, kv_pool.shape[-1]).double()
    valid = slots >= 0
    return flat[slots.clamp_min(0).long()] * valid[..., None], valid


def tp_scores_reference(
    q: torch.Tensor, kv_pool: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Partial scores ``[B, H, T]`` float64 of ``q [B, H, width]`` against the pool slice's
    entries at ``slots [B, T]`` (``kv_pool [num_blocks, block_size, width]``); ``-inf`` at
    unused slots."""
    rows, valid = _rows(kv_pool, slots)
    s = einsum(q.double(), rows, "b h d, b t d -> b h t")
    return s.masked_fill(~valid[:, None, :], float("-inf"))


def tp_values_reference(
    scores: torch.Tensor,
    kv_pool: torch.Tensor,
    slots: torch.Tensor,
    softmax_scale: float,
    d_v: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, H, d_v], lse [B, H])`` float64 of the summed ``scores [B, H, T]`` (unscaled)
    over the value slice (the first ``d_v`` dims of the pool slice's entries at ``slots``);
    natural-log ``lse``, ``-inf`` and ``o = 0`` for a row with no entry."""
    rows, valid = _rows(kv_pool, slots)
    s = (scores.double() * softmax_scale).masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    w = torch.exp(s - torch.where(empty, 0.0, lse)[..., None])
    o = einsum(w, rows[..., :d_v], "b h t, b t d -> b h d")
    return o.masked_fill(empty[..., None], 0.0), lse


def tp_route_reference(
    q_slices: list[torch.Tensor],
    pool_slices: list[torch.Tensor],
    slots: torch.Tensor,
    softmax_scale: float,
    d_v: int,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A whole holder group in fp64: every rank's partial scores summed, then each rank's
    ``o`` slice over its pool slice (``d_v`` latent dims each). Returns ``([o_r [B, H, d_v]
    per rank], lse [B, H])``."""
    s = sum(tp_scores_reference(q, p, slots) for q, p in zip(q_slices, pool_slices, strict=True))
    outs = [tp_values_reference(s, p, slots, softmax_scale, d_v) for p in pool_slices]
    return [o for o, _ in outs], outs[0][1]
