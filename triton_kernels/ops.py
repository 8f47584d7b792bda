"""Every kernel's public signature, written once: each is a ``torch.library`` op (namespace
``mqnc``), declared here with its docstring and its fake, through the registry of ``_core.op``.

==============================  =========================================================
``torch.ops.mqnc.``             the public function (declared here; its module runs it)
==============================  =========================================================
``mla_decode_partial``          :func:`~mqnc.triton_kernels.mla.decode.mla_decode_partial`
``mla_decode_partial_csr``      :func:`~mqnc.triton_kernels.mla.decode.mla_decode_partial_csr`
``mla_sparse_partial``          :func:`~mqnc.triton_kernels.mla.sparse.mla_sparse_partial`
``merge_partials``              :func:`~mqnc.triton_kernels.merge.partials.merge_partials`
``merge_partials_into``         :func:`~mqnc.triton_kernels.merge.partials.merge_partials_into`
                                (mutates)
``rope_splice``                 :func:`~mqnc.triton_kernels.splice.rotate.rope_splice` (mutates its
                                pools: ``[pool]`` with ``stacked``, or one per layer)
``rope_rotate``                 :func:`~mqnc.triton_kernels.splice.rotate.rope_rotate`
==============================  =========================================================

The public function *is* the op's caller: eager calls and ``torch.compile`` (which traces the
op through its fake) take one path, and the plans (``plan_mla_decode``, ...) take the same
signature without ``out``. An op's schema is the declared signature: the same parameters in
declared order, the same keyword-only ones and the same defaults (``torch.ops.mqnc.
mla_decode_partial(q, kv_pool, block_table, cache_seqlens, softmax_scale=s)`` is the public
call, ``d_v=512``), then ``backend`` (keyword-only where the declaration has keyword-only
parameters): ``"triton"`` (the kernels, the default) or ``"torch"`` (the fp64 references of
``mqnc.reference``, registered by ``mqnc.serving.compute``; ``kernel_ops("torch")`` calls
them). An op with ``out=`` has a second overload ``.out`` that writes the caller's tensors
(``out: Tensor[]``, before ``backend``) and returns nothing. Arguments that no op schema
carries are flattened by the registry's codecs: a RoPE spec is ``inv_freq`` (floats),
``rope_dim`` and ``layout``; a splice or rotation ``delta`` is ``delta_t`` (a tensor or None)
and ``delta_i`` (the int when ``delta_t`` is None); the splice's ``pool`` is ``pools`` and
``stacked``. The host-syncing checks are the
functions' own switches (``check_inputs``, ``check_indices``, ``check_lse``, ``validate``): turn
them off for a graph that is captured (``mode="reduce-overhead"``) or must not sync.

Adding an op (say, an FP8-cache variant of the dense kernel) touches four files: its kernel's
module (the kernel, and the op's ``"triton"`` implementation or planner, registered on the op),
this one (the declaration and its fake), ``mqnc/reference/torch_backend.py`` (its ``"torch"``
implementation) and its test; the schema, the public and plan functions, ``kernel_ops`` and
``torch.compile`` need nothing more (re-export it from ``mqnc.triton_kernels`` if it is to be
reached from there too).

The fakes give outputs their shapes and dtypes without running anything (their strides are
the contiguous ones the launchers allocate). Registered when ``mqnc.triton_kernels`` is
imported; registering touches no GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from mqnc.triton_kernels._core.op import (
    Codec,
    OpSet,
    kernel_op,
    kernel_op_named,
    op_set,
    registered_ops,
)

__all__ = [
    "OPS",
    "backend_ops",
    "register_backend",
    "RopeFrequencies",
    "PlainRope",
    "mla_decode_partial",
    "mla_decode_partial_csr",
    "mla_sparse_partial",
    "merge_partials",
    "merge_partials_into",
    "rope_splice",
    "rope_rotate",
    "tp_partial_scores",
    "tp_partial_values",
    "fp8_quantize",
    "fp8_dequantize",
]

Tensor = torch.Tensor
Outputs = tuple[Tensor, Tensor]


@runtime_checkable
class RopeFrequencies(Protocol):
    """What the splice needs of a RoPE specification (``mqnc``'s ``RopeSpec`` has it).

    ``inv_freq``: the ``rope_dim // 2`` frequencies (the model's float32 values) of the pairs;
    ``rope_dim``: the rotated dims at the end of each entry (64 for DeepSeek), ``2 * a power
    of two``; ``layout``: ``"interleaved"`` (pairs ``(x0, x1), (x2, x3), ...``, DeepSeek's
    reference) or ``"half"`` (pairs ``(x_i, x_{i + rope_dim/2})``, Hugging Face's port).
    """

    inv_freq: Sequence[float]
    rope_dim: int
    layout: str


@dataclasses.dataclass(frozen=True)
class PlainRope:
    """A :class:`RopeFrequencies` from plain values (what the ops rebuild from their schema)."""

    inv_freq: tuple[float, ...]
    rope_dim: int
    layout: str

    def pair_indices(self) -> tuple[list[int], list[int]]:
        """``(first, second)`` positions of each pair's members (what the references read)."""
        half = self.rope_dim // 2
        if self.layout == "interleaved":
            return [2 * i for i in range(half)], [2 * i + 1 for i in range(half)]
        return list(range(half)), [i + half for i in range(half)]


def _encode_rope(name: str, rope: object) -> tuple:
    if not isinstance(rope, RopeFrequencies):
        raise TypeError(
            f"{name}: expected a RoPE spec with inv_freq, rope_dim and layout (e.g. "
            f"mqnc's RopeSpec), got {type(rope).__name__}"
        )
    dim, layout = rope.rope_dim, rope.layout
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"{name}.rope_dim: expected an even int >= 2, got {dim!r}")
    if not isinstance(layout, str):
        raise ValueError(f"{name}.layout: expected 'interleaved' or 'half', got {layout!r}")
    return [float(f) for f in rope.inv_freq], dim, layout


ROPE = Codec(
    (("inv_freq", "float[]"), ("rope_dim", "int"), ("layout", "str")),
    _encode_rope,
    lambda inv_freq, dim, layout: PlainRope(tuple(inv_freq), dim, layout),
)
"""A RoPE spec (:class:`RopeFrequencies`) as its frequencies, rope dim and pair layout."""

_INT64 = 2**63


def _encode_delta(name: str, delta: object) -> tuple:
    if isinstance(delta, torch.Tensor):
        return delta, 0
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise TypeError(
            f"{name}: expected an int or an int64 torch.Tensor, got {type(delta).__name__}"
        )
    if not -_INT64 < delta < _INT64:
        raise ValueError(f"{name}: expected |{name}| <= 2**31 - 1, got {delta}")
    return None, delta


DELTA = Codec(
    (("delta_t", "Tensor?"), ("delta_i", "int")),
    _encode_delta,
    lambda t, i: t if t is not None else i,
)
"""``int | Tensor`` as a tensor-or-None and an int (read when the tensor is None)."""


def _encode_pools(name: str, pool: object) -> tuple:
    if isinstance(pool, torch.Tensor):
        return [pool], True
    if not isinstance(pool, (list, tuple)):
        raise TypeError(
            f"{name}: expected a torch.Tensor (or a sequence of one per layer), got "
            f"{type(pool).__name__}"
        )
    for i, p in enumerate(pool):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name}[{i}]: expected a torch.Tensor, got {type(p).__name__}")
    return list(pool), False


