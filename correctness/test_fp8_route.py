"""FP8 holders and requesters end to end over loopback: fetch to a new offset (the FP8 splice),
routes served on an FP8 cache (dense and a selection), and format mismatches named.

Two bars, reported apart (docs/fp8-cache.md): the **kernel bound**, against the fp64 reference
over the dequantized cache (the entries the holder or the requester's pool holds, dequantized
exactly), with the bf16 tolerance table's entries; and the **quantization error**, against the
same calls on a bf16 holder of the rows the entries were quantized from, bounded a posteriori
by :func:`_quantization_bound` (what the keys' quantization can move an output at most, from
the quantization error of those very keys) plus both calls' kernel bounds.
"""

from __future__ import annotations

import math

import pytest
import torch

from mqnc.model import PRESETS, RopeSpec
from mqnc.reference.attention_ref import partial_attention_reference
from mqnc.reference.fp8_ref import fp8_dequantize_reference, fp8_quantize_reference
from mqnc.reference.rope_ref import fp8_rope_rotate_reference
from mqnc.serving import Corpus
from mqnc.serving.local import LocalHolders
from mqnc.testing import TOLERANCES, assert_close

D_C, D_R, D = 512, 64, 576
ROPE = RopeSpec.from_preset("deepseek-v2-lite")
SCALE = ROPE.softmax_scale
G16 = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=4)
G8 = G16.replace(cache_dtype="fp8_e4m3")
TOKENS, CHUNK = 40, 16  # chunks 0 (16 tokens at 0), 1 (16 at 16), 2 (8 at 32)
TOL_O, TOL_LSE = TOLERANCES[("mla_fp8", "bfloat16")], TOLERANCES[("mla_lse", "float32")]


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randn(G16.layers, TOKENS, D, generator=g).clamp(-4, 4).to(torch.bfloat16)


ROWS = _rows()
ENTRIES = fp8_quantize_reference(ROWS, D_C)


def _cluster(fp8: bool, kernels: str) -> LocalHolders:
    rows, g = (ENTRIES, G8) if fp8 else (ROWS, G16)
    corpus = Corpus.partition(
        rows, g, SCALE, chunk_tokens=CHUNK, holders=[1], rope=ROPE, block_size=16
    )
    return LocalHolders(corpus, kernels=kernels, timeout_s=60.0)


@pytest.fixture(scope="module", params=["torch", "triton"])
def clusters(request):
    """An FP8 holder and a bf16 holder of the same rows, each with its requester."""
    c8, c16 = _cluster(True, request.param), _cluster(False, request.param)
    try:
        yield c8, c16
    finally:
        c8.close()
        c16.close()


def _q(batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, G16.heads, D, generator=g).to(torch.bfloat16)


