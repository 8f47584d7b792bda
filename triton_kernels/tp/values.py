"""Softmax times values over a column slice, given the group's summed scores: the second half of
a tensor-parallel holder rank's attention (§8 of the paper).

After the holder group has summed its ranks' partial scores
(:mod:`mqnc.triton_kernels.tp.scores`, then one all-reduce inside the instance), every rank
holds the full scores ``s [B, H, T]`` (fp32, unscaled) of the single-rank kernel and runs the
same online softmax over them, multiplying by the value slice it keeps (its ``d_c / N`` latent
dims of each entry): its slice of ``o`` and the row's ``lse``, which are identical on every
rank (the same scores, the same kernel). The ranks' ``o`` slices side by side are the
single-rank ``o``, the weights being the same on every rank.

Kernel design: grid ``(B * ceil(H / BLOCK_H),)`` (``BLOCK_H`` as in ``tp.scores``: 16, or
64 from 64 heads on); a program streams its token's entries in
``BLOCK_T`` tiles: the scores tile is read from memory (scaled by ``softmax_scale * log2(e)``:
base 2 inside, the natural-log ``lse`` on store, as the dense and sparse kernels), the value
tile gathered by slot; running max, denominator and accumulator in fp32; the weights ``p``
rounded to the cache dtype for the PV product (as FlashMLA and this package's MLA kernels do);
``o = acc / l`` rounded once to the cache dtype. An entry whose slot is ``-1`` is never read
and weighs 0; a row with no entry writes ``o = 0, lse = -inf``; a NaN score (a NaN query)
makes the row's ``lse`` NaN, never an empty partial.

:func:`tp_partial_values` is declared (signature, docstring, fake) in ``ops``; this module is
its ``"triton"`` implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._core.execution import (
    bf16_rne_in_software,
    check_launchable,
    dot_in_fp32,
    new_output,
)
from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels._core.validate import check_same_device, check_softmax_scale, check_tensor
from mqnc.triton_kernels.mla.tile import _softmax_init, _softmax_step, _store_partial
from mqnc.triton_kernels.ops import tp_partial_values
from mqnc.triton_kernels.tp.scores import (
    _token_heads,
    check_slice_operands,
    check_slot_range,
    head_block,
)

__all__ = ["tp_partial_values", "values_launch"]

BLOCK_T = 32
LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["T", "stride_tb", "stride_sb"])
def _tp_values_kernel(
    S,
    KV,
    Slots,
    O,
    LSE,
    H,
    T,
    qk_scale,
    stride_sb,
    stride_sh,
    stride_kb,
    stride_kt,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_lb,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D_LAT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_RNE: tl.constexpr,
):
    """Grid ``(B * ceil(H / BLOCK_H),)``: one query token's ``BLOCK_H`` heads over all its
    ``T`` entries."""
    b, offs_h, mask_h = _token_heads(H, BLOCK_H)
    m, l, acc = _softmax_init(BLOCK_H, D_LAT)
    s_row = S + b.to(tl.int64) * stride_sb + offs_h[:, None] * stride_sh
    slot_row = Slots + b.to(tl.int64) * stride_tb
    offs = tl.arange(0, BLOCK_T)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + offs
        slot = tl.load(slot_row + t, mask=t < T, other=-1)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0)
        s = tl.load(s_row + t[None, :], mask=mask_h[:, None] & valid[None, :], other=0.0)
        s = tl.where(valid[None, :], s * qk_scale, -float("inf"))
        rows = KV + (slot // PAGE).to(tl.int64) * stride_kb + (slot % PAGE) * stride_kt
        v = tl.load(rows[:, None] + tl.arange(0, D_LAT)[None, :], mask=valid[:, None], other=0.0)
        if DOT_FP32:  # (interpreter, bf16: p stays fp32, as in the MLA kernels' tile)
            v = v.to(tl.float32)
        m, l, acc = _softmax_step(s, v, m, l, acc, PRECISION)
    _store_partial(
        O,
        LSE,
        b.to(tl.int64) * stride_ob,
        b.to(tl.int64) * stride_lb,
        offs_h,
        mask_h,
        stride_oh,
        1,
        m,
        l,
        acc,
        D_LAT,
        BF16_RNE,
    )


def values_launch(scores, kv_pool, slots, scale: float, d_v: int, o, lse) -> Launch:
    """The launch writing ``o [B, H, d_v]`` and ``lse [B, H]`` (inputs valid:
    :func:`tp_partial_values` checks)."""
    B, H, T = scores.shape
    dtype = kv_pool.dtype
    bh = head_block(H)
    return Launch(
        name=f"tp_values[{str(dtype)[6:]},d={d_v},{bh}x{BLOCK_T}]",
        kernel=_tp_values_kernel,
        grid=(B * triton.cdiv(H, bh),),
        args=(
            scores,
            kv_pool,
            slots,
            o,
            lse,
            H,
            T,
            scale * LOG2E,
            scores.stride(0),
            scores.stride(1),
            kv_pool.stride(0),
            kv_pool.stride(1),
            slots.stride(0),
            o.stride(0),
            o.stride(1),
            lse.stride(0),
        ),  # fmt: skip
        kwargs=dict(
            PAGE=kv_pool.shape[1],
            BLOCK_H=bh,
            BLOCK_T=BLOCK_T,
            D_LAT=d_v,
            DOT_FP32=dot_in_fp32(dtype, kv_pool.device),
            PRECISION="ieee" if dtype == torch.float32 else "tf32",
            BF16_RNE=bf16_rne_in_software(dtype, kv_pool.device),
            num_warps=8 if d_v > 256 or bh > 16 else 4,
            num_stages=2,
        ),
    )


@tp_partial_values.op.implementation("triton")
def _values(call) -> tuple[torch.Tensor, torch.Tensor]:
    scores, kv_pool, slots = call.scores, call.kv_pool, call.slots
    check_tensor("scores", scores, ndim=3, dtypes=(torch.float32,))
    B, H, T = scores.shape
    d_v, _ = check_slice_operands(kv_pool, slots, call.d_v, batch=B)
    if slots.shape[1] != T:
        raise ValueError(
            f"slots: expected one slot per score, shape ({B}, {T}), got {tuple(slots.shape)}"
        )
    scale = check_softmax_scale(call.softmax_scale)
    check_same_device(scores=scores, kv_pool=kv_pool, slots=slots)
    check_launchable(scores, "scores")
    if call.check_slots:
        check_slot_range(slots, kv_pool.shape[0] * kv_pool.shape[1])
    o = new_output((B, H, d_v), kv_pool.dtype, scores.device)
    lse = new_output((B, H), torch.float32, scores.device)
    if B * H:
        scores = scores if scores.stride(2) == 1 else scores.contiguous()
        values_launch(scores, kv_pool, slots.contiguous(), scale, d_v, o, lse)()
    return o, lse
