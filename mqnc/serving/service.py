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

Addresses and trust (:func:`trust_note`, said once per job by ``mqnc serve``'s rank 0, in two
lines that point to docs/serving.md, "Security and trust model"): gloo's pairs listen
only on the address this rank uses to reach the rendezvous host (``MASTER_ADDR``; 127.0.0.1 for a
job on one machine), or on ``GLOO_SOCKET_IFNAME``'s interface when that is set, or on ``host=``.
A store this module opens itself (env:// without torchrun's agent) listens only on
``MASTER_ADDR``. torchrun's own store is opened by its agent before this code runs, and torch
gives it no listen address: it listens on every interface of node 0. torch.distributed
authenticates nobody, so whoever reaches the store while the job is being built can join it or
hijack its gloo rendezvous; run it on a private network or inside a trusted cluster only. After
the build, the store cannot stop the holders: a requester's ``done`` is the secret whose SHA-256
it published before the build (``KEY/commit/<rank>``, read by every holder once the fabric is
built), so a process that writes ``done`` keys later is ignored. (The wire format checks every
header and never unpickles, so a malformed message fails its request, not the holder; that is
robustness, not security.)
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import json
import os
import secrets
import socket
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
    "bind_address",
    "corpus_terms",
    "gloo_bind_host",
    "make_transport",
    "publish_commitment",
    "publish_done",
    "read_commitments",
    "rendezvous",
    "requester_done",
    "run_rank",
    "serve_holder",
    "trust_note",
    "TRUST_DOC",
    "publish_failure",
    "wait_ready",
]

# the store keys' prefix: KEY/ready/<holder rank>; KEY/failed/<holder rank> (why it could not
# serve); KEY/commit/<requester rank> (the SHA-256 of its secret, set before the fabric is
# built), KEY/done/<requester rank> (the secret, appended)
KEY = "mqnc-serve"
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


def publish_commitment(store, rank: int) -> str:
    """A requester's fresh secret: its SHA-256 is set at ``KEY/commit/<rank>`` (before the
    fabric is built); appending the secret to ``KEY/done/<rank>`` later is this requester's
    ``done``, which only it can say."""
    secret = secrets.token_hex(32)
    store.set(f"{KEY}/commit/{rank}", _digest(secret.encode()))
    return secret


def publish_done(store, rank: int, secret: str) -> None:
    """Requester ``rank``'s ``done``: its secret, appended on a line of its own (whatever else
    was written under the key, with or without a line break, stays beside it and is
    ignored)."""
    store.append(f"{KEY}/done/{rank}", "\n" + secret + "\n")


def read_commitments(store, requesters: list[int], timeout_s: float) -> dict[int, str]:
    """Every requester's commitment (a holder reads them once, when the fabric is built)."""
    keys = [f"{KEY}/commit/{r}" for r in requesters]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    return {
        r: store.get(k).decode("ascii", "replace") for r, k in zip(requesters, keys, strict=True)
    }


def _digest(secret: bytes) -> str:
    return hashlib.sha256(secret).hexdigest()


def requester_done(store, rank: int, commitment: str) -> bool:
    """True once ``KEY/done/<rank>`` holds (among whatever else was appended there) the secret
    whose SHA-256 is ``commitment``; anything else written there is ignored."""
    key = f"{KEY}/done/{rank}"
    if not store.check([key]):
        return False
    lines = store.get(key).split(b"\n")
    return any(hmac.compare_digest(_digest(line), commitment) for line in lines if line)


def publish_failure(store, rank: int, exc: BaseException) -> None:
    """A holder that cannot serve says why (``KEY/failed/<rank>``), so that the requesters
    waiting for its ``ready`` fail at once, naming it and its error."""
    try:
        store.set(f"{KEY}/failed/{rank}", f"{type(exc).__name__}: {exc}"[:2000])
    except Exception:  # noqa: BLE001 - the store itself is gone: the requesters time out
        pass


def wait_ready(store, holders: list[int], timeout_s: float, *, poll_s: float = 0.05) -> None:
    """Wait until every holder rank in ``holders`` has published ``ready``; a holder that
    published a failure instead ends the wait at once with a ``RuntimeError`` naming it and
    its error; past ``timeout_s`` a ``TimeoutError`` names the holders not ready."""
    ready = {h: f"{KEY}/ready/{h}" for h in holders}
    failed = {h: f"{KEY}/failed/{h}" for h in holders}
    deadline = time.monotonic() + timeout_s
    while True:
        for h in holders:
            if store.check([failed[h]]):
                why = store.get(failed[h]).decode("utf-8", "replace")
                raise RuntimeError(f"holder rank {h} could not serve: {why}")
        waiting = [h for h in holders if not store.check([ready[h]])]
        if not waiting:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"holder ranks {waiting} did not publish ready within {timeout_s:g} s "
                "(--timeout); their logs say why"
            )
        time.sleep(poll_s)


