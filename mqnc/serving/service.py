"""Holders as a service: one rank of a job started by ``torchrun`` (what ``mqnc serve`` runs).

The corpus file (:class:`mqnc.serving.Corpus`, written once by
:func:`mqnc.integrations.hf.prefill_context` or ``mqnc corpus``) says which chunk lives on
which ranks (replicas included); a rank that holds chunks is a **holder**, every other rank a
**requester**:

- a holder loads its own chunks from the file (nothing else: no model), publishes ``ready``,
  and serves probe / route / fetch (:class:`mqnc.serving.Holder`, batched per layer) until
  every requester has published ``done`` or is gone (:func:`serve_holder`);
- a requester waits for every holder's ``ready``, builds a :class:`mqnc.serving.Requester` with
  the corpus' directory (it "attaches by rank": the directory maps each chunk to holder ranks)
  and runs its job, a callable given a :class:`ServeContext` (``mqnc serve --generate``: a
  Hugging Face model generating over the holders, :func:`mqnc.integrations.hf.serve_generate`).

Rendezvous (:func:`rendezvous`): the ranks meet through torch's env:// rendezvous
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` from torchrun), or, inside a job that
already called ``init_process_group``, through its default store, or through an explicit
``TCPStore`` address. No default process group is created: the transport builds its own group on
the store (:class:`mqnc.transport.TorchDistTransport`, gloo, CPU tensors) or bootstraps NVSHMEM
through it (:class:`mqnc.transport.NvshmemTransport`, GPU; ``"auto"`` picks it when nvshmem4py
and a GPU are present). NCCL is not used: the one-sided protocol needs a receive a thread can
block in indefinitely per peer, which NCCL's stream semantics do not give (see
:mod:`mqnc.transport.torchdist`). With torchrun's ``--rdzv-backend static``, rank =
``node_rank * nproc_per_node + local_rank``, so a corpus naming holder ranks 2 and 3 puts them on
node 1 of a 2 x 2 job.

Trust: torch.distributed has no authentication or encryption. Anyone who can reach the
rendezvous port or the gloo ports can join the job or read and inject messages; run it on a
private network or inside a trusted cluster only. (The wire format checks every header and never
unpickles, so a malformed message fails its request, not the holder; that is robustness, not
security.)
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mqnc.serving.corpus import Corpus
from mqnc.serving.holder import Holder
from mqnc.serving.requester import Requester
from mqnc.transport import Transport, connect, names, select

__all__ = [
    "TRANSPORTS",
    "ServeContext",
    "lanes_for",
    "make_transport",
    "rendezvous",
    "run_rank",
    "serve_holder",
]

KEY = "mqnc-serve"  # the store keys' prefix: KEY/ready/<holder rank>, KEY/done/<requester rank>
TRANSPORTS = names(in_process=False, auto=True)
"""What ``transport=`` takes: the engines across processes (:mod:`mqnc.transport.registry`)
and ``"auto"``, the selection policy (:func:`mqnc.transport.select`)."""


def lanes_for(corpus: Corpus) -> int:
    """Lanes per (requester, holder) pair: a route wave sends every chunk a holder holds before
    awaiting any reply, so at least that many (and 8, the demo's default)."""
    per: dict[int, int] = {}
    for c in corpus.chunks.values():
        for h in c.holders:
            per[h] = per.get(h, 0) + 1
    return max(8, *per.values())


@dataclasses.dataclass
class ServeContext:
    """What a requester's job receives.

    Attributes
    ----------
    rank, world : int
        This rank and the job's size.
    corpus : Corpus
        The corpus (manifest; the chunks stay on the holders).
    requester : Requester
        This rank's requester, the corpus' directory registered.
    store : torch.distributed.Store
        The job's store (for a job's own coordination).
    options : object
        The job's own options (``mqnc serve``'s parsed command line), or None.
    """

    rank: int
    world: int
    corpus: Corpus
    requester: Requester
    store: Any
    options: Any = None

    @property
    def requester_index(self) -> int:
        """This rank's index among the requester ranks (0, 1, ...)."""
        holders = set(self.corpus.holder_ranks)
        return [r for r in range(self.world) if r not in holders].index(self.rank)


def serve_holder(
    corpus: Corpus,
    transport: Transport,
    store,
    requesters: list[int],
    *,
    kernels: str = "triton",
    device: torch.device | str = "cpu",
    check_every_s: float = 0.25,
) -> Holder:
    """Load this rank's chunks, publish ``ready`` and serve until every requester rank has
    published ``done`` (or is gone, or sent ``SHUTDOWN``); returns the holder (its stats)."""
    holder = corpus.make_holder(transport, kernels=kernels, device=device, poll_s=check_every_s)
    store.set(f"{KEY}/ready/{transport.rank}", "1")
    done = [f"{KEY}/done/{r}" for r in requesters]
    next_check = 0.0
    while not holder.stopped:
        holder.serve_once(check_every_s)
        now = time.monotonic()
        if now >= next_check:
            next_check = now + check_every_s
            gone = all(not transport.peer_alive(r) for r in requesters)
            if gone or store.check(done):
                break
    return holder


def make_transport(
    kind: str,
    rank: int,
    world: int,
    store,
    corpus: Corpus,
    *,
    max_rows: int,
    device: torch.device | str = "cpu",
) -> Transport:
    """This rank's engine (``kind`` one of :data:`TRANSPORTS`; ``"auto"`` resolved by
    :func:`mqnc.transport.select`), slots sized for routes of up to ``max_rows`` rows and
    fetches of any chunk of ``corpus``. An engine that needs a GPU takes this node's device
    ``LOCAL_RANK`` (modulo the devices it sees)."""
    if kind not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {TRANSPORTS}, got {kind!r}")
    kind = select(kind)
    slot, lanes = corpus.slot_bytes(max_rows), lanes_for(corpus)
    local = int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)
    return connect(kind, rank, world, store, slot_bytes=slot, lanes=lanes, device=local)


