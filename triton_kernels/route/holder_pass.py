"""The holder's pass: a device-side take in front of the package's dense attention and a reply
behind it, so that every dense row routed to a holder runs through the fast kernel's schedule
with no host call per request (§3.1-§3.3, §6.3; the host-driven holder is
``mqnc.serving.Holder``, the resident kernel ``route.holder_loop``).

A pass is four launches, captured once in a CUDA graph and replayed back to back on the
holder's stream (``mqnc.serving.device_holder``), or run once (one-shot, the interpreter):

1. :func:`route_take_kernel` (one CTA) polls every slot's inbox signal at once (one vector of
   acquire loads); ``PERSISTENT``: until a request it serves has arrived, the stop word is set
   or ``max_idle`` polls found nothing (a bound, never a hang). It takes every request it has
   not seen (dense, probe, and a mode it does not serve; sparse ones too when the holder runs
   no sparse kernel, answered ``ERR_MODE``) and checks each header (``holder_loop._check``: the
   same codes). Then it **packs** the dense requests, in slot order, into the pass's query
   rows: ``G`` folded rows of ``F`` query rows each (``G x F`` rows, :func:`pass_shape`).
   Every row of a folded row asks the same (chunk, layer): a request whose (chunk, layer) is
   the previous one's continues its folded row, any other starts a new one, so the rows of
   every requester asking one chunk at one layer are one batch against it (the chunk read
   once per ``F`` rows). A request that does not fit is left for the next pass (counted in
   ``Deferred``). It writes the pass record ``Pass [slots, PASS_WORDS]`` (the request's
   number, status, rows and its first pass row) and the attention's table: a used folded row
   gets its chunk's pool blocks plus the layer's offset in the layer-flattened pool and the
   chunk's length, every other one length 0. A request with no rows (a probe, a bad header)
   is answered by the take itself (the local backend; on NVSHMEM by the reply), so a probe's
   round trip is the take's poll, not the pass. Every step is a vector over the slots: no
   loop of dependent loads lies between a request's signal and the attention.
2. :func:`route_gather_kernel` (``slots x P`` programs) copies each packed request's rows from
   its inbox slot into the pass's query rows.
3. The dense attention (``mla.decode``'s plan, whatever backend the dispatch table gives the
   device: the see-saw on an H200) over the ``G`` folded rows of ``F`` heads, into a staging
   output.
4. :func:`route_reply_kernel` (``slots x P`` programs) copies each request's rows from the
   staging output into its reply slot (the rows it asked for; nothing else of the slot is
   written), applies the host route's NaN rule (a row with keys but no finite ``lse`` is
   answered NaN, never ``-inf``), and the last program of a slot writes the reply header and
   raises the reply signal (``holder_loop._publish``; on NVSHMEM a put-with-signal).

A row's partial depends on its folded row's chunk and length, the tile and the split count,
never on the other rows it shares the folded row with: the host holder folding each request
alone (``mqnc.serving.batching.RouteBatcher``, ``fold=`` and ``num_splits=``) answers it bit
for bit. The staging output keeps the attention from writing a reply slot whose previous reply
a requester not served in this pass may still be merging. Folded rows of length 0 cost a launch
of programs that exit at once; ``G`` is the pass's capacity, sized to the work of one pass.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels.route.holder_loop import _acquire, _check, _publish, _wide
from mqnc.triton_kernels.route.words import (
    ERR_MODE,
    H_BATCH,
    H_CHUNK,
    H_HEADS,
    H_LAYER,
    H_MODE,
    H_SEQ,
    H_TOPK,
    HEADER_WORDS,
    MODE_DENSE,
    MODE_SPARSE,
    OK,
    R_DETAIL,
    R_HEADS,
    R_ROWS,
    R_SEQ,
    R_STATUS,
    REPLY_WORDS,
    RouteBuffers,
)

__all__ = [
    "PASS_WORDS",
    "FOLD",
    "pass_shape",
    "route_take_kernel",
    "route_gather_kernel",
    "route_reply_kernel",
    "route_take_launch",
    "route_gather_launch",
    "route_reply_launch",
]

_HW = tl.constexpr(HEADER_WORDS)
_RW = tl.constexpr(REPLY_WORDS)
# the pass record of a slot: [slots, PASS_WORDS] int64
PASS_WORDS = 8
P_SIG = tl.constexpr(0)  # the sequence number taken in this pass (0: none)
P_STATUS = tl.constexpr(1)
P_DETAIL = tl.constexpr(2)
P_BATCH = tl.constexpr(3)
P_HEADS = tl.constexpr(4)
SERVED_WORD = 5
P_SERVED = tl.constexpr(SERVED_WORD)  # 1: a dense request whose rows the attention computes
P_TOKENS = tl.constexpr(6)  # the chunk's c_t (keys: > 0)
OFF_WORD = 7
P_OFF = tl.constexpr(OFF_WORD)  # its first row among the pass's G x F query rows
_PW = tl.constexpr(PASS_WORDS)

FOLD = 128
"""``F``, query rows a folded row holds: the Hopper see-saw's 128-head schedule, its fastest
(docs/gluon-decode.md)."""
COPY_PROGRAMS = 16  # programs per slot of the gather and the reply copies
TABLE_COLUMNS = 128  # table columns (pages) the take writes at once
COPY_ROWS = 16  # rows a copy program moves at once


def pass_shape(heads: int, max_batch: int, slots: int, fold: int = FOLD,
               pass_rows: int | None = None) -> tuple[int, int]:  # fmt: skip
    """``(G, F)``: the pass's folded rows and their width. ``pass_rows`` (default: the larger
    of one full slot, ``max_batch x heads``, and 1,024 rows) rounded up to whole folded rows;
    never less than one full slot (a request always fits an empty pass)."""
    slot_rows = max_batch * heads
    rows = max(slot_rows, 1024) if pass_rows is None else max(pass_rows, slot_rows)
    return triton.cdiv(rows, fold), fold


@triton.jit
def _taken(InSig, InHdr, RepSig, Seen, offs, live, TAKE_SPARSE: tl.constexpr,
           SCOPE: tl.constexpr):  # fmt: skip
    """One poll of every slot: the signals (one vector of acquire loads) and which are new
    requests this pass serves (not seen, not answered; not sparse unless ``TAKE_SPARSE``)."""
    sig = tl.where(live, tl.atomic_add(InSig + offs, 0, mask=live, sem="acquire", scope=SCOPE), 0)
    seen = tl.load(Seen + offs, mask=live, other=0)
    answered = tl.load(RepSig + offs, mask=live, other=0, cache_modifier=".cg")
    new = live & (sig != seen) & (sig != answered)
    mode = tl.load(InHdr + offs * _HW + H_MODE, mask=new, other=0, cache_modifier=".cg")
    if TAKE_SPARSE:
        mine = new
    else:
        mine = new & (mode != MODE_SPARSE)
    return sig, seen, mine


@triton.jit
def _pack(served, c, layer, batch, offs, H, layers, groups, F: tl.constexpr,
          SLOTS: tl.constexpr):  # fmt: skip
    """The packing, vectors over the slots: the requests asking one (chunk, layer) contiguous,
    in slot order, that key's block of rows rounded up to whole folded rows of ``F``, the keys
    in the order of their first slot. ``(off, rows, fits)``: each request's first row, its
    rows, whether it fits the pass's ``groups`` folded rows."""
    rows = tl.where(served, batch * H, 0)
    key = tl.where(served, c * layers + layer, -1)
    before_me = offs[None, :] < offs[:, None]  # [s, t]: t before s
    same = (key[:, None] == key[None, :]) & served[:, None] & served[None, :]
    ahead = tl.sum(tl.where(same & before_me, rows[None, :], 0), axis=1)
    first_slot = tl.min(tl.where(same, offs[None, :], SLOTS), axis=1)
    total = tl.sum(tl.where(same, rows[None, :], 0), axis=1)
    block = tl.where(served & (first_slot == offs), tl.cdiv(total, F) * F, 0)
    base = tl.sum(tl.where(offs[None, :] < first_slot[:, None], block[None, :], 0), axis=1)
    off = base + ahead
    return off, rows, served & (off + rows <= groups * F)


