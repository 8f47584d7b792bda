"""Plan once, run many (FlashMLA's ``get_mla_metadata``, FlashInfer's ``plan()``).

A plan does every check and the split choice on the tensors it is made from; ``run`` takes new
tensors of the same shapes and launches, comparing only their shapes, strides, dtypes and
devices with the planning call's (a batch of another shape is refused, never cut to the plan).
The tests show that ``run`` gives the functional call's bits on new values (new query rows,
new lengths, new indices, refilled buffers), that it calls none of the checks, range checks or
the split search (they are made to fail after planning), and that the FlashMLA / FlashInfer
plans do the same. That ``run`` never syncs the host is checked where a sync would fail: inside
a CUDA graph capture
(``correctness/test_cuda_graph.py``, GPU tier).
"""

from __future__ import annotations

import math

import pytest
import torch

import mqnc.triton_kernels._core.grid as grid
import mqnc.triton_kernels._core.validate as checks
import mqnc.triton_kernels.mla.decode as mla_decode
import mqnc.triton_kernels.mla.sparse as mla_sparse
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.triton_kernels import (
    mla_decode_partial,
    mla_decode_partial_csr,
    mla_sparse_partial,
    plan_mla_decode,
    plan_mla_decode_csr,
    plan_mla_sparse,
)
from mqnc.triton_kernels.adapters.flashinfer import mla_paged_attention, plan_mla_paged_attention
from mqnc.triton_kernels.adapters.flashmla import mla_decode_with_kvcache, plan_mla_with_kvcache

D_QK, D_V = 576, 512
SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2
DEVICE = default_device()


def same(actual, expected, name):
    assert_close(actual, expected, tolerance("same_kernel", "float32"), name=name)


@pytest.fixture
def no_checks(monkeypatch):
    """After planning: every check, host range check and split search raises if called."""

    def boom(*args, **kwargs):
        raise AssertionError("called on the run path")

    def arm():
        for module, names in (
            (checks, ("check_tensor", "check_same_device", "check_softmax_scale")),
            (mla_decode, ("_check_paging", "_check_csr", "check_tensor", "check_launchable")),
            (mla_sparse, ("check_index_range", "check_tensor", "check_launchable")),
            (grid, ("choose_num_splits", "kernel_occupancy")),
        ):
            for name in names:
                monkeypatch.setattr(module, name, boom)

    return arm


def _inputs(gen, B=3, H=4, page=16, W=5):
    pool = torch.randn(B * W + 1, page, D_QK, generator=gen).to(DEVICE)
    table = torch.randperm(B * W + 1, generator=gen)[: B * W].view(B, W).to(DEVICE, torch.int32)
    q = torch.randn(B, H, D_QK, generator=gen).to(DEVICE)
    return q, pool, table


def test_dense_plan_runs_new_steps_like_the_call(no_checks):
    gen = torch.Generator().manual_seed(1)
    q, pool, table = _inputs(gen)
    lens = torch.tensor([70, 3, 40], dtype=torch.int32, device=DEVICE)
    plan = plan_mla_decode(q, pool, table, lens, softmax_scale=SCALE)
    assert plan.num_splits >= 1
    steps = []
    for step in range(3):  # the holder's steps: new rows, grown lengths, refilled buffers
        q_new = torch.randn(q.shape, generator=gen).to(DEVICE)
        lens_new = lens + step
        steps.append(
            (q_new, lens_new, mla_decode_partial(q_new, pool, table, lens_new, softmax_scale=SCALE))
        )
    no_checks()
    with pytest.raises(AssertionError, match="called on the run path"):  # the fixture bites
        mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE)
    out = (torch.empty(3, 4, D_V, device=DEVICE), torch.empty(3, 4, device=DEVICE))
    for q_new, lens_new, (o_ref, lse_ref) in steps:
        o, lse = plan.run(q_new, pool, table, lens_new)
        same(o, o_ref, "o")
        same(lse, lse_ref, "lse")
        o2, lse2 = plan.run(q_new, pool, table, lens_new, out=out)
        assert o2 is out[0] and lse2 is out[1]
        same(o2, o_ref, "o (out=)")


