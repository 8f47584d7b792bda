"""The requester's put of one routed request into a holder's inbox slot, on the device: the query
rows, the selection, the header, then the signal (§3.2: one put-with-signal per request), with
no host call (the sequence number comes from device memory, so a captured CUDA graph replays it).

Grid ``(P,)``: program ``p`` copies query tokens ``p, p + P, ...`` (all their heads, 512 + 64
wide: ``tl.arange`` needs powers of two) and their selection rows into the slot; the last
program to arrive on the slot's put counter (acq_rel atomic) takes the next sequence number,
writes the header (``route.words``) and raises the signal. The number is the slot's, not the
requester object's: the slot's last number (the header's ``H_SEQ`` word in the sender's copy
of the inbox, written by every put on the slot) plus one, recorded in ``Seq[slot]`` for the
merge to wait on. A second requester on a slot, or one restarted, so numbers its request after
the last one the slot carried, never reusing a number the holder has answered (which it would
skip as a duplicate, leaving the old reply to be taken for the new request's):

- ``local`` backend (``NVSHMEM`` off): the slot is the holder's inbox in this device's memory;
  the signal is a release store;
- ``nvshmem``: the slot is this PE's copy of the symmetric inbox; the rows, the selection, a
  fence, then the header with ``nvshmemx_putmem_signal_nbi_block`` go to the holder's PE (a PE
  may be itself), then ``nvshmem_quiet``.

The sequence number wraps as an int64 (after ``2**63 - 1`` comes ``-2**63``): the holder
answers a number that does not increase with an error word, never a partial.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels._core.validate import dtype_name
from mqnc.triton_kernels.route.nvshmem_device import (
    fence,
    putmem_nbi_block,
    putmem_signal_nbi_block,
)
from mqnc.triton_kernels.route.nvshmem_device import quiet as nvshmem_quiet
from mqnc.triton_kernels.route.words import (
    H_BATCH,
    H_CHUNK,
    H_HEADS,
    H_LAYER,
    H_MODE,
    H_SEQ,
    H_TOPK,
    HEADER_WORDS,
    RouteBuffers,
)

__all__ = ["route_put_kernel", "route_put_launch"]

_HW = tl.constexpr(HEADER_WORDS)


@triton.jit
def _copy_rows(Q, Idx, InQ, InIdx, slot, batch, heads, topk, max_batch, max_topk, H,
               stride_qb, stride_qh, stride_ib, BLOCK_H: tl.constexpr, D_LAT: tl.constexpr,
               D_PE: tl.constexpr, BLOCK_K: tl.constexpr, SPARSE: tl.constexpr):  # fmt: skip
    """This program's tokens of ``Q [batch, heads, D_LAT + D_PE]`` (and ``Idx [batch, topk]``)
    into the slot's ``InQ [max_batch, H, D_LAT + D_PE]`` (and ``InIdx [max_batch, max_topk]``)."""
    p = tl.program_id(0)
    P = tl.num_programs(0)
    offs_h = tl.arange(0, BLOCK_H)
    d = D_LAT + D_PE
    for b in range(p, batch, P):
        b64 = b + tl.zeros([], tl.int64)
        dst = InQ + (slot * max_batch + b64) * H * d
        for h0 in range(0, heads, BLOCK_H):
            hs = h0 + offs_h
            mh = (hs < heads)[:, None]
            src_row = Q + b64 * stride_qb + hs[:, None] * stride_qh
            dst_row = dst + hs[:, None] * d
            lat = tl.load(src_row + tl.arange(0, D_LAT)[None, :], mask=mh)
            tl.store(dst_row + tl.arange(0, D_LAT)[None, :], lat, mask=mh)
            pe = tl.load(src_row + D_LAT + tl.arange(0, D_PE)[None, :], mask=mh)
            tl.store(dst_row + D_LAT + tl.arange(0, D_PE)[None, :], pe, mask=mh)
        if SPARSE:
            for k0 in range(0, topk, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                j = tl.load(Idx + b64 * stride_ib + ks, mask=ks < topk)
                tl.store(InIdx + (slot * max_batch + b64) * max_topk + ks, j, mask=ks < topk)


_RUNTIME_INTS = [
    "slot", "layer", "chunk", "batch", "heads", "mode", "topk", "pe", "max_batch", "max_topk",
    "H", "stride_qb", "stride_qh", "stride_ib",
]  # fmt: skip


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def route_put_kernel(
    Q, Idx, InSig, InHdr, InQ, InIdx, Seq, PutArrive, slot, layer, chunk, batch, heads, mode,
    topk, pe, max_batch, max_topk, H, stride_qb, stride_qh, stride_ib, BLOCK_H: tl.constexpr,
    D_LAT: tl.constexpr, D_PE: tl.constexpr, BLOCK_K: tl.constexpr, SPARSE: tl.constexpr,
    ELT: tl.constexpr, NVSHMEM: tl.constexpr, SCOPE: tl.constexpr,
):  # fmt: skip
    """One request on slot ``slot``: rows and selection copied by every program, then the
    last to arrive takes the sequence number (the slot's last, ``InHdr[slot, H_SEQ]``, plus
    one; stored in ``Seq[slot]``), writes the header and signals (see the module docstring).
    ``PutArrive [slots]`` int32 counts the arrivals (reset by the last)."""
    slot64 = slot + tl.zeros([], tl.int64)
    _copy_rows(Q, Idx, InQ, InIdx, slot64, batch, heads, topk, max_batch, max_topk, H,
               stride_qb, stride_qh, stride_ib, BLOCK_H, D_LAT, D_PE, BLOCK_K, SPARSE)  # fmt: skip
    tl.debug_barrier()
    old = tl.atomic_add(PutArrive + slot64, 1, sem="acq_rel", scope="gpu")
    if old == tl.num_programs(0) - 1:
        tl.debug_barrier()
        hdr = InHdr + slot64 * _HW
        seq = tl.load(hdr + H_SEQ, cache_modifier=".cg") + 1  # the slot's number, not ours
        tl.store(Seq + slot64, seq)
        tl.store(hdr + H_SEQ, seq)
        tl.store(hdr + H_LAYER, layer + tl.zeros([], tl.int64))
        tl.store(hdr + H_CHUNK, chunk + tl.zeros([], tl.int64))
        tl.store(hdr + H_BATCH, batch + tl.zeros([], tl.int64))
        tl.store(hdr + H_HEADS, heads + tl.zeros([], tl.int64))
        tl.store(hdr + H_MODE, mode + tl.zeros([], tl.int64))
        tl.store(hdr + H_TOPK, topk + tl.zeros([], tl.int64))
        tl.atomic_xchg(PutArrive + slot64, 0, sem="relaxed", scope="gpu")
        tl.debug_barrier()
        if NVSHMEM:
            pe32 = pe + tl.zeros([], tl.int32)
            q_at = (InQ + slot64 * max_batch * H * (D_LAT + D_PE)).to(tl.int64)
            nq = (batch + tl.zeros([], tl.int64)) * H * (D_LAT + D_PE) * ELT
            putmem_nbi_block(q_at, q_at, nq, pe32)
            if SPARSE:
                i_at = (InIdx + slot64 * max_batch * max_topk).to(tl.int64)
                putmem_nbi_block(i_at, i_at, (batch + tl.zeros([], tl.int64)) * max_topk * 4, pe32)
            fence()
            h_at = hdr.to(tl.int64)
            set_op = tl.full([], 9, tl.int32)  # NVSHMEM_SIGNAL_SET
            putmem_signal_nbi_block(h_at, h_at, tl.zeros([], tl.int64) + _HW * 8,
                                    (InSig + slot64).to(tl.int64), seq.to(tl.uint64), set_op,
                                    pe32)  # fmt: skip
            nvshmem_quiet()
        else:
            tl.atomic_xchg(InSig + slot64, seq, sem="release", scope=SCOPE)


def route_put_launch(
    buf: RouteBuffers,
    seq: torch.Tensor,
    put_arrive: torch.Tensor,
    slot: int,
    q: torch.Tensor,
    indices: torch.Tensor | None,
    *,
    layer: int,
    chunk: int,
    mode: int,
    programs: int = 4,
    pe: int = 0,
    nvshmem_lib: str | None = None,
) -> Launch:
    """The put of ``q [B, heads, d_qk]`` (rows contiguous in their last dim) and, sparse,
    ``indices [B, topk]`` int32 (contiguous rows) as one request on ``slot`` (no checks: the
    device requester checks). ``seq [slots]`` int64 (where the number taken is recorded) and
    ``put_arrive [slots]`` int32 are the requester's; ``mode`` a ``route.words`` mode;
    ``programs`` CTAs copy the rows; ``nvshmem_lib``: NVSHMEM's device bitcode (then ``pe`` is
    the holder's PE)."""
    B, heads, d_qk = q.shape
    d_v = buf.rep_o.shape[3]
    sparse = indices is not None
    idx = indices if sparse else buf.in_idx
    topk = indices.shape[1] if sparse else 0
    kwargs = dict(
        BLOCK_H=8,
        D_LAT=d_v,
        D_PE=d_qk - d_v,
        BLOCK_K=256,
        SPARSE=sparse,
        ELT=q.element_size(),
        NVSHMEM=nvshmem_lib is not None,
        SCOPE="sys" if nvshmem_lib is not None else "gpu",
        num_warps=4,
    )
    if nvshmem_lib is not None:
        kwargs["extern_libs"] = {"libnvshmem_device": nvshmem_lib}
    args = (
        q, idx, buf.in_sig, buf.in_hdr, buf.in_q, buf.in_idx, seq, put_arrive, slot, layer,
        chunk, B, heads, mode, topk, pe, buf.max_batch, buf.max_topk, buf.heads, q.stride(0),
        q.stride(1), idx.stride(0),
    )  # fmt: skip
    backend = "nvshmem" if nvshmem_lib is not None else "local"
    return Launch(
        name=f"route_put[{dtype_name(q.dtype)},{'sparse' if sparse else 'dense'},{backend}]",
        kernel=route_put_kernel,
        grid=(max(1, min(programs, B)),),
        args=args,
        kwargs=kwargs,
    )
