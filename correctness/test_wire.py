"""Wire format (mqnc.transport.wire): round trips, sizes from the geometry, bad buffers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mqnc.model import PRESETS
from mqnc.transport import wire

G = PRESETS["deepseek-v2-lite"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def test_sizes_come_from_the_geometry():
    """§3.2: q = 1152 B and p = 1032 B per row for DeepSeek-V2-Lite, q + p = 2184 B."""
    B, H = 2, G.heads
    q = _rand((B, H, G.d_qk), torch.bfloat16, 0)
    buf = wire.pack_query(q, request_id=1, seq=1, chunk_id=3, layer=0)
    assert buf.numel() - wire.HEADER_BYTES == B * H * G.q_row_bytes == B * H * 1152
    o = _rand((B, H, G.d_v), torch.bfloat16, 1)
    m, l = torch.zeros(B, H), torch.ones(B, H)
    p = wire.pack_partial(o, m, l, request_id=1, seq=1)
    assert p.numel() - wire.HEADER_BYTES == B * H * G.p_row_bytes == B * H * 1032
    kv = _rand((G.layers, 5, G.d_qk), torch.bfloat16, 2)
    c = wire.pack_chunk(kv, request_id=1, seq=1, chunk_id=3, layers=(0, G.layers), position=0)
    assert c.numel() - wire.HEADER_BYTES == G.chunk_bytes(5)
    assert wire.HEADER_BYTES % 16 == 0


@given(
    B=st.integers(1, 4),
    H=st.integers(1, 5),
    topk=st.integers(0, 6),
    dtype=st.sampled_from(DTYPES),
    ids=st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    layer=st.integers(0, G.layers - 1),
    crc=st.sampled_from([None, False]),
    seed=st.integers(0, 2**16),
)
def test_query_round_trip(B, H, topk, dtype, ids, layer, crc, seed):
    """A ROUTE packed and unpacked, with and without the payload CRC; the requester's fast
    packer (the rows' bytes and the selection as numpy) writes the same bytes."""
    q = _rand((B, H, G.d_qk), dtype, seed)
    idx = None
    if topk:
        idx = torch.randint(
            -1, 1000, (B, topk), generator=torch.Generator().manual_seed(seed), dtype=torch.int32
        )
    rid, seq, cid = ids
    kw = dict(request_id=rid, seq=seq, chunk_id=cid, layer=layer, crc=crc)
    buf = wire.pack_query(q, indices=idx, **kw)
    h, q2, idx2 = wire.unpack_query(buf, geometry=G)
    assert (h.kind, h.request_id, h.seq, h.chunk_id) == (wire.Kind.ROUTE, rid, seq, cid)
    assert (h.batch, h.heads, h.rows, h.layer_lo, h.layer_hi, h.topk) == (
        B,
        H,
        B * H,
        layer,
        layer + 1,
        topk,
    )
    assert _bits_equal(q2, q)
    if topk:
        assert torch.equal(idx2, idx)
    else:
        assert idx2 is None
    assert buf.numel() == wire.HEADER_BYTES + wire.query_payload_bytes(B, H, G.d_qk, topk, dtype)
    qb = q.view(torch.uint8).numpy().reshape(B, -1)
    got = wire.pack_query_arrays(
        qb, None if idx is None else idx.numpy(), dtype=dtype, heads=H, width=G.d_qk,
        array=True, **kw,
    )  # fmt: skip
    assert type(got) is np.ndarray and bytes(got) == bytes(buf.numpy())


@given(
    B=st.integers(1, 4),
    H=st.integers(1, 5),
    dtype=st.sampled_from(DTYPES),
    holder_ns=st.integers(0, 2**64 - 1),
    seed=st.integers(0, 2**16),
    empty_row=st.booleans(),
)
def test_partial_round_trip(B, H, dtype, holder_ns, seed, empty_row):
    """The collapsed response (o, m, l) is one buffer and comes back bit-exact (§5.3)."""
    o = _rand((B, H, G.d_v), dtype, seed)
    m = _rand((B, H), torch.float32, seed + 1) * 10
    l = _rand((B, H), torch.float32, seed + 2).abs() + 0.5
    if empty_row:
        m[0, 0], l[0, 0] = 0.0, 0.0
    buf = wire.pack_partial(o, m, l, request_id=5, seq=9, chunk_id=2, layer=3, holder_ns=holder_ns)
    h, o2, m2, l2 = wire.unpack_partial(buf, geometry=G)
    assert h.kind == wire.Kind.PARTIAL and h.holder_ns == holder_ns and h.rows == B * H
    assert _bits_equal(o2, o) and _bits_equal(m2, m) and _bits_equal(l2, l)


@given(
    B=st.integers(1, 4),
    H=st.integers(1, 5),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    keyed_rows=st.one_of(st.none(), st.lists(st.booleans(), min_size=4, max_size=4)),
    bad=st.sampled_from([None, math.nan, math.inf, -math.inf]),
)
def test_partial_lse_round_trip(B, H, dtype, seed, keyed_rows, bad):
    """The wire takes a natural-log lse and gives one back: bit for bit where it is finite and
    the row had keys, -inf for a row without keys (an empty partial, ``(m, l) = (0, 0)`` on
    the wire), NaN for a row with keys but no finite lse (never read as empty); the message
    carries ``(lse, 1)`` for the usual row, as :func:`wire.stat_of_lse` says."""
    o = _rand((B, H, G.d_v), dtype, seed)
    lse = (_rand((B, H), torch.float32, seed + 1) * 10).numpy()
    if bad is not None:
        lse[-1, -1] = bad
    keyed = None if keyed_rows is None else np.array(keyed_rows[:B], dtype=bool)
    ob = o.view(torch.uint8).numpy().reshape(B, -1)
    kw = dict(dtype=dtype, width=G.d_v, request_id=5, seq=9, chunk_id=2, layer=3, holder_ns=7)
    a = wire.pack_partial_lse(ob, lse, keyed=keyed, crc=None, array=True, **kw)
    t = wire.pack_partial_lse(ob, lse, keyed=keyed, crc=None, **kw)
    assert type(a) is np.ndarray and bytes(a) == bytes(t.numpy())
    has_keys = np.ones(B, bool) if keyed is None else keyed
    want = np.where(has_keys[:, None], np.where(np.isfinite(lse), lse, np.nan), -np.inf)
    for buf in (a, t):
        h = wire.parse_header(buf, geometry=G, require_payload_crc=True)
        o2, lse2 = wire.partial_lse(buf, h)
        assert _bits_equal(o2, o) and lse2.dtype == torch.float32
        np.testing.assert_array_equal(lse2.numpy(), want.astype(np.float32))
        kept = has_keys[:, None] & np.isfinite(lse)
        assert lse2.numpy()[kept].tobytes() == lse[kept].tobytes()  # bit for bit
        _, _, m, l = wire.unpack_partial(buf, geometry=G)
        want_l = np.where(has_keys[:, None], 1.0, 0.0) * np.ones((B, H))
        np.testing.assert_array_equal(l.numpy(), want_l.astype(np.float32))
        np.testing.assert_array_equal(m.numpy(), np.where(has_keys[:, None], want, 0.0))


def test_lse_of_stat_reads_any_pair_a_peer_may_send():
    """A forged or corrupt ``(m, l)`` is never a silent "empty": ``l = 0`` is empty (-inf),
    a finite ``m`` with a finite positive ``l`` is ``m + log(l)``, anything else NaN."""
    m = np.array([[0.5, 3.0, 1.0, math.inf, math.nan, 1.0, 7.0]], np.float32)
    l = np.array([[1.0, 2.0, 0.0, 1.0, 1.0, -1.0, math.inf]], np.float32)
    got = wire.lse_of_stat(m, l)
    want = np.array([[0.5, 3.0 + np.log(np.float32(2.0)), -np.inf] + [np.nan] * 4], np.float32)
    np.testing.assert_array_equal(got.numpy(), want)
    assert torch.equal(wire.lse_of_stat(torch.from_numpy(m[:, :2]), torch.from_numpy(l[:, :2])),
                       torch.from_numpy(want[:, :2]))  # fmt: skip
    # the usual (lse, 1) comes back as m itself; stat_of_lse is its inverse there
    lse = np.array([[1.25, -3.5]], np.float32)
    m2, l2 = wire.stat_of_lse(lse)
    assert m2 is lse and np.array_equal(l2, np.ones_like(lse))
    assert wire.lse_of_stat(m2, l2).numpy().tobytes() == lse.tobytes()


def test_pack_partial_lse_refuses_bad_statistics():
    ob = np.zeros((2, 3 * G.d_v * 2), np.uint8)
    kw = dict(dtype=torch.bfloat16, width=G.d_v, request_id=1, seq=1, chunk_id=0, layer=0,
              holder_ns=0, crc=None)  # fmt: skip
    with pytest.raises(TypeError, match=r"lse: expected a \[B, H\] float32 numpy array"):
        wire.pack_partial_lse(ob, np.zeros((2, 3), np.float64), **kw)
    with pytest.raises(TypeError, match="lse: expected .* got Tensor"):
        wire.pack_partial_lse(ob, torch.zeros(2, 3), **kw)
    with pytest.raises(ValueError, match=r"keyed: expected \[2\] bool, got shape \(3,\)"):
        wire.pack_partial_lse(ob, np.zeros((2, 3), np.float32), keyed=np.ones(3, bool), **kw)
    for keyed, got in (
        (np.ones(2, np.int32), "int32"),
        (torch.ones(2, dtype=torch.bool), "Tensor"),
    ):
        with pytest.raises(TypeError, match=f"keyed: expected a \\[B\\] bool numpy array .* {got}"):
            wire.pack_partial_lse(ob, np.zeros((2, 3), np.float32), keyed=keyed, **kw)
    with pytest.raises(ValueError, match="o, m, l: "):
        wire.pack_partial_lse(ob[:1], np.zeros((2, 3), np.float32), **kw)


def test_route_lse_of_ml_is_a_deprecated_alias():
    from mqnc.serving import route

    m, l = np.array([[1.0, 0.0]], np.float32), np.array([[2.0, 0.0]], np.float32)
    with pytest.warns(DeprecationWarning, match="lse_of_stat"):
        got = route.lse_of_ml(m, l)
    assert torch.equal(got, wire.lse_of_stat(m, l))


def test_partial_into_staging_buffer():
    o, m, l = _rand((2, 3, G.d_v), torch.bfloat16, 0), torch.zeros(2, 3), torch.ones(2, 3)
    staging = torch.full((100_000,), 7, dtype=torch.uint8)
    buf = wire.pack_partial(o, m, l, request_id=1, seq=1, out=staging)
    assert buf.data_ptr() == staging.data_ptr()
    _, o2, _, _ = wire.unpack_partial(staging)  # a slot larger than the message is fine
    assert _bits_equal(o2, o)
    with pytest.raises(ValueError, match="out"):
        wire.pack_partial(o, m, l, request_id=1, seq=1, out=staging[:100])


@given(
    layers=st.tuples(st.integers(0, G.layers - 1), st.integers(1, 3)),
    ct=st.integers(0, 9),
    position=st.integers(-(2**40), 2**40),
)
def test_chunk_round_trip(layers, ct, position):
    lo = layers[0]
    hi = min(lo + layers[1], G.layers)
    kv = _rand((hi - lo, ct, G.d_qk), torch.bfloat16, ct)
    buf = wire.pack_chunk(kv, request_id=3, seq=4, chunk_id=11, layers=(lo, hi), position=position)
    h, kv2 = wire.unpack_chunk(buf, geometry=G)
    assert (h.layer_lo, h.layer_hi, h.batch, h.position) == (lo, hi, ct, position)
    assert _bits_equal(kv2, kv)


def test_probe_fetch_error_shutdown():
    for ack in (False, True):
        h = wire.parse_header(wire.pack_probe(request_id=2, seq=3, ack=ack))
        assert h.kind == (wire.Kind.PROBE_ACK if ack else wire.Kind.PROBE)
        assert h.payload_bytes == 0 and h.nbytes == wire.HEADER_BYTES
        # The template path packs the same bytes as the generic header packer.
        kind = wire.Kind.PROBE_ACK if ack else wire.Kind.PROBE
        rid, seq = 2**64 - 1, 2**63 + 5
        want = wire.Header(kind, request_id=rid, seq=seq).pack()
        assert bytes(wire.pack_probe(request_id=rid, seq=seq, ack=ack).numpy()) == want
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="request_id"):
            wire.pack_probe(request_id=bad, seq=1)
    h = wire.parse_header(wire.pack_fetch(request_id=2, seq=3, chunk_id=4), geometry=G)
    assert (h.kind, h.chunk_id, h.layer_lo, h.layer_hi) == (wire.Kind.FETCH, 4, 0, G.layers)
    h, text = wire.unpack_error(wire.pack_error("chunk 4 unknown", request_id=2, seq=3))
    assert text == "chunk 4 unknown" and h.request_id == 2
    assert wire.parse_header(wire.pack_shutdown()).kind == wire.Kind.SHUTDOWN


