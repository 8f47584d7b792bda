"""Real holders and requesters on a transport inside a benchmark: the package's own path
(:class:`~mqnc.serving.Holder`, :class:`~mqnc.serving.Requester`, the wire format, the engine),
as ``perf/bench_host`` and ``mqnc calibrate --path serving`` time it (§5.3's host overhead).

Rank 0 is the requester (this process; several threads may share it, one lane each); ranks
``1 ..`` are holders, each hosting one chunk of ``chunk_tokens`` tokens (chunk id ``1 + i`` on the
``i``-th holder, seeded entries): threads of this process on ``loopback``, subprocesses
(``python -m mqnc.measure.holders serve ...``) over gloo on 127.0.0.1 on ``gloo``.

``stub_kernel`` replaces the holder's partial-attention kernels by a stub that returns
zeros of the right shapes (:func:`stub_attention`): what is left is the software around a
call (packing, the engine, parsing, the block table, the reply), which is what the host
overhead term prices. Without it the holders run the real kernels (the Triton interpreter on
a CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading

import numpy as np
import torch

from mqnc.base import stamps as _stamps
from mqnc.measure.ranks import connect_rank, exit_process, rank_parser, start_gloo_ranks
from mqnc.model.geometry import MLAGeometry, load_geometry
from mqnc.serving import ChunkInfo, Holder, Requester
from mqnc.transport import LoopbackFabric, slot_bytes_for, wire
from mqnc.transport.protocol import INBOX, REPLY, PeerLost, TransportError, TransportTimeout

__all__ = ["HolderFabric", "ReadyHolder", "stub_attention", "SCALE"]

SCALE = 192**-0.5 * 1.2608**2  # DeepSeek-V2-Lite with YaRN (192**-0.5 * mscale**2)
_BLOCK = 64


def stub_attention(q: torch.Tensor, *_args, d_v: int = 512, out=None, **_kw):
    """A stand-in for the partial-attention kernels: ``o = 0 [B, H, d_v]`` in q's dtype and
    ``lse = 0 [B, H]`` float32 (a valid partial: one key of score 0, value 0). Given ``out``
    (the holder's output buffers, reused per batch shape: the kernels' ``out=``) it writes its
    zeros into a pair once and returns it: a stand-in that costs nothing per call, so that what
    is timed is the software around the kernel (the pair must be written by nothing else:
    :func:`stub_holder` stubs both kernels)."""
    if out is None:
        B, H = q.shape[0], q.shape[1]
        return q.new_zeros(B, H, d_v), torch.zeros(B, H, dtype=torch.float32, device=q.device)
    o, lse = out
    if getattr(o, "_stub_zeroed", None) is not lse:  # (a mark on the buffer: no dict, no call)
        o.zero_()
        lse.zero_()
        o._stub_zeroed = lse
    return o, lse


def chunk_kv(chunk_id: int, tokens: int, geometry: MLAGeometry) -> torch.Tensor:
    """The seeded cache of one benchmark chunk ``[L, tokens, d_qk]`` bf16 (entries N(0, 0.25))."""
    g = torch.Generator().manual_seed(1000 + chunk_id)
    shape = (geometry.layers, tokens, geometry.d_qk)
    return (0.5 * torch.randn(shape, generator=g)).to(torch.bfloat16)


def _make_holder(transport, geometry, chunk_id, tokens, stub, poll_s=0.2) -> Holder:
    h = Holder(
        transport,
        geometry,
        softmax_scale=SCALE,
        num_blocks=-(-tokens // _BLOCK),
        block_size=_BLOCK,
        poll_s=poll_s,
    )
    h.add_chunk(chunk_id, chunk_kv(chunk_id, tokens, geometry))
    if stub:
        stub_holder(h)
    return h


def stub_holder(holder: Holder) -> None:
    """Replace ``holder``'s partial-attention kernels by :func:`stub_attention`."""
    b = holder._batcher
    b.dense_kernel = b.sparse_kernel = stub_attention


