"""FlashInfer's calling conventions over mqnc's kernels: adapters, not copies of the kernels.

- **MLA paged attention** (``BatchMLAPagedAttentionWrapper``'s ``plan`` / ``run``): split
  query rows ``q_nope [N, H, 512]`` + ``q_pe [N, H, 64]`` and split caches ``ckv_cache
  [num_pages, page_size, 512]`` + ``kpe_cache [num_pages, page_size, 64]``, read in place
  through their own pointers and strides (the kernels' ``SPLIT`` switch: no 576-wide copy is
  ever made), over a CSR page table ``kv_indptr [B + 1]`` / ``kv_indices [nnz]`` with
  ``kv_len [B]`` (read in place too: ``CSR``), any page size (1 included). ``N = B * s_q``
  query rows, the ``s_q`` rows of a request consecutive (FlashInfer's ``qo_indptr`` with equal
  steps; ragged query counts are not supported), ``causal`` as FlashMLA's (bottom-right).
  An FP8 ``ckv_cache`` (uint8 latent bytes + float32 scales, 528 B per token for 512; bf16
  ``kpe_cache``) is read in place the same way and dequantized in registers.
- **Merges** (``flashinfer.merge_state``, ``merge_state_in_place``, ``merge_states``):
  base-2 lse, states ``[seq_len, num_states, H, D]`` for ``merge_states``, and the in-place
  ``mask``; all through :func:`mqnc.triton_kernels.merge_partials` /
  :func:`~mqnc.triton_kernels.merge_partials_into` with ``layout="BMHD"`` and ``base2=True``
  (the merge kernel works in base 2 itself: nothing converted, masked rows untouched).

**LSE base.** FlashInfer's lse is base 2; every function here takes and returns base 2. The
MLA adapter returns ``o`` alone unless ``return_lse`` (FlashInfer's default) and converts the
kernel's natural-log lse on the way out (``lse / ln 2``, one small elementwise op) unless
``return_lse_base_on_e`` (FlashInfer's flag for the natural log); the merges convert nothing.
The rest of mqnc is natural log (``lse_from_base2`` / ``lse_to_base2`` convert).
"""

from __future__ import annotations

import torch

from mqnc.triton_kernels._core.validate import (
    argument_names,
    check_flags,
    check_same_device,
    check_tensor,
)
from mqnc.triton_kernels.fp8.cache import is_fp8_pool
from mqnc.triton_kernels.merge.partials import lse_to_base2, merge_partials, merge_partials_into
from mqnc.triton_kernels.mla.decode import PagedLayout, checked_plan
from mqnc.triton_kernels.mla.plan import AttentionPlan

__all__ = [
    "mla_paged_attention",
    "plan_mla_paged_attention",
    "FlashInferMLAPlan",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
]


class FlashInferMLAPlan:
    """:func:`mla_paged_attention` planned once (FlashInfer's ``plan()``); ``run`` takes the
    call's tensors (same shapes, dtypes, strides, device: compared with the plan's, host
    metadata only), checks no value, never syncs."""

    def __init__(self, plan: AttentionPlan, return_lse: bool, lse_base_e: bool = False) -> None:
        self.plan = plan
        # run()'s shape errors name this layout's arguments (the plan binds them in this order)
        plan.names = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "kv_indices", "kv_indptr",
                      "kv_len")  # fmt: skip
        self.num_splits = plan.num_splits
        self._return_lse, self._lse_base_e = return_lse, lse_base_e

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len):
        """``o [N, H, 512]``, and ``lse [N, H]`` when planned with ``return_lse`` (base 2, or
        the natural log with ``return_lse_base_on_e``)."""
        o, lse = self.plan.run(
            q_nope, ckv_cache, kv_indptr, kv_indices, kv_len, q_pe=q_pe, kpe_pool=kpe_cache
        )
        if not self._return_lse:
            return o
        return o, (lse if self._lse_base_e else lse_to_base2(lse))


# the kernels' checks, named as FlashInfer's callers know the arguments
_MLA_NAMES = {"q": "q_nope", "kv_pool": "ckv_cache", "kpe_pool": "kpe_cache", "kv_lens": "kv_len",
              "lens": "kv_len"}  # fmt: skip


