"""The routed holder step in a CUDA graph (no per-call host work on a GPU): plans replace the
per-call checks, so the device work of a step can be captured once and replayed.

The step is the holder's: ``RouteBatcher`` (``mqnc.serving.batching``) batches every waiting
route row of every requester into one ``mla_decode_partial`` call per layer (and one
``mla_sparse_partial`` call for selections, §6.3), then the requester merges the holders'
partials. The batcher builds its page table on the host (and times the call with a device sync):
that host work stays outside any graph. Its kernel calls are recorded here as it makes them
(its pool's ``ops.mla_decode_partial`` / ``ops.mla_sparse_partial`` wrapped, nothing else changed);
each is planned once (:func:`plan_mla_decode`, :func:`plan_mla_sparse`: every check and the
split choice), and the step is the plans' runs on static input buffers plus the M-way merge
with ``check_lse=False``.

- On every device: the plans reproduce the batcher's calls bit for bit.
- GPU tier (``gpu`` marker, ``perf/gpu_check.sh``): the step is captured in a CUDA graph
  (``torch.cuda.graph``; a host sync or a blocking copy inside would fail the capture) and
  replayed for new query rows and new lengths refilled into the static buffers, each replay
  bit-identical to the same step run eagerly; and ``torch.compile(fullgraph=True,
  mode="reduce-overhead")`` (Inductor with CUDA graphs) of the step through the public
  functions gives the eager bits.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from mqnc.model.geometry import get_preset
from mqnc.serving.batching import HostedChunk, RouteBatcher, RouteJob
from mqnc.serving.pool import PagedPool
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.transport import wire
from mqnc.triton_kernels import (
    merge_partials,
    mla_decode_partial,
    mla_sparse_partial,
    plan_mla_decode,
    plan_mla_sparse,
)

GEOMETRY = get_preset("deepseek-v2-lite")
SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2
DEVICE = default_device()
HEADS = 16
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def same(actual, expected, name):
    assert_close(actual, expected, tolerance("same_kernel", expected.dtype), name=name)


def _holder(gen, tokens, device):
    """A holder's pool (one layer, pages of 64, bf16) hosting one chunk of ``tokens``."""
    pool = PagedPool(
        1, 2 + math.ceil(tokens / 64), 64, GEOMETRY.d_qk, dtype=torch.bfloat16, device=device
    )
    blocks = pool.alloc(tokens)
    pool.write(blocks, torch.randn(1, tokens, GEOMETRY.d_qk, generator=gen).to(torch.bfloat16))
    chunk = HostedChunk(0, tokens, 0, torch.tensor(blocks, dtype=torch.int32))
    return pool, chunk


def _jobs(gen, chunk, requesters, rows, topk=None):
    """One route request per requester, ``rows`` query tokens each (a selection of ``topk``
    chunk-local entries per token when given)."""
    jobs = []
    for r in range(requesters):
        header = wire.Header(
            wire.Kind.ROUTE, request_id=r, batch=rows, heads=HEADS, width=GEOMETRY.d_qk,
            topk=topk or 0,
        )  # fmt: skip
        q = torch.randn(rows, HEADS, GEOMETRY.d_qk, generator=gen).to(torch.bfloat16)
        idx = None
        if topk:
            idx = torch.randint(-1, chunk.tokens, (rows, topk), generator=gen, dtype=torch.int32)
            idx = idx.numpy()
        # as the holder receives them: the rows' bytes and the selection on the host
        jobs.append(
            RouteJob(r, 0, header, q.view(torch.uint8).numpy().reshape(rows, -1), idx, chunk)
        )
    return jobs


