"""Hostile files and careless inputs against the corpus, the FP8 entries, the holders and the
splice: each kept as a regression test. Nothing hangs on a file, nothing silently drops a
token, every error names the field, argument or file to fix.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from mqnc.model import PRESETS
from mqnc.serving.corpus import parse_json

GEOM = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=4)
SCALE = 192**-0.5 * 1.2608**2
WAIT = 60.0  # a bound on a broken run only: the work it bounds takes milliseconds


def _corpus_file(tmp_path):
    """A 4-chunk bf16 corpus (32 tokens per chunk, holders 1 and 2) saved under ``tmp_path``."""
    from mqnc.serving import Corpus

    g = torch.Generator().manual_seed(40)
    entries = (0.5 * torch.randn(GEOM.layers, 128, GEOM.d_qk, generator=g)).to(torch.bfloat16)
    corpus = Corpus.partition(entries, GEOM, SCALE, chunk_tokens=32, holders=[1, 2])
    return corpus, corpus.save(tmp_path / "c.json")


def _finishes(fn, seconds: float = WAIT):
    """``fn()``'s result (or its exception, raised), or a failure if it is still running after
    ``seconds`` (a thread: the test never hangs)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_json_of_escaped_quotes_parses_in_linear_time():
    """A safetensors header or manifest of escaped quotes (``\\"`` repeated, closed or not) is
    parsed, or refused as not JSON, at once: the depth check used to be a regular expression
    that took quadratic time on such strings (16 KB: 1.3 s; a 128 KB header no answer in
    20 s). 4 MB here, both ways, and nesting past the limit still refused."""
    closed = '{"a": "' + '\\"' * (2 * 2**20) + '"}'
    assert _finishes(lambda: parse_json(closed, "the header"))["a"].startswith('""')
    with pytest.raises(ValueError, match="the header is not JSON"):
        _finishes(lambda: parse_json('"' + '\\"' * (2 * 2**20), "the header"))
    with pytest.raises(ValueError, match="nested deeper than 16 levels"):
        _finishes(lambda: parse_json("[" * 100_000 + "]" * 100_000, "the header"))
    assert parse_json("[" * 16 + "]" * 16, "x") is not None


def test_a_chunks_file_header_past_its_cap_is_refused_before_it_is_read(tmp_path):
    """A chunks' file declaring a 9 MiB header (safetensors allows 100 MB; the package's
    headers take ~120 B a chunk) is refused naming the cap, before the header is read."""
    from mqnc.serving import Corpus

    _, manifest = _corpus_file(tmp_path)
    tensors = manifest.with_suffix(".safetensors")
    n = 9 * 2**20
    raw = tensors.read_bytes()
    tensors.write_bytes(n.to_bytes(8, "little") + b" " * n + raw[8:])
    with pytest.raises(ValueError, match="more than the 8388608 bytes a chunks' file's header"):
        Corpus.load(manifest)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
@pytest.mark.parametrize("which", ["manifest", "tensors"])
def test_a_corpus_file_that_is_a_fifo_is_refused_without_blocking(tmp_path, which):
    """A manifest or chunks' file that is a symlink to a FIFO (or a FIFO) used to block
    ``Corpus.load`` in ``open()`` until a writer came; it is refused at once, naming the file
    and what it is; so are a directory and an empty file."""
    from mqnc.serving import Corpus

    _, manifest = _corpus_file(tmp_path)
    target = manifest if which == "manifest" else manifest.with_suffix(".safetensors")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    kept = target.with_name(target.name + ".kept")
    target.rename(kept)
    target.symlink_to(fifo)
    with pytest.raises(ValueError, match="expected a regular file, got a FIFO"):
        _finishes(lambda: Corpus.load(manifest))
    target.unlink()
    target.mkdir()
    with pytest.raises(ValueError, match="expected a regular file, got a directory"):
        Corpus.load(manifest)
    target.rmdir()
    target.write_bytes(b"")
    with pytest.raises(ValueError, match="expected a non-empty file"):
        Corpus.load(manifest)
    target.unlink()
    kept.rename(target)
    Corpus.load(manifest)