def _selected(sel: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n]`` bool: which entries a selection ``[B, topk]`` (distinct, ``-1`` unused)
    attends."""
    valid = torch.zeros(sel.shape[0], n + 1, dtype=torch.bool)
    valid[torch.arange(sel.shape[0])[:, None], torch.where(sel >= 0, sel, n)] = True
    return valid[:, :n]


def _keys(entries: torch.Tensor) -> torch.Tensor:
    """FP8 entries ``[.., 656]`` dequantized exactly (power-of-two scales), float64."""
    return fp8_dequantize_reference(entries.cpu(), D_C, D_R, torch.float32).double()


def _quantization_bound(q, k16, k8, valid, o16) -> torch.Tensor:
    """``[B, H]``: the most the keys' quantization (``k16 -> k8``, ``[N, 576]`` float64) can
    move an exact attention output, per query row. With ``e`` the largest score change
    ``scale |q . (k8_j - k16_j)|`` over the attended ``j``, every softmax weight moves by a
    factor in ``[exp(-2e), exp(2e)]``, so ``sum_j |p8_j - p16_j| <= exp(2e) - 1``; and
    ``o8 - o16 = sum_j p8_j (v8_j - v16_j) + sum_j (p8_j - p16_j) (v16_j - o16)``, so
    ``|o8 - o16| <= max_j |v8_j - v16_j| + (exp(2e) - 1) max_j |v16_j - o16|``."""
    qd = q.double()
    ds = SCALE * torch.einsum("bhd,nd->bhn", qd, k8 - k16).abs()
    mask = valid[:, None, :]
    e = torch.where(mask, ds, 0.0).amax(-1)
    dv = (k8[:, :D_C] - k16[:, :D_C]).abs().amax(-1)  # [N]
    dv = torch.where(valid, dv[None], 0.0).amax(-1)[:, None]  # [B, 1]
    spread = (k16[None, None, :, :D_C] - o16.double()[:, :, None]).abs().amax(-1)  # [B, H, N]
    spread = torch.where(mask, spread, 0.0).amax(-1)
    return dv + torch.expm1(2 * e) * spread


def _check_quantization(name, q, o8, o16, k8, k16, valid) -> None:
    """``o8`` (over FP8 entries) vs ``o16`` (over the bf16 rows they came from): within the a
    posteriori quantization bound plus both calls' kernel bounds; the error reported."""
    o16_ref, _ = partial_attention_reference(q, k16, valid, SCALE)
    bound = _quantization_bound(q, k16, k8, valid, o16_ref)[..., None] + 2 * TOL_O.atol
    err = (o8.double() - o16.double()).abs()
    print(
        f"{name}: quantization error (FP8 vs bf16 holder) max {float(err.max()):.3e}, "
        f"a-posteriori bound {float(bound.min()):.3e} .. {float(bound.max()):.3e}"
    )
    assert bool((err <= bound).all()), f"{name}: {float((err - bound).max())} over the bound"


def test_fetch_to_a_new_offset_splices_and_attends_fp8_entries(clusters):
    """An FP8 requester fetches chunk 1 (cached at 16) to offset 100: its pool holds the
    holder's latent and scale bytes bit for bit and the RoPE part rotated by 84 (within the
    bf16 splice's bound); attending it (dense and a selection) equals the fp64 attention over
    those entries dequantized (the kernel bound), and a bf16 requester doing the same over the
    bf16 rows lands within the quantization bound."""
    (c8, c16), delta = clusters, 84
    req8, req16 = c8.requester(), c16.requester()
    pool = req8.kept.pool
    lc = req8.fetch(1, offset=100)
    got = pool.gather(lc.blocks, lc.tokens, (0, G8.layers)).cpu()
    prefix, rotated = fp8_rope_rotate_reference(ENTRIES[:, 16:32], delta, ROPE)
    assert torch.equal(got[..., :528], prefix)
    assert_close(got[..., 528:].contiguous().view(torch.bfloat16), rotated,
                 TOLERANCES[("rope", "bfloat16")], name="spliced RoPE")  # fmt: skip
    lc16 = req16.fetch(1, offset=100)
    q = _q(2, 1)
    sel = torch.tensor([[0, 5, -1, 15, 9], [3, 7, -1, -1, 2]])
    for indices in (None, sel):
        part8 = req8.attend_local(lc, q, 1, indices=indices)
        part16 = req16.attend_local(lc16, q, 1, indices=indices)
        valid = torch.ones(2, 16, dtype=torch.bool)
        if indices is not None:
            valid = _selected(sel, 16)
        k8 = _keys(got[1])
        o_ref, lse_ref = partial_attention_reference(q, k8, valid, SCALE)
        kind = "dense" if indices is None else "selection"
        s = assert_close(part8.o, o_ref, TOL_O, name=f"fetched FP8 {kind} o")
        assert_close(part8.lse, lse_ref, TOL_LSE, name=f"fetched FP8 {kind} lse")
        print(f"fetch to offset, {kind}: kernel vs fp64 over the dequantized entries: {s}")
        k16 = req16.kept.pool.gather(lc16.blocks, 16, (1, 2))[0].cpu().double()
        _check_quantization(f"fetch {kind}", q, part8.o, part16.o, k8, k16, valid)


