"""The demo end to end: start the holders, prefill the corpus, calibrate what the profile lacks,
decode, verify, report, write ``demo.json``, the profile and the PNG (see :mod:`mqnc.demo` for
what it does and why). Every argument was checked before this runs
(:func:`mqnc.demo.preflight.prepare`)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import textwrap
from pathlib import Path

import torch

from mqnc.base.runtime import device_name, kernel_mode
from mqnc.demo.calibration import Calibration, calibrate, lacking, median_rounds
from mqnc.demo.cluster import Cluster
from mqnc.demo.config import DemoConfig
from mqnc.demo.device_demo import run_device_route
from mqnc.demo.preflight import Prepared
from mqnc.demo.progress import Progress
from mqnc.demo.report import WIDTH, Report, median_calls, plot, print_table, spread_mape
from mqnc.demo.step import Decisions, Decoder
from mqnc.demo.teams import Plan, check_lines, decision_lines, plan_workload
from mqnc.demo.verify import Verifier
from mqnc.demo.workload import Corpus, build_model, make_agents, readers
from mqnc.model import MLAModel
from mqnc.serving import ChunkInfo, Requester
from mqnc.transport import ENGINES
from mqnc.transport.protocol import TransportError

__all__ = ["run", "run_device_route"]


def run(prep: Prepared, progress: Progress) -> dict:
    """:func:`mqnc.demo.run_demo` once the arguments are checked and the kernel mode chosen."""
    cfg = prep.cfg
    where = "threads" if ENGINES[cfg.transport].in_process else "processes"
    progress.phase(
        f"mqnc demo: {cfg.chunks} chunks over {cfg.holders} holder {where} ({cfg.transport}), "
        f"{cfg.agents} agents x {cfg.steps} step{'s' * (cfg.steps != 1)} x {cfg.layers} layers; "
        f"device {cfg.device}, "
        f"kernels {_kernels(cfg)}, cache {cfg.cache_dtype}"
    )
    model = build_model(cfg)
    corpus = Corpus(cfg, model)
    cluster = Cluster(cfg, model, corpus)
    req = None
    try:
        # one intra-op thread: the holder processes start beside this prefill, and torch's
        # OpenMP workers slow down badly on oversubscribed cores (seen: 0.6 -> 1.7 s a chunk)
        torch.set_num_threads(1)
        with progress.bar(cfg.chunks, "prefill the corpus (chunks)") as bar:
            for c in range(cfg.chunks):
                corpus.kv(c)
                bar.update(1)
        cluster.publish()
        progress.phase("waiting for the holders to serve their chunks")
        cluster.wait_ready()
        req = _requester(cfg, cluster, model, corpus)
        # the calibration rounds, (when, constants): one when the profile gives every term
        n_rounds = cfg.calibration_rounds if lacking(cfg, prep.profile) else 1
        cals: list[tuple[str, Calibration]] = []

        def measure(when: str) -> None:
            try:
                c = calibrate(cfg, req, model.geometry, prep.profile, progress, cluster.cpus)
            except TransportError as exc:  # a holder lost after the decodes began
                if not cals:
                    raise
                why = f"{type(exc).__name__}: {exc}"
                progress.phase(f"calibration {when} failed, left out ({why})")
                return
            cals.append((when, c))

        measure("before the decodes")
        verifier = Verifier(model, corpus)
        # the workload and the decisions from the first constants, before any decode
        plan, decisions = _plan(cfg, model, corpus, cals[0][1], progress)
        kill = cluster.kill if cfg.kill_holder is not None else None
        runs = _decode(
            cfg, model, corpus, req, plan, decisions, verifier, kill, progress, measure, n_rounds
        )
        scored = _score(cfg, model, corpus, cluster.cpus, runs, cals, verifier.errors)
    finally:
        cluster.close(req)
    result = _result(cfg, model, cluster.cpus, plan, decisions, verifier, runs, scored)
    result["wall_s"] = progress.elapsed_s
    _write(cfg, result, verifier.errors, verifier.by_decode["predicate"], scored.cal)
    return result


def _plan(cfg: DemoConfig, model: MLAModel, corpus: Corpus, cal: Calibration, progress):
    """The workload planned from the calibration ``cal`` (:func:`plan_workload`) and the
    decisions over its agents, said on the progress line: ``(plan, decisions)``."""
    plan = plan_workload(
        geometry=model.geometry,
        profile=cal.machine_profile(cfg),
        lengths=corpus.lengths,
        whole_agents=cfg.whole_agents,
        chunks_per_agent=cfg.chunks_per_agent,
        selection_agents=cfg.selection_agents,
        steps=cfg.steps,
        topk=cfg.topk,
    )
    decisions = Decisions(cfg, model, corpus, cal, readers(make_agents(cfg, corpus, plan)))
    teams = " + ".join(str(t.size) for t in plan.teams) or "none"
    progress.phase(
        f"workload planned from the constants: whole-chunk agents in teams of {teams}"
        + "".join(f"; {p} never wins here" for p in plan.never)
    )
    return plan, decisions


def _result(cfg, model, cpus, plan, decisions, verifier, runs, scored) -> dict:
    """``demo.json``'s content (but ``wall_s``) from the finished decodes ``runs`` and what
    :func:`_score` made of them."""
    decoder = runs["predicate"][0][0]  # its first repeat: the fault drill's, the final states
    return dict(
        config=dataclasses.asdict(cfg),
        device=device_name(),
        transport=cfg.transport,
        kernels=_kernels(cfg),
        calibration=scored.cal.to_dict(),
        calibration_rounds=scored.rounds,
        workload=plan.to_dict(),
        decisions=list(decisions.table.values()),
        # the predicate's decode alone, per path: each partial's and merged answer's max |err|
        checked_by_path={
            k: dict(count=len(v), max_abs_error=max(v))
            for k, v in verifier.by_decode["predicate"].items()
        },
        fallbacks=[f for d, _ in runs["predicate"] for f in d.fallbacks],
        killed=decoder.killed,
        compare=scored.compare,
        primitives=scored.rows,
        waves=scored.waves,
        geometry=dataclasses.asdict(model.geometry),
        kv_format=model.geometry.cache_dtype,
        kv_bytes_per_token_layer=model.geometry.kv_bytes_per_token_layer,
        # FP8: the fp64 merged answers over the dequantized keys vs over the bf16 ones (what
        # the format moves an answer; the bounds above are the kernels' alone)
        quantization_error=max(verifier.quantization, default=None),
        cores=cpus,
        max_abs_error={k: max(v) for k, v in verifier.errors.items()},
        checked={k: len(v) for k, v in verifier.errors.items()},
        # each agent's last hidden state: the --force runs of one config must agree on it
        final_hidden={a.name: a.hidden.flatten().tolist() for a in decoder.agents},
    )


def _decode(
    cfg: DemoConfig,
    model: MLAModel,
    corpus: Corpus,
    req: Requester,
    plan: Plan,
    decisions: Decisions,
    verifier: Verifier,
    kill,
    progress: Progress,
    calibrate_again,
    rounds: int,
) -> dict[str, list[tuple[Decoder, list]]]:
    """The predicate's decode and (``cfg.comparing``) the comparison decode, each
    ``cfg.decode_repeats`` times from an empty pool, the two interleaved (a slow spell of the
    machine then touches both alike); the fault drill's ``kill`` in the first decode only;
    ``calibrate_again("between")`` after the middle repeat and ``calibrate_again("after")``
    after the last one when ``rounds`` is three; the agents of ``plan``. Returns, per decode
    (``"predicate"``, ``"other"``), each repeat's decoder and its cost records."""
    passes = [("predicate", decisions)]
    if cfg.comparing:  # each (chunk, agent) through the other primitive
        passes.append(("other", decisions.other()))
    repeats = cfg.decode_repeats
    per_repeat = cfg.steps * model.geometry.layers * cfg.agents * len(passes)
    runs: dict[str, list[tuple[Decoder, list]]] = {key: [] for key, _ in passes}
    what = "decode (agent x layer x step)" + (", then the other primitive" * cfg.comparing)
    ends = [repeats] if rounds == 1 else [(repeats + 1) // 2, repeats]
    lo = 0
    for hi in ends:
        label = f", {repeats} times" if repeats > 1 else ""
        if len(ends) > 1:
            label = f", repeats {lo + 1}-{hi} of {repeats}" if hi > lo + 1 else f", repeat {hi}"
        with progress.bar(per_repeat * (hi - lo), what + label) as bar:
            for r in range(lo, hi):
                for key, picks in passes:
                    req.clear_local()  # nothing fetched before is reused
                    drill = kill if r == 0 and key == "predicate" else None
                    verifier.tag = key
                    agents = make_agents(cfg, corpus, plan)
                    dec = Decoder(cfg, model, corpus, req, agents, picks, verifier, drill)
                    n = len(req.costs)
                    dec.run(bar)
                    runs[key].append((dec, req.costs[n:]))
        if len(ends) > 1:
            calibrate_again("between" if hi < repeats else "after")
        lo = hi
    return runs


@dataclasses.dataclass
class _Scored:
    """What the report makes of the decodes (``demo.json``'s numbers)."""

    cal: Calibration  # the calibration the table predicts with
    rounds: list  # what each calibration round gave
    rows: dict  # the table's rows, per primitive
    waves: list  # every wave the rows name
    compare: dict | None  # the two decodes side by side (``cfg.comparing``)


def _score(cfg: DemoConfig, model: MLAModel, corpus: Corpus, cpus, runs, cals, errors) -> _Scored:
    """Score the decodes ``runs`` (:func:`_decode`): each call's median over the repeats,
    predicted with the calibration round :func:`_median_calibration` picks out of ``cals``;
    beside it each single decode's MAPE, the routes' spread MAPE and (``cfg.comparing``) the
    comparison of the two decodes. ``errors``: the verifier's, per primitive."""
    repeats = cfg.decode_repeats
    decoders = [rs[0][0] for rs in runs.values()]  # each decode's first repeat
    waves = {k: v for rs in runs.values() for d, _ in rs for k, v in d.waves.items()}
    deltas = {k: v for rs in runs.values() for d, _ in rs for k, v in d.deltas.items()}
    medians = {key: median_calls([recs for _, recs in rs]) for key, rs in runs.items()}
    chosen = {key: [rec for rec, _ in calls] for key, calls in medians.items()}
    totals = {id(rec): ts for calls in medians.values() for rec, ts in calls}

    def report_with(c):
        return Report(cfg, model.geometry, corpus, c, waves, deltas, cpus, totals)

    cal, rounds = _median_calibration(cals, report_with, chosen)
    report = report_with(cal)
    rows = report.rows([rec for recs in chosen.values() for rec in recs], errors)
    wave_list = report.wave_list()  # every wave the rows name (demo.json's "waves")
    if "route" in rows:
        rows["route"]["spread_mape"] = spread_mape(rows["route"]["per_call"], wave_list)[0]
    # each single decode's MAPE, beside the medians'
    singles = [
        report.rows([rec for rs in runs.values() for rec in rs[i][1]], {}) for i in range(repeats)
    ]
    for prim, row in rows.items():
        row["repeats"] = repeats
        row["mape_single"] = [s[prim]["mape"] for s in singles if prim in s]
    compare = _compare(report, chosen, runs, decoders) if cfg.comparing else None
    return _Scored(cal, rounds, rows, wave_list, compare)


def _median_calibration(cals: list, report_with, chosen: dict) -> tuple:
    """The calibration the report predicts with (:func:`mqnc.demo.calibration.median_rounds`
    over the rounds ``cals``, ``(when, Calibration)`` pairs, each round's prediction of the
    scored calls ``chosen``) and what each round gave (``demo.json``'s
    ``calibration_rounds``)."""
    recs = [rec for recs in chosen.values() for rec in recs]
    predicted = [
        {p: r["predicted_us"]["total"] for p, r in report_with(c).rows(recs, {}).items()}
        for _, c in cals
    ]
    cal, choice = median_rounds([c for _, c in cals], predicted)
    rounds = [
        dict(
            when=when,
            t_probe_us=c.fabric.t_probe_us,
            host_us=c.terms.get("host_us"),
            predicted_ms={p: us / 1e3 for p, us in pr.items()},
            used=sorted(p for p, i in choice.items() if i == n),
        )
        for n, ((when, c), pr) in enumerate(zip(cals, predicted, strict=True))
    ]
    return cal, rounds


def _compare(report: Report, medians: dict, runs: dict, decoders: list[Decoder]) -> dict:
    """The two decodes side by side: per decode, its calls per primitive, their measured (each
    call's median over the repeats) and predicted time (us, summed over the calls, as the table
    sums them), its wall time (verification included; the median over the repeats), and
    whether both ended in the same agent states (to the bf16 floor: each path rounds its
    queries or keys once more than the reference)."""
    out = {}
    for key in ("predicate", "other"):
        rows = report.rows(medians[key], {})
        out[key] = dict(
            primitives={p: r["count"] for p, r in rows.items()},
            measured_us=sum(r["measured_us"]["total"] for r in rows.values()),
            predicted_us=sum(r["predicted_us"]["total"] for r in rows.values()),
            decode_s=statistics.median(d.decode_s for d, _ in runs[key]),
        )
    first, again = decoders
    out["states_agree"] = all(
        float((a.hidden - b.hidden).abs().max()) <= 2**-6 * float(b.hidden.abs().max())
        for a, b in zip(first.agents, again.agents, strict=True)
    )
    return out


def _kernels(cfg: DemoConfig) -> str:
    """What computes: the Triton kernels (compiled or interpreted) or the torch references."""
    return f"triton ({kernel_mode()})" if cfg.kernels == "triton" else "torch (fp64 references)"


def _requester(cfg: DemoConfig, cluster: Cluster, model: MLAModel, corpus: Corpus):
    """Rank 0's requester, every chunk of the corpus in its directory."""
    per_chunk_blocks = -(-cfg.max_tokens // cfg.block_size)
    req = Requester(
        cluster.transport,
        model.geometry,
        softmax_scale=model.softmax_scale,
        rope=model.rope,
        timeout_s=cfg.timeout_s,
        # every agent's chunks, every chunk once more, and the calibration's copies
        pool_blocks=per_chunk_blocks * (cfg.agents * cfg.chunks_per_agent + cfg.chunks + 8),
        block_size=cfg.block_size,
        device=cfg.device,
        model=corpus.prefill_at,
        kernels=cfg.kernels,
    )
    for c, hs in corpus.placement().items():
        req.register(ChunkInfo(c, corpus.lengths[c], corpus.positions[c], hs))
    return req


def _write(cfg: DemoConfig, result: dict, errors, checked, cal) -> None:
    """The PNG (its title naming the device, transport and kernels), ``demo.json``, the demo
    profile and the printed tables; ``checked``: the predicate's decode's errors per path
    (the summary)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = result["primitives"]
    subtitle = (
        f"{result['device']}\n{cfg.transport}, kernels {result['kernels']}, cache "
        f"{result['kv_format']}"
    )
    result["plot_title"] = plot(rows, out / "measured_vs_predicted.png", subtitle=subtitle)
    with open(out / "demo.json", "w") as f:
        json.dump(result, f, indent=2, default=float)
    cal.save_profile(out / "demo_profile.json", cfg, result["device"])
    print_table(
        rows,
        errors,
        {},
        result["fallbacks"],
        result["calibration"],
        result["killed"],
        result["compare"],
        result["calibration_rounds"],
        decided=decision_lines(result["decisions"], result["workload"], WIDTH),
    )
    print(
        "\n".join(check_lines(result["decisions"], checked, result["workload"], cfg.decode_repeats))
    )
    line = (
        f"cache {result['kv_format']}: {result['kv_bytes_per_token_layer']} B a token-layer "
        "(the cost model's b_KV)"
    )
    if result["quantization_error"] is not None:
        line += (
            f"; quantization error of the merged answers (fp64 over the dequantized cache vs "
            f"over bf16, not in the bounds above): max {result['quantization_error']:.2e}"
        )
    print("\n".join(textwrap.wrap(line, 100)))
    print(
        f"\n{result['wall_s']:.0f} s on {result['device']}, {cfg.transport}, kernels "
        f"{result['kernels']}\nwrote demo.json, demo_profile.json (--profile loads it) and "
        f"measured_vs_predicted.png\ninto {out}"
    )


# ---- the corpus over the device route ------------------------------------------------------------
