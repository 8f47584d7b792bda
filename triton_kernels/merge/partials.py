"""The online-softmax merge of partial attention results (§3.2, §3.3 of the paper).

A partial is ``(o, lse)``: ``o`` the softmax-weighted value average over one key subset and
``lse`` the **natural-log** log-sum-exp of that subset's scaled scores. Partials over disjoint
key subsets merge exactly (in real arithmetic, in any order and grouping) into the partial over
their union::

    lse = log(sum_i exp(lse_i))          o = sum_i exp(lse_i - lse) * o_i

An empty partial (no keys) is ``o = 0, lse = -inf``; ``lse = +inf`` (what FlashMLA writes for
an empty row) is read as empty too. All-empty rows give ``o = 0, lse = -inf``, never NaN; a
NaN ``lse`` (a partial whose inputs were NaN or overflowed) is never read as empty: with
``check_lse=False`` it propagates to the row's ``o`` and ``lse`` (the default check rejects it).

FlashInfer's merges use base-2 LSE: convert with :func:`lse_to_base2` / :func:`lse_from_base2`,
or merge base-2 states as they are (``base2=True``: the kernel then uses ``exp2`` / ``log2``,
no conversion). The axis that holds the partials is named, never guessed (a 4-D shape cannot say
it): ``layout=`` is required, ``"MBHD"`` (this package's partials stacked first,
``[M, B, H, D]``) or ``"BMHD"`` (FlashInfer's ``merge_states`` input ``[T, M, H, D]``), read
in place through strides. A
``mask`` (FlashInfer's ``merge_state_in_place``) leaves the rows it excludes untouched, so a
CUDA graph captured for a padded batch can skip its padding. The wire carries the equivalent
statistic ``(o, m, l)`` with ``lse = m + log(l)``: convert with
:func:`lse_from_ml` / :func:`ml_from_lse`.

:func:`merge_partials` and :func:`merge_partials_into` are declared (signature, docstring,
fake) in ``ops``; this module is their ``"triton"`` implementation.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._core.execution import (
    bf16_rne_in_software,
    check_launchable,
    interpreted,
    new_output,
)
from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels._core.numerics import round_to
from mqnc.triton_kernels._core.op import set_plan_context
from mqnc.triton_kernels._core.validate import (
    FLOAT_DTYPES,
    check_same_device,
    check_tensor,
    dtype_name,
)
from mqnc.triton_kernels.ops import merge_partials, merge_partials_into

__all__ = [
    "merge_partials",
    "merge_partials_into",
    "lse_to_base2",
    "lse_from_base2",
    "lse_from_ml",
    "ml_from_lse",
    "merge_launch",
    "combine_pdl",
    "LAYOUTS",
]

_LN2 = math.log(2.0)
LSE_BLOCK = 256  # lse values of a row loaded at once for the max (one load for M <= 256)
_MAX_BLOCK_M = 32  # partial rows one program unrolls per step


@triton.jit
def _row_max(lse_row, stride_lm, M, LSE_BLOCK: tl.constexpr):
    """The largest of the M lse values of one row, loaded ``LSE_BLOCK`` at a time (all at
    once for M <= LSE_BLOCK); ``+inf`` is read as empty. Returns ``(m, m_safe)``: the max
    (``-inf`` when every partial is empty) and the shift the weights use (0 then)."""
    offs = tl.arange(0, LSE_BLOCK)
    m = -float("inf")
    for m0 in range(0, M, LSE_BLOCK):
        x = tl.load(lse_row + (m0 + offs) * stride_lm, mask=m0 + offs < M, other=-float("inf"))
        x = tl.where(x == float("inf"), -float("inf"), x)
        m = tl.maximum(m, tl.max(x, 0))
    return m, tl.where(m == -float("inf"), 0.0, m)


@triton.jit(do_not_specialize=["M", "H"])
def _merge_partials_kernel(
    O_in,
    LSE_in,
    O_out,
    LSE_out,
    RowMask,
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
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LSE_BLOCK: tl.constexpr,
    BF16_RNE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BASE2: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid ``(B * H, cdiv(D, BLOCK_D))``: one program per (row, ``BLOCK_D`` slice of o).

    The max over the row's M lse values comes from one vector load (:func:`_row_max`); then the
    partials are folded in order ``i = 0 .. M-1``, ``BLOCK_M`` per step, unrolled, so that the
    step's lse and o loads are independent of each other and of the running sums (the compiler
    issues them together: no round trip per partial). Each weight ``e_i = exp(lse_i - max)`` is
    formed once per program; o is read ``BLOCK_D`` wide (16 bytes per thread) only where
    ``e_i > 0`` (an empty partial's o may hold anything, NaN included); the fold's fixed order
    makes an inserted empty partial change nothing, bit for bit.

    ``HAS_MASK``: token rows ``b`` with ``RowMask[b]`` false are not written. ``BASE2``: the lse
    values are base-2 (FlashInfer's): weights ``exp2``, merged lse ``m + log2(l)``.

    ``PDL`` (launched with ``launch_pdl``, programmatic dependent launch): the program may start
    while the kernel before it on the stream (the attention that wrote the partials) still
    runs; ``gdc_wait`` first, before any load, waits until that kernel's writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    b = row // H
    h = row % H
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    if HAS_MASK:
        store_row = tl.load(RowMask + b) != 0
    else:
        store_row = True
    lse_row = LSE_in + b.to(tl.int64) * stride_lb + h * stride_lh
    o_row = O_in + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d * stride_od
    m, m_safe = _row_max(lse_row, stride_lm, M, LSE_BLOCK)

    l = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        for j in tl.static_range(BLOCK_M):
            i = m0 + j
            x = tl.load(lse_row + i * stride_lm, mask=i < M, other=-float("inf"))
            x = tl.where(x == float("inf"), -float("inf"), x)
            if BASE2:
                e = tl.exp2(x - m_safe)
            else:
                e = tl.exp(x - m_safe)
            # (tl.where, not `mask_d & (e > 0)`: the interpreter cannot `&` a scalar and a block)
            keep = tl.where(e > 0.0, mask_d, False)
            o = tl.load(o_row + i.to(tl.int64) * stride_om, mask=keep, other=0.0)
            l += e
            acc += e * o.to(tl.float32)

    # l = 0: every partial empty (o = 0, lse = -inf); a NaN l (from a NaN lse)
    # is "non-empty": it propagates as NaN, never reads as "no keys" (a bad number must
    # reach the caller, not vanish as an empty partial)
    nonempty = l != 0.0
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l, 1.0), 0.0)
    y = O_out + b.to(tl.int64) * stride_yb + h * stride_yh + offs_d * stride_yd
    if HAS_MASK:
        mask_d = tl.where(store_row, mask_d, False)
    tl.store(y, round_to(acc * inv_l, O_out.dtype.element_ty, BF16_RNE), mask=mask_d)
    if tl.program_id(1) == 0:
        if BASE2:
            log_l = tl.log2(tl.where(nonempty, l, 1.0))
        else:
            log_l = tl.log(tl.where(nonempty, l, 1.0))
        lse = tl.where(nonempty, m_safe + log_l, -float("inf"))
        tl.store(LSE_out + b.to(tl.int64) * stride_zb + h * stride_zh, lse, mask=store_row)


def _check_lse_values(name: str, lse: torch.Tensor) -> None:
    if torch.isnan(lse).any():
        n = int(torch.isnan(lse).sum())
        raise ValueError(f"{name}: expected no NaN log-sum-exp values, got {n} NaN entries")


def merge_tiles(M: int, D: int, elt: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_D, num_warps)`` for ``M`` partials of width ``D`` (``elt`` bytes) on
    ``device``.

    One warp per program, each thread reading 16 bytes of a partial row per load
    (``BLOCK_D = 32 * 16 / elt``: 256 bf16 or 128 fp32 values), fewer for a narrower ``D``;
    ``BLOCK_M`` partials unrolled per step, ``next_power_of_2(M)`` up to 32. Under the
    interpreter, whose cost is per program and per operation rather than per element, one
    program covers the whole row (``BLOCK_D = next_power_of_2(D)``): the same code, fewer
    programs.
    """
    block_m = min(triton.next_power_of_2(max(M, 1)), _MAX_BLOCK_M)
    block_d = triton.next_power_of_2(max(D, 1))
    if not interpreted(device):
        block_d = min(32 * 16 // elt, block_d)
    return block_m, block_d, 1


def merge_launch(
    o: torch.Tensor,
    lse: torch.Tensor,
    o_out: torch.Tensor,
    lse_out: torch.Tensor,
    *,
    block_d: int | None = None,
    mask: torch.Tensor | None = None,
    base2: bool = False,
    pdl: bool | None = None,
) -> Launch:
    """The merge kernel's launch for ``o [M, B, H, D]``, ``lse [M, B, H]`` (any strides) into
    ``o_out`` / ``lse_out`` (no checks: :func:`merge_partials` checks); ``block_d`` overrides
    :func:`merge_tiles`' slice width (the tests run the compiled path's tiling under the
    interpreter with it); ``mask [B]`` bool: write only the rows where it is true; ``base2``:
    base-2 lse in and out; ``pdl``: launched as a programmatic dependent launch of the kernel
    before it (None: :func:`combine_pdl`'s process-wide choice, off by default; never under the
    interpreter, which has no grid dependency control)."""
    M, B, H, D = o.shape
    block_m, default_d, num_warps = merge_tiles(M, D, o.element_size(), o.device)
    block_d = block_d or default_d
    dt = dtype_name(o.dtype)
    pdl = (_PDL[0] if pdl is None else bool(pdl)) and not interpreted(o.device)
    extra = (",mask" if mask is not None else "") + (",base2" if base2 else "")
    extra += ",pdl" if pdl else ""
    opts = dict(PDL=True, launch_pdl=True) if pdl else {}
    return Launch(
        name=f"merge[{dt}->{dtype_name(o_out.dtype)},M<={block_m},D={D},w{num_warps}{extra}]",
        kernel=_merge_partials_kernel,
        grid=(B * H, triton.cdiv(D, block_d)),
        args=(
            o,
            lse,
            o_out,
            lse_out,
            mask if mask is not None else lse_out,  # (not read without HAS_MASK)
            M,
            H,
            D,
            *o.stride(),
            *lse.stride(),
            *o_out.stride(),
            *lse_out.stride(),
        ),
        kwargs=dict(
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            LSE_BLOCK=LSE_BLOCK,
            BF16_RNE=bf16_rne_in_software(o_out.dtype, o_out.device),
            HAS_MASK=mask is not None,
            BASE2=base2,
            num_warps=num_warps,
            # Room for a whole step's loads in flight (BLOCK_M rows x 16 bytes per thread):
            # left to itself ptxas keeps fewer (3.6.0: 80 registers at M <= 32) or spills
            # (3.9.0: 8 bytes of stack at M <= 16); one-warp programs can afford 255.
            maxnreg=255,
            **opts,
        ),
    )


_PDL = [False]


@contextlib.contextmanager
def combine_pdl(enabled: bool = True):
    """Inside the ``with`` block, every merge launch planned without an explicit ``pdl`` (the
    split-KV combine of the attention plans among them) is a programmatic dependent launch
    (``launch_pdl``; the kernel waits with ``gdc_wait`` before its first load), so its launch
    overlaps the tail of the attention kernel before it. Opt-in until a GPU run shows it faster
    (perf.bench_mla under it against without); process-wide, for benchmarks; plans made inside
    keep it. The plan cache keys on it."""
    before = _PDL[0]
    _PDL[0] = bool(enabled)
    set_plan_context("combine_pdl", _PDL[0] or None)
    try:
        yield
    finally:
        _PDL[0] = before
        set_plan_context("combine_pdl", before or None)


def _launch(o, lse, o_out, lse_out, mask=None, base2=False) -> None:
    if o.shape[1] * o.shape[2] == 0:
        return
    merge_launch(o, lse, o_out, lse_out, mask=mask, base2=base2)()


LAYOUTS = ("MBHD", "BMHD")  # the axis of the partials first, or second (FlashInfer's [T, M, H, D])


def _partials_first(o: torch.Tensor, lse: torch.Tensor, layout: object):
    """``o``, ``lse`` as ``[M, B, H, D]`` / ``[M, B, H]`` views (no copy) from ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout: expected 'MBHD' (partials first, [M, B, H, D]) or 'BMHD' (FlashInfer's "
            f"[T, M, H, D]), got {layout!r}"
        )
    names = "[M, B, H, D]" if layout == "MBHD" else "[T, M, H, D]"
    check_tensor("o", o, dtypes=FLOAT_DTYPES)
    if o.dim() != 4:
        raise ValueError(
            f"o: expected 4 dims {names} (layout={layout!r}; the other layout is "
            f"{LAYOUTS[layout == 'MBHD']!r}), got shape {tuple(o.shape)}"
        )
    if o.shape[3] < 1:  # no column to merge: the lse would never be written
        raise ValueError(f"o: expected D >= 1 values per row, got shape {tuple(o.shape)}")
    check_tensor("lse", lse, ndim=3, dtypes=(torch.float32,))
    if tuple(lse.shape) != tuple(o.shape[:3]):
        raise ValueError(
            f"lse: expected shape {tuple(o.shape[:3])} ({names[:-4]}], o's without D, "
            f"layout={layout!r}), got {tuple(lse.shape)}"
        )
    if layout == "BMHD":
        return o.transpose(0, 1), lse.transpose(0, 1)
    return o, lse


def _check_mask(mask: object, B: int, device) -> torch.Tensor | None:
    if mask is None:
        return None
    check_tensor("mask", mask, ndim=1, dtypes=(torch.bool,), shape=(B,))
    if mask.device != device:
        raise ValueError(f"mask: expected device {device}, got {mask.device}")
    return mask if mask.is_contiguous() else mask.contiguous()


@merge_partials.op.implementation("triton")
def _merge(call) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_partials` on the merge kernel."""
    o, lse = _partials_first(call.o, call.lse, call.layout)
    M, B, H, D = o.shape
    if M < 1:
        raise ValueError(f"o: expected at least one partial (M >= 1), got M = {M}")
    device = check_same_device(o=o, lse=lse)
    check_launchable(o, "o")
    if call.check_lse:
        _check_lse_values("lse", lse)
    if call.out is None:
        o_out = new_output((B, H, D), o.dtype, device)
        lse_out = new_output((B, H), torch.float32, device)
    else:
        o_out, lse_out = call.out
        check_tensor("out[0]", o_out, ndim=3, dtypes=FLOAT_DTYPES, shape=(B, H, D))
        check_tensor("out[1]", lse_out, ndim=2, dtypes=(torch.float32,), shape=(B, H))
        check_same_device(o=o, out_o=o_out, out_lse=lse_out)
    _launch(o, lse, o_out, lse_out, base2=call.base2)
    return o_out, lse_out


@merge_partials_into.op.implementation("triton")
def _merge_into(call) -> None:
    """:func:`merge_partials_into` on the merge kernel."""
    o_acc, lse_acc, o_new, lse_new = call.o_acc, call.lse_acc, call.o_new, call.lse_new
    check_tensor("o_acc", o_acc, ndim=3, dtypes=FLOAT_DTYPES)
    B, H, D = o_acc.shape
    if D < 1:  # no column to merge: lse_acc would never be written
        raise ValueError(f"o_acc: expected D >= 1 values per row, got shape {(B, H, D)}")
    check_tensor("lse_acc", lse_acc, ndim=2, dtypes=(torch.float32,), shape=(B, H))
    check_tensor("o_new", o_new, ndim=3, dtypes=(o_acc.dtype,), shape=(B, H, D))
    check_tensor("lse_new", lse_new, ndim=2, dtypes=(torch.float32,), shape=(B, H))
    device = check_same_device(o_acc=o_acc, lse_acc=lse_acc, o_new=o_new, lse_new=lse_new)
    check_launchable(o_acc, "o_acc")
    mask = _check_mask(call.mask, B, device)
    if call.check_lse:
        _check_lse_values("lse_acc", lse_acc)
        _check_lse_values("lse_new", lse_new)
    # The pair is stacked into an M = 2 input (one copy of each, B*H*Dv elements) so that the
    # one merge kernel serves both forms; the result is written straight into the accumulator.
    _launch(
        torch.stack([o_acc, o_new]),
        torch.stack([lse_acc, lse_new]),
        o_acc,
        lse_acc,
        mask=mask,
        base2=call.base2,
    )


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