def test_query_arrays_refuse_bad_ids_and_sizes():
    q = np.zeros((2, 3 * G.q_row_bytes), np.uint8)
    kw = dict(dtype=torch.bfloat16, heads=3, width=G.d_qk, request_id=1, seq=1, layer=0, crc=None)
    with pytest.raises(ValueError, match=r"chunk_id: expected an int in \[0, "):
        wire.pack_query_arrays(q, None, chunk_id=-1, **kw)
    with pytest.raises(TypeError, match="chunk_id: expected an int, got float"):
        wire.pack_query_arrays(q, None, chunk_id=1.0, **kw)
    with pytest.raises(ValueError, match="q, indices: 6912 B, expected 4608 B"):
        wire.pack_query_arrays(q, None, chunk_id=1, **{**kw, "heads": 2})
    with pytest.raises(ValueError, match="q, indices: "):
        wire.pack_query_arrays(q, np.zeros((1, 4), np.int32), chunk_id=1, **kw)
    for layer in (-1, 2**16 - 1):  # the header's [layer, layer + 1) is u16
        with pytest.raises(ValueError, match="layer: expected an int in "):
            wire.pack_query_arrays(q, None, chunk_id=1, **{**kw, "layer": layer})
    with pytest.raises(TypeError, match="q: expected the rows' bytes"):
        wire.pack_query_arrays(q.view(np.int16), None, chunk_id=1, **kw)
    with pytest.raises(TypeError, match=r"indices: expected \[B, topk\] int32"):
        wire.pack_query_arrays(q, np.zeros((2, 4), np.int64), chunk_id=1, **kw)


