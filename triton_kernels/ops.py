"""The kernels as ``torch.library`` custom ops (namespace ``mqnc``), each with a fake (meta)
implementation, so that ``torch.compile(fullgraph=True)`` traces a function that calls them.

==============================  =========================================================
``torch.ops.mqnc.``             the public function it runs
==============================  =========================================================
``mla_decode_partial``          :func:`~mqnc.triton_kernels.mla_decode.mla_decode_partial`
``mla_decode_partial_csr``      :func:`~mqnc.triton_kernels.mla_decode.mla_decode_partial_csr`
``mla_sparse_partial``          :func:`~mqnc.triton_kernels.mla_sparse.mla_sparse_partial`
``merge_partials``              :func:`~mqnc.triton_kernels.merge.merge_partials`
``merge_partials_into``         :func:`~mqnc.triton_kernels.merge.merge_partials_into` (mutates)
``rope_splice``                 :func:`~mqnc.triton_kernels.splice.rope_splice` (mutates its
                                pools: ``[pool]`` with ``stacked``, or one cache per layer)
``rope_rotate``                 :func:`~mqnc.triton_kernels.splice.rope_rotate`
==============================  =========================================================

The public functions themselves call their op while ``torch.compile`` traces them
(``torch.compiler.is_compiling()``), so user code calls them as usual; eagerly they run
directly (no dispatcher round trip). Arguments are the public functions', flattened to what an
op schema carries: a RoPE spec is ``inv_freq`` (floats), ``rope_dim`` and ``layout``; a splice
``delta`` is a tensor or, when that is None, an int. The host-syncing checks are the functions'
own switches (``check_inputs``, ``check_indices``, ``check_lse``, ``validate``): turn them off
for a graph that is captured (``mode="reduce-overhead"``) or must not sync.

The fakes give outputs their shapes and dtypes without running anything (their strides are
the contiguous ones the launchers allocate). Registered when ``mqnc.triton_kernels`` is
imported; registering touches no GPU.
"""

from __future__ import annotations

import torch

from mqnc.triton_kernels.merge import merge_partials, merge_partials_into
from mqnc.triton_kernels.mla_decode import mla_decode_partial, mla_decode_partial_csr
from mqnc.triton_kernels.mla_sparse import mla_sparse_partial
from mqnc.triton_kernels.splice import PlainRope, rope_rotate, rope_splice

__all__ = ["OPS"]

_NS = "mqnc"
Tensor = torch.Tensor


def _partial_like(q: Tensor, d_v: int) -> tuple[Tensor, Tensor]:
    """Fake ``(o [R, H, d_v] in q's dtype, lse [R, H] fp32)``."""
    R, H = q.shape[:2]
    return q.new_empty((R, H, d_v)), q.new_empty((R, H), dtype=torch.float32)


@torch.library.custom_op(f"{_NS}::mla_decode_partial", mutates_args=())
def _mla_decode(
    q: Tensor,
    kv_pool: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    softmax_scale: float,
    d_v: int,
    num_splits: int | None,
    check_inputs: bool,
    q_pe: Tensor | None,
    kpe_pool: Tensor | None,
) -> tuple[Tensor, Tensor]:
    return mla_decode_partial(
        q,
        kv_pool,
        block_table,
        cache_seqlens,
        softmax_scale=softmax_scale,
        d_v=d_v,
        num_splits=num_splits,
        check_inputs=check_inputs,
        q_pe=q_pe,
        kpe_pool=kpe_pool,
    )


@_mla_decode.register_fake
def _(q, kv_pool, block_table, cache_seqlens, softmax_scale, d_v, num_splits, check, q_pe, kpe):
    return _partial_like(q, d_v)


@torch.library.custom_op(f"{_NS}::mla_decode_partial_csr", mutates_args=())
def _mla_decode_csr(
    q: Tensor,
    kv_pool: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_lens: Tensor | None,
    softmax_scale: float,
    d_v: int,
    num_splits: int | None,
    check_inputs: bool,
    max_kv_len: int | None,
    q_pe: Tensor | None,
    kpe_pool: Tensor | None,
) -> tuple[Tensor, Tensor]:
    return mla_decode_partial_csr(
        q,
        kv_pool,
        kv_indptr,
        kv_indices,
        kv_lens,
        softmax_scale=softmax_scale,
        d_v=d_v,
        num_splits=num_splits,
        check_inputs=check_inputs,
        max_kv_len=max_kv_len,
        q_pe=q_pe,
        kpe_pool=kpe_pool,
    )