@triton.jit
def _table(ChunkBlocks, Table, Lens, off, rows, fits, c, layer, tokens, max_blocks, num_blocks,
           groups, width, F: tl.constexpr, GROUPS: tl.constexpr,
           WIDTH: tl.constexpr):  # fmt: skip
    """The attention's table and lengths: folded row ``g`` holds rows of the requests whose
    rows reach into it (one key: they share its chunk and layer): their chunk's pool blocks
    plus the layer's offset, its length; an unused folded row length 0."""
    gs = tl.arange(0, GROUPS)
    end = off + rows
    owns = fits[None, :] & (gs[:, None] * F < end[None, :]) & ((gs[:, None] + 1) * F > off[None, :])
    used = (tl.sum(owns.to(tl.int32), axis=1) > 0) & (gs < groups)
    g_chunk = tl.max(tl.where(owns, c[None, :], 0), axis=1)
    g_layer = tl.max(tl.where(owns, layer[None, :], 0), axis=1)
    g_tokens = tl.max(tl.where(owns, tokens[None, :], 0), axis=1)
    tl.store(Lens + gs, tl.where(used, g_tokens, 0).to(tl.int32), mask=gs < groups)
    for w0 in range(0, width, WIDTH):
        ws = w0 + tl.arange(0, WIDTH)
        at = used[:, None] & (ws[None, :] < width)
        blocks = tl.load(ChunkBlocks + g_chunk[:, None] * max_blocks + ws[None, :], mask=at,
                         other=0)  # fmt: skip
        tl.store(Table + gs[:, None] * width + ws[None, :],
                 (blocks + g_layer[:, None] * num_blocks).to(tl.int32), mask=at)  # fmt: skip


