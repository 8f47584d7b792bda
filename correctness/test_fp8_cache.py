"""The FP8 cache (DeepSeek-V3.2's 656-byte entry): the quantizer against its fp64 reference bit
for bit, the round trip within the e4m3 bound, the layout against ``mqnc.model.kv_format``, bad
input named; the cost model's FP8 fetch terms; the pool, the corpus file and the holder keeping
FP8 entries (the wire's own cases are in test_wire.py)."""

from __future__ import annotations

import re

import pytest
import torch

import mqnc.serving.compute  # noqa: F401  (registers the ops' "torch" backend)
from mqnc.model.kv_format import FP8_E4M3
from mqnc.reference.fp8_ref import fp8_dequantize_reference, fp8_quantize_reference
from mqnc.testing import default_device
from mqnc.triton_kernels.fp8.quant import fp8_dequantize, fp8_quantize
from mqnc.triton_kernels.ops import backend_ops

DEVICE = default_device()
D_C, D_R = 512, 64
LAYOUT = FP8_E4M3.layout(D_C, D_R)


def _rows(dtype: torch.dtype, n: int = 19, seed: int = 0) -> torch.Tensor:
    """``n`` rows spanning 2**-24 .. 2**11 in magnitude (one binade a row), a zero group, an
    fp32-subnormal-sized value, a negative value that rounds to -0, a row near 2**112 and one
    near 2**-120."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-24, 12, (n, 1), generator=g).float())
    x = torch.randn(n, D_C + D_R, generator=g) * mag
    x[1, :128] = 0.0
    x[2, 5], x[2, 6] = -1e-30, 2.0**-130
    if n > 4:
        x[3] *= 2.0**110  # scales near the largest (2**113)
        x[4] *= 2.0**-120  # float32 subnormals and e4m3 subnormals under the floor scale
    return x.to(dtype).to(DEVICE)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def quantized(request):
    x = _rows(request.param)
    return x, fp8_quantize(x, D_C), fp8_quantize_reference(x.cpu(), D_C)


def test_quantize_equals_the_fp64_reference_bit_for_bit(quantized):
    x, got, ref = quantized
    assert got.shape == (*x.shape[:-1], LAYOUT.token_bytes) == (19, 656)
    assert got.dtype == torch.uint8
    assert torch.equal(got.cpu(), ref)


def test_quantize_follows_flashmla_recipe(quantized):
    """FlashMLA's V32_FP8Sparse recipe written in torch (scale ``2**ceil(log2(max(amax / 448,
    1e-4)))``, torch's RNE cast of ``x / scale``; RoPE in bf16) gives the same bytes."""
    x, got, _ = quantized
    lat = x.cpu()[:, :D_C].float().reshape(-1, LAYOUT.groups, LAYOUT.group)
    s = torch.pow(2, torch.clamp_min(lat.abs().amax(-1) / 448.0, 1e-4).log2().ceil())
    q = (lat / s[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, D_C)
    rope = x.cpu()[:, D_C:].to(torch.bfloat16).contiguous().view(torch.uint8)
    assert torch.equal(got.cpu(), torch.cat([q, s.contiguous().view(torch.uint8), rope], -1))


def test_layout_is_kv_formats(quantized):
    """Scales at ``scale_offset`` (powers of two, at least amax / 448, 2**-13 for a zero group),
    the RoPE part at ``rope_offset``: the bf16 rows' bytes."""
    x, got, _ = quantized
    got = got.cpu()
    s = got[:, LAYOUT.scale_offset : LAYOUT.rope_offset].contiguous().view(torch.float32)
    amax = x.cpu()[:, :D_C].double().reshape(-1, 4, 128).abs().amax(-1)
    assert s.shape == (19, LAYOUT.groups)
    assert torch.equal(torch.frexp(s)[0], torch.full_like(s, 0.5))  # powers of two
    assert bool((s.double() * 448 >= amax).all()) and s[1, 0].item() == 2.0**-13
    assert bool((((s.double() / 2) * 448 < amax) | (s == 2.0**-13)).all())  # the smallest
    rope = x.cpu()[:, D_C:].to(torch.bfloat16).contiguous().view(torch.uint8)
    assert torch.equal(got[:, LAYOUT.rope_offset :], rope)
    assert got[2, 5].item() == 0x80  # -1e-30 rounds to -0


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=["to_bf16", "to_fp32"])
def test_round_trip_within_the_e4m3_bound(quantized, out):
    """``|dequantize(quantize(x)) - x| <= max(2**-4 |x|, 2**-10 scale)`` per latent value in
    fp64 (3 mantissa bits: half a spacing; subnormals: 2**-10 of the scale); the dequantize is
    exact (an e4m3 value times a power of two) so the kernel equals the reference; the RoPE
    part is the bf16 rows exactly."""
    x, c, _ = quantized
    y = fp8_dequantize(c, D_C, D_R, out)
    assert y.dtype == out and torch.equal(y.cpu(), fp8_dequantize_reference(c.cpu(), D_C, D_R, out))
    s = c.cpu()[:, D_C : D_C + 16].contiguous().view(torch.float32).double()
    s = s.repeat_interleave(128, dim=-1)
    xd, yd = x.cpu().double(), y.cpu().double()
    err = (yd[:, :D_C] - xd[:, :D_C]).abs()
    assert bool((err <= torch.maximum(xd[:, :D_C].abs() / 16, s / 1024)).all())
    amax = xd[:, :D_C].reshape(-1, 4, 128).abs().amax(-1).repeat_interleave(128, dim=-1)
    assert bool((err <= torch.maximum(amax / 16, s / 1024)).all())  # 2**-4 of the group's amax
    assert torch.equal(y.cpu()[:, D_C:], x.cpu()[:, D_C:].to(torch.bfloat16).to(out))


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=["to_bf16", "to_fp32"])
def test_dequantize_takes_any_positive_scale(out):
    """Entries whose scales are not powers of two (FlashMLA's kernels multiply whatever fp32
    scale is stored): the kernel's product is rounded to float32 then to ``out``, as the
    reference's; every byte value but the NaNs, scales over 2**-20 .. 2**20."""
    g = torch.Generator().manual_seed(7)
    c = fp8_quantize_reference(_rows(torch.bfloat16, n=8).cpu(), D_C)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    c[:, :D_C] = codes[torch.randint(0, codes.numel(), (8, D_C), generator=g)]
    s = torch.exp2(torch.empty(8, 4).uniform_(-20, 20, generator=g)).float()
    c[:, D_C : D_C + 16] = s.view(torch.uint8)
    got = fp8_dequantize(c.to(DEVICE), D_C, D_R, out).cpu()
    assert torch.equal(got, fp8_dequantize_reference(c, D_C, D_R, out))
    lat = c[:, :D_C].view(torch.float8_e4m3fn).float().reshape(8, 4, 128) * s[..., None]
    assert torch.equal(got[:, :D_C], lat.reshape(8, D_C).to(out))  # FlashMLA's fp32 product