class ReadyHolder:
    """The floor of any holder (what no holder's software can beat): each ``PROBE`` answered by its
    ack and each ``ROUTE`` by a ``PARTIAL`` packed once per ``(batch, heads)`` (``o = 0``,
    ``lse = 0``), the request's ids stamped in (:func:`mqnc.transport.wire.restamp`). It reads
    each request's header fields
    and nothing else: no checks, no batch, no kernel, no pack per call, no statistics. Its loop
    is the :class:`~mqnc.serving.Holder`'s (one thread waiting on every inbox, the last reply put
    with the next wait), so :meth:`Requester.route <mqnc.serving.Requester.route>` against it
    times what is left of a route whatever its holder does: the requester's own path and the
    engine's round trip with the route's bytes (``perf/bench_host``'s ``route*_ready`` cases).
    A benchmark's stand-in, not a server: a message it cannot answer (a fetch) gets an
    ``ERROR``, a requester gone misses its reply, and it stops once every requester is gone.

    Parameters
    ----------
    transport : Transport
        This holder's endpoint.
    geometry : MLAGeometry
        ``d_v`` of the replies.
    dtype : torch.dtype
        The replies' ``o`` dtype (the routed rows').
    poll_s : float
        Wait granularity (how often the loop checks for :meth:`stop`).
    """

    def __init__(
        self,
        transport,
        geometry: MLAGeometry,
        *,
        dtype: torch.dtype = torch.bfloat16,
        poll_s: float = 0.2,
    ) -> None:
        self.transport = transport
        self.geometry = geometry
        self.dtype = dtype
        self.poll_s = poll_s
        layout = transport.layout
        inboxes = [
            layout.slot(INBOX, src, lane)
            for src in range(layout.world_size)
            for lane in range(layout.lanes)
        ]
        self._targets = {s: 1 for s in inboxes}
        self._reply_to = {
            s: (layout.source_of(s), layout.slot(REPLY, transport.rank, layout.lane_of(s)))
            for s in inboxes
        }
        self._replies: dict[tuple[int, int], np.ndarray] = {}
        self._crc = not transport.in_process
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.served = 0

    def start(self) -> ReadyHolder:
        """Serve in a background thread until :meth:`stop` or a ``SHUTDOWN``."""
        self._thread = threading.Thread(target=self._run, daemon=True, name="ready-holder")
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.serve_forever()
        except BaseException as exc:  # recorded for the owner; the thread must not die silently
            self.failure = exc

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` or a ``SHUTDOWN`` (in the calling thread)."""
        tr, targets, deferred = self.transport, self._targets, None
        try:
            while not self._stop.is_set():
                put, deferred = deferred, None
                try:
                    if put is None:
                        ready = tr.wait_any(targets, self.poll_s)
                    else:
                        ready = tr.put_signal_wait(*put, targets, self.poll_s)
                except TransportTimeout:
                    continue
                except PeerLost:
                    if put is not None and not tr.peer_alive(put[0]):
                        continue  # only the requester of that reply is gone (as Holder._wait)
                    return  # every requester is gone
                for slot in ready:
                    if deferred is not None:
                        self._put(deferred)
                    signal, buf = tr.read_message_host(slot)
                    targets[slot] = signal + 1
                    deferred = self._answer(slot, buf)
        finally:
            if deferred is not None:
                self._put(deferred)

    def _put(self, reply: tuple) -> None:
        try:
            self.transport.put_signal(*reply)
        except TransportError:
            pass  # the requester is gone (as Holder._put)

    def _answer(self, slot: int, buf: np.ndarray) -> tuple | None:
        """``(peer, reply slot, reply, seq)`` for the request in ``buf`` (None: a shutdown)."""
        f = _HEADER.unpack_from(buf, 0)
        kind, rid, seq, batch, heads = f[2], f[5], f[6], f[8], f[9]
        peer, reply_slot = self._reply_to[slot]
        self.served += 1
        if kind == wire.Kind.PROBE:
            ack = wire.pack_probe(request_id=rid, seq=seq, ack=True, array=True)
            return peer, reply_slot, ack, seq
        if kind == wire.Kind.ROUTE:
            reply = self._replies.get((batch, heads))
            if reply is None:
                reply = self._replies[batch, heads] = self._partial(batch, heads)
            return peer, reply_slot, wire.restamp(reply, request_id=rid, seq=seq), seq
        if kind == wire.Kind.SHUTDOWN:
            self._stop.set()
            return None
        why = f"ready holder {self.transport.rank}: answers probes and routes only, got kind {kind}"
        return peer, reply_slot, wire.pack_error(why, request_id=rid, seq=seq, array=True), seq

    def _partial(self, batch: int, heads: int) -> np.ndarray:
        """The sealed ``PARTIAL`` of a ``[batch, heads]`` route (ids 0): ``o = 0``, ``(m, l) =
        (0, 1)`` (``lse = 0``)."""
        d_v, item = self.geometry.d_v, torch.empty((), dtype=self.dtype).element_size()
        return wire.pack_partial_arrays(
            np.zeros((batch, heads * d_v * item), dtype=np.uint8),
            np.zeros((batch, heads), dtype=np.float32),
            np.ones((batch, heads), dtype=np.float32),
            dtype=self.dtype, width=d_v, request_id=0, seq=0, chunk_id=0, layer=0,
            holder_ns=0, crc=self._crc, array=True,
        )  # fmt: skip


_HEADER = struct.Struct(wire.HEADER_FORMAT)  # the header's fields (ReadyHolder reads five)


class HolderFabric:
    """A requester (this process) and real holders on one transport.

    Parameters
    ----------
    transport : str
        ``"loopback"`` (holder threads) or ``"gloo"`` (holder subprocesses).
    holders : int
    chunk_tokens : int
        Tokens of each holder's chunk.
    max_rows : int
        Largest routed ``M_q`` (sizes the slots).
    stub_kernel : bool
        Holders answer with :func:`stub_attention` instead of the kernels.
    ready : bool
        Each holder is a :class:`ReadyHolder` (the floor of any holder: one reply per shape,
        no work per call; ``stub_kernel`` is then moot).
    model : str or MLAGeometry
        The geometry: a preset name, a Hugging Face ``config.json`` path, or the geometry.
    lanes : int
        Requests in flight per holder (threads sharing the requester, one lane each).
    timeout_s, start_timeout_s : float
        Bound on every reply wait; on standing the holders up.
    stamps : bool
        Gloo holder processes record the stage stamps of :mod:`mqnc.base.stamps` and hand
        them back at :meth:`close` (:attr:`holder_stamps`); loopback holders are threads of
        this process, whose stamps :func:`mqnc.base.stamps.enable` records directly.

    Attributes
    ----------
    requester : Requester
        Rank 0; every holder's chunk is in its directory.
    chunks : dict
        ``{chunk_id: holder rank}``.
    """

    def __init__(
        self,
        transport: str = "loopback",
        *,
        holders: int = 1,
        chunk_tokens: int = 64,
        max_rows: int = 256,
        stub_kernel: bool = True,
        ready: bool = False,
        model: str | MLAGeometry = "deepseek-v2-lite",
        lanes: int = 2,
        timeout_s: float = 60.0,
        start_timeout_s: float = 180.0,
        stamps: bool = False,
    ) -> None:
        if transport not in ("loopback", "gloo"):
            raise ValueError(f"transport: expected loopback or gloo, got {transport!r}")
        self.name = transport
        self.geometry = g = model if isinstance(model, MLAGeometry) else load_geometry(model)
        self.world = 1 + holders
        self.holder_ranks = list(range(1, self.world))
        self.chunks = {1 + i: r for i, r in enumerate(self.holder_ranks)}
        self.slot_bytes = slot_bytes_for(g, max_rows=max_rows, max_chunk_tokens=chunk_tokens)
        self._holders: list[Holder] = []
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self.holder_stamps: list[tuple[str, int]] = []
        self._stamp_dir = tempfile.mkdtemp(prefix="mqnc-stamps-") if stamps else None
        kw = dict(tokens=chunk_tokens, stub=stub_kernel)
        if transport == "loopback":
            fab = LoopbackFabric(self.world, self.slot_bytes, lanes=lanes)
            self.fabric = fab
            end = fab.endpoint(0)
            for cid, r in self.chunks.items():
                tr = fab.endpoint(r)
                h = ReadyHolder(tr, g) if ready else _make_holder(tr, g, cid, **kw)
                self._holders.append(h.start())
        else:
            end = self._start_gloo(lanes, chunk_tokens, stub_kernel, ready, start_timeout_s)
        self.requester = Requester(end, g, softmax_scale=SCALE, timeout_s=timeout_s)
        for cid, r in self.chunks.items():
            self.requester.register(ChunkInfo(cid, chunk_tokens, 0, (r,)))

    def _start_gloo(self, lanes, tokens, stub, ready, start_timeout_s):
        g = json.dumps(dataclasses.asdict(self.geometry))
        own = {}
        for cid, r in self.chunks.items():
            own[r] = [f"--chunk={cid}", f"--tokens={tokens}", f"--geometry={g}"]
            if stub:
                own[r].append("--stub")
            if ready:
                own[r].append("--ready")
            if self._stamp_dir:
                own[r].append(f"--stamps={os.path.join(self._stamp_dir, f'{r}.json')}")
        end, self._store, self._procs = start_gloo_ranks(
            "mqnc.measure.holders",
            own,
            world=self.world,
            slot_bytes=self.slot_bytes,
            lanes=lanes,
            start_timeout_s=start_timeout_s,
        )
        return end

    def close(self) -> None:
        """Shut the holders down (every requester's ``SHUTDOWN`` where one is needed)."""
        if self._closed:
            return
        self._closed = True
        for h in self._holders:
            h.stop()
        for r in self.holder_ranks if self._procs else []:
            try:
                self.requester.shutdown(r)
            except Exception:
                pass
        for p in self._procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if self._procs:
            self.requester.transport.close(timeout=2.0)
        if self._stamp_dir:
            for r in self.holder_ranks:
                path = os.path.join(self._stamp_dir, f"{r}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        self.holder_stamps += [tuple(x) for x in json.load(f)]
                    os.remove(path)
            os.rmdir(self._stamp_dir)

    def __enter__(self) -> HolderFabric:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(argv: list[str]) -> int:
    ap = rank_parser("python -m mqnc.measure.holders serve")
    ap.add_argument("--chunk", type=int, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--geometry", required=True, help="the MLAGeometry's fields as JSON")
    ap.add_argument("--stub", action="store_true")
    ap.add_argument("--ready", action="store_true", help="serve as a ReadyHolder")
    ap.add_argument("--stamps", default=None, help="record stage stamps into this JSON file")
    args = ap.parse_args(argv)
    from mqnc.base.runtime import use_interpreter_without_cuda

    use_interpreter_without_cuda()
    tr = connect_rank(args)
    g = MLAGeometry(**json.loads(args.geometry))
    if args.ready:
        h = ReadyHolder(tr, g)
    else:
        h = _make_holder(tr, g, args.chunk, args.tokens, args.stub)
    tr.barrier(args.start_timeout)
    if args.stamps:
        _stamps.enable()
    h.serve_forever()
    if args.stamps:
        with open(args.stamps, "w") as f:
            json.dump(_stamps.take(), f)
    tr.close(timeout=2.0)
    exit_process(0)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        raise SystemExit(_serve(sys.argv[2:]))
    print("usage: python -m mqnc.measure.holders serve --rank R --world W --port P ...")
    raise SystemExit(2)