def test_restamp_gives_new_ids_and_keeps_the_payload():
    """A sealed message under new ids (a header template's copy, a ready holder's reply): the
    header parses with them, the payload and its CRC unchanged, the original untouched."""
    o = _rand((2, 3, G.d_v), torch.bfloat16, 4)
    m, l = np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32)
    ob = o.view(torch.uint8).numpy().reshape(2, -1)
    kw = dict(dtype=torch.bfloat16, width=G.d_v, chunk_id=2, layer=1, holder_ns=7, array=True)
    sealed = wire.pack_partial_arrays(ob, m, l, request_id=1, seq=2, crc=None, **kw)
    before = sealed.copy()
    got = wire.restamp(sealed, request_id=2**64 - 1, seq=99)
    h = wire.parse_header(got, geometry=G, require_payload_crc=True)
    assert (h.request_id, h.seq, h.chunk_id, h.batch, h.heads) == (2**64 - 1, 99, 2, 2, 3)
    assert np.array_equal(sealed, before)
    assert bytes(got) == bytes(wire.pack_partial_arrays(
        ob, m, l, request_id=2**64 - 1, seq=99, crc=None, **kw
    ))  # fmt: skip


def test_array_messages_are_the_same_bytes_and_read_alike():
    """``array=True`` (what the holder and the requester put) packs the same bytes as
    the tensor form into a host numpy array, and every reader takes it: the same header, the
    same query, selection, partial, chunk and error text, bit for bit."""
    q = _rand((2, 3, G.d_qk), torch.bfloat16, 0)
    idx = torch.tensor([[0, 5, -1], [7, 1, 2]], dtype=torch.int32)
    ids = dict(request_id=2**64 - 1, seq=2**63 + 5)
    pairs = {
        "probe": lambda array: wire.pack_probe(**ids, ack=True, array=array),
        "fetch": lambda array: wire.pack_fetch(**ids, chunk_id=4, array=array),
        "shutdown": lambda array: wire.pack_shutdown(**ids, array=array),
        "error": lambda array: wire.pack_error("chunk 4 \u00e9", **ids, array=array),
        "route": lambda array: wire.pack_query(
            q, **ids, chunk_id=2, layer=1, indices=idx, array=array
        ),
    }
    for name, pack in pairs.items():
        t, a = pack(False), pack(True)
        assert type(t) is torch.Tensor and type(a) is np.ndarray, name
        assert a.dtype == np.uint8 and a.ndim == 1 and bytes(a) == bytes(t.numpy()), name
        assert wire.parse_header(a, geometry=G) == wire.parse_header(t, geometry=G), name
        assert wire.peek_length(a) == wire.peek_length(t) == t.numel(), name
    assert wire.unpack_error(pairs["error"](True)) == wire.unpack_error(pairs["error"](False))
    for buf in (pairs["route"](True), pairs["route"](False)):
        h, q2, idx2 = wire.unpack_query(buf, geometry=G)
        assert _bits_equal(q2, q) and torch.equal(idx2, idx)
    # the holder's partial: numpy statistics in, the same message and views out
    o = _rand((2, 3, G.d_v), torch.bfloat16, 1)
    m = np.array([[0.5, -1, 2], [3, 4, -np.inf]], np.float32)
    l = np.array([[1, 2, 3], [4, 5, 0]], np.float32)
    ob = o.contiguous().view(torch.uint8).numpy().reshape(2, -1)
    kw = dict(dtype=torch.bfloat16, width=G.d_v, chunk_id=2, layer=1, holder_ns=7, crc=None)
    t = wire.pack_partial_arrays(ob, m, l, **ids, **kw)
    a = wire.pack_partial_arrays(ob, m, l, **ids, array=True, **kw)
    assert type(a) is np.ndarray and bytes(a) == bytes(t.numpy())
    for buf in (a, t):
        h = wire.parse_header(buf, geometry=G, require_payload_crc=True)
        o2, m2, l2 = wire.partial_arrays(buf, h)
        assert _bits_equal(o2, o) and np.array_equal(m2, m) and np.array_equal(l2, l)
        _, o3, m3, l3 = wire.unpack_partial(buf, geometry=G)
        assert _bits_equal(o3, o) and torch.equal(m3, torch.from_numpy(m))
    # a chunk read from a host array (the requester's fetch reply)
    kv = _rand((2, 5, G.d_qk), torch.bfloat16, 3)
    c = wire.pack_chunk(kv, **ids, chunk_id=2, layers=(0, 2), position=9)
    assert _bits_equal(wire.unpack_chunk(c.numpy().copy(), geometry=G)[1], kv)
    # a field at an offset its dtype cannot view in place is copied, as for a tensor
    odd = np.zeros(c.numel() + 1, np.uint8)[1:]
    odd[:] = c.numpy()
    assert not odd[wire.HEADER_BYTES :].view(np.int16).flags.aligned
    assert _bits_equal(wire.unpack_chunk(odd, geometry=G)[1], kv)

    # a numpy subclass is an array, and a read-only array is read without torch's warning
    class Sub(np.ndarray):
        pass

    sub = c.numpy().copy().view(Sub)
    assert _bits_equal(wire.unpack_chunk(sub, geometry=G)[1], kv)
    frozen = np.frombuffer(bytes(c.numpy()), np.uint8)
    assert not frozen.flags.writeable
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _bits_equal(wire.unpack_chunk(frozen, geometry=G)[1], kv)
    # an array is a host message: asked for with a device, refused by name
    with pytest.raises(ValueError, match="array: a numpy array is a host message"):
        wire.pack_probe(**ids, device="meta", array=True)
    with pytest.raises(ValueError, match="array: a numpy array is a host message"):
        wire.pack_query(q.to("meta"), **ids, chunk_id=2, layer=1, array=True)