def test_routes_to_an_fp8_holder_equal_fp64_over_the_dequantized_cache(clusters):
    """Routes (dense over chunks 0 and 2, a selection over chunk 1) served by the FP8 holder
    equal the fp64 attention over its entries dequantized (kernel bound), and the bf16 holder's
    answers within the quantization bound; the M-way merge of the dense routes over chunks 0
    and 2 too."""
    c8, c16 = clusters
    req8, req16 = c8.requester(), c16.requester()
    q = _q(3, 2)
    sel = torch.tensor([[0, 15, -1, 7], [1, 2, 3, 4], [-1, -1, -1, 11]])
    for chunk, start, n, indices in ((0, 0, 16, None), (2, 32, 8, None), (1, 16, 16, sel)):
        p8 = req8.route(chunk, q, 0, indices=indices)
        p16 = req16.route(chunk, q, 0, indices=indices)
        valid = torch.ones(3, n, dtype=torch.bool)
        if indices is not None:
            valid = _selected(sel, n)
        k8 = _keys(ENTRIES[0, start : start + n])
        o_ref, lse_ref = partial_attention_reference(q, k8, valid, SCALE)
        s = assert_close(p8.o, o_ref, TOL_O, name=f"routed FP8 chunk {chunk} o")
        assert_close(p8.lse, lse_ref, TOL_LSE, name=f"routed FP8 chunk {chunk} lse")
        print(f"route chunk {chunk}: kernel vs fp64 over the dequantized cache: {s}")
        k16 = ROWS[0, start : start + n].double()
        _check_quantization(f"route chunk {chunk}", q, p8.o, p16.o, k8, k16, valid)
    o, lse = req8.route_many([dict(chunk_id=c, q=q, layer=1) for c in (0, 2)])
    keys = _keys(torch.cat([ENTRIES[1, :16], ENTRIES[1, 32:40]]))
    o_ref, lse_ref = partial_attention_reference(q, keys, torch.ones(3, 24, dtype=torch.bool),
                                                 SCALE)  # fmt: skip
    # each partial within the kernel bound, the merge a convex combination of them, its store
    # one more bf16 rounding (half an ulp at |o| < 8: 2**-6)
    assert_close(o, o_ref, TOL_O, atol=TOL_O.atol + 2**-6, name="merged FP8 routes")
    assert bool(((lse - lse_ref).abs() <= TOL_LSE.atol).all())
    assert math.isfinite(float(lse.max()))


def test_format_mismatch_is_named_both_ways(clusters):
    """An FP8 requester asking the bf16 holder (route and fetch) is refused naming both
    formats (the reverse direction: test_fp8_cache.py)."""
    from mqnc.serving import Requester
    from mqnc.transport import LoopbackFabric

    corpus = clusters[1].corpus
    fab = LoopbackFabric(2, corpus.slot_bytes(8), lanes=1)
    holder = corpus.make_holder(fab.endpoint(1), kernels="torch", poll_s=0.02).start()
    req = Requester(fab.endpoint(0), G8, softmax_scale=SCALE, rope=ROPE, timeout_s=20.0,
                    pool_blocks=4, block_size=16, kernels="torch")  # fmt: skip
    for info in corpus.directory():
        req.register(info)
    want = r"the {} comes from a requester keeping a fp8_e4m3 cache, geometry .* keeps a bf16"
    try:
        with pytest.raises(Exception, match=want.format("FETCH")):
            req.fetch(0)
        with pytest.raises(Exception, match=want.format("ROUTE")):
            req.route(0, _q(1, 3), 0)
    finally:
        holder.stop()
    assert holder.failure is None


