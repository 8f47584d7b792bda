"""How kernels are timed (so that a GPU run measures the kernel, not a warm L2 or the host checks):
input sets rotated past the L2, every set called, the method recorded, and the hot paths that are
timed (the holder's batched call, the benchmarks) calling the kernels with their host-side checks
off.

The CUDA-graph path itself needs a GPU (the GPU check runs it); here its arithmetic, the
host-clock path and the arguments the timed calls pass.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch

from mqnc.measure import timing
from mqnc.model import PRESETS
from mqnc.serving import ChunkInfo, Holder, Requester
from mqnc.transport import LoopbackFabric, slot_bytes_for

L2_H200 = 60 * 2**20


@pytest.mark.parametrize(
    "working_set, l2, want",
    [
        (2_400_000, L2_H200, 53),  # the holder partial's 2.4 MB: 53 sets pass 2 x L2
        (128 * 2**20, L2_H200, 1),  # the splice goal's 127 MB: past twice the L2 alone
        (100 * 2**20, L2_H200, 2),  # between one and two L2s: two sets
        (1000, L2_H200, timing.MAX_INPUT_SETS),  # a few KB: capped
        (1000, 0, 1),  # off a GPU: one set
    ],
)
def test_input_sets_pass_twice_the_l2(working_set, l2, want):
    n = timing.input_sets(working_set, l2)
    assert n == want
    if l2 and n < timing.MAX_INPUT_SETS:
        assert n * working_set >= 2 * l2 > (n - 1) * working_set


def test_time_kernel_off_a_gpu_calls_every_set_and_says_how():
    calls = collections.Counter()
    sets = [lambda i=i: calls.update([i]) for i in range(3)]
    t = timing.time_kernel(sets, working_set_bytes=123, warmup=2, reps=6, cuda=False, checks="off")
    assert set(calls) == {0, 1, 2} and sum(calls.values()) == 8
    assert 0 <= t.p20 <= t.p50 <= t.p80 and t.percentiles == (t.p20, t.p50, t.p80)
    assert t.how["method"] == "host-clock" and t.how["input_sets"] == 3
    assert t.how["working_set_bytes"] == 123 and t.how["checks"] == "off"
    assert t.how["host_us"] == t.p50
    with pytest.raises(ValueError, match="calls"):
        timing.time_kernel([], cuda=False)


def test_holder_batches_call_the_kernels_with_checks_off(monkeypatch):
    """The holder builds its block tables and maps checked indices itself: its batched calls
    skip the kernels' host syncs (``check_inputs`` / ``check_indices``), as benchmarks time."""
    seen = {}

    def spy(name, real):
        def call(*args, **kwargs):
            seen[name] = kwargs
            return real(*args, **kwargs)

        return call

    geom = PRESETS["deepseek-v2-lite"].replace(layers=1, heads=2)
    fabric = LoopbackFabric(2, slot_bytes_for(geom, max_rows=8, max_topk=8), lanes=1)
    h = Holder(fabric.endpoint(0), geom, softmax_scale=0.1, num_blocks=1, poll_s=0.02)
    # the batcher calls the kernels through its pool's ops (mqnc.serving.compute.kernel_ops)
    ops = h.pages.ops
    monkeypatch.setattr(
        h.pages,
        "ops",
        types.SimpleNamespace(
            mla_decode_partial=spy("dense", ops.mla_decode_partial),
            mla_sparse_partial=spy("sparse", ops.mla_sparse_partial),
        ),
    )
    h.add_chunk(1, torch.zeros(1, 20, geom.d_qk, dtype=torch.bfloat16))
    h.start()
    try:
        r = Requester(fabric.endpoint(1), geom, softmax_scale=0.1, timeout_s=30.0)
        r.register(ChunkInfo(1, 20, 0, (0,)))
        q = torch.zeros(1, 2, geom.d_qk, dtype=torch.bfloat16)
        r.route(1, q, 0)
        r.route(1, q, 0, indices=torch.tensor([[0, 3]], dtype=torch.int32))
    finally:
        h.stop()
    assert seen["dense"]["check_inputs"] is False
    assert seen["sparse"]["check_indices"] is False


def test_bench_holder_times_the_kernel_with_checks_off(monkeypatch, tmp_path):
    from mqnc.triton_kernels.mla import decode as mla_decode
    from perf import bench_holder

    seen = []
    real = mla_decode.mla_decode_partial

    def spy(*args, **kwargs):
        seen.append(kwargs.get("check_inputs", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(mla_decode, "mla_decode_partial", spy)
    assert bench_holder.main(["--tiny", "--n", "1", "--out", str(tmp_path / "h.jsonl")]) == 0
    assert seen and not any(seen)


def test_time_fn_refuses_counts_it_cannot_time():
    bad = [(dict(reps=0), "reps"), (dict(warmup=-1), "warmup"),
           (dict(min_time_s=-1.0), "min_time_s"), (dict(reps=2.5), "reps")]  # fmt: skip
    for kw, needle in bad:
        with pytest.raises((ValueError, TypeError), match=needle):
            timing.time_fn(lambda: None, cuda=False, **kw)
    p20, p50, p80 = timing.time_fn(lambda: None, reps=1, warmup=0, cuda=False)
    assert 0 <= p20 <= p50 <= p80
