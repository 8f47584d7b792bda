"""Dense paged partial absorbed-MLA attention: the holder's compute for a routed query batch
(§3.3, §6.3 of the paper).

A holder receives absorbed query rows ``q [B, H, 576]`` and attends them over the cache it
holds, a paged pool of 576-wide entries (512 latent ``c_KV`` + 64 rotated ``k_pe``) shared by
all heads, returning the partial ``(o [B, H, 512], lse [B, H])`` the requester merges.

Kernel design (decisions written down here, where the goals left them open):

- **Heads packed**: one program handles ``BLOCK_H`` heads of one query token (16 for H <= 16,
  32 for 17..32, and above 32 heads FlashMLA's 64 under triton 3.6, where it compiles to HGMMA
  without spilling, else 32; see ``mla.plan.tile_config``) and streams that token's cache
  tiles once for all of them; the value is the first ``d_v`` dims of
  the same tile (no second read of the latent).
- **Grid order**: ``(B * ceil(H / BLOCK_H), S)``, a token's head blocks adjacent on axis 0, so
  the head blocks of one token (and split) run side by side and read each tile once from DRAM,
  then from L2; the rows are on axis 0 (up to 2**31 - 1 programs), not on axis 2, whose 65,535
  would refuse a launch of more query rows (a long sparse prefill, ``B * s_q`` rows).
- **Paged, pipelined**: the ``BLOCK_N`` (64 at 16 heads, else 32) entries of a tile are looked
  up in the page table (any power-of-two page size, 1 for SGLang's token pools, smaller or
  larger than the tile); with 5 pipeline stages Triton double-buffers the KV tile behind that
  indirection (the next tile's page ids and entries are in flight while this one is attended: TTGIR
  ``2x64x512xbf16`` buffers, ``async_wait {num = 4}``, checked by ``test_compile_sm90``); the
  64-head tile runs 3 stages, measured faster (its MMAs, not its loads, bound it).
- **Split-KV**: with ``num_splits = S > 1`` each row's tiles are divided into S contiguous
  ranges of at least 64 entries; each split writes an fp32 partial into a workspace
  ``[S, B, H, d_v]`` and the S partials are combined by the package's merge kernel
  (``mqnc.triton_kernels.merge.partials``: one implementation of the merge math).
  ``num_splits=None`` lets the split / grid policy choose (``_core.grid.choose_num_splits``:
  whole waves of the CTAs that the compiled kernel fits per SM, 132 SMs assumed without a
  GPU), from the block table's capacity, never ``cache_seqlens`` (no host sync).
- Lengths per row may differ, including 0 (``o = 0, lse = -inf``).
- **Layouts, read in place** (constexpr switches; the production variant has none of them and
  compiles as before): a padded ``[B, max_blocks]`` block table or FlashInfer's CSR page table
  (``kv_indptr [B + 1]``, ``kv_indices [nnz]``: ``CSR``); one fused ``[.., 576]`` cache or
  FlashInfer's ``ckv [.., 512]`` + ``kpe [.., 64]`` (``SPLIT``: two base pointers and their
  strides, no copy); ``s_q`` query tokens per sequence sharing its pages and length (FlashMLA's
  MTP / speculative decoding: ``MULTI_Q``), optionally causal (``CAUSAL``, FlashMLA's rule:
  query token ``i`` of ``s_q`` attends the first ``len - s_q + i + 1`` entries, the new tokens
  being the last ``s_q`` entries of the cache).

- **Candidates** (``mla.plan.SWEEP_TILES``, reached through ``forced_tile``; no default):
  :func:`_mla_decode_pipe_kernel`, the restructured loop (``-pipe``: full tiles unmasked in a
  ``tl.range``-pipelined loop, the tail masked once; ``-tma``: TMA page boxes from device-side
  descriptors; ``-fused``: the split combine fused, the last split of a row merging), see
  docs/kernel-schedule.md.

:func:`mla_decode_partial` and :func:`mla_decode_partial_csr` are declared (signature,
docstring, fake) in ``ops``; this module plans them (:func:`plan_mla_decode`,
:func:`plan_mla_decode_csr`: the same signatures without ``out``) and launches them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._core.execution import (
    bf16_rne_in_software,
    check_launchable,
    dot_in_fp32,
    interpreted,
)
from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels._core.validate import (
    check_int,
    check_num_splits,
    check_same_device,
    check_softmax_scale,
    check_tensor,
)
from mqnc.triton_kernels.dispatch import Case, Choice, Target, choose
from mqnc.triton_kernels.fp8.cache import (
    as_bytes,
    check_fp8_entries,
    dense_slots,
    fp8_rope_view,
    is_fp8_pool,
)
from mqnc.triton_kernels.mla.gluon_plan import fp8_rows, plan_fp8_seesaw, plan_seesaw, tma_rows
from mqnc.triton_kernels.mla.plan import (
    AttentionPlan,
    MlaOperands,
    MlaPlan,
    TileConfig,
    check_block_size,
    dot_precision,
    fp8_entry_bytes,
    fp8_flags,
    meta_output,
    mla_operands,
    plan_mla,
    split_strides,
    tile_config,
    variant_name,
)
from mqnc.triton_kernels.mla.tile import (
    LOG2E,
    _attend_loaded,
    _attend_rows,
    _load_full_tile,
    _load_full_tile_fp8,
    _load_query,
    _merge_if_last,
    _page_descriptors,
    _softmax_init,
    _split_range,
    _store_partial,
)
from mqnc.triton_kernels.ops import mla_decode_partial, mla_decode_partial_csr

__all__ = [
    "mla_decode_partial",
    "mla_decode_partial_csr",
    "plan_mla_decode",
    "plan_mla_decode_csr",
    "plan_decode",
    "decode_launch",
    "PagedLayout",
    "checked_plan",
]

PRODUCTION_PAGE = 64  # the goal shapes' page (FlashMLA's); other pages name their variant


@triton.jit
def _program_keys(
    SeqLens,
    H,
    NUM_SPLITS,
    SEQ_Q,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MULTI_Q: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """This program's query row ``b``, first head ``h0``, ``split``, sequence ``seq`` and the
    key range ``[t_start, t_end)`` it attends (its split of the row's causal length)."""
    head_blocks = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    b = pid // head_blocks
    h0 = (pid - b * head_blocks) * BLOCK_H
    split = tl.program_id(1)
    if MULTI_Q:
        seq = b // SEQ_Q
    else:
        seq = b
    seqlen = tl.load(SeqLens + seq)
    if CAUSAL:
        seqlen = tl.maximum(seqlen - (SEQ_Q - 1 - (b - seq * SEQ_Q)), 0)
    t_start, t_end = _split_range(seqlen, NUM_SPLITS, split, BLOCK_N, MIN_TILES)
    return b, h0, split, seq, t_start, t_end


# Runtime ints that vary from call to call are not specialised (an int equal to 1 would become
# a constexpr, one divisible by 16 get an alignment hint: each a separate compile at run time);
# the block table's row stride is its width, which follows the longest context of the batch.
@triton.jit(do_not_specialize=["NUM_SPLITS", "SEQ_Q", "stride_tb"])
def _mla_decode_kernel(
    Q,
    Q_PE,
    KV,
    KV_PE,
    BlockTable,
    Indptr,
    SeqLens,
    O,
    LSE,
    H,
    NUM_SPLITS,
    SEQ_Q,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_pqb,
    stride_pqh,
    stride_kb,
    stride_kt,
    stride_pkb,
    stride_pkt,
    stride_tb,
    stride_tj,
    stride_os,
    stride_ob,
    stride_oh,
    stride_ls,
    stride_lb,
    stride_lh,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    D_LAT: tl.constexpr,
    D_PE: tl.constexpr,
    SPLIT: tl.constexpr,
    CSR: tl.constexpr,
    MULTI_Q: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_RNE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_RNE: tl.constexpr,
):
    """Grid ``(B * SEQ_Q * ceil(H / BLOCK_H), NUM_SPLITS)``: one program per (query row, head
    block) and split, a row's head blocks adjacent on axis 0 (axis 0 holds 2**31 - 1 programs;
    rows on axis 2 stopped at 65,535); query row ``b`` belongs to sequence ``b // SEQ_Q`` (its
    pages and length). ``FP8``: ``KV`` holds FP8 entries (uint8; ``mla.tile._load_fp8_tile``),
    dequantized to ``Q``'s dtype (``FP8_RNE``: bf16 rounded in software, the interpreter)."""
    b, h0, split, seq, t_start, t_end = _program_keys(
        SeqLens, H, NUM_SPLITS, SEQ_Q, BLOCK_H, BLOCK_N, MIN_TILES, MULTI_Q, CAUSAL
    )
    q_lat, q_pe, offs_h, mask_h = _load_query(
        Q, Q_PE, b, h0, H, stride_qb, stride_qh, stride_pqb, stride_pqh, BLOCK_H, D_LAT, D_PE,
        SPLIT, DOT_FP32,
    )  # fmt: skip
    m, l, acc = _softmax_init(BLOCK_H, D_LAT)

    table_row = _table_row(BlockTable, Indptr, seq, stride_tb, stride_tj, CSR)
    offs_n = tl.arange(0, BLOCK_N)
    for t0 in range(t_start, t_end, BLOCK_N):
        m, l, acc = _masked_tile(
            q_lat, q_pe, KV, KV_PE, table_row, t0, t_end, offs_n, m, l, acc, qk_scale, stride_tj,
            stride_kb, stride_kt, stride_pkb, stride_pkt, PAGE, D_LAT, D_PE, SPLIT, DOT_FP32,
            PRECISION, FP8, Q.dtype.element_ty, FP8_RNE,
        )  # fmt: skip

    o_base = split.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob
    lse_base = split.to(tl.int64) * stride_ls + b.to(tl.int64) * stride_lb
    _store_partial(
        O, LSE, o_base, lse_base, offs_h, mask_h, stride_oh, stride_lh, m, l, acc, D_LAT, BF16_RNE
    )


@triton.jit
def _table_row(BlockTable, Indptr, seq, stride_tb, stride_tj, CSR: tl.constexpr):
    """Pointer to sequence ``seq``'s first page id: row ``seq`` of the ``[B, max_pages]``
    block table, or (``CSR``) the flat page list from ``Indptr[seq]``."""
    if CSR:
        return BlockTable + tl.load(Indptr + seq).to(tl.int64) * stride_tj
    else:
        return BlockTable + seq.to(tl.int64) * stride_tb


@triton.jit
def _masked_tile(
    q_lat, q_pe, KV, KV_PE, table_row, t0, t_end, offs_n, m, l, acc, qk_scale, stride_tj,
    stride_kb, stride_kt, stride_pkb, stride_pkt, PAGE: tl.constexpr, D_LAT: tl.constexpr,
    D_PE: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    FP8: tl.constexpr, DT: tl.constexpr, FP8_RNE: tl.constexpr,
):  # fmt: skip
    """One masked tile: entries ``t0 .. min(t0 + BLOCK_N, t_end)`` (``offs_n`` is
    ``arange(BLOCK_N)``) through the sequence's page-table row ``table_row``. The classic
    kernel attends every tile so; the restructured loop only its last, partial one. ``FP8``:
    the entries are FP8 (uint8 ``KV``), dequantized to ``DT``."""
    t = t0 + offs_n
    valid = t < t_end
    page = tl.load(table_row + (t // PAGE) * stride_tj, mask=valid, other=0)
    kv_rows = KV + page.to(tl.int64) * stride_kb + (t % PAGE) * stride_kt
    if SPLIT:
        pe_rows = KV_PE + page.to(tl.int64) * stride_pkb + (t % PAGE) * stride_pkt
    else:
        pe_rows = kv_rows  # (not read: the rope part follows the latent)
    return _attend_rows(
        q_lat, q_pe, kv_rows, pe_rows, valid, m, l, acc, qk_scale, D_LAT, D_PE, SPLIT,
        DOT_FP32, PRECISION, FP8, DT, FP8_RNE,
    )  # fmt: skip


@triton.jit(do_not_specialize=["NUM_SPLITS", "SEQ_Q", "stride_tb", "n_blocks"])
def _mla_decode_pipe_kernel(
    Q, Q_PE, KV, KV_PE, BlockTable, Indptr, SeqLens, O, LSE, H, NUM_SPLITS, SEQ_Q, qk_scale,
    stride_qb, stride_qh, stride_pqb, stride_pqh, stride_kb, stride_kt, stride_pkb, stride_pkt,
    stride_tb, stride_tj, stride_os, stride_ob, stride_oh, stride_ls, stride_lb, stride_lh,
    n_blocks, WO, WLSE, Tickets, stride_ws, stride_wb, stride_wh, stride_wls, stride_wlb,
    stride_wlh,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
    D_LAT: tl.constexpr, D_PE: tl.constexpr, SPLIT: tl.constexpr, CSR: tl.constexpr,
    MULTI_Q: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BF16_RNE: tl.constexpr, TMA: tl.constexpr, RING: tl.constexpr, FUSED: tl.constexpr,
    FP8: tl.constexpr, FP8_RNE: tl.constexpr,
):  # fmt: skip
    """The restructured dense kernel (the ``pipe`` and ``tma`` candidates; grid, arguments and
    outputs as :func:`_mla_decode_kernel`'s, plus ``n_blocks``, the pool's pages, which the
    TMA descriptors bound): the split's FULL tiles in a software-pipelined loop
    (``tl.range(num_stages=RING)``) without per-entry masks, each tile's page-id load then its
    two KV loads issued together (one page id per tile when ``PAGE >= BLOCK_N``; ``TMA``: two
    tensor-descriptor boxes of that page), and the last, partial tile masked once after it.

    ``FUSED`` (``NUM_SPLITS > 1``; ``O`` / ``LSE`` are then the final ``[R, H, ..]`` outputs):
    each split stores its fp32 partial into the plan's workspace ``WO [S, R, H, D_LAT]`` /
    ``WLSE [S, R, H]`` and the split that draws a row's last ticket (``Tickets``, one int32 per
    program of axis 0) merges them (``mla.tile._merge_if_last``): one launch, no combine
    kernel. Otherwise ``WO``, ``WLSE``, ``Tickets`` are None and not read. ``FP8`` (not with
    ``TMA``): FP8 entries, as in :func:`_mla_decode_kernel`."""
    b, h0, split, seq, t_start, t_end = _program_keys(
        SeqLens, H, NUM_SPLITS, SEQ_Q, BLOCK_H, BLOCK_N, MIN_TILES, MULTI_Q, CAUSAL
    )
    q_lat, q_pe, offs_h, mask_h = _load_query(
        Q, Q_PE, b, h0, H, stride_qb, stride_qh, stride_pqb, stride_pqh, BLOCK_H, D_LAT, D_PE,
        SPLIT, DOT_FP32,
    )  # fmt: skip
    m, l, acc = _softmax_init(BLOCK_H, D_LAT)
    table_row = _table_row(BlockTable, Indptr, seq, stride_tb, stride_tj, CSR)
    if TMA:
        lat_desc, pe_desc = _page_descriptors(
            KV, KV_PE, n_blocks, stride_kb, stride_kt, stride_pkb, stride_pkt, PAGE, BLOCK_N,
            D_LAT, D_PE, SPLIT,
        )  # fmt: skip
    else:
        lat_desc, pe_desc = KV, KV_PE  # (not read)
    offs_n = tl.arange(0, BLOCK_N)
    n_full = (t_end - t_start) // BLOCK_N
    for i in tl.range(0, n_full, num_stages=RING):
        if FP8:
            kv_lat, kv_pe = _load_full_tile_fp8(
                KV, KV_PE, table_row, t_start + i * BLOCK_N, offs_n, stride_tj, stride_kb,
                stride_kt, stride_pkb, stride_pkt, PAGE, BLOCK_N, D_LAT, D_PE, SPLIT,
                Q.dtype.element_ty, FP8_RNE,
            )  # fmt: skip
        else:
            kv_lat, kv_pe = _load_full_tile(
                KV, KV_PE, lat_desc, pe_desc, table_row, t_start + i * BLOCK_N, offs_n,
                stride_tj, stride_kb, stride_kt, stride_pkb, stride_pkt, PAGE, BLOCK_N, D_LAT,
                D_PE, SPLIT, TMA,
            )  # fmt: skip
        m, l, acc = _attend_loaded(q_lat, q_pe, kv_lat, kv_pe, m, l, acc, qk_scale, DOT_FP32,
                                   PRECISION)  # fmt: skip
    t_tail = t_start + n_full * BLOCK_N
    if t_tail < t_end:
        m, l, acc = _masked_tile(
            q_lat, q_pe, KV, KV_PE, table_row, t_tail, t_end, offs_n, m, l, acc, qk_scale,
            stride_tj, stride_kb, stride_kt, stride_pkb, stride_pkt, PAGE, D_LAT, D_PE, SPLIT,
            DOT_FP32, PRECISION, FP8, Q.dtype.element_ty, FP8_RNE,
        )  # fmt: skip
    o_base = split.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob
    lse_base = split.to(tl.int64) * stride_ls + b.to(tl.int64) * stride_lb
    if FUSED:
        w_row = b.to(tl.int64) * stride_wb
        wl_row = b.to(tl.int64) * stride_wlb
        s64 = split.to(tl.int64)
        _store_partial(
            WO, WLSE, s64 * stride_ws + w_row, s64 * stride_wls + wl_row, offs_h, mask_h,
            stride_wh, stride_wlh, m, l, acc, D_LAT, False,
        )  # fmt: skip
        _merge_if_last(
            WO + w_row, WLSE + wl_row, Tickets, O, LSE, tl.program_id(0), o_base, lse_base,
            offs_h, mask_h, NUM_SPLITS, stride_ws, stride_wh, stride_wls, stride_wlh, stride_oh,
            stride_lh, D_LAT, BF16_RNE,
        )  # fmt: skip
    else:
        _store_partial(
            O, LSE, o_base, lse_base, offs_h, mask_h, stride_oh, stride_lh, m, l, acc, D_LAT,
            BF16_RNE,
        )  # fmt: skip


class PagedLayout:
    """How the dense kernel finds a query row's cache entries (the host side of its layout
    switches): ``csr`` page table, ``s_q`` query tokens per sequence, ``causal``."""

    __slots__ = ("csr", "s_q", "causal")

    def __init__(self, *, csr: bool = False, s_q: int = 1, causal: bool = False) -> None:
        self.csr = csr
        self.s_q = s_q
        self.causal = causal and s_q > 1  # one query token: causal changes nothing


@triton.jit(do_not_specialize=["stride_tb", "stride_tj", "cap", "num_blocks", "block_size"])
def _paging_check_kernel(
    Table, Lens, Flag, stride_tb, stride_tj, cap, num_blocks, block_size, BLOCK: tl.constexpr
):
    """Row ``b``: its length in ``[0, cap]`` and every page it uses (its first
    ``ceil(len / block_size)`` table entries) in ``[0, num_blocks)``; ``Flag`` set to 1 if not
    (every program that finds a fault writes the same 1)."""
    b = tl.program_id(0)
    n = tl.load(Lens + b)
    bad = (n < 0) | (n > cap)
    used = tl.cdiv(tl.minimum(tl.maximum(n, 0), cap), block_size)
    row = Table + b.to(tl.int64) * stride_tb
    for j0 in range(0, used, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        page = tl.load(row + j * stride_tj, mask=j < used, other=0)
        bad = bad | (tl.max(((page < 0) | (page >= num_blocks)).to(tl.int32), 0) > 0)
    if bad:
        tl.store(Flag, 1)


def _check_paging(
    block_table: torch.Tensor, cache_seqlens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Host-side range checks: lengths fit the table, used pages exist. Compiled: one small
    kernel over the rows and one host sync on its flag (:func:`paging_fault_flag`); only a
    fault runs the torch checks, which name the first faulty row and entry. Interpreted: the
    torch checks alone (the interpreter runs a kernel far slower than torch's few ops)."""
    S = cache_seqlens.shape[0]
    if S == 0:
        return
    if interpreted(block_table.device):
        _describe_paging_fault(block_table, cache_seqlens, num_blocks, block_size)
        return
    paging_fault_flag(block_table, cache_seqlens, num_blocks, block_size)


def paging_fault_flag(
    block_table: torch.Tensor, cache_seqlens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """:func:`_check_paging` on the device: the check kernel, one sync on its flag, the torch
    checks (naming the fault) only when it is set."""
    S = cache_seqlens.shape[0]
    flag = torch.zeros(1, dtype=torch.int32, device=cache_seqlens.device)
    Launch(
        name="paging_check",
        kernel=_paging_check_kernel,
        grid=(S,),
        args=(
            block_table,
            cache_seqlens,
            flag,
            *block_table.stride(),
            block_table.shape[1] * block_size,
            num_blocks,
            block_size,
        ),
        kwargs=dict(BLOCK=64, num_warps=1),
    )()
    if flag.item():
        _describe_paging_fault(block_table, cache_seqlens, num_blocks, block_size)
        raise RuntimeError("the paging check kernel found a fault the torch check did not")


def _describe_paging_fault(
    block_table: torch.Tensor, cache_seqlens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """The torch form of :func:`_check_paging`: a ``ValueError`` naming the first faulty row
    (a length past the table's capacity) or entry (a page id out of the pool)."""
    cap = block_table.shape[1] * block_size
    lens = cache_seqlens.long()
    bad = (lens < 0) | (lens > cap)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"cache_seqlens: expected values in [0, {cap}] (block_table has "
            f"{block_table.shape[1]} blocks of {block_size}), got {int(lens[i])} at row {i}"
        )
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * block_size
    used = used < lens[:, None]
    pages = block_table.long()
    bad = used & ((pages < 0) | (pages >= num_blocks))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table: expected block ids in [0, {num_blocks}) for blocks in use, got "
            f"{int(pages[i, j])} at [{i}, {j}]"
        )


def _check_csr(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor | None,
    num_blocks: int,
    block_size: int,
) -> int:
    """Host-side range checks of a CSR page table (one sync); returns the longest row."""
    ptr = kv_indptr.long()
    nnz, S = kv_indices.shape[0], ptr.numel() - 1
    if bool((ptr[1:] < ptr[:-1]).any()) or int(ptr[0]) < 0 or int(ptr[-1]) > nnz:
        raise ValueError(
            f"kv_indptr: expected non-decreasing offsets in [0, {nnz}] (kv_indices holds {nnz} "
            f"pages), got {ptr[:8].tolist()}{' ...' if ptr.numel() > 8 else ''}"
        )
    cap = (ptr[1:] - ptr[:-1]) * block_size
    lens = cap if kv_lens is None else kv_lens.long()
    bad = (lens < 0) | (lens > cap)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"kv_lens: expected values in [0, pages x {block_size}] per row, got {int(lens[i])} "
            f"at row {i}, which has {int(cap[i]) // block_size} pages"
        )
    # the pages a row uses: its first ceil(len / block_size) entries of kv_indices
    j = torch.arange(nnz, device=kv_indices.device)
    row = torch.searchsorted(ptr[1:].contiguous(), j, right=True).clamp(max=max(S - 1, 0))
    start = ptr[row] if S else j
    used = (j >= start) & (j < ptr[-1]) & ((j - start) * block_size < lens[row] if S else False)
    pages = kv_indices.long()
    bad = used & ((pages < 0) | (pages >= num_blocks))
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"kv_indices: expected page ids in [0, {num_blocks}) for pages in use, got "
            f"{int(pages[k])} at [{k}] (row {int(row[k])})"
        )
    return int(lens.max()) if lens.numel() else 0


def _check_dense(q, kv_pool, table, lens, indptr, layout: PagedLayout, q_pe, kpe_pool) -> int:
    """The tensors' checks of a dense call (shapes, dtypes, devices, contiguity, launchability);
    returns ``S``, the sequences (``q`` holds ``S * layout.s_q`` rows)."""
    R = q.shape[0]
    s_q = check_int("s_q", layout.s_q, minimum=1)
    if R % s_q:
        raise ValueError(f"q: expected rows in whole groups of s_q = {s_q}, got {R} rows")
    S = R // s_q
    tensors = dict(q=q, kv_pool=kv_pool)
    if layout.csr:
        check_tensor("kv_indptr", indptr, ndim=1, dtypes=(torch.int32,), shape=(S + 1,))
        check_tensor("kv_indices", table, ndim=1, dtypes=(torch.int32,))
        if lens is not None:
            check_tensor("kv_lens", lens, ndim=1, dtypes=(torch.int32,), shape=(S,))
        tensors.update(kv_indptr=indptr, kv_indices=table)
    else:
        check_tensor("block_table", table, ndim=2, dtypes=(torch.int32,), shape=(S, None))
        check_tensor("cache_seqlens", lens, ndim=1, dtypes=(torch.int32,), shape=(S,))
        tensors.update(block_table=table, cache_seqlens=lens)
    for name, t in (
        ("cache_seqlens" if not layout.csr else "kv_lens", lens),
        ("kv_indptr", indptr),
    ):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if lens is not None:
        tensors["lens"] = lens
    for name, t in (("q_pe", q_pe), ("kpe_pool", kpe_pool)):
        if t is not None:
            tensors[name] = t
    check_same_device(**tensors)
    check_launchable(q, "q")
    return S


def _checked_capacity(table, lens, indptr, layout, check_inputs, max_kv_len, kv_pool):
    """The host-side range checks (one sync, when ``check_inputs``) and the longest row the
    split policy plans for (``max_kv_len`` if given; None: the padded table's capacity)."""
    if max_kv_len is not None and (
        isinstance(max_kv_len, bool) or not isinstance(max_kv_len, int) or max_kv_len < 0
    ):
        raise ValueError(f"max_kv_len: expected None or an int >= 0, got {max_kv_len!r}")
    num_blocks, block_size, _ = kv_pool.shape
    if layout.csr:
        longest = _check_csr(indptr, table, lens, num_blocks, block_size) if check_inputs else None
        if max_kv_len is None:
            # the policy's capacity: the longest row when it is known (checked above), else
            # every page of kv_indices (an upper bound; pass max_kv_len on a hot path)
            max_kv_len = longest if longest is not None else table.shape[0] * block_size
    elif check_inputs:
        _check_paging(table, lens, num_blocks, block_size)
    return max_kv_len


def _binder(layout: PagedLayout, split: bool, d_v: int, page: int, fp8: bool = False):
    """``bind(*run's arguments) -> the kernel's seven tensors`` of a dense plan's ``run`` (the
    positional tensors of :func:`plan_mla_decode`, or with CSR of :func:`plan_mla_decode_csr`,
    plus ``q_pe`` / ``kpe_pool``), and the names its errors give them. ``fp8``: ``kv_pool``
    holds FP8 entries, bound as uint8 (a float8_e4m3fn pool viewed)."""

    def rope_parts(q, kv_pool, q_pe, kpe_pool):
        if not split:
            return q, kv_pool
        q_pe = q[..., d_v:] if q_pe is None else q_pe
        if kpe_pool is None:
            kpe_pool = fp8_rope_view(kv_pool, d_v) if fp8 else kv_pool[..., d_v:]
        return q_pe, kpe_pool

    if layout.csr:

        def bind(q, kv_pool, kv_indptr, kv_indices, kv_lens=None, *, q_pe=None, kpe_pool=None):
            kv_pool = as_bytes(kv_pool) if fp8 else kv_pool
            q_pe, kpe_pool = rope_parts(q, kv_pool, q_pe, kpe_pool)
            if kv_lens is None:
                kv_lens = (kv_indptr[1:] - kv_indptr[:-1]) * page
            return (q, q_pe, kv_pool, kpe_pool, kv_indices, kv_indptr, kv_lens)

        return bind, ("kv_indices", "kv_indptr", "kv_lens")

    def bind(q, kv_pool, block_table, cache_seqlens, *, q_pe=None, kpe_pool=None):
        kv_pool = as_bytes(kv_pool) if fp8 else kv_pool
        q_pe, kpe_pool = rope_parts(q, kv_pool, q_pe, kpe_pool)
        # (Indptr is not read without CSR: any pointer does)
        return (q, q_pe, kv_pool, kpe_pool, block_table, cache_seqlens, cache_seqlens)

    return bind, ("block_table", "cache_seqlens", "cache_seqlens")


def checked_plan(
    q,
    kv_pool,
    table,
    lens,
    indptr,
    *,
    softmax_scale,
    d_v,
    num_splits,
    check_inputs,
    q_pe,
    kpe_pool,
    layout: PagedLayout,
    max_kv_len=None,
) -> tuple[AttentionPlan, MlaOperands]:
    """Every check of a dense call, then its plan: the one checked path of every dense entry
    point (the public functions, their plans, the FlashMLA / FlashInfer layout adapters).

    ``table``: the padded ``block_table [S, W]`` or, with ``layout.csr``, ``kv_indices [nnz]``
    (then ``indptr`` is ``kv_indptr [S + 1]``); ``lens``: ``[S]`` entries per sequence (None
    with CSR: whole pages); ``q`` holds ``S * layout.s_q`` query rows. Returns the plan (its
    ``run`` takes the positional tensors of :func:`plan_mla_decode`, or with CSR of
    :func:`plan_mla_decode_csr`, plus ``q_pe`` / ``kpe_pool``) and the checked operands."""
    ops = mla_operands(q, kv_pool, d_v, q_pe=q_pe, kpe_pool=kpe_pool)
    check_block_size(kv_pool.shape[1])
    _check_dense(q, kv_pool, table, lens, indptr, layout, q_pe, kpe_pool)
    scale = check_softmax_scale(softmax_scale)
    check_num_splits(num_splits)
    max_kv_len = _checked_capacity(table, lens, indptr, layout, check_inputs, max_kv_len, kv_pool)
    if ops.fp8 and check_inputs:
        _check_fp8_attended(ops.kv, table, lens, indptr, layout, d_v, kpe_pool)
    choice = dense_choice(q, kv_pool, table, ops, layout, kpe_pool, q_pe is not None)
    attend = None
    if choice.backend == "gluon" and ops.fp8:
        template, attend = plan_fp8_seesaw(
            q, ops.kv, table, scale=scale, num_splits=num_splits, sparse=False,
            s_q=layout.s_q, causal=layout.causal, max_kv_len=max_kv_len,
        )  # fmt: skip
    elif choice.backend == "gluon":
        template, attend = plan_seesaw(
            q,
            kv_pool,
            table,
            lens,
            indptr,
            scale=scale,
            num_splits=num_splits,
            s_q=layout.s_q,
            causal=layout.causal,
            csr=layout.csr,
            max_kv_len=max_kv_len,
            q_pe=q_pe,
            kpe_pool=kpe_pool,
        )
    else:
        template = plan_decode(
            q,
            kv_pool,
            table,
            lens,
            scale,
            d_v,
            num_splits,
            ops=ops,
            indptr=indptr,
            layout=layout,
            max_kv_len=max_kv_len,
            alloc=meta_output,
        )
    bind, names = _binder(layout, ops.split, d_v, kv_pool.shape[1], ops.fp8)
    if layout.csr:
        planned = bind(q, kv_pool, indptr, table, lens, q_pe=q_pe, kpe_pool=kpe_pool)
    else:
        planned = bind(q, kv_pool, table, lens, q_pe=q_pe, kpe_pool=kpe_pool)
    names = ("q", "q_pe", "kv_pool", "kpe_pool") + names
    plan = AttentionPlan(
        template,
        bind,
        n_inputs=7,
        device=q.device,
        planned=planned,
        names=names,
        attend=attend,
        backend=choice.backend,
        kernel=choice.kernel,
    )
    return plan, ops


def dense_choice(q, kv_pool, table, ops: MlaOperands, layout: PagedLayout, kpe_pool=None,
                 split_q: bool = False) -> Choice:  # fmt: skip
    """The dispatch table's backend for a checked dense call (``dispatch.choose``): the cache
    split when ``kpe_pool`` is given; ``split_q``: the query's rope part came apart (the bf16
    see-saws join it per run, the FP8 one does not)."""
    page = kv_pool.shape[1]
    entries = table.shape[0] * (q.shape[0] // layout.s_q) * (page // 64) if layout.csr else 0
    case = Case.of_dtypes(
        "mla_decode",
        q.dtype,
        None if ops.fp8 else kv_pool.dtype,
        split_cache=kpe_pool is not None,
        split_q=split_q,
        d_qk=ops.d_v + ops.d_pe,
        d_v=ops.d_v,
        page=page,
        tma_rows=fp8_rows(ops.kv) if ops.fp8 else tma_rows(kv_pool, kpe_pool),
        table_entries=entries,
    )
    return choose(case, Target.of(q.device))


def _check_fp8_attended(kv, table, lens, indptr, layout: PagedLayout, d_v: int, kpe=None) -> None:
    """The FP8 entries a dense call attends (a row's first ``lens`` tokens through its pages;
    CSR without ``kv_lens``: every entry of its pages) have valid scales and latent bytes
    (``fp8.cache.check_fp8_entries``; one host sync)."""
    block_size = kv.shape[1]
    if layout.csr:
        starts = indptr[:-1]
        lens = (indptr[1:] - indptr[:-1]) * block_size if lens is None else lens
        pages = table
    else:
        starts = torch.arange(table.shape[0], device=table.device) * table.shape[1]
        pages = table.reshape(-1)
    check_fp8_entries(kv, dense_slots(pages, starts, lens, block_size), d_v, kpe)


def _dense_options(call) -> dict:
    """The options of a dense op's call, as :func:`checked_plan` takes them."""
    return dict(
        softmax_scale=call.softmax_scale,
        d_v=call.d_v,
        num_splits=call.num_splits,
        check_inputs=call.check_inputs,
        q_pe=call.q_pe,
        kpe_pool=call.kpe_pool,
    )


@mla_decode_partial.op.planner
def plan_mla_decode(call) -> AttentionPlan:
    """Plan :func:`mla_decode_partial` once for a batch shape (FlashMLA's ``get_mla_metadata``,
    FlashInfer's ``plan()``): every check and the split choice, on these tensors.

    ``plan.run(q, kv_pool, block_table, cache_seqlens, q_pe=None, kpe_pool=None)`` then launches
    on tensors of the same shapes, dtypes, strides and device (new values, or the same buffers
    refilled), checking nothing and never syncing: the holder's per-step call, CUDA-graph
    capturable. Arguments as in :func:`mla_decode_partial`.

    Examples
    --------
    >>> import torch
    >>> from mqnc.triton_kernels import plan_mla_decode
    >>> q, pool = torch.randn(2, 16, 576), torch.randn(4, 64, 576)
    >>> table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    >>> lens = torch.tensor([100, 128], dtype=torch.int32)
    >>> plan = plan_mla_decode(q, pool, table, lens, softmax_scale=192**-0.5)
    >>> for step in range(2):  # new query rows (and lengths) each step, same shapes
    ...     o, lse = plan.run(torch.randn(2, 16, 576), pool, table, lens)
    >>> o.shape
    torch.Size([2, 16, 512])
    """
    table, lens = call.block_table, call.cache_seqlens
    options = _dense_options(call)
    return checked_plan(call.q, call.kv_pool, table, lens, None, **options, layout=PagedLayout())[0]


@mla_decode_partial.op.checks_apart
def _padded_value_checks(call) -> None:
    """A padded-table call's host-syncing checks (``check_inputs``), run before its cached
    plan: its plan does not depend on the values they read (the split choice reads the table's
    capacity, never ``cache_seqlens``)."""
    if call.check_inputs:
        padded_value_checks(
            call.kv_pool, call.block_table, call.cache_seqlens, call.d_v, call.kpe_pool
        )


def padded_value_checks(kv_pool, block_table, cache_seqlens, d_v: int, kpe_pool=None) -> None:
    """The value checks of a dense call over a padded block table: the lengths fit the table,
    the pages in use exist (:func:`_check_paging`: one small kernel, one sync) and, for an FP8
    pool, the entries attended are valid (one more sync)."""
    num_blocks, block_size = kv_pool.shape[:2]
    _check_paging(block_table, cache_seqlens, num_blocks, block_size)
    if is_fp8_pool(kv_pool):
        kv = as_bytes(kv_pool)
        _check_fp8_attended(kv, block_table, cache_seqlens, None, PagedLayout(), d_v, kpe_pool)


@mla_decode_partial_csr.op.planner
def plan_mla_decode_csr(call) -> AttentionPlan:
    """Plan :func:`mla_decode_partial_csr` once for a batch shape; ``plan.run(q, kv_pool,
    kv_indptr, kv_indices, kv_lens=None, q_pe=None, kpe_pool=None)`` then launches on tensors of
    the same shapes (``kv_indices`` may hold other pages; the same count), unchecked and
    without a host sync. Pass ``max_kv_len`` (the longest row the plan will see) or keep
    ``check_inputs``: the split choice is made here, once."""
    return checked_plan(
        call.q,
        call.kv_pool,
        call.kv_indices,
        call.kv_lens,
        call.kv_indptr,
        **_dense_options(call),
        layout=PagedLayout(csr=True),
        max_kv_len=call.max_kv_len,
    )[0]


def plan_decode(
    q,
    kv_pool,
    block_table,
    cache_seqlens,
    scale,
    d_v,
    num_splits,
    occupancy=None,
    *,
    ops: MlaOperands | None = None,
    indptr=None,
    layout: PagedLayout | None = None,
    max_kv_len: int | None = None,
    alloc=None,
) -> MlaPlan:
    """The launches of one :func:`mla_decode_partial` call for valid inputs (unchecked), at
    ``occupancy`` if given (see ``mla.plan.plan_mla``). ``ops``: the checked operands
    (default: ``q`` and ``kv_pool`` fused); ``layout``: the page table and query layout
    (default: padded table, one query token per row); ``max_kv_len``: the longest row, for the
    split choice (default: the table's capacity); ``alloc``: how outputs are made."""
    if ops is None:  # fused rows; an FP8 pool's operands (its uint8 view) checked as such
        fp8 = is_fp8_pool(kv_pool)
        ops = mla_operands(q, kv_pool, d_v) if fp8 else MlaOperands(
            q, q, kv_pool, kv_pool, d_v, q.shape[2] - d_v, False
        )  # fmt: skip
    layout = layout or PagedLayout()
    cfg = tile_config(q.shape[1], dtype=q.dtype, fp8=ops.fp8)
    page = kv_pool.shape[1]
    lens = cache_seqlens if cache_seqlens is not None else indptr  # (CSR: derived per run)

    def build(o_part, lse_part, splits):
        return decode_launch(
            ops, block_table, indptr, lens, o_part, lse_part, splits, scale, cfg, layout
        )

    if max_kv_len is None:
        max_kv_len = block_table.shape[-1] * page
    extra = {} if alloc is None else {"alloc": alloc}
    return plan_mla(
        build,
        op="mla_decode",
        q=q,
        d_v=d_v,
        cfg=cfg,
        tiles=triton.cdiv(max_kv_len, cfg.block_n),
        num_splits=num_splits,
        occupancy=occupancy,
        d_qk=d_v + ops.d_pe,
        entry_bytes=fp8_entry_bytes(ops),
        **extra,
    )


def decode_features(page: int, split: bool, layout: PagedLayout) -> tuple[str, ...]:
    """What a dense launch's variant name adds to the production layout (see ``variant_name``)."""
    feats = () if page == PRODUCTION_PAGE else (f"page={page}",)
    feats += ("csr",) if layout.csr else ()
    feats += ("split-kv",) if split else ()
    feats += ("sq",) if layout.s_q > 1 else ()
    return feats + (("causal",) if layout.causal else ())


def decode_launch(
    ops: MlaOperands,
    block_table: torch.Tensor,
    indptr: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    num_splits: int,
    scale: float,
    cfg: TileConfig,
    layout: PagedLayout,
) -> Launch:
    """The dense kernel's launch (no checks: :func:`mla_decode_partial` checks), writing into
    ``o_part [R, H, d_v]`` / ``lse_part [R, H]`` for one split or the fp32 workspaces
    ``[num_splits, R, H, d_v]`` / ``[num_splits, R, H]`` (``R = B * s_q`` query rows)."""
    q, kv = ops.q, ops.kv
    R, H = q.shape[:2]
    block_size = kv.shape[1]
    split = o_part.dim() == 4
    if layout.csr:
        stride_tb, stride_tj = 0, block_table.stride(0)
    else:
        stride_tb, stride_tj = block_table.stride(0), block_table.stride(1)
    feats, restructured = _restructured(cfg, block_size, num_splits, split, kv.device)
    feats = decode_features(block_size, ops.split, layout) + feats
    args = (
        q,
        ops.q_pe,
        kv,
        ops.kv_pe,
        block_table,
        indptr if indptr is not None else cache_seqlens,
        cache_seqlens,
        o_part,
        lse_part,
        H,
        num_splits,
        layout.s_q,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        ops.q_pe.stride(0),
        ops.q_pe.stride(1),
        kv.stride(0),
        kv.stride(1),
        ops.kv_pe.stride(0),
        ops.kv_pe.stride(1),
        stride_tb,
        stride_tj,
        *split_strides(o_part, lse_part),
    )
    if cfg.kernel:  # n_blocks (the TMA descriptors' outer extent), the fused workspace
        fused = restructured["FUSED"]
        args += (kv.shape[0], *fused_workspace(R, H, ops.d_v, num_splits, q.device, fused))
    return Launch(
        name=variant_name(
            "mla_decode-fp8" if ops.fp8 else "mla_decode", q.dtype, cfg, split, feats
        ),
        kernel=_mla_decode_pipe_kernel if cfg.kernel else _mla_decode_kernel,
        grid=(R * triton.cdiv(H, cfg.block_h), num_splits),
        args=args,
        kwargs=dict(
            PAGE=block_size,
            BLOCK_H=cfg.block_h,
            BLOCK_N=cfg.block_n,
            MIN_TILES=cfg.min_tiles,
            D_LAT=ops.d_v,
            D_PE=ops.d_pe,
            SPLIT=ops.split,
            CSR=layout.csr,
            MULTI_Q=layout.s_q > 1,
            CAUSAL=layout.causal,
            DOT_FP32=dot_in_fp32(q.dtype, q.device),
            PRECISION=dot_precision(q.dtype),
            BF16_RNE=bf16_rne_in_software(o_part.dtype, o_part.device),
            **restructured,
            **fp8_flags(ops, cfg),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            maxnreg=cfg.reg_cap,
        ),
    )


def _restructured(cfg: TileConfig, page: int, num_splits: int, split: bool, device):
    """A candidate tile's variant-name features and constexprs (none for a classic tile): the
    restructured loop, TMA where a tile lies within a page (the allocator installed for it),
    the combine fused where the launch is split and given the final outputs."""
    if not cfg.kernel:
        return (), {}
    tma = cfg.kernel == "tma" and page >= cfg.block_n
    fused = cfg.fused and num_splits > 1 and not split
    if tma:
        ensure_allocator(device)
    feats = ("tma" if tma else "pipe",) + (("fused",) if fused else ())
    return feats, dict(TMA=tma, RING=cfg.num_stages, FUSED=fused)


def fused_workspace(R: int, H: int, d_v: int, num_splits: int, device, fused: bool) -> tuple:
    """The fused combine's workspace as the kernel takes it (``WO, WLSE, Tickets`` and the six
    strides): fp32 partials ``[S, R, H, d_v]`` / ``[S, R, H]`` and one zeroed int32 ticket per
    program of axis 0 (``R * H`` is enough for any head block), made once when the launch is
    planned and owned by it: a plan's runs (and a CUDA graph's replays) reuse it, the tickets
    returning to 0 at the end of every launch, so two runs of ONE plan must not overlap on
    different streams. Each is wrapped (``triton.reinterpret`` to its own dtype) so that a
    plan keeps the buffer itself, not a stand-in of its shape. Not fused: None x 3, zeros."""
    if not fused:
        return (None, None, None, 0, 0, 0, 0, 0, 0)
    wo = torch.empty((num_splits, R, H, d_v), dtype=torch.float32, device=device)
    wlse = torch.empty((num_splits, R, H), dtype=torch.float32, device=device)
    tickets = torch.zeros(max(R * H, 1), dtype=torch.int32, device=device)
    return (
        *(triton.reinterpret(t, t.dtype) for t in (wo, wlse, tickets)),
        *wo.stride()[:3],
        *wlse.stride(),
    )


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's per-launch global scratch (the device-side TMA descriptors), from torch's
    caching allocator on the current device (inside a CUDA graph capture: the graph's pool)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator(device: torch.device) -> None:
    """Install :func:`_scratch` as Triton's allocator (``triton.set_allocator``) unless one is
    set: a kernel that makes tensor descriptors on the device needs a global scratch at every
    launch, and Triton's default allocator refuses. Done when a TMA launch is planned on a CUDA
    device; Triton keeps the allocator in a ``ContextVar``, so a thread other than the
    planning one must call this (or ``triton.set_allocator``) itself before running the plan.
    The interpreter and the compile step need none."""
    if torch.device(device).type != "cuda":
        return
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)