_TAKE_INTS = ["n_slots", "n_chunks", "layers", "H", "max_batch", "max_rows", "max_topk",
              "max_blocks", "num_blocks", "groups", "width", "max_idle"]  # fmt: skip


@triton.jit(do_not_specialize=_TAKE_INTS)
def route_take_kernel(
    InSig, InHdr, RepSig, RepHdr, Stop, Seen, Pass, Deferred, ChunkBlocks, ChunkTokens, Table,
    Lens, n_slots, n_chunks, layers, H, max_batch, max_rows, max_topk, max_blocks, num_blocks,
    groups, width, max_idle, F: tl.constexpr, SLOTS: tl.constexpr, GROUPS: tl.constexpr,
    WIDTH: tl.constexpr, TAKE_SPARSE: tl.constexpr, ANSWER: tl.constexpr,
    PERSISTENT: tl.constexpr, SCOPE: tl.constexpr,
):  # fmt: skip
    """Grid ``(1,)``. Inbox ``InSig [n_slots]``, ``InHdr [n_slots, 8]`` int64; replies
    ``RepSig [n_slots]``, ``RepHdr [n_slots, 5]`` int64; state ``Stop [1]``, ``Seen [n_slots]``
    int64 (the last number taken per slot); out ``Pass [n_slots, PASS_WORDS]`` int64,
    ``Deferred [1]`` int64 (requests left for the next pass), ``Table [groups, width]`` /
    ``Lens [groups]`` int32 (``groups`` folded rows of ``F``); the chunk table ``ChunkBlocks
    [n_chunks, max_blocks]`` / ``ChunkTokens [n_chunks]`` int32 (-1: not hosted), the pool
    ``num_blocks`` blocks a layer. ``SLOTS``, ``GROUPS``: powers of two >= ``n_slots``,
    ``groups``; ``WIDTH`` the table columns written at once. ``ANSWER`` (the local backend): a
    taken request with no rows (a probe, an error) is answered here, at once (its header, then
    its signal, released); else by the reply.

    Every step is a vector over the slots (or ``[slots, slots]`` for the packing): no loop of
    dependent loads between a request's signal and its table."""
    offs = tl.arange(0, SLOTS)
    live = offs < n_slots
    sig, seen, mine = _taken(InSig, InHdr, RepSig, Seen, offs, live, TAKE_SPARSE, SCOPE)
    if PERSISTENT:
        idle = 0
        go = tl.where(tl.sum(mine.to(tl.int32), 0) > 0, 0, 1)
        while go != 0:
            sig, seen, mine = _taken(InSig, InHdr, RepSig, Seen, offs, live, TAKE_SPARSE, SCOPE)
            idle += 1
            stop = _acquire(Stop, SCOPE)
            found = tl.sum(mine.to(tl.int32), 0) > 0
            go = tl.where(found | (stop != 0) | (idle >= max_idle), 0, 1)
    hdr = InHdr + offs * _HW
    seq = tl.load(hdr + H_SEQ, mask=mine, other=0, cache_modifier=".cg")
    layer = tl.load(hdr + H_LAYER, mask=mine, other=0, cache_modifier=".cg")
    chunk = tl.load(hdr + H_CHUNK, mask=mine, other=0, cache_modifier=".cg")
    batch = tl.load(hdr + H_BATCH, mask=mine, other=0, cache_modifier=".cg")
    heads = tl.load(hdr + H_HEADS, mask=mine, other=0, cache_modifier=".cg")
    mode = tl.load(hdr + H_MODE, mask=mine, other=0, cache_modifier=".cg")
    topk = tl.load(hdr + H_TOPK, mask=mine, other=0, cache_modifier=".cg")
    c = tl.minimum(tl.maximum(chunk, 0), n_chunks - 1)
    tokens = tl.load(ChunkTokens + c, mask=mine, other=-1)
    status, detail = _check(seq, sig, seen, mode, layer, chunk, batch, heads, topk, tokens,
                            n_chunks, layers, H, max_batch, max_rows, max_topk)  # fmt: skip
    if TAKE_SPARSE:  # no sparse kernel runs beside the pass: a sparse request is not served
        bad = (status == OK) & (mode == MODE_SPARSE)
        status, detail = tl.where(bad, ERR_MODE, status), tl.where(bad, mode, detail)
    served = mine & (status == OK) & (mode == MODE_DENSE)
    off, rows, fits = _pack(served, c, layer, batch, offs, H, layers, groups, F, SLOTS)
    taken = mine & ~(served & ~fits)  # a request that does not fit waits for the next pass
    tl.store(Deferred, tl.sum((served & ~fits).to(tl.int64), 0))
    tl.store(Seen + offs, sig, mask=taken)
    _table(ChunkBlocks, Table, Lens, off, rows, fits, c, layer, tokens, max_blocks, num_blocks,
           groups, width, F, GROUPS, WIDTH)  # fmt: skip
    # the pass record; a request with no rows is answered here when ANSWER
    now = taken & ~fits
    if ANSWER:
        rep = RepHdr + offs * _RW
        tl.store(rep + R_SEQ, sig, mask=now)
        tl.store(rep + R_STATUS, _wide(status), mask=now)
        tl.store(rep + R_DETAIL, detail.to(tl.int64), mask=now)
        tl.store(rep + R_ROWS, tl.zeros([SLOTS], tl.int64), mask=now)
        tl.store(rep + R_HEADS, tl.zeros([SLOTS], tl.int64), mask=now)
        tl.debug_barrier()
        tl.atomic_xchg(RepSig + offs, sig, mask=now, sem="release", scope=SCOPE)
        later = fits
    else:
        later = taken
    rec = Pass + offs * _PW
    tl.store(rec + P_SIG, tl.where(later, sig, 0), mask=live)
    tl.store(rec + P_STATUS, _wide(status), mask=live)
    tl.store(rec + P_DETAIL, detail.to(tl.int64), mask=live)
    tl.store(rec + P_BATCH, batch, mask=live)
    tl.store(rec + P_HEADS, heads, mask=live)
    tl.store(rec + P_SERVED, fits.to(tl.int64), mask=live)
    tl.store(rec + P_TOKENS, tokens.to(tl.int64), mask=live)
    tl.store(rec + P_OFF, off, mask=live)