def serve_holder(
    corpus: Corpus,
    transport: Transport,
    store,
    requesters: list[int],
    *,
    kernels: str = "triton",
    device: torch.device | str = "cpu",
    check_every_s: float = 0.25,
    commitments: dict[int, str] | None = None,
    timeout_s: float = 300.0,
) -> Holder:
    """Load this rank's chunks, publish ``ready`` and serve until every requester rank is done
    (its secret matches the commitment it published before the build: ``commitments``, read
    from the store when None) or gone, or until a ``SHUTDOWN``; returns the holder (its stats).
    A ``done`` key that does not match is ignored: it does not stop the holder."""
    if commitments is None:
        commitments = read_commitments(store, requesters, timeout_s)
    holder = corpus.make_holder(transport, kernels=kernels, device=device, poll_s=check_every_s)
    store.set(f"{KEY}/ready/{transport.rank}", "1")
    pending = set(requesters)
    next_check = 0.0
    while not holder.stopped:
        holder.serve_once(check_every_s)
        now = time.monotonic()
        if now >= next_check:
            next_check = now + check_every_s
            pending = {
                r
                for r in pending
                if transport.peer_alive(r) and not requester_done(store, r, commitments[r])
            }
            if not pending:
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
    host: str | None = None,
    timeout_s: float = 300.0,
) -> Transport:
    """This rank's engine (``kind`` one of :data:`TRANSPORTS`; ``"auto"`` resolved by
    :func:`mqnc.transport.select`), slots sized for routes of up to ``max_rows`` rows and
    fetches of any chunk of ``corpus``. An engine that needs a GPU takes this node's device
    ``LOCAL_RANK`` (modulo the devices it sees); gloo's pairs listen on ``host`` (None:
    torch's default, ``GLOO_SOCKET_IFNAME`` or the host name's address) and form within
    ``timeout_s`` (a rank that passed the handshake and left is then named)."""
    if kind not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {TRANSPORTS}, got {kind!r}")
    kind = select(kind)
    slot, lanes = corpus.slot_bytes(max_rows), lanes_for(corpus)
    local = int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)
    options = {"connect_timeout_s": timeout_s} if kind == "gloo" else {}
    if kind == "gloo" and host is not None:
        options["host"] = host
    return connect(
        kind, rank, world, store, slot_bytes=slot, lanes=lanes, device=local,
        agree=corpus_terms(corpus), **options,
    )  # fmt: skip


def corpus_terms(corpus: Corpus) -> dict:
    """What every rank of a job must agree on about the corpus, checked with the engine's own
    terms (slot size, lanes, frame protocol) when the fabric is built: the model's geometry,
    the cache dtype, the softmax scale, the pool page, the chunk table (ids, token ranges,
    canonical positions, holders) and the chunks' bytes (each chunk's SHA-256:
    :meth:`~mqnc.serving.Corpus.chunk_digests`). Two ranks given another corpus or another
    model, or the same table over other bytes, are refused there, naming the term, instead of
    routing queries a holder would attend wrongly."""
    chunks = [
        [c.chunk_id, c.start, c.tokens, c.position, list(c.holders)]
        for _, c in sorted(corpus.chunks.items())
    ]
    digests = sorted(corpus.chunk_digests().items())
    return {
        "geometry": dataclasses.asdict(corpus.geometry),
        "cache_dtype": str(corpus.dtype).removeprefix("torch."),
        "softmax_scale": float(corpus.softmax_scale),
        "block_size": int(corpus.block_size),
        "chunks": hashlib.sha256(json.dumps(chunks).encode()).hexdigest(),
        "chunk_bytes": hashlib.sha256(json.dumps(digests).encode()).hexdigest(),
    }


def bind_address(target: str | None) -> str | None:
    """The local address this machine reaches ``target`` (a host name or address) from: where
    gloo's pairs listen (127.0.0.1 for a loopback rendezvous). None when ``target`` is None or
    unreachable. Nothing is sent (a UDP socket is connected, never written)."""
    if not target:
        return None
    try:
        infos = socket.getaddrinfo(target.strip("[]"), 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.connect(addr)
                return s.getsockname()[0]
            except OSError:
                continue
    return None


def _listening_socket(host: str, port: int) -> int:
    """A socket bound to ``host:port`` and listening (its file descriptor, for a store)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ValueError(f"MASTER_ADDR: cannot resolve {host!r} ({exc})") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        return sock.detach()
    except OSError as exc:
        raise ValueError(
            f"MASTER_ADDR: rank 0 opens the store on {host}:{port}, an address of this machine "
            f"and a free port; binding it failed ({exc})"
        ) from exc
    finally:
        sock.close()


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(
            f"rendezvous: expected torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, "
            f"MASTER_PORT; {name} is missing) or an explicit rank, world and master; start "
            "with `torchrun ... -m mqnc serve --corpus FILE`"
        )
    return value


def _env_store(timeout: datetime.timedelta) -> tuple[Any, int, int]:
    """env:// without torchrun's agent: rank 0 opens the store on ``MASTER_ADDR`` only."""
    rank, world = int(_env("RANK")), int(_env("WORLD_SIZE"))
    host, port = _env("MASTER_ADDR"), int(_env("MASTER_PORT"))
    if rank != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout), rank, world
    fd = _listening_socket(host, port)
    store = dist.TCPStore(
        host, port, world, is_master=True, wait_for_workers=False, timeout=timeout,
        master_listen_fd=fd,
    )  # fmt: skip
    return store, rank, world


