"""Hostile files and careless inputs against the corpus, the FP8 entries, the holders and the
splice: each kept as a regression test. Nothing hangs on a file, nothing silently drops a
token, every error names the field, argument or file to fix.
"""

from __future__ import annotations

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
