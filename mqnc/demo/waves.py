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
requester's time to send one request (``send_us``: rotate, pack, put), the holder's kernel
call as ``compute_fixed_us + compute_us_per_row_token * work`` (work: query rows x attended
tokens of the whole call, measured in waves to one holder at a time: its core's own speed)
and the holder's host work per request it answers (``host_us``: taking the request in,
packing and putting its reply), which occupies its core like the kernel does; the replies of
a kernel call go out one by one, each as its own host work ends (the holder streams them: a
lone request's reply does not wait for a batch's).

Holders that share a CPU core (:func:`mqnc.demo.cluster.cpu_plan` puts both on one core of a
2-core machine) share it as the OS' fair scheduler does: equally among the holders busy at
the same moment (processor sharing), not one after the other. A call that overlaps the other
holder's work therefore takes longer on the wall clock (its ``compute`` term is that wall time,
which is what the holder measures and reports), and the requests of both holders are answered
near the end of their common busy period rather than one holder's early and the other's late.
Measured on this 2-core machine after the transport's host path was sped up: with the two
holders' calls modelled one after the other (FIFO per core) the model predicted half the holder
compute the holders reported (962 vs 1910 ms over 200 routes), the kernel's own CPU time per call
agreeing with the calibration; the holders' host work per call (0.7-1.5 ms of CPU, traced) was
not in the model at all. A send in a wave is priced at its mean in a wave (the median over
calibration waves shaped like the run's, to every holder at once): the engine's threads carry
replies meanwhile, and a busy holder takes a request later. Nothing else is assumed to run on
the machine: on a loaded one the measured times stretch beyond the model, wave by wave.
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
    ``work`` query rows x attended tokens (the call of a batch of requests: their sum);
    ``host_us``: the holder's own work per request it answers, on its core (taking the
    request in, packing and putting its reply), which a holder sharing its core with another
    takes from that one too.
    """

    send_us: float
    send_alone_us: float
    compute_fixed_us: float
    compute_us_per_row_token: float
    host_us: float = 0.0

    @classmethod
    def from_terms(cls, terms) -> RouteConstants:
        """From a calibration's terms (a mapping with these fields' names; ``host_us`` 0 when
        absent: the routed call's sides came from a profile)."""
        return cls(
            terms["send_us"],
            terms["send_alone_us"],
            terms["compute_fixed_us"],
            terms["compute_us_per_row_token"],
            terms.get("host_us", 0.0),
        )

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


def _groups(calls: list[WaveCall], batch: list[int], k: RouteConstants) -> list:
    """The kernel calls of one holder batch, in order: ``(requests, core us)`` per group
    (dense, selection; in the order the batch's first request of each came)."""
    out = []
    for sparse in dict.fromkeys(calls[i].sparse for i in batch):
        group = [i for i in batch if calls[i].sparse == sparse]
        out.append((group, k.compute_us(sum(calls[i].work for i in group))))
    return out


def _serve(arrive: list[float], calls: list[WaveCall], idx: list[int], k: RouteConstants):
    """The service of requests ``idx`` by the holders on one core. Each holder, whenever it is idle,
    takes everything of its own that has arrived and runs one kernel call per group (dense,
    selection), each followed by the host work of its requests in turn (``host_us`` each: its reply
    packed and put), each reply going out as its own ends. The core is shared equally by the holders
    busy at the same moment (processor sharing: the OS' fair scheduler time-slices runnable
    processes on a core), so a call's wall time is its core time stretched by the holders busy
    beside it. Returns ``{i: (done_us, own_call_us)}``, the kernel call's wall time (what the holder
    measures: ``holder_ns``)."""
    out: dict[int, tuple[float, float]] = {}
    waiting: dict[int, list[int]] = defaultdict(list)
    for i in sorted(idx, key=arrive.__getitem__):
        waiting[calls[i].peer].append(i)
    # holder -> its phases left, in order: [core us left, requests, kind]; kind "kernel" is a
    # kernel call, each "host" after it one of its requests' replies (which goes out at its end)
    busy: dict[int, list[list]] = {}
    started: dict[int, float] = {}  # holder -> start of its current kernel call
    kernel_us: dict[int, float] = {}  # request -> its kernel call's wall time
    t, eps = 0.0, 1e-9
    while busy or any(waiting.values()):
        for p, queue in waiting.items():  # idle holders take what has arrived
            if p not in busy and queue and arrive[queue[0]] <= t + eps:
                batch = [i for i in queue if arrive[i] <= t + eps]
                waiting[p] = queue[len(batch) :]
                busy[p] = [
                    phase
                    for group, call in _groups(calls, batch, k)
                    for phase in [[call, group, "kernel"]]
                    + [[k.host_us, [i], "host"] for i in group]
                ]
                started[p] = t
        idle_next = [arrive[q[0]] for p, q in waiting.items() if p not in busy and q]
        if not busy:
            t = min(idle_next)
            continue
        share = len(busy)
        dt = min(phases[0][0] for phases in busy.values()) * share
        if idle_next:
            dt = min(dt, max(min(idle_next) - t, 0.0))
        t += dt
        for p in list(busy):
            phases = busy[p]
            phases[0][0] -= dt / share
            while phases and phases[0][0] <= eps:
                _, group, kind = phases.pop(0)
                if kind == "kernel":
                    kernel_us.update(dict.fromkeys(group, t - started[p]))
                else:
                    out.update({i: (t, kernel_us[i]) for i in group})
                    started[p] = t
            if not phases:
                del busy[p]
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
    # the holder's host work per request is its core's time (in _serve), not latency
    half = max(fixed - k.send_alone_us - k.host_us, 0.0) / 2
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
