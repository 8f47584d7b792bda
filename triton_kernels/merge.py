"""The online-softmax merge of partial attention results (§3.2, §3.3 of the paper).

A partial is ``(o, lse)``: ``o`` the softmax-weighted value average over one key subset and
``lse`` the **natural-log** log-sum-exp of that subset's scaled scores. Partials over disjoint
key subsets merge exactly (in real arithmetic, in any order and grouping) into the partial over
their union::

    lse = log(sum_i exp(lse_i))          o = sum_i exp(lse_i - lse) * o_i

An empty partial (no keys) is ``o = 0, lse = -inf``; ``lse = +inf`` (what FlashMLA writes for
an empty row) is read as empty too. All-empty rows give ``o = 0, lse = -inf``, never NaN.

FlashInfer's merges use base-2 LSE: convert with :func:`lse_to_base2` / :func:`lse_from_base2`.
The wire carries the equivalent statistic ``(o, m, l)`` with ``lse = m + log(l)``: convert with
:func:`lse_from_ml` / :func:`ml_from_lse`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._checks import FLOAT_DTYPES, check_same_device, check_tensor
from mqnc.triton_kernels._numerics import round_to
from mqnc.triton_kernels._runtime import bf16_rne_in_software, launch_lock, new_output

__all__ = [
    "merge_partials",
    "merge_partials_into",
    "lse_to_base2",
    "lse_from_base2",
    "lse_from_ml",
    "ml_from_lse",
    "compile_specs",
]

_LN2 = math.log(2.0)


@triton.jit
def _merge_weights(lse_ptr, stride_lse_m, M):
    """Pass over the M lse values of one row: returns (max, sum of exp(lse_i - max)).

    +inf is read as empty (-inf). If every partial is empty, returns (-inf, 0).
    """
    m = -float("inf")
    for i in range(M):
        x = tl.load(lse_ptr + i * stride_lse_m)
        x = tl.where(x == float("inf"), -float("inf"), x)
        m = tl.maximum(m, x)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    l = 0.0
    for i in range(M):
        x = tl.load(lse_ptr + i * stride_lse_m)
        x = tl.where(x == float("inf"), -float("inf"), x)
        l += tl.exp(x - m_safe)
    return m, m_safe, l


@triton.jit
def _merge_partials_kernel(
    O_in,
    LSE_in,
    O_out,
    LSE_out,
    M,
    H,
    D,
    stride_om,
    stride_ob,
    stride_oh,
    stride_od,
    stride_lm,
    stride_lb,
    stride_lh,
    stride_yb,
    stride_yh,
    stride_yd,
    stride_zb,
    stride_zh,
    BLOCK_D: tl.constexpr,
    BF16_RNE: tl.constexpr,
):
    """One program per (b, h) row: weights from the M lse values, then the weighted sum of o."""
    row = tl.program_id(0)
    b = row // H
    h = row % H
    lse_row = LSE_in + b * stride_lb + h * stride_lh
    m, m_safe, l = _merge_weights(lse_row, stride_lm, M)
    inv_l = tl.where(l > 0.0, 1.0 / l, 0.0)

    o_row = O_in + b * stride_ob + h * stride_oh
    y_row = O_out + b * stride_yb + h * stride_yh
    offs = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        mask = d0 + offs < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in range(M):
            x = tl.load(lse_row + i * stride_lm)
            x = tl.where(x == float("inf"), -float("inf"), x)
            w = tl.exp(x - m_safe) * inv_l
            if w > 0.0:  # an empty partial's o is never read (it may hold anything, even NaN)
                o = tl.load(o_row + i * stride_om + (d0 + offs) * stride_od, mask=mask, other=0.0)
                acc += w * o.to(tl.float32)
        tl.store(
            y_row + (d0 + offs) * stride_yd,
            round_to(acc, O_out.dtype.element_ty, BF16_RNE),
            mask=mask,
        )

    lse = tl.where(l == 0.0, -float("inf"), m_safe + tl.log(l))  # NaN l (a NaN lse) stays NaN
    tl.store(LSE_out + b * stride_zb + h * stride_zh, lse)


def _check_lse_values(name: str, lse: torch.Tensor) -> None:
    if torch.isnan(lse).any():
        n = int(torch.isnan(lse).sum())
        raise ValueError(f"{name}: expected no NaN log-sum-exp values, got {n} NaN entries")


def _block_d(D: int) -> int:
    return min(triton.next_power_of_2(D), 512)


def _launch(o: torch.Tensor, lse: torch.Tensor, o_out: torch.Tensor, lse_out: torch.Tensor) -> None:
    M, B, H, D = o.shape
    if B * H == 0:
        return
    with launch_lock():
        _merge_partials_kernel[(B * H,)](
            o,
            lse,
            o_out,
            lse_out,
            M,
            H,
            D,
            *o.stride(),
            *lse.stride(),
            *o_out.stride(),
            *lse_out.stride(),
            BLOCK_D=_block_d(D),
            BF16_RNE=bf16_rne_in_software(o_out.dtype),
        )


def merge_partials(
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    check_lse: bool = True,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge M partials over disjoint key subsets into the partial over their union.

    Parameters
    ----------
    o : torch.Tensor
        Partial outputs, shape ``[M, B, H, Dv]``, bf16 / fp16 / fp32, any strides. ``M >= 1``,
        any ``Dv`` (tiled by powers of two with masks).
    lse : torch.Tensor
        Natural-log log-sum-exp of each partial's scaled scores, shape ``[M, B, H]``, float32.
        ``-inf`` and ``+inf`` mark an empty partial.
    check_lse : bool
        Raise on NaN ``lse`` (one host sync); pass False on a hot path.
    out : (torch.Tensor, torch.Tensor) or None
        Write the result into these ``[B, H, Dv]`` (any float dtype: the fp32 accumulator is
        rounded once to it) and ``[B, H]`` float32 tensors instead of new ones (how split-KV
        partials are combined straight into the attention kernels' outputs).

    Returns
    -------
    o_merged : torch.Tensor
        ``[B, H, Dv]`` in ``o``'s dtype, accumulated in fp32.
    lse_merged : torch.Tensor
        ``[B, H]`` float32, natural log; ``-inf`` where every partial was empty (then o = 0).

    Examples
    --------
    >>> import torch
    >>> from mqnc.triton_kernels.merge import merge_partials
    >>> o, lse = torch.randn(3, 2, 16, 512), torch.randn(3, 2, 16)
    >>> om, lm = merge_partials(o, lse)
    >>> om.shape, lm.shape
    (torch.Size([2, 16, 512]), torch.Size([2, 16]))
    """
    check_tensor("o", o, ndim=4, dtypes=FLOAT_DTYPES)
    M, B, H, D = o.shape
    check_tensor("lse", lse, ndim=3, dtypes=(torch.float32,), shape=(M, B, H))
    if M < 1:
        raise ValueError(f"o: expected at least one partial (M >= 1), got M = {M}")
    device = check_same_device(o=o, lse=lse)
    if check_lse:
        _check_lse_values("lse", lse)
    if out is None:
        o_out = new_output((B, H, D), o.dtype, device)
        lse_out = new_output((B, H), torch.float32, device)
    else:
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"out: expected a tuple (o_out, lse_out), got {type(out).__name__}")
        o_out, lse_out = out
        check_tensor("out[0]", o_out, ndim=3, dtypes=FLOAT_DTYPES, shape=(B, H, D))
        check_tensor("out[1]", lse_out, ndim=2, dtypes=(torch.float32,), shape=(B, H))
        check_same_device(o=o, out_o=o_out, out_lse=lse_out)
    _launch(o, lse, o_out, lse_out)
    return o_out, lse_out


