"""The requester's wait-then-merge of routed partials, on the device (§3.2, §3.3): the launch
waits on each holder's reply signal (bounded acquire polls: no host poll, no hang), checks
each reply's status word, and merges the replies (and optionally one local partial) into
``(o, lse)``, natural-log LSE.

Two launches. The wait (:func:`route_wait_kernel`, one CTA) polls every awaited slot's reply
signal at once (one vector of acquire loads) until each equals the slot's sequence number
(``Seq[slot]``, the one the put took), at most ``spins`` polls, then reads each reply's header:
a header that does not echo that number is not this request's reply (``ERR_SEQ``), and a reply
that did not answer every row the merge reads (its rows and heads words: ``B`` tokens of ``H``
heads need ``H <= heads`` and ``B * heads <= rows``; a probe answers none) is ``UNANSWERED``;
it writes each slot's status into ``Status [n]``. One CTA waits, not one per row: rows'
programs spinning on every SM would keep a holder's pass (on the same GPU) from the SMs it
needs to answer them. The merge (:func:`route_merge_kernel`, grid ``(B * H,)``: one program
per (token, head) row, the 512-wide latent in one block), launched after the wait, reads the
statuses and the replies. The merge is ``merge``'s fold (the max of the lse values first,
``+inf`` read as empty, then the partials in order: the replies in ``Slots`` order, the local
partial last; an empty partial's ``o`` is never read); a NaN ``lse`` (a holder's row with keys
but no finite ``lse``) makes the row NaN. The statuses are ``route.words``' (``OK``, the
holder's error code, ``ERR_SEQ``, ``UNANSWERED`` or ``TIMEOUT``). A row whose step had any
status but ``OK`` is written as NaN (``o`` and ``lse``): a failed route is never merged as if
it were empty.
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

__all__ = ["route_wait_kernel", "route_merge_kernel", "route_wait_launch", "route_merge_launch"]

_RW = tl.constexpr(REPLY_WORDS)


@triton.jit(do_not_specialize=["n", "B", "H", "spins"])
def route_wait_kernel(RepSig, RepHdr, Seq, Slots, Status, n, B, H, spins, SLOTS: tl.constexpr,
                      SCOPE: tl.constexpr):  # fmt: skip
    """Grid ``(1,)``: poll the reply signals of ``Slots [n]`` int64 (acquire, all at once)
    until each equals its ``Seq [slot]`` or ``spins`` polls; each slot's status into
    ``Status [n]`` int64: the reply's, ``ERR_SEQ`` (its header answers another number),
    ``UNANSWERED`` (it answered fewer than ``B`` tokens of ``H`` heads) or ``TIMEOUT``."""
    offs = tl.arange(0, SLOTS)
    live = offs < n
    s = tl.load(Slots + offs, mask=live, other=0)
    want = tl.load(Seq + s, mask=live, other=0)
    got = tl.where(live, tl.atomic_add(RepSig + s, 0, mask=live, sem="acquire", scope=SCOPE), 0)
    t = 0
    while (tl.sum((got != want).to(tl.int32), 0) > 0) & (t < spins):
        got = tl.where(live, tl.atomic_add(RepSig + s, 0, mask=live, sem="acquire", scope=SCOPE), 0)
        t += 1
    hdr = RepHdr + s * _RW
    st = tl.load(hdr + R_STATUS, mask=live, other=0, cache_modifier=".cg")
    rows = tl.load(hdr + R_ROWS, mask=live, other=0, cache_modifier=".cg")
    heads = tl.load(hdr + R_HEADS, mask=live, other=0, cache_modifier=".cg")
    short = (heads < H) | (rows < heads * B)
    st = tl.where((st == OK) & short, UNANSWERED, st)
    echo = tl.load(hdr + R_SEQ, mask=live, other=0, cache_modifier=".cg")
    st = tl.where(echo != want, ERR_SEQ, st)
    tl.store(Status + offs, tl.where(got == want, st, TIMEOUT), mask=live)


@triton.jit(do_not_specialize=["n", "B", "H", "HS", "max_batch"])
def route_merge_kernel(
    RepO, RepLse, Slots, OLoc, LseLoc, O, LSE, Status, n, B, H, HS, max_batch,
    D_LAT: tl.constexpr, HAS_LOCAL: tl.constexpr, BF16_RNE: tl.constexpr,
):  # fmt: skip
    """Reply slots ``RepO [slots, max_batch, HS, D_LAT]`` / ``RepLse [slots, max_batch, HS]``,
    awaited slots ``Slots [n]`` int64 and their statuses ``Status [n]`` int64 (the wait's);
    local partial ``OLoc [B, H, D_LAT]`` / ``LseLoc [B, H]`` (``HAS_LOCAL``); out
    ``O [B, H, D_LAT]``, ``LSE [B, H]`` fp32."""
    row = tl.program_id(0)
    b = row // H
    h = row - b * H
    offs_d = tl.arange(0, D_LAT)
    bad = 0
    m = -float("inf")
    for i in range(0, n):
        s = tl.load(Slots + i)
        bad += tl.where(tl.load(Status + i) != OK, 1, 0)
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


def route_wait_launch(buf: RouteBuffers, seq: torch.Tensor, slots: torch.Tensor,
                      status: torch.Tensor, B: int, H: int, *, spins: int = 1 << 24,
                      nvshmem: bool = False) -> Launch:  # fmt: skip
    """The wait for the replies on ``slots [n]`` int64 (``B`` tokens of ``H`` heads read),
    statuses into ``status [n]`` int64. ``spins``: the bound of the wait (polls). ``nvshmem``:
    the replies arrive by NVSHMEM puts (system-scope acquire)."""
    n = slots.shape[0]
    return Launch(
        name="route_wait",
        kernel=route_wait_kernel,
        grid=(1,),
        args=(buf.rep_sig, buf.rep_hdr, seq, slots, status, n, B, H, spins),
        kwargs=dict(
            SLOTS=triton.next_power_of_2(max(n, 1)), SCOPE="sys" if nvshmem else "gpu", num_warps=1
        ),  # fmt: skip
    )


def route_merge_launch(
    buf: RouteBuffers,
    slots: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    status: torch.Tensor,
    *,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Launch:
    """The merge of the replies on ``slots [n]`` int64 (their statuses in ``status [n]``, the
    wait's) into ``o [B, H, d_v]`` (the cache dtype) / ``lse [B, H]`` fp32 (contiguous), with
    ``local = (o_local [B, H, d_v], lse_local [B, H])`` merged last if given (no checks: the
    device requester checks)."""
    B, H, d_v = o.shape
    o_loc, lse_loc = local if local is not None else (o, lse)
    return Launch(
        name=f"route_merge[{dtype_name(o.dtype)},D={d_v}{',local' if local else ''}]",
        kernel=route_merge_kernel,
        grid=(B * H,),
        args=(
            buf.rep_o,
            buf.rep_lse,
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
        ),  # fmt: skip
        kwargs=dict(
            D_LAT=d_v,
            HAS_LOCAL=local is not None,
            BF16_RNE=bf16_rne_in_software(o.dtype, o.device),
            num_warps=4,
        ),
    )
