"""The routed wave's queue: what a route call costs when it goes out with others (§4.2, §6.3).

The demo routes the rows of all agents of one layer together (:meth:`Requester.route_many`):
the requester sends every request of the wave, then awaits the replies in the order it sent
them, and each holder answers what has arrived whenever it is free, one kernel call per
(dense | selection) group (dispatcher batching, §6.3). A call's time is then its own route
(§4.2: the round trip's fixed part, its bytes out and back, the compute of the holder batch it
was answered in) plus the queueing the wave adds: the sends after it (the requester awaits
nothing before the wave is out), the holder's earlier batches, the replies before it.

:func:`predict_wave` plays that out with this machine's constants (all measured at start-up,
never taken from the run it predicts): ``T_probe + turnaround`` and ``BW`` of the fabric, the
requester's time to send one request (``send_us``: rotate, pack, put), and the holder's kernel
call as ``compute_fixed_us + compute_us_per_row_token * work`` (work: query rows x attended
tokens of the whole call, measured in waves to one holder at a time). Holders that share a CPU
core (:func:`mqnc.demo.cluster.cpu_plan`) take turns on it. A send in a wave is priced at its
mean over waves shaped like the run's (to every holder at once): the engine's threads carry
replies meanwhile, and a busy holder takes a request later. Nothing else is assumed to run on
the machine: on a loaded one the measured times stretch beyond the model.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from mqnc.cost import FabricProfile, bytes_to_us
from mqnc.model import MLAGeometry

__all__ = ["RouteConstants", "WaveCall", "predict_wave", "WAVE_TERMS"]

WAVE_TERMS = ("probe", "transfer", "compute", "return_", "queue")
"""The terms of a predicted routed call (us); ``total`` is their sum."""


@dataclasses.dataclass(frozen=True)
class RouteConstants:
    """The requester's and the holder's side of a routed call on this machine (us).

    ``send_alone_us``: the requester's work to put one request out (rotation, packing, the
    put until the holder's receiver has it) when nothing else is in flight (part of the route's
    fixed round trip); ``send_us``: the same, averaged over the requests of a wave (the engine's
    threads then also carry the replies, and a busy holder takes a request later);
    ``compute_fixed_us + compute_us_per_row_token * work``: one holder kernel call over
    ``work`` query rows x attended tokens (the call of a batch of requests: their sum).
    """

    send_us: float
    send_alone_us: float
    compute_fixed_us: float
    compute_us_per_row_token: float

    def compute_us(self, work: float) -> float:
        """One holder kernel call over ``work`` rows x tokens."""
        return self.compute_fixed_us + self.compute_us_per_row_token * work


@dataclasses.dataclass(frozen=True)
class WaveCall:
    """One request of a wave, in send order: its holder, ``M_q`` rows, the rows x tokens its
    kernel call computes over (``work``; a selection's index row counts at its full width,
    ``-1`` padding included, as the kernel walks it) and whether it is a selection (sparse)
    request."""

    peer: int
    m_q: int
    work: int
    sparse: bool = False


def _serve(arrive: list[float], calls: list[WaveCall], idx: list[int], k: RouteConstants):
    """The service of requests ``idx`` by the holders on one core: whenever the core is free,
    the holder of the earliest waiting request takes everything of its own that has arrived
    and runs one kernel call per group (dense, selection), replying to each group as its call
    ends. Returns ``{i: (done_us, own_call_us)}``."""
    out: dict[int, tuple[float, float]] = {}
    pending = sorted(idx, key=arrive.__getitem__)
    free = 0.0
    while pending:
        start = max(free, arrive[pending[0]])
        peer = calls[pending[0]].peer
        batch = [i for i in pending if calls[i].peer == peer and arrive[i] <= start]
        pending = [i for i in pending if i not in batch]
        t = start
        for sparse in dict.fromkeys(calls[i].sparse for i in batch):
            group = [i for i in batch if calls[i].sparse == sparse]
            call = k.compute_us(sum(calls[i].work for i in group))
            t += call
            for i in group:
                out[i] = (t, call)
        free = t
    return out


def predict_wave(
    calls: list[WaveCall],
    geometry: MLAGeometry,
    fabric: FabricProfile,
    k: RouteConstants,
    cores: dict[int, int] | None = None,
) -> list[dict[str, float]]:
    """Every call's predicted terms (us) in a wave of ``calls`` (send order); ``cores`` maps a
    holder to the CPU core it shares with others (None: every holder computes on its own).

    Each call: ``probe`` (``T_probe`` + turnaround), ``transfer`` (its query rows out at
    ``BW``), ``compute`` (the holder kernel call that answered it), ``return_`` (its partial
    back at ``BW``) and ``queue`` (what the wave adds: the sends after it, the holder's calls
    before its own, replies before it), and ``total``, their sum. A wave of one call is the
    plain §4.2 route: ``probe + transfer + compute + return``.
    """
    fixed = fabric.t_probe_us + fabric.turnaround_us
    out_us = [bytes_to_us(c.m_q * geometry.q_row_bytes, fabric.bw_gbps) for c in calls]
    back_us = [bytes_to_us(c.m_q * geometry.p_row_bytes, fabric.bw_gbps) for c in calls]
    n = len(calls)
    # request i is sent when the sends before it are done and reaches its holder after half of
    # the fixed round trip less a send alone (the other half is the reply's)
    send = k.send_us if n > 1 else k.send_alone_us
    half = max(fixed - k.send_alone_us, 0.0) / 2
    start = [i * send for i in range(n)]
    arrive = [start[i] + send + half + out_us[i] for i in range(n)]
    by_core: dict[int, list[int]] = defaultdict(list)
    for i, c in enumerate(calls):
        by_core[c.peer if cores is None else cores[c.peer]].append(i)
    served: dict[int, tuple[float, float]] = {}
    for idx in by_core.values():
        served.update(_serve(arrive, calls, idx, k))
    terms, t = [], n * send  # the requester awaits once every request is out
    for i in range(n):
        done, call = served[i]
        t = max(t, done + half + back_us[i])
        total = t - start[i]
        own = dict(probe=fixed, transfer=out_us[i], compute=call, return_=back_us[i])
        own["queue"] = max(total - sum(own.values()), 0.0)
        own["total"] = sum(own.values())
        terms.append(own)
    return terms