def plan_mla_paged_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    sm_scale: float,
    causal: bool = False,
    return_lse: bool = False,
    return_lse_base_on_e: bool = False,
    num_splits: int | None = None,
    check_inputs: bool = True,
    max_kv_len: int | None = None,
) -> FlashInferMLAPlan:
    """Plan :func:`mla_paged_attention` once for these tensors' shapes (checks and the split
    choice); ``plan.run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len)``."""
    check_flags(causal=causal, return_lse=return_lse, return_lse_base_on_e=return_lse_base_on_e)
    check_tensor("q_nope", q_nope, ndim=3)
    check_tensor("q_pe", q_pe, ndim=3)
    check_tensor("kv_indptr", kv_indptr, ndim=1)
    check_tensor("ckv_cache", ckv_cache, ndim=3)
    check_tensor("kpe_cache", kpe_cache, ndim=3)
    B, N = kv_indptr.shape[0] - 1, q_nope.shape[0]
    if B < 1 or N < B or N % B:
        raise ValueError(
            f"q_nope: expected N = B * s_q query rows, s_q >= 1, for B = {B} requests "
            f"(kv_indptr has B + 1 entries; equal query counts per request), got N = {N}"
        )
    with argument_names(_MLA_NAMES):
        plan, _ = checked_plan(
            q_nope,
            ckv_cache,
            kv_indices,
            kv_len,
            kv_indptr,
            softmax_scale=sm_scale,
            d_v=q_nope.shape[-1] if is_fp8_pool(ckv_cache) else ckv_cache.shape[-1],
            num_splits=num_splits,
            check_inputs=check_inputs,
            q_pe=q_pe,
            kpe_pool=kpe_cache,
            layout=PagedLayout(csr=True, s_q=N // B, causal=causal),
            max_kv_len=max_kv_len,
        )
    return FlashInferMLAPlan(plan, return_lse, return_lse_base_on_e)


def mla_paged_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    sm_scale: float,
    causal: bool = False,
    return_lse: bool = False,
    return_lse_base_on_e: bool = False,
    num_splits: int | None = None,
    check_inputs: bool = True,
    max_kv_len: int | None = None,
):
    """Partial absorbed-MLA attention in FlashInfer's MLA layout (the holder's compute, §3.3).

    Parameters
    ----------
    q_nope : torch.Tensor
        ``[N, H, d_ckv]`` (``d_ckv = 512``): the absorbed latent part of the query rows,
        ``N = B * s_q``, a request's rows consecutive. bf16 / fp16 / fp32, unit last stride.
    q_pe : torch.Tensor
        ``[N, H, d_kpe]`` (64): the rotated rope part, same dtype.
    ckv_cache : torch.Tensor
        ``[num_pages, page_size, d_ckv]``: the latent cache (also the value), same dtype. Or
        FP8 (uint8 / float8_e4m3fn): ``[num_pages, page_size, d_ckv + 4 d_ckv / 128]``, the
        e4m3 latent bytes and their float32 scales (528 B for 512; ``mqnc.model.kv_format``),
        dequantized in registers to the query dtype; ``kpe_cache`` is then bf16.
    kpe_cache : torch.Tensor
        ``[num_pages, page_size, d_kpe]``: the rope cache.
    kv_indptr : torch.Tensor
        ``[B + 1]`` int32: request ``b``'s pages are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
    kv_indices : torch.Tensor
        ``[nnz]`` int32 page ids.
    kv_len : torch.Tensor
        ``[B]`` int32 entries per request (FlashInfer's ``kv_len_arr``), the new tokens
        included.
    sm_scale : float
        The model's softmax scale, required.
    causal : bool
        With ``s_q > 1``: token ``i`` of a request attends its first ``kv_len - s_q + i + 1``
        entries (see ``adapters.flashmla``).
    return_lse : bool
        Also return the lse (FlashInfer's default: False, ``o`` alone).
    return_lse_base_on_e : bool
        The lse as the natural log (the kernels' own) instead of FlashInfer's base 2.
    num_splits, check_inputs, max_kv_len
        As in :func:`mqnc.triton_kernels.mla_decode_partial_csr`.

    Returns
    -------
    o : torch.Tensor
        ``[N, H, d_ckv]`` in the query dtype.
    lse : torch.Tensor
        ``[N, H]`` float32, **base 2** unless ``return_lse_base_on_e`` (only with
        ``return_lse``).
    """
    plan = plan_mla_paged_attention(
        q_nope,
        q_pe,
        ckv_cache,
        kpe_cache,
        kv_indptr,
        kv_indices,
        kv_len,
        sm_scale=sm_scale,
        causal=causal,
        return_lse=return_lse,
        return_lse_base_on_e=return_lse_base_on_e,
        num_splits=num_splits,
        check_inputs=check_inputs,
        max_kv_len=max_kv_len,
    )
    return plan.run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's ``merge_states``: ``v [seq_len, num_states, H, D]``, base-2 ``s
    [seq_len, num_states, H]`` float32 -> ``(v [seq_len, H, D], s [seq_len, H])``, base 2."""
    return merge_partials(v, s, layout="BMHD", base2=True)


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's ``merge_state``: two states ``v [seq_len, H, D]``, base-2 ``s [seq_len,
    H]`` -> the merged ``(v, s)``, base 2 (``v_b`` / ``s_b`` as ``v_a`` / ``s_a``: shape, dtype,
    device)."""
    check_tensor("v_a", v_a, ndim=3)
    check_tensor("s_a", s_a, ndim=2, dtypes=(torch.float32,))
    check_tensor("v_b", v_b, dtypes=(v_a.dtype,), shape=tuple(v_a.shape))
    check_tensor("s_b", s_b, dtypes=(s_a.dtype,), shape=tuple(s_a.shape))
    check_same_device(v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b)
    return merge_partials(torch.stack([v_a, v_b]), torch.stack([s_a, s_b]), base2=True)


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """FlashInfer's ``merge_state_in_place``: ``(v, s) <- merge((v, s), (v_other, s_other))``,
    base-2 ``s``; ``mask [seq_len]`` bool merges only the rows where it is true, leaving the
    others untouched (a captured CUDA graph skipping its padding)."""
    names = {"o_acc": "v", "lse_acc": "s", "o_new": "v_other", "lse_new": "s_other"}
    with argument_names(names):
        merge_partials_into(v, s, v_other, s_other, mask=mask, base2=True)
