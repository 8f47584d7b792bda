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
