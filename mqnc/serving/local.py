"""The holders of a corpus on this machine, for tests, demos and the README's example: threads
over the in-process loopback, or processes over gloo running the loop ``mqnc serve`` runs under
torchrun (:func:`mqnc.serving.service.serve_holder`)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mqnc.serving.compute import check_kernels
from mqnc.serving.corpus import Corpus
from mqnc.serving.holder import Holder
from mqnc.serving.requester import Requester
from mqnc.serving.service import KEY, corpus_terms, lanes_for, publish_commitment, publish_done
from mqnc.transport import ENGINES, connect, free_port_store, names, open_fabric

__all__ = ["LocalHolders", "LOCAL_TRANSPORTS"]

LOCAL_TRANSPORTS = names(needs_gpu=False)
"""What ``LocalHolders(transport=...)`` takes: the engines that run on any machine."""


class LocalHolders:
    """The holders of a corpus on this machine; rank 0 is the caller's requester.

    ``transport="loopback"`` (an in-process engine): holder threads. ``"gloo"`` (an engine
    across processes): holder processes (``python -m mqnc.serving.holder_process``, one rank of
    the same service loop ``mqnc serve`` runs under torchrun) on 127.0.0.1; the corpus is saved
    to a temporary folder first unless it was loaded from (or saved to) a file. Holder ranks
    must be ``1 .. M``.

    Parameters
    ----------
    corpus : Corpus
    transport : str
        One of :data:`LOCAL_TRANSPORTS` (``"loopback"``, ``"gloo"``).
    kernels : {"triton", "torch"}
        The holders' partial attention (:mod:`mqnc.serving.compute`), and the default of
        :meth:`requester`'s.
    max_route_tokens : int
        Query tokens one routed message carries (sizes the slots; longer prompts are split).
    timeout_s : float
        Start-up bound and the requester's wait bound.
    device : torch.device or str
        The holders' and the requester's pools.
    """

    def __init__(
        self,
        corpus: Corpus,
        *,
        transport: str = "loopback",
        kernels: str = "triton",
        max_route_tokens: int = 64,
        timeout_s: float = 120.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if not isinstance(corpus, Corpus):
            raise TypeError(f"corpus: expected a Corpus, got {type(corpus).__name__}")
        if transport not in LOCAL_TRANSPORTS:
            raise ValueError(f"transport: expected one of {LOCAL_TRANSPORTS}, got {transport!r}")
        ranks = corpus.holder_ranks
        if ranks != list(range(1, len(ranks) + 1)):
            raise ValueError(f"corpus: expected holder ranks 1..M for local holders, got {ranks}")
        self.corpus, self.kind, self.kernels = corpus, transport, check_kernels(kernels)
        self.timeout_s, self.device = float(timeout_s), device
        self.world = len(ranks) + 1
        self.max_rows = max_route_tokens * corpus.geometry.heads
        slot, lanes = corpus.slot_bytes(self.max_rows), lanes_for(corpus)
        self.holders: dict[int, Holder] = {}
        self.procs: dict[int, subprocess.Popen] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._requester: Requester | None = None
        if ENGINES[transport].in_process:
            self.fabric = open_fabric(transport, self.world, slot_bytes=slot, lanes=lanes)
            for r in ranks:
                h = corpus.make_holder(self.fabric.endpoint(r), kernels=kernels, device=device)
                self.holders[r] = h.start()
            self.transport = self.fabric.endpoint(0)
            return
        self._start_processes(slot, lanes)

    def _start_processes(self, slot: int, lanes: int) -> None:
        path = self.corpus.path
        if path is None or self.corpus.entries is not None and not path.exists():
            self._tmp = tempfile.TemporaryDirectory(prefix="mqnc-corpus-")
            path = self.corpus.save(Path(self._tmp.name) / "corpus.json")
        self.store = free_port_store(self.world, timeout_s=self.timeout_s)
        # the holders' gloo pairs on the loopback interface unless the user chose one; this
        # process's environment is left as it was (the requester binds 127.0.0.1 by argument)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        options = {}
        if self.kind == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
            options["host"] = "127.0.0.1"
        for r in self.corpus.holder_ranks:
            spec = dict(
                corpus=str(path),
                transport=self.kind,
                rank=r,
                world=self.world,
                master=f"127.0.0.1:{self.store.port}",
                kernels=self.kernels,
                max_rows=self.max_rows,
                timeout_s=self.timeout_s,
                device=str(self.device),
            )
            cmd = [sys.executable, "-m", "mqnc.serving.holder_process", json.dumps(spec)]
            self.procs[r] = subprocess.Popen(cmd, env=env)
        self._secret = publish_commitment(self.store, 0)  # before the fabric: the holders' done
        self.transport = connect(
            self.kind, 0, self.world, self.store, slot_bytes=slot, lanes=lanes,
            agree=corpus_terms(self.corpus), **options,
        )  # fmt: skip
        # one intra-op thread while the holders run: on small CPU machines torch's workers spin
        # after each op and starve gloo's receive threads; restored on close
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        keys = [f"{KEY}/ready/{r}" for r in self.procs]
        self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))

    def requester(self, **kwargs) -> Requester:
        """Rank 0's :class:`~mqnc.serving.Requester`, built on the first call (``kwargs``:
        ``kernels``, ``timeout_s``, ``device``, ...; defaults: the holders' kernels and this
        object's timeout and device) and the same object afterwards: one requester per
        transport endpoint (its sequence numbers are what the holders answer in order)."""
        if self._requester is not None:
            if kwargs:
                raise ValueError(f"requester: already built; got new arguments {sorted(kwargs)}")
            return self._requester
        kwargs.setdefault("kernels", self.kernels)
        kwargs.setdefault("timeout_s", self.timeout_s)
        kwargs.setdefault("device", self.device)
        self._requester = self.corpus.make_requester(self.transport, **kwargs)
        return self._requester

    def kill(self, rank: int) -> None:
        """Kill holder ``rank`` (a fault drill): its process is killed, or its thread stopped
        and its loopback endpoint marked dead."""
        if rank in self.procs:
            self.procs[rank].kill()
            self.procs[rank].wait(self.timeout_s)
        elif rank in self.holders:
            self.holders[rank].stop()
            self.fabric.kill(rank)
        else:
            raise ValueError(f"rank: expected a holder rank {self.corpus.holder_ranks}, got {rank}")

    def close(self) -> None:
        """Stop every holder and release the transport (idempotent)."""
        for h in self.holders.values():
            h.stop()
        self.holders = {}
        if self.procs:
            publish_done(self.store, 0, self._secret)
            self.transport.close()
            for p in self.procs.values():
                try:
                    p.wait(self.timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            self.procs = {}
            torch.set_num_threads(self._threads)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalHolders:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
