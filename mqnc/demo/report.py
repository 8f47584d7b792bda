"""The demo's report: per primitive, measured time beside the model's prediction (§4) with this
machine's constants, wire bytes, MAPE and the largest error; printed as tables of at most 100
columns and drawn as measured against predicted per call. :func:`predict_call`,
:func:`primitive_rows`, :func:`print_table` and :func:`plot` serve both demos (``mqnc demo``
and ``mqnc demo --hf``, :mod:`mqnc.demo.hf_demo`).

The table's terms are the ones a call's record measures on its own: the holder's kernel call
(route), the splice (fetch) and the re-prefill (local); ``transport`` is the rest of the call
(the round trip, the bytes, the requester's packing and, for a route in a wave, the queueing
behind the other requests of the wave). The prediction's finer terms (round trip, bytes out and
back, queue) are in ``demo.json``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import textwrap
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

from mqnc.cost import FABRICS, FabricProfile, mape, t_local, t_pull, t_route, t_splice
from mqnc.demo.calibration import Calibration
from mqnc.demo.config import DemoConfig
from mqnc.demo.waves import RouteConstants, WaveCall, predict_wave
from mqnc.demo.workload import Corpus
from mqnc.model import MLAGeometry
from mqnc.serving import CostRecord

WIDTH = 100
"""The columns every printed table fits in."""

__all__ = [
    "Report",
    "predict_call",
    "primitive_rows",
    "replay_routes",
    "spread_mape",
    "median_calls",
    "print_table",
    "plot",
    "TABLE_TERMS",
]

TABLE_TERMS = ("transport", "compute", "splice", "prefill")
"""The table's terms: what a record measures on its own, and the rest of the call."""

_WORK = ("compute", "splice", "prefill")


def predict_call(
    rec: CostRecord,
    geometry: MLAGeometry,
    fabric,
    *,
    tokens: int,
    compute_us_per_row_token: float,
    c_us: float,
    batch_work: int | None = None,
    splice_us: float = 0.0,
    prefill_tokens: int | None = None,
) -> dict[str, float]:
    """The model's terms (§4, microseconds) for one recorded call over a chunk of ``tokens``,
    with this machine's constants: a route's holder compute over ``batch_work`` rows x tokens
    (the batch it was answered in; default its own ``m_q x tokens``), a fetch's pull plus
    ``splice_us``, a local re-prefill of ``prefill_tokens`` (default ``tokens``) at ``c_us``
    per token-layer."""
    g = geometry
    if rec.primitive == "route":
        work = rec.m_q * tokens if batch_work is None else batch_work
        compute = compute_us_per_row_token * work
        r = t_route(g, fabric, rec.m_q, t_compute_us=compute, t_merge_us=0.0)
        return dict(
            probe=r.probe + r.turnaround,
            host=r.host,
            transfer=r.transfer,
            compute=r.compute,
            return_=r.return_,
            total=r.total,
        )
    if rec.primitive == "fetch":
        pull = t_pull(g, fabric, tokens)
        return dict(pull=pull, splice=splice_us, total=pull + splice_us)
    prefill = t_local(g, tokens if prefill_tokens is None else prefill_tokens, c_us)
    return dict(prefill=prefill, total=prefill)


def _measured(rec: CostRecord) -> dict[str, float]:
    """A record's terms in the table's split: its own work, and the rest of the call."""
    work = dict(compute=rec.compute_us, splice=rec.splice_us, prefill=rec.prefill_us)
    return dict(transport=rec.total_us - sum(work.values()), **work, total=rec.total_us)


def primitive_rows(
    records: list[CostRecord],
    predict: Callable[[CostRecord], dict[str, float]],
    errors: dict[str, list[float]],
    where: Callable[[CostRecord], dict] | None = None,
) -> dict:
    """Per primitive (route, fetch, local) of the successful ``records``: count, wire bytes,
    measured and predicted us per term (``predict(record) -> {term: us}``, with ``total``),
    MAPE of the totals, each call's measured and predicted total (with ``where(record)``'s
    fields: a route's wave, a call's repeats), the largest error of its partials in ``errors``."""
    rows = {}
    for prim in ("route", "fetch", "local"):
        recs = [r for r in records if r.primitive == prim and r.ok]
        if recs:
            rows[prim] = _row(prim, recs, predict, errors, where)
    return rows


