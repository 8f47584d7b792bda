"""The Gluon kernels' launch-exact sm_90 compiles: each launch compiled as a run makes it (its
own arguments through ``JITFunction.warmup`` under :mod:`~mqnc.triton_kernels.sm90.compile`'s
compile-only driver; CPU tensors stand in, only their dtypes, shapes and alignment matter).
Gluon compiles need ``TRITON_INTERPRET=0`` and triton 3.6's Gluon API."""

from __future__ import annotations

import torch

from mqnc.triton_kernels.mla.gluon import D_QK, D_V, PAGE, _check, gluon_decode_launches
from mqnc.triton_kernels.mla.gluon_plan import plan_seesaw, table_launch
from mqnc.triton_kernels.mla.plan import split_outputs
from mqnc.triton_kernels.sm90.compile import _compile_only

__all__ = ["compile_gluon_decode", "compile_fp8_seesaw", "compile_seesaw", "compile_sparse_seesaw"]


def compile_gluon_decode(
    *,
    batch: int,
    heads: int,
    max_blocks: int,
    num_splits: int,
    block_n: int = 64,
    schedule: str = "sync",
):
    """Compile the Gluon kernel for sm_90 exactly as a launch at these values would (the
    launch's own arguments through ``JITFunction.warmup`` under ``sm90.compile``'s compile-only
    driver; CPU tensors stand in, only their dtypes, shapes and alignment matter). Returns
    ``(launch name, CompiledKernel)``. Needs ``TRITON_INTERPRET=0`` and triton 3.6's Gluon."""
    num_pages = max(batch * max_blocks, 1)
    c = _check(
        torch.empty(batch, 1, heads, D_QK, dtype=torch.bfloat16),
        torch.empty(num_pages, PAGE, 1, D_QK, dtype=torch.bfloat16),
        torch.zeros(batch, max_blocks, dtype=torch.int32),
        torch.zeros(batch, dtype=torch.int32),
        D_QK**-0.5,
        False,
        num_splits,
        block_n,
        schedule,
    )
    _, _, launches = gluon_decode_launches(
        c, causal=False, num_splits=num_splits, block_n=block_n, schedule=schedule
    )
    ln = launches[0]
    with _compile_only(90):
        return ln.name, ln.kernel.warmup(*ln.args, grid=ln.grid, **ln.kwargs)


def compile_seesaw(
    *,
    rows: int,
    heads: int,
    s_q: int = 1,
    num_splits: int,
    page: int = PAGE,
    csr: bool = False,
    split_cache: bool = False,
):
    """Compile the default path's launches of a see-saw plan for sm_90, exactly as a run makes
    them (the plan's own launches, its descriptors made as a run makes them; CPU tensors stand
    in, only their dtypes, shapes and alignment matter): ``[(launch name, CompiledKernel)]``,
    the see-saw kernel, then the table kernel when the plan converts its table; ``split_cache``:
    FlashInfer's ``ckv`` / ``kpe`` cache (the split variant). Needs ``TRITON_INTERPRET=0`` and
    triton 3.6's Gluon."""
    S = rows // s_q
    q = torch.empty(rows, heads, D_QK, dtype=torch.bfloat16)
    blocks = max(S, 1) * 4
    pool = torch.empty(blocks, page, D_V if split_cache else D_QK, dtype=torch.bfloat16)
    kpe = torch.empty(blocks, page, D_QK - D_V, dtype=torch.bfloat16) if split_cache else None
    lens = torch.zeros(S, dtype=torch.int32)
    if csr:
        indptr, table = torch.zeros(S + 1, dtype=torch.int32), torch.zeros(S * 4, dtype=torch.int32)
    else:
        indptr, table = None, torch.zeros(S, 4, dtype=torch.int32)
    template, attend = plan_seesaw(
        q, pool, table, lens, indptr, scale=D_QK**-0.5, num_splits=num_splits, s_q=s_q,
        causal=s_q > 1, csr=csr, max_kv_len=None, kpe_pool=kpe,
    )  # fmt: skip
    kernel = template.launches[0]
    s = attend.shape
    out_table = torch.zeros((S, s.W), dtype=torch.int32) if s.convert else table
    _, _, o_part, lse_part = split_outputs(rows, heads, D_V, q.dtype, q.device, num_splits)
    first = (attend._q(q), *attend._kv(pool, kpe), out_table, lens, o_part, lse_part)
    out = []
    with _compile_only(90):
        rest = kernel.args[len(first) :]
        c = kernel.kernel.warmup(*first, *rest, grid=kernel.grid, **kernel.kwargs)
        out.append((kernel.name, c))
        if s.convert:
            conv = table_launch(
                table, indptr, lens, out_table, torch.zeros(S, dtype=torch.int32), page=page,
                csr=csr,
            )  # fmt: skip
            out.append((conv.name, conv.kernel.warmup(*conv.args, grid=conv.grid, **conv.kwargs)))
    return out


