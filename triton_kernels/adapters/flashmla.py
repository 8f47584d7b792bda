"""FlashMLA's calling convention over mqnc's kernels: an adapter, not a copy of a kernel.

FlashMLA (``flash_mla_with_kvcache``) takes query tokens as ``q [b, s_q, h_q, d]``: ``s_q``
query tokens per sequence (multi-token prediction, speculative decoding) share that sequence's
pages and length. It returns ``o [b, s_q, h_q, d_v]`` and ``lse [b, h_q, s_q]``. Here the
``s_q`` axis is read in place: the dense kernel maps query row ``b * s_q + i`` to sequence
``b`` (``mla.decode``'s ``MULTI_Q`` switch), so nothing is repeated or copied; ``q`` is
reshaped to ``[b * s_q, h_q, d]`` (a view for any layout where that is possible, a copy of
the small query otherwise), ``o`` and ``lse`` come back as views.

**Causal semantics** (FlashMLA's, ``causal=True``): the ``s_q`` query tokens are the last
``s_q`` entries of their sequence's cache (already written), and token ``i`` attends the first
``cache_seqlens[b] - s_q + i + 1`` entries: itself and everything before it, the mask aligned
to the bottom right. A length shorter than ``s_q`` leaves the first tokens with nothing to
attend (``o = 0, lse = -inf``). With ``causal=False`` every token attends all
``cache_seqlens[b]`` entries; for ``s_q = 1`` both are the same.

**Differences from FlashMLA**, on purpose: ``softmax_scale`` is required (FlashMLA defaults to
``d**-0.5``, wrong for DeepSeek with YaRN); an empty row gives ``lse = -inf`` (FlashMLA writes
``+inf``; mqnc's merge reads both as empty); the lse is the natural log, as FlashMLA's (no
conversion); planning (:func:`plan_mla_with_kvcache`, FlashMLA's ``get_mla_metadata``)
returns a plan object whose ``run`` takes the same tensors as the call; the cache may be
``[num_blocks, page, 1, d]`` (FlashMLA's, one KV head) or ``[num_blocks, page, d]``, with any
power-of-two page; heads are ``d_v`` + a rope part (576 = 512 + 64), FlashMLA's rope-less
``d = 512`` is refused by name (``q``).

**FP8 caches** (``is_fp8_kvcache=True``, FlashMLA's flag): ``k_cache`` holds DeepSeek-V3.2's
656-byte entries (512 e4m3 latent bytes, 4 float32 scales, 64 bf16 RoPE values;
``mqnc.model.kv_format``) as ``[num_blocks, page, 1, 656]`` float8_e4m3fn (FlashMLA's) or
uint8, read in place by the same kernels (dequantized in registers to the query's dtype); the
dense call (paged, ``s_q``, causal) and the sparse one take it. The flag must agree with the
cache's dtype (an FP8 dtype with the flag off, or a 16-bit cache with it on, is an error
naming ``is_fp8_kvcache``). FlashMLA's sparse decode takes only FP8 caches; here both.
"""

from __future__ import annotations

import torch

from mqnc.triton_kernels._core.op import PlanCache, eager_is_plain
from mqnc.triton_kernels._core.validate import (
    argument_names,
    check_flags,
    check_int,
    check_same_device,
    check_tensor,
)
from mqnc.triton_kernels.fp8.cache import as_bytes, check_fp8_entries, is_fp8_pool
from mqnc.triton_kernels.mla.decode import PagedLayout, checked_plan, padded_value_checks
from mqnc.triton_kernels.mla.plan import AttentionPlan
from mqnc.triton_kernels.mla.sparse import check_index_range, plan_mla_sparse

__all__ = [
    "mla_decode_with_kvcache",
    "plan_mla_with_kvcache",
    "FlashMLAPlan",
    "mla_sparse_with_kvcache",
    "partial_from_flashmla",
    "flashmla_from_partial",
]


def _cache_3d(k_cache: torch.Tensor, is_fp8_kvcache: bool = False) -> torch.Tensor:
    """``[num_blocks, page, 1, d]`` (FlashMLA's) or ``[num_blocks, page, d]`` as the latter;
    ``is_fp8_kvcache`` checked against the cache's dtype."""
    check_tensor("k_cache", k_cache)
    check_flags(is_fp8_kvcache=is_fp8_kvcache)
    if is_fp8_kvcache != is_fp8_pool(k_cache):
        raise ValueError(
            f"is_fp8_kvcache: expected {not is_fp8_kvcache} for a k_cache of dtype "
            f"{k_cache.dtype} (FP8 entries are uint8 or float8_e4m3fn), got {is_fp8_kvcache}"
        )
    if k_cache.dim() == 4:
        if k_cache.shape[2] != 1:
            raise ValueError(
                f"k_cache: expected one KV head ([num_blocks, page, 1, d]: MLA's latent cache), "
                f"got shape {tuple(k_cache.shape)}"
            )
        return k_cache[:, :, 0]
    if k_cache.dim() != 3:
        raise ValueError(
            f"k_cache: expected [num_blocks, page, 1, d] or [num_blocks, page, d], got shape "
            f"{tuple(k_cache.shape)}"
        )
    return k_cache