@triton.jit(do_not_specialize=["H", "max_batch"])
def route_gather_kernel(Pass, InQ, QC, H, max_batch, D_LAT: tl.constexpr, D_PE: tl.constexpr,
                        ROWS: tl.constexpr):  # fmt: skip
    """Grid ``(n_slots, P)``. Copies each packed request's ``B x H`` rows from ``InQ [n_slots,
    max_batch, H, D_LAT + D_PE]`` to the pass's query rows ``QC [G x F, D_LAT + D_PE]`` from
    its row ``Pass[s, P_OFF]``."""
    s = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    rec = Pass + _wide(s) * _PW
    if (tl.load(rec + P_SIG) != 0) & (tl.load(rec + P_SERVED) != 0):
        n = tl.load(rec + P_BATCH) * H
        off = tl.load(rec + P_OFF)
        offs_r = tl.arange(0, ROWS)
        d_lat = tl.arange(0, D_LAT)
        d_pe = tl.arange(0, D_PE)
        for r0 in range(p * ROWS, n, P * ROWS):
            r = r0 + offs_r
            ok = (r < n)[:, None]
            src = InQ + (_wide(s) * max_batch * H + r)[:, None] * (D_LAT + D_PE)
            dst = QC + (off + r)[:, None] * (D_LAT + D_PE)
            x = tl.load(src + d_lat[None, :], mask=ok, cache_modifier=".cg")
            tl.store(dst + d_lat[None, :], x, mask=ok)
            x = tl.load(src + D_LAT + d_pe[None, :], mask=ok, cache_modifier=".cg")
            tl.store(dst + D_LAT + d_pe[None, :], x, mask=ok)


