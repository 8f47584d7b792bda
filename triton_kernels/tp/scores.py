"""Partial scores over a column slice of the cache: the first half of a tensor-parallel holder
rank's attention (§8 of the paper).

At tensor-parallel degree ``N`` a holder instance keeps each cache entry column-partitioned over
its ``N`` ranks: rank ``r`` holds ``d_c / N`` latent dims and ``d_r / N`` RoPE dims of every
entry (``mqnc.serving.tp_group`` fixes which), and receives only the matching slice of each
query row. A score ``<q, k>`` is a sum over all ``d_qk`` dims, so each rank computes the partial
sum over its own dims (this kernel), the group sums the ``N`` partial score tensors (one
all-reduce inside the instance), and each rank then runs the softmax and its slice of the value
product over the summed scores (:mod:`mqnc.triton_kernels.tp.values`).

Why two kernels and not one with a reduction hook: the reduction is a collective over the
holder group (gloo on a CPU, NCCL on GPUs), issued by the host between two launches; a device
hook would need a device-initiated all-reduce (NVSHMEM), which the interpreter cannot run and
Triton has no binding for. The scores cross that boundary in fp32 (``[B, H, T]``, unscaled),
so the sum over ranks is the single-rank kernel's dot product regrouped, never rounded to a
narrower type.

Which entries: ``slots [B, T]`` int32, one flat pool slot per attended entry of each query token
(``-1``: unused, never read, scored ``-inf``). One kernel serves dense attention (the slots of a
chunk's tokens in order, from its block table) and top-k selection (the selected entries'
slots): at ``d_qk / N`` wide rows (at most 576 B at N = 2) a row gather costs what the dense
kernel's block read does.

Kernel design: grid ``(B * ceil(H / BLOCK_H), ceil(T / BLOCK_T))`` (``BLOCK_H`` 16, or 64
from 64 heads on: :func:`head_block`); a program loads the ``BLOCK_H`` heads of one query
token as a latent tile ``[BLOCK_H, D_LAT]`` and a rope tile ``[BLOCK_H, D_PE]``
(``tl.arange`` needs powers of two, so the slice is split where its latent part ends), gathers
``BLOCK_T`` entries the same way and writes ``q_lat k_lat^T + q_pe k_pe^T`` in fp32 (bf16 /
fp16 operands on the tensor cores, fp32 with ``ieee`` precision; under the interpreter bf16
operands are upcast, ``_core.execution.dot_in_fp32``).

:func:`tp_partial_scores` is declared (signature, docstring, fake) in ``ops``; this module is
its ``"triton"`` implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._core.execution import check_launchable, dot_in_fp32, new_output
from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels._core.validate import check_int, check_same_device, check_tensor
from mqnc.triton_kernels.ops import tp_partial_scores

__all__ = [
    "tp_partial_scores",
    "scores_launch",
    "check_slice_operands",
    "head_block",
    "SLICE_DTYPES",
]

SLICE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_T = 32


def head_block(heads: int) -> int:
    """Heads per program: 64 from 64 heads on (one wgmma M on sm_90: DeepSeek-V3's 128 heads
    are two programs a token), else 16 (``tl.dot``'s smallest M, ``mma.sync``: V2-Lite's 16
    heads are one)."""
    return 64 if heads >= 64 else 16


@triton.jit
def _token_heads(H, BLOCK_H: tl.constexpr):
    """Program ``pid`` of a ``B * ceil(H / BLOCK_H)`` grid axis: ``(b, offs_h, mask_h)``, its
    query token ``b``, its heads ``offs_h [BLOCK_H]`` and which of them exist ``mask_h``."""
    head_blocks = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    b = pid // head_blocks
    h0 = (pid - b * head_blocks) * BLOCK_H
    offs_h = h0 + tl.arange(0, BLOCK_H)
    return b, offs_h, offs_h < H


@triton.jit(do_not_specialize=["T", "stride_tb", "stride_sb"])
def _tp_scores_kernel(
    Q,
    KV,
    Slots,
    S,
    H,
    T,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_tb,
    stride_sb,
    stride_sh,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D_LAT: tl.constexpr,
    D_PE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid ``(B * ceil(H / BLOCK_H), ceil(T / BLOCK_T))``: scores of one query token's
    ``BLOCK_H`` heads against ``BLOCK_T`` of its entries."""
    b, offs_h, mask_h = _token_heads(H, BLOCK_H)
    row = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    q_lat = tl.load(row + tl.arange(0, D_LAT)[None, :], mask=mask_h[:, None], other=0.0)
    q_pe = tl.load(row + D_LAT + tl.arange(0, D_PE)[None, :], mask=mask_h[:, None], other=0.0)

    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    slot = tl.load(Slots + b.to(tl.int64) * stride_tb + offs_t, mask=mask_t, other=-1)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    rows = KV + (slot // PAGE).to(tl.int64) * stride_kb + (slot % PAGE) * stride_kt
    k_lat = tl.load(rows[:, None] + tl.arange(0, D_LAT)[None, :], mask=valid[:, None], other=0.0)
    k_pe = tl.load(
        rows[:, None] + D_LAT + tl.arange(0, D_PE)[None, :], mask=valid[:, None], other=0.0
    )
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
        k_lat = k_lat.to(tl.float32)
        k_pe = k_pe.to(tl.float32)
    s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
    s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=PRECISION)
    s = tl.where(valid[None, :], s, -float("inf"))
    out = S + b.to(tl.int64) * stride_sb + offs_h[:, None] * stride_sh + offs_t[None, :]
    tl.store(out, s, mask=mask_h[:, None] & mask_t[None, :])