def test_demo_runs_with_an_fp8_cache(tmp_path, capsys):
    """``mqnc demo --kv-dtype fp8`` at the demo's small size (loopback, the torch references):
    holders keep FP8 entries, every answer is verified against fp64 over the dequantized cache
    (``run_demo`` raises beyond a bound), the quantization error is reported apart, the cost
    model prices b_KV at 656 B, each fetch moves 656 B a token-layer, and the report says the
    format; --kv-dtype is refused where it does not apply."""
    import json

    from mqnc.cli import main
    from mqnc.demo import DemoConfig
    from mqnc.demo.workload import Corpus as DemoCorpus
    from mqnc.demo.workload import build_model
    from mqnc.model import MLAGeometry

    small = dict(layers=2, chunks=4, min_tokens=64, max_tokens=96, whole_agents=1,
                 selection_agents=1, chunks_per_agent=2, topk=48, steps=2,
                 repeats=1)  # fmt: skip
    argv = ["demo", "--kv-dtype", "fp8", "--transport", "loopback", "--kernels", "torch"]
    argv += ["--no-compare", "--no-progress", "--out", str(tmp_path)]
    for k, v in small.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    r = json.loads((tmp_path / "demo.json").read_text())
    g = MLAGeometry(**r["geometry"])  # what the report's predictions were priced with
    assert r["kv_format"] == g.cache_dtype == "fp8_e4m3" and g.kv_bytes_per_token_layer == 656
    assert r["checked"]["merged"] == small["steps"] * small["layers"] * 2
    assert 0 < r["quantization_error"] < 0.5 and max(r["max_abs_error"].values()) < 0.05
    assert "cache fp8_e4m3: 656 B a token-layer" in printed and "quantization error" in printed
    assert "fp8_e4m3" in r["plot_title"]
    fetch = r["primitives"].get("fetch")
    if fetch:  # each fetch: a FETCH header out, a CHUNK of 656-byte entries back
        cfg = DemoConfig(**small, kv_dtype="fp8")
        lengths = DemoCorpus(cfg, build_model(cfg)).lengths
        calls = fetch["per_call"]
        want = sum(2 * 96 + small["layers"] * lengths[c["chunk"]] * 656 for c in calls)
        assert fetch["wire_bytes"] == want
    assert main(["demo", "--kv-dtype", "fp8", "--device-route"]) == 2
    assert main(["demo", "--kv-dtype", "fp8", "--hf"]) == 2
    assert main(["demo", "--kv-dtype", "fp16"]) == 2


def _bad(kind: str) -> torch.Tensor:
    """Chunk 0's entries broken one way (entry [layer 1, token 3])."""
    bad = ENTRIES[:, :CHUNK].clone()
    scale = slice(512 + 4, 512 + 8)  # the second scale
    value = {"nan": float("nan"), "negative": -0.5, "zero": 0.0, "inf": float("inf")}
    if kind in value:
        bad[1, 3, scale] = torch.tensor([value[kind]]).view(torch.uint8)
    else:
        bad[1, 3, 200] = 0x7F if kind == "latent_7f" else 0xFF
    return bad


BAD = [("nan", "scale"), ("negative", "scale"), ("zero", "scale"), ("inf", "scale"),
       ("latent_7f", "NaN latent byte"), ("latent_ff", "NaN latent byte")]  # fmt: skip