@triton.jit(do_not_specialize=["H", "max_batch"])
def route_reply_kernel(
    Pass, SO, SLse, RepSig, RepHdr, RepO, RepLse, Arrive, SlotPe, H, max_batch,
    D_LAT: tl.constexpr, ROWS: tl.constexpr, ELT: tl.constexpr, NVSHMEM: tl.constexpr,
    SCOPE: tl.constexpr,
):  # fmt: skip
    """Grid ``(n_slots, P)``. ``Pass [n_slots, PASS_WORDS]`` int64 (the take's); the staging
    output ``SO [G x F, D_LAT]`` (the slots' dtype) / ``SLse [G x F]`` fp32 (the attention's
    over the pass's rows); the reply slots as ``mqnc.transport.device_route`` lays them out;
    ``Arrive [n_slots]`` int32; ``SlotPe [n_slots]`` int32 (``NVSHMEM``)."""
    s = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    rec = Pass + _wide(s) * _PW
    sig = tl.load(rec + P_SIG)
    if sig != 0:
        served = tl.load(rec + P_SERVED) != 0
        batch = tl.load(rec + P_BATCH)
        heads = tl.load(rec + P_HEADS)
        if served:
            keyed = tl.load(rec + P_TOKENS) > 0
            off = tl.load(rec + P_OFF)
            n = batch * H
            offs_r = tl.arange(0, ROWS)
            offs_d = tl.arange(0, D_LAT)
            for r0 in range(p * ROWS, n, P * ROWS):
                r = r0 + offs_r
                ok = (r < n) & ((r % H) < heads)
                at = _wide(s) * max_batch * H + r
                o = tl.load(SO + (off + r)[:, None] * D_LAT + offs_d[None, :], mask=ok[:, None])
                tl.store(RepO + at[:, None] * D_LAT + offs_d[None, :], o, mask=ok[:, None])
                x = tl.load(SLse + off + r, mask=ok, other=0.0)
                # the host route's rule (holder_loop._nan_without_finite_lse): keys, no finite lse
                bad = tl.where(keyed, (x != x) | (tl.abs(x) == float("inf")), False)
                tl.store(RepLse + at, tl.where(bad, float("nan"), x), mask=ok)
        tl.debug_barrier()
        old = tl.atomic_add(Arrive + s, 1, sem="acq_rel", scope=SCOPE)
        if old == P - 1:
            tl.debug_barrier()
            tl.atomic_xchg(Arrive + s, 0, sem="relaxed", scope=SCOPE)
            _publish(RepSig, RepHdr, RepO, RepLse, SlotPe, s, sig, tl.load(rec + P_STATUS),
                     tl.load(rec + P_DETAIL), served, batch, heads, H, max_batch, D_LAT, ELT,
                     NVSHMEM, SCOPE)  # fmt: skip