def _row(prim: str, recs: list[CostRecord], predict, errors: dict, where=None) -> dict:
    preds = [predict(r) for r in recs]
    measured: dict[str, float] = defaultdict(float)
    predicted: dict[str, float] = defaultdict(float)
    for r, p in zip(recs, preds, strict=True):
        for k, v in _measured(r).items():
            measured[k] += v
        for k, v in p.items():
            predicted[k] += v
        predicted["transport"] += p["total"] - sum(p.get(k, 0.0) for k in _WORK)
    return dict(
        count=len(recs),
        wire_bytes=sum(r.bytes_sent + r.bytes_recv for r in recs),
        measured_us=dict(measured),
        predicted_us=dict(predicted),
        mape=mape([p["total"] for p in preds], [r.total_us for r in recs]),
        per_call=[
            dict(
                measured=r.total_us,
                predicted=p["total"],
                m_q=r.m_q,
                chunk=r.chunk_id,
                peer=r.peer,
                layer=r.layer,
                measured_terms=_measured(r) | dict(send=r.transfer_us, wait=r.return_us),
                predicted_terms=p,
                **(where(r) if where is not None else {}),
            )
            for r, p in zip(recs, preds, strict=True)
        ],
        max_abs_error=max(errors.get(prim, [0.0])),
    )


class Report:
    """Measured against predicted, per primitive, for a finished run's cost records.

    ``waves`` maps ``id(record)`` of a route to its wave (the :class:`WaveCall` list in send
    order) and its index there; ``deltas`` maps ``id(record)`` to the call's delta
    (:class:`mqnc.demo.step.Decoder`); ``cores`` maps a holder to its CPU core
    (:func:`mqnc.demo.cluster.cpu_plan`; None: each its own); ``repeats`` maps ``id(record)``
    to the totals of its call over the decode's repeats (:func:`median_calls`: the record is
    their median; each call of :meth:`rows` then carries them as ``measured_repeats``). A
    route is predicted by :func:`predict_wave` over its wave, a fetch as its request's fixed
    part, the pull at the bulk rate and the splice (when the chunk moved; else the pool write
    alone), a local as the re-prefill.
    """

    def __init__(
        self,
        cfg: DemoConfig,
        geometry: MLAGeometry,
        corpus: Corpus,
        cal: Calibration,
        waves: dict[int, tuple[list[WaveCall], int]],
        deltas: dict[int, int],
        cores: dict[int, int] | None = None,
        repeats: dict[int, list[float]] | None = None,
    ) -> None:
        self.cfg, self.geometry, self.corpus, self.cal = cfg, geometry, corpus, cal
        self.waves, self.deltas, self.cores = waves, deltas, cores
        self.repeats = repeats or {}
        self._predicted: dict[int, list[dict[str, float]]] = {}
        self._wave_ids: dict[int, tuple[int, list[WaveCall]]] = {}

    def _route(self, rec: CostRecord) -> dict[str, float]:
        wave, i = self.waves.get(id(rec)) or (None, 0)
        if wave is None:  # not noted (a wave cut short by a failure): on its own, uncached
            tokens = self.corpus.lengths[rec.chunk_id]  # (a cache keyed by a temporary's id
            wave = [WaveCall(rec.peer, rec.m_q, rec.m_q * tokens)]  # would hit a reused id)
            return predict_wave(wave, self.geometry, self.cal.fabric, self.cal.route, self.cores)[0]
        key = id(wave)
        if key not in self._predicted:
            self._predicted[key] = predict_wave(
                wave, self.geometry, self.cal.fabric, self.cal.route, self.cores
            )
        return self._predicted[key][i]

    def predict(self, rec: CostRecord) -> dict[str, float]:
        """The model's terms for one recorded call, with this machine's constants."""
        if rec.primitive == "route":
            return self._route(rec)
        ct, profile = self.corpus.lengths[rec.chunk_id], self.cal.machine_profile(self.cfg)
        if rec.primitive == "fetch":
            moved = self.deltas.get(id(rec), 1) != 0
            splice = t_splice(ct, profile.splice_for(ct, moved, self.geometry.cache_dtype))
            pull = profile.fetch_fixed_us + t_pull(self.geometry, profile.fabric, ct)
            return dict(pull=pull, splice=splice, total=pull + splice)
        prefill = t_local(self.geometry, ct, profile.c_us)
        return dict(prefill=prefill, total=prefill)

    def rows(self, costs: list[CostRecord], errors: dict[str, list[float]]) -> dict:
        """:func:`primitive_rows` with :meth:`predict`; each route call names its wave
        (``wave``: an index into :meth:`wave_list`, ``index``: its place there)."""
        return primitive_rows(costs, self.predict, errors, self._where)

    def _where(self, rec: CostRecord) -> dict:
        out = {}
        if id(rec) in self.repeats:
            out["measured_repeats"] = self.repeats[id(rec)]
        noted = self.waves.get(id(rec))
        if noted is not None:
            wave, i = noted
            out["wave"] = self._wave_ids.setdefault(id(wave), (len(self._wave_ids), wave))[0]
            out["index"] = i
        return out

    def wave_list(self) -> list[list[dict]]:
        """Every wave a route call of :meth:`rows` named, in that order: its calls in send
        order (:class:`WaveCall` fields), what :func:`predict_wave` plays out (``demo.json``'s
        ``waves``: with ``calibration`` they let a reader rerun the route predictions)."""
        return [[dataclasses.asdict(c) for c in wave] for _, wave in self._wave_ids.values()]