def _messages():
    q = _rand((2, 3, G.d_qk), torch.bfloat16, 0)
    idx = torch.tensor([[0, 5, -1], [7, 1, 2]], dtype=torch.int32)
    o = _rand((2, 3, G.d_v), torch.bfloat16, 1)
    return {
        "route": wire.pack_query(q, request_id=1, seq=1, chunk_id=2, layer=1, indices=idx),
        "partial": wire.pack_partial(o, torch.zeros(2, 3), torch.ones(2, 3), request_id=1, seq=1),
        "probe": wire.pack_probe(request_id=1, seq=1),
        "chunk": wire.pack_chunk(
            _rand((1, 3, G.d_qk), torch.bfloat16, 2),
            request_id=1,
            seq=1,
            chunk_id=2,
            layers=(0, 1),
            position=0,
        ),
    }


MESSAGES = _messages()


@given(name=st.sampled_from(sorted(MESSAGES)), data=st.data())
def test_any_single_byte_corruption_is_rejected(name, data):
    """Flipping any bit of any byte (header, padding or payload) is caught before use."""
    buf = MESSAGES[name].clone()
    pos = data.draw(st.integers(0, buf.numel() - 1))
    bit = data.draw(st.integers(0, 7))
    buf[pos] ^= 1 << bit
    with pytest.raises(wire.WireError):
        wire.parse_header(buf, geometry=G)


