"""The dense decode's plan on the Gluon see-saw: what the default path runs on sm_90.

The dispatch table (:mod:`mqnc.triton_kernels.dispatch`) sends a dense call here when the see-saw
(:mod:`mqnc.triton_kernels.mla.gluon`) can serve it and its GPU evidence holds; the call's
checks, its outputs, its ``out=``, its plan cache and its CUDA-graph capture are the ``tl``
path's own (``mla.decode.checked_plan``, :class:`~mqnc.triton_kernels.mla.plan.AttentionPlan`):
only the attention step differs (:class:`SeesawAttend`), and the split-KV combine is the same
merge kernel.

What the kernel reads, and what a run adapts first (each on the device, no host sync):

- **Page tables.** The kernel reads a padded ``[S, W]`` table of 64-entry pages. A padded
  table of 64-entry pages with unit stride along a row is read as given. Otherwise a small
  ``tl`` kernel (:func:`_seesaw_table_kernel`) writes one per run: pages of ``64 k`` entries
  become ``k`` consecutive 64-entry pages (page ``p``'s ``i``-th is ``k p + i`` of the pool
  viewed as 64-entry pages), and FlashInfer's CSR table (``kv_indptr`` / ``kv_indices``, with or
  without ``kv_lens``) becomes a padded table ``nnz k`` wide (wide enough for any row a run may
  bring: the plan fixes ``nnz``, not the rows' lengths), with the rows' lengths (``kv_lens``,
  or whole pages). Its ``S x nnz k`` entries are why the table caps CSR at
  :data:`CSR_TABLE_ENTRIES`.
- **Query rows**, ``q [R, H, 576]``, are read by TMA as ``[R H, 576]`` rows: in place when the
  plan's strides allow it (unit stride along the row, heads 16 bytes apart, tokens ``H`` heads
  apart), else copied per run (the small query, never the cache); a query whose base is not
  16-byte aligned is copied too.
- **The cache** is read in place as ``[pages x page, 576]`` rows (``dispatch.Case.tma_rows``);
  its descriptor is rebuilt only when the pool's storage changes. FlashInfer's split cache
  (``ckv [.., 512]`` + ``kpe [.., 64]``) is read in place through two descriptors by the
  split variant of the kernel (``gluon_mla_seesaw_split_kernel``: opt-in until a GPU run
  verifies it); a query given as ``q_nope`` + ``q_pe`` is joined per run (a copy of the small
  query, never of the cache).
- **Split-KV**: the see-saw's split rule (``ceil(ceil(n / 64) / S)`` blocks a split, pages
  paired) and the split policy at one CTA per SM; ``S > 1`` writes fp32 partials that the plan's
  combine merges.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._core.launch import Launch, LaunchRunner
from mqnc.triton_kernels.merge.partials import merge_launch
from mqnc.triton_kernels.mla.gluon import (
    BLOCK_H,
    D_QK,
    D_V,
    LOG2E,
    PAGE,
    choose_splits,
    descriptor_layout,
    seesaw_kernel,
)
from mqnc.triton_kernels.mla.plan import MlaPlan, meta_output, split_outputs, split_strides

__all__ = [
    "Fp8SeesawAttend",
    "SeesawAttend",
    "fp8_rows",
    "fp8_views",
    "plan_fp8_seesaw",
    "plan_seesaw",
    "tma_rows",
    "table_launch",
]

_TABLE_BLOCK = 256


def tma_rows(kv_pool: torch.Tensor, kpe_pool: torch.Tensor | None = None) -> bool:
    """True when ``kv_pool [pages, page, d]``'s entries (and ``kpe_pool``'s, FlashInfer's rope
    part, when given) are rows of one 2-D tensor that a TMA descriptor reads in place: unit
    stride along an entry, entries a multiple of 8 elements (16 bytes) apart, pages ``page``
    entries apart, the base 16-byte aligned."""
    if kpe_pool is not None and not tma_rows(kpe_pool):
        return False
    if kv_pool.dim() != 3:
        return False
    sp, se, sd = kv_pool.stride()
    return sd == 1 and se % 8 == 0 and sp == kv_pool.shape[1] * se and kv_pool.data_ptr() % 16 == 0


@triton.jit(do_not_specialize=["stride_tb", "stride_tj", "W", "page"])
def _seesaw_table_kernel(
    Table,
    Indptr,
    Lens,
    Out,
    OutLens,
    stride_tb,
    stride_tj,
    W,
    page,
    SUB: tl.constexpr,
    CSR: tl.constexpr,
    HAS_LENS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row ``seq`` of the padded table of 64-entry pages, entries ``[BLOCK j, BLOCK (j + 1))``:
    entry ``e`` is sub-page ``e % SUB`` of the row's page ``e // SUB`` (CSR: of its pages in
    ``Table`` from ``Indptr[seq]``); entries past the row's pages are 0 (never read: past its
    length). CSR: block 0 also writes the row's length (``Lens``, else its whole pages)."""
    seq = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = e // SUB
    if CSR:
        start = tl.load(Indptr + seq)
        count = tl.load(Indptr + seq + 1) - start
        pid = tl.load(Table + start + src, mask=(src < count) & (e < W), other=0)
    else:
        pid = tl.load(Table + seq * stride_tb + src * stride_tj, mask=e < W, other=0)
    tl.store(Out + seq.to(tl.int64) * W + e, pid * SUB + e % SUB, mask=e < W)
    if CSR:
        if tl.program_id(1) == 0:
            if HAS_LENS:
                n = tl.load(Lens + seq)
            else:
                n = count * page
            tl.store(OutLens + seq, n)