def replay_routes(result: dict, predict=predict_wave) -> list[dict[str, float]]:
    """The route predictions of a finished run, played out again from its ``demo.json``
    (``result``): each wave of ``result["waves"]`` through ``predict`` (default
    :func:`predict_wave`, the demo's own model; pass a changed model to see what it would have
    said) with the run's constants (``calibration``), geometry and CPU plan (``cores``).
    Returns, per route call of ``primitives["route"]["per_call"]`` that names its wave, the
    model's terms (us, with ``total``); with the default model they equal the recorded
    ``predicted_terms``."""
    cal = result["calibration"]
    fabric = FabricProfile.from_dict(cal["fabric"])
    k = RouteConstants.from_terms(cal)  # to_dict() puts the terms beside the fabric
    g = MLAGeometry(**result["geometry"])
    cores = result.get("cores")
    cores = {int(r): c for r, c in cores.items()} if cores else None
    waves = [predict(w, g, fabric, k, cores) for w in
             ([WaveCall(**c) for c in wave] for wave in result["waves"])]  # fmt: skip
    calls = result["primitives"].get("route", {}).get("per_call", [])
    return [waves[c["wave"]][c["index"]] for c in calls if "wave" in c]


def spread_mape(per_call: list[dict], waves: list[list[dict]], min_repeats: int = 3):
    """The run's own spread, as a MAPE: each route call scored by the median of its repeats
    (the call at the same place of a wave of the same shape, one per layer-step) instead of a
    model. No prediction that gives every repeat of a call one value scores much below it
    (the median is the best such value for the absolute error), so it is the floor under the
    model's per-call MAPE on this run. ``(mape, calls scored)``; ``(None, 0)`` when no call
    repeats ``min_repeats`` times."""
    repeats: dict[tuple, list[float]] = defaultdict(list)
    for c in per_call:
        if "wave" in c:
            shape = tuple(tuple(sorted(w.items())) for w in waves[c["wave"]])
            repeats[(shape, c["index"])].append(c["measured"])
    scored = [ms for ms in repeats.values() if len(ms) >= min_repeats]
    if not scored:
        return None, 0
    errs = [abs(m - median) / m for ms in scored for median in [statistics.median(ms)] for m in ms]
    return sum(errs) / len(errs), len(errs)