def rendezvous(
    *,
    rank: int | None = None,
    world: int | None = None,
    master: str | None = None,
    timeout_s: float = 300.0,
) -> tuple[Any, int, int]:
    """``(store, rank, world)``: an explicit ``TCPStore`` at ``master`` (``"host:port"``, with
    ``rank`` and ``world``), the default group's store of a job that already initialised
    torch.distributed, or torch's env:// rendezvous (torchrun's environment)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank is not None:
        if world is None or master is None:
            raise ValueError("rank: an explicit rendezvous needs world and master ('host:port')")
        host, _, port = master.rpartition(":")
        store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout)
        return store, rank, world
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ValueError(
            "rendezvous: expected torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, "
            "MASTER_PORT) or an explicit rank, world and master; start with `torchrun ... "
            "-m mqnc serve --corpus FILE`"
        )
    return next(dist.rendezvous("env://", timeout=timeout))


def run_rank(
    corpus: Corpus | str | Path,
    job: Callable[[ServeContext], Any] | None,
    *,
    transport: str = "auto",
    kernels: str = "triton",
    device: torch.device | str = "cpu",
    max_rows: int = 64 * 16,
    timeout_s: float = 300.0,
    rank: int | None = None,
    world: int | None = None,
    master: str | None = None,
    options: Any = None,
) -> dict:
    """One rank of a serve job (see the module docstring): a holder serves until the requesters
    are done; a requester runs ``job(ServeContext)`` and publishes ``done``.

    Returns ``{"role": "holder", "rank", "stats": HolderStats, "transport", "engine"}`` or
    ``{"role": "requester", "rank", "result": job's return value, "transport", "engine"}``
    (``transport``: the endpoint's ``name``; ``engine``: the registry name ``transport=``
    resolved to); the transport is closed. A process whose engine's entry says
    ``exit_directly`` (gloo) should then end through ``os._exit`` once its output is flushed
    (the engine keeps closed groups alive until exit, and their destructors at interpreter
    shutdown can abort), as ``mqnc serve`` does.
    """
    if not isinstance(corpus, Corpus):
        corpus = Corpus.load(corpus)
    store, rank, world = rendezvous(rank=rank, world=world, master=master, timeout_s=timeout_s)
    holders = corpus.holder_ranks
    if max(holders) >= world:
        raise ValueError(f"corpus: holder ranks {holders} do not exist in a world of {world} ranks")
    requesters = [r for r in range(world) if r not in holders]
    kind = select(transport) if transport in TRANSPORTS else transport  # else: the error below
    engine = make_transport(kind, rank, world, store, corpus, max_rows=max_rows, device=device)
    ids = dict(transport=engine.name, engine=kind)
    try:
        if rank in holders:
            h = serve_holder(corpus, engine, store, requesters, kernels=kernels, device=device)
            return dict(role="holder", rank=rank, stats=h.stats, **ids)
        if job is None:
            raise ValueError(f"job: rank {rank} is a requester and needs a job")
        store.wait([f"{KEY}/ready/{h}" for h in holders], datetime.timedelta(seconds=timeout_s))
        try:
            req = corpus.make_requester(engine, timeout_s=timeout_s, kernels=kernels, device=device)
            result = job(ServeContext(rank, world, corpus, req, store, options))
        finally:  # the holders stop once every requester is done, failed or not
            store.set(f"{KEY}/done/{rank}", "1")
        return dict(role="requester", rank=rank, result=result, **ids)
    finally:
        engine.close()