def table_launch(table, indptr, lens, out, out_lens, *, page: int, csr: bool) -> Launch:
    """The table kernel's launch: ``table`` (``[S, W0]`` padded, or CSR's ``kv_indices [nnz]``
    with ``indptr [S + 1]`` and ``lens [S]`` or None) into ``out [S, W]`` int32 (and, CSR,
    ``out_lens [S]``), pages of ``page`` entries as 64-entry ones."""
    S, W = out.shape
    sub = page // PAGE
    strides = (0, 0) if csr else table.stride()
    return Launch(
        name=f"seesaw_table[{'csr' if csr else 'padded'},sub={sub}]",
        kernel=_seesaw_table_kernel,
        grid=(S, triton.cdiv(max(W, 1), _TABLE_BLOCK)),
        args=(
            table,
            indptr if indptr is not None else table,  # (not read without CSR)
            lens if lens is not None else out_lens,  # (not read without HAS_LENS)
            out,
            out_lens,
            *strides,
            W,
            page,
        ),
        kwargs=dict(SUB=sub, CSR=csr, HAS_LENS=lens is not None, BLOCK=_TABLE_BLOCK, num_warps=4),
    )


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What a see-saw plan fixes: ``R`` query rows of ``H`` heads, ``S`` sequences (``s_q``
    rows each), the padded table's width ``W`` in 64-entry pages, the pool's page ``page``,
    CSR or not, ``copy_q`` (the planned strides are not TMA's), ``split_q`` (the query's rope
    part comes apart: the two are joined per run) and ``split_cache`` (FlashInfer's ``ckv`` /
    ``kpe``: the split kernel, two cache descriptors)."""

    R: int
    H: int
    S: int
    s_q: int
    W: int
    page: int
    csr: bool
    convert: bool
    copy_q: bool
    split_q: bool = False
    split_cache: bool = False


class SeesawAttend:
    """The attention step of an :class:`~mqnc.triton_kernels.mla.plan.AttentionPlan` on the
    see-saw: called as a ``LaunchRunner`` is, with the plan's seven bound tensors ``(q, q_pe,
    kv_pool, kpe_pool, table, indptr, lens)`` then ``(o_part, lse_part)``. It writes the table of
    64-entry pages when the plan needs one, makes the TMA descriptors and launches the kernel
    (its compiled launcher after the first run, as ``LaunchRunner`` does)."""

    def __init__(self, shape: _Shape, kernel: Launch, table: Launch | None) -> None:
        self.shape = shape
        self._kernel = LaunchRunner(kernel, 7 if shape.split_cache else 6)
        self._table = LaunchRunner(table, 5) if table is not None else None
        self._layout = None
        self._kv_key = self._kv_desc = self._q_template = None

    def _descriptor(self, base: torch.Tensor, shape, strides, block):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        if self._layout is None:
            self._layout = descriptor_layout()
        return TensorDescriptor(base, list(shape), list(strides), list(block), self._layout)

    def _q(self, q: torch.Tensor):
        """``q``'s descriptor: the planned one with ``q`` as its base (the plan fixed its
        shape, strides and dtype: Triton's own checks of them need not run again)."""
        s = self.shape
        if s.copy_q:
            q = q.contiguous()
        elif q.data_ptr() % 16:  # (a view off the planned alignment: a copy, its own strides)
            q = q.clone(memory_format=torch.contiguous_format)
            return self._descriptor(q, (s.R * s.H, D_QK), (q.stride(1), 1), (BLOCK_H, 64))
        template = self._q_template
        if template is None:
            template = self._q_template = self._descriptor(
                q, (s.R * s.H, D_QK), (q.stride(1), 1), (BLOCK_H, 64)
            )
            return template
        desc = object.__new__(type(template))
        desc.__dict__.update(template.__dict__, base=q)
        return desc

    def _kv(self, kv_pool: torch.Tensor, kpe_pool: torch.Tensor) -> tuple:
        """The cache's descriptors (one; two for a split cache), rebuilt only when its storage
        changes."""
        pools = (kv_pool, kpe_pool) if self.shape.split_cache else (kv_pool,)
        key = tuple(t.data_ptr() for t in pools)
        if key != self._kv_key:
            descs = []
            for name, pool in zip(("kv_pool", "kpe_pool"), pools, strict=False):
                if pool.data_ptr() % 16:
                    raise ValueError(
                        f"{name}: expected a 16-byte aligned base (the Gluon kernel reads it by "
                        f"TMA, as planned), got address {pool.data_ptr():#x}"
                    )
                n, page, width = pool.shape
                rows = (n * page, width)
                descs.append(self._descriptor(pool, rows, (pool.stride(1), 1), (64, 64)))
            self._kv_desc, self._kv_key = tuple(descs), key
        return self._kv_desc

    def __call__(self, interpreted, q, q_pe, kv_pool, kpe_pool, table, indptr, lens, o_part,
                 lse_part):  # fmt: skip
        s = self.shape
        if s.convert:
            device = q.device
            out = torch.empty((s.S, s.W), dtype=torch.int32, device=device)
            out_lens = torch.empty((s.S,), dtype=torch.int32, device=device) if s.csr else lens
            self._table(False, table, indptr, lens, out, out_lens)
            table, lens = out, out_lens
        if s.split_q:  # (the small query joined; the cache is read in place)
            q = torch.cat((q, q_pe), dim=-1)
        kv = self._kv(kv_pool, kpe_pool)
        self._kernel(False, self._q(q), *kv, table, lens, o_part, lse_part)


