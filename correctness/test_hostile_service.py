"""Hostile store clients and careless peers against the service layer (rendezvous, the done
protocol, the gloo engine's forming, tensor-parallel endpoints), each kept as a regression
test: nothing hangs past the caller's timeout, nothing answers the wrong request, every error
names what to fix.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mqnc.serving.service import KEY, publish_commitment, publish_done, requester_done
from mqnc.transport import TransportTimeout
from mqnc.transport.torchdist import TorchDistTransport, free_port_store, gloo_available

WAIT = 30.0

needs_gloo = pytest.mark.skipif(not gloo_available(), reason="this torch build has no gloo")


def test_a_requesters_done_is_recognised_whatever_else_the_key_holds():
    """Any store client may write ``mqnc-serve/done/<r>`` (the store has no access control):
    a ``1`` set there before the requester's ``done`` (no line break after it), or anything
    appended after, leaves the requester's secret recognised; a forged value alone is not."""
    store = free_port_store(1)
    secret = publish_commitment(store, 3)
    commitment = store.get(f"{KEY}/commit/3").decode()
    store.set(f"{KEY}/done/3", "1")  # a foreign write, no line break
    assert not requester_done(store, 3, commitment)
    publish_done(store, 3, secret)
    assert requester_done(store, 3, commitment)
    store.append(f"{KEY}/done/3", "junk-without-a-newline")
    assert requester_done(store, 3, commitment)


@needs_gloo
def test_a_rank_that_passes_the_handshake_and_leaves_is_named_within_the_timeout():
    """A gloo peer that passes the engine's handshake and never builds its process group (it
    exited) ends the other ranks' ``TorchDistTransport(...)`` within ``connect_timeout_s``
    (``mqnc serve`` passes its ``--timeout``) with a ``TransportTimeout`` naming it, not after
    the hour-long idle timeout."""
    from mqnc.transport import wire
    from mqnc.transport._gloo import FRAME, PROTOCOL
    from mqnc.transport.protocol import handshake

    store = free_port_store(2)

    def handshake_then_leave():
        s = torch.distributed.TCPStore("127.0.0.1", store.port, 2, is_master=False)
        terms = {"engine": "torchdist", "protocol": PROTOCOL, "wire": wire.VERSION,
                 "frame_bytes": FRAME, "world_size": 2, "lanes": 1, "slot_bytes": 4096}  # fmt: skip
        handshake(torch.distributed.PrefixStore("mqnc/handshake", s), 1, 2, terms)

    peer = threading.Thread(target=handshake_then_leave, daemon=True)
    peer.start()
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"rank 0: .* within 2 s: rank\(s\) \[1\] passed"):
        TorchDistTransport(0, 2, store, slot_bytes=4096, connect_timeout_s=2.0, host="127.0.0.1")
    assert time.monotonic() - t0 < WAIT
    peer.join(WAIT)


def _partitioned(seed):
    from mqnc.model import PRESETS
    from mqnc.serving import Corpus

    geom = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=4)
    g = torch.Generator().manual_seed(seed)
    entries = (0.5 * torch.randn(geom.layers, 64, geom.d_qk, generator=g)).to(torch.bfloat16)
    return Corpus.partition(entries, geom, 0.1, chunk_tokens=32, holders=[1])


def test_two_corpora_with_one_table_and_other_bytes_are_refused_at_the_handshake(tmp_path):
    """A requester on one corpus and a holder on another with the same chunk table (ids, token
    ranges, positions, holders) but other bytes agreed before (the handshake left the chunks'
    checksums out) and attended the wrong document, status ok; the chunks' SHA-256 are now a
    term of the handshake, which refuses the pair naming it. A corpus in memory and the same
    corpus saved and loaded give the same digests."""
    from mqnc.serving import Corpus
    from mqnc.serving.service import corpus_terms
    from mqnc.transport.protocol import handshake

    a, b = _partitioned(1), _partitioned(2)
    assert [c for c in a.chunks.values()] == [c for c in b.chunks.values()]
    ta, tb = corpus_terms(a), corpus_terms(b)
    assert ta["chunks"] == tb["chunks"] and ta["chunk_bytes"] != tb["chunk_bytes"]
    loaded = Corpus.load(a.save(tmp_path / "a.json"))
    assert corpus_terms(loaded)["chunk_bytes"] == ta["chunk_bytes"]
    store = free_port_store(2)
    errors = []

    def rank(r, terms):
        client = torch.distributed.TCPStore("127.0.0.1", store.port, 2, is_master=False)
        try:
            handshake(torch.distributed.PrefixStore("t", client), r, 2, terms)
        except ValueError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=rank, args=(r, t)) for r, t in ((0, ta), (1, tb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert len(errors) == 2 and all("chunk_bytes" in e for e in errors), errors


def test_a_holder_that_cannot_serve_fails_its_requesters_at_once():
    """A holder that fails to load its chunks used to exit with a clear message while the
    requester waited its whole ``--timeout`` (300 s) and then reported a store-key timeout; the
    holder now publishes why, and the requester's wait ends at once naming the holder and its
    error. ``run_rank`` itself, over gloo in two threads: the holder's chunks' file is cut."""
    from mqnc.serving.service import publish_failure, wait_ready

    store = free_port_store(1)
    publish_failure(store, 4, ValueError("corpus: c.safetensors: 10 bytes, too short"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"holder rank 4 could not serve: ValueError: corpus"):
        wait_ready(store, [4], timeout_s=WAIT)
    assert time.monotonic() - t0 < WAIT
    with pytest.raises(TimeoutError, match=r"holder ranks \[5\] did not publish ready"):
        wait_ready(store, [5], timeout_s=0.2)


@needs_gloo
def test_run_rank_requester_fails_promptly_when_its_holder_cannot_load(tmp_path):
    """``run_rank`` over gloo, one holder and one requester (threads): a byte of the holder's
    chunks' file is flipped after the manifest was written, so loading its chunks fails (the
    checksum; the requester reads the manifest and headers only, which pass); the requester
    fails well inside its timeout, naming holder rank 1 and the error (it used to wait the
    whole timeout, then name a store key)."""
    from mqnc.serving.service import run_rank

    corpus = _partitioned(3)
    path = corpus.save(tmp_path / "c.json")
    tensors = path.with_suffix(".safetensors")
    raw = bytearray(tensors.read_bytes())
    raw[-1] ^= 0xFF  # a flipped byte of the last chunk: the load passes, its checksum does not
    tensors.write_bytes(bytes(raw))
    store = free_port_store(2, timeout_s=WAIT)
    master = f"127.0.0.1:{store.port}"
    out = {}

    def rank(r):
        try:
            out[r] = run_rank(path, lambda ctx: None, transport="gloo", kernels="torch",
                              timeout_s=WAIT, rank=r, world=2, master=master)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - checked below
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * WAIT)
    assert time.monotonic() - t0 < WAIT, out
    assert corpus.holder_ranks == [1] and isinstance(out[1], ValueError), out  # the holder
    assert isinstance(out[0], RuntimeError), out  # the requester: at once, naming it
    assert "holder rank 1 could not serve: ValueError: corpus" in str(out[0]), out[0]
