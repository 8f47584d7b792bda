"""The demo's workload planned from this machine's constants (§4, §5.5): which chunks the
whole-chunk agents read, and how many of them read each one, chosen nearest the predicate's
crossover (straddling it where the corpus' lengths reach it).

The predicate's request for one (chunk, context) (:func:`read_request`): the agents that read a
chunk at the same offset (a team: sub-agents forked from one context, each with its own suffix)
share what the requester's pool keeps, so a fetch or a re-prefill is paid once for all of them,
while route is paid per reader: each reader's own call per layer and step (``readers x steps x
L`` round trips of ``H`` rows). The requester's partial attention and the merge are paid by
every primitive and are left out (``attention=False``).

A route call is priced as the demo's wave model (:func:`mqnc.demo.waves.predict_wave`) prices it
on its own (:func:`holder_overhead`): the predicate's round trip (probe, turnaround, the rows'
bytes out and back) plus what the call pays on the holder beyond it, the holder's kernel call
(``compute_fixed_us + compute_us_per_row_token x H x tokens``; a selection's over its index
row's width) and whatever of the holder's host work and the requester's send the round trip does
not cover, carried as the predicate's host term (:class:`mqnc.cost.HostOverhead`, shown by
``explain()``). Route's cost therefore grows with the readers and, through the holder's kernel,
with the chunk; fetch's and local's with the chunk and not with the readers: route wins a chunk
read by few agents where its holder call grows by less a token than the pull and splice do, and
long enough for that to pay its fixed calls; fetch or local a short one or a shared one (the
paper's "fetch only to amortise", §5.5).

:func:`plan_workload` prices every chunk of the corpus for every team size ``1 ..
whole_agents`` (and the selection agents' reads at the canonical positions) with
:func:`decide_read`, splits the whole-chunk agents into at most three teams so that every path
the constants let win in this corpus is read somewhere (ties: more distinct team sizes, then
the first split in order), and gives each team the chunks nearest the crossover at its size,
taking the paths in turn (where two paths win somewhere, the chunk lengths straddle the
crossover). A path that wins for no chunk of the corpus and no team size is named, with the
numbers that rule it out (:attr:`Plan.never`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from mqnc.cost import PRIMITIVES, Decision, HostOverhead, MachineProfile, Request, decide
from mqnc.demo.waves import RouteConstants, WaveCall, predict_wave
from mqnc.model import MLAGeometry

__all__ = [
    "Plan",
    "Team",
    "read_request",
    "holder_overhead",
    "decide_read",
    "plan_workload",
    "crossover_tokens",
    "decision_lines",
    "check_lines",
]

MAX_TEAMS = 3
"""The whole-chunk agents are split into at most this many teams (one per path suffices)."""
PREAMBLE = 32
"""Tokens of team ``t``'s own preamble before its chunks: ``PREAMBLE * (t + 1)`` (a new offset
for every chunk it reads)."""


def read_request(
    geometry: MLAGeometry, tokens: int, *, moved: bool, readers: int, steps: int
) -> Request:
    """The predicate's request for a chunk of ``tokens`` read by ``readers`` agents at one offset
    for ``steps`` decode steps: route ``readers x steps x L`` round trips of ``H`` rows, fetch
    (spliced when ``moved``, else only written) and local once; attention and merge left out
    (every primitive pays them)."""
    return Request(
        geometry.heads,
        tokens,
        moved=moved,
        attention=False,
        round_trips=readers * steps * geometry.layers,
    )


def holder_overhead(
    geometry: MLAGeometry, profile: MachineProfile, m_q: int, width: int
) -> HostOverhead | None:
    """What one route call of ``m_q`` rows over ``width`` attended tokens pays beyond the
    predicate's round trip and beyond what fetch and local pay for the same rows, as the wave
    model prices the call on its own: its total (:func:`mqnc.demo.waves.predict_wave`, a wave of
    one) less its probe, turnaround and bytes out and back, less the attention call itself
    (``compute_fixed_us + compute_us_per_row_token x m_q x width``: the holder runs it for a
    route, the requester runs the same kernel over its copy for a fetch or a re-prefill, so it
    is left out of all three, as the predicate's ``attention=False`` leaves it). What remains
    is the excess of the requester's send alone and the holder's host work per request over
    the round trip (the wave model's queue), never below 0. As a
    :class:`~mqnc.cost.HostOverhead` (fixed, at these ``m_q`` rows) for
    :func:`mqnc.cost.decide`; None when ``profile`` lacks the routed call's measured sides
    (``send_us``, ``send_alone_us``, ``compute_fixed_us``, ``compute_us_per_row_token``).

    ``width``: a dense call's chunk tokens, a selection's index row (its full width, ``-1``
    padding included, as the holder's kernel walks it and the run's waves count it)."""
    terms = profile.terms()
    sides = ("send_us", "send_alone_us", "compute_fixed_us", "compute_us_per_row_token")
    if not all(k in terms for k in sides):
        return None
    k = RouteConstants.from_terms(terms)
    (lone,) = predict_wave([WaveCall(1, m_q, m_q * width)], geometry, profile.fabric, k)
    trip = lone["probe"] + lone["transfer"] + lone["return_"]
    attention = k.compute_fixed_us + k.compute_us_per_row_token * m_q * width
    return HostOverhead(max(lone["total"] - trip - attention, 0.0), 0.0)


def decide_read(
    geometry: MLAGeometry,
    profile: MachineProfile,
    tokens: int,
    *,
    moved: bool,
    readers: int,
    steps: int,
    width: int | None = None,
) -> Decision:
    """The predicate's decision for a chunk of ``tokens`` read by ``readers`` agents at one
    offset for ``steps`` steps (:func:`read_request`), each route call priced with the holder's
    side (:func:`holder_overhead`; ``width``: the tokens each call attends, default
    ``tokens``; a selection's index row width)."""
    request = read_request(geometry, tokens, moved=moved, readers=readers, steps=steps)
    holder = holder_overhead(geometry, profile, request.m_q, tokens if width is None else width)
    return decide(geometry, profile if holder is None else profile.replace(host=holder), request)


@dataclasses.dataclass(frozen=True)
class Team:
    """Whole-chunk agents forked from one context: ``size`` agents reading ``chunks`` (in this
    order, after the team's preamble) at the same offsets."""

    size: int
    chunks: tuple[int, ...]


@dataclasses.dataclass
class Plan:
    """The planned workload and what the constants say about it.

    Attributes
    ----------
    teams : list of Team
        The whole-chunk agents, team by team (agents ``whole-0 ..`` in this order).
    picks : dict
        ``picks[n][chunk]``: the predicate's pick for the chunk read at a new offset by ``n``
        agents (``n`` in ``1 .. whole_agents``).
    selection : dict
        ``selection[chunk]``: the pick for the selection agents' reads (canonical positions).
    crossover : dict
        ``crossover[n]``: chunk tokens above which route wins for ``n`` readers at a new offset
        (0: at every length; inf: at none; :func:`crossover_tokens`).
    never : dict
        Path -> why it wins nowhere in this workload, from the constants' numbers.
    left_out : dict
        Path -> why it wins somewhere but no team reads it (too few agents or chunks).
    """

    teams: list[Team]
    picks: dict[int, dict[int, str]]
    selection: dict[int, str]
    crossover: dict[int, float]
    never: dict[str, str]
    left_out: dict[str, str]

    def to_dict(self) -> dict:
        """The JSON form (``demo.json``'s ``workload``)."""
        return dict(
            teams=[dict(size=t.size, chunks=list(t.chunks)) for t in self.teams],
            picks={str(n): {str(c): p for c, p in ps.items()} for n, ps in self.picks.items()},
            selection={str(c): p for c, p in self.selection.items()},
            crossover_tokens={
                str(n): (None if math.isinf(x) else x) for n, x in self.crossover.items()
            },
            never=dict(self.never),
            left_out=dict(self.left_out),
        )


def crossover_tokens(
    geometry: MLAGeometry, profile: MachineProfile, *, readers: int, steps: int
) -> float:
    """Chunk tokens above which route beats the cheaper of fetch and local for ``readers``
    agents reading a moved chunk for ``steps`` steps (bisection on :func:`decide_read`'s costs:
    route's grows with the chunk only through the holder's kernel call, and where that grows
    by less a token than the cheaper path the gap falls with the chunk); 0 when route wins at
    one token, ``inf`` when it loses at 2**24 (its holder call growing as fast as fetch or
    local, or its fixed calls never paid back)."""

    def gap(tokens: float) -> float:
        c = decide_read(geometry, profile, tokens, moved=True, readers=readers, steps=steps).costs
        return c["route"] - min(c["fetch"], c["local"])

    lo, hi = 1.0, float(1 << 24)
    if gap(lo) < 0:
        return 0.0
    if gap(hi) >= 0:
        return math.inf
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gap(mid) >= 0 else (lo, mid)
    return hi


def plan_workload(
    *,
    geometry: MLAGeometry,
    profile: MachineProfile,
    lengths: list[int],
    whole_agents: int,
    chunks_per_agent: int,
    selection_agents: int,
    steps: int,
    topk: int | None = None,
) -> Plan:
    """The whole-chunk agents' teams and chunks for this corpus (``lengths``) under
    ``profile`` (the module's docstring says how).

    Parameters
    ----------
    geometry : MLAGeometry
        The demo's model.
    profile : MachineProfile
        The constants the predicate decides with (the first calibration, or ``--profile``).
    lengths : list of int
        Each chunk's tokens.
    whole_agents, chunks_per_agent, selection_agents, steps : int
        The run's agents and decode steps (:class:`~mqnc.demo.config.DemoConfig`).
    topk : int or None
        The selection agents' index row width (``DemoConfig.topk``): what their route calls
        attend on the holder (None: the whole chunk).

    Returns
    -------
    Plan
    """
    chunks = range(len(lengths))
    decided: dict[int, dict[int, Decision]] = {
        n: {
            c: decide_read(geometry, profile, lengths[c], moved=True, readers=n, steps=steps)
            for c in chunks
        }
        for n in range(1, whole_agents + 1)
    }
    picks = {n: {c: d.primitive for c, d in ds.items()} for n, ds in decided.items()}
    selected = _selection_reads(geometry, profile, lengths, selection_agents, steps, topk)
    selection = {c: d.primitive for c, d in selected.items()}

    def teams_of(sizes: tuple[int, ...]) -> list[Team]:
        teams: list[Team] = []
        for size in sizes:
            taken = {c for t in teams if t.size == size for c in t.chunks}
            teams.append(Team(size, _nearest_crossover(decided[size], taken, chunks_per_agent)))
        return teams

    def covered(teams: list[Team]) -> set[str]:
        return {picks[t.size][c] for t in teams for c in t.chunks} | set(selection.values())

    best = None
    for sizes in _splits(whole_agents):
        teams = teams_of(sizes)
        score = (len(covered(teams)), len(set(sizes)))
        if best is None or score > best[0]:
            best = (score, teams)
    teams = best[1] if best else []
    wins = {p for ps in picks.values() for p in ps.values()} | set(selection.values())
    shown = covered(teams)
    never = {
        p: _why_never(p, decided, selected, selection_agents, geometry, profile, lengths, steps)
        for p in PRIMITIVES
        if p not in wins
    }
    left_out = {}
    for p in PRIMITIVES:
        if p in wins and p not in shown:
            n, c = min((n, c) for n, ps in picks.items() for c, q in ps.items() if q == p)
            left_out[p] = (
                f"{p} wins chunk {c} ({lengths[c]} tokens) read by {n} agent(s); the "
                f"{whole_agents} whole-chunk agents' teams read other chunks"
            )
    crossover = {
        n: crossover_tokens(geometry, profile, readers=n, steps=steps)
        for n in sorted({t.size for t in teams})
    }
    return Plan(teams, picks, selection, crossover, never, left_out)


def _selection_reads(geometry, profile, lengths, agents: int, steps: int, topk) -> dict:
    """Chunk -> the decision for the selection ``agents``' reads of it (at its canonical
    position; each route call over the index row, ``topk`` wide); empty without them."""
    if not agents:
        return {}
    return {
        c: decide_read(
            geometry, profile, tokens, moved=False, readers=agents, steps=steps, width=topk
        )
        for c, tokens in enumerate(lengths)
    }


def _splits(total: int) -> list[tuple[int, ...]]:
    """The ways to split ``total`` agents into at most :data:`MAX_TEAMS` teams (sizes
    ascending), in lexicographic order."""
    out = []

    def rest(left: int, smallest: int, parts: tuple[int, ...]) -> None:
        if left == 0:
            out.append(parts)
            return
        if len(parts) == MAX_TEAMS:
            return
        for size in range(smallest, left + 1):
            rest(left - size, size, (*parts, size))

    if total > 0:
        rest(total, 1, ())
    return sorted(out)


def _nearest_crossover(decided: dict[int, Decision], taken: set[int], k: int) -> tuple[int, ...]:
    """``k`` chunks, the paths in turn (route, fetch, local), each path's chunks nearest the
    crossover first (smallest margin to the runner-up), chunks another team of the same size
    reads last."""
    groups: dict[str, list[int]] = defaultdict(list)
    for c, d in decided.items():
        groups[d.primitive].append(c)
    for p in groups:
        groups[p].sort(key=lambda c: (c in taken, decided[c].margin_ratio, c))
    order = [p for p in PRIMITIVES if p in groups]
    picked: list[int] = []
    while len(picked) < min(k, len(decided)):
        for p in order:
            if groups[p] and len(picked) < k:
                picked.append(groups[p].pop(0))
    return tuple(picked)


def _why_never(p, decided, selected, selection_agents, geometry, profile, lengths, steps) -> str:
    """Why ``p`` wins no read of this workload: each path's unit terms (route a call, fetch and
    local a token) and where ``p`` comes closest (its cost against the winner's)."""
    cases = [(n, c, True, d) for n, ds in decided.items() for c, d in ds.items()]
    cases += [(selection_agents, c, False, d) for c, d in selected.items()]
    if not cases:
        return f"{p} never wins here: no agent reads a chunk"
    n, c, moved, d = min(cases, key=lambda t: (t[3].costs[p] / t[3].costs[t[3].primitive], t[1]))
    tokens, costs, trips = lengths[c], d.costs, d.inputs["round_trips"]
    splice = "splice" if moved else "pool write"
    r = d.route
    units = dict(
        route=f"route {r.total / trips:,.1f} us a call (round trip {r.transport / trips:,.1f} "
        f"+ holder {r.host / trips:,.1f}), paid by every reader at every layer and step",
        fetch=f"fetch {d.fetch.total / tokens:,.1f} us a token (pull {d.fetch.pull / tokens:.2f}"
        f" + {splice} {d.fetch.splice / tokens:.2f}), once for all readers",
        local=f"local {d.local_us / tokens:,.1f} us a token ({geometry.layers} layers x "
        f"{profile.local_c_us:.1f} of re-prefill), once for all readers",
    )
    where = "at a new offset" if moved else "in place"
    agents = f"{n} agent" + "s" * (n != 1)
    why = (
        f"{p} never wins here: {units[p]}; {units[d.primitive]}. Closest: chunk {c} ({tokens} "
        f"tokens) read by {agents} {where}, {p} {costs[p]:,.0f} us against {d.primitive} "
        f"{costs[d.primitive]:,.0f} us"
    )
    per_reader = d.route.total / n  # route is paid per reader, fetch and local once
    if p == "route":
        why += _route_at_length(geometry, profile, steps)
    elif d.primitive == "route" and math.isfinite(costs[p]) and per_reader > 0:
        need = math.floor(costs[p] / per_reader) + 1
        why += f"; {need} agents sharing this read would {p} it (--whole-agents)"
    return why + "."


def _route_at_length(geometry, profile, steps: int) -> str:
    """Where one agent would route a chunk at a new offset: above its crossover, or at no
    length, with route's and the cheaper path's growth a token (route's: the holder's kernel
    over the agent's calls)."""
    x = crossover_tokens(geometry, profile, readers=1, steps=steps)
    if not math.isinf(x):
        return f"; one agent would route a chunk above {x:,.0f} tokens (--max-tokens)"
    a, b = (decide_read(geometry, profile, t, moved=True, readers=1, steps=steps) for t in (1, 2))
    other = min(("fetch", "local"), key=lambda q: b.costs[q])
    grow = {q: b.costs[q] - a.costs[q] for q in ("route", other)}
    return (
        f"; one agent would route a chunk at no length: its calls grow by {grow['route']:,.2f} "
        f"us a token (the holder's kernel), {other} by {grow[other]:,.2f}"
    )


# ---- printing -----------------------------------------------------------------------------------

_GROUP = 4
"""Reads by the same agents that the predicate sent the same way, at least this many, print as
one line (the selection agents' reads of every chunk)."""


def decision_lines(decisions: list[dict], plan: dict | None, width: int = 100) -> list[str]:
    """The decisions as printed: the count per path, the terms each path is priced with, one
    line per (chunk, context) with the predicted us of each path and the pick (the selection
    agents' like reads grouped), the crossover, and the paths that never win with why.

    ``decisions``: ``demo.json``'s ``decisions`` (one per (chunk, agent)); ``plan``: its
    ``workload`` (:meth:`Plan.to_dict`) or None."""
    import textwrap

    counts = {p: 0 for p in PRIMITIVES}
    for d in decisions:
        counts[d["primitive"]] += 1
    said = ", ".join(f"{p} {v}" for p, v in counts.items())
    if any(d["primitive"] != d.get("predicate", d["primitive"]) for d in decisions):
        own = {p: sum(d["predicate"] == p for d in decisions) for p in PRIMITIVES}
        said += " (--force; the predicate's: " + ", ".join(f"{p} {v}" for p, v in own.items())
        said += ")"
    lines = [f"\ndecisions per (chunk, agent): {said}"]
    rows: dict[tuple, dict] = {}
    for d in decisions:
        key = (d["chunk"], d.get("offset"), tuple(d.get("readers") or [d["agent"]]))
        rows.setdefault(key, d)
    if not rows or "explain" not in next(iter(rows.values())):
        return lines
    for line in _terms_lines(list(rows.values())):
        lines += textwrap.wrap(line, width, subsequent_indent=" " * 9)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for (_, _, who), d in rows.items():
        groups[(who, d["predicate"], d["moved"])].append(d)
    table = []  # (names, reads): one read, or like reads on one line
    for (who, _, moved), ds in groups.items():
        names = _names(who) + ("" if moved else " in place")
        if len(ds) >= _GROUP:
            table.append((names, ds))
        else:
            table += [(names, [d]) for d in sorted(ds, key=lambda d: d["tokens"])]
    for scale, unit in ((1.0, "us"), (1e3, "ms")):  # ms when us would not fit
        text = _table(table, scale, unit)
        if max(len(line) for line in text) <= width:
            break
    lines += text
    lines.append(
        "* the predicate's pick, x its margin over the runner-up; agents reading a chunk in one"
    )
    lines.append("context share one fetch or re-prefill of it, and each pays its own route calls")
    crossover = (plan or {}).get("crossover_tokens") or {}
    if crossover:
        parts = []
        for n, x in crossover.items():
            agents = f"{n} agent" + "s" * (int(n) != 1)
            at = "at every length" if x == 0 else "at no length" if x is None else f"above {x:,.0f}"
            parts.append(f"by {agents} {at}" + " tokens" * (x is not None and x > 0))
        lo = min(d["tokens"] for d in decisions)
        hi = max(d["tokens"] for d in decisions)
        text = (
            f"crossover: route wins a chunk read at a new offset {', '.join(parts)} (the chunks "
            f"read here: {lo}-{hi} tokens)"
        )
        lines += textwrap.wrap(text, width)
    for why in {**(plan or {}).get("never", {}), **(plan or {}).get("left_out", {})}.values():
        lines += textwrap.wrap(why, width, subsequent_indent="  ")
    return lines


def _names(who: tuple[str, ...], width: int = 20) -> str:
    """Agent names within ``width`` columns (``whole-1, whole-2``; ``whole-0..5`` when long)."""
    text = ", ".join(who)
    if len(text) <= width:
        return text
    return f"{who[0]}..{who[-1].rsplit('-', 1)[-1]} ({len(who)})"[:width]


def _terms_lines(ds: list[dict]) -> list[str]:
    """Each path's terms, per round trip (route) and per token (fetch, local), read off the
    decisions' own breakdowns (every route call moves one token's ``H`` rows)."""
    out = [
        "predicted us of each path for the whole decode over a chunk, by the first calibration's",
        "constants (the predicate decides before any decode; every term in demo.json's decisions):",
        _route_terms(ds),
    ]
    fetch = {}
    for moved, what in ((True, "splice"), (False, "pool write")):
        got = [x for x in ds if x["moved"] is moved and not x["explain"]["fetch"]["selection"]]
        if got:
            x = max(got, key=lambda x: x["tokens"])
            f, t = x["explain"]["fetch"], x["tokens"]
            fetch[what] = (f["pull"] / t, f["splice"] / t)
    if fetch:
        pull = next(iter(fetch.values()))[0]
        how = " or ".join(
            f"{what} {us:.2f} ({'at a new offset' if what == 'splice' else 'in place'})"
            for what, (_, us) in fetch.items()
        )
        out.append(f"  fetch  pull {pull:.2f} us a token + {how}")
    d = ds[0]
    c_us = d["explain"]["inputs"]["c_us"]
    layers = round(d["explain"]["local"]["total"] / (d["tokens"] * c_us)) if c_us else 0
    out.append(
        f"  local  re-prefill {layers} layers x {c_us:.1f} = {layers * c_us:,.1f} us a token"
    )
    return out


def _route_terms(ds: list[dict]) -> str:
    """Route's line: a call's round trip and, where the decisions carry it, the holder's side
    (the predicate's host term: :func:`holder_overhead`), the latter over the reads' range
    (it grows with the tokens a call attends)."""
    per = []
    for d in ds:
        r, trips = d["explain"]["route"], d["explain"]["inputs"]["round_trips"]
        per.append({k: (r.get(k) or 0.0) / trips for k in r if k != "transport"})
    first = per[0]
    trip = (
        f"probe {first['probe']:.1f} + turnaround {first['turnaround']:.1f} + query "
        f"{first['transfer']:.1f} + partial {first['return']:.1f}"
    )
    if not max(x["host"] for x in per):
        return f"  route  calls x {first['total']:,.1f} us a round trip ({trip})"

    def span(key: str) -> str:
        lo, hi = (f"{f(x[key] for x in per):,.1f}" for f in (min, max))
        return lo if lo == hi else f"{lo}-{hi}"

    return (
        f"  route  calls x {span('total')} us a call: round trip "
        f"{first['total'] - first['host']:,.1f} ({trip}) + queue {span('host')} (the send and "
        "the holder's host work beyond the round trip; the attention, the holder's for a "
        "route, the requester's for a fetch or local, is left out of all three)"
    )


_SEPS = (" ", "  ", "  ", "  ", " ", " ", "  ")
"""The space before each column of the decisions' table after the first."""


def _table(table: list[tuple[str, list[dict]]], scale: float, unit: str) -> list[str]:
    """The decisions' rows, each ``(names, reads)``: one read, or like reads (same agents, same
    pick) with each column's range and their count in the chunk column; costs in ``unit``
    (``scale`` us each), ``*`` on the predicate's pick; columns as wide as their cells."""

    def span(xs, fmt) -> str:
        lo, hi = fmt(min(xs)), fmt(max(xs))
        return lo if lo == hi else f"{lo}-{hi}"

    def cost(x: float) -> str:
        return f"{x / scale:,.0f}" if unit == "us" else f"{x / scale:,.1f}"

    def ratio(x: float) -> str:
        return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:,.0f}"

    head = ["chunk", "tokens", "read by", "calls", *(f"{p} {unit}" for p in PRIMITIVES), "pick"]
    rows = []
    for names, ds in table:
        pick = ds[0]["predicate"]
        rows.append(
            [
                str(ds[0]["chunk"]) if len(ds) == 1 else f"({len(ds)})",
                span([d["tokens"] for d in ds], str),
                names,
                span([d["round_trips"] for d in ds], str),
                *(
                    span([d["costs_us"][p] for d in ds], cost) + ("*" if p == pick else " ")
                    for p in PRIMITIVES
                ),
                f"{pick} x{span([d['margin_ratio'] for d in ds], ratio)}",
            ]
        )
    wide = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    left = {2, 7}  # the names and the pick; the numbers right-aligned (a pick's "*" beside)
    out = []
    for r in [head, *rows]:
        cells = []
        for i, cell in enumerate(r):
            if i in left:
                cells.append(cell.ljust(wide[i]))
            elif 4 <= i <= 6 and r is not head:
                cells.append(cell.rjust(wide[i]))
            else:
                cells.append(cell.rjust(wide[i] - (4 <= i <= 6)) + " " * (4 <= i <= 6))
        line = cells[0] + "".join(sep + c for sep, c in zip(_SEPS, cells[1:], strict=True))
        out.append(line.rstrip())
    return out


def check_lines(decisions: list[dict], checked: dict, plan: dict | None, repeats: int) -> list[str]:
    """The summary: per path, its decisions and how its partials in the predicate's decode
    compared with fp64 (``checked[path]``: each partial's max |err|), or why it has none."""
    counts = {p: 0 for p in PRIMITIVES}
    for d in decisions:
        counts[d["primitive"]] += 1
    times = f" ({repeats} repeats)" if repeats > 1 else ""
    out = [
        f"\nper path, the predicate's decode{times}; exact: every partial within one bf16 ulp "
        "of fp64"
    ]
    never = (plan or {}).get("never", {})
    for p in PRIMITIVES:
        errs = checked.get(p, [])
        head = f"  {p:<6}{counts[p]:>4} (chunk, agent) decisions"
        if errs:
            out.append(f"{head} {len(errs):>6} partials, max |err| {max(errs):.2e}: exact")
        elif counts[p]:
            out.append(f"{head}      0 partials (every request answered by another path)")
        else:
            out.append(f"{head}" + (": never wins here (above)" if p in never else ""))
    return out
