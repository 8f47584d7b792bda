"""Tensor-parallel instances as a service (§8): what ``mqnc serve --tp N`` runs under torchrun.

The job's ``world`` ranks form ``world / N`` instances of ``N`` ranks each, instance ``i`` being
ranks ``i N .. i N + N - 1`` (with torchrun's static rendezvous, ``--nproc-per-node N`` makes
each node one instance). In this mode the corpus' holder ids name **instances**: a chunk held by
``(1,)`` lives on every rank of instance 1, each rank keeping its columns of it
(:class:`~mqnc.serving.tp_group.TPPartition`). Every other instance is a requester instance: its
rank ``r`` runs the job with a :class:`~mqnc.serving.tp_requester.TPRequester` that routes to
holder rank ``r`` of a holder instance.

Rendezvous, the done protocol (a requester's ``done`` is the secret it committed to before the
fabric was built) and the trust model are :mod:`mqnc.serving.service`'s. The fabric is gloo
(CPU tensors) over every rank of the job; each holder instance's score reduction is its own
group on the same store (:class:`~mqnc.serving.tp_group.GlooGroup`; NCCL on CUDA devices,
:class:`~mqnc.serving.tp_group.NcclGroup`).

:func:`exactness_job` is a built-in requester job (``--job mqnc.serving.tp_service:exactness_job``):
it routes a seeded query batch over every chunk, dense and top-k, and compares this rank's slice of
``o`` and the row's ``lse`` with the fp64 reference of the whole row computed from the corpus
file (which the requester reads for the check only).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mqnc.base.checks import check_int
from mqnc.serving.corpus import Corpus
from mqnc.serving.service import (
    KEY,
    corpus_terms,
    gloo_bind_host,
    publish_commitment,
    publish_done,
    publish_failure,
    read_commitments,
    rendezvous,
    requester_done,
    wait_ready,
)
from mqnc.serving.tp_group import GlooGroup, NcclGroup, TPPartition
from mqnc.serving.tp_holder import TPHolder
from mqnc.serving.tp_requester import TPRequester
from mqnc.transport import connect

__all__ = ["TPServeContext", "exactness_job", "run_tp_rank"]


@dataclasses.dataclass
class TPServeContext:
    """What a requester rank's job receives in TP mode: ``rank``, ``world``, ``degree`` (N),
    ``instance`` (this rank's), ``partition``, ``corpus``, ``requester`` (this rank's
    :class:`~mqnc.serving.tp_requester.TPRequester`), ``store`` and the job's ``options``."""

    rank: int
    world: int
    degree: int
    instance: int
    partition: TPPartition
    corpus: Corpus
    requester: TPRequester
    store: Any
    options: Any = None


def _check_layout(corpus: Corpus, world: int, degree: int) -> tuple[list[int], list[int]]:
    """``(holder instances, requester instances)``, or an error naming ``--tp``."""
    check_int("tp", degree, minimum=1)
    if world % degree:
        raise ValueError(
            f"tp: a TP degree must divide the job's world size {world} (whole instances of N "
            f"ranks), got {degree}"
        )
    instances = world // degree
    holders = corpus.holder_ranks
    if max(holders) >= instances:
        raise ValueError(
            f"corpus: with --tp {degree} the corpus' holder ids name instances; {holders} do "
            f"not all exist among the {instances} instances of a world of {world}"
        )
    requesters = [i for i in range(instances) if i not in holders]
    if not requesters:
        raise ValueError(f"corpus: every one of the {instances} instances holds chunks")
    return holders, requesters


