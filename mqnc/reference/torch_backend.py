"""The fp64 references as the kernels' ``"torch"`` backend: one implementation per kernel op.

Each function here implements the op of its name (``mqnc.triton_kernels.ops``) from that op's
call (one attribute per declared parameter: ``call.q``, ``call.softmax_scale``, ...), so no
signature is written again; :data:`IMPLEMENTATIONS` maps op names to them. This module sits on
the kernels' layer and cannot import them: ``mqnc.serving.compute`` (a higher layer) registers
:data:`IMPLEMENTATIONS` as the ops' ``"torch"`` backend, and ``kernel_ops("torch")`` calls them
through the ops (eager or under ``torch.compile``, where the ops' fakes stand in).

Results are the references' fp64 values rounded once to the kernels' output dtypes (``o`` in
the query's dtype, ``lse`` float32, rotated and spliced rows in the input's / pool's dtype). An
``out=`` is written by the ops' registry (same shapes, dtypes and device required, as the
kernels' ``out=``). The kernels' host-check switches (``check_inputs``, ``check_indices``,
``check_lse``, ``validate``) and ``num_splits`` change nothing here: the references have no
such checks and no splits.
"""

from __future__ import annotations

import math

import torch

from mqnc.reference.attention_ref import (
    dequantized_cache,
    is_fp8_cache,
    mla_decode_reference,
    mla_sparse_reference,
)
from mqnc.reference.fp8_ref import fp8_dequantize_reference, fp8_quantize_reference
from mqnc.reference.merge_ref import merge_reference
from mqnc.reference.rope_ref import fp8_rope_rotate_reference, rope_rotate_reference
from mqnc.reference.tp_ref import tp_scores_reference, tp_values_reference

__all__ = ["IMPLEMENTATIONS", "ROWS_PER_SLICE"]

IMPLEMENTATIONS: dict = {}
"""Op name -> its torch implementation ``impl(call)``."""

ROWS_PER_SLICE = 2
"""Query tokens per slice of a torch-path attention call: the fp64 reference gathers every
row's keys at once (``rows x tokens x d_qk`` float64), which for a holder's batch of 8 rows of
~450 tokens is ~16 MB, out of cache: a call then costs ~2.5x per row x token what a single row
does. Slices of 2 rows keep the cost linear in the rows (the values are the same: each row's
attention is its own)."""

_LN2 = math.log(2.0)


def _implements(name: str):
    def register(impl):
        IMPLEMENTATIONS[name] = impl
        return impl

    return register


