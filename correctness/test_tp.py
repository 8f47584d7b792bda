"""Tensor-parallel rank pairing (§8): the two TP kernels against fp64, the column partition, and
the rank-paired route (TP holder and requester groups) against the single-rank route and fp64,
in one process (loopback engine, the holder group as threads, the Triton kernels) and across
processes (2 instances x 2 ranks over gloo: one requester instance in this process, one holder
instance as two processes), with a holder rank killed mid-route.

Geometry: the production row (512 latent + 64 RoPE dims), 2 layers, 4 heads, chunks of <= 48
tokens; entries N(0, 0.25) so that |o| < 0.25 (the premise of the routed bf16 bound).
"""

from __future__ import annotations

import threading

import pytest
import torch

from mqnc.model import PRESETS
from mqnc.reference.attention_ref import partial_attention_reference
from mqnc.reference.tp_ref import tp_scores_reference, tp_values_reference
from mqnc.serving import ChunkInfo, Holder, RemoteError, Requester
from mqnc.serving.tp_group import GroupLost, ThreadGroup, TPPartition
from mqnc.serving.tp_holder import TPHolder
from mqnc.serving.tp_requester import TPRequester, payload_bytes
from mqnc.testing import TOLERANCES, assert_close, default_device
from mqnc.transport import INBOX, REPLY, LoopbackFabric, PeerLost, slot_bytes_for, wire
from mqnc.triton_kernels.tp.scores import tp_partial_scores
from mqnc.triton_kernels.tp.values import tp_partial_values

DEVICE = default_device()
GEOM = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=4)
SCALE = 192**-0.5 * 1.2608**2
SLOT = slot_bytes_for(GEOM, max_rows=64, max_topk=64)
TOKENS = 48
# Scaled scores (softmax_scale x the partial sum) are what the softmax and the lse see: fp32 sums
# of exact bf16 products over <= 288 dims, |q.k| < ~20 here, scaled by ~0.115: a few fp32 ulp,
# the bound of an fp32 lse from such scores (mla_lse).
SCALED_SCORES = TOLERANCES[("mla_lse", "float32")]


def _randn(seed, *shape, dtype=torch.bfloat16, std=0.5):
    g = torch.Generator().manual_seed(seed)
    return (std * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def _slots(seed, B, T, pool_slots, unused=0.25):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, pool_slots, (B, T), generator=g, dtype=torch.int32)
    s[torch.rand(B, T, generator=g) < unused] = -1
    return s.to(DEVICE)


# ---- the kernels ----------------------------------------------------------------------------


# H 20: two 16-head blocks, a partial one; H 80: two 64-head blocks (from 64 heads on)
@pytest.mark.parametrize(
    ("degree", "dtype", "H"),
    [(2, torch.bfloat16, 20), (4, torch.bfloat16, 80), (2, torch.float32, 20)],
)
def test_tp_kernels_against_fp64(degree, dtype, H):
    """Partial scores over a slice, their sum, softmax times each value slice: the Triton
    kernels against fp64 (outputs NaN-poisoned), a row with no entry giving o = 0, lse = -inf."""
    part = TPPartition(GEOM, degree)
    B, T = 3, 40  # two token tiles, a partial one
    q = _randn(1, B, H, GEOM.d_qk, dtype=dtype)
    pool = _randn(2, 4, 16, GEOM.d_qk, dtype=dtype)
    slots = _slots(3, B, T, 64)
    slots[2] = -1  # a row with no entry
    d_v = part.slice_latent
    s_sum, s_ref = 0, 0
    qs = [part.slice(q, r) for r in range(degree)]
    ps = [part.slice(pool, r) for r in range(degree)]
    for r in range(degree):
        s = tp_partial_scores(qs[r], ps[r], slots, d_v=d_v)
        ref = tp_scores_reference(qs[r], ps[r], slots)
        assert_close(s * SCALE, ref * SCALE, SCALED_SCORES, name=f"scores of rank {r}")
        s_sum, s_ref = s_sum + s, s_ref + ref
    full = tp_scores_reference(q, pool, slots)
    assert_close(s_sum * SCALE, full * SCALE, SCALED_SCORES, name="summed scores")
    name = "float32" if dtype == torch.float32 else "bfloat16"
    o_parts = []
    for r in range(degree):
        o, lse = tp_partial_values(s_sum, ps[r], slots, softmax_scale=SCALE, d_v=d_v)
        o_ref, lse_ref = tp_values_reference(s_sum, ps[r], slots, SCALE, d_v)
        assert_close(o, o_ref, TOLERANCES[("mla", name)], name=f"o of rank {r}")
        assert_close(lse, lse_ref, TOLERANCES[("mla_lse", "float32")], name="lse")
        assert bool((o[2] == 0).all()) and bool(torch.isneginf(lse[2]).all())
        o_parts.append(o)
    valid = slots >= 0
    keys = pool.reshape(-1, GEOM.d_qk)[slots.clamp_min(0).long()]
    o_full, _ = partial_attention_reference(q, keys, valid, SCALE, GEOM.d_c)
    assert_close(part.join_values(o_parts), o_full, TOLERANCES[("mla", name)], name="joined o")