def _serve_holder(corpus, part, tr, store, instance, requester_ranks, *, kernels, device,
                  timeout_s, host) -> TPHolder:  # fmt: skip
    """Load this rank's columns of its instance's chunks and serve until every requester rank
    is done or gone."""
    n, r = part.degree, tr.rank % part.degree
    commitments = read_commitments(store, requester_ranks, timeout_s)
    prefix = f"{KEY}/tp-group/{instance}"
    if torch.device(device).type == "cuda":
        group = NcclGroup(r, n, store, prefix=prefix, timeout_s=timeout_s)
    else:
        group = GlooGroup(r, n, store, prefix=prefix, timeout_s=timeout_s, host=host)
    mine = corpus.chunks_on(instance)
    blocks = sum(-(-c.tokens // corpus.block_size) for c in mine) or 1
    holder = TPHolder(
        tr, group, part, softmax_scale=corpus.softmax_scale, num_blocks=blocks,
        block_size=corpus.block_size, dtype=corpus.dtype, device=device, kernels=kernels,
        pair_timeout_s=timeout_s,
    )  # fmt: skip
    for c in mine:
        holder.add_chunk(c.chunk_id, part.slice(corpus.chunk_kv(c.chunk_id), r), c.position)
    store.set(f"{KEY}/ready/{tr.rank}", "1")
    pending, next_check = set(requester_ranks), 0.0
    while pending:
        holder.step(holder.poll_s)
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + 0.25
            pending = {
                q for q in pending
                if tr.peer_alive(q) and not requester_done(store, q, commitments[q])
            }  # fmt: skip
    return holder


def run_tp_rank(
    corpus: Corpus | str | Path,
    job: Callable[[TPServeContext], Any] | None,
    *,
    degree: int,
    kernels: str = "triton",
    device: torch.device | str = "cpu",
    max_rows: int = 64 * 16,
    timeout_s: float = 300.0,
    rank: int | None = None,
    world: int | None = None,
    master: str | None = None,
    options: Any = None,
) -> dict:
    """One rank of a TP serve job (see the module docstring). Returns ``{"role": "holder",
    "rank", "stats"}`` or ``{"role": "requester", "rank", "result"}`` (plus ``"engine":
    "gloo"``); the transport is closed, and the process should end through ``os._exit`` (gloo).
    """
    if not isinstance(corpus, Corpus):
        corpus = Corpus.load(corpus)
    store, rank, world = rendezvous(rank=rank, world=world, master=master, timeout_s=timeout_s)
    holders, requester_instances = _check_layout(corpus, world, degree)
    part = TPPartition(corpus.geometry, degree, getattr(corpus.rope, "layout", "interleaved"))
    instance = rank // degree
    requester_ranks = [i * degree + r for i in requester_instances for r in range(degree)]
    secret = None if instance in holders else publish_commitment(store, rank)
    terms = {**corpus_terms(corpus), "tp_degree": degree}
    host = gloo_bind_host(None, master)  # where gloo's pairs listen (mqnc.serving.service)
    options = {"connect_timeout_s": timeout_s} | ({} if host is None else {"host": host})
    slot = corpus.slot_bytes(max_rows)
    tr = connect("gloo", rank, world, store, slot_bytes=slot, agree=terms, **options)
    try:
        if instance in holders:
            try:
                h = _serve_holder(corpus, part, tr, store, instance, requester_ranks,
                                  kernels=kernels, device=device, timeout_s=timeout_s,
                                  host=host)  # fmt: skip
            except BaseException as exc:
                publish_failure(store, rank, exc)
                raise
            return dict(role="holder", rank=rank, stats=dict(h.stats), engine="gloo")
        if job is None:
            raise ValueError(f"job: rank {rank} is a requester and needs a job")
        wait_ready(store, [i * degree + r for i in holders for r in range(degree)], timeout_s)
        try:
            req = TPRequester(tr, part, dtype=corpus.dtype, timeout_s=timeout_s)
            ctx = TPServeContext(rank, world, degree, instance, part, corpus, req, store, options)
            result = job(ctx)
        finally:
            publish_done(store, rank, secret)
        return dict(role="requester", rank=rank, result=result, engine="gloo")
    finally:
        tr.close()


def exactness_job(ctx: TPServeContext) -> dict:
    """Route a seeded batch (2 tokens x the model's heads) over every chunk, dense and top-k
    (every other entry), and compare this rank's ``o`` slice and the row's ``lse`` with the fp64
    reference of the whole row from the corpus file. Returns the largest errors and the bytes
    this rank sent and received per route."""
    from mqnc.reference.attention_ref import partial_attention_reference

    g, part = ctx.corpus.geometry, ctx.partition
    gen = torch.Generator().manual_seed(1234)
    q = (0.5 * torch.randn(2, g.heads, g.d_qk, generator=gen)).to(ctx.corpus.dtype)
    q_r = part.slice(q, ctx.rank % ctx.degree)
    cols = part.columns(ctx.rank % ctx.degree)[: part.slice_latent]
    worst = dict(o=0.0, lse=0.0, routes=0)
    for c in sorted(ctx.corpus.chunks.values(), key=lambda c: c.chunk_id):
        kv = ctx.corpus.chunk_kv(c.chunk_id)[g.layers - 1]
        sel = torch.arange(0, c.tokens, 2, dtype=torch.int32).expand(2, -1)
        for idx in (None, sel):
            o, lse = ctx.requester.route(c.holders[0], c.chunk_id, q_r, g.layers - 1, idx)
            valid = torch.ones(2, c.tokens, dtype=torch.bool)
            if idx is not None:
                valid = torch.zeros_like(valid)
                valid[:, ::2] = True
            o_ref, lse_ref = partial_attention_reference(
                q, kv, valid, ctx.corpus.softmax_scale, g.d_c
            )
            worst["o"] = max(worst["o"], float((o.double() - o_ref[..., cols]).abs().max()))
            worst["lse"] = max(worst["lse"], float((lse.double() - lse_ref).abs().max()))
            worst["routes"] += 1
    worst["sent_bytes"], worst["received_bytes"] = ctx.requester.last_bytes
    return worst