def merge_partials_into(
    o_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    o_new: torch.Tensor,
    lse_new: torch.Tensor,
    *,
    check_lse: bool = True,
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
    """
    check_tensor("o_acc", o_acc, ndim=3, dtypes=FLOAT_DTYPES)
    B, H, D = o_acc.shape
    check_tensor("lse_acc", lse_acc, ndim=2, dtypes=(torch.float32,), shape=(B, H))
    check_tensor("o_new", o_new, ndim=3, dtypes=(o_acc.dtype,), shape=(B, H, D))
    check_tensor("lse_new", lse_new, ndim=2, dtypes=(torch.float32,), shape=(B, H))
    check_same_device(o_acc=o_acc, lse_acc=lse_acc, o_new=o_new, lse_new=lse_new)
    if check_lse:
        _check_lse_values("lse_acc", lse_acc)
        _check_lse_values("lse_new", lse_new)
    # The pair is stacked into an M = 2 input (one copy of each, B*H*Dv elements) so that the
    # one merge kernel serves both forms; the result is written straight into the accumulator.
    _launch(torch.stack([o_acc, o_new]), torch.stack([lse_acc, lse_new]), o_acc, lse_acc)


def lse_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """Natural-log LSE to base-2 LSE (what FlashInfer's merge and MLA wrapper use)."""
    return lse / _LN2


def lse_from_base2(lse2: torch.Tensor) -> torch.Tensor:
    """Base-2 LSE (FlashInfer) to natural-log LSE (this package)."""
    return lse2 * _LN2


def lse_from_ml(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Wire statistic ``(m, l)`` (running max, softmax denominator; fp32) to natural-log LSE.

    ``l = 0`` (no keys) gives ``-inf``.
    """
    return torch.where(l > 0, m + torch.log(l), torch.full_like(m, float("-inf")))


def ml_from_lse(lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Natural-log LSE to an equivalent wire statistic ``(m, l)`` with ``m + log(l) = lse``.

    ``(lse, 1)`` for a non-empty row and ``(0, 0)`` for an empty one (``lse = +-inf``); any
    ``(m, l)`` pair with the same ``m + log(l)`` merges identically.
    """
    empty = torch.isinf(lse)
    m = torch.where(empty, torch.zeros_like(lse), lse)
    l = torch.where(empty, torch.zeros_like(lse), torch.ones_like(lse))
    return m, l


def compile_specs():
    """Kernels of this file at their production sizes, for the sm_90 compile test."""
    sig = {
        "O_in": "*bf16",
        "LSE_in": "*fp32",
        "O_out": "*bf16",
        "LSE_out": "*fp32",
        "M": "i32",
        "H": "i32",
        "D": "i32",
        **{
            k: "i32"
            for k in (
                "stride_om",
                "stride_ob",
                "stride_oh",
                "stride_od",
                "stride_lm",
                "stride_lb",
                "stride_lh",
                "stride_yb",
                "stride_yh",
                "stride_yd",
                "stride_zb",
                "stride_zh",
            )
        },
        "BLOCK_D": "constexpr",
        "BF16_RNE": "constexpr",
    }
    return [
        dict(
            name="merge_partials[bf16,D=512]",
            fn=_merge_partials_kernel,
            signature=sig,
            constexprs={"BLOCK_D": 512, "BF16_RNE": False},
            num_warps=4,
        ),
    ]