@given(name=st.sampled_from(sorted(MESSAGES)), data=st.data())
def test_truncation_is_rejected(name, data):
    buf = MESSAGES[name]
    n = data.draw(st.integers(0, buf.numel() - 1))
    with pytest.raises(wire.WireError, match="truncated"):
        wire.parse_header(buf[:n].clone(), geometry=G)


def test_rejections_name_what_is_wrong():
    route = MESSAGES["route"]
    with pytest.raises(wire.WireError, match="unexpected message kind"):
        wire.unpack_partial(route)
    with pytest.raises(wire.WireError, match="width"):
        wire.parse_header(route, geometry=G.replace(d_c=256))
    with pytest.raises(wire.WireError, match="layer range"):
        wire.parse_header(route, geometry=G.replace(layers=1))
    bad = route.clone()
    bad[:4] = torch.tensor(list(b"XXXX"), dtype=torch.uint8)
    with pytest.raises(wire.WireError, match="magic"):
        wire.parse_header(bad)
    # a host uint8 array is a message too (the packers' array=True); any other is refused
    assert wire.parse_header(route.numpy(), geometry=G) == wire.parse_header(route, geometry=G)
    with pytest.raises(TypeError, match="buf: expected a 1-D uint8 array, got dtype int16"):
        wire.parse_header(route.numpy().view(np.int16))
    with pytest.raises(ValueError, match=r"buf: expected a contiguous .* strides \(2,\)"):
        wire.parse_header(np.repeat(route.numpy(), 2)[::2])
    with pytest.raises(TypeError, match="buf: expected a 1-D uint8 array"):
        wire.peek_length(route.numpy().reshape(1, -1))
    with pytest.raises(TypeError, match="buf: expected a torch.Tensor or numpy array"):
        wire.parse_header(list(route.numpy()))
    with pytest.raises(TypeError, match="uint8"):
        wire.parse_header(route.view(torch.int16))
    with pytest.raises(ValueError, match="contiguous"):
        wire.parse_header(route[::2])


