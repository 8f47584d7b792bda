"""Holder and requester over the loopback engine: route / fetch / local / probe against fp64
references, dispatcher batching, the query rotation, bad requests and cost records."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from mqnc.model import PRESETS, RopeSpec
from mqnc.reference import (
    merge_reference,
    mla_sparse_reference,
    partial_attention_reference,
    rope_rotate_reference,
)
from mqnc.serving import ChunkInfo, Holder, RemoteError, Requester
from mqnc.testing import TOLERANCES, assert_close, default_device
from mqnc.transport import INBOX, REPLY, LoopbackFabric, slot_bytes_for, wire

DEVICE = default_device()  # where the kernels run: the GPU when there is one

GEOM = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=4)
ROPE = RopeSpec.from_preset("deepseek-v2-lite")
SCALE = ROPE.softmax_scale
# Slots sized for fp32 rows and entries (the fp32 tests), which also fit bf16.
SLOT = slot_bytes_for(
    GEOM.replace(cache_dtype="fp32", wire_dtype="fp32"),
    max_rows=64,
    max_topk=64,
    max_chunk_tokens=128,
)


def _chunk(seed, tokens, dtype=torch.bfloat16, std=0.5):
    g = torch.Generator().manual_seed(seed)
    return (std * torch.randn(GEOM.layers, tokens, GEOM.d_qk, generator=g)).to(dtype)


def _q(seed, B, dtype=torch.bfloat16, std=0.5):
    g = torch.Generator().manual_seed(seed)
    return (std * torch.randn(B, GEOM.heads, GEOM.d_qk, generator=g)).to(dtype)


def _all(B, n):
    return torch.ones(B, n, dtype=torch.bool)


class Setup:
    """Rank 0 holds the chunks (served from a thread), ranks 1.. are requesters."""

    def __init__(
        self,
        chunks: dict[int, torch.Tensor],
        *,
        world=2,
        dtype=torch.bfloat16,
        start=True,
        timeout_s=20.0,
        lanes=2,
        model=None,
        kernels="triton",
    ):
        self.fabric = LoopbackFabric(world, SLOT, lanes=lanes)
        self.holder = Holder(
            self.fabric.endpoint(0),
            GEOM,
            softmax_scale=SCALE,
            num_blocks=8,
            dtype=dtype,
            poll_s=0.02,
            kernels=kernels,
        )
        for cid, kv in chunks.items():
            self.holder.add_chunk(cid, kv, position=0)
        self.requesters = [
            Requester(
                self.fabric.endpoint(r),
                GEOM,
                softmax_scale=SCALE,
                rope=ROPE,
                timeout_s=timeout_s,
                pool_blocks=8,
                dtype=dtype,
                model=model,
                kernels=kernels,
            )
            for r in range(1, world)
        ]
        for req in self.requesters:
            for cid, kv in chunks.items():
                req.register(ChunkInfo(cid, kv.shape[1], 0, (0,)))
        if start:
            self.holder.start()

    def close(self):
        if self.holder._thread is not None:
            self.holder.stop()
        assert self.holder.failure is None


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_route_rotation_and_fetch_splice_agree_with_keys_at_the_new_position(kernels):
    """§3.2: rotating q by -delta and attending canonical keys equals attending keys re-encoded
    at the requester's offset; fetch's splice (§2.2) gives the same. fp32 end to end, by the
    Triton kernels and by their torch references (``kernels="torch"``, mqnc.serving.compute)."""
    kv = _chunk(1, 100, torch.float32)
    s = Setup({5: kv}, dtype=torch.float32, kernels=kernels)
    try:
        req = s.requesters[0]
        q = _q(2, 3, torch.float32)
        offset = 12_345
        keys_new = rope_rotate_reference(kv[1], offset, ROPE)  # keys as seen at the offset
        o_ref, lse_ref = partial_attention_reference(q, keys_new, _all(3, 100), SCALE)
        routed = req.route(5, q, 1, offset=offset)
        s1 = assert_close(routed.o, o_ref, TOLERANCES[("mla", "float32")], name="routed o")
        s2 = assert_close(routed.lse, lse_ref, TOLERANCES[("mla_lse", "float32")], name="lse")
        print(f"fp32 route with rotation: o {s1}; lse {s2}")
        lc = req.fetch(5, offset=offset)
        local = req.attend_local(lc, q, 1)
        s1 = assert_close(local.o, o_ref, TOLERANCES[("mla", "float32")], name="fetched o")
        s2 = assert_close(local.lse, lse_ref, TOLERANCES[("mla_lse", "float32")], name="lse")
        print(f"fp32 fetch + splice: o {s1}; lse {s2}")
        rec = req.costs[-1]
        assert rec.primitive == "fetch" and rec.splice_us > 0
        assert rec.bytes_recv == wire.HEADER_BYTES + GEOM.chunk_bytes(100) * 2  # fp32 entries
        o, lse, _ = req.merge([routed, local], kernels=kernels)
        o_ref, lse_ref = merge_reference(
            torch.stack([routed.o, local.o]), torch.stack([routed.lse, local.lse])
        )
        assert_close(o, o_ref, TOLERANCES[("merge", "float32")], name="merged o")
        assert_close(lse, lse_ref, TOLERANCES[("merge_lse", "float32")], name="merged lse")
    finally:
        s.close()


def test_route_bf16_matches_reference_over_the_sent_rows():
    """bf16: the routed partial equals the fp64 attention of the rows actually sent (q rotated
    by the splice module's kernel, whose own accuracy test_splice checks) over the chunk."""
    from mqnc.triton_kernels.splice.rotate import rope_rotate

    kv = _chunk(3, 128)
    s = Setup({7: kv})
    try:
        req = s.requesters[0]
        q = _q(4, 2)
        sent = rope_rotate(q.to(default_device()), -777, ROPE).cpu()  # where the kernels run
        o_ref, lse_ref = partial_attention_reference(sent, kv[0], _all(2, 128), SCALE)
        part = req.route(7, q, 0, offset=777)
        assert part.o.dtype == torch.bfloat16 and part.lse.dtype == torch.float32
        assert_close(part.o, o_ref, TOLERANCES[("mla", "bfloat16")], name="o")
        assert_close(part.lse, lse_ref, TOLERANCES[("mla_lse", "float32")], name="lse")
    finally:
        s.close()


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_dispatcher_batches_waiting_requesters_into_one_call(kernels):
    """§6.3: route requests of two requesters (different chunks, same layer) waiting on one
    holder run as ONE dense kernel call; a selection request runs as one sparse call. By the
    kernels and by their torch references."""
    chunks = {1: _chunk(5, 70), 2: _chunk(6, 128)}
    s = Setup(chunks, world=3, start=False, kernels=kernels)
    r1, r2 = s.requesters
    q1, q2 = _q(7, 2), _q(8, 3)
    idx = torch.tensor([[0, 5, 69, -1], [3, 3, 10, 20]], dtype=torch.int32)
    out = {}

    def call(key, req, *args, **kw):
        out[key] = req.route(*args, **kw)

    threads = [
        threading.Thread(target=call, args=("a", r1, 1, q1, 1)),
        threading.Thread(target=call, args=("b", r2, 2, q2, 1)),
        threading.Thread(target=call, args=("c", r1, 1, q1, 1), kwargs=dict(indices=idx)),
    ]
    for t in threads:
        t.start()
    inboxes = [s.fabric.layout.slot(INBOX, src, lane) for src in (1, 2) for lane in (0, 1)]
    deadline = time.monotonic() + 20
    while sum(s.holder.transport.signal(x) > 0 for x in inboxes) < 3:
        assert time.monotonic() < deadline, "requests did not arrive"
        time.sleep(0.01)
    assert s.holder.serve_once(1.0) == 3
    for t in threads:
        t.join(20)
    assert sorted(s.holder.stats.batch_requests) == [1, 2]  # one dense call of 2, one sparse
    assert s.holder.stats.kernel_calls == 2
    tol, tol_lse = TOLERANCES[("mla", "bfloat16")], TOLERANCES[("mla_lse", "float32")]
    for key, q, cid in (("a", q1, 1), ("b", q2, 2)):
        kv = chunks[cid][1]
        o_ref, lse_ref = partial_attention_reference(q, kv, _all(q.shape[0], kv.shape[0]), SCALE)
        assert_close(out[key].o, o_ref, tol, name=f"{key} o")
        assert_close(out[key].lse, lse_ref, tol_lse, name=f"{key} lse")
    pool = chunks[1][1].reshape(1, 70, GEOM.d_qk)
    o_ref, lse_ref = mla_sparse_reference(q1, pool, idx, SCALE)
    assert_close(out["c"].o, o_ref, tol, name="sparse o")
    assert_close(out["c"].lse, lse_ref, tol_lse, name="sparse lse")
    # The records of a batched call report the whole batch's kernel time.
    assert out["a"].record.compute_us == out["b"].record.compute_us > 0


def test_local_through_the_model_and_attend_policy():
    kv = _chunk(9, 90)
    calls = []

    def model(chunk_id, offset):
        calls.append((chunk_id, offset))
        return kv

    s = Setup({3: kv}, model=model, start=False)  # the holder never answers
    try:
        req = s.requesters[0]
        req.timeout_s = 0.3
        q = _q(10, 2)
        part = req.attend(3, q, 0, order=("local",))
        assert part.primitive == "local" and calls == [(3, 0)]
        o_ref, lse_ref = partial_attention_reference(q, kv[0], _all(2, 90), SCALE)
        assert_close(part.o, o_ref, TOLERANCES[("mla", "bfloat16")], name="local o")
        assert_close(part.lse, lse_ref, TOLERANCES[("mla_lse", "float32")], name="local lse")
        rec = [c for c in req.costs if c.primitive == "local"][0]
        assert rec.prefill_us > 0
    finally:
        s.close()


def test_probe_and_cost_terms():
    s = Setup({1: _chunk(11, 64)})
    try:
        req = s.requesters[0]
        rt = req.probe(0)
        assert rt > 0 and req.last_probe_us[0] == rt and s.holder.stats.probes == 1
        part = req.route(1, _q(12, 2), 0)
        r = part.record
        assert r.ok and r.primitive == "route" and r.peer == 0 and r.m_q == 2 * GEOM.heads
        assert r.probe_us == rt and r.transfer_us > 0 and r.compute_us > 0
        assert r.total_us >= r.compute_us and r.return_us >= 0
        assert r.bytes_sent == wire.HEADER_BYTES + r.m_q * GEOM.q_row_bytes
        assert r.bytes_recv == wire.HEADER_BYTES + r.m_q * GEOM.p_row_bytes
        assert set(r.to_dict()) >= {
            "probe_us",
            "transfer_us",
            "compute_us",
            "return_us",
            "merge_us",
            "splice_us",
            "prefill_us",
        }
    finally:
        s.close()


def test_bad_requests_get_an_error_and_the_holder_keeps_serving():
    s = Setup({1: _chunk(13, 64)})
    try:
        req = s.requesters[0]
        req.register(ChunkInfo(99, 64, 0, (0,)))  # the directory is wrong about chunk 99
        with pytest.raises(RemoteError, match="chunk 99 is not hosted"):
            req.route(99, _q(14, 1), 0)
        # An index outside the chunk: the requester refuses it before anything is sent...
        with pytest.raises(ValueError, match="indices"):
            req.route(1, _q(14, 1), 0, indices=torch.tensor([[0, 64]], dtype=torch.int32))
        # ...and the holder answers a raw ROUTE carrying it with an ERROR.
        t = req.transport
        reply = t.layout.slot(REPLY, 0, 1)
        idx = torch.tensor([[0, 64]], dtype=torch.int32)
        raw = wire.pack_query(
            _q(14, 1), request_id=9, seq=40, chunk_id=1, layer=0, indices=idx, geometry=GEOM
        )
        t.put_signal(0, t.layout.slot(INBOX, 1, 1), raw, 40)
        t.wait_signal(reply, 40, 10.0)
        h, text = wire.unpack_error(wire.read_message(t, reply))
        assert h.seq == 40 and "indices" in text
        # A corrupt message straight into the holder's inbox: an ERROR for that slot only.
        bad = wire.pack_probe(request_id=1, seq=50)
        bad[10] ^= 0xFF
        t.put_signal(0, t.layout.slot(INBOX, 1, 1), bad, 50)
        t.wait_signal(reply, 50, 10.0)
        h, text = wire.unpack_error(wire.read_message(t, reply))
        assert h.seq == 50 and "CRC" in text
        # The lane's next request moves past the injected numbers on its own.
        part = req.route(1, _q(15, 2), 1)  # still serving
        assert part.o.shape == (2, GEOM.heads, GEOM.d_v)
        assert s.holder.stats.errors == 3
    finally:
        s.close()


def test_argument_errors():
    s = Setup({1: _chunk(16, 64)}, start=False)
    req = s.requesters[0]
    q = _q(17, 2)
    with pytest.raises(ValueError, match=r"q: expected shape \(B, H, 576\)"):
        req.route(1, q[..., :512], 0)
    with pytest.raises(TypeError, match="q: invalid dtype"):
        req.route(1, q.float(), 0)
    with pytest.raises(KeyError, match="chunk 2 is not in the directory"):
        req.route(2, q, 0)
    with pytest.raises(ValueError, match="layer"):
        req.route(1, q, 2)
    with pytest.raises(ValueError, match="canonical positions"):
        req.route(1, q, 0, offset=5, indices=torch.zeros(2, 3, dtype=torch.int32))
    norope = Requester(s.fabric.endpoint(1), GEOM, softmax_scale=SCALE)
    norope.register(ChunkInfo(1, 64, 0, (0,)))
    with pytest.raises(ValueError, match="rope"):
        norope.route(1, q, 0, offset=5)
    with pytest.raises(ValueError, match="timeout_s"):
        Requester(s.fabric.endpoint(1), GEOM, softmax_scale=SCALE, timeout_s=0)
    with pytest.raises(ValueError, match=r"kernels: expected one of \('triton', 'torch'\)"):
        Requester(s.fabric.endpoint(1), GEOM, softmax_scale=SCALE, kernels="cuda")
    with pytest.raises(ValueError, match="kernels"):
        Holder(s.fabric.endpoint(1), GEOM, softmax_scale=SCALE, num_blocks=1, kernels=None)
    with pytest.raises(ValueError, match="kv: expected shape"):
        s.holder.add_chunk(4, _chunk(1, 8)[:1])
    with pytest.raises(ValueError, match="already hosted"):
        s.holder.add_chunk(1, _chunk(1, 8))
    with pytest.raises(ValueError, match="blocks"):
        s.holder.add_chunk(5, _chunk(1, 64 * 8))


@pytest.mark.parametrize("rows", [1, 5])
def test_torch_path_by_row_slices_is_the_whole_batch(rows):
    """The torch path attends a holder's batch in slices of rows (its cost then stays linear in
    the rows); dense and sparse calls equal the fp64 references over the whole batch, with
    NaN in the pool's unused slots (a slice that read them would fail)."""
    from mqnc.reference import mla_decode_reference, mla_sparse_reference
    from mqnc.serving.compute import ROWS_PER_SLICE, ReferenceOps
    from mqnc.testing import tolerance

    assert ROWS_PER_SLICE == 2  # 5 rows: two whole slices and a short one
    g = torch.Generator().manual_seed(rows)
    pool = torch.randn(12, 16, 576, generator=g).to(torch.bfloat16)
    pool[-1] = float("nan")  # never in a block table, never selected
    q = torch.randn(rows, 16, 576, generator=g).to(torch.bfloat16)
    table = torch.stack([torch.randperm(11, generator=g)[:6] for _ in range(rows)]).int()
    lens = torch.randint(1, 6 * 16 + 1, (rows,), generator=g).int()
    idx = torch.randint(0, 11 * 16, (rows, 40), generator=g).int()
    idx[:, 30:] = -1
    calls = [
        (
            ReferenceOps.mla_decode_partial(q, pool, table, lens, softmax_scale=0.07),
            mla_decode_reference(q, pool, table, lens, 0.07),
        ),
        (
            ReferenceOps.mla_sparse_partial(q, pool, idx, softmax_scale=0.07),
            mla_sparse_reference(q, pool, idx, 0.07),
        ),
    ]
    for (o, lse), (o_ref, lse_ref) in calls:
        assert o.shape == (rows, 16, 512) and lse.shape == (rows, 16)
        assert_close(o, o_ref, tolerance("mla", torch.bfloat16), name="o")
        assert_close(lse, lse_ref, tolerance("mla_lse", torch.float32), name="lse")


def test_request_ids_drawn_ahead_are_distinct_u64():
    """Request ids come 256 to a read of the OS's randomness: non-zero u64s, no repeats
    across refills (one requester's lanes take them under its lock)."""
    from mqnc.serving.client import _lanes_of

    fab = LoopbackFabric(2, slot_bytes_for(GEOM, max_rows=1, max_chunk_tokens=1))
    lanes = _lanes_of(fab.endpoint(0))
    with lanes.cond:
        ids = [lanes.request_id() for _ in range(600)]
    assert len(set(ids)) == len(ids)
    assert all(type(i) is int and 0 < i < 2**64 for i in ids)


def test_pool_keeps_no_blocks_for_a_failed_or_replaced_chunk():
    """A splice that fails gives its blocks back; the same chunk at the same offset again
    replaces the old copy and frees its blocks; a fetch that could not be spliced (no rope)
    is refused before the pull."""
    from mqnc.serving.pool import LocalChunks, PagedPool

    kv = _chunk(3, 40, torch.float32)
    info = ChunkInfo(7, 40, 0, (0,))
    pool = PagedPool(GEOM.layers, 4, 16, GEOM.d_qk, dtype=torch.float32, device=DEVICE)
    kept = LocalChunks(pool)
    with pytest.raises(ValueError, match="needs rope"):
        kept.put(info, 9, kv, delta=9, rope=None, source="fetch")
    assert pool.free_blocks == 4
    kept.put(info, 0, kv, delta=0, rope=None, source="local")
    assert pool.free_blocks == 1
    kept.put(info, 0, kv, delta=0, rope=None, source="fetch")  # replaces the first copy
    assert pool.free_blocks == 1 and len(kept.chunks) == 1
    with pytest.raises(ValueError, match="blocks: expected distinct taken blocks"):
        pool.free([0, 0])
    s = Setup({5: _chunk(4, 40)}, start=False)
    try:
        req = s.requesters[0]
        req.rope = None
        before = (req.kept.pool.free_blocks, req.client.transport.signal(0))
        with pytest.raises(ValueError, match="offset: chunk 5 is cached at 0; splicing it to 3"):
            req.fetch(5, offset=3)
        assert (req.kept.pool.free_blocks, req.client.transport.signal(0)) == before
        assert not req.costs  # nothing was sent
    finally:
        s.close()


@pytest.mark.parametrize("offset", [10.9, 3.0, True, -1])
def test_offsets_and_positions_are_ints_never_truncated(offset):
    """A float offset would be rotated by its truncation (route) or kept under it (fetch,
    local): refused, naming the argument, before any work."""
    s = Setup({5: _chunk(5, 40)}, start=False)
    try:
        req = s.requesters[0]
        q = _q(1, 1)
        err = ValueError  # check_int: "offset: expected an int >= 0, got 10.9"
        for call in (
            lambda: req.route(5, q, 0, offset=offset),
            lambda: req.fetch(5, offset=offset),
            lambda: req.attend(5, q, 0, offset=offset),
        ):
            with pytest.raises(err, match="offset"):
                call()
        assert not req.costs
        with pytest.raises(err, match="position"):
            s.holder.add_chunk(6, _chunk(6, 16), position=offset)
    finally:
        s.close()


def test_holder_and_requester_refuse_bad_scales_and_limits():
    fab = LoopbackFabric(2, SLOT)
    for kw, err, needle in (
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale: expected a finite"),
        (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
        (dict(max_rows=0), ValueError, "max_rows: expected an int >= 1"),
        (dict(max_rows=-1), ValueError, "max_rows"),
        (dict(max_topk=0), ValueError, "max_topk"),
        (dict(poll_s=0), ValueError, "poll_s"),
        (dict(batch_window_s=-1.0), ValueError, "batch_window_s"),
    ):
        args = dict(softmax_scale=SCALE, num_blocks=1) | kw
        with pytest.raises(err, match=needle):
            Holder(fab.endpoint(0), GEOM, **args)
    with pytest.raises(ValueError, match="softmax_scale"):
        Requester(fab.endpoint(1), GEOM, softmax_scale=float("nan"))


def test_merge_refuses_no_partials_and_partials_of_other_shapes():
    from mqnc.serving import Partial

    a = Partial(torch.zeros(1, 4, GEOM.d_v), torch.zeros(1, 4), "route", 0, None)
    b = Partial(torch.zeros(2, 4, GEOM.d_v), torch.zeros(2, 4), "route", 0, None)
    with pytest.raises(ValueError, match="parts: expected at least one partial, got 0"):
        Requester.merge([])
    with pytest.raises(ValueError, match="parts: expected partials of one shape"):
        Requester.merge([a, b])


def test_batcher_stages_rows_of_one_dtype_per_kernel_call():
    """The batcher stages the rows' bytes (one copy per batch, not a torch call per request),
    so a bf16 and an fp16 request of the same
    shape in one dispatch must not share a kernel call (the holder admits one dtype, but the
    batcher is its own piece): each is answered over its own rows, as the fp64 reference says."""
    from mqnc.reference import mla_decode_reference
    from mqnc.serving.batching import HostedChunk, RouteBatcher, RouteJob
    from mqnc.serving.holder import HolderStats
    from mqnc.serving.pool import PagedPool

    pool = PagedPool(1, 2, 64, GEOM.d_qk, dtype=torch.float32, device=DEVICE, kernels="torch")
    kv = _chunk(3, 64, torch.float32)[:1]
    blocks = pool.alloc(64)
    pool.write(blocks, kv)
    chunk = HostedChunk(7, 64, 0, torch.tensor(blocks, dtype=torch.int32, device=DEVICE))
    replies = {}

    def reply(src, lane, buf, seq):
        replies[src] = buf

    b = RouteBatcher(pool, GEOM, SCALE, HolderStats(), reply, None, "holder test")
    jobs, qs = [], {}
    for src, dtype in ((1, torch.bfloat16), (2, torch.float16)):
        q = _q(src, 1, dtype)
        qs[src] = q
        h = wire.Header(wire.Kind.ROUTE, dtype, batch=1, heads=GEOM.heads, width=GEOM.d_qk,
                        chunk_id=7, layer_hi=1, seq=src)  # fmt: skip
        jobs.append(RouteJob(src, 0, h, q.view(torch.uint8).numpy().reshape(1, -1), None, chunk))
    b.answer(jobs)
    assert sorted(replies) == [1, 2] and b.stats.kernel_calls == 2
    table, lens = torch.tensor([blocks], dtype=torch.int32), torch.tensor([64], dtype=torch.int32)
    for src, q in qs.items():
        h, o, m, l = wire.unpack_partial(replies[src], geometry=GEOM)
        assert h.dtype == q.dtype
        o64, lse64 = mla_decode_reference(q, pool.kv[0], table, lens, SCALE, GEOM.d_v)
        name = str(q.dtype)[6:]
        assert_close(o[0], o64[0], TOLERANCES[("mla", name)], name=f"o {name}")
        assert_close(m + torch.log(l), lse64, TOLERANCES[("mla_lse", "float32")], name="lse")


def _one_chunk_batcher(seed: int, kernels: str):
    """A :class:`RouteBatcher` over one hosted fp32 chunk (id 7, 64 tokens of layer 0 of
    ``_chunk(seed)``) in a 2-block pool on ``kernels``. Returns ``(batcher, pool, chunk,
    replies, table, lens)``: each reply's buffer is appended to ``replies``; ``table [1, 1]``
    int32 and ``lens [1]`` int32 give the chunk's pages for an fp64 reference."""
    from mqnc.serving.batching import HostedChunk, RouteBatcher
    from mqnc.serving.holder import HolderStats
    from mqnc.serving.pool import PagedPool

    pool = PagedPool(1, 2, 64, GEOM.d_qk, dtype=torch.float32, device=DEVICE, kernels=kernels)
    blocks = pool.alloc(64)
    pool.write(blocks, _chunk(seed, 64, torch.float32)[:1])
    chunk = HostedChunk(7, 64, 0, torch.tensor(blocks, dtype=torch.int32, device=DEVICE))
    replies = []
    b = RouteBatcher(
        pool, GEOM, SCALE, HolderStats(), lambda *a: replies.append(a[2]), None, "holder test"
    )
    table, lens = torch.tensor([blocks], dtype=torch.int32), torch.tensor([64], dtype=torch.int32)
    return b, pool, chunk, replies, table, lens


def test_batcher_reuses_output_buffers_each_written_in_full():
    """The kernels write into output buffers the batcher keeps per batch shape (``out=``: no
    allocation per call). Poisoned with NaN between two batches of the same shape (dense, then a
    selection), the buffers come back written in full: each reply is its own rows' fp64
    attention."""
    from mqnc.reference import mla_decode_reference, mla_sparse_reference
    from mqnc.serving.batching import RouteJob

    b, pool, chunk, replies, table, lens = _one_chunk_batcher(5, "torch")
    idx = torch.tensor([[3, -1, 60, 3, 17]], dtype=torch.int32)
    for step, sparse in enumerate((False, False, True, True)):
        q = _q(10 + step, 1, torch.float32)
        topk = idx.shape[1] if sparse else 0
        h = wire.Header(
            wire.Kind.ROUTE, torch.float32, batch=1, heads=GEOM.heads, width=GEOM.d_qk,
            chunk_id=7, layer_hi=1, seq=step + 1, topk=topk,
        )  # fmt: skip
        rows = q.view(torch.uint8).numpy().reshape(1, -1)
        b.answer([RouteJob(1, 0, h, rows, idx.numpy() if sparse else None, chunk)])
        _, o, m, l = wire.unpack_partial(replies[-1], geometry=GEOM)
        if sparse:
            o64, lse64 = mla_sparse_reference(q, pool.kv[0], idx, SCALE, GEOM.d_v)
        else:
            o64, lse64 = mla_decode_reference(q, pool.kv[0], table, lens, SCALE, GEOM.d_v)
        assert_close(o, o64, TOLERANCES[("mla", "float32")], name=f"o, step {step}")
        assert_close(m + torch.log(l), lse64, TOLERANCES[("mla_lse", "float32")], name="lse")
        assert len(b._outs) == 1  # one shape: one pair of buffers, reused
        for o_buf, lse_buf, _, _ in b._outs.values():
            o_buf.fill_(math.nan)
            lse_buf.fill_(math.nan)
    # a kernel set by hand that ignores out= (returns its own tensors) is copied in
    b.dense_kernel = lambda q, *_a, d_v, **_k: (
        torch.full((1, GEOM.heads, d_v), 0.25),
        torch.full((1, GEOM.heads), -2.0),
    )
    h = wire.Header(wire.Kind.ROUTE, torch.float32, batch=1, heads=GEOM.heads, width=GEOM.d_qk,
                    chunk_id=7, layer_hi=1, seq=9)  # fmt: skip
    rows = _q(20, 1, torch.float32).view(torch.uint8).numpy().reshape(1, -1)
    b.answer([RouteJob(1, 0, h, rows, None, chunk)])
    _, o, m, l = wire.unpack_partial(replies[-1], geometry=GEOM)
    assert bool((o == 0.25).all()) and bool((m == -2.0).all()) and bool((l == 1).all())


def test_batcher_steps_of_one_shape_launch_one_cached_plan():
    """The batcher's hot path holds a plan where shapes repeat: its kernel calls (the Triton
    op, checks off, ``out=``) of one batch shape are planned once and launched from the op's
    plan cache on every later step (new rows each step), each reply its rows' fp64 attention,
    and a repeated step's reply bit-identical to the first's."""
    from mqnc.reference import mla_decode_reference
    from mqnc.serving.batching import RouteJob
    from mqnc.triton_kernels import mla_decode_partial

    b, pool, chunk, replies, table, lens = _one_chunk_batcher(6, "triton")
    plans = mla_decode_partial.op.plans
    plans.clear()
    got = []
    for step, seed in enumerate((30, 31, 30)):
        q = _q(seed, 1, torch.float32)
        h = wire.Header(wire.Kind.ROUTE, torch.float32, batch=1, heads=GEOM.heads,
                        width=GEOM.d_qk, chunk_id=7, layer_hi=1, seq=step + 1)  # fmt: skip
        rows = q.view(torch.uint8).numpy().reshape(1, -1)
        b.answer([RouteJob(1, 0, h, rows, None, chunk)])
        _, o, m, l = wire.unpack_partial(replies[-1], geometry=GEOM)
        o64, lse64 = mla_decode_reference(q, pool.kv[0], table, lens, SCALE, GEOM.d_v)
        assert_close(o, o64, TOLERANCES[("mla", "float32")], name=f"o, step {step}")
        assert_close(m + torch.log(l), lse64, TOLERANCES[("mla_lse", "float32")], name="lse")
        got.append((o, m, l))
    assert (plans.misses, plans.hits) == (1, 2)
    assert all(torch.equal(a, b) for a, b in zip(got[2], got[0], strict=True))
