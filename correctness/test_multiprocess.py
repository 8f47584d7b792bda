"""Exactness across processes: a corpus partitioned over holder processes
(gloo), queries routed to every holder and merged, equal the single-instance result.

The pytest process is the requester (rank 0); holders are subprocesses running this file as a
script (``python test_multiprocess.py holder ...``), each regenerating its chunks from a seed,
so that no tensor is pickled between processes. Small shapes (2 layers, 4 heads, chunks of
<= 128 tokens) keep the interpreter runs short; the row width is the production 576 = 512 + 64.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest
import torch

from mqnc.model import PRESETS
from mqnc.testing import default_device

GEOM = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=4)
SCALE = 192**-0.5 * 1.2608**2  # DeepSeek-V2-Lite with YaRN (§3.1 of DESIGN.md)
BLOCK = 64
DTYPE = torch.bfloat16


def corpus_chunk(chunk_id: int, seed: int, tokens: int) -> torch.Tensor:
    """The canonical cache of one chunk, ``[L, tokens, 576]`` bf16, from (seed, chunk_id).

    Entries are N(0, 0.25): with the DeepSeek scale the softmax spreads over many entries,
    so |o| stays < 0.25, the premise of the routed bf16 bound (mqnc.testing, mla_routed).
    """
    g = torch.Generator().manual_seed(seed * 100_003 + chunk_id)
    return (0.5 * torch.randn(GEOM.layers, tokens, GEOM.d_qk, generator=g)).to(DTYPE)


def slot_bytes(max_rows: int = 64, max_chunk_tokens: int = 128) -> int:
    from mqnc.transport import slot_bytes_for

    return slot_bytes_for(GEOM, max_rows=max_rows, max_topk=64, max_chunk_tokens=max_chunk_tokens)


def spawn_holder(
    rank: int,
    world: int,
    port: int,
    chunks: dict[int, int],
    *,
    seed: int,
    lanes: int = 2,
    kernels: str = "triton",
) -> subprocess.Popen:
    """Start a holder process hosting ``chunks`` ({chunk_id: tokens}), computing its partials
    with ``kernels``."""
    spec = ",".join(f"{c}:{t}" for c, t in chunks.items())
    env = dict(
        os.environ,
        GLOO_SOCKET_IFNAME="lo",
        PYTHONUNBUFFERED="1",
        TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"),
    )
    return subprocess.Popen(
        [
            sys.executable,
            __file__,
            "holder",
            "--rank",
            str(rank),
            "--world",
            str(world),
            "--port",
            str(port),
            "--chunks",
            spec,
            "--seed",
            str(seed),
            "--lanes",
            str(lanes),
            "--kernels",
            kernels,
        ],
        env=env,
    )


class Cluster:
    """Rank 0 (this process, the requester) plus holder subprocesses over gloo."""

    def __init__(
        self,
        placement: dict[int, dict[int, int]],
        *,
        seed: int,
        timeout_s: float,
        lanes: int = 2,
        kernels: str = "triton",
    ) -> None:
        from mqnc.serving import ChunkInfo, Requester
        from mqnc.transport.torchdist import TorchDistTransport, free_port_store

        self.world = 1 + len(placement)
        self.store = free_port_store(self.world)
        self.procs = {
            r: spawn_holder(
                r, self.world, self.store.port, ch, seed=seed, lanes=lanes, kernels=kernels
            )  # fmt: skip
            for r, ch in placement.items()
        }
        self.transport = TorchDistTransport(
            0, self.world, self.store, slot_bytes=slot_bytes(), lanes=lanes, idle_timeout_s=600
        )
        self.transport.barrier(120.0)
        self.requester = Requester(
            self.transport,
            GEOM,
            softmax_scale=SCALE,
            timeout_s=timeout_s,
            pool_blocks=16,
            block_size=BLOCK,
        )
        holders: dict[int, list[int]] = {}
        tokens: dict[int, int] = {}
        for r, ch in placement.items():
            for c, t in ch.items():
                holders.setdefault(c, []).append(r)
                tokens[c] = t
        for c in sorted(holders):
            self.requester.register(ChunkInfo(c, tokens[c], 0, tuple(holders[c])))
        self.tokens = tokens
        self.seed = seed

    def close(self) -> None:
        for r, p in self.procs.items():
            if p.poll() is None and self.transport.peer_alive(r):
                try:
                    self.requester.shutdown(r)
                except Exception:
                    pass
        deadline = time.monotonic() + 20
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.transport.close(timeout=2.0)


def _union_reference(
    chunks: list[torch.Tensor],
    q: torch.Tensor,
    layer: int,
    indices: list[torch.Tensor] | None = None,
):
    """fp64 reference and one local kernel call over the union of the chunks."""
    from mqnc.reference import mla_decode_reference, mla_sparse_reference
    from mqnc.triton_kernels import mla_decode_partial, mla_sparse_partial

    B = q.shape[0]
    # One pool holding every chunk, each padded to whole blocks, as a single instance has it.
    blocks, table, offsets, nb = [], [], [], 0
    for kv in chunks:
        t = kv.shape[1]
        n = -(-t // BLOCK)
        pad = torch.zeros(n * BLOCK, GEOM.d_qk, dtype=DTYPE)
        pad[:t] = kv[layer]
        blocks.append(pad.view(n, BLOCK, GEOM.d_qk))
        offsets.append(nb * BLOCK)
        table += list(range(nb, nb + n))
        nb += n
    pool = torch.cat(blocks)
    if indices is None:
        # The union as one contiguous key set: gather the valid tokens into a dense pool.
        flat = torch.cat([kv[layer] for kv in chunks])
        total = flat.shape[0]
        n = -(-total // BLOCK)
        dense = torch.zeros(n * BLOCK, GEOM.d_qk, dtype=DTYPE)
        dense[:total] = flat
        dense = dense.view(n, BLOCK, GEOM.d_qk)
        bt = torch.arange(n, dtype=torch.int32)[None].expand(B, -1).contiguous()
        lens = torch.full((B,), total, dtype=torch.int32)
        ref = mla_decode_reference(q, dense, bt, lens, SCALE)
        on = [x.to(default_device()) for x in (q, dense, bt, lens)]  # where the kernels run
        one = mla_decode_partial(*on, softmax_scale=SCALE)
        return ref, one
    idx = torch.cat(
        [
            torch.where(i >= 0, i + off, torch.full_like(i, -1))
            for i, off in zip(indices, offsets, strict=True)
        ],
        dim=1,
    ).to(torch.int32)
    ref = mla_sparse_reference(q, pool, idx, SCALE)
    on = [x.to(default_device()) for x in (q, pool, idx)]
    one = mla_sparse_partial(*on, softmax_scale=SCALE)
    return ref, one


def _check(o, lse, ref, one, label):
    from mqnc.testing import TOLERANCES, assert_close

    o_ref, lse_ref = ref
    assert float(o_ref.abs().max()) < 0.25, "premise of the routed bf16 bound (|o| < 0.25)"
    s1 = assert_close(o, o_ref, TOLERANCES[("mla", "bfloat16")], name=f"{label} o vs fp64")
    s2 = assert_close(lse, lse_ref, TOLERANCES[("mla_lse", "float32")], name=f"{label} lse")
    s3 = assert_close(
        o, one[0], TOLERANCES[("route_wire", "bfloat16")], name=f"{label} routed vs one call"
    )
    print(f"{label}: o vs fp64 {s1}; lse {s2}; routed vs one call {s3}")
    return s1, s2, s3


@pytest.fixture(scope="module")
def cluster():
    # 4 holder processes, one chunk each (different lengths, partial last blocks).
    placement = {1: {11: 96}, 2: {12: 64}, 3: {13: 50}, 4: {14: 128}}
    c = Cluster(placement, seed=7, timeout_s=60.0)
    yield c
    c.close()


def test_routed_dense_equals_single_instance(cluster):
    """Dense: route the same batch to all 4 holders, merge, compare with one instance."""
    req = cluster.requester
    g = torch.Generator().manual_seed(1)
    chunks = [corpus_chunk(c, cluster.seed, cluster.tokens[c]) for c in sorted(cluster.tokens)]
    for layer in range(GEOM.layers):
        q = (0.5 * torch.randn(3, GEOM.heads, GEOM.d_qk, generator=g)).to(DTYPE)
        o, lse = req.route_many(
            [dict(chunk_id=c, q=q, layer=layer) for c in sorted(cluster.tokens)]
        )
        _check(o, lse, *_union_reference(chunks, q, layer), label=f"dense layer {layer}")
    rec = [c for c in req.costs if c.primitive == "route"]
    assert len(rec) == 2 * 4 and all(r.ok and r.compute_us > 0 and r.merge_us > 0 for r in rec)


def test_routed_sparse_equals_single_instance(cluster):
    """Selection (§5.4): each holder attends its chunk-local top-k; merged = one sparse call."""
    req = cluster.requester
    g = torch.Generator().manual_seed(2)
    ids = sorted(cluster.tokens)
    chunks = [corpus_chunk(c, cluster.seed, cluster.tokens[c]) for c in ids]
    B, topk = 2, 40
    q = (0.5 * torch.randn(B, GEOM.heads, GEOM.d_qk, generator=g)).to(DTYPE)
    indices = []
    for c in ids:
        idx = torch.stack([torch.randperm(cluster.tokens[c], generator=g)[:topk] for _ in range(B)])
        idx[0, -3:] = -1  # unused slots
        indices.append(idx.to(torch.int32))
    o, lse = req.route_many(
        [dict(chunk_id=c, q=q, layer=1, indices=i) for c, i in zip(ids, indices, strict=True)]
    )
    _check(o, lse, *_union_reference(chunks, q, 1, indices), label="sparse")


def test_probe_and_cost_samples_fit(cluster):
    """Probes round-trip; route records at two batch sizes feed the cost model's fit (§4.3)."""
    from mqnc.cost import fit

    req = cluster.requester
    for peer in (1, 4):
        assert req.probe(peer) > 0
    g = torch.Generator().manual_seed(3)
    for B in (1, 4):
        q = torch.randn(B, GEOM.heads, GEOM.d_qk, generator=g).to(DTYPE)
        part = req.route(12, q, 0)
        assert part.record.m_q == B * GEOM.heads and part.record.bytes_sent == (
            96 + B * GEOM.heads * GEOM.q_row_bytes
        )
        assert part.record.bytes_recv == 96 + B * GEOM.heads * GEOM.p_row_bytes
    samples = req.cost_samples("route")
    res = fit(samples, qp_row_bytes=GEOM.qp_row_bytes, probe_us=req.last_probe_us[1])
    assert res.n_points == len(samples) and res.probe_measured