# ---- FP8 entries: the RoPE part, overflowing scales, FlashMLA's float8 view ------------------


def _fp8_entries(n=8, seed=3):
    from mqnc.reference.fp8_ref import fp8_quantize_reference

    g = torch.Generator().manual_seed(seed)
    x = (0.5 * torch.randn(n, 576, generator=g)).to(torch.bfloat16)
    return fp8_quantize_reference(x, 512)


def test_an_fp8_entry_with_a_rope_value_not_finite_is_refused():
    """The FP8 entry check looked at the scales and latent bytes only: a ``-inf`` (or NaN) in
    the bf16 RoPE part was accepted, and the token vanished from the answer (its score
    ``-inf``), status ok; a bf16 holder refuses the same value. Now the pools' check, the
    kernels' attended-entry check (dense and sparse) and a split cache's ``kpe_pool`` refuse
    it, naming the RoPE value."""
    from mqnc.triton_kernels import mla_decode_partial, mla_sparse_partial
    from mqnc.triton_kernels.fp8.quant import check_entries

    entries = _fp8_entries()
    bad = entries.clone()
    bad[5, 528 + 2 * 7 : 528 + 2 * 8] = torch.tensor([float("-inf")], dtype=torch.bfloat16).view(
        torch.uint8
    )
    with pytest.raises(
        ValueError,
        match=r"cache: expected finite RoPE values .* got -inf at RoPE value 7 of the entry "
        r"at \[5\]",
    ):
        check_entries(bad, 512, 64)
    check_entries(entries, 512, 64)
    q = torch.randn(1, 16, 576).to(torch.bfloat16)
    pool = bad.view(1, 8, 656)
    table = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.tensor([8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"kv_pool: expected finite RoPE values .* token slot 5"):
        mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE)
    with pytest.raises(ValueError, match=r"kv_pool: expected finite RoPE values .* token slot 5"):
        mla_sparse_partial(q, pool, torch.arange(8, dtype=torch.int32)[None], softmax_scale=SCALE)
    # FlashInfer's split layout: latent + scales in kv_pool, bf16 RoPE in kpe_pool
    kv = entries[:, :528].contiguous().view(1, 8, 528)
    kpe = torch.randn(1, 8, 64).to(torch.bfloat16)
    kpe[0, 2, 9] = float("nan")
    with pytest.raises(ValueError, match=r"kpe_pool: expected finite RoPE values .* token slot 2"):
        mla_decode_partial(q[..., :512].contiguous(), kv, table, lens, softmax_scale=SCALE,
                           q_pe=q[..., 512:].contiguous(), kpe_pool=kpe)  # fmt: skip


def test_an_fp8_scale_whose_values_overflow_float32_is_refused():
    """Scales of 2^127 (up to 3.4e38) passed the check; dequantizing gave inf and a later
    route NaN. An entry whose latent value times its scale overflows float32 is refused where
    it enters (the pools, the kernels' check), naming the group; the largest values the
    quantizer writes (below 248 * 2^120) pass, so the check and the quantizer agree."""
    from mqnc.triton_kernels.fp8.quant import X_LIMIT, check_entries, fp8_quantize

    entries = _fp8_entries()
    big = entries.clone()
    big[2, 512 + 4 : 512 + 8] = torch.tensor([2.0**127]).view(torch.uint8)  # group 1's scale
    big[2, 128] = 0x7E  # 448 in group 1
    with pytest.raises(
        ValueError, match=r"latent value times its scale finite .*group 1 of the entry at \[2\]"
    ):
        check_entries(big, 512, 64)
    x = torch.zeros(2, 576)
    x[0, :512] = float(X_LIMIT) * (1 - 2**-20)  # the quantizer's largest accepted value
    x[1, 3] = -float(X_LIMIT) * 0.999
    check_entries(fp8_quantize(x, 512), 512, 64)


