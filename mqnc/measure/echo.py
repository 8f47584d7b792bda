"""Stand up a requester and echo holders on a transport inside a benchmark (§3.1, §4.3, §6).

The transport benchmarks (``perf/bench_route``, ``bench_fetch``, ``bench_congestion``) and
``mqnc calibrate`` time what the paper times in §3.2: the *transport term* of a primitive, not
its compute. Rank 0 is the requester (this process); ranks ``1..M`` are **echo holders** that
answer each request with a reply of the size the request asks for:

- ``probe`` (``sig_rt``): a 1-byte put + signal, answered by a 1-byte put + signal;
- ``route`` (``full_rt``): ``M_q q`` bytes sent, ``M_q p`` bytes returned, both with signals
  (the holder runs no attention: the reply is a preallocated buffer of the partial's size);
- ``gather``: ``n`` int32 entry indices sent; the holder gathers those ``n`` rows
  (``index_select`` over a ``[rows, d_qk]`` pool, one layer) and returns them;
- ``chunk``: a contiguous chunk of ``c_t`` tokens x ``L`` layers returned from a preallocated
  buffer (fetch's coalesced bulk pull).

Every message goes through the package's own :class:`~mqnc.transport.Transport` protocol
(``put_signal`` into the peer's symmetric slot, ``wait_signal`` with a timeout), on the engine
chosen by name:

- ``loopback``: holders are threads of this process (:class:`~mqnc.transport.LoopbackFabric`);
- ``gloo``: holders are subprocesses (``python -m mqnc.measure.echo serve ...``) joined over
  ``torch.distributed`` gloo on 127.0.0.1 (``GLOO_SOCKET_IFNAME=lo``);
- ``nvshmem``: GPU only, through ``perf/gpu_check_nvshmem.py`` (two PEs); this harness reports
  it unavailable (:class:`Unavailable`) rather than guessing an engine that is not here.

Message layout of this echo protocol (not :mod:`mqnc.transport.wire`: the raw transport term
is what is timed): byte 0 is the op, bytes 8..16 a little-endian int64 (reply bytes, or gather
rows), gather indices follow from byte 16. A 1-byte message is a probe.

Everything here is host-side: record these timings with
:func:`mqnc.measure.timing.time_fn` ``(..., cuda=False)`` or
:func:`~mqnc.measure.timing.time_interleaved`.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import torch

from mqnc.base.checks import check_int
from mqnc.measure.options import TRANSPORTS
from mqnc.measure.ranks import connect_rank, rank_parser, start_gloo_ranks
from mqnc.model.geometry import MLAGeometry
from mqnc.transport import ENGINES, open_fabric
from mqnc.transport.protocol import INBOX, REPLY, PeerLost, Transport, TransportTimeout

PROCESS_ENGINES = ("gloo",)
"""The cross-process engines this harness starts holder ranks for
(:func:`mqnc.measure.ranks.start_gloo_ranks`); an in-process engine needs none."""

__all__ = [
    "TRANSPORTS",
    "Unavailable",
    "EchoHolder",
    "EchoFabric",
    "split_row_bytes",
    "host_extra",
    "OP_PROBE",
    "OP_ECHO",
    "OP_GATHER",
    "OP_CHUNK",
    "OP_STOP",
    "HDR",
]

OP_PROBE, OP_ECHO, OP_GATHER, OP_CHUNK, OP_STOP = 0, 1, 2, 3, 4
HDR = 16


class Unavailable(RuntimeError):
    """The requested transport cannot run on this machine (the message says why)."""


def split_row_bytes(qp_row_bytes: int, geometry: MLAGeometry) -> tuple[int, int]:
    """Split a payload-sweep row ``q + p`` into ``(q, p)`` in the geometry's proportion.

    Table 1 varies ``(q, p)`` together over a 10x span; with the real MLA row (2184 B) this
    returns the geometry's own ``(1152, 1032)``.
    """
    check_int("qp_row_bytes", qp_row_bytes, minimum=2)
    if qp_row_bytes == geometry.qp_row_bytes:
        return geometry.q_row_bytes, geometry.p_row_bytes
    q = round(qp_row_bytes * geometry.q_row_bytes / geometry.qp_row_bytes)
    return q, qp_row_bytes - q


# ---- the holder side ---------------------------------------------------------------------------


class EchoHolder:
    """Answer echo-protocol requests arriving from rank 0 on every lane (one thread per lane).

    Parameters
    ----------
    transport : Transport
        This holder's endpoint (rank >= 1).
    pool_rows : int
        Rows of the one-layer ``[pool_rows, d_qk]`` bf16 pool that ``gather`` reads (0: none).
    chunk_bytes : int
        Size of the preallocated chunk that ``chunk`` replies slice (0: none).
    d_qk : int
        Row width of the gather pool (576).
    poll_s : float
        Wait granularity (how often a lane thread checks for ``stop``).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        pool_rows: int = 0,
        chunk_bytes: int = 0,
        d_qk: int = 576,
        poll_s: float = 0.2,
    ) -> None:
        self.transport = transport
        self.poll_s = poll_s
        g = torch.Generator().manual_seed(1234 + transport.rank)
        self.reply = torch.randint(0, 256, (transport.slot_bytes,), dtype=torch.uint8, generator=g)
        self.pool = (
            torch.randn(pool_rows, d_qk, generator=g).to(torch.bfloat16) if pool_rows else None
        )
        self.chunk = (
            torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=g)
            if chunk_bytes
            else None
        )
        self.stop_event = threading.Event()
        self.failure: BaseException | None = None
        self.served = 0
        self._threads: list[threading.Thread] = []

    def start(self) -> EchoHolder:
        for lane in range(self.transport.layout.lanes):
            t = threading.Thread(target=self._lane, args=(lane,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def join(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def stop(self, timeout: float = 30.0) -> None:
        self.stop_event.set()
        self.join(timeout)

    def _lane(self, lane: int) -> None:
        tr = self.transport
        inbox = tr.layout.slot(INBOX, 0, lane)
        reply_slot = tr.layout.slot(REPLY, tr.rank, lane)
        seq, answer = 0, None
        try:
            while not self.stop_event.is_set():
                try:
                    if answer is None:
                        tr.wait_signal(inbox, seq + 1, self.poll_s)
                    else:  # the last answer goes out with this wait (put + wait, fused)
                        tr.put_signal_wait(
                            0, reply_slot, answer, seq, {inbox: seq + 1}, self.poll_s
                        )
                        answer = None
                except TransportTimeout:
                    continue
                except PeerLost:
                    return
                seq += 1
                answer = self._answer(inbox, tr.read(inbox, HDR))
                self.served += 1
                if self.stop_event.is_set():
                    tr.put_signal(0, reply_slot, answer, seq)
        except BaseException as exc:  # recorded for the owner; the thread must not die silently
            self.failure = exc
            self.stop_event.set()

    def _answer(self, inbox: int, hdr: torch.Tensor) -> torch.Tensor:
        op = int(hdr[0])
        n = int(hdr[8:16].view(torch.int64)[0])
        if op == OP_PROBE:
            return self.reply[:1]
        if op == OP_ECHO:
            return self.reply[:n]
        if op == OP_GATHER:
            if self.pool is None:
                raise ValueError(f"echo holder {self.transport.rank}: gather without a pool")
            raw = self.transport.read(inbox, HDR + 4 * n)
            idx = raw[HDR:].view(torch.int32).to(torch.int64)
            return self.pool.index_select(0, idx).view(torch.uint8).reshape(-1)
        if op == OP_CHUNK:
            if self.chunk is None or n > self.chunk.numel():
                raise ValueError(f"echo holder {self.transport.rank}: chunk of {n} B not held")
            return self.chunk[:n]
        if op == OP_STOP:
            self.stop_event.set()
            return self.reply[:1]
        raise ValueError(f"echo holder {self.transport.rank}: unknown op {op}")


# ---- the requester side ------------------------------------------------------------------------


class EchoFabric:
    """Rank 0 (the requester: this process) and ``holders`` echo holders on one transport.

    Parameters
    ----------
    transport : str
        ``"loopback"`` (holder threads), ``"gloo"`` (holder subprocesses over torch.distributed)
        or ``"nvshmem"`` (raises :class:`Unavailable`: see the module docstring).
    holders : int
        Echo holders (ranks ``1..holders``).
    lanes : int
        Independent request slots per holder (concurrent flows, one per lane).
    slot_bytes : int
        Largest message either way (request or reply), bytes.
    pool_rows : int
        Rows of each holder's gather pool (``[pool_rows, 576]`` bf16, one layer).
    chunk_bytes : int
        Size of each holder's contiguous chunk (fetch's bulk pull).
    timeout_s : float
        Bound on every reply wait.
    start_timeout_s : float
        Bound on standing the holders up (process start and rendezvous for gloo).

    Use as a context manager; :meth:`close` stops the holders.
    """

    def __init__(
        self,
        transport: str = "loopback",
        *,
        holders: int = 1,
        lanes: int = 1,
        slot_bytes: int,
        pool_rows: int = 0,
        chunk_bytes: int = 0,
        timeout_s: float = 60.0,
        start_timeout_s: float = 180.0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
        check_int("holders", holders, minimum=1)
        spec = ENGINES[transport]
        if not (spec.in_process or transport in PROCESS_ENGINES):
            if spec.needs_gpu and not torch.cuda.is_available():
                why = "no CUDA device on this machine"
            elif spec.needs_gpu:
                why = "its route benchmark is perf/gpu_check_nvshmem.py (two PEs, device waits)"
            else:
                why = "mqnc.measure.ranks starts no ranks of it"
            raise Unavailable(
                f"transport {transport}: {why}; this host harness drives the in-process engines "
                f"and {', '.join(PROCESS_ENGINES)} only"
            )
        self.name = transport
        self.world = 1 + holders
        self.holders = list(range(1, self.world))
        self.lanes = lanes
        self.slot_bytes = int(max(slot_bytes, HDR + 4096))
        self.timeout_s = float(timeout_s)
        self._seq: dict[tuple[int, int], int] = {}
        self._payload = torch.randint(0, 256, (self.slot_bytes,), dtype=torch.uint8)
        # Preallocated like every timed route message (a fresh tensor per probe read ~25 us
        # slower here than the 1-row route).
        self._probe_msg = torch.zeros(1, dtype=torch.uint8)
        self._holder_objs: list[EchoHolder] = []
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        kw = dict(pool_rows=pool_rows, chunk_bytes=chunk_bytes)
        if ENGINES[transport].in_process:
            fab = open_fabric(transport, self.world, slot_bytes=self.slot_bytes, lanes=lanes)
            self.transport: Transport = fab.endpoint(0)
            self._holder_objs = [EchoHolder(fab.endpoint(r), **kw).start() for r in self.holders]
        else:
            self._start_gloo(start_timeout_s, **kw)

    def _start_gloo(self, start_timeout_s: float, *, pool_rows: int, chunk_bytes: int) -> None:
        """Holder subprocesses (``python -m mqnc.measure.echo serve``) and this rank's engine."""
        own = [f"--pool-rows={pool_rows}", f"--chunk-bytes={chunk_bytes}"]
        self.transport, self._store, self._procs = start_gloo_ranks(
            "mqnc.measure.echo",
            dict.fromkeys(self.holders, own),
            world=self.world,
            slot_bytes=self.slot_bytes,
            lanes=self.lanes,
            start_timeout_s=start_timeout_s,
        )

    # ---- messages -----------------------------------------------------------------------------
    def message(self, op: int, nbytes: int, n: int = 0, indices: torch.Tensor | None = None):
        """A request of ``nbytes`` bytes (payload: random bytes) with op and count ``n``."""
        if op == OP_PROBE:
            return torch.zeros(1, dtype=torch.uint8)
        if indices is not None:
            nbytes = max(nbytes, HDR + 4 * indices.numel())
        nbytes = max(int(nbytes), HDR)
        if nbytes > self.slot_bytes:
            raise ValueError(f"nbytes: {nbytes} B does not fit a slot of {self.slot_bytes} B")
        msg = self._payload[:nbytes].clone()
        msg[0] = op
        msg[8:16] = torch.tensor([int(n)], dtype=torch.int64).view(torch.uint8)
        if indices is not None:
            msg[HDR : HDR + 4 * indices.numel()] = indices.to(torch.int32).view(torch.uint8)
        return msg

    def route_message(self, m_q: int, q_row_bytes: int, p_row_bytes: int) -> torch.Tensor:
        """``route``: ``m_q`` query rows out, ``m_q`` partial rows back."""
        if m_q * p_row_bytes > self.slot_bytes:
            raise ValueError(f"m_q: a reply of {m_q * p_row_bytes} B does not fit the slot")
        return self.message(OP_ECHO, m_q * q_row_bytes, m_q * p_row_bytes)

    # ---- requests -----------------------------------------------------------------------------
    def send(self, peer: int, msg: torch.Tensor, lane: int = 0) -> tuple[int, int, int]:
        """Put ``msg`` into holder ``peer``'s inbox (lane ``lane``) with its signal."""
        key = (peer, lane)
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        tr = self.transport
        tr.put_signal(peer, tr.layout.slot(INBOX, 0, lane), msg, seq)
        return peer, tr.layout.slot(REPLY, peer, lane), seq

    def wait(self, pending: tuple[int, int, int]) -> None:
        """Wait for the reply to a :meth:`send` (raises with the holder's failure, if any)."""
        peer, slot, seq = pending
        try:
            self.transport.wait_signal(slot, seq, self.timeout_s)
        except TransportTimeout as exc:
            why = ""
            if self._holder_objs and self._holder_objs[peer - 1].failure is not None:
                why = f" (holder failed: {self._holder_objs[peer - 1].failure!r})"
            raise TransportTimeout(f"echo fabric: no reply from holder {peer}{why}") from exc

    def round_trip(self, peer: int, msg: torch.Tensor, lane: int = 0) -> None:
        """Send ``msg`` to ``peer`` and wait for the reply (the put and the wait fused,
        ``Transport.put_signal_wait``, as the requester does)."""
        key = (peer, lane)
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        tr = self.transport
        reply = tr.layout.slot(REPLY, peer, lane)
        try:
            tr.put_signal_wait(
                peer, tr.layout.slot(INBOX, 0, lane), msg, seq, {reply: seq}, self.timeout_s
            )
        except TransportTimeout:
            self.wait((peer, reply, seq))  # raises with the holder's failure, if any

    def probe(self, peer: int = 1, lane: int = 0) -> None:
        """``sig_rt``: a 1-byte put + signal answered by a 1-byte put + signal."""
        self.round_trip(peer, self._probe_msg, lane)

    # ---- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in self.holders:
            try:
                self.round_trip(peer, self.message(OP_STOP, HDR), 0)
            except Exception:
                pass
        for h in self._holder_objs:
            h.stop()
        deadline = time.monotonic() + 30
        for p in self._procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if self._procs:
            self.transport.close(timeout=2.0)

    def __enter__(self) -> EchoFabric:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def host_extra(fabric: EchoFabric, **extra) -> dict:
    """``extra`` of a transport record: what ran where (host-side echo holders)."""
    return {"holders": len(fabric.holders), "lanes": fabric.lanes, "host_side": True, **extra}


# ---- holder processes (gloo) -------------------------------------------------------------------


def _serve(argv: list[str]) -> int:
    ap = rank_parser("python -m mqnc.measure.echo serve")
    ap.add_argument("--pool-rows", type=int, default=0)
    ap.add_argument("--chunk-bytes", type=int, default=0)
    args = ap.parse_args(argv)
    tr = connect_rank(args)
    holder = EchoHolder(tr, pool_rows=args.pool_rows, chunk_bytes=args.chunk_bytes).start()
    tr.barrier(args.start_timeout)
    while not holder.stop_event.wait(0.5):
        if not tr.peer_alive(0):
            break
    holder.stop()
    tr.close(timeout=2.0)
    if holder.failure is not None:
        print(f"echo holder {args.rank}: {holder.failure!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        raise SystemExit(_serve(sys.argv[2:]))
    print("usage: python -m mqnc.measure.echo serve --rank R --world W --port P --slot-bytes N")
    raise SystemExit(2)