@pytest.mark.parametrize("kind, what", BAD)
def test_bad_fp8_entries_are_refused_where_they_enter(kind, what):
    """Entries with a NaN, negative, zero or infinite scale or a NaN latent byte (0x7F / 0xFF)
    are refused by a holder adding them (naming the argument and the entry) and, when a
    holder's pool holds them anyway (written past its checks), by the requester fetching them
    (naming the holder and the chunk); entries without their scales (too short) or of the
    wrong shape are refused by name."""
    from mqnc.serving import Requester
    from mqnc.transport import LoopbackFabric

    corpus = Corpus.partition(ENTRIES, G8, SCALE, chunk_tokens=CHUNK, holders=[1], rope=ROPE,
                              block_size=16)  # fmt: skip
    fab = LoopbackFabric(2, corpus.slot_bytes(8), lanes=1)
    holder = corpus.make_holder(fab.endpoint(1), kernels="torch", poll_s=0.02)
    bad = _bad(kind)
    with pytest.raises(ValueError, match=rf"kv: expected .*{what}.*\[1, 3"):
        holder.add_chunk(7, bad)
    if kind == "nan":
        with pytest.raises(ValueError, match=r"kv: expected shape \(2, c_t, 656\), got \(2, 16, "
                           r"640\) uint8 \(fp8_e4m3 entries: scales missing\?\)"):  # fmt: skip
            holder.add_chunk(7, bad[..., :640].contiguous())
        with pytest.raises(ValueError, match=r"kv: expected shape \(2, c_t, 656\), got \(16, 656"):
            holder.add_chunk(7, bad[0])
    c0 = holder.chunks[0]
    flat = holder.pool.view(G8.layers, -1, 656)
    flat[:, holder.pages.slots(c0.blocks, CHUNK)] = bad  # past the holder's checks
    req = Requester(fab.endpoint(0), G8, softmax_scale=SCALE, rope=ROPE, timeout_s=20.0,
                    pool_blocks=4, block_size=16, kernels="torch")  # fmt: skip
    for info in corpus.directory():
        req.register(info)
    holder.start()
    try:
        free = req.kept.pool.free_blocks
        for offset in (None, 40):  # written as it came, or spliced to a new offset
            with pytest.raises(ValueError, match=rf"holder 1: chunk 0: kv: expected .*{what}"):
                req.fetch(0, offset=offset)
            assert req.kept.pool.free_blocks == free  # a refused chunk keeps no block
    finally:
        holder.stop()
    assert holder.failure is None


def test_requests_say_their_cache_format_in_the_header_flags():
    """A ROUTE or FETCH packed with a geometry carries its cache format in flag bits 1-3 (the
    payload CRC bit untouched); a receiver of another format refuses it naming both, one of
    the same format (or a 16-bit one for a 16-bit holder) accepts it, a request that says
    nothing (packed without a geometry) is accepted, and an unknown code is refused."""
    from mqnc.transport import wire

    q = _q(1, 4)
    route8 = wire.pack_query(q, request_id=1, seq=1, chunk_id=0, layer=0, geometry=G8)
    h = wire.parse_header(route8, geometry=G8)
    assert h.flags & ~wire.FLAG_PAYLOAD_CRC == wire.format_flags(G8) == 4 << wire.FORMAT_SHIFT
    assert h.flags & wire.FLAG_PAYLOAD_CRC
    with pytest.raises(wire.WireError, match="ROUTE comes from a requester keeping a fp8_e4m3"):
        wire.parse_header(route8, geometry=G16)
    fetch16 = wire.pack_fetch(request_id=2, seq=2, chunk_id=0, geometry=G16)
    assert wire.parse_header(fetch16, geometry=G16.replace(cache_dtype="fp32")).kind.name == "FETCH"
    with pytest.raises(wire.WireError, match="FETCH comes from a requester keeping a bf16 cache"):
        wire.parse_header(fetch16, geometry=G8)
    plain = wire.pack_query(q, request_id=3, seq=3, chunk_id=0, layer=0)  # nothing said
    assert wire.parse_header(plain, geometry=G8).flags & ~wire.FLAG_PAYLOAD_CRC == 0
    forged = wire.Header(wire.Kind.FETCH, flags=7 << wire.FORMAT_SHIFT, layer_lo=0, layer_hi=1)
    raw = torch.frombuffer(bytearray(forged.pack()), dtype=torch.uint8)
    with pytest.raises(wire.WireError, match="unknown cache format code 7"):
        wire.parse_header(raw, geometry=G8)