@_mla_decode_csr.register_fake
def _(q, kv_pool, indptr, indices, lens, scale, d_v, splits, check, max_len, q_pe, kpe):
    return _partial_like(q, d_v)


@torch.library.custom_op(f"{_NS}::mla_sparse_partial", mutates_args=())
def _mla_sparse(
    q: Tensor,
    kv_pool: Tensor,
    indices: Tensor,
    softmax_scale: float,
    d_v: int,
    num_splits: int | None,
    check_indices: bool,
    q_pe: Tensor | None,
    kpe_pool: Tensor | None,
) -> tuple[Tensor, Tensor]:
    return mla_sparse_partial(
        q,
        kv_pool,
        indices,
        softmax_scale=softmax_scale,
        d_v=d_v,
        num_splits=num_splits,
        check_indices=check_indices,
        q_pe=q_pe,
        kpe_pool=kpe_pool,
    )


@_mla_sparse.register_fake
def _(q, kv_pool, indices, softmax_scale, d_v, num_splits, check_indices, q_pe, kpe_pool):
    return _partial_like(q, d_v)


@torch.library.custom_op(f"{_NS}::merge_partials", mutates_args=())
def _merge(
    o: Tensor, lse: Tensor, check_lse: bool, layout: str, base2: bool
) -> tuple[Tensor, Tensor]:
    return merge_partials(o, lse, check_lse=check_lse, layout=layout, base2=base2)


@_merge.register_fake
def _(o, lse, check_lse, layout, base2):
    B, H, D = (
        (o.shape[1], o.shape[2], o.shape[3])
        if layout == "MBHD"
        else (
            o.shape[0],
            o.shape[2],
            o.shape[3],
        )
    )
    return o.new_empty((B, H, D)), lse.new_empty((B, H))


@torch.library.custom_op(f"{_NS}::merge_partials_into", mutates_args=("o_acc", "lse_acc"))
def _merge_into(
    o_acc: Tensor,
    lse_acc: Tensor,
    o_new: Tensor,
    lse_new: Tensor,
    check_lse: bool,
    mask: Tensor | None,
    base2: bool,
) -> None:
    merge_partials_into(o_acc, lse_acc, o_new, lse_new, check_lse=check_lse, mask=mask, base2=base2)


@_merge_into.register_fake
def _(o_acc, lse_acc, o_new, lse_new, check_lse, mask, base2):
    return None


def _delta(delta_t: Tensor | None, delta_i: int):
    return delta_t if delta_t is not None else delta_i


@torch.library.custom_op(f"{_NS}::rope_splice", mutates_args=("pools",))
def _splice(
    chunk: Tensor,
    pools: list[Tensor],
    stacked: bool,
    slot_mapping: Tensor,
    delta_t: Tensor | None,
    delta_i: int,
    inv_freq: list[float],
    rope_dim: int,
    layout: str,
    validate: bool,
) -> None:
    rope = PlainRope(tuple(inv_freq), rope_dim, layout)
    pool = pools[0] if stacked else pools
    rope_splice(chunk, pool, slot_mapping, _delta(delta_t, delta_i), rope, validate=validate)


@_splice.register_fake
def _(chunk, pools, stacked, slot_mapping, delta_t, delta_i, inv_freq, rope_dim, layout, validate):
    return None


@torch.library.custom_op(f"{_NS}::rope_rotate", mutates_args=())
def _rotate(
    x: Tensor,
    delta_t: Tensor | None,
    delta_i: int,
    inv_freq: list[float],
    rope_dim: int,
    layout: str,
) -> Tensor:
    rope = PlainRope(tuple(inv_freq), rope_dim, layout)
    return rope_rotate(x, _delta(delta_t, delta_i), rope)


@_rotate.register_fake
def _(x, delta_t, delta_i, inv_freq, rope_dim, layout):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


OPS = (
    "mla_decode_partial",
    "mla_decode_partial_csr",
    "mla_sparse_partial",
    "merge_partials",
    "merge_partials_into",
    "rope_splice",
    "rope_rotate",
)
