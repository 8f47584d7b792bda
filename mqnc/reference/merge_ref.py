"""fp64 reference of the online-softmax merge (kernel: ``mqnc.triton_kernels.merge.partials``).

LSE is natural-log throughout. ``-inf`` and ``+inf`` mark an empty partial (FlashMLA writes
``+inf`` for empty rows); an all-empty row merges to ``o = 0, lse = -inf``.
"""

from __future__ import annotations

import torch

__all__ = ["merge_reference", "merge_ml_reference"]


def merge_reference(
    o: torch.Tensor, lse: torch.Tensor, *, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge M partials in float64 (or ``dtype``).

    Parameters
    ----------
    o : torch.Tensor
        ``[M, B, H, Dv]``, any float dtype (upcast to ``dtype``).
    lse : torch.Tensor
        ``[M, B, H]``, natural log; ``+-inf`` = empty.
    dtype : torch.dtype
        Arithmetic precision: float64 for the reference; the benchmarks time the same merge in
        float32 as the requester's CPU path (the one torch merge of the package).

    Returns
    -------
    (o, lse) : ``[B, H, Dv]`` and ``[B, H]``, both in ``dtype``.
    """
    o = o.to(dtype)
    lse = lse.to(dtype)
    lse = torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)
    m = lse.max(dim=0).values
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)  # exp(-inf) = 0 for empty partials
    l = w.sum(dim=0)
    # An empty partial's o is never read: zero it so NaN/garbage there cannot leak through 0 * NaN.
    o = torch.where((w > 0)[..., None], o, torch.zeros_like(o))
    out = (w[..., None] * o).sum(dim=0) / torch.where(l > 0, l, torch.ones_like(l))[..., None]
    # l = 0: every partial empty; a NaN l (a NaN lse) stays NaN, never "empty": a bad number
    # must reach the caller, not vanish as a partial without keys
    lse_out = torch.where(l == 0, torch.full_like(l, float("-inf")), m_safe + torch.log(l))
    return out, lse_out


def merge_ml_reference(
    o: torch.Tensor, m: torch.Tensor, l: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge M partials given in the wire form ``(o, m, l)`` (§3.2), in float64.

    ``o`` is each partial's normalised output ``[M, B, H, Dv]``, ``m`` its running max and ``l``
    its softmax denominator relative to ``m`` (``[M, B, H]``; ``l = 0`` marks an empty partial).
    Returns the merged ``(o, m, l)``: ``m`` the max over partials and ``l`` relative to it.
    """
    m = m.to(torch.float64)
    l = l.to(torch.float64)
    empty = l <= 0
    lse = torch.where(
        empty, torch.full_like(m, float("-inf")), m + torch.log(torch.where(empty, 1.0, l))
    )
    o_out, lse_out = merge_reference(o, lse)
    m_out = torch.where(empty, torch.full_like(m, float("-inf")), m).max(dim=0).values
    m_out_safe = torch.where(torch.isneginf(m_out), torch.zeros_like(m_out), m_out)
    l_out = torch.where(
        torch.isneginf(lse_out), torch.zeros_like(lse_out), torch.exp(lse_out - m_out_safe)
    )
    return o_out, torch.where(torch.isneginf(m_out), torch.zeros_like(m_out), m_out), l_out