def plan_seesaw(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor | None,
    indptr: torch.Tensor | None,
    *,
    scale: float,
    num_splits: int | None,
    s_q: int,
    causal: bool,
    csr: bool,
    max_kv_len: int | None,
    q_pe: torch.Tensor | None = None,
    kpe_pool: torch.Tensor | None = None,
) -> tuple[MlaPlan, SeesawAttend | None]:
    """The template plan (outputs as stand-ins, the kernel's launch with its descriptors left
    out, the combine when split) and the attention step of a dense call on the see-saw, for
    checked inputs: ``q [R, H, 576]`` bf16, ``kv_pool [pages, page, 576]`` bf16 (``page`` a
    multiple of 64, :func:`tma_rows`), ``table`` a padded ``[S, W0]`` block table or (``csr``)
    ``kv_indices [nnz]`` with ``indptr [S + 1]``; ``lens [S]`` (None: CSR's whole pages);
    ``max_kv_len``: the longest row the split policy plans for (None: the table's capacity);
    ``q_pe`` / ``kpe_pool``: the query's and the cache's rope parts when they come apart
    (``q [R, H, 512]``, ``kv_pool [pages, page, 512]``, FlashInfer's layout)."""
    R, H, _ = q.shape
    page = kv_pool.shape[1]
    sub = page // PAGE
    S = R // s_q
    if csr:
        W = table.shape[0] * sub
        capacity = table.shape[0] * page
    else:
        W = table.shape[1] * sub
        capacity = table.shape[1] * page
    convert = csr or sub != 1 or (table.shape[1] > 1 and table.stride(1) != 1)
    row_stride = W if convert else table.stride(0)
    qs = q.stride()
    split_q, split_cache = q_pe is not None, kpe_pool is not None
    copy_q = not split_q and not (qs[2] == 1 and qs[1] % 8 == 0 and qs[0] == H * qs[1])
    shape = _Shape(R, H, S, s_q, W, page, csr, convert, copy_q, split_q, split_cache)
    longest = capacity if max_kv_len is None else min(max_kv_len, capacity)
    if num_splits is None:
        num_splits = choose_splits(R, H, triton.cdiv(longest, PAGE), PAGE, q.device, 2)
    o, lse, o_part, lse_part = split_outputs(R, H, D_V, q.dtype, q.device, num_splits, meta_output)
    if R * H == 0:
        return MlaPlan(o, lse, num_splits, ()), None
    out = "fp32-split" if num_splits > 1 else "bf16"
    fn, name, options = seesaw_kernel(out, s_q, causal, split_cache)
    meta = torch.device("meta")
    kernel = Launch(
        name=name,
        kernel=fn,
        grid=(R * triton.cdiv(H, BLOCK_H), num_splits),
        args=(
            None,  # q's TMA descriptor, made per run
            None,  # the cache's (its latent part's, split)
            *((None,) if split_cache else ()),  # (split: the rope part's)
            torch.empty((S, W), dtype=torch.int32, device=meta) if convert else table,
            lens if lens is not None else torch.empty((S,), dtype=torch.int32, device=meta),
            o_part,
            lse_part,
            H,
            W,
            row_stride,
            num_splits,
            *split_strides(o_part, lse_part),
            scale * LOG2E,
        ),
        kwargs=dict(S_Q=s_q, CAUSAL=causal, **options),
    )
    conv = None
    if convert:
        out = torch.empty((S, W), dtype=torch.int32, device=meta)
        out_lens = torch.empty((S,), dtype=torch.int32, device=meta)
        conv = table_launch(table, indptr, lens, out, out_lens, page=page, csr=csr)
    launches = [kernel]
    if num_splits > 1:
        launches.append(merge_launch(o_part, lse_part, o, lse))
    template = MlaPlan(o, lse, num_splits, tuple(launches))
    return template, SeesawAttend(shape, _without_outputs(kernel, split_cache), conv)