POOLS = Codec(
    (("pools", "Tensor[]"), ("stacked", "bool")),
    _encode_pools,
    lambda pools, stacked: pools[0] if stacked else list(pools),
)
"""One stacked tensor or a sequence of tensors (one per layer) as a list and a flag."""


def _partial_like(call) -> tuple[Tensor, Tensor]:
    """Fake ``(o [R, H, d_v] in q's dtype, lse [R, H] fp32)``."""
    R, H = call.q.shape[:2]
    return call.q.new_empty((R, H, call.d_v)), call.q.new_empty((R, H), dtype=torch.float32)


@kernel_op(fake=_partial_like)
def mla_decode_partial(
    q: Tensor,
    kv_pool: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    *,
    softmax_scale: float,
    d_v: int = 512,
    num_splits: int | None = None,
    check_inputs: bool = True,
    q_pe: Tensor | None = None,
    kpe_pool: Tensor | None = None,
    out: Outputs | None = None,
) -> tuple[Tensor, Tensor]:
    """Partial attention of absorbed MLA query rows over a paged cache (the holder's compute, §3.3).

    For query token ``b`` and head ``h``, with ``kv[t]`` the ``t``-th cache entry of token ``b``
    (``t < cache_seqlens[b]``) and ``s_t = softmax_scale * <q[b, h], kv[t]>``::

        lse[b, h] = log(sum_t exp(s_t))        o[b, h] = sum_t exp(s_t - lse[b, h]) * kv[t, :d_v]

    Parameters
    ----------
    q : torch.Tensor
        Absorbed query rows, shape ``[B, H, d_qk]`` (``d_qk = 576``: ``q_nope @ W_UK`` then the
        rotated ``q_pe``), bf16 / fp16 / fp32, unit stride on the last dim. With ``q_pe`` given:
        the latent part only, ``[B, H, d_v]``.
    kv_pool : torch.Tensor
        Paged cache, shape ``[num_blocks, block_size, d_qk]``, same dtype as ``q``, unit stride on
        the last dim; ``block_size`` a power of two (64 in production, 1 for a token pool). Each
        entry is ``[c_KV (d_v), k_pe (d_qk - d_v)]``, shared by all heads. With ``kpe_pool``
        given: the latent part only, ``[num_blocks, block_size, d_v]`` (FlashInfer's
        ``ckv_cache``). **FP8 cache**: a ``torch.uint8`` (or ``torch.float8_e4m3fn``) tensor of
        DeepSeek-V3.2's entries (``mqnc.model.kv_format``): ``[num_blocks, block_size, d_v +
        4 d_v / 128 + 2 (d_qk - d_v)]`` (656 for 512 + 64: e4m3 latent bytes, one float32 scale
        per 128 of them, bf16 RoPE values), or with ``kpe_pool`` (then bf16) the latent and
        scales ``[.., d_v + 4 d_v / 128]``; read in place and dequantized in registers to
        ``q``'s dtype (``q`` stays bf16 / fp16 / fp32; ``d_v`` a multiple of 128).
        ``check_inputs`` then also checks the attended entries' scales (finite, > 0) and latent
        bytes (no NaN).
    block_table : torch.Tensor
        ``[B, max_blocks]`` int32: token ``t`` of row ``b`` lives at
        ``kv_pool[block_table[b, t // block_size], t % block_size]``. Entries past a row's
        length are never read.
    cache_seqlens : torch.Tensor
        ``[B]`` int32, entries attended per row, ``0 <= cache_seqlens[b] <= max_blocks *
        block_size``; 0 gives ``o = 0, lse = -inf``.
    softmax_scale : float
        The model's scale, required (DeepSeek with YaRN: ``192**-0.5 * mscale**2``, not
        ``576**-0.5``).
    d_v : int
        Value width, the first ``d_v`` dims of each entry (512). ``d_v`` and ``d_qk - d_v`` must
        be powers of two >= 16.
    num_splits : int or None
        Splits of each row's key axis (split-KV), combined by the merge kernel; None chooses
        (see the module docstring). 1 writes the output directly.
    check_inputs : bool
        Check on the host (one sync) that lengths fit the table and the blocks in use exist;
        pass False on a hot path (or plan once: :func:`plan_mla_decode`).
    q_pe : torch.Tensor or None
        The rope part of the query rows, ``[B, H, d_qk - d_v]``, read in place (FlashInfer's
        ``q_pe``); then ``q`` is the latent part.
    kpe_pool : torch.Tensor or None
        The rope part of the cache, ``[num_blocks, block_size, d_qk - d_v]``, read in place
        (FlashInfer's ``kpe_cache``); then ``kv_pool`` is the latent part.
    out : tuple of torch.Tensor or None
        ``(o, lse)`` written instead of new tensors and returned (FlashInfer's ``out`` /
        ``lse``): contiguous, of the shapes and dtypes under Returns, on ``q``'s device (a
        holder reuses one pair per batch shape: no output allocation per call).

    Returns
    -------
    o : torch.Tensor
        ``[B, H, d_v]`` in ``q``'s dtype (accumulated in fp32).
    lse : torch.Tensor
        ``[B, H]`` float32, **natural-log** log-sum-exp of the scaled scores; ``-inf`` for an
        empty row. ``lse_to_base2`` converts to FlashInfer's convention.

    Examples
    --------
    >>> import torch
    >>> from mqnc.triton_kernels import mla_decode_partial
    >>> q = torch.randn(2, 16, 576)
    >>> pool = torch.randn(4, 64, 576)
    >>> table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    >>> lens = torch.tensor([100, 0], dtype=torch.int32)
    >>> o, lse = mla_decode_partial(q, pool, table, lens, softmax_scale=192**-0.5)
    >>> o.shape, lse.shape, float(lse[1, 0])
    (torch.Size([2, 16, 512]), torch.Size([2, 16]), -inf)
    """


