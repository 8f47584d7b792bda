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

**Two entry points.** :func:`flash_mla_with_kvcache` and :func:`get_mla_metadata` take
FlashMLA's own call as its README writes it (positional ``head_dim_v``,
``tile_scheduler_metadata``, ``num_splits``; ``softmax_scale`` defaulting to FlashMLA's
``q.shape[-1] ** -0.5``; dense or sparse by ``indices``; ``attn_sink``; ``extra_k_cache``):
change the import line, nothing else. The mqnc-named functions (:func:`mla_decode_with_kvcache`,
:func:`mla_sparse_with_kvcache`, :func:`plan_mla_with_kvcache`) keep ``softmax_scale``
required (FlashMLA's default ``d**-0.5`` is wrong for DeepSeek with YaRN) and take ``num_splits``
as an int (the split count) rather than FlashMLA's placeholder.

**Differences from FlashMLA**, on purpose: an empty row gives ``lse = -inf`` (FlashMLA writes
``+inf``; mqnc's merge reads both as empty); the lse is the natural log, as FlashMLA's (no
conversion); the schedule :func:`get_mla_metadata` returns holds no tile metadata (the split
choice is mqnc's plan, cached per call signature), only the call's config, which later calls
with it must agree with (a ``ValueError`` naming the field, where FlashMLA asserts); FlashMLA's
own schedule object or its old int32 tensors are refused by name, saying to import
:func:`get_mla_metadata` from this module; :func:`plan_mla_with_kvcache` returns a plan object
whose ``run`` takes the same tensors as the call; the cache may be ``[num_blocks, page, 1, d]``
(FlashMLA's, one KV head) or ``[num_blocks, page, d]``, with any power-of-two page; heads are
``d_v`` + a rope part (576 = 512 + 64), FlashMLA's rope-less ``d = 512`` is refused by name
(``q``); ``attn_sink`` is taken by the dense call too (FlashMLA: sparse only).

**FP8 caches** (``is_fp8_kvcache=True``, FlashMLA's flag): ``k_cache`` holds DeepSeek-V3.2's
656-byte entries (512 e4m3 latent bytes, 4 float32 scales, 64 bf16 RoPE values;
``mqnc.model.kv_format``) as ``[num_blocks, page, 1, 656]`` float8_e4m3fn (FlashMLA's) or
uint8, read in place by the same kernels (dequantized in registers to the query's dtype); the
dense call (paged, ``s_q``, causal) and the sparse one take it. The flag must agree with the
cache's dtype (an FP8 dtype with the flag off, or a 16-bit cache with it on, is an error
naming ``is_fp8_kvcache``). FlashMLA's sparse decode takes only FP8 caches; here both.
"""

from __future__ import annotations

import dataclasses

import torch

from mqnc.triton_kernels._core.execution import new_output
from mqnc.triton_kernels._core.op import PlanCache, eager_is_plain
from mqnc.triton_kernels._core.validate import (
    argument_names,
    check_flags,
    check_int,
    check_same_device,
    check_tensor,
    dtype_name,
)
from mqnc.triton_kernels.fp8.cache import as_bytes, check_fp8_entries, is_fp8_pool
from mqnc.triton_kernels.merge.partials import merge_partials
from mqnc.triton_kernels.mla.decode import PagedLayout, checked_plan, padded_value_checks
from mqnc.triton_kernels.mla.plan import AttentionPlan
from mqnc.triton_kernels.mla.sparse import check_index_range, plan_mla_sparse

__all__ = [
    "flash_mla_with_kvcache",
    "get_mla_metadata",
    "FlashMLASchedMeta",
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


# ---- FlashMLA's own call: get_mla_metadata + flash_mla_with_kvcache -------------------------


class FlashMLASchedMeta:
    """The schedule :func:`get_mla_metadata` returns (FlashMLA's ``FlashMLASchedMeta``): empty
    until its first :func:`flash_mla_with_kvcache` call, which records that call's config
    (:class:`FlashMLASchedMeta.Config`); every later call with the same schedule (the other
    layers of a step) must agree with it, else a ``ValueError`` naming the field and both values.
    It holds no tile metadata: mqnc's split choice is its plan, cached per call signature."""

    @dataclasses.dataclass(frozen=True)
    class Config:
        """One call's config, as FlashMLA records it: ``b``, ``s_q``, ``h_q`` from ``q``;
        ``page_block_size``, ``h_k`` (1) from ``k_cache``; the flags; ``topk`` (the last dim of
        ``indices``, None when dense); the page size of ``extra_k_cache`` and the last dim of
        ``extra_indices_in_kvcache`` (None without them)."""

        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: int | None
        extra_page_block_size: int | None
        extra_topk: int | None

    def __init__(self) -> None:
        self.have_initialized = False
        self.config: FlashMLASchedMeta.Config | None = None

    def _agree(self, config: FlashMLASchedMeta.Config) -> None:
        """``config`` equal to the recorded one, field by field (nothing recorded: nothing to
        compare)."""
        if self.config is None:
            return
        for field in dataclasses.fields(config):
            had, got = getattr(self.config, field.name), getattr(config, field.name)
            if had != got:
                raise ValueError(
                    f"tile_scheduler_metadata: expected {field.name} = {had!r} (recorded by this "
                    f"schedule's first call; later calls must agree with it), got {got!r}; take a "
                    f"new schedule from get_mla_metadata() for calls of another config"
                )

    def _record(self, config: FlashMLASchedMeta.Config) -> None:
        if self.config is None:
            self.config, self.have_initialized = config, True


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """FlashMLA's ``get_mla_metadata``: a new, empty schedule and ``None``.

    As FlashMLA's current interface, the arguments are accepted and ignored (the old interface's
    ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
    is_fp8_kvcache=False, topk=None)`` keeps running); the schedule records its first call's
    config (:class:`FlashMLASchedMeta`).

    Returns
    -------
    tile_scheduler_metadata : FlashMLASchedMeta
        Pass it to :func:`flash_mla_with_kvcache`, reused by every layer of a step.
    num_splits : None
        FlashMLA's placeholder: pass it on (or None).
    """
    return FlashMLASchedMeta(), None


def _describe(value: object) -> str:
    """A value as an error message shows it: a tensor's shape and dtype, an object's class."""
    if isinstance(value, torch.Tensor):
        return f"a torch.Tensor of shape {tuple(value.shape)}, {dtype_name(value.dtype)}"
    kind = type(value)
    if kind.__module__ == "builtins":
        return f"{kind.__name__} {value!r}"
    return f"a {kind.__module__}.{kind.__qualname__}"


def _check_schedule(tile_scheduler_metadata: object, num_splits: object) -> FlashMLASchedMeta:
    """This module's schedule and FlashMLA's ``None`` placeholder, else a ``TypeError`` saying
    which import gives them."""
    if not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        raise TypeError(
            f"tile_scheduler_metadata: expected the schedule of mqnc's get_mla_metadata "
            f"({__name__}.FlashMLASchedMeta), got {_describe(tile_scheduler_metadata)}; import "
            f"get_mla_metadata from {__name__} (FlashMLA's own schedule and tensors are its "
            f"CUDA kernels' tile metadata, which these kernels do not read)"
        )
    if num_splits is not None:
        raise TypeError(
            f"num_splits: expected None (FlashMLA's placeholder, the second value of "
            f"get_mla_metadata), got {_describe(num_splits)}; pass None or the value that "
            f"get_mla_metadata from {__name__} returns (FlashMLA's old split tensors are its "
            f"CUDA kernels' metadata)"
        )
    return tile_scheduler_metadata


def _not_dense(**extras: object) -> None:
    """FlashMLA's sparse-only arguments absent from a dense call (``indices`` None)."""
    for name, value in extras.items():
        if value is not None:
            raise ValueError(
                f"{name}: expected None without indices (it belongs to sparse attention), got "
                f"{_describe(value)}; pass indices [b, s_q, topk] for a sparse call, or drop "
                f"{name}"
            )


def _apply_sink(o: torch.Tensor, lse: torch.Tensor, attn_sink: torch.Tensor, dtype) -> torch.Tensor:
    """``o [b, s_q, h, dv]`` scaled by ``exp(lse) / (exp(lse) + exp(attn_sink[h]))`` (``lse [b,
    h, s_q]``, natural log) in float32, rounded once to ``dtype``; ``attn_sink = -inf`` leaves a
    row as it is (an empty row too), ``+inf`` zeroes it."""
    sink = attn_sink[None, :, None]
    keep = torch.where(torch.isneginf(sink), 1.0, torch.sigmoid(lse - sink))
    return (o.float() * keep.transpose(1, 2)[..., None]).to(dtype)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's ``flash_mla_with_kvcache``, argument for argument, on mqnc's kernels.

    Dense when ``indices`` is None (:func:`mla_decode_with_kvcache`: paged, ``s_q`` tokens,
    ``causal``), sparse when it is given (:func:`mla_sparse_with_kvcache`). Extra tokens
    (``extra_k_cache``) are a second sparse partial, merged with the first by
    :func:`mqnc.triton_kernels.merge_partials` (exact: the merged partial is attention over the
    union); the sink then scales the result.

    Parameters
    ----------
    q : torch.Tensor
        ``[b, s_q, h_q, d]`` (``d = 576``), bf16 / fp16 / fp32.
    k_cache : torch.Tensor
        ``[num_blocks, page_block_size, 1, d]`` (or ``[num_blocks, page, d]``), ``q``'s dtype;
        with ``is_fp8_kvcache``, FP8 entries ``[num_blocks, page, 1, 656]`` (float8_e4m3fn or
        uint8; module docstring).
    block_table : torch.Tensor or None
        ``[b, max_blocks]`` int32; required when dense, unused (may be None) when sparse.
    cache_seqlens : torch.Tensor or None
        ``[b]`` int32 entries per sequence; required when dense, unused when sparse.
    head_dim_v : int
        Value width (512).
    tile_scheduler_metadata : FlashMLASchedMeta
        From this module's :func:`get_mla_metadata` (FlashMLA's own object, or a tensor, is a
        ``TypeError`` saying so); its first call records the config, later calls must agree.
    num_splits : None
        FlashMLA's placeholder (the second value of :func:`get_mla_metadata`); anything else is
        a ``TypeError``.
    softmax_scale : float or None
        None: ``q.shape[-1] ** -0.5`` (FlashMLA's default). DeepSeek with YaRN needs the
        model's own scale (``192**-0.5 * mscale**2``: ``mqnc.model.RopeSpec.softmax_scale``).
    causal : bool
        Dense only (FlashMLA's bottom-right rule, module docstring); must be False when sparse.
    is_fp8_kvcache : bool
        ``k_cache`` (and ``extra_k_cache``) hold FP8 entries; must agree with their dtype. The
        sparse call takes 16-bit caches too (FlashMLA's takes only FP8).
    indices : torch.Tensor or None
        ``[b, s_q, topk]`` int32 token ids into the flattened cache (``page_id * page + slot``),
        ``-1`` unused: sparse attention.
    attn_sink : torch.Tensor or None
        ``[h_q]`` float32: the output is scaled by ``exp(lse) / (exp(lse) + exp(attn_sink[h]))``
        (computed in float32, rounded once to ``q``'s dtype; ``+inf`` gives 0, ``-inf`` leaves
        ``o`` as it is); the lse is unchanged. Dense or sparse.
    extra_k_cache, extra_indices_in_kvcache : torch.Tensor or None
        Sparse only, both or neither: a second cache of ``k_cache``'s format and
        ``[b, s_q, extra_topk]`` int32 ids into it; those tokens are attended in addition.
    topk_length, extra_topk_length : torch.Tensor or None
        Sparse only, ``[b]`` int32: only the leftmost ``topk_length[i]`` of ``indices[i]`` (and
        ``extra_topk_length[i]`` of ``extra_indices_in_kvcache[i]``) count.

    Returns
    -------
    out : torch.Tensor
        ``[b, s_q, h_q, head_dim_v]`` in ``q``'s dtype.
    softmax_lse : torch.Tensor
        ``[b, h_q, s_q]`` float32, natural log (as FlashMLA's); ``-inf`` for a token with
        nothing to attend, where FlashMLA writes ``+inf`` (mqnc's merge reads both as empty).
    """
    sched = _check_schedule(tile_scheduler_metadata, num_splits)
    _rows(q)  # (q's layout checked before its shape is read)
    kv = _cache_3d(k_cache, is_fp8_kvcache)
    check_flags(causal=causal)
    d = q.shape[3]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    if indices is None:
        _not_dense(topk_length=topk_length, extra_k_cache=extra_k_cache,
                   extra_indices_in_kvcache=extra_indices_in_kvcache,
                   extra_topk_length=extra_topk_length)  # fmt: skip
        _dense_tables(block_table=block_table, cache_seqlens=cache_seqlens)
    else:
        _check_sparse(causal, extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
    config = _call_config(q, kv, causal, is_fp8_kvcache, indices, extra_k_cache,
                          extra_indices_in_kvcache)  # fmt: skip
    sched._agree(config)
    if attn_sink is not None:
        _check_sink(attn_sink, q)
    o, lse = _dense_or_sparse(
        q, k_cache, block_table, cache_seqlens, indices, topk_length, head_dim_v,
        softmax_scale=scale, causal=causal, is_fp8_kvcache=is_fp8_kvcache,
    )  # fmt: skip
    if extra_k_cache is not None:
        extra = _extra_partial(
            q, extra_k_cache, extra_indices_in_kvcache, extra_topk_length, head_dim_v,
            softmax_scale=scale, is_fp8_kvcache=is_fp8_kvcache,
        )  # fmt: skip
        # merged in fp32 when a sink follows (one rounding to q's dtype, after it)
        o, lse = _merge_two((o, lse), extra, torch.float32 if attn_sink is not None else o.dtype)
    if attn_sink is not None:
        o = _apply_sink(o, lse, attn_sink, q.dtype)
    sched._record(config)
    return o, lse


def _dense_tables(**tables: object) -> None:
    """The page table and lengths a dense call (``indices`` None) needs, present."""
    for name, t in tables.items():
        if t is None:
            raise ValueError(
                f"{name}: expected a tensor for dense attention (indices is None), got None; "
                f"pass it, or indices [b, s_q, topk] for sparse attention"
            )


def _check_sparse(
    causal: bool,
    extra_k_cache: object,
    extra_indices_in_kvcache: object,
    extra_topk_length: object,
) -> None:
    """A sparse call's (``indices`` given) arguments that FlashMLA's sparse path constrains:
    ``causal`` False; ``extra_k_cache`` and ``extra_indices_in_kvcache`` both or neither;
    ``extra_topk_length`` only with them. A ``ValueError`` naming the argument."""
    if causal:
        raise ValueError(
            "causal: expected False with indices (a sparse token's selection already says "
            "what it attends), got True; pass causal=False"
        )
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        names = ("extra_k_cache", "extra_indices_in_kvcache")
        missing, given = names if extra_k_cache is None else names[::-1]
        raise ValueError(
            f"{missing}: expected a tensor with {given} (the extra tokens need both), got "
            f"None; pass both or neither"
        )
    if extra_topk_length is not None and extra_k_cache is None:
        raise ValueError(
            f"extra_topk_length: expected None without extra_indices_in_kvcache, got "
            f"{_describe(extra_topk_length)}; drop it"
        )


def _call_config(
    q: torch.Tensor,
    kv: torch.Tensor,
    causal: bool,
    is_fp8_kvcache: bool,
    indices: torch.Tensor | None,
    extra_k_cache: torch.Tensor | None,
    extra_indices_in_kvcache: torch.Tensor | None,
) -> FlashMLASchedMeta.Config:
    """The call's config as its schedule records it (:class:`FlashMLASchedMeta.Config`).

    Parameters
    ----------
    q : torch.Tensor
        ``[b, s_q, h_q, d]`` (layout already checked).
    kv : torch.Tensor
        ``k_cache`` as ``[num_blocks, page_block_size, d]`` (checked).
    causal, is_fp8_kvcache : bool
        The call's flags (checked).
    indices, extra_k_cache, extra_indices_in_kvcache : torch.Tensor or None
        The call's; ``extra_k_cache`` is checked here (``is_fp8_kvcache`` against its dtype,
        its layout), then the index tensors' dims (``[b, s_q, topk]``).

    Returns
    -------
    FlashMLASchedMeta.Config
        ``topk`` None when dense, the extra fields None without extra tokens.
    """
    b, s_q, h, _ = q.shape
    extra_page = None
    if extra_k_cache is not None:
        with argument_names({"k_cache": "extra_k_cache"}):
            extra_page = _cache_3d(extra_k_cache, is_fp8_kvcache).shape[1]
    return FlashMLASchedMeta.Config(
        b, s_q, h, kv.shape[1], 1, causal, is_fp8_kvcache,
        None if indices is None else _last_dim("indices", indices),
        extra_page,
        None if extra_k_cache is None else _last_dim("extra_indices_in_kvcache",
                                                      extra_indices_in_kvcache),
    )  # fmt: skip


def _check_sink(attn_sink: object, q: torch.Tensor) -> None:
    """``attn_sink`` ``[h_q]`` float32 on ``q``'s device (``q [b, s_q, h_q, d]``)."""
    check_tensor("attn_sink", attn_sink, ndim=1, dtypes=(torch.float32,), shape=(q.shape[2],))
    check_same_device(q=q, attn_sink=attn_sink)


def _dense_or_sparse(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    indices: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    head_dim_v: int,
    *,
    softmax_scale: float,
    causal: bool,
    is_fp8_kvcache: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The main partial: :func:`mla_decode_with_kvcache` when ``indices`` is None (paged,
    ``causal``), else :func:`mla_sparse_with_kvcache` (``indices``, ``topk_length``).

    Returns
    -------
    o : torch.Tensor
        ``[b, s_q, h_q, head_dim_v]`` in ``q``'s dtype.
    lse : torch.Tensor
        ``[b, h_q, s_q]`` float32, natural log (contiguous when dense, a transposed view when
        sparse).
    """
    if indices is None:
        return mla_decode_with_kvcache(
            q, k_cache, block_table, cache_seqlens, head_dim_v,
            softmax_scale=softmax_scale, causal=causal, is_fp8_kvcache=is_fp8_kvcache,
        )  # fmt: skip
    return mla_sparse_with_kvcache(
        q, k_cache, indices, head_dim_v, softmax_scale=softmax_scale, topk_length=topk_length,
        is_fp8_kvcache=is_fp8_kvcache,
    )  # fmt: skip


# the sparse call's checks, named as FlashMLA's extra-token arguments
_EXTRA_NAMES = {"k_cache": "extra_k_cache", "indices": "extra_indices_in_kvcache",
                "topk_length": "extra_topk_length"}  # fmt: skip


def _extra_partial(
    q: torch.Tensor,
    extra_k_cache: torch.Tensor,
    extra_indices_in_kvcache: torch.Tensor,
    extra_topk_length: torch.Tensor | None,
    head_dim_v: int,
    *,
    softmax_scale: float,
    is_fp8_kvcache: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The extra tokens' sparse partial (:func:`mla_sparse_with_kvcache` over
    ``extra_k_cache``), its errors naming the extra arguments.

    Returns
    -------
    o : torch.Tensor
        ``[b, s_q, h_q, head_dim_v]`` in ``q``'s dtype.
    lse : torch.Tensor
        ``[b, h_q, s_q]`` float32, natural log.
    """
    with argument_names(_EXTRA_NAMES):
        return mla_sparse_with_kvcache(
            q, extra_k_cache, extra_indices_in_kvcache, head_dim_v, softmax_scale=softmax_scale,
            topk_length=extra_topk_length, is_fp8_kvcache=is_fp8_kvcache,
        )  # fmt: skip


def _merge_two(
    first: tuple[torch.Tensor, torch.Tensor],
    second: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partials in FlashMLA's layout merged into one (attention over the union, exact) by
    :func:`mqnc.triton_kernels.merge_partials`.

    Parameters
    ----------
    first, second : tuple of torch.Tensor
        ``(o [b, s_q, h_q, d_v], lse [b, h_q, s_q])``, ``o`` in one dtype, ``lse`` float32,
        natural log.
    dtype : torch.dtype
        The merged ``o``'s (float32 when a sink follows: one rounding, after it).

    Returns
    -------
    o : torch.Tensor
        ``[b, s_q, h_q, d_v]`` in ``dtype``.
    lse : torch.Tensor
        ``[b, h_q, s_q]`` float32, natural log, contiguous.
    """
    s_q = first[0].shape[1]
    parts = (partial_from_flashmla(*first), partial_from_flashmla(*second))
    o_m = new_output(parts[0][0].shape, dtype, first[0].device)
    lse_m = new_output(parts[0][1].shape, torch.float32, first[0].device)
    merge_partials(
        torch.stack([p[0] for p in parts]),
        torch.stack([p[1] for p in parts]),
        check_lse=False,
        out=(o_m, lse_m),
        layout="MBHD",
    )
    return flashmla_from_partial(o_m, lse_m, s_q)


def _last_dim(name: str, t: object) -> int:
    """The last dim of a ``[b, s_q, topk]`` index tensor (its other checks are the sparse
    call's)."""
    check_tensor(name, t, ndim=3)
    return t.shape[-1]