def test_ties_and_subnormals_round_to_even():
    """A group whose amax is 448 has scale 1, so its bytes are the values' own e4m3 codes: ties
    go to even, e4m3 subnormals (spacing 2**-9) are kept, the interpreter's own fp8 cast (ties
    away, subnormals flushed) is not used."""
    vals = [448.0, 1.0625, 1.1875, -1.0625, 3 * 2.0**-11, 2.0**-10, 3 * 2.0**-10, 17.0, 19.0]
    codes = [0x7E, 0x38, 0x3A, 0xB8, 0x01, 0x00, 0x02, 0x58, 0x5A]
    x = torch.zeros(1, D_C + D_R, dtype=torch.float32)
    x[0, : len(vals)] = torch.tensor(vals)
    for impl in (fp8_quantize, fp8_quantize_reference):
        c = impl(x.to(DEVICE) if impl is fp8_quantize else x, D_C).cpu()
        assert c[0, : len(vals)].tolist() == codes
        assert c[0, 512:516].view(torch.float32).item() == 1.0


def test_empty_and_batched_shapes():
    x = _rows(torch.bfloat16, n=6).reshape(2, 3, D_C + D_R)
    c = fp8_quantize(x, D_C)
    assert c.shape == (2, 3, 656) and torch.equal(
        c.reshape(6, 656), fp8_quantize(x.reshape(6, -1), D_C)
    )
    assert fp8_quantize(x[:0], D_C).shape == (0, 3, 656)
    assert fp8_dequantize(c, D_C, D_R, torch.float32).shape == (2, 3, 576)