def _rows(q: torch.Tensor) -> torch.Tensor:
    """``q [b, s_q, h_q, d]`` as ``[b * s_q, h_q, d]``."""
    check_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q: expected [b, s_q, h_q, d] (FlashMLA's layout), got {tuple(q.shape)}")
    b, s_q, h, d = q.shape
    return q.reshape(b * s_q, h, d)


# the kernels' checks, named as FlashMLA's callers know the arguments
_NAMES = {"kv_pool": "k_cache", "d_qk - d_v": "q"}


def _flashmla_outputs(o: torch.Tensor, lse: torch.Tensor, b: int, s_q: int, contiguous: bool):
    """``o [b * s_q, h, dv]``, ``lse [b * s_q, h]`` as ``[b, s_q, h, dv]`` (a view) and
    ``[b, h, s_q]``: contiguous as FlashMLA's dense call returns it (a copy of ``b * h * s_q``
    floats; its sparse call returns the transposed view, as here with ``contiguous=False``)."""
    h = o.shape[1]
    lse = lse.view(b, s_q, h).transpose(1, 2)
    return o.view(b, s_q, h, o.shape[2]), (lse.contiguous() if contiguous else lse)


_O_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def partial_from_flashmla(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's output layout as the merge's: one partial per query row.

    ``flash_mla_with_kvcache`` (and :func:`mla_decode_with_kvcache`,
    :func:`mla_sparse_with_kvcache`) return ``o [b, s_q, h_q, d_v]`` and ``lse [b, h_q, s_q]``;
    :func:`mqnc.triton_kernels.merge_partials` takes partials ``[B, H, D]`` / ``[B, H]`` (stacked
    to ``[M, B, H, D]`` / ``[M, B, H]``) with ``B = b * s_q`` query rows, row ``b_i * s_q + i``.

    Parameters
    ----------
    o : torch.Tensor
        ``[b, s_q, h_q, d_v]``, bf16 / fp16 / fp32.
    lse : torch.Tensor
        ``[b, h_q, s_q]`` float32, natural log (FlashMLA's and mqnc's; an empty row's ``+inf``,
        FlashMLA's, or ``-inf``, mqnc's, is kept: the merge reads both as empty).

    Returns
    -------
    o : torch.Tensor
        ``[b * s_q, h_q, d_v]``, ``o``'s dtype (a view when ``o``'s strides allow one).
    lse : torch.Tensor
        ``[b * s_q, h_q]`` float32, contiguous (a copy of ``b * h_q * s_q`` floats unless
        ``s_q == 1``).
    """
    check_tensor("o", o, ndim=4, dtypes=_O_DTYPES)
    b, s_q, h, _ = o.shape
    check_tensor("lse", lse, ndim=3, dtypes=(torch.float32,), shape=(b, h, s_q))
    check_same_device(o=o, lse=lse)
    return o.reshape(b * s_q, h, o.shape[3]), lse.transpose(1, 2).reshape(b * s_q, h)


def flashmla_from_partial(
    o: torch.Tensor, lse: torch.Tensor, s_q: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge's layout as FlashMLA's: the inverse of :func:`partial_from_flashmla`.

    Parameters
    ----------
    o : torch.Tensor
        ``[b * s_q, h_q, d_v]``, bf16 / fp16 / fp32 (a merged or a single partial).
    lse : torch.Tensor
        ``[b * s_q, h_q]`` float32, natural log.
    s_q : int
        Query tokens per sequence (FlashMLA's ``seq_len_q``); ``o``'s rows must be a multiple.

    Returns
    -------
    o : torch.Tensor
        ``[b, s_q, h_q, d_v]``, ``o``'s dtype.
    lse : torch.Tensor
        ``[b, h_q, s_q]`` float32, contiguous (as FlashMLA's dense call returns it).
    """
    check_int("s_q", s_q, minimum=1)
    check_tensor("o", o, ndim=3, dtypes=_O_DTYPES)
    rows, h, _ = o.shape
    check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,), shape=(rows, h))
    check_same_device(o=o, lse=lse)
    if rows % s_q:
        raise ValueError(f"o: expected b * s_q rows with s_q = {s_q}, got {rows} rows")
    o4 = o.reshape(rows // s_q, s_q, h, o.shape[2])
    return o4, lse.reshape(rows // s_q, s_q, h).transpose(1, 2).contiguous()


class FlashMLAPlan:
    """:func:`mla_decode_with_kvcache` planned once for a batch shape (FlashMLA's
    ``get_mla_metadata``, computed once per step and reused by every layer); ``run`` takes
    the call's tensors (same shapes, dtypes, strides, device: compared with the plan's, host
    metadata only), checks no value, never syncs."""

    def __init__(self, plan: AttentionPlan, b: int, s_q: int) -> None:
        self.plan = plan
        self.num_splits = plan.num_splits
        self._b, self._s_q = b, s_q

    def run(self, q, k_cache, block_table, cache_seqlens):
        """``(o [b, s_q, h_q, d_v], lse [b, h_q, s_q])``, natural-log lse."""
        b, s_q = self._b, self._s_q
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or tuple(q.shape[:2]) != (b, s_q):
            got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q: expected shape ({b}, {s_q}, h_q, d) (as planned), got {got}")
        return self._run(self.plan.run, q, k_cache, block_table, cache_seqlens)

    def run_planned(self, q, k_cache, block_table, cache_seqlens):
        """:meth:`run` on tensors of the very signature planned (a cached plan's own call)."""
        return self._run(self.plan.run_planned, q, k_cache, block_table, cache_seqlens)

    def _run(self, run, q, k_cache, block_table, cache_seqlens):
        b, s_q = self._b, self._s_q
        q2 = q.reshape(b * s_q, q.shape[2], q.shape[3])
        kv = k_cache[:, :, 0] if k_cache.dim() == 4 else k_cache
        o, lse = run(q2, kv, block_table, cache_seqlens)  # (an FP8 cache: viewed)
        return _flashmla_outputs(o, lse, b, s_q, contiguous=True)


def plan_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int = 512,
    *,
    softmax_scale: float,
    causal: bool = False,
    num_splits: int | None = None,
    check_inputs: bool = True,
    is_fp8_kvcache: bool = False,
) -> FlashMLAPlan:
    """Plan :func:`mla_decode_with_kvcache` for these tensors' shapes: every check and the split
    choice once; then ``plan.run(q, k_cache, block_table, cache_seqlens)``."""
    rows = _rows(q)
    b, s_q = q.shape[:2]
    check_flags(causal=causal)
    with argument_names(_NAMES):
        plan, _ = checked_plan(
            rows,
            _cache_3d(k_cache, is_fp8_kvcache),
            block_table,
            cache_seqlens,
            None,
            softmax_scale=softmax_scale,
            d_v=head_dim_v,
            num_splits=num_splits,
            check_inputs=check_inputs,
            q_pe=None,
            kpe_pool=None,
            layout=PagedLayout(s_q=s_q, causal=causal),
        )
    return FlashMLAPlan(plan, b, s_q)


def mla_decode_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int = 512,
    *,
    softmax_scale: float,
    causal: bool = False,
    num_splits: int | None = None,
    check_inputs: bool = True,
    is_fp8_kvcache: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention in FlashMLA's layout (the holder's compute, §3.3, for ``s_q`` tokens).

    Parameters
    ----------
    q : torch.Tensor
        ``[b, s_q, h_q, d]`` absorbed query rows (``d = 576``), bf16 / fp16 / fp32, unit stride
        on the last dim.
    k_cache : torch.Tensor
        ``[num_blocks, page, 1, d]`` (FlashMLA's) or ``[num_blocks, page, d]``, same dtype;
        ``page`` any power of two (FlashMLA's is 64). With ``is_fp8_kvcache``: FP8 entries
        ``[num_blocks, page, 1, 656]`` (float8_e4m3fn or uint8; module docstring).
    block_table : torch.Tensor
        ``[b, max_blocks]`` int32, one row per sequence (shared by its ``s_q`` tokens).
    cache_seqlens : torch.Tensor
        ``[b]`` int32 entries per sequence, the ``s_q`` new tokens included.
    head_dim_v : int
        Value width, the first ``head_dim_v`` dims of each entry (512).
    softmax_scale : float
        The model's scale, required.
    causal : bool
        FlashMLA's rule (module docstring): token ``i`` attends the first
        ``cache_seqlens[b] - s_q + i + 1`` entries.
    num_splits, check_inputs
        As in :func:`mqnc.triton_kernels.mla_decode_partial` (``check_inputs`` also checks the
        scales and latent bytes of the FP8 entries attended).
    is_fp8_kvcache : bool
        FlashMLA's flag: ``k_cache`` holds FP8 entries (must agree with its dtype).

    Returns
    -------
    o : torch.Tensor
        ``[b, s_q, h_q, head_dim_v]`` in ``q``'s dtype.
    lse : torch.Tensor
        ``[b, h_q, s_q]`` float32, natural log, contiguous (as FlashMLA's); ``-inf`` for a
        token with nothing to attend.
    """
    args = (q, k_cache, block_table, cache_seqlens)
    options = (head_dim_v, softmax_scale, causal, num_splits, check_inputs, is_fp8_kvcache)
    key = _PLANS.key_of(args + options, decoded=True) if eager_is_plain() else None
    plan = _PLANS.get(key)
    if plan is None:
        plan = plan_mla_with_kvcache(
            *args,
            head_dim_v,
            softmax_scale=softmax_scale,
            causal=causal,
            num_splits=num_splits,
            check_inputs=check_inputs,
            is_fp8_kvcache=is_fp8_kvcache,
        )
        if key is not None:
            _PLANS.put(key, plan)
        return plan.run(*args)
    if check_inputs:  # (the plan does not depend on the values checked)
        with argument_names(_NAMES):
            padded_value_checks(_cache_3d(k_cache, is_fp8_kvcache), block_table, cache_seqlens,
                                head_dim_v)  # fmt: skip
    return plan.run_planned(*args)


_PLANS = PlanCache.of(
    ("q", "k_cache", "block_table", "cache_seqlens"),
    ("head_dim_v", "softmax_scale", "causal", "num_splits", "check_inputs", "is_fp8_kvcache"),
    checks_apart=True,
)
"""The plans of :func:`mla_decode_with_kvcache`'s eager calls, one per call signature (as the
ops' own: ``_core.op.PlanCache``); a checked call runs its value checks before the plan."""


def mla_sparse_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    head_dim_v: int = 512,
    *,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    num_splits: int | None = None,
    check_indices: bool = True,
    is_fp8_kvcache: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse top-k partial attention in FlashMLA's layout: ``q [b, s_q, h_q, d]``, ``indices
    [b, s_q, topk]`` int32 into the flattened cache (``-1`` unused; each query token has its
    own selection, so ``s_q`` is only a reshape); ``topk_length [b]`` int32 (FlashMLA's): only
    the leftmost ``topk_length[i]`` indices of sequence ``i`` count (the rest are read as
    ``-1``: a masked copy of ``indices``). Returns ``o [b, s_q, h_q, head_dim_v]`` and
    natural-log ``lse [b, h_q, s_q]`` (a transposed view, as FlashMLA's sparse call). The cache
    is bf16 / fp16 / fp32 ``[num_blocks, page, (1,) d]`` or, with ``is_fp8_kvcache``
    (FlashMLA's sparse decode's only format), FP8 entries ``[num_blocks, page, (1,) 656]``
    (float8_e4m3fn or uint8; ``check_indices`` then also checks the selected entries' scales
    and latent bytes). Other arguments as in :func:`mqnc.triton_kernels.mla_sparse_partial`."""
    rows = _rows(q)
    b, s_q = q.shape[:2]
    check_tensor("indices", indices, ndim=3, shape=(b, s_q, None))
    if topk_length is not None:
        check_tensor("topk_length", topk_length, ndim=1, dtypes=(torch.int32,), shape=(b,))
        keep = torch.arange(indices.shape[2], device=indices.device) < topk_length[:, None, None]
        indices = torch.where(keep, indices, -1)
    idx = indices.reshape(b * s_q, indices.shape[2])
    kv = _cache_3d(k_cache, is_fp8_kvcache)
    with argument_names(_NAMES):
        plan = plan_mla_sparse(
            rows,
            kv,
            idx,
            softmax_scale=softmax_scale,
            d_v=head_dim_v,
            num_splits=num_splits,
            check_indices=False,
        )
    if check_indices:  # after every other check, on the caller's [b, s_q, topk] (its places)
        check_index_range(indices, kv.shape[0] * kv.shape[1])
        if is_fp8_kvcache:
            with argument_names(_NAMES):
                check_fp8_entries(as_bytes(kv), idx[idx >= 0], head_dim_v)
    o, lse = plan.run(rows, kv, idx)
    return _flashmla_outputs(o, lse, b, s_q, contiguous=False)
