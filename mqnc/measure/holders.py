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
import subprocess
import sys
import tempfile

import torch

from mqnc.base import stamps as _stamps
from mqnc.measure.ranks import connect_rank, exit_process, rank_parser, start_gloo_ranks
from mqnc.model.geometry import MLAGeometry, load_geometry
from mqnc.serving import ChunkInfo, Holder, Requester
from mqnc.transport import LoopbackFabric, slot_bytes_for

__all__ = ["HolderFabric", "stub_attention", "SCALE"]

SCALE = 192**-0.5 * 1.2608**2  # DeepSeek-V2-Lite with YaRN (192**-0.5 * mscale**2)
_BLOCK = 64


def stub_attention(q: torch.Tensor, *_args, d_v: int = 512, **_kw):
    """A stand-in for the partial-attention kernels: ``o = 0 [B, H, d_v]`` in q's dtype and
    ``lse = 0 [B, H]`` float32 (a valid partial: one key of score 0, value 0)."""
    B, H = q.shape[0], q.shape[1]
    return q.new_zeros(B, H, d_v), torch.zeros(B, H, dtype=torch.float32, device=q.device)


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
                self._holders.append(_make_holder(fab.endpoint(r), g, cid, **kw).start())
        else:
            end = self._start_gloo(lanes, chunk_tokens, stub_kernel, start_timeout_s)
        self.requester = Requester(end, g, softmax_scale=SCALE, timeout_s=timeout_s)
        for cid, r in self.chunks.items():
            self.requester.register(ChunkInfo(cid, chunk_tokens, 0, (r,)))

    def _start_gloo(self, lanes, tokens, stub, start_timeout_s):
        g = json.dumps(dataclasses.asdict(self.geometry))
        own = {}
        for cid, r in self.chunks.items():
            own[r] = [f"--chunk={cid}", f"--tokens={tokens}", f"--geometry={g}"]
            if stub:
                own[r].append("--stub")
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
    ap.add_argument("--stamps", default=None, help="record stage stamps into this JSON file")
    args = ap.parse_args(argv)
    from mqnc.base.runtime import use_interpreter_without_cuda

    use_interpreter_without_cuda()
    tr = connect_rank(args)
    g = MLAGeometry(**json.loads(args.geometry))
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