def _agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def rendezvous(
    *,
    rank: int | None = None,
    world: int | None = None,
    master: str | None = None,
    timeout_s: float = 300.0,
) -> tuple[Any, int, int]:
    """``(store, rank, world)``: an explicit ``TCPStore`` at ``master`` (``"host:port"``, with
    ``rank`` and ``world``), the default group's store of a job that already initialised
    torch.distributed, or torch's env:// rendezvous (torchrun's environment: its agent's store;
    without the agent, rank 0 opens the store on ``MASTER_ADDR`` only)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank is not None:
        if world is None or master is None:
            raise ValueError("rank: an explicit rendezvous needs world and master ('host:port')")
        host, _, port = master.rpartition(":")
        store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout)
        return store, rank, world
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    _env("RANK"), _env("MASTER_ADDR")
    if not _agent_store():
        return _env_store(timeout)
    return next(dist.rendezvous("env://", timeout=timeout))


TRUST_DOC = 'docs/serving.md, "Security and trust model"'
"""Where the trust model :func:`trust_note` points to is written out."""


def trust_note(
    rank: int, engine: str, *, master: str | None = None, gloo_host: str | None = None
) -> str:
    """What ``mqnc serve`` says once per job, at start, on rank 0 (``rank``: the rank whose
    listen addresses it names): two lines, where the rendezvous store and the engine's pairs
    listen, and that torch.distributed authenticates nobody, pointing to the whole model
    (:data:`TRUST_DOC`)."""
    if master is not None:
        store = f"the rendezvous store at {master} was opened outside this job"
    elif dist.is_available() and dist.is_initialized():
        store = "the rendezvous store is the default process group's (not this job's)"
    else:
        at = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        store = (
            f"torchrun's rendezvous store at {at} listens on every interface of node 0"
            if _agent_store()
            else f"the rendezvous store listens on {at} only"
        )
    if engine != "gloo":
        pairs = f"the {engine} engine's fabric is its own (NVLink / InfiniBand)"
    elif gloo_host is not None:
        pairs = f"gloo's pairs listen on {gloo_host} only"
    elif os.environ.get("GLOO_SOCKET_IFNAME"):
        pairs = f"gloo's pairs listen on GLOO_SOCKET_IFNAME's {os.environ['GLOO_SOCKET_IFNAME']}"
    else:
        pairs = "gloo's pairs listen on torch's default (the host name's address)"
    return (
        f"mqnc serve: rank {rank}: {store}; {pairs}.\n"
        "mqnc serve: torch.distributed authenticates nobody: run the job on a private network or "
        f"a trusted cluster only ({TRUST_DOC})."
    )


def gloo_bind_host(host: str | None, master: str | None) -> str | None:
    """Where gloo's pairs listen: ``host``; else GLOO_SOCKET_IFNAME's interface (None: torch
    reads it); else the local address that reaches the rendezvous host."""
    if host is not None or os.environ.get("GLOO_SOCKET_IFNAME"):
        return host
    target = master.rpartition(":")[0] if master is not None else os.environ.get("MASTER_ADDR")
    return bind_address(target)


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
    host: str | None = None,
    say: Callable[[str], Any] | None = None,
) -> dict:
    """One rank of a serve job (see the module docstring): a holder serves until the requesters
    are done; a requester runs ``job(ServeContext)`` and publishes ``done``.

    ``host``: the address gloo's pairs listen on (default: ``GLOO_SOCKET_IFNAME``'s interface
    when set, else the local address that reaches the rendezvous host). ``say``: called once per
    job, on rank 0 (no other rank calls it), before the fabric is built, with :func:`trust_note`
    (``mqnc serve`` prints it).

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
    gloo_host = gloo_bind_host(host, master)
    if say is not None and rank == 0:  # once per job
        say(trust_note(rank, kind, master=master, gloo_host=gloo_host))
    secret = None if rank in holders else publish_commitment(store, rank)
    engine = make_transport(
        kind, rank, world, store, corpus, max_rows=max_rows, device=device, host=gloo_host,
        timeout_s=timeout_s,
    )  # fmt: skip
    ids = dict(transport=engine.name, engine=kind)
    try:
        if rank in holders:
            try:
                h = serve_holder(
                    corpus, engine, store, requesters, kernels=kernels, device=device,
                    timeout_s=timeout_s,
                )  # fmt: skip
            except BaseException as exc:
                publish_failure(store, rank, exc)
                raise
            return dict(role="holder", rank=rank, stats=h.stats, **ids)
        if job is None:
            raise ValueError(f"job: rank {rank} is a requester and needs a job")
        wait_ready(store, holders, timeout_s)
        try:
            req = corpus.make_requester(engine, timeout_s=timeout_s, kernels=kernels, device=device)
            result = job(ServeContext(rank, world, corpus, req, store, options))
        finally:  # the holders stop once every requester is done, failed or not
            publish_done(store, rank, secret)
        return dict(role="requester", rank=rank, result=result, **ids)
    finally:
        engine.close()
