"""The demo's instances: one requester (rank 0, this process) and ``holders`` holders, as
threads over the in-process loopback or as processes over gloo (NVSHMEM PEs on a GPU), each
holder serving its share of the canonical corpus (§3.1, §6)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os

import torch
from torch.distributed import TCPStore

from mqnc.demo.config import LANES, REQUESTER, DemoConfig
from mqnc.demo.workload import Corpus, build_model
from mqnc.model import MLAGeometry, MLAModel
from mqnc.serving import Holder, Requester
from mqnc.transport import (
    LoopbackFabric,
    NvshmemTransport,
    TorchDistTransport,
    Transport,
    free_port_store,
    slot_bytes_for,
)

__all__ = ["device_of", "Cluster"]


def device_of(cfg: DemoConfig) -> str:
    """Where pools and kernels live: the GPU when there is one (compiled kernels), else the CPU
    (the interpreter)."""
    return cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _slot_bytes(cfg: DemoConfig, geometry: MLAGeometry) -> int:
    return slot_bytes_for(
        geometry,
        max_rows=max(cfg.agents, 16) * geometry.heads,
        max_topk=cfg.topk,
        max_batch=max(cfg.agents, 16),
        max_chunk_tokens=cfg.max_tokens,
    )


def _process_transport(cfg: DemoConfig, rank: int, world: int, store, geometry) -> Transport:
    """This rank's engine for a multi-process run: gloo, or NVSHMEM (GPU only; several PEs
    may share one GPU in NVSHMEM's limited multi-process mode)."""
    slot_bytes = _slot_bytes(cfg, geometry)
    if cfg.transport == "nvshmem":
        return NvshmemTransport(rank, world, store, slot_bytes=slot_bytes, lanes=LANES, device=0)
    return TorchDistTransport(rank, world, store, slot_bytes=slot_bytes, lanes=LANES)


def _make_holder(cfg: DemoConfig, transport: Transport, model: MLAModel, corpus: Corpus) -> Holder:
    """A holder with the chunks placed on its rank, at their canonical positions."""
    mine = [c for c, hs in corpus.placement().items() if transport.rank in hs]
    blocks = sum(-(-corpus.lengths[c] // cfg.block_size) for c in mine) + 1
    holder = Holder(
        transport,
        model.geometry,
        softmax_scale=model.softmax_scale,
        num_blocks=blocks,
        block_size=cfg.block_size,
        device=device_of(cfg),
    )
    for c in mine:
        holder.add_chunk(c, corpus.kv(c), corpus.positions[c])
    return holder


def _holder_process(rank: int, world: int, port: int, cfg_dict: dict) -> None:
    """Entry point of a holder process (gloo or NVSHMEM): build its chunks, serve until shut
    down. The kernel mode comes with the environment (``TRITON_INTERPRET``) the parent chose."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    cfg = DemoConfig(**cfg_dict)
    model = build_model(cfg)
    corpus = Corpus(cfg, model)
    store = TCPStore("127.0.0.1", port, world, is_master=False)
    transport = _process_transport(cfg, rank, world, store, model.geometry)
    holder = _make_holder(cfg, transport, model, corpus)
    store.set(f"ready/{rank}", "1")
    try:
        holder.serve_forever()
    finally:
        transport.close()


class Cluster:
    """The requester's transport (:attr:`transport`) and the running holders.

    ``kill()`` kills holder ``cfg.kill_holder`` (the fault drill); :meth:`close` asks the
    others to stop and waits for them.
    """

    def __init__(self, cfg: DemoConfig, model: MLAModel, corpus: Corpus) -> None:
        self.cfg = cfg
        self.world = cfg.holders + 1
        self._holders: list[Holder] = []
        self._procs: list = []
        self._threads = torch.get_num_threads()
        if cfg.transport == "loopback":
            self._fabric = LoopbackFabric(self.world, _slot_bytes(cfg, model.geometry), lanes=LANES)
            for r in range(1, self.world):
                holder = _make_holder(cfg, self._fabric.endpoint(r), model, corpus)
                self._holders.append(holder.start())
            self.transport = self._fabric.endpoint(REQUESTER)
        else:
            self._start_processes(model.geometry)

    def _start_processes(self, geometry: MLAGeometry) -> None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = free_port_store(self.world)
        ctx = mp.get_context("spawn")
        cfg_dict = dataclasses.asdict(self.cfg)
        for r in range(1, self.world):
            p = ctx.Process(target=_holder_process, args=(r, self.world, store.port, cfg_dict))
            p.start()
            self._procs.append(p)
        self.transport = _process_transport(self.cfg, REQUESTER, self.world, store, geometry)
        # one intra-op thread: on 2 cores, torch's OpenMP workers spin after each op and starve
        # gloo's receive threads (seen: a 1.4 ms round trip became 3.9 ms)
        torch.set_num_threads(1)
        for r in range(1, self.world):
            store.wait([f"ready/{r}"], torch.distributed.constants.default_pg_timeout)

    def kill(self) -> None:
        """Kill holder ``cfg.kill_holder`` mid-run."""
        k = self.cfg.kill_holder
        if self._procs:
            self._procs[k - 1].kill()
            self._procs[k - 1].join()
        else:
            self._holders[k - 1].stop()
            self._fabric.kill(k)

    def close(self, requester: Requester | None) -> None:
        """Ask every live holder to stop (best effort), wait for it, close the transport."""
        for r in range(1, self.world):
            if r == self.cfg.kill_holder or requester is None:
                continue
            try:
                requester.shutdown(r)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        for h in self._holders:
            h.stop()
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.transport.close()
        if self._procs:
            torch.set_num_threads(self._threads)
