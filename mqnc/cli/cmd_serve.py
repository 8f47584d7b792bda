"""``mqnc serve``: one rank of a holder / requester job started by torchrun
(:func:`mqnc.serving.run_rank`; docs/serving.md, "Holders as a service").

A rank that holds chunks of the corpus file serves them until every requester is done; every
other rank is a requester and runs its job: ``--generate`` (the default: a Hugging Face model
folder generating from this requester's prompt, :func:`mqnc.integrations.hf.serve_generate`) or
``--job module:function`` (called with a :class:`mqnc.serving.ServeContext`). Start it with
``torchrun ... -m mqnc serve --corpus corpus.json ...``. (``--run``, the old name of ``--job``,
still works outside torchrun, with a warning: torchrun's parser takes it for an abbreviation of
its own ``--run-path`` and refuses the command line as ambiguous.) Rank 0 says, once per job at
start, where the store and gloo listen and where the trust model is written
(:func:`mqnc.serving.service.trust_note`: two lines on stderr). With ``--tp N`` the ranks form
tensor-parallel instances of ``N`` ranks each and route rank to rank
(:mod:`mqnc.serving.tp_service`; docs/tensor-parallel.md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings

from mqnc.measure.options import positive_float, positive_int, resolve_hf_model
from mqnc.transport import AUTO, ENGINES, describe, names

__all__ = ["register"]

TRANSPORTS = names(in_process=False, auto=True)  # mqnc.serving.service.TRANSPORTS
DESCRIPTION = (
    "One rank of a holder / requester job under torchrun (env:// rendezvous). Ranks that hold "
    "chunks of the corpus file load them and serve route / fetch / probe until every requester "
    "is done; every other rank is a requester and runs its job: --generate (a Hugging Face "
    "model folder generating from its prompt with the context on the holders) or --job "
    "module:function. Start: torchrun --nnodes N --nproc-per-node P --node-rank I "
    "--rdzv-backend static --rdzv-endpoint HOST0:PORT -m mqnc serve --corpus corpus.json ..."
)


def _job(args):
    """The requester's job: ``--job module:function`` or the built-in ``--generate``."""
    flag = "--job"
    if args.run:
        warnings.warn(
            "mqnc serve: --run is deprecated (torchrun takes it for its own --run-path and "
            "refuses the command line); use --job module:function",
            FutureWarning,
            stacklevel=2,
        )
        args.job, flag = args.run, "--run"
    if args.job:
        module, _, fn = args.job.partition(":")
        if not module or not fn:
            raise ValueError(f"{flag}: expected 'module:function', got {args.job!r}")
        return getattr(importlib.import_module(module), fn)

    def generate(ctx):
        from mqnc.integrations.hf import serve_generate

        if not args.model or not args.prompts:
            raise ValueError("--generate: needs --model DIR and --prompts FILE")
        return serve_generate(
            ctx,
            model=resolve_hf_model(args.model),  # (this rank's: a holder needs no model)
            prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            force=args.force,
            offset=args.offset,
            out=args.out,
            device=args.device or "cpu",
        )

    return generate


def _say(note: str) -> None:
    """The trust note (run_rank says it once per job, on rank 0), on stderr."""
    print(note, file=sys.stderr, flush=True)