def _bad_entries() -> list:
    c = fp8_quantize_reference(_rows(torch.bfloat16, n=3).cpu(), D_C)
    out = []
    for value, what in ((float("nan"), "nan"), (-1.0, "-1.0"), (0.0, "0.0"), (float("inf"), "inf")):
        bad = c.clone()
        bad[1, 516:520] = torch.tensor([value], dtype=torch.float32).view(torch.uint8)
        out.append((bad, rf"expected every scale finite and > 0, got {what} \(scale 1"))
    bad = c.clone()
    bad[0, 7] = 0x7F
    out.append((bad, "no NaN latent byte"))
    out.append((c[:, :640], "entries of 656 bytes .*scales missing"))
    out.append((c.view(torch.int8), None))
    return out


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_input_is_named(backend):
    ops = backend_ops(backend)
    x = _rows(torch.float32, n=3)
    limit = r"magnitude < 3\.29649e\+38 \(248 \* 2\*\*120: from there e4m3 rounds to 2\*\*128"
    for value in (float("nan"), float("inf"), -float("inf"), 248 * 2.0**120, -3.3e38):
        bad = x.clone()
        bad[1, 3] = value
        got = re.escape(f"{bad[1, 3].item()} at [1, 3]")
        with pytest.raises(ValueError, match=rf"x: expected finite cache values of {limit}.*{got}"):
            ops.fp8_quantize(bad, D_C)
    edge = x.clone()
    edge[1, 3] = -247.9 * 2.0**120  # the largest magnitudes: rounded down to 240, finite back
    back = ops.fp8_dequantize(ops.fp8_quantize(edge, D_C), D_C, D_R, torch.float32)
    assert back[1, 3].item() == -240 * 2.0**120
    with pytest.raises(TypeError, match="x: expected a bfloat16 or float32 tensor"):
        ops.fp8_quantize(x.half(), D_C)
    with pytest.raises(ValueError, match="d_c"):
        ops.fp8_quantize(x, 500)
    for bad, match in _bad_entries():
        err = TypeError if match is None else ValueError
        with pytest.raises(err, match=match or "cache: expected a uint8 tensor"):
            ops.fp8_dequantize(bad.to(DEVICE), D_C, D_R, torch.float32)
    good = fp8_quantize_reference(x.cpu(), D_C).to(DEVICE)
    with pytest.raises(TypeError, match="dtype: expected torch.bfloat16 or torch.float32"):
        ops.fp8_dequantize(good, D_C, D_R, torch.float16)


# ---- the cost model and predicate -----------------------------------------------------------