def test_out_is_written_in_full_like_the_call():
    """``out=`` of the three entry points and of the fp64 reference ops (the holder's output
    buffers, reused per batch shape): NaN-poisoned buffers come back written in full,
    bit-equal to the call without ``out``; a buffer unlike the outputs is refused by name."""
    from mqnc.serving.compute import ReferenceOps

    gen = torch.Generator().manual_seed(8)
    q, pool, table = _inputs(gen)
    lens = torch.tensor([70, 0, 40], dtype=torch.int32, device=DEVICE)  # an empty row too
    n = pool.shape[0] * pool.shape[1]
    idx = torch.randint(-1, n, (3, 20), generator=gen, dtype=torch.int32).to(DEVICE)
    indptr = torch.tensor([0, 5, 5, 8], dtype=torch.int32, device=DEVICE)
    pages = torch.cat([table[0], table[2, :3]])
    kw = dict(softmax_scale=SCALE)
    calls = {
        "decode": lambda **o: mla_decode_partial(q, pool, table, lens, **kw, **o),
        "csr": lambda **o: mla_decode_partial_csr(q, pool, indptr, pages, lens, **kw, **o),
        "sparse": lambda **o: mla_sparse_partial(q, pool, idx, **kw, **o),
        "decode (reference)": lambda **o: ReferenceOps.mla_decode_partial(
            q, pool, table, lens, **kw, **o
        ),
        "sparse (reference)": lambda **o: ReferenceOps.mla_sparse_partial(q, pool, idx, **kw, **o),
    }
    for name, call in calls.items():
        o_ref, lse_ref = call()
        out = (torch.full_like(o_ref, math.nan), torch.full_like(lse_ref, math.nan))
        o, lse = call(out=out)
        assert o is out[0] and lse is out[1], name
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref), name
        with pytest.raises((TypeError, ValueError), match=r"out"):
            call(out=(o_ref[:2].clone(), lse_ref[:2].clone()))
        with pytest.raises((TypeError, ValueError), match=r"out"):
            call(out=(o_ref.double(), lse_ref))
    # what torch.compile's path does with out= (the op's results copied in): checked alike
    from mqnc.triton_kernels.mla.plan import written_into

    o_ref, lse_ref = calls["decode"]()
    for bad in ((o_ref[:1].clone(), lse_ref), (o_ref, lse_ref.double()), (o_ref,)):
        with pytest.raises((TypeError, ValueError), match=r"out"):
            written_into(bad, (o_ref, lse_ref))


def test_split_cache_and_csr_plans(no_checks):
    gen = torch.Generator().manual_seed(2)
    q, pool, table = _inputs(gen)
    lens = torch.tensor([80, 16, 33], dtype=torch.int32, device=DEVICE)
    ckv, kpe = pool[..., :D_V].clone(), pool[..., D_V:].clone()
    indptr = torch.tensor([0, 5, 6, 9], dtype=torch.int32, device=DEVICE)
    indices = torch.cat([table[0], table[1, :1], table[2, :3]])
    split_plan = plan_mla_decode(q, ckv, table, lens, softmax_scale=SCALE, kpe_pool=kpe)
    csr_plan = plan_mla_decode_csr(q, pool, indptr, indices, lens, softmax_scale=SCALE)
    whole_pages = plan_mla_decode_csr(q, pool, indptr, indices, softmax_scale=SCALE)
    q2 = torch.randn(q.shape, generator=gen).to(DEVICE)
    ref_split = mla_decode_partial(q2, ckv, table, lens, softmax_scale=SCALE, kpe_pool=kpe)
    ref_csr = mla_decode_partial_csr(q2, pool, indptr, indices, lens, softmax_scale=SCALE)
    ref_pages = mla_decode_partial_csr(q2, pool, indptr, indices, softmax_scale=SCALE)
    no_checks()
    same(split_plan.run(q2, ckv, table, lens, kpe_pool=kpe)[0], ref_split[0], "split")
    same(csr_plan.run(q2, pool, indptr, indices, lens)[0], ref_csr[0], "csr")
    same(whole_pages.run(q2, pool, indptr, indices)[0], ref_pages[0], "csr, whole pages")


def test_sparse_plan_takes_new_indices_unchecked(no_checks):
    gen = torch.Generator().manual_seed(3)
    q, pool, _ = _inputs(gen)
    n = pool.shape[0] * pool.shape[1]
    idx = torch.randint(-1, n, (3, 70), generator=gen, dtype=torch.int32).to(DEVICE)
    plan = plan_mla_sparse(q, pool, idx, softmax_scale=SCALE)
    idx2 = torch.randint(-1, n, (3, 70), generator=gen, dtype=torch.int32).to(DEVICE)
    o_ref, lse_ref = mla_sparse_partial(q, pool, idx2, softmax_scale=SCALE)
    no_checks()
    o, lse = plan.run(q, pool, idx2)
    same(o, o_ref, "o")
    same(lse, lse_ref, "lse")


def test_layout_adapters_plan_once_too(no_checks):
    gen = torch.Generator().manual_seed(4)
    q, pool, table = _inputs(gen, B=2, H=4)
    q4 = torch.randn(2, 2, 4, D_QK, generator=gen).to(DEVICE)
    lens = torch.tensor([70, 20], dtype=torch.int32, device=DEVICE)
    mla_plan = plan_mla_with_kvcache(
        q4, pool[:, :, None], table, lens, softmax_scale=SCALE, causal=True
    )
    ref = mla_decode_with_kvcache(
        q4, pool[:, :, None], table, lens, softmax_scale=SCALE, causal=True
    )
    slots = torch.cat(
        [
            (table[b].long()[:, None] * 16 + torch.arange(16, device=DEVICE)).reshape(-1)[:n]
            for b, n in enumerate(lens.tolist())
        ]
    ).to(torch.int32)
    indptr = torch.tensor([0, 70, 90], dtype=torch.int32, device=DEVICE)
    ckv, kpe = pool[..., :D_V].reshape(-1, 1, D_V), pool[..., D_V:].reshape(-1, 1, D_QK - D_V)
    args = (q[:2, :, :D_V], q[:2, :, D_V:], ckv, kpe, indptr, slots, lens)
    fi_plan = plan_mla_paged_attention(*args, sm_scale=SCALE, return_lse=True)
    fi_ref = mla_paged_attention(*args, sm_scale=SCALE, return_lse=True)
    no_checks()
    o, lse = mla_plan.run(q4, pool[:, :, None], table, lens)
    same(o, ref[0], "flashmla o")
    same(lse, ref[1], "flashmla lse")
    o, lse2 = fi_plan.run(*args)
    same(o, fi_ref[0], "flashinfer o")
    same(lse2, fi_ref[1], "flashinfer lse (base 2)")