def test_a_holder_takes_fp8_entries_as_float8_e4m3fn_too():
    """``Holder.add_chunk`` and ``DeviceHolder.add_chunk`` took FP8 entries as uint8 only: the
    ``float8_e4m3fn`` view (FlashMLA's, which the kernels accept) was refused as "expected shape
    (1, c_t, 576), got (1, 32, 656)". The view is taken, bit for bit; a wrong dtype is named."""
    from mqnc.serving import Holder
    from mqnc.transport import LoopbackFabric, slot_bytes_for

    g8 = GEOM.replace(layers=1, cache_dtype="fp8_e4m3")
    fab = LoopbackFabric(1, slot_bytes_for(g8, max_rows=8, max_chunk_tokens=32))
    holder = Holder(fab.endpoint(0), g8, softmax_scale=SCALE, num_blocks=4, kernels="torch")
    entries = _fp8_entries(32).view(1, 32, 656)
    holder.add_chunk(1, entries.view(torch.float8_e4m3fn))
    assert torch.equal(holder.chunk_kv(1).cpu(), entries)
    with pytest.raises(
        TypeError, match=r"kv: invalid dtype, expected torch.bfloat16, got torch.float16"
    ):
        holder.add_chunk(2, torch.zeros(1, 8, 576, dtype=torch.float16))


# ---- the splice: entries moved within one pool ----------------------------------------------


@pytest.mark.parametrize("fp8", [False, True])
def test_a_splice_within_one_pool_over_overlapping_slots_is_a_copy_then_a_splice(fp8):
    """``rope_splice`` of pool slots 0-31 (a view of the pool) onto slots 16-47 of the same
    pool gave 16 entries that differ from a copy-then-splice (the kernel's tiles read entries
    another tile had already written); the chunk is now copied first when it shares memory
    with the pool: bf16 and FP8 alike, every slot equal to the copy-then-splice."""
    from mqnc.model import RopeSpec
    from mqnc.triton_kernels import rope_splice

    rope = RopeSpec.from_preset("deepseek-v2-lite")
    g = torch.Generator().manual_seed(9)
    rows = (0.5 * torch.randn(2, 64, 576, generator=g)).to(torch.bfloat16)
    if fp8:
        from mqnc.triton_kernels.fp8.quant import fp8_quantize

        rows = fp8_quantize(rows.reshape(-1, 576), 512).view(2, 64, 656)
    pool = rows.view(2, 4, 16, rows.shape[-1]).clone()
    slots = torch.arange(16, 48, dtype=torch.int64)
    want = pool.clone()
    rope_splice(pool.view(2, 64, -1)[:, :32].clone(), want, slots, 7, rope)
    rope_splice(pool.view(2, 64, -1)[:, :32], pool, slots, 7, rope)
    assert torch.equal(pool, want)


def test_a_manifest_declaring_more_tokens_than_memory_is_named_before_allocating(tmp_path):
    """A requester with only the manifest sized its pool from the declared token counts: a
    chunk of 2^31 - 200 tokens ended in the allocator's "can't allocate 1.2 TB". The pool's
    size is checked against the device's free memory first, and the error names the manifest's
    ``tokens`` field of the largest chunk."""
    from mqnc.serving import Corpus
    from mqnc.transport import LoopbackFabric

    _, manifest = _corpus_file(tmp_path)
    m = json.loads(manifest.read_text())
    m["chunks"][3]["tokens"] = 2**31 - 200 - m["chunks"][3]["start"]
    manifest.write_text(json.dumps(m))
    manifest.with_suffix(".safetensors").unlink()  # (a requester has only the manifest)
    corpus = Corpus.load(manifest)
    fabric = LoopbackFabric(3, 4096)
    with pytest.raises(ValueError, match=r"chunks\[3\] \(chunk_id 3\) declares tokens=2147483352"):
        corpus.make_requester(fabric.endpoint(0))