def test_cost_model_prices_an_fp8_fetch_at_656_bytes_and_keeps_the_papers_bf16_numbers():
    """``b_KV`` comes from the geometry's cache format: the wire break-even, the pull, the
    selection gather and the fetch/local crossover follow from 656 B by fp64 arithmetic; the
    paper's bf16 numbers (break-even 1080.3 at c_t 2048 on V2-Lite) are unchanged; route and
    local do not depend on the cache format."""
    from mqnc.cost import get_fabric
    from mqnc.cost import predicate as pr
    from mqnc.cost.terms import SpliceProfile
    from mqnc.model import PRESETS

    v2, v32 = PRESETS["deepseek-v2-lite"], PRESETS["deepseek-v3.2"]
    f8 = v32.replace(cache_dtype="fp8_e4m3")
    assert round(pr.wire_break_even_rows(v2, 2048), 1) == 1080.3
    assert pr.wire_break_even_rows(f8, 2048) == 2048 * 656 / 2184
    assert pr.selection_break_even_rows(f8) == 2048 * 656 / 2184  # V3.2's top-2048
    fab = get_fabric("h100-ibgda")
    d8, d16 = pr.decide(f8, fab, 64, 2048), pr.decide(v32, fab, 64, 2048)
    assert d8.fetch.pull == 2048 * 656 * 61 / (fab.bulk_bw * 1e3)
    assert d8.fetch.pull == pytest.approx(d16.fetch.pull * 656 / 1152, rel=1e-15)
    assert (d8.route, d8.local_us, d8.fetch.splice) == (d16.route, d16.local_us, d16.fetch.splice)
    assert d8.wire["chunk_bytes_per_layer"] == 2048 * 656 and d8.inputs["kv_format"] == "fp8_e4m3"
    g8, g16 = (pr.decide(g, fab, 64, 8192, topk=2048, holders=2) for g in (f8, v32))
    assert g8.fetch.selection and g8.fetch.pull < g16.fetch.pull
    flat = SpliceProfile.flat(2910.0)
    per_token = 61 * 1.0 - 656 * 61 / (fab.bulk_bw * 1e3)
    got = pr.fetch_local_crossover_tokens(f8, fab, splice=flat)
    assert got == pytest.approx(2910.0 / per_token, rel=1e-12)
    assert got < pr.fetch_local_crossover_tokens(v32, fab, splice=flat)