def test_tp_kernels_refuse_bad_slices():
    """Widths the kernels cannot tile, rows of another width than the pool slice, slots out of
    range: errors naming the argument, the expected and the received value."""
    q, pool = _randn(1, 1, 16, 288), _randn(2, 2, 16, 288)
    slots = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="d_v: expected the slice's latent width to be a power"):
        tp_partial_scores(q, pool, slots, d_v=200)
    with pytest.raises(ValueError, match=r"q: expected rows as wide as kv_pool's slice \(288\)"):
        tp_partial_scores(q[..., :144], pool, slots, d_v=256)
    with pytest.raises(ValueError, match=r"slots: expected -1 \(unused\) or a slot in \[0, 32\)"):
        tp_partial_scores(q, pool, slots + 32, d_v=256)
    with pytest.raises(TypeError, match="slots: invalid dtype"):
        tp_partial_values(q[..., :4].float(), pool, slots.long(), softmax_scale=0.1, d_v=256)


# ---- the partition --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("degree", [1, 2, 4])
def test_partition_keeps_every_column_once_and_rope_pairs_whole(degree, layout):
    part = TPPartition(PRESETS["deepseek-v2-lite"], degree, layout)
    cols = [part.columns(r) for r in range(degree)]
    assert all(len(c) == 576 // degree for c in cols)
    assert sorted(torch.cat(cols).tolist()) == list(range(576))
    P = 32
    for c in cols:
        rope = sorted(int(x) - 512 for x in c[512 // degree :])
        pairs = {(d // 2) if layout == "interleaved" else (d % P) for d in rope}
        assert len(pairs) * 2 == len(rope)  # both elements of every pair
    assert part.slice_geometry.d_qk == 576 // degree and part.slice_geometry.d_v == 512 // degree


def test_partition_refuses_a_degree_that_does_not_divide_the_latent():
    with pytest.raises(ValueError, match="degree: a TP degree must divide the latent width"):
        TPPartition(GEOM, 3)
    with pytest.raises(ValueError, match="degree: a TP degree must divide the 32 RoPE pairs"):
        TPPartition(GEOM, 64)
    with pytest.raises(ValueError, match="geometry: TP partitions the latent"):
        TPPartition(GEOM.replace(value_dim=576), 2)


# ---- the paired route in one process (loopback, Triton kernels) -----------------------------


class _Loopback:
    """Instance 0: a TP requester group; instances 1..: TP holder groups (threads); plus the
    package's single-rank holder and requester over the same chunks."""

    def __init__(
        self, degree, chunks_per_instance, *, pair_timeout_s=10.0, kernels="triton", group_s=10.0
    ):
        self.part = part = TPPartition(GEOM, degree)
        n = degree
        self.fabric = LoopbackFabric(n * (1 + len(chunks_per_instance)), SLOT)
        self.holders = []
        for i, chunks in enumerate(chunks_per_instance, start=1):
            group = ThreadGroup(n, timeout_s=group_s)
            for r in range(n):
                h = TPHolder(
                    self.fabric.endpoint(i * n + r),
                    group.member(r),
                    part,
                    softmax_scale=SCALE,
                    num_blocks=8,
                    block_size=16,
                    pair_timeout_s=pair_timeout_s,
                    kernels=kernels,
                )
                for cid, kv in chunks.items():
                    h.add_chunk(cid, part.slice(kv, r))
                self.holders.append(h.start())
        self.requesters = [
            TPRequester(self.fabric.endpoint(r), part, timeout_s=20.0) for r in range(n)
        ]

    def route(self, instance, chunk_id, q, layer, indices=None, ranks=None):
        out = [None] * self.part.degree

        def go(r):
            try:
                q_r = self.part.slice(q, r)
                out[r] = self.requesters[r].route(instance, chunk_id, q_r, layer, indices)
            except Exception as exc:  # noqa: BLE001 - checked by the caller
                out[r] = exc

        threads = [threading.Thread(target=go, args=(r,)) for r in ranks or range(len(out))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def close(self):
        for h in self.holders:
            h.stop()
            assert h.failure is None


def _single_rank_route(chunks, q, layer, indices_by_chunk, kernels="triton"):
    """The package's single-rank route of ``q`` over each chunk (loopback)."""
    fabric = LoopbackFabric(2, SLOT)
    holder = Holder(
        fabric.endpoint(0), GEOM, softmax_scale=SCALE, num_blocks=8, poll_s=0.02, kernels=kernels
    )
    req = Requester(
        fabric.endpoint(1),
        GEOM,
        softmax_scale=SCALE,
        timeout_s=20.0,
        pool_blocks=2,
        kernels=kernels,
    )
    for cid, kv in chunks.items():
        holder.add_chunk(cid, kv)
        req.register(ChunkInfo(cid, kv.shape[1], 0, (0,)))
    holder.start()
    try:
        return {c: req.route(c, q, layer, indices=indices_by_chunk.get(c)) for c in chunks}
    finally:
        holder.stop()


def _chunk(seed, tokens=TOKENS):
    return _randn(seed, GEOM.layers, tokens, GEOM.d_qk, std=0.5).cpu()


# N = 2 on the Triton kernels, N = 4 on their torch references (the N = 4 widths' kernels are
# checked above): one interpreted route set per test file keeps it short.
@pytest.mark.parametrize(("degree", "kernels"), [(2, "triton"), (4, "torch")])
def test_paired_route_equals_the_single_rank_route(degree, kernels):
    """Dense and top-k routes to two TP holder instances: each requester rank's o slice and
    the row's lse equal the single-rank route's (within the routed bf16 bound) and fp64; the
    lse is the same on every rank; the slices merged across the two holders (merge_partials,
    unchanged) equal fp64 over the union; each rank sends 1/N of the query bytes."""
    chunks = {5: _chunk(11), 6: _chunk(12, 40)}
    s = _Loopback(degree, [{5: chunks[5]}, {6: chunks[6]}], kernels=kernels)
    try:
        q = _randn(13, 2, GEOM.heads, GEOM.d_qk).cpu()
        idx = torch.tensor([[0, 7, -1, 39], [3, -1, -1, 1]], dtype=torch.int32)
        single = _single_rank_route(chunks, q, 1, {6: idx}, kernels)
        dense = s.route(1, 5, q, 1)
        sparse = s.route(2, 6, q, 1, idx)
        for got, cid in ((dense, 5), (sparse, 6)):
            assert not any(isinstance(x, Exception) for x in got), got
            o = s.part.join_values([o for o, _ in got])
            assert all(torch.equal(got[0][1], lse) for _, lse in got), "lse differs across ranks"
            ref = single[cid]
            assert_close(o, ref.o, TOLERANCES[("mla_routed", "bfloat16")], name=f"o of {cid}")
            assert_close(got[0][1], ref.lse, TOLERANCES[("mla_lse", "float32")], name="lse")
        for r in range(degree):  # the partials merged per rank, as a single-rank requester does
            o_m, lse_m = s.requesters[r].merge_slices([dense[r], sparse[r]], kernels)
            if r == 0:
                lse0 = lse_m
            assert torch.equal(lse_m, lse0)
            dense[r] = o_m
        valid = torch.zeros(2, TOKENS + 40, dtype=torch.bool)
        valid[:, :TOKENS] = True
        for b in range(2):
            valid[b, TOKENS + idx[b][idx[b] >= 0].long()] = True
        keys = torch.cat([chunks[5][1], chunks[6][1]])
        o_ref, lse_ref = partial_attention_reference(q, keys, valid, SCALE, GEOM.d_c)
        assert_close(s.part.join_values(dense), o_ref, TOLERANCES[("merge_wire", "bfloat16")])
        assert_close(lse0, lse_ref, TOLERANCES[("mla_lse", "float32")], name="merged lse")
        sent, got_bytes = s.requesters[0].last_bytes
        q_bytes, p_bytes = payload_bytes(s.part, 2 * GEOM.heads, torch.bfloat16)
        assert q_bytes * degree == 2 * GEOM.heads * GEOM.q_row_bytes  # 1/N of the query
        assert sent == wire.HEADER_BYTES + q_bytes + 2 * 4 * 4  # + the selection, every rank
        assert got_bytes == wire.HEADER_BYTES + p_bytes
    finally:
        s.close()


def test_a_second_requester_on_the_same_endpoints_gets_its_own_answers():
    """Request ids and sequence numbers belong to the endpoint: a second ``TPRequester`` on the
    same endpoints (or one made again after a restart of its object) continues the numbering,
    so its route over another chunk is answered with that chunk's partial (a fresh one used to
    number from 1 again and was handed the first requester's earlier reply, status ok)."""
    chunks = {5: _chunk(21), 6: _chunk(22)}
    s = _Loopback(2, [chunks], kernels="torch")
    try:
        q = _randn(23, 2, GEOM.heads, GEOM.d_qk).cpu()
        first = s.route(1, 5, q, 0)
        s.requesters = [TPRequester(s.fabric.endpoint(r), s.part, timeout_s=20.0) for r in range(2)]
        second = s.route(1, 6, q, 0)
        assert not any(isinstance(x, Exception) for x in first + second), (first, second)
        valid = torch.ones(2, TOKENS, dtype=torch.bool)
        for got, cid in ((first, 5), (second, 6)):  # each the partial of its own chunk
            o_ref, lse_ref = partial_attention_reference(q, chunks[cid][0], valid, SCALE, GEOM.d_c)
            o = s.part.join_values([got[r][0] for r in range(2)])
            assert_close(o, o_ref, TOLERANCES[("merge_wire", "bfloat16")], name=f"o {cid}")
            for r in range(2):
                assert_close(got[r][1], lse_ref, TOLERANCES[("mla_lse", "float32")], name="lse")
    finally:
        s.close()


def test_paired_route_refuses_mismatched_ranks_and_widths():
    """A request whose requester ranks disagree (another selection), one whose pair never
    comes, a slice of another width and a requester rank routing to another holder rank:
    errors naming what is wrong, on the requester side."""
    s = _Loopback(2, [{5: _chunk(21)}], pair_timeout_s=0.5, kernels="torch")
    try:
        q = _randn(22, 1, GEOM.heads, GEOM.d_qk).cpu()
        part, req = s.part, s.requesters

        def routed(r, indices):
            return req[r].route(1, 5, part.slice(q, r), 0, indices)

        out = [None, None]
        threads = [
            threading.Thread(target=lambda r=r, i=idx: out.__setitem__(r, _catch(routed, r, i)))
            for r, idx in ((0, torch.tensor([[1, 2]])), (1, torch.tensor([[1, 3]])))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in out:
            assert isinstance(e, RemoteError) and "ranks of two groups mismatched" in str(e)
            assert "selection_crc" in str(e)
        assert req[0].probe(1) > 0  # a probe is answered by its rank alone, ids apart
        (alone,) = [x for x in s.route(1, 5, q, 0, ranks=[0]) if x is not None]
        assert isinstance(alone, RemoteError) and "did not arrive within 0.5 s" in str(alone)
        with pytest.raises(ValueError, match=r"q_slice: expected this rank's slice \(B, H, 288\)"):
            req[0].route(1, 5, q[..., :144], 0)
        tr = s.fabric.endpoint(0)
        for width, peer, why in (
            (144, 2, "slices of different widths"),
            (288, 3, "ranks mismatched"),
        ):
            msg = wire.pack_query_arrays(
                torch.zeros(1, GEOM.heads * width * 2, dtype=torch.uint8).numpy(), None,
                dtype=torch.bfloat16, heads=GEOM.heads, width=width, request_id=99, seq=100 + peer,
                chunk_id=5, layer=0, crc=True, array=True,
            )  # fmt: skip
            tr.put_signal(peer, tr.layout.slot(INBOX, 0, 0), msg, 100 + peer)
            reply = tr.layout.slot(REPLY, peer, 0)
            tr.wait_signal(reply, 100 + peer, 10.0)
            _, text = wire.unpack_error(tr.read_message(reply)[1])
            assert why in text, text
    finally:
        s.close()


def _catch(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return exc


def test_a_broken_holder_group_refuses_at_once():
    """A group member lost (the thread group aborted): the reduction raises GroupLost and the
    ranks answer every request with an error naming it, never a hang."""
    s = _Loopback(2, [{5: _chunk(31)}], kernels="torch")
    try:
        s.holders[0].group.group.abort()
        got = s.route(1, 5, _randn(32, 1, GEOM.heads, GEOM.d_qk).cpu(), 0)
        for e in got:
            assert isinstance(e, RemoteError) and "holder group" in str(e), e
        assert s.holders[0].group.broken
        with pytest.raises(GroupLost):
            s.holders[1].group.all_reduce_sum(torch.zeros(1))
    finally:
        s.close()


def test_a_rank_whose_batch_fails_fails_the_request_on_every_rank():
    """One holder rank's kernel call raises: its requester rank gets that error, the other
    rank's reduction times out (the group's bound, 2 s here) and its requester rank gets an
    error naming the group; neither hangs, and the group refuses at once afterwards."""
    import types

    s = _Loopback(2, [{5: _chunk(51)}], kernels="torch", group_s=2.0)
    try:

        def boom(*args, **kwargs):
            raise RuntimeError("boom")

        s.holders[0].ops = types.SimpleNamespace(tp_partial_scores=boom)
        q = _randn(52, 1, GEOM.heads, GEOM.d_qk).cpu()
        first = s.route(1, 5, q, 0)
        assert isinstance(first[0], RemoteError) and "RuntimeError: boom" in str(first[0])
        assert isinstance(first[1], RemoteError) and "holder group" in str(first[1]), first[1]
        for e in s.route(1, 5, q, 0):
            assert isinstance(e, RemoteError) and "broken" in str(e), e
    finally:
        s.close()


# ---- across processes: 2 instances x 2 ranks over gloo --------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from mqnc.serving.tp_process import TPCluster

    chunks = {5: _chunk(41), 6: _chunk(42, 40)}
    c = TPCluster(
        TPPartition(GEOM, 2), chunks, str(tmp_path_factory.mktemp("tp")), scale=SCALE,
        slot_bytes=SLOT, kernels="torch", timeout_s=20.0,
    )  # fmt: skip
    yield c, chunks
    c.close()


def test_processes_paired_route_equals_the_single_rank_route(cluster):
    """Two requester ranks (this process) and two holder-rank processes (gloo): dense and top-k
    routes equal the single-rank route within the routed bf16 bound, with half the query bytes
    per rank and half the o bytes (plus the row's 8-byte statistic) back."""
    c, chunks = cluster
    q = _randn(43, 3, GEOM.heads, GEOM.d_qk).cpu()
    idx = torch.tensor([[0, 9, -1], [39, 2, 3], [-1, -1, -1]], dtype=torch.int32)
    single = _single_rank_route(chunks, q, 1, {6: idx}, "torch")
    for cid, indices in ((5, None), (6, idx)):
        got = c.route_all(1, cid, q, 1, indices)
        assert not any(isinstance(x, Exception) for x in got), got
        o = c.partition.join_values([o for o, _ in got])
        assert_close(o, single[cid].o, TOLERANCES[("mla_routed", "bfloat16")], name="o")
        assert_close(got[1][1], single[cid].lse, TOLERANCES[("mla_lse", "float32")], name="lse")
        assert torch.equal(got[0][1], got[1][1])
    rows = 3 * GEOM.heads
    for req in c.requesters:
        sent, recv = req.last_bytes
        topk = 3 * 3 * 4
        assert 2 * (sent - wire.HEADER_BYTES - topk) == rows * GEOM.q_row_bytes
        assert recv - wire.HEADER_BYTES == rows * (GEOM.d_c * 2 // 2 + 8)


def test_processes_a_rank_killed_mid_route_fails_the_request(cluster):
    """Holder rank 1 killed while rank 0 of the requester group has a request in flight: that
    request fails with an error naming the holder group, the next route of requester rank 1
    with PeerLost naming its lost holder rank; nothing hangs (every wait bounded)."""
    c, _ = cluster
    q = _randn(44, 1, GEOM.heads, GEOM.d_qk).cpu()
    out = [None]

    def first():
        out[0] = _catch(c.requesters[0].route, 1, 5, c.partition.slice(q, 0), 0)

    t = threading.Thread(target=first)
    t.start()
    c.kill(3)
    t.join(timeout=60)
    assert not t.is_alive()
    assert isinstance(out[0], RemoteError) and "holder group" in str(out[0]), out[0]
    with pytest.raises(PeerLost, match=r"holder rank 1 \(global 3\): the holder rank was lost"):
        c.requesters[1].route(1, 5, c.partition.slice(q, 1), 0)


def test_fit_tp_recovers_the_rank_pair_line():
    """The cost model's TP term from tp_route records: the fixed part, the per-rank group term
    and one rank pair's rate of an exact plane, and the measured byte fractions beside the
    model's 1/N."""
    from mqnc.cost.calibration_fits import fit_tp

    recs, base = [], {}
    for n in (1, 2, 4):
        for m_q in (16, 256):
            q, p = payload_bytes(TPPartition(GEOM, n), m_q, torch.bfloat16)
            b = 2 * wire.HEADER_BYTES + q + p
            base.setdefault(m_q, b)
            extra = dict(degree=n, rank_fraction=b / base[m_q])
            t = 300.0 + 50.0 * (n - 1) + b / 2e3
            recs.append(dict(bench="tp_route", bytes=b, p50=t, extra=extra))
    res = fit_tp(recs)
    assert abs(res.fixed_us - 300.0) < 1e-6 and abs(res.group_us - 50.0) < 1e-6
    assert abs(res.bw_gbps - 2.0) < 1e-9 and res.mape < 1e-9
    assert 0.5 < res.rank_fraction[2] < 0.51 and 0.25 < res.rank_fraction[4] < 0.26
    with pytest.raises(ValueError, match="expected tp_route records"):
        fit_tp([])


def test_serve_layout_refuses_a_degree_that_does_not_fit_the_job():
    """``mqnc serve --tp N``: N must divide the world (whole instances), and the corpus' holder
    ids name instances that exist, with at least one requester instance left."""
    from mqnc.serving import Corpus
    from mqnc.serving.tp_service import _check_layout

    entries = torch.zeros(GEOM.layers, 32, GEOM.d_qk, dtype=torch.bfloat16)
    corpus = Corpus.partition(entries, GEOM, SCALE, chunk_tokens=16, holders=[1])
    assert _check_layout(corpus, 4, 2) == ([1], [0])
    with pytest.raises(ValueError, match="tp: a TP degree must divide the job's world size 6"):
        _check_layout(corpus, 6, 4)
    with pytest.raises(ValueError, match="holder ids name instances; \\[1\\] do not all exist"):
        _check_layout(corpus, 4, 4)


def test_an_fp8_geometry_is_refused_by_name_at_construction():
    """A TP instance keeps 16-bit column slices: an FP8 cache (DeepSeek-V3.2's 656-byte entry)
    is refused where every TP holder, requester and cluster starts (each takes a
    ``TPPartition``), naming ``cache_dtype``, why, and what serves it instead."""
    fp8 = GEOM.replace(cache_dtype="fp8_e4m3")
    for degree in (1, 2, 8):  # at 8, d_c / N = 64: a 128-wide scale group spans two ranks
        with pytest.raises(ValueError, match=r"geometry\.cache_dtype: .*'fp8_e4m3'.*Holder"):
            TPPartition(fp8, degree)
    assert TPPartition(GEOM.replace(cache_dtype="fp16"), 2).slice_width == 288
