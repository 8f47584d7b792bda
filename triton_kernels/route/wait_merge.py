"""The requester's wait-then-merge of routed partials, on the device (§3.2, §3.3): the launch
waits on each holder's reply signal (bounded acquire polls: no host poll, no hang), checks
each reply's status word, and merges the replies (and optionally one local partial) into
``(o, lse)``, natural-log LSE.

Grid ``(B * H,)``: one program per (token, head) row, the 512-wide latent in one block. Each
program waits for every awaited slot's reply signal to equal the slot's sequence number
(``Seq[slot]``, the one the put took), at most ``spins`` polls each, then reads the reply's
header: a header that does not echo that number is not this request's reply (``ERR_SEQ``), and
a reply that did not answer every row the merge reads (its rows and heads words: ``B`` tokens
of ``H`` heads need ``H <= heads`` and ``B * heads <= rows``; a probe answers none) is
``UNANSWERED``. Every program computes the same statuses (they depend on the slot, not the
row). The merge is ``merge``'s fold (the max of the lse values first, ``+inf`` read as empty,
then the partials in order: the replies in ``Slots`` order, the local partial last; an empty
partial's ``o`` is never read); a NaN ``lse`` (a holder's row with keys but no finite ``lse``)
makes the row NaN. Program 0 writes each slot's status (``route.words``: ``OK``, the holder's
error code, ``ERR_SEQ``, ``UNANSWERED`` or ``TIMEOUT``) into ``Status [n]``. A row whose step
had any status but ``OK`` is written as NaN (``o`` and ``lse``): a failed route is never merged
as if it were empty.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._core.execution import bf16_rne_in_software
from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels._core.numerics import round_to
from mqnc.triton_kernels._core.validate import dtype_name
from mqnc.triton_kernels.route.words import (
    ERR_SEQ,
    OK,
    R_HEADS,
    R_ROWS,
    R_SEQ,
    R_STATUS,
    REPLY_WORDS,
    TIMEOUT,
    UNANSWERED,
    RouteBuffers,
)

__all__ = ["route_merge_kernel", "route_merge_launch"]

_RW = tl.constexpr(REPLY_WORDS)


@triton.jit
def _wait_status(RepSig, RepHdr, want, s, spins, B, H, SCOPE: tl.constexpr):
    """Poll slot ``s``'s reply signal (acquire) until it equals ``want`` or ``spins`` polls;
    the reply's status, ``ERR_SEQ`` (its header answers another number), ``UNANSWERED`` (it
    answered fewer than ``B`` tokens of ``H`` heads) or ``TIMEOUT``."""
    got = tl.atomic_add(RepSig + s, 0, sem="acquire", scope=SCOPE)
    t = 0
    while (got != want) & (t < spins):
        got = tl.atomic_add(RepSig + s, 0, sem="acquire", scope=SCOPE)
        t += 1
    hdr = RepHdr + s * _RW
    st = tl.load(hdr + R_STATUS, cache_modifier=".cg")
    rows = tl.load(hdr + R_ROWS, cache_modifier=".cg")
    heads = tl.load(hdr + R_HEADS, cache_modifier=".cg")
    short = (heads < H) | (rows < heads * B)
    st = tl.where((st == OK) & short, UNANSWERED, st)
    st = tl.where(tl.load(hdr + R_SEQ, cache_modifier=".cg") != want, ERR_SEQ, st)
    return tl.where(got == want, st, TIMEOUT)


@triton.jit(do_not_specialize=["n", "B", "H", "HS", "max_batch", "spins"])
def route_merge_kernel(
    RepSig, RepHdr, RepO, RepLse, Seq, Slots, OLoc, LseLoc, O, LSE, Status, n, B, H, HS,
    max_batch, spins, D_LAT: tl.constexpr, HAS_LOCAL: tl.constexpr, BF16_RNE: tl.constexpr,
    SCOPE: tl.constexpr,
):  # fmt: skip
    """Reply slots ``RepO [slots, max_batch, HS, D_LAT]`` / ``RepLse [slots, max_batch, HS]``,
    awaited slots ``Slots [n]`` int64, sequence numbers ``Seq [slots]`` int64; local partial
    ``OLoc [B, H, D_LAT]`` / ``LseLoc [B, H]`` (``HAS_LOCAL``); out ``O [B, H, D_LAT]``,
    ``LSE [B, H]`` fp32, ``Status [n]`` int64."""
    row = tl.program_id(0)
    b = row // H
    h = row - b * H
    offs_d = tl.arange(0, D_LAT)
    bad = 0
    m = -float("inf")
    for i in range(0, n):
        s = tl.load(Slots + i)
        st = _wait_status(RepSig, RepHdr, tl.load(Seq + s), s, spins, B, H, SCOPE)
        if row == 0:
            tl.store(Status + i, st)
        bad += tl.where(st != OK, 1, 0)
        x = tl.load(RepLse + (s * max_batch + b) * HS + h, cache_modifier=".cg")
        x = tl.where(x == float("inf"), -float("inf"), x)
        m = tl.maximum(m, x)
    if HAS_LOCAL:
        x = tl.load(LseLoc + row)
        m = tl.maximum(m, tl.where(x == float("inf"), -float("inf"), x))
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    l = 0.0
    acc = tl.zeros([D_LAT], dtype=tl.float32)
    for i in range(0, n):
        s = tl.load(Slots + i)
        at = (s * max_batch + b) * HS + h
        x = tl.load(RepLse + at, cache_modifier=".cg")
        e = tl.exp(tl.where(x == float("inf"), -float("inf"), x) - m_safe)
        keep = tl.where(e > 0.0, offs_d < D_LAT, False)
        o = tl.load(RepO + at * D_LAT + offs_d, mask=keep, other=0.0, cache_modifier=".cg")
        l += e
        acc += e * o.to(tl.float32)
    if HAS_LOCAL:
        x = tl.load(LseLoc + row)
        e = tl.exp(tl.where(x == float("inf"), -float("inf"), x) - m_safe)
        keep = tl.where(e > 0.0, offs_d < D_LAT, False)
        o = tl.load(OLoc + row.to(tl.int64) * D_LAT + offs_d, mask=keep, other=0.0)
        l += e
        acc += e * o.to(tl.float32)
    nonempty = l != 0.0
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l, 1.0), 0.0)
    out = tl.where(bad == 0, acc * inv_l, float("nan"))
    tl.store(O + row.to(tl.int64) * D_LAT + offs_d, round_to(out, O.dtype.element_ty, BF16_RNE))
    lse = tl.where(nonempty, m_safe + tl.log(tl.where(nonempty, l, 1.0)), -float("inf"))
    tl.store(LSE + row, tl.where(bad == 0, lse, float("nan")))


def route_merge_launch(
    buf: RouteBuffers,
    seq: torch.Tensor,
    slots: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    status: torch.Tensor,
    *,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
    spins: int = 1 << 24,
    nvshmem: bool = False,
) -> Launch:
    """The wait-then-merge of the replies on ``slots [n]`` int64 into ``o [B, H, d_v]`` (the
    cache dtype) / ``lse [B, H]`` fp32 (contiguous), statuses into ``status [n]`` int64, with
    ``local = (o_local [B, H, d_v], lse_local [B, H])`` merged last if given (no checks: the
    device requester checks). ``spins``: the bound of each wait (polls). ``nvshmem``: the
    replies arrive by NVSHMEM puts (system-scope acquire)."""
    B, H, d_v = o.shape
    o_loc, lse_loc = local if local is not None else (o, lse)
    return Launch(
        name=f"route_merge[{dtype_name(o.dtype)},D={d_v}{',local' if local else ''}]",
        kernel=route_merge_kernel,
        grid=(B * H,),
        args=(
            buf.rep_sig,
            buf.rep_hdr,
            buf.rep_o,
            buf.rep_lse,
            seq,
            slots,
            o_loc,
            lse_loc,
            o,
            lse,
            status,
            slots.shape[0],
            B,
            H,
            buf.heads,
            buf.max_batch,
            spins,
        ),  # fmt: skip
        kwargs=dict(
            D_LAT=d_v,
            HAS_LOCAL=local is not None,
            BF16_RNE=bf16_rne_in_software(o.dtype, o.device),
            SCOPE="sys" if nvshmem else "gpu",
            num_warps=4,
        ),
    )
