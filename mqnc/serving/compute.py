"""Where the holder's and the requester's arithmetic runs: the Triton kernels or their fp64
torch references, chosen once per object with ``kernels=``.

Every primitive of §2.1 ends in one of five kernel calls: dense paged or sparse top-k partial
absorbed-MLA attention, the M-way merge of partials (§3.3), the query rotation by ``-delta``
(route, §3.2) and the splice of a fetched chunk (§2.2). :class:`~mqnc.serving.Holder`,
:class:`~mqnc.serving.Requester` and the paged pool call them through the object
:func:`kernel_ops` returns, which has those five functions under the kernels' own names and
signatures:

``"triton"`` (the default)
    the package :mod:`mqnc.triton_kernels` itself (compiled on a GPU, interpreted on a CPU);
``"torch"``
    :class:`ReferenceOps`: the fp64 references of :mod:`mqnc.reference`, rounded once to the
    kernels' output dtypes (``o`` in the query's dtype, ``lse`` float32, rotated and spliced
    rows in the input's / pool's dtype). For tests and CPU runs that exercise the serving logic
    (transport, batching, fallback, an external model's decode loop) rather than the kernels:
    the Triton interpreter takes ~0.1 s per merge on a CPU, the reference well under 1 ms.

Shapes, dtypes and the LSE base (natural log) are the kernels'; see their docstrings.
"""

from __future__ import annotations

import torch

import mqnc.triton_kernels as triton_ops
from mqnc.reference import (
    merge_reference,
    mla_decode_reference,
    mla_sparse_reference,
    rope_rotate_reference,
)
from mqnc.triton_kernels._mla_launch import written_into

__all__ = ["KERNELS", "ReferenceOps", "check_kernels", "kernel_ops"]

KERNELS = ("triton", "torch")


def check_kernels(kernels: object) -> str:
    """``kernels`` if it is one of :data:`KERNELS`, else a ``ValueError`` naming it."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels: expected one of {KERNELS}, got {kernels!r}")
    return kernels  # type: ignore[return-value]


class ReferenceOps:
    """The kernels' five entry points computed by the fp64 references, rounded once.

    The kernels' ``check_inputs`` / ``check_indices`` / ``check_lse`` switches (skip host-side
    checks that sync the device) are accepted for the same call signature; the references
    have no such checks to skip."""

    @staticmethod
    def mla_decode_partial(
        q: torch.Tensor,
        kv_pool: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        *,
        softmax_scale: float,
        d_v: int = 512,
        check_inputs: bool = True,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense paged partial attention: ``q [B, H, d_qk]`` over ``kv_pool [nb, bs, d_qk]``
        (``block_table [B, max_blocks]`` int32, ``cache_seqlens [B]`` int32); returns
        ``o [B, H, d_v]`` in q's dtype and natural-log ``lse [B, H]`` float32 (written into
        ``out`` when given)."""
        o, lse = _by_rows(
            lambda r: mla_decode_reference(
                q[r], kv_pool, block_table[r], cache_seqlens[r], softmax_scale, d_v
            ),
            q.shape[0],
        )
        return _rounded(o, lse, q.dtype, out)

    @staticmethod
    def mla_sparse_partial(
        q: torch.Tensor,
        kv_pool: torch.Tensor,
        indices: torch.Tensor,
        *,
        softmax_scale: float,
        d_v: int = 512,
        check_indices: bool = True,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse top-k partial attention over the flattened pool entries ``indices [B, topk]``
        (``-1`` unused); returns ``o [B, H, d_v]`` in q's dtype, ``lse [B, H]`` float32
        (written into ``out`` when given)."""
        o, lse = _by_rows(
            lambda r: mla_sparse_reference(q[r], kv_pool, indices[r], softmax_scale, d_v),
            q.shape[0],
        )
        return _rounded(o, lse, q.dtype, out)

    @staticmethod
    def merge_partials(
        o: torch.Tensor, lse: torch.Tensor, *, check_lse: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """M-way merge of ``o [M, B, H, Dv]``, ``lse [M, B, H]`` (natural log, ``+-inf``
        empty) into ``o [B, H, Dv]`` in o's dtype and ``lse [B, H]`` float32."""
        om, lm = merge_reference(o, lse)
        return om.to(o.dtype), lm.to(torch.float32)

    @staticmethod
    def rope_rotate(x: torch.Tensor, delta, rope) -> torch.Tensor:
        """``x [..., d_c + d_r]`` with its last ``d_r`` dims rotated by ``R(delta)``, in x's
        dtype."""
        return rope_rotate_reference(x, delta, rope).to(x.dtype)

    @staticmethod
    def rope_splice(
        chunk: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor, delta, rope
    ) -> torch.Tensor:
        """Write ``chunk [L, ct, d_qk]`` into ``pool [L, nb, bs, d_qk]`` at flat slots
        ``slot_mapping [ct]``, its rope dims rotated by ``R(delta)``; returns ``pool``
        (modified in place)."""
        flat = pool.view(pool.shape[0], -1, pool.shape[-1])
        flat[:, slot_mapping.long()] = rope_rotate_reference(chunk, delta, rope).to(pool.dtype)
        return pool


ROWS_PER_SLICE = 2
"""Query tokens per slice of a torch-path attention call: the fp64 reference gathers every
row's keys at once (``rows x tokens x d_qk`` float64), which for a holder's batch of 8 rows of
~450 tokens is ~16 MB, out of cache: a call then costs ~2.5x per row x token what a single row
does. Slices of 2 rows keep the cost linear in the rows (the values are the same: each row's
attention is its own)."""


def _rounded(o, lse, dtype, out) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's fp64 ``(o, lse)`` rounded once to ``dtype`` and float32, written into
    ``out`` when given (checked as the kernels' ``out=`` under ``torch.compile``: same shapes,
    dtypes and device)."""
    return written_into(out, (o.to(dtype), lse.to(torch.float32)))


def _by_rows(call, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``call(slice)`` over slices of :data:`ROWS_PER_SLICE` query tokens, ``(o, lse)`` joined
    along the batch axis."""
    if rows <= ROWS_PER_SLICE:
        return call(slice(None))
    parts = [call(slice(i, i + ROWS_PER_SLICE)) for i in range(0, rows, ROWS_PER_SLICE)]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def kernel_ops(kernels: str = "triton"):
    """The five kernel entry points for ``kernels`` (:data:`KERNELS`): the module
    :mod:`mqnc.triton_kernels` or :class:`ReferenceOps`."""
    return triton_ops if check_kernels(kernels) == "triton" else ReferenceOps