def test_pack_argument_errors():
    q = _rand((2, 3, G.d_qk), torch.bfloat16, 0)
    with pytest.raises(ValueError, match="q: expected 3 dims with last dim 576"):
        wire.pack_query(q[..., :512], request_id=1, seq=1, chunk_id=1, layer=0)
    with pytest.raises(TypeError, match="q: invalid dtype"):
        wire.pack_query(q.to(torch.int32), request_id=1, seq=1, chunk_id=1, layer=0)
    with pytest.raises(ValueError, match=rf"layer: expected 0 <= layer < {G.layers}, got -1"):
        wire.pack_query(q, request_id=1, seq=1, chunk_id=1, layer=-1)
    with pytest.raises(ValueError, match=rf"layer: expected 0 <= layer < {G.layers}"):
        wire.pack_query(q, request_id=1, seq=1, chunk_id=1, layer=G.layers)
    # a layer range is a pair of ints: a float or a bool is refused, not cut to a layer
    for layers in ((0.9, 2.7), (True, 2), [0.5, 2.5]):
        with pytest.raises(TypeError, match="layers: expected a pair of ints"):
            wire.pack_fetch(request_id=1, seq=1, chunk_id=1, layers=layers)
    with pytest.raises(ValueError, match="request_id"):
        wire.pack_query(q, request_id=-1, seq=1, chunk_id=1, layer=0)
    with pytest.raises(TypeError, match="indices: invalid dtype"):
        wire.pack_query(
            q,
            request_id=1,
            seq=1,
            chunk_id=1,
            layer=0,
            indices=torch.zeros(2, 4, dtype=torch.int64),
        )
    with pytest.raises(ValueError, match="indices: expected shape"):
        wire.pack_query(
            q,
            request_id=1,
            seq=1,
            chunk_id=1,
            layer=0,
            indices=torch.zeros(3, 4, dtype=torch.int32),
        )
    o = _rand((2, 3, G.d_v), torch.bfloat16, 0)
    with pytest.raises(TypeError, match="m: invalid dtype"):
        wire.pack_partial(
            o, torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, 3), request_id=1, seq=1
        )
    with pytest.raises(ValueError, match="l: expected shape"):
        wire.pack_partial(o, torch.zeros(2, 3), torch.ones(3, 2), request_id=1, seq=1)
    with pytest.raises(ValueError, match="kv: expected 2 layers"):
        wire.pack_chunk(
            _rand((1, 3, G.d_qk), torch.bfloat16, 0),
            request_id=1,
            seq=1,
            chunk_id=1,
            layers=(0, 2),
            position=0,
        )


# ---- the fuzz (a hostile peer): any bytes, any sealed header: typed errors only, no big buffers

_UNPACKERS = (wire.parse_header, wire.unpack_query, wire.unpack_partial, wire.unpack_chunk,
              wire.unpack_error, wire.peek_length)  # fmt: skip