# ---- the launches -----------------------------------------------------------------------------


def route_take_launch(buf: RouteBuffers, *, stop, seen, record, deferred, chunk_blocks,
                      chunk_tokens, table, lens, layers: int, num_blocks: int, max_rows: int,
                      fold: int, take_sparse: bool, persistent: bool = False,
                      max_idle: int = 1 << 30, nvshmem: bool = False) -> Launch:  # fmt: skip
    """The take's launch (no checks: the device holder built every tensor): ``record [slots,
    PASS_WORDS]`` / ``deferred [1]`` int64, ``table [G, width]`` / ``lens [G]`` int32, ``fold``
    rows a folded row (:func:`pass_shape`)."""
    groups, width = table.shape
    args = (
        buf.in_sig, buf.in_hdr, buf.rep_sig, buf.rep_hdr, stop, seen, record, deferred,
        chunk_blocks, chunk_tokens, table, lens, buf.slots, chunk_tokens.shape[0], layers,
        buf.heads, buf.max_batch, max_rows, buf.max_topk, chunk_blocks.shape[1], num_blocks,
        groups, width, max_idle,
    )  # fmt: skip
    mode = "persistent" if persistent else "one-shot"
    return Launch(
        name=f"route_take[{mode},F={fold}{',sparse' if take_sparse else ''}]",
        kernel=route_take_kernel,
        grid=(1,),
        args=args,
        kwargs=dict(
            F=fold,
            SLOTS=triton.next_power_of_2(buf.slots),
            GROUPS=triton.next_power_of_2(groups),
            WIDTH=min(triton.next_power_of_2(width), TABLE_COLUMNS),
            TAKE_SPARSE=bool(take_sparse),
            ANSWER=not nvshmem,
            PERSISTENT=bool(persistent),
            SCOPE="sys" if nvshmem else "gpu",
            num_warps=4,
        ),
    )


def route_gather_launch(buf: RouteBuffers, *, record, q) -> Launch:
    """The gather's launch: the pass's query rows ``q [G x F, d_qk]`` (the slots' dtype)."""
    d_v = buf.rep_o.shape[3]
    return Launch(
        name="route_gather",
        kernel=route_gather_kernel,
        grid=(buf.slots, COPY_PROGRAMS),
        args=(record, buf.in_q, q, buf.heads, buf.max_batch),
        kwargs=dict(D_LAT=d_v, D_PE=buf.in_q.shape[3] - d_v, ROWS=COPY_ROWS, num_warps=4),
    )


def route_reply_launch(buf: RouteBuffers, *, record, o, lse, arrive, slot_pe,
                       nvshmem_lib: str | None = None) -> Launch:  # fmt: skip
    """The reply's launch: staging ``o [G x F, d_v]`` / ``lse [G x F]`` fp32 (the attention's
    outputs, flattened), ``arrive [slots]`` int32."""
    d_v = buf.rep_o.shape[3]
    kwargs = dict(
        D_LAT=d_v,
        ROWS=COPY_ROWS,
        ELT=buf.rep_o.element_size(),
        NVSHMEM=nvshmem_lib is not None,
        SCOPE="sys" if nvshmem_lib is not None else "gpu",
        num_warps=4,
    )
    if nvshmem_lib is not None:
        kwargs["extern_libs"] = {"libnvshmem_device": nvshmem_lib}
    backend = "nvshmem" if nvshmem_lib is not None else "local"
    return Launch(
        name=f"route_reply[{backend}]",
        kernel=route_reply_kernel,
        grid=(buf.slots, COPY_PROGRAMS),
        args=(
            record,
            o,
            lse,
            buf.rep_sig,
            buf.rep_hdr,
            buf.rep_o,
            buf.rep_lse,
            arrive,
            slot_pe,
            buf.heads,
            buf.max_batch,
        ),  # fmt: skip
        kwargs=kwargs,
    )
