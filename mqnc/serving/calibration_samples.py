"""Timing this machine's constants through a requester against its holders (§4.3): what the
demo's calibration (:mod:`mqnc.demo.calibration`) and the Hugging Face session's
(:func:`mqnc.integrations.hf_predicate.measure_constants`) both run, each with its own sizes,
repetitions and chunks.

- :func:`sample_rounds`: the loop every measurement here shares: untimed warm-ups of each call,
  then repetitions, interleaved in rounds (a slow spell of the machine touches every call
  alike) or each call's in a row;
- :func:`probe_times`: payload-free round trips to one holder;
- :func:`route_sweep`: routed calls of a few query sizes to one chunk (:class:`RouteSample`
  per call: the round trip less the holder's kernel call, the kernel call, the send);
- :func:`fetch_samples`: pulls of chunks spliced into the requester's pool (at a new offset,
  or at the canonical position: the pool write alone), each round's copies evicted again, so
  that the pool is left as it was found (:class:`FetchSample` per call);
- :func:`merge_times`: the merge of an agent's partials on the requester's kernels.

Everything returns plain numbers (microseconds, bytes); the lines through them are
:mod:`mqnc.cost.calibration_fits`'s (:func:`~mqnc.cost.fit_route`, :func:`~mqnc.cost.robust_affine`,
:func:`~mqnc.cost.fit_pull`). ``mqnc calibrate`` (:mod:`mqnc.measure.calibrate`) times an echo
holder's transport instead of a requester and shares the fit only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from mqnc.base.checks import check_int
from mqnc.model import MLAGeometry
from mqnc.serving.compute import kernel_ops
from mqnc.serving.requester import Requester

__all__ = [
    "RouteSample",
    "FetchSample",
    "sample_rounds",
    "probe_times",
    "route_sweep",
    "fetch_samples",
    "merge_times",
]


@dataclasses.dataclass(frozen=True)
class RouteSample:
    """One routed call's times (us).

    Attributes
    ----------
    tokens : int
        Query tokens (``B``).
    rows : int
        ``M_q = B * H``.
    round_trip_us : float
        The whole call less the holder's kernel call (what :func:`mqnc.cost.fit_route` fits).
    compute_us : float
        The holder's kernel call (from the reply's header).
    send_us : float
        The requester's pack and put (:attr:`mqnc.serving.CostRecord.transfer_us`).
    work : int
        Row-tokens the kernel attended: ``M_q x`` the chunk's tokens.
    """

    tokens: int
    rows: int
    round_trip_us: float
    compute_us: float
    send_us: float
    work: int


@dataclasses.dataclass(frozen=True)
class FetchSample:
    """One fetch's times (us) and size.

    Attributes
    ----------
    chunk_id, tokens, offset : int
        The chunk, its length and where it was spliced.
    bytes : int
        The chunk's bytes received.
    total_us : float
        The whole call (pull and splice).
    return_us : float
        From the request's put to the chunk's arrival.
    splice_us : float
        The splice into the pool (re-rotation and pool write; the pool write alone at the
        canonical position).
    """

    chunk_id: int
    tokens: int
    offset: int
    bytes: int
    total_us: float
    return_us: float
    splice_us: float

    @property
    def pull_us(self) -> float:
        """The call less its splice."""
        return self.total_us - self.splice_us

    @property
    def splice_us_per_token(self) -> float:
        return self.splice_us / self.tokens


def sample_rounds(
    calls: Mapping[Hashable, Callable[[], Any]],
    *,
    reps: int,
    warmup: int = 0,
    interleave: bool = True,
) -> dict[Hashable, list]:
    """What each of ``calls`` returns, ``reps`` times, after ``warmup`` untimed calls of each
    (all warm-ups first, in the order of ``calls``).

    ``interleave``: ``reps`` rounds, each calling every key once in order (a slow spell of the
    machine touches every key alike); else each key's ``reps`` calls in a row.

    Returns
    -------
    dict
        ``{key: [reps results]}``, in the order of ``calls``.
    """
    check_int("reps", reps, minimum=1)
    check_int("warmup", warmup, minimum=0)
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    out: dict[Hashable, list] = {k: [] for k in calls}
    if interleave:
        for _ in range(reps):
            for k, fn in calls.items():
                out[k].append(fn())
    else:
        for k, fn in calls.items():
            out[k] += [fn() for _ in range(reps)]
    return out


def probe_times(req: Requester, peer: int, *, reps: int, warmup: int) -> list[float]:
    """``reps`` payload-free round trips to ``peer`` (us) after ``warmup`` untimed ones (the
    link's first transfers run slow)."""
    return sample_rounds({peer: lambda: req.probe(peer)}, reps=reps, warmup=warmup)[peer]


def route_sweep(
    req: Requester,
    chunk_id: int,
    sizes: Sequence[int],
    *,
    reps: int,
    warmup: int,
    generator: torch.Generator,
    offset: int | None = None,
    interleave: bool = True,
) -> dict[int, list[RouteSample]]:
    """Routes of ``B`` query tokens (each of ``sizes``) of layer 0 to ``chunk_id``'s first
    holder, :func:`sample_rounds` of them.

    One query per size, drawn from ``generator`` in the order of ``sizes`` (standard normal,
    then the requester's dtype and device); ``offset`` as in :meth:`Requester.route` (a new one
    rotates the query, as a run's routes are).

    Returns
    -------
    dict
        ``{B: [RouteSample per timed call]}``.
    """
    sizes = [check_int("sizes", b, minimum=1) for b in sizes]
    g = req.geometry
    tokens = req.lookup(chunk_id).tokens
    qs = {
        b: torch.randn(b, g.heads, g.d_qk, generator=generator).to(req.device, req.dtype)
        for b in sizes
    }

    def call(b: int) -> RouteSample:
        rec = req.route(chunk_id, qs[b], 0, offset=offset).record
        return RouteSample(
            b,
            rec.m_q,
            rec.total_us - rec.compute_us,
            rec.compute_us,
            rec.transfer_us,
            rec.m_q * tokens,
        )

    calls = {b: (lambda b=b: call(b)) for b in sizes}
    return sample_rounds(calls, reps=reps, warmup=warmup, interleave=interleave)


def fetch_samples(
    req: Requester,
    chunk_ids: Sequence[int],
    *,
    rounds: int,
    warmup: int = 0,
    moved: bool = True,
) -> list[FetchSample]:
    """Fetches of every chunk of ``chunk_ids`` (interleaved) in ``warmup`` untimed rounds and
    ``rounds`` timed ones, each round's copies evicted after it: the requester's pool is left
    as it was found.

    ``moved``: each spliced at a new offset (round ``k``, warm-ups counted: the first offset
    from ``position + 1 + k`` at which the pool keeps no copy of the chunk; the splice
    re-rotates it); else at the canonical position (the pool write alone).

    Returns
    -------
    list of FetchSample
        The timed rounds' calls, in order.

    Raises
    ------
    ValueError
        Not ``moved`` and the pool already keeps a chunk at its canonical position (it would
        be reused, not fetched).
    """
    check_int("rounds", rounds, minimum=1)
    check_int("warmup", warmup, minimum=0)
    infos = [req.lookup(c) for c in chunk_ids]
    if not moved:
        kept = [i.chunk_id for i in infos if (i.chunk_id, i.position) in req.local_chunks]
        if kept:
            raise ValueError(
                f"chunk_ids: expected chunks not kept at their canonical position, got {kept}"
            )
    out = []
    for k in range(warmup + rounds):
        spliced = []
        for info in infos:
            offset = info.position
            if moved:
                offset += 1 + k
                while (info.chunk_id, offset) in req.local_chunks:
                    offset += 1
            req.fetch(info.chunk_id, offset=offset)
            spliced.append((info.chunk_id, offset))
            rec = req.costs[-1]
            if k >= warmup:
                out.append(
                    FetchSample(
                        info.chunk_id,
                        info.tokens,
                        offset,
                        rec.bytes_recv,
                        rec.total_us,
                        rec.return_us,
                        rec.splice_us,
                    )
                )
        for chunk_id, offset in spliced:
            req.evict_local(chunk_id, offset)
    return out


def merge_times(
    kernels: str,
    partials: int,
    geometry: MLAGeometry,
    *,
    generator: torch.Generator,
    dtype: torch.dtype,
    device: torch.device | str,
    reps: int,
    warmup: int = 1,
    width: int | None = None,
) -> list[float]:
    """The merge of ``partials`` one-token partials (an agent's chunks and its suffix) by
    ``kernels``' ``merge_partials`` (us per call) after ``warmup`` untimed calls.

    ``o [partials, 1, H, width]`` (``width``: default ``d_v``) drawn from ``generator`` in
    ``dtype``, then ``lse [partials, 1, H]`` in float32; both moved to ``device``.
    """
    check_int("partials", partials, minimum=1)
    g = geometry
    width = g.d_v if width is None else check_int("width", width, minimum=1)
    o = torch.randn(partials, 1, g.heads, width, generator=generator).to(dtype)
    lse = torch.randn(o.shape[:3], generator=generator)
    o, lse = o.to(device), lse.to(device)
    ops = kernel_ops(kernels)

    def call() -> float:
        t0 = time.perf_counter()
        ops.merge_partials(o, lse, layout="MBHD")
        return (time.perf_counter() - t0) * 1e6

    return sample_rounds({"merge": call}, reps=reps, warmup=warmup)["merge"]