def _sealed(fields: dict, payload: bytes) -> torch.Tensor:
    """A header with these raw struct fields and a correct header CRC (what any peer can
    forge), then ``payload``: the header CRC rule of the module docstring, written out."""
    import struct
    import zlib

    raw = bytearray(wire.HEADER_BYTES)
    values = [wire.MAGIC, wire.VERSION] + [fields[k] for k in _RAW_FIELDS] + [0]
    struct.pack_into(wire.HEADER_FORMAT, raw, 0, *values)
    off = struct.calcsize(wire.HEADER_FORMAT) - 4
    struct.pack_into("<I", raw, off, zlib.crc32(bytes(raw)))
    return torch.frombuffer(bytearray(bytes(raw) + payload), dtype=torch.uint8)


_RAW_FIELDS = ("kind", "dtype", "flags", "request_id", "seq", "chunk_id", "batch", "heads",
               "width", "layer_lo", "layer_hi", "topk", "payload_bytes", "position", "holder_ns",
               "payload_crc")  # fmt: skip
_U = {"H": 2**16 - 1, "I": 2**32 - 1, "Q": 2**64 - 1}
_SMALL = st.one_of(st.integers(0, 8), st.integers(0, 2**16 - 1))


def _field(kind: str):
    return st.one_of(_SMALL, st.integers(0, _U[kind]))


_HEADER_FIELDS = st.fixed_dictionaries(
    {
        "kind": st.integers(0, 10),
        "dtype": st.integers(0, 4),
        "flags": st.integers(0, 3),
        "request_id": _field("Q"),
        "seq": _field("Q"),
        "chunk_id": _field("Q"),
        "batch": _field("I"),
        "heads": _field("I"),
        "width": st.one_of(st.sampled_from([G.d_qk, G.d_v, 1, 3, 575]), _field("I")),
        "layer_lo": _field("H"),
        "layer_hi": _field("H"),
        "topk": _field("I"),
        "payload_bytes": st.one_of(st.integers(0, 4096), _field("Q")),
        "position": st.integers(-(2**63), 2**63 - 1),
        "holder_ns": _field("Q"),
        "payload_crc": _field("I"),
    }
)


def _only_typed_errors(buf: torch.Tensor) -> None:
    for fn in _UNPACKERS:
        for kw in ({}, {"geometry": G}) if fn is not wire.peek_length else ({},):
            if fn in (wire.unpack_error, wire.peek_length) and kw:
                continue
            try:
                out = fn(buf, **kw)
            except wire.WireError:
                continue  # the one error a message may raise
            # Anything returned is a view of (or a small copy from) the buffer.
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    assert t.numel() * t.element_size() <= buf.numel(), fn.__name__


@given(data=st.binary(min_size=0, max_size=2048))
def test_fuzz_random_bytes(data):
    """Random buffers (most fail the magic, version or header CRC)."""
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    _only_typed_errors(buf)


@given(fields=_HEADER_FIELDS, payload=st.binary(max_size=4096))
def test_fuzz_sealed_headers(fields, payload):
    """Headers with a valid CRC and arbitrary fields (a hostile peer reseals what it forges):
    every parser raises only WireError, and nothing it returns is larger than the buffer."""
    _only_typed_errors(_sealed(fields, payload))


@given(fields=_HEADER_FIELDS)
def test_fuzz_consistent_sizes(fields):
    """The same, with the payload the header's fields imply (up to 64 KiB) actually present."""
    h = fields.copy()
    itemsize = {1: 2, 2: 2, 3: 4}.get(h["dtype"], 2)
    rows = min(h["batch"], 64) * min(h["heads"], 8)
    hi = min(h["layer_hi"], h["layer_lo"] + 3, 2**16 - 1)
    h.update(batch=min(h["batch"], 64), heads=min(h["heads"], 8), width=min(h["width"], 600),
             topk=min(h["topk"], 16), layer_hi=hi)  # fmt: skip
    need = {3: rows * h["width"] * itemsize + h["batch"] * h["topk"] * 4,
            4: rows * (h["width"] * itemsize + 8),
            6: (h["layer_hi"] - h["layer_lo"]) * h["batch"] * h["width"] * itemsize}.get(
        h["kind"], 0)  # fmt: skip
    if not 0 <= need <= 65536:
        return
    h["payload_bytes"] = need
    _only_typed_errors(_sealed(h, bytes(need)))