def median_calls(runs: list[list[CostRecord]]) -> list[tuple[CostRecord, list[float]]]:
    """Each call of the first run as the record of its median total over the runs, with the
    totals it was chosen from (us, sorted).

    ``runs`` are the cost records of repeats of one decode (the same calls in the same order:
    a decode is deterministic). A call is its primitive, chunk, layer, peer and rows, and its
    occurrence among the run's calls alike; its record in each run where it occurs is taken,
    and the one whose ``total_us`` is the median (the lower middle for an even count) stands
    for the call, all its terms with it (so they still add up to its total). Failed calls of
    the first run stay as they are; a call some repeat did not make (a fallback there) is
    scored over the repeats that made it.
    """
    if not runs:
        raise ValueError("runs: expected at least one run of cost records, got none")
    keyed = [_call_keys(recs) for recs in runs]
    found = [dict(zip(keys, recs, strict=True)) for keys, recs in zip(keyed, runs, strict=True)]
    out = []
    for key, rec in zip(keyed[0], runs[0], strict=True):
        if key is None:
            out.append((rec, [rec.total_us]))
            continue
        same = sorted((f[key] for f in found if key in f), key=lambda r: r.total_us)
        out.append((same[(len(same) - 1) // 2], [r.total_us for r in same]))
    return out


def _call_keys(recs: list[CostRecord]) -> list[tuple | None]:
    """Each record's call: (primitive, chunk, layer, peer, rows) and its occurrence among the
    records; None for a failed one."""
    seen: Counter = Counter()
    keys: list[tuple | None] = []
    for r in recs:
        if not r.ok:
            keys.append(None)
            continue
        call = (r.primitive, r.chunk_id, r.layer, r.peer, r.m_q)
        keys.append((call, seen[call]))
        seen[call] += 1
    return keys


# ---- printing ----------------------------------------------------------------------------------

_CONSTANTS = (
    # (key, label, unit, scale): fabric keys are read from cal["fabric"]
    ("t_probe_us", "T_probe (probe round trip)", "us", 1.0),
    ("turnaround_us", "turnaround beyond the probe", "us", 1.0),
    ("bw_gbps", "BW (routed rows)", "GB/s", 1.0),
    ("bulk_bw_gbps", "bulk pull rate (fetch)", "GB/s", 1.0),
    ("host_fixed_us", "host overhead, fixed", "us", 1.0),
    ("host_per_row_us", "host overhead per row", "us", 1.0),
    ("fetch_fixed_us", "fetch request, fixed part", "us", 1.0),
    ("send_alone_us", "route send, alone", "us", 1.0),
    ("send_us", "route send, in a wave (mean)", "us", 1.0),
    ("compute_fixed_us", "holder kernel call, fixed", "us", 1.0),
    ("compute_us_per_row_token", "holder compute", "us/(row x token)", 1.0),
    ("host_us", "holder host work per request", "us", 1.0),
    ("splice_us_per_token", "splice", "us/token", 1.0),
    ("scatter_us_per_token", "pool write, no rotation", "us/token", 1.0),
    ("merge_us", "merge of an agent's partials", "us", 1.0),
    ("c_us", "re-prefill c", "us/(token x layer)", 1.0),
)


def _source(key: str, cal: dict) -> str:
    """Where the constant ``key`` of ``cal`` came from, in words: ``"measured this run"``,
    ``"profile FILE"`` (taken from ``--profile`` as it is) or ``"preset NAME"`` (a preset
    fabric named by ``--profile``), from the run's ``sources`` (the calibration's, what a
    :class:`mqnc.cost.MachineProfile` records per term: ``"profile"``, ``"calibrated"`` or
    a note that says more). A term ``sources`` does not name was measured this run, except a
    fabric term of a run given a profile: the fabric's fields the run does not measure (the
    host overhead; every one in the HF demo, which records no sources) are the profile's."""
    given, src = cal.get("profile"), cal.get("sources", {}).get(key)
    if src is None:
        src = "profile" if given and key in cal.get("fabric", {}) else "calibrated"
    if src == "profile" and given:
        return f"preset {given}" if given in FABRICS else f"profile {given}"
    if src.startswith("calibrated"):  # (measured by this run's calibration)
        return "measured this run" + src.removeprefix("calibrated")
    return src


def _constants(cal: dict) -> list[str]:
    """One line per constant the calibration holds: value, unit, where it came from
    (:func:`_source`)."""
    fabric = cal.get("fabric", {})
    lines = [f"{'constant':<30} {'value':>10}  {'unit':<18} from"]
    if cal.get("profile"):
        lines.insert(0, f"profile: {cal['profile']}")
    indent = " " * len(lines[-1].removesuffix("from"))
    for key, label, unit, scale in _CONSTANTS:
        value = fabric.get(key, cal.get(key))
        if value is None:
            continue
        src = _source(key, cal)
        # a long source wraps in its own column, so that the table stays within WIDTH
        src = textwrap.wrap(src, WIDTH - len(indent), break_on_hyphens=False) or [""]
        lines.append(f"{label:<30} {value * scale:>10.4g}  {unit:<18} {src[0]}")
        lines += [indent + more for more in src[1:]]
    return lines


def _fallback_lines(fallbacks: list, killed: dict | None) -> list[str]:
    """Which holder died when (the drill's kill, and each failing holder's first failed
    request) and who answered its requests instead."""
    lines = []
    if killed:
        lines.append(
            f"fault drill: holder {killed['holder']} killed before step {killed['before_step']} "
            f"({killed['decode_s']:.1f} s into the decode)"
        )
    by_holder: dict[int, list] = defaultdict(list)
    for f in fallbacks:
        by_holder[f["holder"]].append(f)
    for holder, fs in sorted(by_holder.items()):
        first = min(fs, key=lambda f: (f.get("step", 0), f["layer"]))
        used = Counter(
            f["used"] if f["peer"] in (None, holder) else f"{f['used']} at holder {f['peer']}"
            for f in fs
        )
        how = ", ".join(f"{k} ({v})" for k, v in used.most_common())
        lines.append(
            f"holder {holder} failed from step {first.get('step', '?')}, layer {first['layer']}: "
            f"{len(fs)} requests answered by {how}"
        )
    return lines


def print_table(
    rows: dict,
    errors: dict,
    decisions: dict,
    fallbacks: list,
    cal: dict,
    killed: dict | None = None,
    compare: dict | None = None,
    rounds: list | None = None,
    decided: list[str] | None = None,
) -> None:
    """The constants (value and source) and, when they were measured more than once, each
    round's (``rounds``), the decisions (``decided``, the lines of
    :func:`mqnc.demo.teams.decision_lines`, else the count per primitive of ``decisions``), the
    fallbacks, one line per primitive (calls, wire bytes, measured and predicted total, MAPE,
    largest error) and the terms (measured and predicted, summed over the calls); every line
    fits in 100 columns."""
    print()
    print("\n".join(_constants(cal)))
    if rounds and len(rounds) > 1:
        print(
            f"calibrated {len(rounds)} times; each primitive predicted with the round of its "
            "median prediction (*):"
        )
        for r in rounds:
            host = "" if r["host_us"] is None else f", host work {r['host_us']:.0f} us"
            said = ", ".join(
                f"{p} {ms:.0f} ms" + "*" * (p in r["used"]) for p, ms in r["predicted_ms"].items()
            )
            line = f"  {r['when']:<18} T_probe {r['t_probe_us']:.0f} us{host}; {said}"
            print("\n".join(textwrap.wrap(line, WIDTH, subsequent_indent=" " * 21)))
    if decided is not None:
        print("\n".join(decided))
    else:
        chosen = Counter(d["primitive"] for d in decisions.values())
        print(
            "\ndecisions per (chunk, agent): "
            + ", ".join(f"{k} {v}" for k, v in sorted(chosen.items()))
        )
    for line in _fallback_lines(fallbacks, killed):
        print(line)
    if compare:
        print("\n".join(_compare_lines(compare)))
    print(
        f"\n{'primitive':<9} {'calls':>6} {'wire MB':>9} {'measured ms':>12} "
        f"{'predicted ms':>13} {'MAPE':>6} {'max|err|':>9}"
    )
    for prim, r in rows.items():
        print(
            f"{prim:<9} {r['count']:>6} {r['wire_bytes'] / 1e6:>9.2f} "
            f"{r['measured_us']['total'] / 1e3:>12.1f} {r['predicted_us']['total'] / 1e3:>13.1f} "
            f"{r['mape'] * 100:>5.0f}% {r['max_abs_error']:>9.2e}"
        )
    repeats = max((r.get("repeats", 1) for r in rows.values()), default=1)
    if repeats > 1:  # a line per primitive, wrapped within WIDTH
        print(f"each call is its median over {repeats} decodes; one decode's MAPE:")
        for prim, r in rows.items():
            singles = ", ".join(f"{m * 100:.0f}" for m in r["mape_single"]) + "%"
            line = f"  {prim:<7} {singles}"
            print("\n".join(textwrap.wrap(line, WIDTH, subsequent_indent=" " * 10)))
    spread = rows.get("route", {}).get("spread_mape")
    if spread is not None:
        print(
            f"route calls scored by the median of their own repeats (the run's spread, the "
            f"floor under MAPE): {spread * 100:.0f}%"
        )
    if rows:
        print("\n".join(_terms_table(rows)))
    merged = max(errors.get("merged", [0.0]))
    print(
        f"merged answers: {len(errors.get('merged', []))} checked against the fp64 reference, "
        f"max |err| {merged:.2e}"
    )


def _compare_lines(compare: dict) -> list[str]:
    """The predicate's decode against the comparison decode (the other primitive each): the
    calls' measured and predicted time, summed."""
    lines = [f"\n{'decoded with':<22} {'calls':<28} {'measured ms':>12} {'predicted ms':>13}"]
    for key, what in (("predicate", "the predicate's picks"), ("other", "the other primitive")):
        side = compare[key]
        calls = ", ".join(f"{k} {v}" for k, v in sorted(side["primitives"].items()))
        lines.append(
            f"{what:<22} {calls:<28} {side['measured_us'] / 1e3:>12.1f} "
            f"{side['predicted_us'] / 1e3:>13.1f}"
        )
    if not compare["states_agree"]:
        lines.append("the two decodes ended in different agent states (beyond the bf16 floor)")
    return lines


def _terms_table(rows: dict) -> list[str]:
    """Terms down, primitives across: measured / predicted ms summed over the calls."""
    labels = dict(
        transport="transport + queueing",
        compute="holder compute",
        splice="splice",
        prefill="re-prefill",
        total="total",
    )
    head = f"\n{'ms over the calls':<22}" + "".join(f"{p + ' meas/pred':>22}" for p in rows)
    lines = [head, "-" * (len(head) - 1)]
    for term in (*TABLE_TERMS, "total"):
        cells = []
        for r in rows.values():
            m, p = r["measured_us"].get(term, 0.0), r["predicted_us"].get(term, 0.0)
            cells.append(" " * 22 if not (m or p) else f"{m / 1e3:>11.1f} /{p / 1e3:>9.1f}")
        lines.append(f"{labels[term]:<22}" + "".join(cells))
    return lines


def plot(rows: dict, path: Path, subtitle: str = "") -> str:
    """Measured against predicted time per call, one colour per primitive (log-log);
    ``subtitle`` (the device, transport and kernels) goes under the title. Returns the title."""
    import matplotlib  # here: an optional dependency (the notebooks extra), only for the PNG

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 5.0))
    colors = {"route": "tab:green", "fetch": "tab:red", "local": "tab:purple"}
    lo, hi = math.inf, 0.0
    for prim, r in rows.items():
        xs = [c["predicted"] for c in r["per_call"]]
        ys = [c["measured"] for c in r["per_call"]]
        ax.scatter(
            xs,
            ys,
            s=14,
            alpha=0.7,
            color=colors[prim],
            label=f"{prim} (n={r['count']}, MAPE {r['mape'] * 100:.0f}%)",
        )
        lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="measured = predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    if hi > 0:  # one range on both axes: the diagonal is the diagonal
        ax.set_xlim(lo / 1.3, hi * 1.3)
        ax.set_ylim(lo / 1.3, hi * 1.3)
    _time_ticks(ax)
    ax.set_xlabel("predicted per call")
    ax.set_ylabel("measured per call")
    title = "mqnc demo: measured vs the cost model" + (f"\n{subtitle}" if subtitle else "")
    ax.set_title("\n".join(textwrap.fill(line, 70) for line in title.split("\n")), fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return title


def _time_ticks(ax) -> None:
    """Both log axes ticked at 1, 2, 5 x 10^k (10^k alone past three decades) and labelled as
    times ("500 us", "2 ms"), minor ticks unlabelled: no "3x10^3 4x10^3" pairs that collide."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def label(us: float, _pos=None) -> str:
        for unit, scale in (("s", 1e6), ("ms", 1e3)):
            if us >= scale:
                return f"{us / scale:g} {unit}"
        return f"{us:g} us"

    for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        decades = math.log10(hi / lo) if lo > 0 and hi > lo else 0.0
        subs = (1.0, 2.0, 5.0) if decades < 3 else (1.0,)
        axis.set_major_locator(LogLocator(base=10, subs=subs, numticks=12))
        axis.set_major_formatter(FuncFormatter(label))
        axis.set_minor_formatter(NullFormatter())