def _pow2_at_least_16(name: str, value: int, what: str) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(
            f"{name}: expected {what} to be a power of two >= 16 (the Triton kernels tile it; "
            f"the torch backend takes any width), got {value}"
        )


def check_slice_operands(
    kv_pool: object, slots: object, d_v: object, *, batch: int | None = None
) -> tuple[int, int]:
    """The checks both TP kernels make on the pool slice and the slots: ``kv_pool
    [num_blocks, block_size, width]`` (a power-of-two block size, unit stride on the last dim),
    ``slots [B, T]`` int32 (``B = batch`` when given), ``d_v`` latent dims of a ``width``-wide
    slice row with ``d_v`` and ``width - d_v`` powers of two >= 16. Returns ``(d_v, d_pe)``."""
    check_tensor("kv_pool", kv_pool, ndim=3, dtypes=SLICE_DTYPES, contiguous_last=True)
    check_tensor("slots", slots, ndim=2, dtypes=(torch.int32,), shape=(batch, None))
    check_int("d_v", d_v, minimum=1)
    page = kv_pool.shape[1]
    if page & (page - 1):
        raise ValueError(f"kv_pool: expected a power-of-two block size, got {page}")
    width = kv_pool.shape[2]
    if d_v >= width:
        raise ValueError(
            f"d_v: expected fewer latent dims than the slice's width {width} (the rest are its "
            f"RoPE dims), got {d_v}"
        )
    _pow2_at_least_16("d_v", d_v, "the slice's latent width")
    _pow2_at_least_16("kv_pool", width - d_v, "the slice's RoPE width (width - d_v)")
    return d_v, width - d_v


def check_slot_range(slots: torch.Tensor, pool_slots: int) -> None:
    """Every slot is -1 (unused) or in ``[0, pool_slots)`` (one host sync); the first that is
    not is named."""
    bad = (slots < -1) | (slots >= pool_slots)
    if bool(bad.any()):
        where = tuple(int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"slots: expected -1 (unused) or a slot in [0, {pool_slots}) of the flattened "
            f"kv_pool, got {int(slots[where])} at {list(where)}"
        )


def scores_launch(q: torch.Tensor, kv_pool: torch.Tensor, slots: torch.Tensor, d_v: int, s):
    """The launch writing ``s [B, H, T]`` fp32 (inputs valid: :func:`tp_partial_scores`
    checks)."""
    B, H, _ = q.shape
    T = slots.shape[1]
    wide = q.shape[2] > 256
    bh = head_block(H)
    return Launch(
        name=f"tp_scores[{str(q.dtype)[6:]},d={d_v}+{q.shape[2] - d_v},{bh}x{BLOCK_T}]",
        kernel=_tp_scores_kernel,
        grid=(B * triton.cdiv(H, bh), triton.cdiv(T, BLOCK_T)),
        args=(
            q,
            kv_pool,
            slots,
            s,
            H,
            T,
            q.stride(0),
            q.stride(1),
            kv_pool.stride(0),
            kv_pool.stride(1),
            slots.stride(0),
            s.stride(0),
            s.stride(1),
        ),  # fmt: skip
        kwargs=dict(
            PAGE=kv_pool.shape[1],
            BLOCK_H=bh,
            BLOCK_T=BLOCK_T,
            D_LAT=d_v,
            D_PE=q.shape[2] - d_v,
            DOT_FP32=dot_in_fp32(q.dtype, q.device),
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=8 if wide else 4,
            num_stages=2,
        ),
    )


@tp_partial_scores.op.implementation("triton")
def _scores(call) -> torch.Tensor:
    q, kv_pool, slots = call.q, call.kv_pool, call.slots
    check_tensor("q", q, ndim=3, dtypes=SLICE_DTYPES, contiguous_last=True)
    B, H, width = q.shape
    d_v, _ = check_slice_operands(kv_pool, slots, call.d_v, batch=B)
    if kv_pool.dtype != q.dtype:
        raise TypeError(f"kv_pool: expected q's dtype {q.dtype}, got {kv_pool.dtype}")
    if kv_pool.shape[2] != width:
        raise ValueError(
            f"q: expected rows as wide as kv_pool's slice ({kv_pool.shape[2]}), got {width}"
        )
    check_same_device(q=q, kv_pool=kv_pool, slots=slots)
    check_launchable(q, "q")
    if call.check_slots:
        check_slot_range(slots, kv_pool.shape[0] * kv_pool.shape[1])
    s = new_output((B, H, slots.shape[1]), torch.float32, q.device)
    if B * H and slots.shape[1]:
        scores_launch(q, kv_pool, slots.contiguous(), d_v, s)()
    return s