# ---- worker processes (run as a script) --------------------------------------------------------


def _holder_main(args) -> None:
    from mqnc.serving import Holder
    from mqnc.transport.torchdist import TorchDistTransport

    t = TorchDistTransport.connect(
        args.rank,
        args.world,
        args.port,
        slot_bytes=slot_bytes(),
        lanes=args.lanes,
        idle_timeout_s=600,
    )
    chunks = {int(a): int(b) for a, b in (x.split(":") for x in args.chunks.split(","))}
    need = sum(-(-n // BLOCK) for n in chunks.values())
    h = Holder(t, GEOM, softmax_scale=SCALE, num_blocks=max(need, 1), block_size=BLOCK, poll_s=0.2,
               kernels=args.kernels)  # fmt: skip
    for c, n in chunks.items():
        h.add_chunk(c, corpus_chunk(c, args.seed, n))
    t.barrier(120.0)
    h.serve_forever()
    t.close(timeout=2.0)
    os._exit(0)  # no gloo destructor under a service thread still blocked in recv


def _echo_main(args) -> None:
    from mqnc.transport import INBOX, REPLY
    from mqnc.transport.torchdist import TorchDistTransport

    t = TorchDistTransport.connect(
        args.rank, args.world, args.port, slot_bytes=4096, lanes=1, idle_timeout_s=120
    )
    t.barrier(60.0)
    inbox, reply = t.layout.slot(INBOX, 0), t.layout.slot(REPLY, args.rank)
    seq = 0
    while True:
        seq = t.wait_signal(inbox, seq + 1, timeout=60.0)
        if seq >= 100:
            os._exit(1)  # die abruptly, as a crashed holder would
        t.put_signal(0, reply, t.read(inbox), seq)


if __name__ == "__main__":
    from mqnc.base.runtime import use_interpreter_without_cuda

    use_interpreter_without_cuda()
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["holder", "echo"])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunks", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lanes", type=int, default=2)
    p.add_argument("--kernels", choices=["triton", "torch"], default="triton")
    a = p.parse_args()
    _holder_main(a) if a.role == "holder" else _echo_main(a)