def _by_rows(call, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``call(slice)`` over slices of :data:`ROWS_PER_SLICE` query tokens, ``(o, lse)`` joined
    along the batch axis."""
    if rows <= ROWS_PER_SLICE:
        return call(slice(None))
    parts = [call(slice(i, i + ROWS_PER_SLICE)) for i in range(0, rows, ROWS_PER_SLICE)]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def _fused(call) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, kv_pool)`` with their rope parts joined back when given apart (``q_pe``,
    ``kpe_pool``: FlashInfer's split layout); an FP8 ``kv_pool`` as the rows the kernels
    attend (``attention_ref.dequantized_cache``, in the query's dtype)."""
    q = call.q if call.q_pe is None else torch.cat([call.q, call.q_pe], dim=-1)
    if is_fp8_cache(call.kv_pool):
        return q, dequantized_cache(call.kv_pool, call.d_v, q.dtype, call.kpe_pool)
    kv = call.kv_pool if call.kpe_pool is None else torch.cat([call.kv_pool, call.kpe_pool], -1)
    return q, kv


def _rounded(o, lse, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's fp64 ``(o, lse)`` rounded once to ``dtype`` and float32."""
    return o.to(dtype), lse.to(torch.float32)


@_implements("mla_decode_partial")
def _decode(call) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense paged partial attention, by slices of rows."""
    q, kv = _fused(call)
    table, lens = call.block_table, call.cache_seqlens
    o, lse = _by_rows(
        lambda r: mla_decode_reference(q[r], kv, table[r], lens[r], call.softmax_scale, call.d_v),
        q.shape[0],
    )
    return _rounded(o, lse, q.dtype)


@_implements("mla_decode_partial_csr")
def _decode_csr(call) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense partial attention over a CSR page table: the padded table of its rows."""
    q, kv = _fused(call)
    ptr = call.kv_indptr.long().tolist()
    rows = [call.kv_indices[a:b] for a, b in zip(ptr[:-1], ptr[1:], strict=True)]
    table = torch.zeros(len(rows), max([1] + [len(r) for r in rows]), dtype=torch.int32)
    table = table.to(call.kv_indices.device)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    lens = call.kv_lens
    if lens is None:
        lens = torch.tensor([len(r) * kv.shape[1] for r in rows], dtype=torch.int32)
        lens = lens.to(table.device)
    o, lse = _by_rows(
        lambda r: mla_decode_reference(q[r], kv, table[r], lens[r], call.softmax_scale, call.d_v),
        q.shape[0],
    )
    return _rounded(o, lse, q.dtype)


@_implements("mla_sparse_partial")
def _sparse(call) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse top-k partial attention, by slices of rows."""
    q, kv = _fused(call)
    idx = call.indices
    o, lse = _by_rows(
        lambda r: mla_sparse_reference(q[r], kv, idx[r], call.softmax_scale, call.d_v),
        q.shape[0],
    )
    return _rounded(o, lse, q.dtype)


def _partials_first(o, lse, layout):
    if layout not in ("MBHD", "BMHD"):
        raise ValueError(
            f"layout: expected 'MBHD' (partials first, [M, B, H, D]) or 'BMHD' (FlashInfer's "
            f"[T, M, H, D]), got {layout!r}"
        )
    return (o, lse) if layout == "MBHD" else (o.transpose(0, 1), lse.transpose(0, 1))


@_implements("merge_partials")
def _merge(call) -> tuple[torch.Tensor, torch.Tensor]:
    """The M-way merge (natural log, or base 2 with ``base2``), rounded to ``out``'s dtype when
    ``out`` is given (as the kernel rounds its fp32 accumulator once to it), else ``o``'s."""
    o, lse = _partials_first(call.o, call.lse, call.layout)
    unit = _LN2 if call.base2 else 1.0
    om, lm = merge_reference(o, lse.double() * unit)
    dtype = o.dtype if call.out is None else call.out[0].dtype
    return om.to(dtype), (lm / unit).to(torch.float32)


@_implements("merge_partials_into")
def _merge_into(call) -> None:
    """The two-way merge written into ``(o_acc, lse_acc)``, on the rows of ``mask`` only."""
    unit = _LN2 if call.base2 else 1.0
    lse = torch.stack([call.lse_acc, call.lse_new]).double() * unit
    om, lm = merge_reference(torch.stack([call.o_acc, call.o_new]), lse)
    rows = slice(None) if call.mask is None else call.mask
    call.o_acc[rows] = om.to(call.o_acc.dtype)[rows]
    call.lse_acc[rows] = (lm / unit).to(torch.float32)[rows]


@_implements("rope_rotate")
def _rotate(call) -> torch.Tensor:
    """``x`` with its rope dims rotated by ``R(delta)``, in x's dtype."""
    return rope_rotate_reference(call.x, call.delta, call.rope).to(call.x.dtype)


@_implements("rope_splice")
def _splice(call) -> None:
    """The chunk's rows, rope dims rotated by ``R(delta[t])``, written at the flat slots of
    every layer's pool (one stacked pool or one cache per layer)."""
    delta = call.delta
    if isinstance(delta, torch.Tensor):
        delta = delta.reshape(1, -1)  # one per token, the same for every layer
    if call.chunk.dtype == torch.uint8:  # FP8 entries: latent and scales copied, RoPE rotated
        prefix, rotated = fp8_rope_rotate_reference(call.chunk, delta, call.rope)
        rotated = rotated.to(torch.bfloat16).view(torch.uint8)
        rows = torch.cat([prefix, rotated], dim=-1)
    else:
        rows = rope_rotate_reference(call.chunk, delta, call.rope)
    slots = call.slot_mapping.long()
    pool = call.pool
    if isinstance(pool, torch.Tensor):
        flat = pool.view(pool.shape[0], -1, pool.shape[-1])
        flat[:, slots] = rows.to(pool.dtype)
        return
    for layer, p in zip(rows, pool, strict=True):
        p.view(-1, p.shape[-1])[slots] = layer.to(p.dtype)


@_implements("tp_partial_scores")
def _tp_scores(call) -> torch.Tensor:
    """A tensor-parallel rank's partial scores, fp32."""
    return tp_scores_reference(call.q, call.kv_pool, call.slots).to(torch.float32)


@_implements("tp_partial_values")
def _tp_values(call) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor-parallel rank's softmax times its value slice, ``o`` in the pool's dtype."""
    o, lse = tp_values_reference(
        call.scores, call.kv_pool, call.slots, call.softmax_scale, call.d_v
    )
    return _rounded(o, lse, call.kv_pool.dtype)


@_implements("fp8_quantize")
def _fp8_quantize(call) -> torch.Tensor:
    """Cache rows to FP8 entries, the fp64 reference's bytes."""
    return fp8_quantize_reference(call.x, call.d_c)


@_implements("fp8_dequantize")
def _fp8_dequantize(call) -> torch.Tensor:
    """FP8 entries to cache rows, exact products rounded to float32, then to ``dtype``."""
    return fp8_dequantize_reference(call.cache, call.d_c, call.d_r, call.dtype)