def test_empty_batches_plan_and_run():
    """No query rows: nothing to launch, empty outputs (dense, CSR, sparse)."""
    q = torch.zeros(0, 16, D_QK, device=DEVICE)
    pool = torch.zeros(2, 16, D_QK, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    plans = (
        (
            plan_mla_decode(q, pool, none.view(0, 1), none, softmax_scale=SCALE),
            (none.view(0, 1), none),
        ),
        (
            plan_mla_decode_csr(q, pool, none[:0].new_zeros(1), none, none, softmax_scale=SCALE),
            (none.new_zeros(1), none, none),
        ),
        (
            plan_mla_sparse(q, pool, none.new_zeros(0, 4), softmax_scale=SCALE),
            (none.new_zeros(0, 4),),
        ),
    )
    for plan, rest in plans:
        o, lse = plan.run(q, pool, *rest)
        assert o.shape == (0, 16, D_V) and lse.shape == (0, 16) and not plan.launches


def test_run_refuses_tensors_unlike_the_planned_ones(no_checks):
    """A run on a batch of another shape (more requests, other strides, another dtype) is a
    ValueError naming the argument, not a launch over the planned sizes that drops rows."""
    gen = torch.Generator().manual_seed(5)
    q, pool, table = _inputs(gen, B=2)
    lens = torch.tensor([30, 9], dtype=torch.int32, device=DEVICE)
    q4, _, table4 = _inputs(gen, B=4)
    plan = plan_mla_decode(q, pool, table, lens, softmax_scale=SCALE)
    mla_plan = plan_mla_with_kvcache(q[:, None], pool, table, lens, softmax_scale=SCALE)
    sparse = plan_mla_sparse(q, pool, table, softmax_scale=SCALE)
    rows = torch.tensor([0, 5, 10], dtype=torch.int32, device=DEVICE)
    fi_args = (q[..., :D_V], q[..., D_V:], pool[..., :D_V], pool[..., D_V:], rows,
               table.reshape(-1), lens)  # fmt: skip
    fi_plan = plan_mla_paged_attention(*fi_args, sm_scale=SCALE)
    no_checks()
    with pytest.raises(ValueError, match=r"q: expected shape \(2, 4, 576\).*as planned.*\(4, 4"):
        plan.run(q4, pool, table4, lens.repeat(2))
    with pytest.raises(ValueError, match="block_table: expected shape"):
        plan.run(q, pool, table.t().contiguous().t(), lens)  # same values, other strides
    with pytest.raises(ValueError, match="q: expected shape"):
        plan.run(q.to(torch.float64), pool, table, lens)
    with pytest.raises(TypeError, match="cache_seqlens: expected a torch.Tensor"):
        plan.run(q, pool, table, lens.tolist())
    with pytest.raises(ValueError, match=r"q: expected shape \(2, 1, h_q, d\) \(as planned\)"):
        mla_plan.run(q4[:, None], pool, table4, lens.repeat(2))
    with pytest.raises(ValueError, match="indices: expected shape"):
        sparse.run(q, pool, table[:, :1].contiguous())
    with pytest.raises(ValueError, match="q_nope: expected shape"):
        fi_plan.run(q4[..., :D_V], *fi_args[1:])
    # an out= the kernels would write through the planned strides: refused before the launch
    o, lse = plan.run(q, pool, table, lens)
    wide = torch.full((2, 4, 2 * D_V), float("nan"), device=DEVICE)
    for bad, what in (
        ((wide[..., :D_V], lse.clone()), r"out\[0\] \(o\): expected a contiguous tensor"),
        ((o.to(torch.float64), lse.clone()), r"out\[0\] \(o\): .*torch.float64"),
        ((o.clone(), lse[:1].clone()), r"out\[1\] \(lse\): expected .*shape \(2, 4\)"),
        ((o.clone()[:1], lse.clone()), r"out\[0\] \(o\): expected .*shape \(2, 4, 512\)"),
    ):
        with pytest.raises(ValueError, match=what):
            plan.run(q, pool, table, lens, out=bad)
    with pytest.raises(TypeError, match="out: expected a pair"):
        plan.run(q, pool, table, lens, out=o)
    assert torch.isnan(wide).all()  # nothing was written