def recorded_holder_calls(monkeypatch, gen):
    """Two holders' batched dense calls and one sparse call, exactly as ``RouteBatcher`` makes
    them: ``[(fn, args, kwargs, (o, lse)), ...]``."""
    calls = []

    def recorder(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            # recorded without the batcher's reused output buffers (out=): the plans make theirs
            calls.append((fn, args, {k: v for k, v in kwargs.items() if k != "out"}, out))
            return out

        return wrapped

    # The batcher calls its pool's kernel ops (``mqnc.serving.compute.kernel_ops``); record them.
    recording = types.SimpleNamespace(
        mla_decode_partial=recorder(mla_decode_partial),
        mla_sparse_partial=recorder(mla_sparse_partial),
    )
    for tokens, sparse in ((260, False), (130, False), (260, True)):
        pool, chunk = _holder(gen, tokens, DEVICE)
        assert pool.ops.mla_decode_partial is mla_decode_partial
        monkeypatch.setattr(pool, "ops", recording)
        batcher = RouteBatcher(pool, GEOMETRY, SCALE, None, None, None, f"holder-{tokens}")
        jobs = _jobs(gen, chunk, 2, 2, topk=64) if sparse else _jobs(gen, chunk, 3, 2)
        rows = sum(j.header.batch for j in jobs)
        out = batcher._outputs(rows, HEADS, torch.bfloat16)[:2]  # as RouteBatcher.answer
        (batcher._sparse if sparse else batcher._dense)(jobs, 0, rows, out)
    return calls


def _plan(fn, args, kwargs):
    if fn is mla_decode_partial:
        return plan_mla_decode(*args, **kwargs)
    return plan_mla_sparse(*args, **kwargs)


def test_plans_reproduce_the_holders_batched_calls(monkeypatch):
    calls = recorded_holder_calls(monkeypatch, torch.Generator().manual_seed(0))
    assert [c[0] for c in calls] == [mla_decode_partial, mla_decode_partial, mla_sparse_partial]
    for fn, args, kwargs, (o_ref, lse_ref) in calls:
        o, lse = _plan(fn, args, kwargs).run(*args)
        same(o, o_ref, f"{fn.__name__} o")
        same(lse, lse_ref, f"{fn.__name__} lse")


@pytest.mark.gpu
@gpu
def test_routed_holder_step_replays_exactly_in_a_cuda_graph(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    calls = recorded_holder_calls(monkeypatch, gen)
    (_, dense_a, kw, _), (_, dense_b, _, _), (_, sparse_a, kw_s, _) = calls
    # static inputs: the rows routed to both holders, each holder's lengths, the selection
    q = dense_a[0].clone()
    lens_a, lens_b = dense_a[3].clone(), dense_b[3].clone()
    idx = sparse_a[2].clone()
    q_sel = sparse_a[0].clone()
    plans = (
        plan_mla_decode(q, dense_a[1], dense_a[2], lens_a, **kw),
        plan_mla_decode(q, dense_b[1], dense_b[2], lens_b, **kw),
        plan_mla_sparse(q_sel, sparse_a[1], idx, **kw_s),
    )
    assert plans[0].num_splits > 1  # the split-KV combine is captured too

    def step():
        o_a, l_a = plans[0].run(q, dense_a[1], dense_a[2], lens_a)
        o_b, l_b = plans[1].run(q, dense_b[1], dense_b[2], lens_b)
        o, lse = merge_partials(
            torch.stack([o_a, o_b]), torch.stack([l_a, l_b]), check_lse=False, layout="MBHD"
        )
        return o, lse, *plans[2].run(q_sel, sparse_a[1], idx)

    side = torch.cuda.Stream()  # warm up (compiles, fills the allocator) off the capture stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    for k in range(3):  # new rows each step, shorter lengths on one holder, a new selection
        q.copy_(torch.randn(q.shape, generator=gen).to(DEVICE, q.dtype))
        q_sel.copy_(torch.randn(q_sel.shape, generator=gen).to(DEVICE, q.dtype))
        lens_b.copy_((dense_b[3] - 29 * k).clamp(min=0))
        idx.copy_(torch.randint(-1, 260, idx.shape, generator=gen, dtype=torch.int32).to(DEVICE))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for name, got, want in zip(
            ("o", "lse", "sparse o", "sparse lse"), static_out, eager, strict=True
        ):
            same(got, want, f"replay {k}: {name}")


@pytest.mark.gpu
@gpu
def test_compiled_holder_step_with_cuda_graphs(monkeypatch):
    """``torch.compile(fullgraph=True, mode="reduce-overhead")``: the public functions route to
    the ``torch.ops.mqnc`` ops (checks off: nothing syncs), Inductor records a CUDA graph and
    replays it; every call equals eager."""
    calls = recorded_holder_calls(monkeypatch, torch.Generator().manual_seed(2))
    (_, (q, kv_a, t_a, l_a), kw, _), (_, (_, kv_b, t_b, l_b), _, _) = calls[:2]

    def step(q, l_a, l_b):
        args = dict(softmax_scale=SCALE, d_v=GEOMETRY.d_v, check_inputs=False)
        o_a, s_a = mla_decode_partial(q, kv_a, t_a, l_a, **args)
        o_b, s_b = mla_decode_partial(q, kv_b, t_b, l_b, **args)
        return merge_partials(
            torch.stack([o_a, o_b]), torch.stack([s_a, s_b]), check_lse=False, layout="MBHD"
        )

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator().manual_seed(3)
    for k in range(4):  # warm-up, record, replays
        q_k = torch.randn(q.shape, generator=gen).to(DEVICE, q.dtype)
        l_b_k = (l_b - 11 * k).clamp(min=0)
        got = [t.clone() for t in compiled(q_k, l_a, l_b_k)]
        want = step(q_k, l_a, l_b_k)
        same(got[0], want[0], f"call {k}: o")
        same(got[1], want[1], f"call {k}: lse")
