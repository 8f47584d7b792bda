"""The demo's instances: one requester (rank 0, this process) and ``holders`` holders, as
threads over the in-process loopback or as processes over gloo (NVSHMEM PEs on a GPU), each
holder serving its share of the canonical corpus (§3.1, §6).

Holder processes start first and build what does not need the corpus while this process
prefills it once (:meth:`Cluster.publish` then hands each holder its chunks through files, so no
chunk is prefilled twice). Every step of a holder's start-up reports to the rendezvous store: a
holder that fails says so there (its exception) and one that dies is seen by its exit code, and
:meth:`Cluster.wait_ready` raises :class:`HolderStartupError` at once, naming the holder, instead
of waiting on a rendezvous that cannot complete.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from mqnc.demo.config import LANES, REQUESTER, DemoConfig, HolderStartupError
from mqnc.demo.workload import Corpus, build_model
from mqnc.model import MLAGeometry, MLAModel
from mqnc.serving import Holder, Requester
from mqnc.transport import ENGINES, Transport, connect, free_port_store, open_fabric, slot_bytes_for

__all__ = ["Cluster", "HolderStartupError", "cpu_plan"]

log = logging.getLogger(__name__)

_POLL_S = 0.05


def _slot_bytes(cfg: DemoConfig, geometry: MLAGeometry) -> int:
    return slot_bytes_for(
        geometry,
        max_rows=max(cfg.agents, 16) * geometry.heads,
        max_topk=cfg.topk if cfg.selection_agents else 0,
        max_batch=max(cfg.agents, 16),
        max_chunk_tokens=cfg.max_tokens,
    )


def _process_transport(cfg: DemoConfig, rank: int, world: int, store, geometry) -> Transport:
    """This rank's engine for a multi-process run: gloo, or NVSHMEM (GPU only, device 0:
    several PEs may share one GPU in NVSHMEM's limited multi-process mode)."""
    slot_bytes = _slot_bytes(cfg, geometry)
    options = {}
    if cfg.transport == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
        options["host"] = "127.0.0.1"  # the loopback interface, as the holders' GLOO_SOCKET_IFNAME
    return connect(
        cfg.transport, rank, world, store, slot_bytes=slot_bytes, lanes=LANES, device=0, **options
    )


