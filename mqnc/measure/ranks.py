"""Holder ranks as child processes over gloo, for the benchmark fabrics (:mod:`mqnc.measure.echo`,
:mod:`mqnc.measure.holders`): both sides of standing them up, written once.

The parent (rank 0, the requester) runs :func:`start_gloo_ranks`: a free-port store, one
``python -m MODULE serve --rank R --world W --port P --slot-bytes N --lanes K
--start-timeout S ...`` per holder rank, then its own engine and the barrier that says every
rank is up (the children are killed if that fails). A child parses those flags with
:func:`rank_parser` (plus its own) and joins with :func:`connect_rank`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

from mqnc.transport import TorchDistTransport, free_port_store

__all__ = ["start_gloo_ranks", "rank_parser", "connect_rank", "exit_process"]

_GLOO_OPENED = False


def exit_process(rc: int) -> None:
    """End a benchmark process with ``rc``.

    After a gloo fabric, the process exits through ``os._exit`` once its output is flushed:
    the torchdist engine keeps closed process groups alive until exit (a service thread may
    still sit in a blocked ``recv``), and their destructors at interpreter shutdown can abort
    the process (seen once here as SIGABRT after every record was written). Results are on
    disk by then; only the exit status would be lost.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if _GLOO_OPENED:
        os._exit(rc)
    raise SystemExit(rc)


def _idle_timeout(start_timeout_s: float) -> float:
    return max(600.0, 4 * start_timeout_s)


def start_gloo_ranks(
    module: str,
    extra_args: dict[int, list[str]],
    *,
    world: int,
    slot_bytes: int,
    lanes: int,
    start_timeout_s: float,
) -> tuple[TorchDistTransport, object, list[subprocess.Popen]]:
    """Start ``python -m module serve`` for each rank of ``extra_args`` (rank -> its own
    flags) and join as rank 0: ``(this rank's engine, the store, the child processes)``."""
    global _GLOO_OPENED
    _GLOO_OPENED = True  # see exit_process
    store = free_port_store(world, timeout_s=start_timeout_s)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    procs = []
    for rank, extra in extra_args.items():
        cmd = [sys.executable, "-m", module, "serve", f"--rank={rank}", f"--world={world}",
               f"--port={store.port}", f"--slot-bytes={slot_bytes}", f"--lanes={lanes}",
               f"--start-timeout={start_timeout_s}", *extra]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        end = TorchDistTransport(
            0,
            world,
            store,
            slot_bytes=slot_bytes,
            lanes=lanes,
            idle_timeout_s=_idle_timeout(start_timeout_s),
        )
        end.barrier(start_timeout_s)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return end, store, procs


def rank_parser(prog: str) -> argparse.ArgumentParser:
    """The flags :func:`start_gloo_ranks` gives every child (add the child's own to it)."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--slot-bytes", type=int, required=True)
    ap.add_argument("--lanes", type=int, required=True)
    ap.add_argument("--start-timeout", type=float, required=True)
    return ap


def connect_rank(args: argparse.Namespace) -> TorchDistTransport:
    """This child's engine (one intra-op thread: torch's spinning workers starve gloo's
    receiving threads); the caller sets up what it serves, then enters the barrier."""
    global _GLOO_OPENED
    _GLOO_OPENED = True
    torch.set_num_threads(1)
    return TorchDistTransport.connect(
        args.rank,
        args.world,
        args.port,
        slot_bytes=args.slot_bytes,
        lanes=args.lanes,
        idle_timeout_s=_idle_timeout(args.start_timeout),
        store_timeout_s=args.start_timeout,
    )