def compile_sparse_seesaw(*, rows: int, heads: int, topk: int, num_splits: int, page: int = 64):
    """Compile the sparse gather see-saw's launches for sm_90 as a run makes them (CPU tensors
    stand in): ``[(launch name, CompiledKernel)]``, the kernel then the compaction."""
    from mqnc.triton_kernels.mla.gluon_plan import compact_launch, plan_sparse_seesaw

    q = torch.empty(rows, heads, D_QK, dtype=torch.bfloat16)
    pool = torch.empty(max(rows, 1) * 4, page, D_QK, dtype=torch.bfloat16)
    indices = torch.zeros(rows, topk, dtype=torch.int32)
    template, attend = plan_sparse_seesaw(q, pool, indices, scale=D_QK**-0.5, num_splits=num_splits)
    kernel = template.launches[0]
    table = torch.zeros(attend._shape, dtype=torch.int32)
    lens = torch.zeros(rows, dtype=torch.int32)
    _, _, o_part, lse_part = split_outputs(rows, heads, D_V, q.dtype, q.device, num_splits)
    first = (q, pool, table, lens, o_part, lse_part)
    compact = compact_launch(indices, table, lens)
    with _compile_only(90):
        rest = kernel.args[len(first) :]
        c = kernel.kernel.warmup(*first, *rest, grid=kernel.grid, **kernel.kwargs)
        k = compact.kernel.warmup(*compact.args, grid=compact.grid, **compact.kwargs)
    return [(kernel.name, c), (compact.name, k)]


def compile_fp8_seesaw(
    *,
    rows: int,
    heads: int,
    num_splits: int,
    topk: int | None = None,
    page: int = PAGE,
    blocks: int = 4,
    s_q: int = 1,
):
    """Compile the FP8 see-saw's launches for sm_90 as a run makes them (CPU tensors stand in):
    sparse (``topk`` given: the kernel then the compaction) or dense (a padded table ``blocks``
    pages wide, ``s_q`` query tokens a sequence, causal when more than one):
    ``[(launch name, CompiledKernel)]``."""
    from mqnc.triton_kernels.mla.gluon_plan import fp8_views, plan_fp8_seesaw

    q = torch.empty(rows, heads, D_QK, dtype=torch.bfloat16)
    S = rows // s_q
    pool = torch.empty(max(S, 1) * blocks, page, 656, dtype=torch.uint8)
    sparse = topk is not None
    table = torch.zeros((rows, topk) if sparse else (S, blocks), dtype=torch.int32)
    template, attend = plan_fp8_seesaw(
        q, pool, table, scale=D_QK**-0.5, num_splits=num_splits, sparse=sparse, s_q=s_q,
        causal=s_q > 1,
    )  # fmt: skip
    kernel = template.launches[0]
    _, _, o_part, lse_part = split_outputs(rows, heads, D_V, q.dtype, q.device, num_splits)
    if sparse:
        from mqnc.triton_kernels.mla.gluon_plan import compact_launch

        compacted = torch.zeros(attend._shape, dtype=torch.int32)
        lens = torch.zeros(rows, dtype=torch.int32)
        compact = compact_launch(table, compacted, lens)
    else:
        compacted, lens, compact = table, torch.zeros(S, dtype=torch.int32), None
    first = (q, *fp8_views(pool)[:3], compacted, lens, o_part, lse_part)
    out = []
    with _compile_only(90):
        rest = kernel.args[len(first) :]
        out.append(
            (kernel.name, kernel.kernel.warmup(*first, *rest, grid=kernel.grid, **kernel.kwargs))
        )
        if compact is not None:
            k = compact.kernel.warmup(*compact.args, grid=compact.grid, **compact.kwargs)
            out.append((compact.name, k))
    return out