def _run_tp(args) -> int:
    """``--tp N``: the job's ranks as TP instances of N ranks (:mod:`mqnc.serving.tp_service`)."""
    from mqnc.serving.tp_service import run_tp_rank

    if args.transport not in (AUTO, "gloo"):
        raise ValueError(f"--transport: --tp runs over gloo (or auto), got {args.transport!r}")
    if not (args.job or args.run):
        raise ValueError(
            "--tp: requester ranks need --job module:function (a TPServeContext; e.g. "
            "mqnc.serving.tp_service:exactness_job); --generate is single-rank"
        )
    done = run_tp_rank(
        args.corpus, _job(args), degree=args.tp, kernels=args.kernels, device=args.device or "cpu",
        max_rows=args.max_rows, timeout_s=args.timeout, rank=args.rank, world=args.world,
        master=args.master, options=args,
    )  # fmt: skip
    if done["role"] == "holder":
        s = done["stats"]
        print(
            f"mqnc serve: TP holder rank {done['rank']} done ({s['routes']} routes, "
            f"{s['reductions']} reductions)",
            flush=True,
        )
    else:
        text = json.dumps(done["result"], default=str)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"rank{done['rank']}.json"), "w") as f:
                f.write(text)
        print(f"mqnc serve: TP requester {done['rank']} done: {text[:200]}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo: closed groups stay alive until exit (see below)


def _run(args) -> int:
    # imported here: registering this command must not load torch (``mqnc --help``)
    from mqnc.base.runtime import use_interpreter_without_cuda

    use_interpreter_without_cuda()
    import torch

    from mqnc.serving import run_rank

    # on small CPU machines torch's intra-op workers spin after each op and starve gloo's
    # receive threads (the demo saw a 1.4 ms round trip become 3.9 ms): one thread by default
    torch.set_num_threads(args.threads)
    if args.tp is not None:
        return _run_tp(args)
    done = run_rank(
        args.corpus,
        _job(args),
        transport=args.transport,
        kernels=args.kernels,
        device=args.device or "cpu",
        max_rows=args.max_rows,
        timeout_s=args.timeout,
        rank=args.rank,
        world=args.world,
        master=args.master,
        options=args,
        say=_say,
    )
    if done["role"] == "holder":
        s = done["stats"]
        print(
            f"mqnc serve: holder {done['rank']} done ({s.routes} routes, {s.fetches} fetches, "
            f"{s.kernel_calls} batches)",
            flush=True,
        )
    else:
        text = json.dumps(done["result"], default=str)
        print(f"mqnc serve: requester {done['rank']} done: {text[:200]}", flush=True)
    if ENGINES[done["engine"]].exit_directly:
        # gloo keeps closed groups alive until exit (a service thread may sit in a blocked
        # recv); their destructors at interpreter shutdown can abort: exit directly
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="one rank of a holder / requester job under torchrun (corpus from a file)",
        description=DESCRIPTION,
    )
    p.add_argument("--corpus", required=True, help="corpus manifest (.json) from mqnc corpus")
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=AUTO,
        help=f"{describe(TRANSPORTS)} (default {AUTO})",
    )
    p.add_argument(
        "--kernels",
        choices=("triton", "torch"),
        default="triton",
        help="holders' and requesters' arithmetic: Triton kernels (default) or torch references",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default cpu")
    p.add_argument(
        "--max-rows",
        type=positive_int,
        default=64 * 16,
        help="query rows one routed message carries, the same on every rank (default 1024)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=300.0,
        help="rendezvous and reply bound in seconds (default 300)",
    )
    p.add_argument(
        "--threads", type=positive_int, default=1, help="torch intra-op threads (default 1)"
    )
    p.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        help="tensor-parallel degree N: the ranks form instances of N ranks, the corpus' holder "
        "ids name instances, requester rank r routes its query slice to holder rank r "
        "(needs --job; docs/tensor-parallel.md)",
    )
    job = p.add_mutually_exclusive_group()
    job.add_argument("--job", default=None, help="requester job 'module:function' (ServeContext)")
    # the old name: torchrun's parser reads it as an abbreviation of --run-path (ambiguous)
    job.add_argument("--run", default=None, help=argparse.SUPPRESS)
    job.add_argument(
        "--generate",
        action="store_true",
        help="requester job: generate with --model from --prompts (the job without --job)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR|HUB_ID",
        help="Hugging Face model folder (from_pretrained) or hub id, read by the requester "
        "ranks only (a holder's machine needs no model): checked as mqnc corpus checks it",
    )
    p.add_argument(
        "--prompts", default=None, help='JSON {"prompts": [[ids], ...]}, one per requester'
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="default 16")
    p.add_argument("--force", choices=("route", "fetch", "local"), default=None)
    p.add_argument("--offset", type=int, default=None, help="the context's offset in the prompt")
    p.add_argument("--out", default=None, help="folder for rank<r>.json (requester results)")
    # an explicit rendezvous without torchrun: this rank, the world and the TCPStore host:port
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--master", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_run)