@kernel_op(fake=_partial_like)
def mla_decode_partial_csr(
    q: Tensor,
    kv_pool: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_lens: Tensor | None = None,
    *,
    softmax_scale: float,
    d_v: int = 512,
    num_splits: int | None = None,
    check_inputs: bool = True,
    max_kv_len: int | None = None,
    q_pe: Tensor | None = None,
    kpe_pool: Tensor | None = None,
    out: Outputs | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`mla_decode_partial` over a CSR page table (FlashInfer's and SGLang's layout).

    Row ``b``'s pages are ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]``, in token order;
    token ``t`` of row ``b`` lives at ``kv_pool[page(t // block_size), t % block_size]``. With
    ``block_size = 1`` (SGLang's token pool) ``kv_indices`` lists the row's token slots. The
    kernel reads the table in place (no conversion to a padded table, which would need the
    longest row on the host).

    Parameters
    ----------
    q, kv_pool, softmax_scale, d_v, num_splits, q_pe, kpe_pool, out
        As in :func:`mla_decode_partial` (``q [B, H, d_qk]``; ``kv_pool [num_pages, block_size,
        d_qk]``, any power-of-two ``block_size``).
    kv_indptr : torch.Tensor
        ``[B + 1]`` int32, contiguous, non-decreasing offsets into ``kv_indices``.
    kv_indices : torch.Tensor
        ``[nnz]`` int32 page ids (any stride).
    kv_lens : torch.Tensor or None
        ``[B]`` int32 entries attended per row (FlashInfer's ``kv_len_arr``), at most the row's
        pages times ``block_size``; None: every entry of the row's pages (exact for
        ``block_size = 1``, or when each row's last page is full).
    check_inputs : bool
        Check on the host (one sync) the offsets, lengths and page ids in use.
    max_kv_len : int or None
        The longest row, for the split choice (a host int). None: read from ``kv_lens`` when
        ``check_inputs`` (which syncs anyway), else every page of ``kv_indices`` (an upper bound
        that may over-split: pass it on a hot path, or plan once with
        :func:`plan_mla_decode_csr`).

    Returns
    -------
    o : torch.Tensor
        ``[B, H, d_v]`` in ``q``'s dtype.
    lse : torch.Tensor
        ``[B, H]`` float32, natural log (``lse_to_base2`` gives FlashInfer's base 2).
    """


@kernel_op(fake=_partial_like)
def mla_sparse_partial(
    q: Tensor,
    kv_pool: Tensor,
    indices: Tensor,
    *,
    softmax_scale: float,
    d_v: int = 512,
    num_splits: int | None = None,
    check_indices: bool = True,
    q_pe: Tensor | None = None,
    kpe_pool: Tensor | None = None,
    out: Outputs | None = None,
) -> tuple[Tensor, Tensor]:
    """Partial attention of absorbed MLA query rows over a selected (top-k) set of cache entries.

    For query token ``b`` and head ``h``, over the entries ``j = indices[b, k] >= 0`` of the
    flattened pool ``kv = kv_pool.reshape(-1, d_qk)``, with ``s_j = softmax_scale *
    <q[b, h], kv[j]>``::

        lse[b, h] = log(sum_j exp(s_j))        o[b, h] = sum_j exp(s_j - lse[b, h]) * kv[j, :d_v]

    A repeated index is attended as many times as it appears (as the reference does).

    Parameters
    ----------
    q : torch.Tensor
        Absorbed query rows ``[B, H, d_qk]`` (576 for DeepSeek), bf16 / fp16 / fp32, unit
        stride on the last dim. Any ``H``.
    kv_pool : torch.Tensor
        Cache pool ``[num_blocks, block_size, d_qk]``, same dtype as ``q``, unit stride on the
        last dim, ``block_size`` a power of two (1: a token pool); entry ``j`` of the flattened
        token axis is ``kv_pool[j // block_size, j % block_size]``. Entries ``[c_KV (d_v),
        k_pe]``, attended at their canonical positions (no rotation). An FP8 cache (uint8 or
        float8_e4m3fn entries of 656 bytes for 512 + 64, or latent + scales with a bf16
        ``kpe_pool``) as in :func:`mla_decode_partial`; ``check_indices`` then also checks the
        selected entries' scales and latent bytes.
    indices : torch.Tensor
        ``[B, topk]`` int32 into the flattened token axis; ``-1`` marks an unused slot. A row
        with no valid index gives ``o = 0, lse = -inf``.
    softmax_scale : float
        The model's scale, required (DeepSeek with YaRN: ``192**-0.5 * mscale**2``).
    d_v : int
        Value width (512); ``d_v`` and ``d_qk - d_v`` powers of two >= 16.
    num_splits : int or None
        Splits of each row's index list (split-KV), combined by the merge kernel; None lets the
        split / grid policy choose (``_core.grid.choose_num_splits``: whole waves, at least 64
        slots per split).
    check_indices : bool
        Raise ``ValueError`` on the host (one sync) for an index ``< -1`` or ``>= num_blocks *
        block_size``; pass False on a hot path (an index past the pool then reads out of bounds,
        a negative one is read as unused), or plan once (:func:`plan_mla_sparse`).
    q_pe, kpe_pool : torch.Tensor or None
        The rope parts of the query rows ``[B, H, d_qk - d_v]`` and of the cache
        ``[num_blocks, block_size, d_qk - d_v]``, read in place (FlashInfer's split layout); then
        ``q`` / ``kv_pool`` hold the latent part only, as in
        :func:`mqnc.triton_kernels.mla.decode.mla_decode_partial`.
    out : tuple of torch.Tensor or None
        ``(o, lse)`` written instead of new tensors and returned (FlashInfer's ``out`` /
        ``lse``): contiguous, of the shapes and dtypes under Returns, on ``q``'s device (a
        holder reuses one pair per batch shape: no output allocation per call).

    Returns
    -------
    o : torch.Tensor
        ``[B, H, d_v]`` in ``q``'s dtype (accumulated in fp32).
    lse : torch.Tensor
        ``[B, H]`` float32, **natural-log** log-sum-exp of the scaled scores; ``-inf`` for a row
        with no valid index.

    Examples
    --------
    >>> import torch
    >>> from mqnc.triton_kernels import mla_sparse_partial
    >>> q = torch.randn(1, 16, 576)
    >>> pool = torch.randn(8, 64, 576)
    >>> idx = torch.tensor([[5, 300, 77, -1]], dtype=torch.int32)
    >>> o, lse = mla_sparse_partial(q, pool, idx, softmax_scale=192**-0.5)
    >>> o.shape, lse.shape
    (torch.Size([1, 16, 512]), torch.Size([1, 16]))
    """


def _merged(call) -> tuple[Tensor, Tensor]:
    """Fake ``(o [B, H, D], lse [B, H])`` of the partials' axis ``layout`` merged away."""
    o = call.o
    B = o.shape[1] if call.layout == "MBHD" else o.shape[0]
    return o.new_empty((B, o.shape[2], o.shape[3])), call.lse.new_empty((B, o.shape[2]))


MERGE_LAYOUTS = (
    "'MBHD' (mqnc's partials stacked first: [M, B, H, D]) or 'BMHD' (FlashInfer's [B, M, H, D])"
)


@kernel_op(fake=_merged, required=dict(layout=MERGE_LAYOUTS))
def merge_partials(
    o: Tensor,
    lse: Tensor,
    *,
    layout: str,
    check_lse: bool = True,
    out: Outputs | None = None,
    base2: bool = False,
) -> tuple[Tensor, Tensor]:
    """Merge M partials over disjoint key subsets into the partial over their union.

    Parameters
    ----------
    o : torch.Tensor
        Partial outputs, shape ``[M, B, H, Dv]`` (``layout="MBHD"``) or ``[B, M, H, Dv]``
        (``layout="BMHD"``, FlashInfer's ``[T, M, H, D]``), bf16 / fp16 / fp32, any strides.
        ``M >= 1``, any ``Dv`` (tiled by powers of two with masks).
    lse : torch.Tensor
        Log-sum-exp of each partial's scaled scores, ``o``'s shape without ``Dv``, float32;
        natural log (base 2 with ``base2``). ``-inf`` and ``+inf`` mark an empty partial.
    layout : str
        Required, keyword-only: which axis holds the partials, ``"MBHD"`` (the first: mqnc's
        partials stacked with ``torch.stack``, ``[M, B, H, D]``) or ``"BMHD"`` (the second:
        FlashInfer's ``merge_states`` input, ``[B, M, H, D]``). A 4-D tensor cannot say which
        it is (``[3, 2, 16, 512]`` is either), so there is no default and the axis is never
        guessed; a missing ``layout`` is a ``TypeError`` naming both values.
    check_lse : bool
        Raise on NaN ``lse`` (one host sync); pass False on a hot path.
    out : (torch.Tensor, torch.Tensor) or None
        Write the result into these ``[B, H, Dv]`` (any float dtype: the fp32 accumulator is
        rounded once to it) and ``[B, H]`` float32 tensors instead of new ones (how split-KV
        partials are combined straight into the attention kernels' outputs).
    base2 : bool
        ``lse`` given, and returned, in base 2 (FlashInfer's convention): merged with ``exp2``
        / ``log2``, no conversion.

    Returns
    -------
    o_merged : torch.Tensor
        ``[B, H, Dv]`` in ``o``'s dtype, accumulated in fp32.
    lse_merged : torch.Tensor
        ``[B, H]`` float32, natural log (base 2 with ``base2``); ``-inf`` where every partial
        was empty (then o = 0).

    Examples
    --------
    >>> import torch
    >>> from mqnc.triton_kernels.merge.partials import merge_partials
    >>> o, lse = torch.randn(3, 2, 16, 512), torch.randn(3, 2, 16)
    >>> om, lm = merge_partials(o, lse, layout="MBHD")
    >>> om.shape, lm.shape
    (torch.Size([2, 16, 512]), torch.Size([2, 16]))
    >>> om2, _ = merge_partials(o.transpose(0, 1), lse.transpose(0, 1), layout="BMHD")
    >>> bool((om2 == om).all())
    True
    """


@kernel_op(mutates=("o_acc", "lse_acc"))
def merge_partials_into(
    o_acc: Tensor,
    lse_acc: Tensor,
    o_new: Tensor,
    lse_new: Tensor,
    *,
    check_lse: bool = True,
    mask: Tensor | None = None,
    base2: bool = False,
) -> None:
    """Two-way in-place merge: ``(o_acc, lse_acc) <- merge((o_acc, lse_acc), (o_new, lse_new))``.

    The form a requester uses while partials stream in: start from an empty state
    (``o_acc = 0``, ``lse_acc = -inf``) and fold each arriving partial in.

    Parameters
    ----------
    o_acc : torch.Tensor
        Running output ``[B, H, Dv]``, bf16 / fp16 / fp32; overwritten.
    lse_acc : torch.Tensor
        Running natural-log LSE ``[B, H]`` float32; overwritten.
    o_new : torch.Tensor
        Arriving partial ``[B, H, Dv]``, same dtype as ``o_acc``.
    lse_new : torch.Tensor
        Its natural-log LSE ``[B, H]`` float32.
    check_lse : bool
        Raise on NaN ``lse`` (one host sync); pass False on a hot path.
    mask : torch.Tensor or None
        ``[B]`` bool: merge only the token rows where it is true; the others are left untouched
        (FlashInfer's ``merge_state_in_place`` mask: a CUDA graph captured for a padded batch
        skips its padding). None merges every row.
    base2 : bool
        Both ``lse`` in base 2 (FlashInfer's convention), ``lse_acc`` updated in base 2.
    """


@kernel_op(mutates=("pool",), codecs=dict(pool=POOLS, delta=DELTA, rope=ROPE), returns="pool")
def rope_splice(
    chunk: Tensor,
    pool: Tensor | Sequence[Tensor],
    slot_mapping: Tensor,
    delta: int | Tensor,
    rope: RopeFrequencies,
    *,
    validate: bool = True,
) -> Tensor | Sequence[Tensor]:
    """Splice a chunk of all layers into a paged pool, re-homing it by ``delta`` positions.

    One kernel launch for all ``L`` layers (§2.2): token ``t`` of layer ``l`` goes to flattened
    slot ``slot_mapping[t]`` of layer ``l``'s pool; its first ``d_c`` dims are copied
    bit-exactly and its last ``d_r`` rope dims rotated by ``R(delta[t])`` in float32 (angles
    reduced in float64, see the module docstring) and rounded once to the pool dtype.

    FP8 entries (``mqnc.model.kv_format``, DeepSeek-V3.2's 656 bytes: e4m3 latent, float32
    scales, bf16 RoPE part) are spliced by dtype: a uint8 ``chunk`` ``[L, ct, W]`` and uint8
    pools of the same ``W`` (``d_c + 4 d_c / 128 + 2 d_r``, ``d_r = rope.rope_dim``); latent
    and scale bytes are copied bit for bit, only the bf16 RoPE part is rotated (the same
    kernel over the entries read as bf16: ``splice.rotate.fp8_entry_views``).

    Parameters
    ----------
    chunk : torch.Tensor
        ``[L, ct, d_c + d_r]`` (576 = 512 + 64 for DeepSeek), bf16 / fp16 / fp32, unit stride on
        the last dim; rope dims encoded at the chunk's old positions in ``rope.layout``. Or
        uint8 FP8 entries ``[L, ct, W]`` (656 for 512 + 64).
    pool : torch.Tensor or sequence of torch.Tensor
        ``[L, num_blocks, block_size, d_c + d_r]``, same dtype and device as ``chunk``, unit
        stride on the last dim. Written in place at the given slots; other slots untouched. A
        ``chunk`` that is a view of the pool (entries moved within one pool, overlapping slots
        or not) is copied first: the splice reads it whole before it writes.
        Or one cache per layer, as vLLM and SGLang keep them (a list of ``L`` tensors
        ``[num_blocks, block_size, d_c + d_r]``, ``[num_blocks, block_size, 1, d_c + d_r]`` or
        ``[slots, d_c + d_r]``, one shape and strides for all): still one launch, the kernel
        reading each layer's address from a small table (cached per list of addresses).
    slot_mapping : torch.Tensor
        ``[ct]`` int64: slot of each token in the flattened ``[num_blocks * block_size]`` axis
        (block ``slot // block_size``, offset ``slot % block_size``), the same for every layer.
        Must be in range and free of duplicates (checked when ``validate``).
    delta : int or torch.Tensor
        New minus old position: one int for the whole chunk (a contiguous re-homing), or
        ``[ct]`` int64, one per token. ``|delta| <= 2**31 - 1``.
    rope : RopeFrequencies
        Frequencies and pair layout: any object with ``inv_freq``, ``rope_dim`` and ``layout``
        (:class:`RopeFrequencies`), e.g. ``mqnc``'s ``RopeSpec``.
    validate : bool
        Check slot range, duplicates and delta range (host syncs); pass False on a hot path
        once the inputs are known good.

    Returns
    -------
    torch.Tensor or sequence of torch.Tensor
        ``pool`` (modified in place).

    Examples
    --------
    >>> import torch
    >>> from mqnc.model import RopeSpec
    >>> from mqnc.triton_kernels.splice.rotate import rope_splice
    >>> rope = RopeSpec.from_preset("deepseek-v2-lite")
    >>> chunk = torch.randn(27, 55, 576).to(torch.bfloat16)
    >>> pool = torch.zeros(27, 4, 64, 576, dtype=torch.bfloat16)
    >>> _ = rope_splice(chunk, pool, torch.arange(64, 119), 1000, rope)
    >>> torch.equal(pool.view(27, 256, 576)[:, 64:119, :512], chunk[..., :512])
    True
    """


def _rotated(call) -> Tensor:
    return torch.empty_like(call.x, memory_format=torch.contiguous_format)


@kernel_op(fake=_rotated, codecs=dict(delta=DELTA, rope=ROPE))
def rope_rotate(x: Tensor, delta: int | Tensor, rope: RopeFrequencies) -> Tensor:
    """Rotate the rope dims of query (or key) rows by ``R(delta)``; the rest is copied.

    The requester applies this to its absorbed query with the opposite of the holder's offset
    before routing, so that the holder attends its cache at canonical positions and stays
    position-oblivious (§3.2): ``<R(-s) q, k(p)> = <q, R(s) k(p)>`` for a chunk the requester
    sees at offset ``s`` from where the holder cached it.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., d_c + d_r]`` (e.g. a query batch ``[B, H, 576]``), bf16 / fp16 / fp32, pairs in
        ``rope.layout``.
    delta : int or torch.Tensor
        One int, or an int64 tensor whose shape is a prefix of ``x.shape[:-1]`` (``[B]`` for
        ``[B, H, 576]``: one delta per query token) or equal to it.
    rope : RopeFrequencies
        As in :func:`rope_splice`.

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``x``: first ``d_c`` dims bit-identical, last ``d_r`` rotated
        in float32 and rounded once.

    Examples
    --------
    >>> import torch
    >>> from mqnc.model import RopeSpec
    >>> from mqnc.triton_kernels.splice.rotate import rope_rotate
    >>> q = torch.randn(2, 16, 576)
    >>> rope_rotate(q, torch.tensor([-5, 7]), RopeSpec.from_preset("deepseek-v2-lite")).shape
    torch.Size([2, 16, 576])
    """


def register_backend(backend: str, implementations: dict) -> None:
    """Register ``implementations`` (op name -> ``impl(call)``, each taking the op's call: one
    attribute per declared parameter) as the ops' ``backend`` (how ``mqnc.serving.compute``
    registers the fp64 references as ``"torch"``). Registering again replaces them."""
    for name, impl in implementations.items():
        kernel_op_named(name).implementation(backend)(impl)


def backend_ops(backend: str = "triton") -> OpSet:
    """The ops bound to ``backend``: attribute ``<name>`` is the public function of op
    ``<name>`` on it (same signature and docstring; for ``"triton"`` the functions of
    :mod:`mqnc.triton_kernels` themselves)."""
    return op_set(backend)


# ---- tensor-parallel holder ranks (§8) ----------------------------------------------------------


def _tp_scores_like(call) -> Tensor:
    q = call.q
    return q.new_empty((q.shape[0], q.shape[1], call.slots.shape[1]), dtype=torch.float32)


@kernel_op(fake=_tp_scores_like)
def tp_partial_scores(
    q: Tensor, kv_pool: Tensor, slots: Tensor, *, d_v: int, check_slots: bool = True
) -> Tensor:
    """Partial scores of query rows against a column slice of the cache (one tensor-parallel
    rank's share of ``<q, k>``, §8): summed over the ranks of a holder group, they are the
    single-rank scores (unscaled).

    ``s[b, h, t] = <q[b, h], kv[slots[b, t]]>`` over the slice's dims, fp32; ``-inf`` where
    ``slots[b, t] = -1``.

    Parameters
    ----------
    q : torch.Tensor
        This rank's slice of the absorbed query rows, ``[B, H, d_v + d_pe]``: its ``d_v``
        latent dims, then its ``d_pe`` RoPE dims (``mqnc.serving.tp_group.TPPartition`` says
        which), bf16 / fp16 / fp32, unit stride on the last dim.
    kv_pool : torch.Tensor
        This rank's slice of the paged cache, ``[num_blocks, block_size, d_v + d_pe]``, same
        dtype, same column order; ``block_size`` a power of two.
    slots : torch.Tensor
        ``[B, T]`` int32: flat slot (``block * block_size + offset``) of each entry token ``b``
        attends, ``-1`` unused (never read). Dense attention over a chunk: its tokens' slots in
        order; top-k selection: the selected entries' slots.
    d_v : int
        Latent dims of the slice (the value dims); ``d_v`` and ``d_pe`` powers of two >= 16
        for the Triton kernel (any width on the torch backend).
    check_slots : bool
        Check every slot is in range (one host sync); False on a hot path.

    Returns
    -------
    torch.Tensor
        ``[B, H, T]`` float32, unscaled partial scores, ``-inf`` at unused slots.

    Examples
    --------
    >>> import torch
    >>> from mqnc.triton_kernels.tp.scores import tp_partial_scores
    >>> q, pool = torch.randn(1, 16, 48), torch.randn(2, 16, 48)
    >>> slots = torch.tensor([[0, 5, -1]], dtype=torch.int32)
    >>> s = tp_partial_scores(q, pool, slots, d_v=32)
    >>> s.shape, bool(torch.isinf(s[0, :, 2]).all())
    (torch.Size([1, 16, 3]), True)
    """


def _tp_values_like(call) -> tuple[Tensor, Tensor]:
    s = call.scores
    B, H = s.shape[0], s.shape[1]
    return s.new_empty((B, H, call.d_v), dtype=call.kv_pool.dtype), s.new_empty((B, H))


@kernel_op(fake=_tp_values_like)
def tp_partial_values(
    scores: Tensor,
    kv_pool: Tensor,
    slots: Tensor,
    *,
    softmax_scale: float,
    d_v: int,
    check_slots: bool = True,
) -> tuple[Tensor, Tensor]:
    """Softmax of a holder group's summed scores times this rank's value slice (§8): the rank's
    slice of the partial ``o`` and the row's ``lse`` (the same on every rank of the group).

    With ``s_t = softmax_scale * scores[b, h, t]`` over the entries ``t`` whose slot is not -1::

        lse[b, h] = log(sum_t exp(s_t))     o[b, h] = sum_t exp(s_t - lse[b, h]) kv[slot_t, :d_v]

    Parameters
    ----------
    scores : torch.Tensor
        ``[B, H, T]`` float32: the group's summed :func:`tp_partial_scores` (unscaled).
    kv_pool : torch.Tensor
        This rank's slice of the paged cache, ``[num_blocks, block_size, d_v + d_pe]``, bf16 /
        fp16 / fp32; its first ``d_v`` dims are the rank's value dims.
    slots : torch.Tensor
        ``[B, T]`` int32, as given to :func:`tp_partial_scores`.
    softmax_scale : float
        The model's scale (DeepSeek with YaRN: ``192**-0.5 * mscale**2``).
    d_v : int
        Latent (value) dims of the slice; a power of two >= 16 for the Triton kernel.
    check_slots : bool
        Check every slot is in range (one host sync); False on a hot path.

    Returns
    -------
    o : torch.Tensor
        ``[B, H, d_v]`` in ``kv_pool``'s dtype (accumulated in fp32, rounded once).
    lse : torch.Tensor
        ``[B, H]`` float32, **natural-log** log-sum-exp of the scaled scores; ``-inf`` (and
        ``o = 0``) for a row with no entry.

    Examples
    --------
    >>> import torch
    >>> from mqnc.triton_kernels.tp.values import tp_partial_values
    >>> s, pool = torch.randn(1, 16, 3), torch.randn(2, 16, 48)
    >>> slots = torch.tensor([[0, 5, -1]], dtype=torch.int32)
    >>> o, lse = tp_partial_values(s, pool, slots, softmax_scale=0.1, d_v=32)
    >>> o.shape, lse.shape
    (torch.Size([1, 16, 32]), torch.Size([1, 16]))
    """


# ---- the FP8 cache (DeepSeek-V3.2's 656-byte entry, mqnc.model.kv_format) -----------------------

_FP8_OUT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _encode_dtype(name: str, dtype: object) -> tuple:
    if not isinstance(dtype, torch.dtype) or str(dtype)[6:] not in _FP8_OUT_DTYPES:
        raise TypeError(f"{name}: expected torch.bfloat16 or torch.float32, got {dtype!r}")
    return (str(dtype)[6:],)


OUT_DTYPE = Codec(
    fields=(("dtype", "str"),), encode=_encode_dtype, decode=lambda s: _FP8_OUT_DTYPES[s]
)


def _entries_like(call) -> Tensor:
    x, d_c = call.x, call.d_c
    d_r = x.shape[-1] - d_c
    return x.new_empty((*x.shape[:-1], d_c + 4 * (d_c // 128) + 2 * d_r), dtype=torch.uint8)


@kernel_op(fake=_entries_like)
def fp8_quantize(x: Tensor, d_c: int) -> Tensor:
    """Quantize cache rows to FP8 entries (DeepSeek-V3.2's format, FlashMLA's ``V32_FP8Sparse``):
    per row, ``d_c`` FP8 e4m3fn latent bytes, one float32 scale per 128 latent values, then the
    ``d_r`` RoPE values in bfloat16 (656 B for 512 + 64; ``mqnc.model.kv_format``).

    A group's scale is ``2**ceil(log2(max(fp32(amax / 448), 1e-4)))`` (a power of two: ``x /
    scale`` is exact, at most 448); the latent byte is ``x / scale`` rounded to nearest e4m3,
    ties to even. Bit-identical to the fp64 reference ``mqnc.reference.fp8_ref``.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., d_c + d_r]`` bfloat16 or float32 cache rows (latent first), finite and of
        magnitude below ``248 * 2**120`` (~3.3e38: from there the dequantized value overflows
        float32; checked: one host sync), unit stride on the last dim; ``d_r`` a power of two
        >= 16 for the kernel.
    d_c : int
        Latent width, a multiple of 128.

    Returns
    -------
    torch.Tensor
        ``[..., d_c + 4 d_c / 128 + 2 d_r]`` uint8 entries (a bf16 RoPE part is copied bit for
        bit; an fp32 one rounded to nearest even).

    Examples
    --------
    >>> import torch
    >>> from mqnc.triton_kernels.fp8.quant import fp8_quantize
    >>> fp8_quantize(torch.randn(3, 576, dtype=torch.bfloat16), 512).shape
    torch.Size([3, 656])
    """


def _rows_like(call) -> Tensor:
    c = call.cache
    return c.new_empty((*c.shape[:-1], call.d_c + call.d_r), dtype=call.dtype)


@kernel_op(fake=_rows_like, codecs=dict(dtype=OUT_DTYPE))
def fp8_dequantize(cache: Tensor, d_c: int, d_r: int, dtype: torch.dtype) -> Tensor:
    """Dequantize FP8 entries (:func:`fp8_quantize`'s) to cache rows: ``fp8 * scale`` per
    latent value, the RoPE part as stored.

    Parameters
    ----------
    cache : torch.Tensor
        ``[..., d_c + 4 d_c / 128 + 2 d_r]`` uint8 entries; every scale finite and > 0 and no
        latent byte a NaN (checked: one host sync; a wrong width is named: scales missing).
    d_c, d_r : int
        Latent and RoPE widths.
    dtype : torch.dtype
        ``torch.bfloat16`` or ``torch.float32``.

    Returns
    -------
    torch.Tensor
        ``[..., d_c + d_r]`` in ``dtype``: exact for power-of-two scales (an e4m3 value times a
        power of two is a bf16 value); another scale's product is rounded to float32, then to
        ``dtype`` (nearest even; FlashMLA's order).

    Examples
    --------
    >>> import torch
    >>> from mqnc.triton_kernels.fp8.quant import fp8_dequantize, fp8_quantize
    >>> x = torch.randn(3, 576, dtype=torch.bfloat16)
    >>> fp8_dequantize(fp8_quantize(x, 512), 512, 64, torch.bfloat16).shape
    torch.Size([3, 576])
    """


OPS = registered_ops()
"""The ops' names (``torch.ops.mqnc.<name>``), in declaration order."""