def _make_holder(cfg: DemoConfig, transport: Transport, model: MLAModel, chunks: dict) -> Holder:
    """A holder serving ``chunks`` (chunk -> ``(kv [L, c_t, d_qk] bf16, position)``)."""
    blocks = sum(-(-kv.shape[1] // cfg.block_size) for kv, _ in chunks.values()) + 1
    holder = Holder(
        transport,
        model.geometry,
        softmax_scale=model.softmax_scale,
        num_blocks=blocks,
        block_size=cfg.block_size,
        device=cfg.device,
        kernels=cfg.kernels,
    )
    for c, (kv, position) in chunks.items():
        holder.add_chunk(c, kv.to(cfg.device), position)
    return holder


def cpu_plan(cfg: DemoConfig) -> dict[int, int] | None:
    """Rank -> the CPU core it runs on, for holder processes computing on the CPU: the
    requester keeps the first core of this process' set to itself, the holders share the
    others round robin (each holder's kernel calls then run on a core of known speed, never
    behind the requester's own work). None when nothing is pinned: holders on a GPU, threads
    (loopback), fewer than two cores, or no ``os.sched_setaffinity``."""
    threads = ENGINES[cfg.transport].in_process
    if cfg.device != "cpu" or threads or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    rest = cpus[1:]
    return {REQUESTER: cpus[0], **{r: rest[(r - 1) % len(rest)] for r in range(1, cfg.holders + 1)}}


def _holder_process(rank: int, world: int, port: int, cfg_dict: dict, cpu: int | None) -> None:
    """Entry point of a holder process (gloo or NVSHMEM): wait for the corpus, load its chunks,
    serve until shut down. Each start-up step reports to the store (``built/R``, ``ready/R``;
    ``failed/R`` with the traceback). The kernel mode comes with the environment
    (``TRITON_INTERPRET``) the parent chose; ``cpu`` pins it to one core (:func:`cpu_plan`)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    cfg = DemoConfig(**cfg_dict)
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=600)
    )
    transport, stage = None, "loading its chunks"
    try:
        model = build_model(cfg)
        store.wait(["corpus"])
        folder = Path(store.get("corpus").decode())
        chunks = torch.load(folder / f"holder-{rank}.pt")
        store.set(f"built/{rank}", "1")
        stage = "joining the transport"
        transport = _process_transport(cfg, rank, world, store, model.geometry)
        stage = "building its pool"
        holder = _make_holder(cfg, transport, model, chunks)
        store.set(f"ready/{rank}", "1")
    except BaseException:  # noqa: BLE001 - reported through the store; the parent raises
        store.set(f"failed/{rank}", f"{stage}\n{traceback.format_exc()}")
        raise SystemExit(1) from None
    try:
        holder.serve_forever()
    finally:
        transport.close()


class Cluster:
    """The requester's transport (:attr:`transport`, after :meth:`wait_ready`) and the holders.

    ``Cluster(cfg, model, corpus)`` starts the holder processes (gloo, NVSHMEM) at once;
    :meth:`publish` hands them the prefilled corpus; :meth:`wait_ready` builds this rank's
    transport and returns when every holder serves, raising :class:`HolderStartupError` as soon
    as one fails or dies. ``kill()`` kills holder ``cfg.kill_holder`` (the fault drill);
    :meth:`close` asks the others to stop and waits for them.
    """

    def __init__(self, cfg: DemoConfig, model: MLAModel, corpus: Corpus) -> None:
        self.cfg, self.model, self.corpus = cfg, model, corpus
        self.world = cfg.holders + 1
        self.transport: Transport | None = None
        self._holders: list[Holder] = []
        self._procs: list = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._threads = torch.get_num_threads()
        self.cpus = cpu_plan(cfg)
        self._affinity = os.sched_getaffinity(0) if self.cpus else None
        if not ENGINES[cfg.transport].in_process:
            self._start_processes()

    def _start_processes(self) -> None:
        self.store = free_port_store(self.world)
        ctx = mp.get_context("spawn")
        cfg_dict = dataclasses.asdict(self.cfg)
        for r in range(1, self.world):
            cpu = self.cpus[r] if self.cpus else None
            p = ctx.Process(
                target=_holder_process,
                args=(r, self.world, self.store.port, cfg_dict, cpu),
                name=f"mqnc-demo-holder-{r}",
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        if self.cpus:  # this process (the requester) on its own core until close()
            os.sched_setaffinity(0, {self.cpus[REQUESTER]})

    def _chunks_of(self, rank: int) -> dict:
        """Chunk -> ``(kv, position)`` of the chunks placed on ``rank``."""
        placement = self.corpus.placement()
        return {
            c: (self.corpus.kv(c), self.corpus.positions[c])
            for c, ranks in placement.items()
            if rank in ranks
        }

    def publish(self) -> None:
        """Hand every holder its chunks of the (prefilled) corpus: threads get the tensors,
        processes one file each in a temporary folder (removed by :meth:`close`)."""
        if ENGINES[self.cfg.transport].in_process:
            slot_bytes = _slot_bytes(self.cfg, self.model.geometry)
            self._fabric = open_fabric(
                self.cfg.transport, self.world, slot_bytes=slot_bytes, lanes=LANES
            )
            for r in range(1, self.world):
                holder = _make_holder(
                    self.cfg, self._fabric.endpoint(r), self.model, self._chunks_of(r)
                )
                self._holders.append(holder.start())
            self.transport = self._fabric.endpoint(REQUESTER)
            return
        self._tmp = tempfile.TemporaryDirectory(prefix="mqnc-demo-")
        for r in range(1, self.world):
            torch.save(self._chunks_of(r), Path(self._tmp.name) / f"holder-{r}.pt")
        self.store.set("corpus", self._tmp.name)

    def wait_ready(self) -> None:
        """Build this rank's transport and wait until every holder serves; raises
        :class:`HolderStartupError` naming the first holder that failed or died."""
        if not self._procs:
            return
        self._await("built", "loading its chunks")
        box: dict = {}

        def connect() -> None:
            try:
                box["transport"] = _process_transport(
                    self.cfg, REQUESTER, self.world, self.store, self.model.geometry
                )
            except BaseException as exc:  # noqa: BLE001 - re-raised by the waiting thread
                box["error"] = exc

        # the rendezvous blocks until every rank joins: wait for it beside the holders' health
        t = threading.Thread(target=connect, name="mqnc-demo-connect", daemon=True)
        t.start()
        deadline = time.monotonic() + self.cfg.timeout_s
        while t.is_alive():
            t.join(_POLL_S)
            self._check("joining the transport")
            if time.monotonic() > deadline:
                raise HolderStartupError(
                    f"holders: the transport did not connect within {self.cfg.timeout_s:.0f} s"
                )
        if "error" in box:
            raise box["error"]
        self.transport = box["transport"]
        # one intra-op thread: on 2 cores, torch's OpenMP workers spin after each op and starve
        # gloo's receive threads (seen: a 1.4 ms round trip became 3.9 ms)
        torch.set_num_threads(1)
        self._await("ready", "building its pool")

    def _await(self, key: str, what: str) -> None:
        """Wait for ``key/R`` of every holder, checking their health meanwhile."""
        keys = [f"{key}/{r}" for r in range(1, self.world)]
        deadline = time.monotonic() + self.cfg.timeout_s
        while not self.store.check(keys):
            self._check(what)
            if time.monotonic() > deadline:
                raise HolderStartupError(
                    f"holders: not all reached '{key}' within {self.cfg.timeout_s:.0f} s ({what})"
                )
            time.sleep(_POLL_S)

    def _check(self, what: str) -> None:
        """Raise :class:`HolderStartupError` if a holder reported a failure (the stage it was
        in, its exception) or died (``what`` it was doing, its exit code)."""
        for r, p in enumerate(self._procs, start=1):
            if self.store.check([f"failed/{r}"]):
                stage, _, remote = self.store.get(f"failed/{r}").decode().partition("\n")
                log.info("holder %d's traceback:\n%s", r, remote)
                last = remote.strip().splitlines()[-1] if remote.strip() else "no message"
                raise HolderStartupError(
                    f"holder {r} failed at start-up ({stage}): {last} (-v shows its traceback)"
                )
            if p.exitcode is not None:
                raise HolderStartupError(
                    f"holder {r} died at start-up ({what}): exit code {p.exitcode}"
                )

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
        """Ask every live holder to stop (best effort), close the transport, wait for the
        holders; with no requester (start-up failed) the holder processes are killed at once.

        The requester closes its transport before it waits: a holder process, shut down, closes
        its own, which waits (up to its timeout, 5 s) for every peer's goodbye, the
        requester's included."""
        for r in range(1, self.world):
            if r == self.cfg.kill_holder or requester is None:
                continue
            try:
                requester.shutdown(r)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        for h in self._holders:
            h.stop()
        if self.transport is not None and requester is not None:
            self.transport.close()
        for p in self._procs:
            if requester is None:
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        if self.transport is not None and requester is None:
            self.transport.close()
        if self._procs:
            torch.set_num_threads(self._threads)
        if self._affinity is not None:
            os.sched_setaffinity(0, self._affinity)
            self._affinity = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