def test_predict_and_crossover_take_kv_dtype_fp8(tmp_path, capsys):
    import csv
    import json

    from mqnc.cli import main

    argv = ["--model", "deepseek-v3.2", "--m-q", "64", "--c-t", "2048"]
    assert main(["predict", "--json", "--kv-dtype", "fp8", *argv]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["wire"]["chunk_bytes_per_layer"] == 2048 * 656
    assert got["wire"]["break_even_rows"] == 2048 * 656 / 2184
    assert got["inputs"]["kv_format"] == "fp8_e4m3"
    assert main(["predict", *argv, "--kv-dtype", "fp8"]) == 0
    assert "cache fp8_e4m3" in capsys.readouterr().out
    assert main(["predict", "--json", *argv]) == 0
    assert json.loads(capsys.readouterr().out)["wire"]["chunk_bytes_per_layer"] == 2048 * 1152
    rc = main(
        ["crossover", "--out", str(tmp_path), "--points", "4", "--no-png", "--kv-dtype", "fp8"]
    )
    assert rc == 0
    with open(tmp_path / "fig3b_wire_bytes.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(float(r["chunk_bytes_per_layer"]) == float(r["c_t"]) * 656 for r in rows)
    capsys.readouterr()
    assert main(["predict", "--kv-dtype", "fp8", "--model", "deepseek-v4-flash"]) == 2
    assert (
        "--kv-dtype fp8: MLAGeometry.cache_dtype: 'fp8_e4m3' needs d_c" in capsys.readouterr().err
    )


# ---- the pool ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_fp8_pool_keeps_entries_and_attends_the_dequantized_chunk(kernels):
    """An FP8 pool stores 656-byte entries (16-bit rows quantized on write, entries copied bit
    for bit), gathers them back as written, and attends a chunk exactly as a bf16 pool holding
    the dequantized rows does (dense and a top-k selection); a splice to a new offset copies
    latent and scale bytes and rotates the RoPE part; entries with a bad scale or a NaN latent
    byte and rows of another format are refused where they enter, naming them."""
    from mqnc.serving.pool import PagedPool

    L, bs, tokens = 2, 16, 20
    x = _rows(torch.bfloat16, n=L * tokens, seed=3).reshape(L, tokens, D_C + D_R)
    kw = dict(dtype=torch.bfloat16, device=DEVICE, kernels=kernels)
    p8 = PagedPool(L, 4, bs, D_C + D_R, fp8=LAYOUT, **kw)
    p16 = PagedPool(L, 4, bs, D_C + D_R, **kw)
    assert p8.kv.dtype == torch.uint8 and p8.kv.shape == (L, 4, bs, 656)
    b8, b16 = p8.alloc(tokens), p16.alloc(tokens)
    p8.write(b8[::-1], x)  # blocks out of order: slots follow the block list
    entries = fp8_quantize_reference(x.cpu(), D_C)
    got = p8.gather(torch.tensor(b8[::-1]), tokens, (0, L))
    assert torch.equal(got.cpu(), entries)
    b8c = p8.alloc(tokens)
    p8.splice(b8c, entries.to(DEVICE), 0, None)  # a fetched chunk's entries: copied
    assert torch.equal(p8.gather(torch.tensor(b8c), tokens, (0, L)).cpu(), entries)
    p16.write(b16, fp8_dequantize_reference(entries, D_C, D_R, torch.bfloat16).to(DEVICE))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 16, D_C + D_R, generator=g).to(torch.bfloat16).to(DEVICE)
    sel = torch.tensor([[3, -1, 19, 0, 7]], device=DEVICE)
    for indices in (None, sel):
        kw = dict(indices=indices, softmax_scale=0.1, d_v=D_C)
        o8, lse8 = p8.attend(q, 1, torch.tensor(b8c, dtype=torch.int32), tokens, **kw)
        o16, lse16 = p16.attend(q, 1, torch.tensor(b16, dtype=torch.int32), tokens, **kw)
        assert torch.equal(o8, o16) and torch.equal(lse8, lse16)
    from mqnc.model import RopeSpec
    from mqnc.reference.rope_ref import fp8_rope_rotate_reference

    rope = RopeSpec.from_preset("deepseek-v2-lite")
    p8.free(b8c)
    p8.splice(b8c, entries.to(DEVICE), 5, rope)
    spliced = p8.gather(torch.tensor(b8c), tokens, (0, L)).cpu()
    prefix, rotated = fp8_rope_rotate_reference(entries, 5, rope)
    assert torch.equal(spliced[..., :528], prefix)
    got = spliced[..., 528:].contiguous().view(torch.bfloat16).double()
    # rounded once to bf16 (half an ulp: <= 2**-9 |y|) after an fp32 rotation (a few fp32 ulps
    # of the entry's largest RoPE value; these rows span 2**-24 .. 2**121), whose two products
    # may each flush an fp32 subnormal (< 2**-126) to zero
    amax = entries[..., 528:].contiguous().view(torch.bfloat16).double().abs().amax(-1, True)
    bound = 2**-8 * rotated.abs() + 2**-20 * amax + 2**-125
    assert bool(((got - rotated).abs() <= bound).all())
    for where, value, match in [
        ((0, 2, slice(516, 520)), torch.tensor([float("nan")]).view(torch.uint8), "scale"),
        ((1, 0, slice(512, 516)), torch.tensor([0.0]).view(torch.uint8), "scale"),
        ((1, 4, 7), 0x7F, "NaN latent byte"),
    ]:
        bad = entries.clone()
        bad[where] = value
        with pytest.raises(ValueError, match=match):
            p8.write(b8c, bad.to(DEVICE))
        with pytest.raises(ValueError, match=match):
            p8.splice(b8c, bad.to(DEVICE), 5, rope)
    with pytest.raises(ValueError, match=r"this pool's format \(fp8_e4m3 entries\)"):
        p8.write(b8c, entries[..., :640].to(DEVICE))
    with pytest.raises(ValueError, match=r"this pool's format \(bfloat16\)"):
        p16.write(b16, entries.to(DEVICE))


# ---- the corpus file and the holder ------------------------------------------------------------


def _fp8_corpus():
    from mqnc.model import PRESETS, RopeSpec
    from mqnc.serving import Corpus

    g = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=4, cache_dtype="fp8_e4m3")
    x = _rows(torch.bfloat16, n=2 * 40, seed=5).cpu().reshape(2, 40, D_C + D_R)
    entries = fp8_quantize_reference(x, D_C)
    rope = RopeSpec.from_preset("deepseek-v2-lite")
    corpus = Corpus.partition(
        entries, g, rope.softmax_scale, chunk_tokens=16, holders=[1], rope=rope, block_size=16
    )
    return corpus, entries


