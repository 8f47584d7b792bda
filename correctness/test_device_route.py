"""The device route on the CPU: the holder kernel one-shot under the interpreter answers exactly
what the host-driven ``Holder`` answers (dense with split partials, sparse with and without),
bit for bit; bad headers get error words and leave the reply untouched (its NaN poison stays);
the stop word and the idle bound end the loop; a sequence number that wraps or goes backwards
is refused; a missing reply is a bounded ``TIMEOUT``; the requester's merge passes a single
reply through exactly and merges a local partial against the fp64 reference. Over an FP8
cache (DeepSeek-V3.2's 656-byte entries) the holder kernel answers the same requests as the
host holder over the same entries, bit for bit. Sequence numbers are the slot's (a second or
restarted client is answered, never handed another request's reply); the merge refuses rows a
reply did not answer and checks its ``out`` tensors; a row whose every score overflows is NaN,
as on the host route. Every test runs on ``mqnc.testing.default_device()`` (compiled on a
GPU)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from mqnc.model import PRESETS, RopeSpec
from mqnc.reference import merge_reference
from mqnc.serving import ChunkInfo, Holder, Requester
from mqnc.serving.device_holder import DeviceHolder
from mqnc.testing import TOLERANCES, assert_close, default_device
from mqnc.transport import LoopbackFabric, slot_bytes_for
from mqnc.transport.device_route import (
    LocalBackend,
    RouteClient,
    RouteFailed,
    RouteLayout,
    allocate,
    check_status,
)
from mqnc.triton_kernels.fp8.quant import fp8_quantize
from mqnc.triton_kernels.mla.plan import forced_tile
from mqnc.triton_kernels.route import words as W
from mqnc.triton_kernels.route.holder_loop import HOLDER_TILE, fp8_holder_tile

GEOM = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=16)
SCALE = RopeSpec.from_preset("deepseek-v2-lite").softmax_scale
TOKENS = 200  # 7 tiles of 32: the dense plan splits B 1..2 (the fold is tested)
CHUNK = 3
DEVICE = default_device()  # the CPU (interpreted, one-shot) here; on a GPU the compiled kernels
EXACT = DEVICE.type == "cpu"  # bit for bit where both run the same interpreted arithmetic


def _randn(seed, *shape, std=0.5):
    g = torch.Generator().manual_seed(seed)
    return (std * torch.randn(*shape, generator=g)).to(torch.bfloat16).to(DEVICE)


def _indices(seed, B, topk):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, TOKENS, (B, topk), generator=g, dtype=torch.int32).to(DEVICE)


KV = _randn(0, GEOM.layers, TOKENS, GEOM.d_qk)
GEOM_FP8 = GEOM.replace(cache_dtype="fp8_e4m3")
KV_FP8 = fp8_quantize(KV, GEOM.d_c)  # [L, TOKENS, 656] uint8: the same entries on both holders
# (slot, tokens, layer, sparse top-k or None): two dense, two sparse (200 entries: split)
REQUESTS = [(0, 2, 1, None), (1, 1, 0, None), (2, 2, 0, 40), (3, 1, 1, 200)]


def _route(slot, B, layer, topk):
    q = _randn(10 + slot, B, GEOM.heads, GEOM.d_qk)
    return q, (None if topk is None else _indices(20 + slot, B, topk))


SCHEDULES = ("pass", "resident")


def _device(slots=4, max_batch=2, max_topk=256, ctas=3, geom=GEOM, kv=KV, schedule="pass",
            num_splits=3, pass_rows=64, fold=32):  # fmt: skip
    """Slots, a device holder hosting ``kv`` as chunk ``CHUNK`` and a client; the pass split
    ``num_splits`` ways (the fold of split partials tested; its plan alone picks 1 here), its
    folded rows ``fold`` wide and ``pass_rows`` rows a pass (32 and 64, the interpreter's time:
    it runs every folded row's programs; the production 128 in the bit-for-bit test)."""
    buf = allocate(
        RouteLayout(slots, max_batch, GEOM.heads, max_topk=max_topk), LocalBackend(DEVICE)
    )
    buf.rep_o.fill_(float("nan"))
    buf.rep_lse.fill_(float("nan"))
    holder = DeviceHolder(buf, geom, softmax_scale=SCALE, num_blocks=8, ctas=ctas,
                          schedule=schedule, num_splits=num_splits,
                          pass_rows=pass_rows, fold=fold)  # fmt: skip
    holder.add_chunk(CHUNK, kv)
    return buf, holder, RouteClient(buf, LocalBackend(DEVICE), spins=4 if EXACT else 1 << 16)


def _host_answers(geom, kv, tile=HOLDER_TILE, routes=None, holder=None):
    """The host-driven holder's partial for each request (``routes``: ``(q, indices, layer)``
    each; default :data:`REQUESTS`'), asked one at a time (one kernel call each, so its split
    count is the plan's for that request alone), its ops planned at the holder kernel's
    tile. ``holder``: a device holder whose pass serves the dense requests: the host holder
    then folds dense rows as it does, at its split count, on the default tile (the resident
    sparse kernel's tile still forced)."""
    if routes is None:
        routes = [(*_route(s, B, layer, topk), layer) for s, B, layer, topk in REQUESTS]
    slot = slot_bytes_for(geom, max_rows=64, max_topk=256, max_chunk_tokens=256)
    fab = LoopbackFabric(2, slot, lanes=1)
    passed = holder is not None and holder.schedule == "pass"
    fold = dict(fold=holder.fold, num_splits=holder.num_splits) if passed else {}
    holder = Holder(
        fab.endpoint(0),
        geom,
        softmax_scale=SCALE,
        num_blocks=8,
        poll_s=0.02,
        device=DEVICE,
        **fold,
    )
    holder.add_chunk(CHUNK, kv)
    holder.start()
    out = []
    dense_tile = contextlib.nullcontext() if passed else forced_tile(tile)
    try:
        with dense_tile, forced_tile(tile, sparse=True):
            req = Requester(
                fab.endpoint(1),
                geom,
                softmax_scale=SCALE,
                timeout_s=120,
                pool_blocks=8,
                device=DEVICE,
            )
            req.register(ChunkInfo(CHUNK, TOKENS, 0, (0,)))
            for q, idx, layer in routes:
                p = req.route(CHUNK, q, layer, indices=idx)
                out.append((p.o, p.lse))
    finally:
        holder.stop()
    return out


def _served(geom, kv, schedule="pass", num_splits=3, fold=32):
    """Four requesters' requests (dense and sparse, split and not) served one-shot: one pass
    and one launch of the sparse kernel, or (``"resident"``) one launch of each kernel."""
    buf, holder, client = _device(geom=geom, kv=kv, schedule=schedule, num_splits=num_splits,
                                  fold=fold)  # fmt: skip
    for slot, B, layer, topk in REQUESTS:
        q, idx = _route(slot, B, layer, topk)
        client.put(slot, q, layer=layer, chunk=CHUNK, indices=idx)
    holder.serve_once()
    return buf, holder, client


@pytest.fixture(scope="module")
def served():
    return _served(GEOM, KV)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_holder_kernel_answers_bit_identical_to_the_host_holder(schedule):
    """The pass (dense rows folded, the dense plan's split count) and the resident kernels
    answer four requesters' requests (dense and sparse, split and not) served in one go as the
    host-driven holder answers each alone: with the pass's fold and split count, or at the
    resident kernel's tile."""
    served = _served(GEOM, KV, schedule, fold=128)  # (the production fold)
    _assert_answers_match(served, _host_answers(GEOM, KV, holder=served[1]))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_holder_kernel_over_fp8_entries_answers_bit_identical_to_the_host_holder(schedule):
    """An FP8 geometry: both holders keep the same 656-byte entries (the device holder's pool
    is uint8, read in place by the pass's attention or the kernel's FP8 variant) and answer
    alike, dense and sparse, split and not; a chunk with a bad scale is refused when added,
    naming it."""
    served_fp8 = _served(GEOM_FP8, KV_FP8, schedule)
    holder = served_fp8[1]
    assert holder.pages.kv.dtype == torch.uint8 and holder.pages.kv.shape[-1] == 656
    assert torch.equal(holder.pages.gather(holder.chunks[CHUNK].blocks, TOKENS, (0, 2)), KV_FP8)
    host = _host_answers(GEOM_FP8, KV_FP8, fp8_holder_tile(), holder=holder)
    _assert_answers_match(served_fp8, host, bound=("mla_fp8", "bfloat16"))
    bad = KV_FP8.clone()
    bad[1, 7, 512:516] = 0  # scale 0 of token 7, layer 1
    with pytest.raises(ValueError, match="kv.*scale"):
        holder.add_chunk(CHUNK + 1, bad)
    with pytest.raises(ValueError, match="scales missing"):
        holder.add_chunk(CHUNK + 1, KV_FP8[..., :528])


def _assert_answers_match(served, host_answers, bound=("mla", "bfloat16")):
    buf, holder, _ = served
    if holder.schedule == "pass":
        assert holder.num_splits > 1, "the dense requests must be split"
    else:
        splits = holder.tables().splits_dense[CHUNK]
        assert int(splits[1]) > 1 and int(splits[2]) > 1, "the dense requests must be split"
    tile = holder._sparse_tile.block_n
    assert int(holder.tables().splits_sparse[1, -(-200 // tile)]) > 1, "top-200 must be split"
    for (slot, B, _, topk), (o_ref, lse_ref) in zip(REQUESTS, host_answers, strict=True):
        hdr = buf.rep_hdr[slot].tolist()
        assert hdr == [1, W.OK, 0, B * GEOM.heads, GEOM.heads], (slot, hdr)
        assert int(buf.rep_sig[slot]) == 1
        what = f"slot {slot} ({'dense' if topk is None else f'top-{topk}'})"
        if EXACT:
            assert torch.equal(buf.rep_o[slot, :B], o_ref), f"{what}: o differs"
            assert torch.equal(buf.rep_lse[slot, :B], lse_ref), f"{what}: lse differs"
        else:  # compiled twice (two kernels): the same arithmetic, maybe other instructions
            assert_close(buf.rep_o[slot, :B], o_ref, TOLERANCES[bound], name=what)
        # the slot's tokens beyond B are never written: their poison stays
        assert bool(torch.isnan(buf.rep_o[slot, B:].float()).all())


def test_merge_of_one_reply_is_the_reply_and_merges_a_local_partial(served):
    buf, _, client = served
    o, lse, status = client.merge([0], 2, GEOM.heads)
    check_status(status, [0])
    assert torch.equal(o, buf.rep_o[0, :2]) and torch.equal(lse, buf.rep_lse[0, :2])
    o_loc = _randn(5, 2, GEOM.heads, GEOM.d_v)
    lse_loc = torch.randn(2, GEOM.heads, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    o, lse, status = client.merge([0], 2, GEOM.heads, local=(o_loc, lse_loc))
    check_status(status, [0])
    o_ref, lse_ref = merge_reference(
        torch.stack([buf.rep_o[0, :2], o_loc]), torch.stack([buf.rep_lse[0, :2], lse_loc])
    )
    assert_close(o, o_ref, TOLERANCES[("merge", "bfloat16")], name="merged o")
    assert_close(lse, lse_ref, TOLERANCES[("merge_lse", "float32")], name="merged lse")


def _raw(buf, slot, seq, *, layer=0, chunk=CHUNK, batch=1, heads=16, mode=0, topk=0, sig=None):
    """A request written by hand (a buggy or hostile requester): header words, then signal."""
    buf.in_hdr[slot] = torch.tensor([seq, layer, chunk, batch, heads, mode, topk, 0]).to(DEVICE)
    buf.in_sig[slot] = seq if sig is None else sig


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bad_headers_get_error_words_and_nothing_is_written(schedule):
    buf, holder, _ = _device(slots=8, max_batch=2, max_topk=64, ctas=2, schedule=schedule)
    _raw(buf, 0, 1, layer=2)  # a layer the holder does not hold
    _raw(buf, 1, 1, chunk=5)  # a chunk id in the table, not hosted
    _raw(buf, 2, 1, chunk=99)  # a chunk id outside the table
    _raw(buf, 3, 1, batch=3)  # more tokens than a slot holds
    _raw(buf, 4, 1, heads=17)  # more heads than the holder's
    _raw(buf, 5, 1, mode=7)  # no such mode
    _raw(buf, 6, 1, mode=1, topk=65)  # a selection wider than the slot's
    _raw(buf, 7, 5, sig=6)  # a header that claims another number than its signal
    holder.serve_once()
    want = [W.ERR_LAYER, W.ERR_CHUNK, W.ERR_CHUNK, W.ERR_ROWS, W.ERR_ROWS, W.ERR_MODE,
            W.ERR_TOPK, W.ERR_SEQ]  # fmt: skip
    assert buf.rep_hdr[:, 1].tolist() == [int(w) for w in want]
    assert buf.rep_hdr[:, 2].tolist() == [2, 5, 99, 48, 17 * 1, 7, 65, 6]
    assert buf.rep_sig.tolist() == [1] * 7 + [6]
    assert bool(torch.isnan(buf.rep_o.float()).all()) and bool(torch.isnan(buf.rep_lse).all())


def test_an_index_outside_the_chunk_is_refused_and_never_read():
    buf, holder, client = _device(slots=1, max_batch=1, max_topk=64, ctas=2)
    idx = torch.tensor([[0, 5, TOKENS, -1]], dtype=torch.int32).to(DEVICE)  # one past the chunk
    client.put(0, _randn(1, 1, GEOM.heads, GEOM.d_qk), layer=0, chunk=CHUNK, indices=idx)
    holder.serve_once()
    assert buf.rep_hdr[0].tolist()[:2] == [1, W.ERR_INDEX]
    o, lse, status = client.merge([0], 1, GEOM.heads)
    with pytest.raises(RouteFailed, match="slot 0: index"):
        check_status(status, [0])
    assert bool(torch.isnan(lse).all()), "a failed route must not merge as empty"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sequence_numbers_that_wrap_or_go_backwards_are_refused(schedule):
    buf, holder, client = _device(slots=2, ctas=2, schedule=schedule)
    buf.in_hdr[0, int(W.H_SEQ)] = (
        2**63 - 1
    )  # the slot's last number: the next put's wraps to -2**63
    client.put(0, _randn(2, 1, GEOM.heads, GEOM.d_qk), layer=0, chunk=CHUNK, probe=True)
    client.put(1, _randn(3, 1, GEOM.heads, GEOM.d_qk), layer=0, chunk=CHUNK, probe=True)
    holder.serve_once()
    assert int(client.seq[0]) == -(2**63)
    assert buf.rep_hdr[0].tolist()[:2] == [-(2**63), W.ERR_SEQ]
    assert buf.rep_hdr[1].tolist() == [1, W.OK, 0, 0, 0]  # the probe: a header-only answer
    buf.in_hdr[1, int(W.H_SEQ)] = -6  # a slot whose numbers went backwards: -5 after 1
    client.put(1, _randn(3, 1, GEOM.heads, GEOM.d_qk), layer=0, chunk=CHUNK, probe=True)
    holder.serve_once()
    assert buf.rep_hdr[1].tolist()[:2] == [-5, W.ERR_SEQ]
    buf.in_hdr[1, int(W.H_SEQ)] = -6  # the same number again: a duplicate, never answered twice
    buf.rep_hdr[1] = 0
    client.put(1, _randn(3, 1, GEOM.heads, GEOM.d_qk), layer=0, chunk=CHUNK, probe=True)
    holder.serve_once()
    assert buf.rep_hdr[1].tolist() == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stop_word_and_idle_bound_end_the_persistent_loop_and_missing_replies_time_out(schedule):
    buf, holder, client = _device(slots=2, ctas=2, schedule=schedule)

    def persistent(max_idle=1 << 30):
        if schedule == "pass":  # the pass's take waits on the device; persistent, it returns
            holder._run_pass(persistent=True, max_idle=max_idle)  # on the stop word or idle
        else:
            holder.launch(persistent=True, max_idle=max_idle)()
        holder.launch(sparse=True, persistent=True, max_idle=max_idle)()

    client.put(0, _randn(4, 1, GEOM.heads, GEOM.d_qk), layer=0, chunk=CHUNK, probe=True)
    holder.tables().stop.fill_(1)  # stopped before it starts: one pass, then it returns
    persistent()
    assert buf.rep_hdr[0].tolist() == [1, W.OK, 0, 0, 0]
    holder.tables().stop.fill_(0)
    persistent(max_idle=2)  # nothing to serve: returns after 2 polls
    client.put(1, _randn(5, 1, GEOM.heads, GEOM.d_qk), layer=0, chunk=CHUNK, probe=True)
    _, lse, status = client.merge([1], 1, GEOM.heads)  # nobody served it: a bounded wait
    assert status.tolist() == [int(W.TIMEOUT)] and bool(torch.isnan(lse).all())


def test_the_client_refuses_what_the_slot_cannot_hold():
    buf, _, client = _device(slots=1, max_batch=2, max_topk=64, ctas=1)
    with pytest.raises(ValueError, match="q: expected 1..2 tokens"):
        client.put(0, _randn(1, 3, GEOM.heads, GEOM.d_qk), layer=0, chunk=CHUNK)
    with pytest.raises(TypeError, match="q: invalid dtype"):
        client.put(0, torch.zeros(1, GEOM.heads, GEOM.d_qk, device=DEVICE), layer=0, chunk=CHUNK)
    with pytest.raises(ValueError, match="indices: expected 1..64"):
        idx = torch.zeros(1, 65, dtype=torch.int32, device=DEVICE)
        client.put(0, _randn(1, 1, GEOM.heads, GEOM.d_qk), layer=0, chunk=CHUNK, indices=idx)
    with pytest.raises(ValueError, match="slot"):
        client.put(1, _randn(1, 1, GEOM.heads, GEOM.d_qk), layer=0, chunk=CHUNK)
    assert int(buf.in_sig[0]) == 0, "nothing was put"


def test_the_device_route_profile_is_fitted_from_bench_records():
    """``fit_device_route`` reads ``perf.bench_device_route`` records (probe, one-requester
    route sweep at 16 heads; other records ignored) and recovers the affine round trip."""
    from mqnc.cost.calibration_fits import fit_device_route

    def rec(bench, x, p50, **extra):
        return dict(bench=bench, x=x, p50=p50, transport="device-local", device="test",
                    commit="c0", extra=dict(heads=16, c_t=2048, **extra))  # fmt: skip

    # probe 4 us, turnaround 10 us, 2184 B a row at 50 GB/s
    route = [rec("route", m, 14 + m * 2184 / 50e3, requesters=1) for m in (16, 256, 512, 1024)]
    noise = [rec("route", 16, 999.0, requesters=4), rec("route", 128, 999.0, requesters=1)]
    noise[1]["extra"]["heads"] = 128
    prof = fit_device_route([rec("probe", 1, 4.0), *route, *noise, dict(bench="route", x=1)])
    assert prof.name == "device-local" and prof.host_fixed_us == 0.0
    assert prof.t_probe_us == pytest.approx(4.0)
    assert prof.turnaround_us == pytest.approx(10.0, rel=1e-6)
    assert prof.bw_gbps == pytest.approx(50.0, rel=1e-6)
    assert "c_t 2048" in prof.source and "partial attention" in prof.description
    with pytest.raises(ValueError, match="probe"):
        fit_device_route(route)


def test_the_demo_routes_its_corpus_over_the_device_route(tmp_path, capsys, monkeypatch):
    """``mqnc demo --device-route``: the demo model's prefilled chunks on a device holder; a
    calibration measured on this device (probe, route at both agents' ``M_q``, fetch) fits the
    profile each (chunk, agent) is decided with (route or fetch, both costs printed); then every
    layer runs as decided, routed replies and fetched chunks' local partials merged in one
    launch, within the bf16 bound of fp64 attention over the chunks' union (the run asserts
    it). Here every other decision is flipped, so that both primitives run whatever the
    interpreter's timings pick."""
    import json

    import mqnc.demo.device_demo as demo
    from mqnc.cli import main

    decide = demo._decide

    def both(*args):
        got = decide(*args)
        for i, d in enumerate(got):
            d["choice"] = ("route", "fetch")[i % 2]
        return got

    monkeypatch.setattr(demo, "_decide", both)
    argv = ["demo", "--device-route", "--layers", "1", "--chunks", "2", "--min-tokens", "16",
            "--max-tokens", "40", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "device route: 2 chunks" in out and "decisions: route 2, fetch 2" in out
    got = json.loads((tmp_path / "device_route.json").read_text())
    assert got["chunks"] == 2 and len(got["layer_us"]) == 2 and len(got["vs_fp64_max_abs"]) == 2
    assert {d["choice"] for d in got["decisions"]} == {"route", "fetch"}
    assert {r["bench"] for r in got["calibration"]} == {"probe", "route", "fetch"}
    assert all(d["route_us"] > 0 and d["fetch_us"] > 0 for d in got["decisions"])
    assert got["host_free"] is (DEVICE.type == "cuda")


def test_route_layout_refuses_what_the_kernels_cannot_lay_out():
    with pytest.raises(ValueError, match="slots"):
        RouteLayout(0, 1, 16)
    with pytest.raises(ValueError, match="d_qk, d_v"):
        RouteLayout(1, 1, 16, d_qk=640, d_v=576)
    with pytest.raises(TypeError, match="dtype"):
        RouteLayout(1, 1, 16, dtype=torch.int8)
    layout = RouteLayout(2, 4, 16, max_topk=64)
    buf = allocate(layout, LocalBackend(DEVICE))
    assert buf.in_q.shape == (2, 4, 16, 576) and buf.rep_o.shape == (2, 4, 16, 512)
    assert buf.in_hdr.shape == (2, W.HEADER_WORDS) and buf.rep_hdr.shape == (2, W.REPLY_WORDS)
    assert int(buf.in_sig.sum()) == 0 and int(buf.rep_sig.sum()) == 0  # the first number is 1
    nbytes = sum(t.numel() * t.element_size() for t in vars(buf).values()) // 2
    assert layout.slot_bytes == nbytes


def test_an_answered_number_is_skipped_by_every_cta_alike():
    """A signal equal to the slot's reply signal is answered already: even a CTA that never saw
    it (here: one whose record is set back, as a CTA of the dense kernel that skipped a sparse
    request's number) does not serve it, so the next request's arrivals stay whole and it is
    answered only when every CTA has done its share."""
    buf, holder, client = _device(slots=1, max_batch=1, ctas=2, schedule="resident")
    q = _randn(7, 1, GEOM.heads, GEOM.d_qk)
    client.put(0, q, layer=1, chunk=CHUNK)
    holder.serve_once()
    first = buf.rep_o[0, :1].clone()
    state = holder.tables(sparse=False)
    state.seen[1, 0] = 0  # CTA 1 of the dense kernel: as if it never saw number 1
    holder.serve_once()  # number 1 again, answered already: nobody serves it
    assert state.arrive.tolist() == [0] and buf.rep_hdr[0].tolist()[:2] == [1, W.OK]
    buf.rep_o.fill_(float("nan"))
    client.put(0, q, layer=1, chunk=CHUNK)
    holder.serve_once()
    assert buf.rep_hdr[0].tolist() == [2, W.OK, 0, GEOM.heads, GEOM.heads]
    assert state.arrive.tolist() == [0]
    assert torch.equal(buf.rep_o[0, :1], first)  # every item of it written, the same answer


def test_the_merge_refuses_what_the_reply_slots_cannot_hold():
    _, _, client = _device(slots=1, max_batch=2, max_topk=64, ctas=1)
    with pytest.raises(ValueError, match="batch"):
        client.merge([0], 3, GEOM.heads)
    with pytest.raises(ValueError, match="heads"):
        client.merge([0], 1, GEOM.heads + 1)
    with pytest.raises(ValueError, match="slots"):
        client.merge([1], 1, GEOM.heads)
    with pytest.raises(ValueError, match="slots"):
        client.merge([], 1, GEOM.heads)
    o_loc = torch.zeros(1, GEOM.heads, GEOM.d_v, device=DEVICE)  # fp32, not the cache's bf16
    lse_loc = torch.zeros(1, GEOM.heads, device=DEVICE)
    with pytest.raises(ValueError, match=r"local\[0\] \(o\)"):
        client.merge([0], 1, GEOM.heads, local=(o_loc, lse_loc))


def test_bench_check_names_the_goal_a_run_missed(tmp_path, capsys):
    """``perf.bench_device_route --check`` on a GPU: status 1 when this run misses a goal at
    H 16 and c_t 2048 (probe 5 us; route M_q 1, 16: 15 us; M_q 1024: 40 us; 16 requesters of
    M_q 16: 60 us), the holder's compute is over 1.5x the default kernel's, or the measured
    crossover is more than 15% from the predicate's, naming each; other points and the records
    of earlier runs in the file do not count."""
    from perf.bench_device_route import _missed

    def rec(bench, p50, x=1, heads=16, c_t=2048, n=1):
        extra = dict(heads=heads, c_t=c_t, requesters=n)
        return dict(bench=bench, x=x, p50=p50, p20=p50, p80=p50, extra=extra)

    out = tmp_path / "r.jsonl"
    old = [rec("probe", 99.0)]  # an earlier run's miss
    ok = [
        rec("probe", 4.0),
        rec("route", 14.0),
        rec("route", 14.5, x=16),
        rec("route", 39.0, x=1024),
        rec("route", 59.0, x=16, n=16),
        rec("route", 90.0, x=64),  # no goal at M_q 64
        rec("route", 50.0, heads=128),  # nor at 128 heads
        rec("route", 50.0, c_t=8192),  # nor at c_t 8192
        rec("holder_attend", 14.0, x=1024),
        rec("default_attend", 10.0, x=1024),
    ]
    out.write_text("".join(json.dumps(r) + "\n" for r in old + ok))
    assert _missed(str(out), 1) == 0
    with out.open("a") as f:
        f.write(json.dumps(rec("route", 41.5, x=1024)) + "\n")
        f.write(json.dumps(rec("route", 61.0, x=16, n=16)) + "\n")
        f.write(json.dumps(rec("holder_attend", 15.5, x=1024)) + "\n")
    assert _missed(str(out), 1) == 1
    err = capsys.readouterr().err
    assert "route M_q 1024 p50 41.50 us > 40.0" in err
    assert "route M_q 16 x 16 p50 61.00 us > 60.0" in err
    assert "holder_attend p50 15.50 us > 1.5 x default_attend 10.00 us" in err


def _same(got, want, what):
    """Bit for bit where both run the interpreter's arithmetic (NaN where the other is NaN);
    within the bf16 bound where compiled."""
    if EXACT:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=what)
    else:
        assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN rows differ"
        ok = ~torch.isnan(want)
        assert_close(got[ok], want[ok], TOLERANCES[("mla", "bfloat16")], name=what)


def test_sequence_numbers_belong_to_the_slot_not_the_client():
    """A second client on a slot (made before either puts) and one made after the routes (a
    restarted requester) number their requests after the slot's last one: each is answered
    (not skipped as a duplicate of the other's) and each merge takes its own request's
    answer. A client whose number the slot has passed never merges the newer reply as its
    own."""
    buf, holder, first = _device(slots=1, max_batch=1, ctas=2)
    second = RouteClient(buf, LocalBackend(DEVICE), spins=first.spins)
    qa, qb = _randn(7, 1, GEOM.heads, GEOM.d_qk), _randn(8, 1, GEOM.heads, GEOM.d_qk)
    answers = []
    for q in (qa, qb):  # each alone on fresh slots: the reference answers
        _, h, c = _device(slots=1, max_batch=1, ctas=2)
        c.put(0, q, layer=1, chunk=CHUNK)
        h.serve_once()
        o, lse, status = c.merge([0], 1, GEOM.heads)
        check_status(status, [0])
        answers.append((o, lse))
    first.put(0, qa, layer=1, chunk=CHUNK)
    holder.serve_once()
    o, lse, status = first.merge([0], 1, GEOM.heads)
    check_status(status, [0])
    _same(o, answers[0][0], "first o")
    second.put(0, qb, layer=1, chunk=CHUNK)
    holder.serve_once()
    assert buf.rep_hdr[0].tolist()[:2] == [2, W.OK], "the second request was not answered"
    o, lse, status = second.merge([0], 1, GEOM.heads)
    check_status(status, [0])
    _same(o, answers[1][0], "second o")
    _same(lse, answers[1][1], "second lse")
    _, lse, status = first.merge([0], 1, GEOM.heads)  # its number 1 is passed: not its reply
    assert status.tolist() == [int(W.TIMEOUT)] and bool(torch.isnan(lse).all())
    restarted = RouteClient(buf, LocalBackend(DEVICE), spins=first.spins)
    restarted.put(0, qa, layer=1, chunk=CHUNK)
    holder.serve_once()
    assert buf.rep_hdr[0].tolist()[:2] == [3, W.OK] and int(restarted.seq[0]) == 3
    o, lse, status = restarted.merge([0], 1, GEOM.heads)
    check_status(status, [0])
    _same(o, answers[0][0], "restarted o")
    _same(lse, answers[0][1], "restarted lse")


def test_the_merge_refuses_rows_the_reply_did_not_answer():
    """A merge of more tokens or heads than the request carried: refused on the host when this
    client put it (``ValueError`` naming the argument); on the device the reply's rows and
    heads words decide (a probe answers no row; a reply answering fewer rows than the merge
    reads): status ``unanswered``, the step NaN, never stale rows as a partial."""
    buf, holder, client = _device(slots=2, max_batch=2, ctas=2)
    q = _randn(9, 1, 8, GEOM.d_qk)  # one token of 8 heads
    client.put(0, q, layer=0, chunk=CHUNK)
    client.put(1, q, layer=0, chunk=CHUNK, probe=True)
    holder.serve_once()
    with pytest.raises(ValueError, match=r"batch: .*slot 0.* 1 token.* got 2"):
        client.merge([0], 2, 8)
    assert buf.rep_hdr[0].tolist() == [1, W.OK, 0, 8, 8]  # rows answered, heads answered
    assert buf.rep_hdr[1].tolist() == [1, W.OK, 0, 0, 0]
    with pytest.raises(ValueError, match=r"heads: .*slot 0.* 8 heads.* got 16"):
        client.merge([0], 1, GEOM.heads)
    with pytest.raises(ValueError, match=r"slots: .*no request.* slot 1"):
        RouteClient(buf, LocalBackend(DEVICE)).merge([1], 1, 8)
    o, lse, status = client.merge([0], 1, 8)
    check_status(status, [0])
    assert torch.equal(o, buf.rep_o[0, :1, :8]) and torch.equal(lse, buf.rep_lse[0, :1, :8])
    _, lse, status = client.merge([1], 1, 1)  # the probe's reply: no row to merge
    assert status.tolist() == [int(W.UNANSWERED)] and bool(torch.isnan(lse).all())
    with pytest.raises(RouteFailed, match="slot 1: unanswered"):
        check_status(status, [1])
    buf.rep_hdr[0, int(W.R_ROWS)] = 4  # a reply that answered 4 heads of the token only
    buf.rep_hdr[0, int(W.R_HEADS)] = 4
    o, lse, status = client.merge([0], 1, 8)
    assert status.tolist() == [int(W.UNANSWERED)]
    assert bool(torch.isnan(lse).all()) and bool(torch.isnan(o.float()).all())
    buf.rep_hdr[0, int(W.R_ROWS)] = 8
    buf.rep_hdr[0, int(W.R_HEADS)] = 8
    buf.rep_hdr[0, int(W.R_SEQ)] = 7  # the signal is this request's, the header another's
    _, lse, status = client.merge([0], 1, 8)
    assert status.tolist() == [int(W.ERR_SEQ)] and bool(torch.isnan(lse).all())


def test_the_merge_checks_its_out_tensors():
    """``merge(out=(o, lse, status))`` checks each tensor's type, shape, dtype, device and
    layout on the host before the launch (a short ``status`` would be written out of bounds,
    an ``o`` of another width or batch merged wrongly as ``OK``), naming it."""
    buf, holder, client = _device(slots=1, max_batch=2, ctas=1)
    client.put(0, _randn(11, 2, GEOM.heads, GEOM.d_qk), layer=0, chunk=CHUNK)
    holder.serve_once()
    H, d_v, bf16, i64 = GEOM.heads, GEOM.d_v, torch.bfloat16, torch.int64

    def e(*shape, dtype=torch.float32, device=DEVICE):
        return torch.empty(*shape, dtype=dtype, device=device)

    o, lse, status = e(2, H, d_v, dtype=bf16), e(2, H), e(1, dtype=i64)
    O, L, S = r"out\[0\] \(o\)", r"out\[1\] \(lse\)", r"out\[2\] \(status\)"
    bad = [
        ((e(2, H, d_v // 2, dtype=bf16), lse, status), ValueError, O + r".*got \(2, 16, 256\)"),
        ((e(1, H, d_v, dtype=bf16), lse, status), ValueError, O + r".*got \(1, 16, 512\)"),
        ((e(2, H, d_v), lse, status), TypeError, O + r".*bfloat16.*got torch.float32"),
        ((e(2, d_v, H, dtype=bf16).transpose(1, 2), lse, status), ValueError, O + ".*contiguous"),
        ((o, e(2, H, device="meta"), status), ValueError, L + ".*meta"),
        ((o, e(2, H, dtype=bf16), status), TypeError, L + r".*float32.*got torch.bfloat16"),
        ((o, lse, e(1, dtype=torch.int32)), TypeError, S + r".*int64.*got torch.int32"),
        ((o, lse), TypeError, r"out: expected a tuple of three tensors"),
        ((o, lse, [0]), TypeError, S + r".*Tensor.*got list"),
        ((o, lse, e(0, dtype=i64)), ValueError, S + r".*\(1,\).*got \(0,\)"),
    ]  # fmt: skip
    for out, exc, match in bad:
        with pytest.raises(exc, match=match):
            client.merge([0], 2, H, out=out)
    got = client.merge([0], 2, H, out=(o, lse, status))
    assert got[0] is o and got[1] is lse and got[2] is status
    check_status(status, [0])
    assert torch.equal(o, buf.rep_o[0]) and torch.equal(lse, buf.rep_lse[0])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_row_whose_every_score_overflows_is_nan_as_on_the_host_route(schedule):
    """A query row whose every score overflows to ``-inf`` (``q . k`` below float32's range)
    has keys but no finite ``lse``: the host route answers it NaN (never an empty partial),
    and so does the device route (the reply's ``lse`` NaN, its ``o`` what the kernel wrote),
    dense split and sparse; the merge gives that row NaN (``o`` and ``lse``), status ``OK``,
    the other rows their answers."""
    kv = KV.clone()
    kv[..., 0] = 2.0**126  # every entry's first latent value: 2^126
    qd = _randn(30, 2, GEOM.heads, GEOM.d_qk)
    qd[..., 0] = 0.0
    qd[1, 3, 0] = -(2.0**126)  # token 1, head 3: every score -2^252 -> -inf
    qs = _randn(31, 1, GEOM.heads, GEOM.d_qk)
    qs[..., 0] = 0.0
    qs[0, 12, 0] = -(2.0**126)
    idx = _indices(32, 1, 200)
    buf, holder, client = _device(slots=2, max_batch=2, kv=kv, schedule=schedule)
    host = _host_answers(GEOM, kv, routes=[(qd, None, 1), (qs, idx, 0)], holder=holder)
    for (_, lse_ref), (b, h) in zip(host, [(1, 3), (0, 12)], strict=True):
        assert bool(torch.isnan(lse_ref[b, h])), "the host route answers NaN"
        assert int(torch.isnan(lse_ref).sum()) == 1
    if schedule == "pass":
        assert holder.num_splits > 1, "the dense request must be split"
    else:
        assert int(holder.tables().splits_dense[CHUNK][2]) > 1, "the dense request must be split"
    client.put(0, qd, layer=1, chunk=CHUNK)
    client.put(1, qs, layer=0, chunk=CHUNK, indices=idx)
    holder.serve_once()
    for slot, B, (o_ref, lse_ref) in ((0, 2, host[0]), (1, 1, host[1])):
        assert buf.rep_hdr[slot].tolist()[:2] == [1, W.OK]
        _same(buf.rep_lse[slot, :B], lse_ref, f"slot {slot} lse")
        _same(buf.rep_o[slot, :B], o_ref, f"slot {slot} o")
    for slot, B, (b, h) in ((0, 2, (1, 3)), (1, 1, (0, 12))):
        o, lse, status = client.merge([slot], B, GEOM.heads)
        check_status(status, [slot])
        assert torch.isnan(lse).nonzero().tolist() == [[b, h]], f"slot {slot}: lse"
        assert bool(torch.isnan(o[b, h].float()).all()), f"slot {slot}: o of the NaN row"
        assert int(torch.isnan(o.float()).sum()) == GEOM.d_v, f"slot {slot}: o"


def test_the_pass_takes_a_number_once_and_answers_only_the_rows_asked():
    """The pass's take serves a number once: set back as if never seen, an answered number is
    not served again (its reply stays); a request of fewer heads than the slot's gets those
    heads written, every other row of its slot keeps its poison; a request of 3 tokens spans
    two folded rows (the second padded by the slot's next token), answered as the host holder
    folding alike."""
    buf, holder, client = _device(slots=1, max_batch=4, ctas=2)
    q = _randn(8, 3, 8, GEOM.d_qk)
    client.put(0, q, layer=1, chunk=CHUNK)
    holder.serve_once()
    assert buf.rep_hdr[0].tolist() == [1, W.OK, 0, 3 * 8, 8]
    assert bool(torch.isnan(buf.rep_o[0, :3, 8:].float()).all()), "heads not asked: not written"
    assert bool(torch.isnan(buf.rep_o[0, 3:].float()).all()), "tokens not asked: not written"
    o, lse, status = client.merge([0], 3, 8)
    check_status(status, [0])
    ref = _host_answers(GEOM, KV, routes=[(q, None, 1)], holder=holder)
    _same(o, ref[0][0], "o of 8 heads")
    _same(lse, ref[0][1], "lse of 8 heads")
    holder._pass_state["seen"].zero_()  # as if the take never saw number 1
    buf.rep_o.fill_(float("nan"))
    holder.serve_once()
    assert bool(torch.isnan(buf.rep_o.float()).all()), "an answered number was served again"
    client.put(0, q, layer=1, chunk=CHUNK)
    holder.serve_once()
    assert buf.rep_hdr[0].tolist() == [2, W.OK, 0, 3 * 8, 8]


def test_the_pass_packs_one_chunk_and_layer_together_and_defers_what_does_not_fit():
    """Requests asking one (chunk, layer) share folded rows (the second's rows follow the
    first's); one at another layer starts the next folded row; with one folded row a pass,
    what does not fit waits for the next pass (the one-shot serve runs three) and is answered
    alike, each request as the host holder folding it alone answers it."""
    from mqnc.triton_kernels.route.holder_pass import OFF_WORD

    routes = [(0, 2, 1), (1, 1, 1), (2, 1, 0)]  # (slot, tokens, layer)
    qs = [_randn(40 + s, B, GEOM.heads, GEOM.d_qk) for s, B, _ in routes]
    host = None
    for pass_rows, passes in ((256, 1), (32, 3)):  # folded rows of 32: 8, then 1 a pass
        buf, holder, client = _device(slots=3, pass_rows=pass_rows)
        for (slot, _, layer), q in zip(routes, qs, strict=True):
            client.put(slot, q, layer=layer, chunk=CHUNK)
        before = holder.launches
        holder.serve_once()
        record = holder._pass_state["record"]
        if passes == 1:
            assert record[:, OFF_WORD].tolist() == [0, 32, 64], "packed by (chunk, layer)"
        else:
            assert record[:, OFF_WORD].tolist()[2] == 0, "the last pass took only slot 2"
        assert holder.launches - before == 4 * passes + 1  # (+ the sparse kernel's)
        if host is None:  # (the same fold and split count for both holders)
            asked = [(q, None, ly) for q, (_, _, ly) in zip(qs, routes, strict=True)]
            host = _host_answers(GEOM, KV, routes=asked, holder=holder)
        for (slot, B, _), (o_ref, lse_ref) in zip(routes, host, strict=True):
            assert buf.rep_hdr[slot].tolist() == [1, W.OK, 0, B * GEOM.heads, GEOM.heads]
            _same(buf.rep_o[slot, :B], o_ref, f"slot {slot} o ({passes} passes)")
            _same(buf.rep_lse[slot, :B], lse_ref, f"slot {slot} lse ({passes} passes)")


def _profile_records(c_t, *, probe=4.0, turnaround=10.0, bw=50.0, pull_us=2.0, splice_us=6.0,
                     m_qs=(1, 16, 256, 1024)):  # fmt: skip
    """Bench records drawn from the affine model: a route round trip of ``probe + turnaround
    + M_q (q + p) / bw`` per layer, a fetch of ``pull_us + splice_us`` per layer."""

    def rec(bench, x, p50, **extra):
        return dict(bench=bench, x=x, p50=p50, transport="device-local", device="test",
                    commit="c0", extra=dict(heads=16, c_t=c_t, requesters=1, **extra))  # fmt: skip

    out = [rec("probe", 1, probe)]
    out += [rec("route", m, probe + turnaround + m * 2184 / (bw * 1e3)) for m in m_qs]
    out.append(rec("fetch", c_t, pull_us + splice_us, pull_us=pull_us, splice_us=splice_us,
                   entry_bytes=1152))  # fmt: skip
    return out


def test_the_device_profile_prices_route_and_fetch_as_measured():
    """``device_profile`` fits the route per chunk size and the fetch's pull rate and splice
    from the bench's records; the predicate with it turns from route to fetch where the
    model's two lines cross, and so does the measured crossover (linear between the route
    points); fetch faster everywhere is 0, route faster everywhere None, and they agree
    by side."""
    from mqnc.cost.device_profile import (
        Crossover,
        crossovers,
        device_profile,
        measured_crossover,
        predicted_crossover,
    )

    recs = _profile_records(2048, pull_us=20.0, splice_us=14.0)  # fetch 34 us a layer
    prof = device_profile(recs, 2048)
    assert prof.fabric.t_probe_us == pytest.approx(4.0)
    assert prof.fabric.turnaround_us == pytest.approx(10.0, rel=1e-6)
    assert prof.fabric.bulk_bw_gbps == pytest.approx(2048 * 1152 / 20.0 / 1e3)
    assert prof.splice.at(2048) == pytest.approx(14.0)
    want = (34.0 - 14.0) * 50e3 / 2184  # where 14 + M_q 2184 / 50e3 meets 34: 457.9 rows
    assert predicted_crossover(prof, PRESETS["deepseek-v2-lite"], 2048) == pytest.approx(
        want, rel=2e-3
    )
    m, span = measured_crossover(recs, 2048)
    assert span == (1.0, 1024.0) and m == pytest.approx(want, rel=1e-9)  # (linear: exact)
    (c,) = crossovers(recs)
    assert c.c_t == 2048 and c.agrees(0.15), c.describe()
    assert not Crossover(2048, 300.0, want, span).agrees(0.15)
    slow = _profile_records(8192, pull_us=1.0, splice_us=2.0)  # fetch beats every route point
    assert measured_crossover(slow, 8192)[0] == 0.0
    assert crossovers(slow)[0].agrees()
    assert "fetch wins from M_q 1" in crossovers(slow)[0].describe()
    fast = _profile_records(8192, pull_us=300.0, splice_us=300.0)  # route wins past the sweep
    assert measured_crossover(fast, 8192)[0] is None
    assert crossovers(fast)[0].agrees()
    with pytest.raises(ValueError, match="fetch record at c_t 4096"):
        device_profile(recs, 4096)
    with pytest.raises(ValueError, match="route points at >= 2 M_q values"):
        device_profile(recs + _profile_records(4096)[-1:], 4096)
    with pytest.raises(ValueError, match="fetch record at c_t 2048"):
        device_profile([r for r in recs if r["bench"] != "fetch"], 2048)


def test_a_route_sweep_that_does_not_grow_takes_the_rows_at_the_pull_rate():
    """A route sweep whose round trips do not grow with ``M_q`` beyond their noise (all fixed
    cost, as a fast holder's can be) cannot be fitted for a bandwidth: ``fit_device_route``
    refuses it alone, and ``device_profile`` takes the rows at the measured pull rate, the
    fixed part the fastest point's, saying so."""
    from mqnc.cost.calibration_fits import fit_device_route
    from mqnc.cost.device_profile import device_profile

    recs = _profile_records(2048, pull_us=20.0, splice_us=14.0)
    for r, t in zip((r for r in recs if r["bench"] == "route"), (20.0, 19.0, 19.5, 18.0),
                    strict=True):  # fmt: skip
        r["p50"] = t
    with pytest.raises(ValueError, match="does not grow"):
        fit_device_route(recs, c_t=2048)
    prof = device_profile(recs, 2048)
    assert prof.fabric.bw_gbps == pytest.approx(2048 * 1152 / 20.0 / 1e3)
    assert prof.fabric.turnaround_us == pytest.approx(18.0 - 4.0)  # the fastest, less the probe
    assert "pull rate" in prof.fabric.description


def test_the_device_holder_refuses_a_bad_schedule_fold_or_pass_by_name():
    """``schedule``, ``fold`` (a power of two >= 16), ``pass_rows``, ``num_splits`` and
    ``serve_sparse`` are checked when the holder is made, each error naming its argument; a
    pass is never smaller than one full slot."""
    buf = allocate(RouteLayout(1, 2, GEOM.heads, max_topk=64), LocalBackend(DEVICE))
    make = dict(softmax_scale=SCALE, num_blocks=8)
    for kw, err, match in (
        (dict(schedule="resident-pass"), ValueError, "schedule: expected one of"),
        (dict(fold=48), ValueError, "fold: expected a power of two"),
        (dict(fold=8), ValueError, "fold"),
        (dict(pass_rows=0), ValueError, "pass_rows"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(serve_sparse=1), TypeError, "serve_sparse: expected a bool"),
    ):
        with pytest.raises(err, match=match):
            DeviceHolder(buf, GEOM, **make, **kw)
    holder = DeviceHolder(buf, GEOM, **make, pass_rows=1)
    assert (holder.groups, holder.fold) == (1, 128), "one slot's 32 rows: one folded row"
    big = allocate(RouteLayout(1, 16, GEOM.heads, max_topk=64), LocalBackend(DEVICE))
    assert DeviceHolder(big, GEOM, **make, pass_rows=1).groups == 2, "a full slot fits a pass"
