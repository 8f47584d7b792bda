"""TP holder ranks as processes over gloo, and the requester ranks that pair with them (§8):
what ``correctness/test_tp.py`` and ``perf/bench_tp.py`` run on a CPU.

``python -m mqnc.serving.tp_process SPEC``, ``SPEC`` a JSON object: ``port`` (the rendezvous
``TCPStore`` on 127.0.0.1), ``world`` (all ranks of all instances), ``rank`` (this process's
global rank: holder instance ``i``'s rank ``r`` is ``i N + r``), ``degree`` (``N``),
``geometry`` (:class:`~mqnc.model.MLAGeometry`'s fields), ``chunks`` (a ``torch.save`` file of
``{chunk_id: full chunk [L, c_t, d_qk]}``: each rank keeps its columns), ``scale``, ``dtype``,
``kernels``, ``slot_bytes``, ``num_blocks``, ``block_size``, ``timeout_s``. The process serves
until the store holds ``tp/stop``, then leaves through ``os._exit`` (as
:mod:`mqnc.serving.holder_process`: gloo's groups must not be destroyed at interpreter exit).

:class:`TPCluster` is the launching side: it starts the holder processes of instances
``1 .. I - 1`` and gives this process's threads the requester ranks of instance 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import torch

from mqnc.model.geometry import MLAGeometry
from mqnc.serving.holder_process import run_then_exit
from mqnc.serving.tp_group import GlooGroup, TPPartition
from mqnc.serving.tp_holder import TPHolder
from mqnc.serving.tp_requester import TPRequester

__all__ = ["TPCluster", "serve_rank", "main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _connect(spec: dict, rank: int):
    """This rank's transport and a client of the rendezvous store."""
    import datetime

    import torch.distributed as dist

    from mqnc.transport.torchdist import TorchDistTransport

    store = dist.TCPStore(
        "127.0.0.1", spec["port"], spec["world"], is_master=False,
        timeout=datetime.timedelta(seconds=spec["timeout_s"]),
    )  # fmt: skip
    tr = TorchDistTransport(
        rank, spec["world"], store, slot_bytes=spec["slot_bytes"], host="127.0.0.1",
        agree={"tp_degree": spec["degree"]}, connect_timeout_s=spec["timeout_s"],
    )  # fmt: skip
    return tr, store


def serve_rank(spec: dict) -> None:
    """Serve one holder rank described by ``spec`` (see the module docstring) until stopped."""
    n, rank = spec["degree"], spec["rank"]
    part = TPPartition(MLAGeometry(**spec["geometry"]), n)
    tr, store = _connect(spec, rank)
    group = GlooGroup(
        rank % n, n, store, prefix=f"tp-group/{rank // n}", timeout_s=spec["timeout_s"]
    )
    dtype = _DTYPES[spec["dtype"]]
    holder = TPHolder(
        tr, group, part, softmax_scale=spec["scale"], num_blocks=spec["num_blocks"],
        block_size=spec["block_size"], dtype=dtype, kernels=spec["kernels"],
        pair_timeout_s=spec["timeout_s"],
    )  # fmt: skip
    chunks = torch.load(spec["chunks"], weights_only=True)
    for cid, kv in chunks.items():
        holder.add_chunk(int(cid), part.slice(kv.to(dtype), rank % n))
    store.set(f"tp/ready/{rank}", "1")
    while not store.check(["tp/stop"]):
        holder.step(holder.poll_s)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m mqnc.serving.tp_process SPEC_JSON")
    torch.set_num_threads(1)  # torch's spinning intra-op workers starve gloo's receive threads
    run_then_exit(lambda: serve_rank(json.loads(argv[0])))


class TPCluster:
    """Instance 0's ``N`` requester ranks in this process (one transport each) and holder
    instances ``1 .. instances - 1`` as ``N`` processes each, over gloo on 127.0.0.1.

    Parameters
    ----------
    partition : TPPartition
    chunks : dict
        ``{chunk_id: full chunk [L, c_t, d_qk]}`` every holder instance hosts (its ranks keep
        their columns).
    workdir : str
        Where the chunk file is written.
    """

    def __init__(
        self,
        partition: TPPartition,
        chunks: dict,
        workdir: str,
        *,
        instances: int = 2,
        scale: float,
        dtype: str = "bf16",
        kernels: str = "torch",
        slot_bytes: int,
        num_blocks: int = 16,
        block_size: int = 16,
        timeout_s: float = 20.0,
    ) -> None:
        from mqnc.transport.torchdist import free_port_store

        self.partition, n = partition, partition.degree
        self.world = instances * n
        path = os.path.join(workdir, "tp_chunks.pt")
        torch.save(chunks, path)
        self.store = free_port_store(self.world + 1, timeout_s=timeout_s)
        g = partition.geometry
        fields = ("name", "d_c", "d_r", "heads", "layers", "cache_dtype", "wire_dtype")
        spec = dict(
            port=self.store.port, world=self.world, degree=n, chunks=path, scale=scale,
            dtype=dtype, kernels=kernels, slot_bytes=slot_bytes, num_blocks=num_blocks,
            block_size=block_size, timeout_s=timeout_s,
            geometry={f: getattr(g, f) for f in fields},
        )  # fmt: skip
        self.spec = spec
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
        self.procs = {
            r: subprocess.Popen(
                [sys.executable, "-m", "mqnc.serving.tp_process", json.dumps({**spec, "rank": r})],
                env=env,
            )
            for r in range(n, self.world)
        }
        self.requesters: list[TPRequester | None] = [None] * n
        errors: list[BaseException] = []

        def join(r: int) -> None:
            try:
                tr, _ = _connect(spec, r)
                self.requesters[r] = TPRequester(
                    tr, partition, dtype=_DTYPES[dtype], timeout_s=timeout_s
                )
            except BaseException as exc:  # noqa: BLE001 - raised below
                errors.append(exc)

        threads = [threading.Thread(target=join, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.close()
            raise errors[0]
        self.store.wait([f"tp/ready/{r}" for r in range(n, self.world)])

    def route_all(self, instance: int, chunk_id: int, q: torch.Tensor, layer: int, indices=None):
        """Every requester rank routes its slice of ``q [B, H, d_qk]`` at once (one thread
        each); returns ``[(o_r, lse_r) or the exception, per rank]``."""
        out: list = [None] * self.partition.degree

        def go(r: int) -> None:
            try:
                q_r = self.partition.slice(q, r)
                out[r] = self.requesters[r].route(instance, chunk_id, q_r, layer, indices)
            except BaseException as exc:  # noqa: BLE001 - returned to the caller
                out[r] = exc

        threads = [threading.Thread(target=go, args=(r,)) for r in range(self.partition.degree)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def kill(self, rank: int) -> None:
        """Kill holder process ``rank`` (global) at once (SIGKILL)."""
        p = self.procs[rank]
        p.kill()
        p.wait(timeout=30)

    def close(self) -> None:
        """Stop the holders (bounded), then the requester transports."""
        self.store.set("tp/stop", "1")
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for req in self.requesters:
            if req is not None:
                req.transport.close(timeout=2.0)


if __name__ == "__main__":
    main(sys.argv[1:])