def _without_outputs(kernel: Launch, split_cache: bool) -> Launch:
    """The kernel's launch as its runner keeps it: its leading arguments (descriptors, table,
    lengths, outputs: six, seven with a split cache's second descriptor) come with every run."""
    k = 7 if split_cache else 6
    return dataclasses.replace(kernel, args=(None,) * k + kernel.args[k:])


# ---- the sparse top-k plan on the see-saw's gather variant (opt-in until a GPU verifies it) --


@triton.jit(do_not_specialize=["K", "stride_ib", "stride_ik", "stride_ob"])
def _compact_kernel(Idx, Out, Lens, K, stride_ib, stride_ik, stride_ob, BLOCK: tl.constexpr):
    """Row ``b`` of a top-k selection: its valid indices (``>= 0``) written first, in order,
    to ``Out[b]``, their count to ``Lens[b]``; the rest of ``Out[b]`` is not written (never
    read: past the row's count)."""
    b = tl.program_id(0)
    count = tl.zeros((), dtype=tl.int32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        idx = tl.load(Idx + b.to(tl.int64) * stride_ib + k * stride_ik, mask=k < K, other=-1)
        valid = (idx >= 0).to(tl.int32)
        pos = count + tl.cumsum(valid, 0) - 1
        tl.store(Out + b.to(tl.int64) * stride_ob + pos, idx, mask=valid > 0)
        count += tl.sum(valid, 0)
    tl.store(Lens + b, count)


def compact_launch(indices: torch.Tensor, out: torch.Tensor, lens: torch.Tensor) -> Launch:
    """The compaction's launch: ``indices [B, K]`` int32 (``-1``, or any negative: unused) into
    ``out [B, K]`` (valid first) and ``lens [B]`` (their count)."""
    B, K = indices.shape
    return Launch(
        name="sparse_compact",
        kernel=_compact_kernel,
        grid=(B,),
        args=(indices, out, lens, K, *indices.stride(), out.stride(0)),
        kwargs=dict(BLOCK=1024, num_warps=4),
    )


def compacted(compact: LaunchRunner, shape: tuple, indices: torch.Tensor):
    """A run's compacted selection, ``(table [B, W], lens [B])`` int32 on the indices' device,
    written by the planned compaction ``compact`` (:func:`compact_launch`'s runner)."""
    table = torch.empty(shape, dtype=torch.int32, device=indices.device)
    lens = torch.empty(shape[:1], dtype=torch.int32, device=indices.device)
    compact(False, indices, table, lens)
    return table, lens


class SparseSeesawAttend:
    """The attention step of a sparse :class:`~mqnc.triton_kernels.mla.plan.AttentionPlan` on
    the see-saw's gather variant: called as a ``LaunchRunner`` is, with the sparse plan's five
    bound tensors ``(q, q_pe, kv_pool, kpe_pool, indices)`` then ``(o_part, lse_part)``; it
    compacts the selection and launches the kernel."""

    def __init__(self, kernel: Launch, compact: Launch) -> None:
        self._kernel = LaunchRunner(kernel, 6)
        self._compact = LaunchRunner(compact, 3)
        self._shape = tuple(compact.args[1].shape)

    def __call__(self, interpreted, q, q_pe, kv_pool, kpe_pool, indices, o_part, lse_part):
        out, lens = compacted(self._compact, self._shape, indices)
        self._kernel(False, q, kv_pool, out, lens, o_part, lse_part)


def plan_sparse_seesaw(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    indices: torch.Tensor,
    *,
    scale: float,
    num_splits: int | None,
) -> tuple[MlaPlan, SparseSeesawAttend | None]:
    """The template plan and the attention step of a sparse call on the gather see-saw, for
    checked inputs: ``q [B, H, 576]`` bf16, ``kv_pool [pages, page, 576]`` bf16 (its entries
    rows of one 2-D tensor: :func:`tma_rows`), ``indices [B, K]`` int32 into the flattened
    entries (``-1`` unused)."""
    B, H, _ = q.shape
    K = indices.shape[1]
    blocks = triton.cdiv(max(K, 1), PAGE)
    if num_splits is None:
        num_splits = choose_splits(B, H, blocks, PAGE, q.device, 2)
    o, lse, o_part, lse_part = split_outputs(B, H, D_V, q.dtype, q.device, num_splits, meta_output)
    if B * H == 0:
        return MlaPlan(o, lse, num_splits, ()), None
    from mqnc.triton_kernels.mla import gluon_kernels

    meta = torch.device("meta")
    table = torch.empty((B, blocks * PAGE), dtype=torch.int32, device=meta)
    lens = torch.empty((B,), dtype=torch.int32, device=meta)
    out = "fp32-split" if num_splits > 1 else "bf16"
    kernel = Launch(
        name=f"mla_sparse_gluon[bfloat16,64x64,seesaw-gather,w4+4+4,out={out}]",
        kernel=gluon_kernels.gluon_mla_sparse_seesaw_kernel,
        grid=(B * triton.cdiv(H, BLOCK_H), num_splits),
        args=(
            q,
            kv_pool,
            table,
            lens,
            o_part,
            lse_part,
            H,
            blocks,
            table.stride(0),
            num_splits,
            q.stride(0),
            q.stride(1),
            kv_pool.stride(1),
            *split_strides(o_part, lse_part),
            scale * LOG2E,
        ),
        kwargs=dict(S_Q=1, CAUSAL=False, num_warps=4),
    )
    launches = [kernel]
    if num_splits > 1:
        launches.append(merge_launch(o_part, lse_part, o, lse))
    template = MlaPlan(o, lse, num_splits, tuple(launches))
    return template, SparseSeesawAttend(kernel, compact_launch(indices, table, lens))


# ---- the see-saw over DeepSeek-V3.2's FP8 cache, dense and sparse (opt-in until a GPU verifies
# it): the same kernel reads a padded page table (dense) or a compacted top-k selection (sparse)


def fp8_views(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The FP8 kernel's three views of a pool of 656-byte entries (``[pages, page, 656]``
    uint8, entries rows of one 2-D tensor): its FP8 bytes, its fp32 words (the scales) and its
    bf16 halves (the RoPE part), and the entry stride in bytes."""
    flat = pool.reshape(-1, pool.shape[-1])
    return (
        flat.view(torch.float8_e4m3fn),
        flat.view(torch.float32),
        flat.view(torch.bfloat16),
        flat.stride(0),
    )


def fp8_rows(kv_pool: torch.Tensor) -> bool:
    """True when an FP8 pool's (uint8 ``[pages, page, 656]``) entries are rows of one 2-D tensor
    the FP8 see-saw reads by cp.async and views as fp32 / bf16: unit stride along an entry, 16
    bytes apart at least a multiple of 16, pages ``page`` entries apart, the base 16-byte
    aligned."""
    if kv_pool.dim() != 3:
        return False
    sp, se, sd = kv_pool.stride()
    return sd == 1 and se % 16 == 0 and sp == kv_pool.shape[1] * se and kv_pool.data_ptr() % 16 == 0


def _fp8_launch(q, pool, table, lens, o_part, lse_part, *, n_blocks_row, page, scale, s_q,
                causal, out) -> Launch:  # fmt: skip
    """The FP8 see-saw's launch (``page`` 0: ``table`` a compacted selection)."""
    from mqnc.triton_kernels.mla import gluon_kernels

    R, H, _ = q.shape
    num_splits = o_part.shape[0] if o_part.dim() == 4 else 1
    kv8, kvs, kvb, stride_e = fp8_views(pool)
    what = "seesaw-fp8-gather" if page == 0 else "seesaw-fp8"
    extra = (f",sq={s_q}" if s_q > 1 else "") + (",causal" if causal else "")
    op = "mla_sparse_gluon" if page == 0 else "mla_decode_gluon"
    return Launch(
        name=f"{op}[bfloat16,fp8,64x64,{what},w4+4+4,out={out}{extra}]",
        kernel=gluon_kernels.gluon_mla_seesaw_fp8_kernel,
        grid=(R * triton.cdiv(H, BLOCK_H), num_splits),
        args=(
            q,
            kv8,
            kvs,
            kvb,
            table,
            lens,
            o_part,
            lse_part,
            H,
            n_blocks_row,
            table.stride(0),
            num_splits,
            q.stride(0),
            q.stride(1),
            stride_e,
            page,
            *split_strides(o_part, lse_part),
            scale * LOG2E,
        ),
        kwargs=dict(S_Q=s_q, CAUSAL=causal, num_warps=4),
    )


class Fp8SeesawAttend:
    """The attention step of an FP8 plan on the see-saw, called as a ``LaunchRunner`` is: a
    dense plan's seven bound tensors ``(q, q_pe, kv_pool, kpe_pool, table, indptr, lens)`` or a
    sparse plan's five ``(q, q_pe, kv_pool, kpe_pool, indices)``, then ``(o_part, lse_part)``;
    a sparse run compacts its selection first."""

    def __init__(self, kernel: Launch, compact: Launch | None, *, copy_q: bool,
                 copy_table: bool) -> None:  # fmt: skip
        self._kernel = LaunchRunner(kernel, 8)
        self._compact = LaunchRunner(compact, 3) if compact is not None else None
        self._shape = tuple(compact.args[1].shape) if compact is not None else None
        self._copy_q, self._copy_table = copy_q, copy_table

    def __call__(self, interpreted, q, q_pe, kv_pool, kpe_pool, *rest):
        if self._copy_q:  # (rows the kernel cannot cp.async in place: the small query copied)
            q = q.contiguous()
        if q.data_ptr() % 16:
            q = q.clone(memory_format=torch.contiguous_format)
        kv8, kvs, kvb, _ = fp8_views(kv_pool)
        if self._compact is not None:
            indices, o_part, lse_part = rest
            table, lens = compacted(self._compact, self._shape, indices)
        else:
            table, _, lens, o_part, lse_part = rest
            if self._copy_table:
                table = table.contiguous()
        self._kernel(False, q, kv8, kvs, kvb, table, lens, o_part, lse_part)


def plan_fp8_seesaw(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    table: torch.Tensor,
    *,
    scale: float,
    num_splits: int | None,
    sparse: bool,
    s_q: int = 1,
    causal: bool = False,
    max_kv_len: int | None = None,
) -> tuple[MlaPlan, Fp8SeesawAttend | None]:
    """The template plan and the attention step of an FP8 call on the see-saw, for checked
    inputs: ``q [R, H, 576]`` bf16 (unit stride along a row), ``kv_pool [pages, page, 656]``
    uint8 (:func:`fp8_rows`); dense (``sparse`` False): ``table`` a padded ``[S, W]`` block
    table of ``page``-entry pages (unit stride along a row), ``R = S s_q`` query rows, the
    lengths per run; sparse: ``table`` the ``[R, K]`` int32 top-k selection into the flattened
    entries (``-1`` unused). ``max_kv_len``: the longest dense row the split policy plans for
    (None: the table's capacity)."""
    R, H, _ = q.shape
    page = kv_pool.shape[1]
    if sparse:
        width = triton.cdiv(max(table.shape[1], 1), PAGE)
        longest = width * PAGE
    else:
        capacity = table.shape[1] * page
        width = triton.cdiv(capacity, PAGE)
        longest = capacity if max_kv_len is None else min(max_kv_len, capacity)
    if num_splits is None:
        num_splits = choose_splits(R, H, triton.cdiv(max(longest, 1), PAGE), PAGE, q.device, 2)
    o, lse, o_part, lse_part = split_outputs(R, H, D_V, q.dtype, q.device, num_splits, meta_output)
    if R * H == 0:
        return MlaPlan(o, lse, num_splits, ()), None
    meta = torch.device("meta")
    out = "fp32-split" if num_splits > 1 else "bf16"
    qs = q.stride()
    copy_q = not (qs[2] == 1 and qs[1] % 8 == 0 and qs[0] % 8 == 0)
    if copy_q:
        q = torch.empty(q.shape, dtype=q.dtype, device=meta)
    copy_table = not sparse and table.shape[1] > 1 and table.stride(1) != 1
    if sparse:
        compacted = torch.empty((R, width * PAGE), dtype=torch.int32, device=meta)
        lens = torch.empty((R,), dtype=torch.int32, device=meta)
        compact = compact_launch(table, compacted, lens)
    else:
        compacted = (
            torch.empty(table.shape, dtype=torch.int32, device=meta) if copy_table else table
        )
        lens, compact = torch.empty((R // s_q,), dtype=torch.int32, device=meta), None
    kernel = _fp8_launch(
        q, kv_pool, compacted, lens, o_part, lse_part, n_blocks_row=width,
        page=0 if sparse else page, scale=scale, s_q=s_q, causal=causal, out=out,
    )  # fmt: skip
    launches = [kernel]
    if num_splits > 1:
        launches.append(merge_launch(o_part, lse_part, o, lse))
    template = MlaPlan(o, lse, num_splits, tuple(launches))
    attend = Fp8SeesawAttend(kernel, compact, copy_q=copy_q, copy_table=copy_table)
    return template, attend