def test_corpus_file_stores_fp8_entries_with_their_format_and_checksums(tmp_path):
    """An FP8 corpus (geometry cache_dtype fp8_e4m3) saves its 656-byte entries as U8 tensors
    with the format in the manifest, loads them back bit for bit, and refuses a flipped byte
    (SHA-256) and a manifest whose kv_format disagrees with its geometry, naming them."""
    import json

    from mqnc.serving import Corpus

    corpus, entries = _fp8_corpus()
    assert corpus.dtype == torch.bfloat16 and corpus.entry_width == 656
    path = corpus.save(tmp_path / "c.json")
    m = json.loads(path.read_text())
    assert m["kv_format"] == m["geometry"]["cache_dtype"] == "fp8_e4m3"
    back = Corpus.load(path)
    for cid, c in back.chunks.items():
        got = back.chunk_kv(cid)
        assert got.dtype == torch.uint8 and torch.equal(
            got, entries[:, c.start : c.start + c.tokens]
        )
    raw = bytearray(path.with_suffix(".safetensors").read_bytes())
    raw[-3] ^= 0x10  # a latent or RoPE byte of the last chunk
    path.with_suffix(".safetensors").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"chunks\[2\] \(chunk_id 2\).*checksum mismatch"):
        Corpus.load(path).chunk_kv(2)
    path.write_text(json.dumps({**m, "kv_format": "bf16"}))
    with pytest.raises(ValueError, match="kv_format: 'bf16' disagrees with the geometry's"):
        Corpus.load(path)
    with pytest.raises(TypeError, match=r"expected torch.uint8, got torch.bfloat16 \(geometry"):
        wrong = torch.zeros(2, 40, 656, dtype=torch.bfloat16)
        chunks = list(corpus.chunks.values())
        Corpus(corpus.geometry, 0.1, chunks, dtype=torch.bfloat16, entries=wrong)