def test_all_finite_and_all_equal_one_element_and_many():
    """The one-element fast path answers as the reduction does (NaN, inf, -inf, 0)."""
    for v in (0.0, 1.5, math.nan, math.inf, -math.inf):
        for n in (1, 3):
            a = np.full((n, 1), v, dtype=np.float32)
            assert wire.all_finite(a) == bool(np.isfinite(a).all())
            assert wire.all_equal(a, 1.5) == bool((a == 1.5).all())
    mixed = np.array([[1.0, math.nan]], dtype=np.float32)
    assert not wire.all_finite(mixed) and not wire.all_equal(mixed, 1.0)
    assert wire.all_equal(np.ones(1, bool), True) and not wire.all_equal(np.zeros(1, bool), True)


def test_wire_crc_is_zlibs_crc32():
    """The wire's CRC-32 (ISA-L's when installed) gives zlib's values, chained too."""
    import zlib

    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 96, 1153, 300_001):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        assert wire._crc32(a) == zlib.crc32(a)
        assert wire._crc32(a, 12345) == zlib.crc32(a, 12345)


# ---- FP8 cache entries (cache_dtype "fp8_e4m3", mqnc.model.kv_format) ---------------------------
G8 = G.replace(cache_dtype="fp8_e4m3")


def _fp8_entries(layers: int, ct: int, seed: int = 0) -> torch.Tensor:
    """Random bytes in the entries' shape (the wire moves bytes; it never reads the values)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layers, ct, 656), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("crc", [None, False])
def test_fp8_chunk_moves_656_bytes_per_token_layer(crc):
    """A fetch of FP8 entries moves ``b_KV`` = 656 B per token per layer, bit for bit; its
    header says dtype code 4 and the entry's width."""
    kv = _fp8_entries(G.layers, 5)
    buf = wire.pack_chunk(
        kv, request_id=1, seq=2, chunk_id=3, layers=(0, G.layers), position=7, geometry=G8, crc=crc
    )
    assert buf.numel() - wire.HEADER_BYTES == G8.chunk_bytes(5) == 5 * G.layers * 656
    assert (
        buf[8].item() == wire.FP8_ENTRIES_CODE
    )  # the dtype field (u16 after magic, version, kind)
    h, got = wire.unpack_chunk(buf, geometry=G8, require_payload_crc=crc is None)
    assert (h.dtype, h.width, h.batch, h.position) == (torch.uint8, 656, 5, 7)
    assert got.dtype == torch.uint8 and torch.equal(got, kv)
    one = wire.pack_chunk(
        kv[2:3], request_id=1, seq=2, chunk_id=3, layers=(2, 3), position=7, geometry=G8
    )
    assert torch.equal(wire.unpack_chunk(one, geometry=G8)[1], kv[2:3])


def test_fp8_format_mismatch_names_both_sides():
    kv8, kv16 = _fp8_entries(1, 3), _rand((1, 3, G.d_qk), torch.bfloat16, 0)
    kw = dict(request_id=1, seq=2, chunk_id=3, layers=(0, 1), position=0)
    with pytest.raises(ValueError, match=r"cache format mismatch: got uint8 \(fp8_e4m3 entries\), "
                       r"geometry 'deepseek-v2-lite' keeps a bf16 cache"):  # fmt: skip
        wire.pack_chunk(kv8, **kw, geometry=G)
    with pytest.raises(ValueError, match="got bfloat16, geometry .* keeps a fp8_e4m3 cache .*"
                       "fp8_quantize"):  # fmt: skip
        wire.pack_chunk(kv16, **kw, geometry=G8)
    with pytest.raises(ValueError, match="last dim 656"):
        wire.pack_chunk(kv8[..., :640], **kw, geometry=G8)
    sent8, sent16 = wire.pack_chunk(kv8, **kw, geometry=G8), wire.pack_chunk(kv16, **kw)
    with pytest.raises(wire.WireError, match=r"the CHUNK carries fp8_e4m3 entries \(656 B a "
                       r"token\), geometry 'deepseek-v2-lite' keeps a bf16 cache"):  # fmt: skip
        wire.unpack_chunk(sent8, geometry=G)
    with pytest.raises(wire.WireError, match="the CHUNK carries bfloat16 rows, .* fp8_e4m3 cache"):
        wire.unpack_chunk(sent16, geometry=G8)
    forged = wire.Header(wire.Kind.ROUTE, torch.uint8, batch=1, heads=1, width=4,
                         layer_lo=0, layer_hi=1, payload_bytes=4).pack()  # fmt: skip
    with pytest.raises(wire.WireError, match="dtype code 4 .* on a ROUTE message"):
        wire.parse_header(torch.frombuffer(bytearray(forged + bytes(4)), dtype=torch.uint8))