def test_holder_keeps_fp8_chunks_and_a_requester_of_another_format_is_told_both():
    """A holder made from an FP8 corpus keeps its 656-byte entries (bad scales refused when a
    chunk is added) and answers a FETCH with them (656 B a token-layer on the wire); a
    requester whose geometry keeps a bf16 cache asking for a chunk gets the
    format mismatch naming both formats (the holder refuses the FETCH: the requester's
    format rides in its flags), and so does its route (the requester's format rides
    in the ROUTE's flags)."""
    from mqnc.serving import Requester
    from mqnc.serving.records import ChunkInfo
    from mqnc.transport import INBOX, REPLY, LoopbackFabric, wire

    corpus, entries = _fp8_corpus()
    fab = LoopbackFabric(2, corpus.slot_bytes(8), lanes=1)
    holder = corpus.make_holder(fab.endpoint(1), kernels="torch", poll_s=0.02)
    assert holder.pool.dtype == torch.uint8 and holder.pool.shape[-1] == 656
    assert torch.equal(holder.chunk_kv(1).cpu(), entries[:, 16:32])
    bad = entries[:, :8].clone()
    bad[0, 3, 512:516] = torch.tensor([-1.0]).view(torch.uint8)
    with pytest.raises(ValueError, match=r"every scale finite and > 0, got -1.0"):
        holder.add_chunk(9, bad)
    g16 = corpus.geometry.replace(cache_dtype="bf16")
    req = Requester(fab.endpoint(0), g16, softmax_scale=corpus.softmax_scale, rope=corpus.rope,
                    timeout_s=20.0, pool_blocks=8, kernels="torch")  # fmt: skip
    req.register(ChunkInfo(1, 16, 16, (1,)))
    holder.start()
    try:
        with pytest.raises(
            ValueError,
            match=r"cache format mismatch: the FETCH comes from a requester keeping a bf16 "
            r"cache, geometry .* keeps a fp8_e4m3 cache",
        ):
            req.fetch(1)
        q = torch.randn(1, 4, D_C + D_R).to(torch.bfloat16)
        with pytest.raises(
            Exception,
            match=r"cache format mismatch: the ROUTE comes from a "
            r"requester keeping a bf16 cache, geometry .* keeps a fp8_e4m3 cache",
        ):
            req.route(1, q, 0)
        # a raw FETCH of chunk 1: the holder answers with its FP8 entries, 656 B a token-layer
        t, g8 = req.transport, corpus.geometry
        raw = wire.pack_fetch(request_id=7, seq=1000, chunk_id=1, geometry=g8)
        t.put_signal(1, t.layout.slot(INBOX, 0, 0), raw, 1000)
        t.wait_signal(t.layout.slot(REPLY, 1, 0), 1000, 10.0)
        buf = wire.read_message(t, t.layout.slot(REPLY, 1, 0))
        h, kv = wire.unpack_chunk(buf, geometry=g8)
        assert h.payload_bytes == g8.layers * 16 * 656 == g8.chunk_bytes(16)
        assert h.position == 16 and torch.equal(kv, entries[:, 16:32])
    finally:
        holder.stop()
    assert holder.failure is None


def test_a_requester_of_an_fp8_geometry_keeps_fetched_entries_bit_for_bit():
    """A requester whose geometry keeps an fp8_e4m3 cache fetches a chunk at its canonical
    position into its own pool as 656-byte FP8 entries, bit for bit the holder's; a fetch to
    another offset splices them (latent and scale bytes the holder's, the RoPE part rotated;
    the attention over it is checked in test_fp8_route.py)."""
    from mqnc.serving import Requester
    from mqnc.serving.records import ChunkInfo
    from mqnc.transport import LoopbackFabric

    corpus, entries = _fp8_corpus()
    fab = LoopbackFabric(2, corpus.slot_bytes(8), lanes=1)
    holder = corpus.make_holder(fab.endpoint(1), kernels="torch", poll_s=0.02)
    req = Requester(fab.endpoint(0), corpus.geometry, softmax_scale=corpus.softmax_scale,
                    rope=corpus.rope, timeout_s=20.0, pool_blocks=8, kernels="torch")  # fmt: skip
    pool = req.kept.pool
    assert pool.kv.dtype == torch.uint8 and pool.kv.shape[-1] == 656
    pool.kv.fill_(0xFF)  # poisoned: 0xFF is a NaN byte in e4m3, a NaN scale and RoPE value
    req.register(ChunkInfo(1, 16, 16, (1,)))
    holder.start()
    try:
        lc = req.fetch(1)
        got = pool.gather(lc.blocks, lc.tokens, (0, corpus.geometry.layers))
        assert torch.equal(got.cpu(), entries[:, 16:32])
        lc = req.fetch(1, offset=48)
        got = pool.gather(lc.blocks, lc.tokens, (0, corpus.geometry.layers))
        assert torch.equal(got[..., :528].cpu(), entries[:, 16:32, :528])
        assert not torch.equal(got[..., 528:].cpu(), entries[:, 16:32, 528:])  # rotated
    finally:
        holder.stop()
    assert holder.failure is None
