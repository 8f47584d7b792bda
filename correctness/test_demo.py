"""The demo end to end (the package's main job, and its command line): small configurations on
loopback and gloo, the three ``--force`` paths agreeing, a holder killed mid-run with every
request still answered correctly through the fallback (and the report saying which holder died
when), a holder that fails or dies at start-up ending the run at once, a profile loaded instead
of recalibrated, every argument checked before any work; the default workload planned from
given constants so that each path occurs where the predicate says it wins (and a path that wins
nowhere named with its numbers), the decisions printed with every path's predicted cost. Every
partial and merged answer inside the demo is checked against the fp64 single-instance reference
(``run_demo`` raises beyond the bounds). No test reads a time: the model's MAPE is a measured
figure for docs/demo.md."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from mqnc.demo import DemoConfig, HolderStartupError, run_demo
from mqnc.demo.calibration import counts_for
from mqnc.demo.report import median_calls, replay_routes, spread_mape
from mqnc.demo.step import OTHER
from mqnc.demo.waves import WaveCall, predict_wave
from mqnc.serving import CostRecord

SMALL = dict(
    layers=2,
    chunks=4,
    min_tokens=64,
    max_tokens=96,
    whole_agents=1,
    selection_agents=1,
    chunks_per_agent=2,
    topk=48,
    suffix_tokens=8,
    steps=2,
    progress=False,
    repeats=1,  # each decode once; the gloo test runs its decodes three times
)
README = Path(__file__).parents[1] / "README.md"


def _run(tmp_path, name, **kw) -> dict:
    return run_demo(DemoConfig(**{**SMALL, "out": str(tmp_path / name), **kw}))


def _printed_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_demo_loopback_decides_executes_and_verifies(tmp_path, capsys):
    """The Triton kernels (interpreted here) on the holders and the requester: decided,
    executed, verified; the table fits in 100 columns; the picture names device, transport and
    kernels."""
    r = _run(tmp_path, "lb", transport="loopback", kernels="triton", compare=False)
    printed = capsys.readouterr().out
    assert (tmp_path / "lb" / "demo.json").exists()
    png = tmp_path / "lb" / "measured_vs_predicted.png"
    assert png.exists() and png.stat().st_size > 5000
    on_disk = json.loads((tmp_path / "lb" / "demo.json").read_text())
    assert on_disk["checked"]["merged"] == SMALL["steps"] * SMALL["layers"] * 2
    assert r["kernels"].startswith("triton")
    assert r["device"] in r["plot_title"] and "loopback" in r["plot_title"]
    assert r["kernels"] in r["plot_title"]
    # every (chunk, agent) got a decision from the predicate, executed as decided
    assert r["decisions"] and all(d["primitive"] == d["predicate"] for d in r["decisions"])
    assert not r["fallbacks"]
    for prim, row in r["primitives"].items():
        assert row["count"] > 0 and row["measured_us"]["total"] > 0
        assert row["predicted_us"]["total"] > 0, prim
        assert f"\n{prim} " in printed
    lines = [line for line in _printed_lines(printed) if str(tmp_path) not in line]
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    assert "decisions per (chunk, agent)" in printed and "MAPE" in printed
    # each decision with the explain() table's content (every term of every path), decided for
    # all the agents reading the chunk at its offset; the plan it came from; and, per path, the
    # predicate's decode checked against fp64, in demo.json and printed
    for d in on_disk["decisions"]:
        assert (
            d["explain"]["costs"] == d["costs_us"] and d["explain"]["primitive"] == d["predicate"]
        )
        assert d["round_trips"] == len(d["readers"]) * SMALL["steps"] * SMALL["layers"]
        assert set(d["explain"]["route"]) >= {"probe", "turnaround", "transfer", "total"}
    assert sum(t["size"] for t in on_disk["workload"]["teams"]) == SMALL["whole_agents"]
    picked = {d["primitive"] for d in on_disk["decisions"]}
    assert set(on_disk["checked_by_path"]) == picked | {"merged"}
    assert "per path, the predicate's decode; exact: every partial within one bf16 ulp" in printed
    for p in picked:
        n = on_disk["checked_by_path"][p]["count"]
        assert re.search(rf"\n  {p} +\d+ \(chunk, agent\) decisions +{n} partials", printed), p
    # every constant printed with where it came from
    assert re.search(r"T_probe .* measured this run", printed)
    # the interpreter's counts, recorded (on a GPU: the compiled kernels, the default counts)
    counts = on_disk["calibration"]["samples"]["counts"]
    assert counts == asdict(counts_for(DemoConfig(transport="loopback", kernels="triton")))


def test_calibration_counts_are_the_defaults_unless_the_kernels_are_interpreted(monkeypatch):
    """Only the Triton kernels under the interpreter take :data:`INTERPRETED_COUNTS`: the
    torch path and compiled kernels (a GPU run, ``mqnc demo``'s default there) keep the
    defaults, which are the module's constants."""
    from mqnc.demo.calibration import (
        ALONE,
        COUNTS,
        FETCH_REPS,
        INTERPRETED_COUNTS,
        ROUTE_REPS,
        WAVE_REPS,
        counts_for,
    )

    assert asdict(COUNTS) == dict(
        route_reps=ROUTE_REPS, alone=ALONE, wave_reps=WAVE_REPS, fetch_reps=FETCH_REPS
    )
    triton, torch_path = (DemoConfig(transport="loopback", kernels=k) for k in ("triton", "torch"))
    assert counts_for(torch_path) == COUNTS
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert counts_for(triton) == INTERPRETED_COUNTS and counts_for(torch_path) == COUNTS
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert counts_for(triton) == COUNTS


def test_constants_table_fits_its_width_whatever_the_sources():
    """The constants table stays within ``WIDTH`` columns whatever a constant's source says (a
    long one wraps in its column; a failed route fit's note once made it 102 wide), at the
    widest value format, and every source is printed whole."""
    from mqnc.demo.report import _CONSTANTS, WIDTH, _constants

    long = "calibrated (profile: torch on a-very-long-device-name:0, measured elsewhere, wrapped)"
    keys = [key for key, *_ in _CONSTANTS]
    cal = {"fabric": dict.fromkeys(keys, -1.2345e-300), "sources": dict.fromkeys(keys, long)}
    lines = _constants(cal)
    assert max(len(line) for line in lines) <= WIDTH, max(lines, key=len)
    words = " ".join(lines).split()
    assert words.count("wrapped)") == len(keys) and words.count(
        "a-very-long-device-name:0,"
    ) == len(keys)


def test_demo_gloo_processes_torch_path_and_progress(tmp_path, capsys):
    """Holder processes over gloo; on a CPU the default is the torch path; the run says what it
    does from its first line (prefill, calibration, decode, the comparison decode), decodes a
    second time through the other primitive of each choice (the model measured on both), and
    prints nothing wider than 100 columns."""
    r = _run(tmp_path, "gloo", transport="gloo", progress=True, repeats=3)
    printed = capsys.readouterr()
    err = printed.err
    # the decode, then the same decode with every (chunk, agent) through the other primitive,
    # both three times (interleaved), every answer of every repeat checked
    assert r["checked"]["merged"] == 3 * 2 * SMALL["steps"] * SMALL["layers"] * 2
    # each call scored once, by its median over the three repeats; each repeat's MAPE beside
    for prim, row in r["primitives"].items():
        assert row["count"] == r["compare"]["predicate"]["primitives"].get(prim, 0) + r["compare"][
            "other"
        ]["primitives"].get(prim, 0)
        assert row["repeats"] == 3 and len(row["mape_single"]) == 3, prim
        for call in row["per_call"]:
            ms = call["measured_repeats"]
            assert len(ms) == 3 and ms == sorted(ms) and call["measured"] == ms[1], call
    assert "each call is its median over 3 decodes; one decode's MAPE:\n  route " in printed.out
    cmp = r["compare"]
    assert cmp["states_agree"]
    picked = {d["primitive"] for d in r["decisions"]}
    assert set(cmp["predicate"]["primitives"]) == picked
    assert set(cmp["other"]["primitives"]) == {OTHER[p] for p in picked}
    assert set(r["primitives"]) == picked | {OTHER[p] for p in picked}
    if len(picked) == 1:  # each decode's calls are then one row of the table
        (p,) = picked
        for side, prim in (("predicate", p), ("other", OTHER[p])):
            total = r["primitives"][prim]["measured_us"]["total"]
            assert cmp[side]["measured_us"] == pytest.approx(total)
    if not torch.cuda.is_available():
        assert r["kernels"] == "torch (fp64 references)"
        assert r["config"]["kernels"] == "torch" and r["config"]["device"] == "cpu"
    assert err.startswith("[   0.0 s] mqnc demo: checking the arguments"), err[:200]
    phases = [
        "mqnc demo: 4 chunks",
        "prefill the corpus",
        "holders",
        "calibrate",
        "decode",
        "then the other primitive, repeats 1-2 of 3",
        "calibrate",
        "then the other primitive, repeat 3",
        "calibrate",
    ]
    where, at = [], 0
    for p in phases:  # in this order (a phase named twice is found after the one before)
        at = err.find(p, at)
        where.append(at)
    assert all(w >= 0 for w in where), (where, err[:3000])
    # calibrated before, between and after the repeats; the report predicts with the median
    rounds = r["calibration_rounds"]
    assert [c["when"] for c in rounds] == ["before the decodes", "between", "after"]
    for prim, row in r["primitives"].items():  # each predicted with its median round
        (used,) = [c for c in rounds if prim in c["used"]]
        assert used["predicted_ms"][prim] == sorted(c["predicted_ms"][prim] for c in rounds)[1]
        assert used["predicted_ms"][prim] == pytest.approx(row["predicted_us"]["total"] / 1e3)
    (route_round,) = [c for c in rounds if "route" in c["used"]]
    assert route_round["t_probe_us"] == r["calibration"]["fabric"]["t_probe_us"]
    assert "calibrated 3 times; each primitive predicted with the round of its median" in (
        printed.out
    )
    lines = [line for line in _printed_lines(printed.out) if str(tmp_path) not in line]
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    assert "the other primitive" in printed.out
    # demo.json holds what the route predictions need: replayed, they are the recorded ones
    on_disk = json.loads((tmp_path / "gloo" / "demo.json").read_text())
    calls = on_disk["primitives"]["route"]["per_call"]
    assert calls and all("wave" in c for c in calls)
    replayed = replay_routes(on_disk)
    assert [p["total"] for p in replayed] == pytest.approx([c["predicted"] for c in calls])
    # ... and a changed model is played out over the same waves
    slower = replay_routes(on_disk, lambda *a: [
        {**t, "total": 2 * t["total"]} for t in predict_wave(*a)
    ])  # fmt: skip
    assert [p["total"] for p in slower] == pytest.approx([2 * c["predicted"] for c in calls])
    # the run's own spread, the floor under the per-call MAPE, is recorded and printed
    assert on_disk["primitives"]["route"]["spread_mape"] >= 0
    assert "floor under MAPE" in printed.out


def test_spread_mape_scores_each_call_by_the_median_of_its_repeats():
    """Calls at the same place of waves of the same shape are one call repeated; each is
    scored against their median; a call seen fewer than ``min_repeats`` times is not."""
    a = [dict(peer=1, m_q=16, work=100, sparse=False), dict(peer=2, m_q=16, work=50, sparse=False)]
    b = [dict(peer=1, m_q=16, work=999, sparse=True)]
    waves = [a, b, a, a, b]
    calls = [
        dict(wave=0, index=0, measured=10.0), dict(wave=0, index=1, measured=4.0),
        dict(wave=1, index=0, measured=7.0),
        dict(wave=2, index=0, measured=20.0), dict(wave=2, index=1, measured=4.0),
        dict(wave=3, index=0, measured=40.0), dict(wave=3, index=1, measured=8.0),
        dict(wave=4, index=0, measured=9.0),
        dict(measured=1.0),  # a call outside any noted wave
    ]  # fmt: skip
    got, n = spread_mape(calls, waves)
    # (a, 0): median 20 -> 10/10, 0, 20/40; (a, 1): median 4 -> 0, 0, 4/8; b seen twice only
    want = (1.0 + 0.0 + 0.5 + 0.0 + 0.0 + 0.5) / 6
    assert n == 6 and got == pytest.approx(want)
    assert spread_mape(calls, waves, min_repeats=4) == (None, 0)
    assert spread_mape(calls, waves, min_repeats=2)[1] == 8


def _record(prim="route", chunk=0, layer=0, total=1.0, ok=True):
    return CostRecord(
        prim, 1, chunk, layer, 16, 100, 200, compute_us=total / 2, total_us=total, ok=ok
    )


def test_table_fits_its_width_at_many_repeats(capsys):
    """Every printed line fits in ``WIDTH`` columns with three primitives at the default five
    repeats and at twenty (each primitive's single-decode MAPEs on a line of its own)."""
    from mqnc.demo.report import WIDTH, print_table

    for repeats in (DemoConfig().decode_repeats, 20):
        terms = dict(transport=1e6, compute=2e6, splice=3e5, prefill=4e6, total=7.3e6)
        row = dict(
            count=200, wire_bytes=7.16e6, measured_us=terms, predicted_us=terms, mape=1.234,
            max_abs_error=7.8e-3, repeats=repeats, mape_single=[1.234] * repeats,
        )  # fmt: skip
        rows = {p: dict(row) for p in ("route", "fetch", "local")}
        rows["route"]["spread_mape"] = 0.99
        rounds = [  # three calibration rounds, each naming three primitives' predictions
            dict(when=w, t_probe_us=12345.6, host_us=98765.4, used=used,
                 predicted_ms=dict(route=123456.7, fetch=12345.6, local=123456.7))
            for w, used in (("before the decodes", ["route"]), ("between", ["fetch", "local"]),
                            ("after", []))
        ]  # fmt: skip
        cal = {"fabric": {"t_probe_us": 400.0}}
        print_table(rows, {"merged": [5e-3]}, {}, [], cal, rounds=rounds)
        lines = _printed_lines(capsys.readouterr().out)
        assert sum("ms*" in line for line in lines) == 3, lines  # route, fetch, local
        assert max(len(line) for line in lines) <= WIDTH, max(lines, key=len)
        assert sum(line.startswith(("  route ", "  fetch ", "  local ")) for line in lines) == 3


def test_median_rounds_take_each_primitives_terms_whole_from_its_median_round():
    """Three calibration rounds: the route's constants come from the round whose route
    prediction is the median, the fetch's own terms (bulk rate, fixed part, splice, pool write)
    from the round of the median fetch prediction; nothing else of that round is taken."""
    from mqnc.cost import FabricProfile
    from mqnc.demo.calibration import OWN_TERMS, Calibration, median_rounds

    def round_(i):
        fabric = FabricProfile(
            f"r{i}", t_probe_us=100.0 + i, bw_gbps=1.0 + i, bulk_bw_gbps=10.0 + i
        )
        terms = dict(host_us=500.0 + i, fetch_fixed_us=1000.0 + i, splice_us_per_token=10.0 + i,
                     scatter_us_per_token=2.0 + i, c_us=200.0 + i)  # fmt: skip
        return Calibration(fabric, terms, dict.fromkeys(terms, f"round {i}"))

    rounds = [round_(i) for i in range(3)]
    # route: round 2 is the median (5 < 6 < 9); fetch: round 0 (1 < 3 < 4); local: round 1
    predicted = [
        dict(route=9.0, fetch=3.0, local=7.0),
        dict(route=5.0, fetch=4.0, local=8.0),
        dict(route=6.0, fetch=1.0, local=9.0),
    ]
    cal, choice = median_rounds(rounds, predicted)
    assert choice == dict(route=2, fetch=0, local=1)
    assert (cal.fabric.t_probe_us, cal.fabric.bw_gbps, cal.terms["host_us"]) == (102, 3, 502)
    assert cal.fabric.bulk_bw_gbps == 10.0 and "bulk_bw_gbps" in OWN_TERMS["fetch"]
    assert (cal.terms["fetch_fixed_us"], cal.terms["splice_us_per_token"]) == (1000, 10)
    assert cal.terms["scatter_us_per_token"] == 2 and cal.terms["c_us"] == 201
    assert cal.sources["fetch_fixed_us"] == "round 0" and cal.sources["host_us"] == "round 2"
    assert rounds[2].terms["fetch_fixed_us"] == 1002  # the rounds themselves are unchanged
    # one round: itself
    one, choice = median_rounds(rounds[:1], predicted[:1])
    assert one.terms == rounds[0].terms and choice == dict(route=0, fetch=0, local=0)


def test_median_calls_picks_each_calls_median_record_over_the_repeats():
    """A call (primitive, chunk, layer, peer, rows, and its occurrence) is stood for by its
    record of median total over the repeats, whole (its terms with it); a failed call of the
    first run stays; a call one repeat did not make is scored over the others; the sorted
    totals come with it."""
    first = [_record(total=5), _record(total=9), _record(chunk=1, total=3), _record(ok=False)]
    second = [_record(total=1), _record(total=7), _record(chunk=1, total=4)]
    third = [_record(total=3), _record(total=8)]  # chunk 1 fell back to another primitive
    third.append(_record("fetch", chunk=1, total=50))
    got = median_calls([first, second, third])
    assert [ts for _, ts in got] == [[1, 3, 5], [7, 8, 9], [3, 4], [first[3].total_us]]
    assert [rec for rec, _ in got] == [third[0], third[1], first[2], first[3]]
    assert got[0][0].compute_us == 1.5  # the record, not a median per term
    assert median_calls([first]) == [(r, [r.total_us]) for r in first]
    with pytest.raises(ValueError, match="runs: expected at least one run"):
        median_calls([])


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forced")
    return tmp, {
        p: _run(tmp, p, transport="loopback", force=p) for p in ("route", "fetch", "local")
    }


@pytest.mark.parametrize("primitive", ["route", "fetch", "local"])
def test_force_runs_every_request_through_one_primitive(forced, primitive):
    r = forced[1][primitive]
    assert {d["primitive"] for d in r["decisions"]} == {primitive}
    # the selection agent's chunks sit at canonical positions: its fetch splices nothing
    assert set(r["primitives"]) == {primitive}


def test_force_paths_agree(forced):
    """Identical work through route, fetch and local ends in the same agent states, to the
    bf16 floor (each path rounds its queries or keys once more than the reference)."""
    base = forced[1]["route"]["final_hidden"]
    for other in ("fetch", "local"):
        for agent, h in forced[1][other]["final_hidden"].items():
            a, b = torch.tensor(h), torch.tensor(base[agent])
            scale = float(b.abs().max())
            assert float((a - b).abs().max()) <= 2**-6 * scale, (other, agent)


def test_profile_is_loaded_not_recalibrated(forced, tmp_path):
    """A demo profile (written by every run) gives every term: nothing is measured again.
    A fabric profile gives the transport's terms; the demo measures the rest. Each term says
    where it came from."""
    profile = forced[0] / "route" / "demo_profile.json"
    r = _run(tmp_path, "again", transport="loopback", profile=str(profile), repeats=2)
    cal = r["calibration"]
    assert set(cal["sources"].values()) == {"profile"} and cal["profile"] == str(profile)
    assert len(r["calibration_rounds"]) == 1  # nothing to measure: one round, not three
    assert cal["samples"] == {} and cal["probe_samples_us"] == []
    saved = json.loads(profile.read_text())
    assert saved["schema"] == "mqnc-profile" and saved["version"] == 1
    assert cal["send_us"] == saved["send_us"]
    assert cal["fabric"]["t_probe_us"] == saved["fabric"]["t_probe_us"]

    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(saved["fabric"]))
    r = _run(tmp_path, "fabric", transport="loopback", profile=str(fabric))
    src = r["calibration"]["sources"]
    assert src["t_probe_us"] == src["bw_gbps"] == "profile"
    assert src["compute_us_per_row_token"] == src["c_us"] == "calibrated"
    assert r["calibration"]["probe_samples_us"] == []  # the fabric was not probed again


def test_a_later_calibration_round_lost_to_a_holder_fault_is_left_out(tmp_path, monkeypatch):
    """A holder lost after the decodes began fails the round measured then; the run goes on
    with the rounds it has (before the decodes and after them here), and says so."""
    import mqnc.demo.run as demo_run
    from mqnc.transport.protocol import PeerLost

    calls = []
    real = demo_run.calibrate

    def calibrate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise PeerLost("rank 1 is gone (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(demo_run, "calibrate", calibrate)
    r = _run(tmp_path, "lost", transport="loopback", repeats=2)
    assert len(calls) == 3
    assert [c["when"] for c in r["calibration_rounds"]] == ["before the decodes", "after"]
    for prim, row in r["primitives"].items():  # the lower middle of two: still one round each
        (used,) = [c for c in r["calibration_rounds"] if prim in c["used"]]
        assert used["predicted_ms"][prim] == pytest.approx(row["predicted_us"]["total"] / 1e3)


def test_killed_holder_every_request_answered_through_fallback(tmp_path, capsys):
    r = _run(
        tmp_path,
        "kill",
        transport="loopback",
        holders=2,
        replicas=2,
        kill_holder=1,
        kill_after_step=1,
        force="route",
    )
    printed = capsys.readouterr().out
    assert r["fallbacks"], "the killed holder's chunks must have been served by the fallback"
    # with a replica, route goes on: to the other holder
    assert all(f["holder"] == 1 and f["peer"] == 2 for f in r["fallbacks"])
    assert {f["used"] for f in r["fallbacks"]} == {"route"}
    assert {f["step"] for f in r["fallbacks"]} == {1}
    assert r["checked"]["merged"] == SMALL["steps"] * SMALL["layers"] * 2
    assert r["killed"]["holder"] == 1 and r["killed"]["before_step"] == 1
    assert "fault drill: holder 1 killed before step 1" in printed
    n = len(r["fallbacks"])
    assert (
        f"holder 1 failed from step 1, layer 0: {n} requests answered by route at holder 2 ({n})"
        in printed
    )


def test_killed_holder_process_gloo(tmp_path, capsys):
    r = _run(
        tmp_path,
        "killgloo",
        transport="gloo",
        holders=2,
        replicas=1,
        kill_holder=2,
        kill_after_step=1,
        force="route",
    )
    printed = capsys.readouterr().out
    assert r["fallbacks"]
    assert {f["used"] for f in r["fallbacks"]} <= {"fetch", "local"}
    assert r["checked"]["merged"] == SMALL["steps"] * SMALL["layers"] * 2
    assert "fault drill: holder 2 killed before step 1" in printed
    assert re.search(r"holder 2 failed from step 1, layer 0: \d+ requests answered by", printed)


@pytest.mark.parametrize("how", ["fails", "dies"])
def test_holder_lost_at_start_up_ends_the_run_at_once(tmp_path, monkeypatch, how):
    """A holder process that fails while building its pool (its exception, through the store)
    or dies before it loads its chunks (its exit code) ends the run with the holder named; the
    other holder is stopped. ``timeout_s`` bounds the wait if detection broke: the message
    then says so, and the test fails."""
    from mqnc.demo.cluster import Cluster

    if how == "fails":
        chunks_of = Cluster._chunks_of

        def bad_chunks(self, rank):  # holder 2 gets a cache of the wrong shape
            out = chunks_of(self, rank)
            return {c: (kv[:, :, :8], p) for c, (kv, p) in out.items()} if rank == 2 else out

        monkeypatch.setattr(Cluster, "_chunks_of", bad_chunks)
        expect = r"holder 2 failed at start-up \(building its pool\): ValueError: kv: expected"
    else:
        publish = Cluster.publish

        def kill_first(self):
            self._procs[0].kill()
            self._procs[0].join()
            publish(self)

        monkeypatch.setattr(Cluster, "publish", kill_first)
        expect = r"holder 1 died at start-up \(loading its chunks\): exit code -9"
    with pytest.raises(HolderStartupError, match=expect):
        _run(tmp_path, how, transport="gloo", timeout_s=120.0)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(profile="no/such/profile.json"), FileNotFoundError, "no/such/profile.json"),
        (dict(profile=str(README)), ValueError, r"README\.md' is not a profile"),
        (dict(topk=0), ValueError, "topk: expected an int in"),
        (dict(topk=4 * 64 + 1), ValueError, "topk: expected an int in"),
        (dict(kill_holder=1, kill_after_step=2), ValueError, "kill_after_step"),
        (dict(whole_agents=0, selection_agents=0), ValueError, "at least one agent"),
        (dict(kernels="cuda"), ValueError, "kernels: expected one of"),
        (dict(transport="carrier-pigeon"), ValueError, "transport"),
        (dict(device="tpu"), ValueError, "device"),
        (dict(holders=1, replicas=2), ValueError, "replicas"),
        (dict(force="route", compare=True), ValueError, "compare: .* without force"),
        (dict(kill_holder=1, compare=True), ValueError, "compare: .* the fault drill"),
        (dict(repeats=0), ValueError, "repeats: expected an int"),
        (dict(kill_holder=1, repeats=2), ValueError, "repeats: the fault drill decodes once"),
    ],
)
def test_bad_argument_fails_before_any_work(tmp_path, monkeypatch, kw, error, match):
    import mqnc.demo.run

    def no_work(*args):
        raise AssertionError("the run started before its arguments were checked")

    monkeypatch.setattr(mqnc.demo.run, "run", no_work)
    with pytest.raises(error, match=match):
        _run(tmp_path, "bad", **kw)
    assert not (tmp_path / "bad").exists()


def test_machine_dependent_arguments_fail_before_any_work(tmp_path, monkeypatch):
    import mqnc.demo.run

    monkeypatch.setattr(mqnc.demo.run, "run", lambda *a: pytest.fail("the run started"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda' asked for, but torch sees no CUDA"):
            _run(tmp_path, "cuda", device="cuda")
        with pytest.raises(ValueError, match="nvshmem.*needs a CUDA device"):
            _run(tmp_path, "nv", transport="nvshmem")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        _run(tmp_path, "file")
    # no selection agents: no top-k to check (documented in DemoConfig)
    DemoConfig(**{**SMALL, "selection_agents": 0, "topk": 0})


def test_demo_command_line_checks(capsys, tmp_path):
    from mqnc.cli import main

    assert main(["demo", "--profile", str(README), "--out", str(tmp_path / "o")]) == 2
    assert f"'{README}' is not a profile" in capsys.readouterr().err
    assert main(["demo", "--topk", "0"]) == 2
    assert "topk: expected" in capsys.readouterr().err
    assert main(["demo", "--kill-after-step", "1"]) == 2
    assert "--kill-after-step: applies to the fault drill only" in capsys.readouterr().err
    assert main(["demo", "--force", "fetch", "--compare"]) == 2
    assert "compare: the second decode" in capsys.readouterr().err
    assert main(["demo", "--repeats", "0"]) == 2
    assert "repeats: expected an int" in capsys.readouterr().err
    assert main(["demo", "--hf", "--repeats", "2"]) == 2
    assert "--repeats apply to the MLA demo only" in capsys.readouterr().err
    assert main(["demo", "--kernels", "cuda"]) == 2  # argparse: not a choice


# ---- the model's pieces (no run) ----------------------------------------------------------------


def test_wave_of_one_is_the_papers_route():
    """A wave of one call is §4.2's route: probe + turnaround + rows out + compute + partial
    back, no queueing; more requests queue behind the sends and the holder's batches."""
    from mqnc.cost import FABRICS, t_route
    from mqnc.demo.waves import RouteConstants, WaveCall, predict_wave
    from mqnc.model import get_preset

    g = get_preset("deepseek-v2-lite")
    fabric = FABRICS["h100-ibgda"]
    k = RouteConstants(
        send_us=40.0, send_alone_us=5.0, compute_fixed_us=3.0, compute_us_per_row_token=0.01
    )
    (one,) = predict_wave([WaveCall(1, 16, 16 * 300)], g, fabric, k)
    ref = t_route(g, fabric, 16, t_compute_us=3.0 + 0.01 * 16 * 300, t_merge_us=0.0)
    assert one["queue"] == 0.0
    assert one["total"] == pytest.approx(ref.total - ref.host, rel=1e-12)
    wave = [WaveCall(1, 16, 16 * 300), WaveCall(1, 16, 16 * 200), WaveCall(2, 16, 16 * 100)]
    apart = predict_wave(wave, g, fabric, k)
    shared = predict_wave(wave, g, fabric, k, cores={1: 1, 2: 1})
    assert all(t["queue"] >= 0 for t in apart)
    # the first request waits for the sends after it: at least the wave's sends
    assert apart[0]["total"] >= 3 * k.send_us
    # two holders on one core share it: nobody is answered earlier
    assert all(s["total"] >= a["total"] - 1e-9 for s, a in zip(shared, apart, strict=True))
    # the holder's host work is core time, not latency: a wave of one is still §4.2's route
    (alone,) = predict_wave([WaveCall(1, 16, 16 * 300)], g, fabric, replace(k, host_us=2.0))
    assert alone["total"] == pytest.approx(one["total"], rel=1e-12)


def test_holders_on_one_core_share_it():
    """Two holders on one core computing at once share it equally (processor sharing, as the
    OS time-slices them): each call takes twice its core time on the wall clock, and that wall
    time is its ``compute`` term; on their own cores each takes its core time."""
    from mqnc.cost import FABRICS
    from mqnc.demo.waves import RouteConstants, WaveCall, predict_wave
    from mqnc.model import get_preset

    g = get_preset("deepseek-v2-lite")
    fabric = FABRICS["h100-ibgda"]
    k = RouteConstants(
        send_us=0.0, send_alone_us=0.0, compute_fixed_us=0.0, compute_us_per_row_token=1.0
    )
    wave = [WaveCall(1, 16, 1000), WaveCall(2, 16, 1000)]
    apart = predict_wave(wave, g, fabric, k)
    shared = predict_wave(wave, g, fabric, k, cores={1: 1, 2: 1})
    assert [t["compute"] for t in apart] == pytest.approx([1000.0, 1000.0])
    assert [t["compute"] for t in shared] == pytest.approx([2000.0, 2000.0])
    # one after the other (FIFO) would answer the first at 1000 us: shared, both end at 2000
    assert shared[0]["total"] - apart[0]["total"] == pytest.approx(1000.0)
    # host work after each call is the core's time too (both end at 2 x (1000 + 100)), and it
    # leaves the fixed round trip's latency (100 less, out and back)
    slow = replace(fabric, t_probe_us=500.0, turnaround_us=500.0)
    hosted = predict_wave(wave, g, slow, replace(k, host_us=100.0), cores={1: 1, 2: 1})
    base = predict_wave(wave, g, slow, k, cores={1: 1, 2: 1})
    assert [h["total"] - b["total"] for h, b in zip(hosted, base, strict=True)] == pytest.approx(
        [100.0, 100.0]
    )


def test_holder_streams_the_replies_of_a_kernel_call():
    """The replies of one kernel call go out one by one, each after its own host work: the
    first of two requests answered together is back ``host_us`` before the second, and a lone
    request waits for its own host work only."""
    from mqnc.cost import FABRICS
    from mqnc.demo.waves import RouteConstants, WaveCall, predict_wave
    from mqnc.model import get_preset

    g = get_preset("deepseek-v2-lite")
    # a round trip longer than the host work, which it includes (as the probe's does)
    fabric = replace(FABRICS["h100-ibgda"], t_probe_us=500.0, turnaround_us=500.0)
    k = RouteConstants(0.0, 0.0, 0.0, 1.0, host_us=100.0)
    two = predict_wave([WaveCall(1, 16, 1000)] * 2, g, fabric, k)
    assert [t["compute"] for t in two] == pytest.approx([2000.0, 2000.0])  # one call
    assert two[1]["total"] - two[0]["total"] == pytest.approx(100.0)
    one = predict_wave([WaveCall(1, 16, 1000)], g, fabric, k)
    base = predict_wave([WaveCall(1, 16, 1000)], g, fabric, replace(k, host_us=0.0))
    assert one[0]["total"] == pytest.approx(base[0]["total"])  # host work out of the latency
    assert two[0]["total"] - base[0]["total"] == pytest.approx(1000.0)  # the shared call only


def test_calibration_recovers_the_holders_host_work():
    """``host_us`` is the value that makes the model give the calibration's own waves their
    measured time: waves timed by the model with a known host work give it back."""
    from types import SimpleNamespace

    from mqnc.cost import FABRICS
    from mqnc.demo.calibration import _Measure
    from mqnc.demo.waves import RouteConstants, WaveCall, predict_wave
    from mqnc.model import get_preset

    g = get_preset("deepseek-v2-lite")
    fabric = FABRICS["h100-ibgda"]
    known = dict(
        t_probe_us=fabric.t_probe_us,
        turnaround_us=fabric.turnaround_us,
        bw_gbps=fabric.bw_gbps,
        send_us=40.0,
        send_alone_us=5.0,
        compute_fixed_us=30.0,
        compute_us_per_row_token=0.05,
    )
    cores = {1: 1, 2: 1}
    truth = RouteConstants(40.0, 5.0, 30.0, 0.05, host_us=700.0)
    shapes = [
        [WaveCall(1, 16, 16 * 300)] * 8,
        [WaveCall(1, 16, 16 * 300)] * 8 + [WaveCall(2, 16, 16 * 256, True)] * 8,
    ]
    waves = [(w, [t["total"] for t in predict_wave(w, g, fabric, truth, cores)]) for w in shapes]
    m = SimpleNamespace(waves=waves, g=g, cores=cores, samples={})
    assert _Measure._host_us(m, known) == pytest.approx(700.0, rel=1e-6)
    assert _Measure._host_us(SimpleNamespace(waves=[]), known) == 0.0


def test_host_work_is_fitted_on_the_median_round_of_each_wave_shape():
    """Of each shape's repetitions the round of median summed time is kept (one round the OS
    slowed down does not count), every shape once, in the order first sent."""
    from mqnc.demo.calibration import _median_waves
    from mqnc.demo.waves import WaveCall

    a = [WaveCall(1, 1, 300)] * 2
    b = [WaveCall(1, 1, 300), WaveCall(2, 1, 256, True)]
    waves = [(a, [5.0, 5.0]), (b, [9.0, 9.0]), (a, [50.0, 90.0]), (b, [7.0, 8.0])]
    waves += [(a, [6.0, 6.0]), (b, [8.0, 8.0])]
    assert _median_waves(waves) == [(a, [6.0, 6.0]), (b, [8.0, 8.0])]
    # an even count: the lower of the two middle rounds
    assert _median_waves(waves[:4]) == [(a, [5.0, 5.0]), (b, [7.0, 8.0])]


def test_profile_measured_with_other_kernels_is_measured_again(tmp_path):
    """A demo profile's compute terms hold only for the kernels and device they were measured
    with; the rest is loaded."""
    from mqnc.demo.calibration import _loaded
    from mqnc.demo.profile_file import COMPUTE_TERMS, DEMO_PROFILE, DEMO_TERMS, load_profile

    path = tmp_path / "p.json"
    fabric = dict(name="x", t_probe_us=10.0, bw_gbps=1.0, bulk_bw_gbps=2.0)
    terms = {k: 1.0 for k in DEMO_TERMS}
    measured = dict(kernels="torch", device="cpu", transport="gloo")
    path.write_text(
        json.dumps(dict(kind=DEMO_PROFILE, fabric=fabric, terms=terms, measured_with=measured))
    )
    cfg = DemoConfig(**SMALL, kernels="triton", device="cpu")
    fab, got, sources = _loaded(cfg, load_profile(str(path)))
    assert fab["t_probe_us"] == 10.0 and fab["bulk_bw_gbps"] == 2.0
    assert set(got) == set(DEMO_TERMS) - set(COMPUTE_TERMS)
    assert all(sources[k] == "calibrated (profile: torch on cpu)" for k in COMPUTE_TERMS)
    assert sources["c_us"] == "profile"


def test_prefill_decompressed_is_the_absorbed_attention():
    """The demo's prefill attends in the decompressed form (per-head keys and values); the
    decode path's absorbed pieces (cache entries, absorbed query, W_UV after attention) give the
    same cache, in fp64, at a position with rotation (offset 300)."""
    from mqnc.demo.workload import build_model
    from mqnc.testing import assert_close, tolerance

    model = build_model(DemoConfig(**SMALL))
    x = torch.randn(40, model.hidden, generator=torch.Generator().manual_seed(3))
    got = model.prefill(x, 300, dtype=torch.float64)
    pos, h, expected = torch.arange(300, 340), x.double(), []
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    for layer in range(model.geometry.layers):
        kv = model.cache_entries(layer, h, pos)
        q = model.absorbed_query(layer, h, pos)
        s = torch.einsum("thc,sc->ths", q, kv) * model.softmax_scale
        p = torch.softmax(s.masked_fill(~causal[:, None, :], float("-inf")), dim=-1)
        o = torch.einsum("ths,sc->thc", p, kv[:, : model.geometry.d_v])
        h = h + model.attention_output(layer, o)
        expected.append(kv)
    assert got.dtype == torch.float64 and got.shape == (2, 40, model.geometry.d_qk)
    assert_close(got, torch.stack(expected), tolerance("prefill_forms", torch.float64))


def test_profile_bulk_rate_from_link_peak_is_loaded_not_recalibrated():
    """A profile whose bulk rate is its link peak (``FabricProfile.bulk_bw``: bulk, else link
    peak, else BW) gives the demo that rate; only a profile with neither leaves it to measure."""
    from mqnc.cost import FabricProfile
    from mqnc.demo.calibration import _loaded
    from mqnc.demo.profile_file import load_profile

    cfg = DemoConfig(device="cpu", kernels="torch")
    preset = load_profile("h100-ibgda")
    fabric, _, sources = _loaded(cfg, preset)
    assert fabric["bulk_bw_gbps"] == preset.fabric.bulk_bw == preset.fabric.link_peak_gbps
    assert sources["bulk_bw_gbps"] == "profile"
    bare = replace(preset, fabric=FabricProfile("route-only fit", 300.0, 1.0))
    fabric, _, _ = _loaded(cfg, bare)
    assert "bulk_bw_gbps" not in fabric  # measured by the calibration


def test_constants_say_where_each_came_from():
    """Each constant of the report says where it came from: "measured this run", "profile
    FILE" (taken from ``--profile`` as it is) or "preset NAME" (a preset fabric named by
    ``--profile``); a term taken from the profile is never labelled as calibrated. The MLA
    demo records ``sources``; the HF demo's calibration records none (its fabric is the
    profile's when one is given, the rest measured)."""
    from mqnc.demo.report import _constants

    fab = dict(t_probe_us=7.0, bw_gbps=20.0, turnaround_us=1.0, bulk_bw_gbps=9.0)
    mla = {
        "fabric": dict(fab, host_fixed_us=300.0, host_per_row_us=2.0),
        "sources": dict(
            t_probe_us="profile",
            bw_gbps="profile",
            turnaround_us="profile",
            bulk_bw_gbps="calibrated",
            splice_us_per_token="calibrated (profile: torch on cpu)",
            merge_us="profile",
        ),
        "splice_us_per_token": 3.0,
        "merge_us": 40.0,
        "profile": "/p/fab.json",
    }
    hf = {"fabric": fab, "merge_us": 40.0, "c_us": 1.0, "profile": "/p/fab.json"}

    def source(cal, label):
        lines = _constants(cal)
        column = next(x for x in lines if x.startswith("constant")).index("from")
        (i,) = [i for i, x in enumerate(lines) if x.startswith(label + " ")]
        more = [x.strip() for x in lines[i + 1 :]]
        wrapped = more[: next((k for k, x in enumerate(lines[i + 1 :]) if x[0] != " "), None)]
        return " ".join([lines[i][column:], *wrapped])

    for cal in (mla, hf):
        assert source(cal, "T_probe") == "profile /p/fab.json"
        assert source(cal, "merge of an agent's partials") in (
            "profile /p/fab.json",
            "measured this run",
        )
        assert not any("calibrated" in line for line in _constants(cal) if "profile /p" in line)
    assert source(mla, "host overhead, fixed") == "profile /p/fab.json"
    assert source(mla, "bulk pull rate (fetch)") == "measured this run"
    assert source(mla, "splice") == "measured this run (profile: torch on cpu)"
    assert source(hf, "merge of an agent's partials") == "measured this run"
    assert source(dict(hf, profile="h100-ibgda"), "BW (routed rows)") == "preset h100-ibgda"
    assert source(dict(hf, profile=None), "T_probe") == "measured this run"


def test_kernels_help_says_each_mode_default():
    """``--kernels``' help says the default of both modes: the MLA demo's (preflight: triton on
    cuda, torch on cpu) and ``--hf``'s (triton everywhere: on a CPU, interpreted)."""
    from mqnc.demo import HFDemoConfig
    from mqnc.demo.preflight import default_kernels

    assert (default_kernels("cuda"), default_kernels("cpu")) == ("triton", "torch")
    assert HFDemoConfig().kernels == "triton"
    parser = argparse.ArgumentParser()
    from mqnc.cli import cmd_demo

    cmd_demo.register(parser.add_subparsers())
    (demo,) = parser._subparsers._group_actions[0].choices.values()
    (help_text,) = [a.help for a in demo._actions if "--kernels" in a.option_strings]
    text = " ".join(help_text.split())
    assert "triton on cuda, torch on cpu" in text
    assert "--hf: triton on both (on cpu, the Triton interpreter)" in text


# ---- the workload planned from the constants, and the decisions printed ------------------------


ROUTE_SIDES = dict(
    send_us=150.0,
    send_alone_us=60.0,
    compute_fixed_us=30.0,
    compute_us_per_row_token=0.002,
    host_us=200.0,
)
"""The routed call's sides the planning tests give (us): a holder kernel call of 30 us + 0.002
per row x token, host work inside the round trip."""


def _planned(**constants) -> tuple:
    """The default workload (``DemoConfig()``'s agents, chunks and steps) planned on constants
    of the test's choosing (``t_probe_us``, ``c_us``, ``splice_us_per_token`` and the routed
    call's sides, :data:`ROUTE_SIDES`), and every (chunk, agent) of it decided as the run
    decides: ``(cfg, geometry, profile, plan, agents, decisions)``."""
    from mqnc.cost import FabricProfile
    from mqnc.demo.calibration import Calibration
    from mqnc.demo.step import Decisions
    from mqnc.demo.teams import plan_workload
    from mqnc.demo.workload import Corpus, build_model, make_agents, readers

    cfg = DemoConfig(progress=False, device="cpu", kernels="torch")  # as preflight resolves
    model = build_model(cfg)
    corpus = Corpus(cfg, model)
    fabric = FabricProfile(
        "chosen",
        t_probe_us=constants.get("t_probe_us", 300.0),
        bw_gbps=1.0,
        turnaround_us=650.0,
        bulk_bw_gbps=1.0,
    )
    terms = dict(
        splice_us_per_token=constants.get("splice_us_per_token", 15.0),
        scatter_us_per_token=2.0,
        c_us=constants.get("c_us", 2.5),
        **{k: constants.get(k, v) for k, v in ROUTE_SIDES.items()},
    )
    cal = Calibration(fabric, terms, dict.fromkeys(terms, "chosen"))
    profile = cal.machine_profile(cfg)
    plan = plan_workload(
        geometry=model.geometry,
        profile=profile,
        lengths=corpus.lengths,
        whole_agents=cfg.whole_agents,
        chunks_per_agent=cfg.chunks_per_agent,
        selection_agents=cfg.selection_agents,
        steps=cfg.steps,
        topk=cfg.topk,
    )
    agents = make_agents(cfg, corpus, plan)
    decisions = Decisions(cfg, model, corpus, cal, readers(agents))
    for agent in agents:
        for c in agent.chunks:
            decisions(agent, c)
    return cfg, model.geometry, profile, plan, agents, decisions


def _holder_us(profile, m_q: int, width: int) -> float:
    """A lone route call's holder side beyond its round trip and its attention, stated here:
    what the requester's send alone and the holder's host work take beyond the round trip
    (which otherwise covers them). The attention call itself (``m_q x width`` rows x tokens)
    is left out: fetch and local run the same kernel on the requester."""
    fixed = profile.fabric.t_probe_us + profile.fabric.turnaround_us
    return max(profile.send_alone_us + profile.host_us - fixed, 0.0)


def _predicate_picks(cfg, geometry, profile, agents) -> dict:
    """(agent, chunk) -> the predicate's pick, the request built here from the agents: route
    pays every agent reading the chunk at that offset ``steps x L`` calls of ``H`` rows, each
    its round trip and its holder side (:func:`_holder_us`: over the chunk, or a selection's
    ``topk``-wide index row), fetch (a splice when the chunk moved from its canonical
    position) and local once, attention and merge left out."""
    from mqnc.cost import HostOverhead, Request, decide
    from mqnc.demo.workload import Corpus, build_model

    corpus = Corpus(cfg, build_model(cfg))
    out = {}
    for a in agents:
        for c in a.chunks:
            n = sum(b.offsets.get(c) == a.offsets[c] for b in agents)
            req = Request(
                geometry.heads,
                corpus.lengths[c],
                moved=a.offsets[c] != corpus.positions[c],
                attention=False,
                round_trips=n * cfg.steps * geometry.layers,
            )
            width = cfg.topk if a.kind == "selection" else corpus.lengths[c]
            host = HostOverhead(_holder_us(profile, geometry.heads, width), 0.0)
            out[(a.name, c)] = decide(geometry, profile.replace(host=host), req).primitive
    return out


@pytest.mark.parametrize("host_us", [200.0, 2000.0])
@pytest.mark.parametrize(
    "tokens, readers, steps, moved, width",
    [(288, 1, 1, True, None), (509, 2, 2, True, None), (400, 1, 1, False, 256)],
)
def test_route_price_is_the_wave_models_call(tokens, readers, steps, moved, width, host_us):
    """The route cost the decision uses is, call for call, what the report's wave model
    predicts for the same call on its own (:class:`mqnc.demo.report.Report`, a call in no
    noted wave, through :func:`mqnc.demo.waves.predict_wave`) less its attention call (the
    holder runs it for a route, the requester the same kernel for a fetch or a re-prefill:
    left out of all three): the round trip and, where the send alone and the holder's host
    work exceed the round trip (``host_us`` 2000 here), the excess, the predicate's host term,
    so that ``explain()`` shows it."""
    from mqnc.cost import FabricProfile
    from mqnc.demo.calibration import Calibration
    from mqnc.demo.report import Report
    from mqnc.demo.teams import decide_read
    from mqnc.demo.workload import Corpus, build_model

    cfg = DemoConfig(progress=False, device="cpu", kernels="torch")
    model = build_model(cfg)
    g = model.geometry
    fabric = FabricProfile(
        "chosen", t_probe_us=300.0, bw_gbps=1.0, turnaround_us=650.0, bulk_bw_gbps=1.0
    )
    terms = dict(
        send_us=150.0,
        send_alone_us=60.0,
        compute_fixed_us=900.0,
        compute_us_per_row_token=0.2,
        host_us=host_us,
        splice_us_per_token=11.0,
        scatter_us_per_token=1.7,
        c_us=400.0,
        fetch_fixed_us=1100.0,
        merge_us=200.0,
    )
    cal = Calibration(fabric, terms, dict.fromkeys(terms, "chosen"))
    profile = cal.machine_profile(cfg)
    d = decide_read(g, profile, tokens, moved=moved, readers=readers, steps=steps, width=width)
    trips = readers * steps * g.layers
    assert d.inputs["round_trips"] == trips
    # the report's prediction of the same call: H rows over the chunk (or the index row)
    corpus = Corpus(cfg, model)
    corpus.lengths[0] = tokens  # the call's chunk
    report = Report(cfg, g, corpus, cal, waves={}, deltas={})
    rec = CostRecord("route", 1, 0, 0, g.heads, 0, 0)
    if width is None:
        predicted = report.predict(rec)
    else:  # a selection's call over its index row
        (predicted,) = predict_wave(
            [WaveCall(1, g.heads, g.heads * width, True)], g, cal.fabric, cal.route
        )
    lone = predicted["total"] - predicted["compute"]  # the call, its attention left out
    assert d.route.total == pytest.approx(trips * lone, rel=1e-12)
    holder = d.route.host / trips
    assert holder == pytest.approx(_holder_us(profile, g.heads, width or tokens), abs=1e-9)
    assert holder == pytest.approx(predicted["queue"], abs=1e-9)
    assert (predicted["queue"] > 0) == (host_us == 2000.0)
    if holder:
        assert f"+ host {d.route.host:.1f}" in d.explain()
    # the round trip is the predicate's own: probe, turnaround, the rows' bytes out and back
    assert d.route.transport / trips == pytest.approx(
        predicted["probe"] + predicted["transfer"] + predicted["return_"], rel=1e-12
    )


def test_default_workload_exercises_each_path_where_the_constants_say_it_wins():
    """On constants where each path wins somewhere (route a round trip of ~1 ms, re-prefill
    2.5 us a token-layer, a splice of 15 us a token, the pool write 2), the default workload
    is planned so that route, fetch and local each occur, and every (chunk, agent) is what the
    predicate decides for it on those constants: agents sharing a context share one fetch or
    re-prefill and each pays its own route calls."""
    cfg, g, profile, plan, agents, decisions = _planned()
    picks = {key: d["primitive"] for key, d in decisions.table.items()}
    assert set(picks.values()) == {"route", "fetch", "local"}, plan.to_dict()
    assert picks == _predicate_picks(cfg, g, profile, agents)
    assert not plan.never and not plan.left_out
    assert all(d["predicate"] == d["primitive"] for d in decisions.table.values())
    # the whole-chunk agents: every agent of the default, in teams of the plan
    assert sum(t.size for t in plan.teams) == cfg.whole_agents
    assert all(len(t.chunks) == cfg.chunks_per_agent for t in plan.teams)
    # a team reads its chunks at the same offsets: one decision for all its agents
    for team_agents in _teams(agents):
        for c in team_agents[0].chunks:
            assert len({decisions.table[(a.name, c)]["primitive"] for a in team_agents}) == 1
    # the route picks' chunks are longer than the other picks' of the same readers (the
    # crossover falls between them), and the crossover is where the plan says
    solo = [d for d in decisions.table.values() if d["readers"] == ["whole-0"]]
    routed = [d["tokens"] for d in solo if d["primitive"] == "route"]
    other = [d["tokens"] for d in solo if d["primitive"] != "route"]
    assert routed and other and min(routed) > plan.crossover[1] > max(other)


def _teams(agents) -> list[list]:
    by_offsets: dict = {}
    for a in agents:
        if a.kind == "whole":
            by_offsets.setdefault(tuple(sorted(a.offsets.items())), []).append(a)
    return list(by_offsets.values())


@pytest.mark.parametrize(
    "constants, path, says",
    [
        (dict(c_us=200.0), "local", "us a token (4 layers x 200.0 of re-prefill)"),
        (dict(t_probe_us=20000.0), "route", "one agent would route a chunk above"),
    ],
)
def test_a_path_that_never_wins_is_named_with_the_numbers(constants, path, says):
    """Where the constants rule a path out for every chunk and team size, the plan says which
    and why (each path's unit cost and where it came closest), the printed decisions carry it,
    and the summary names it; the decisions stay the predicate's."""
    from mqnc.demo.teams import check_lines, decision_lines

    cfg, g, profile, plan, agents, decisions = _planned(**constants)
    picks = {key: d["primitive"] for key, d in decisions.table.items()}
    assert path not in picks.values() and picks == _predicate_picks(cfg, g, profile, agents)
    assert set(plan.never) == {path}
    assert plan.never[path].startswith(f"{path} never wins here: ") and says in plan.never[path]
    printed = " ".join(decision_lines(list(decisions.table.values()), plan.to_dict()))
    assert " ".join(plan.never[path].split()) in " ".join(printed.split())
    summary = check_lines(list(decisions.table.values()), {}, plan.to_dict(), 5)
    assert any(line.split()[0] == path and "never wins here" in line for line in summary[1:])


def test_printed_decisions_name_each_path_and_its_predicted_costs():
    """One line per (chunk, context) read: the chunk, its tokens, who reads it, the route
    calls, the predicted us of route, fetch and local (``*`` on the pick) and the pick with its
    margin; the selection agent's like reads on one line with their ranges; the terms each
    path is priced with above; everything within 100 columns. The summary gives each path's
    count and its check against fp64."""
    from mqnc.cost import PRIMITIVES
    from mqnc.demo.teams import check_lines, decision_lines

    cfg, g, profile, plan, agents, decisions = _planned()
    table = list(decisions.table.values())
    lines = decision_lines(table, plan.to_dict())
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    counts = {p: sum(d["primitive"] == p for d in table) for p in ("route", "fetch", "local")}
    assert lines[0] == "\ndecisions per (chunk, agent): " + ", ".join(
        f"{p} {n}" for p, n in counts.items()
    )
    for head in ("  route  calls x ", "  fetch  pull ", "  local  re-prefill 4 layers x 2.5 "):
        assert any(line.startswith(head) for line in lines), head
    rows = [line.split() for line in lines if re.match(r"^ *\(?\d+\)? +\d+(-\d+)?  \S", line)]
    for d in table:
        if not d["readers"][0].startswith("whole"):
            continue
        (cells,) = [r for r in rows if r[:2] == [str(d["chunk"]), str(d["tokens"])]
                    and " ".join(r[2:]).startswith(", ".join(d["readers"]))]  # fmt: skip
        assert cells[-2] == d["primitive"] and cells[-1] == f"x{d['margin_ratio']:.2f}"
        costs = [f"{d['costs_us'][p]:,.0f}" + "*" * (p == d["primitive"]) for p in PRIMITIVES]
        assert cells[-6:-2] == [str(d["round_trips"]), *costs], cells
    # the selection agent's reads: one line per pick, their count in the chunk column
    sel = [d for d in table if d["readers"] == ["select-0"]]
    grouped = [r for r in rows if r[2:5] == ["select-0", "in", "place"]]
    assert sum(int(r[0].strip("()")) if r[0].startswith("(") else 1 for r in grouped) == len(sel)
    for r in grouped:
        assert r[-2] in {d["primitive"] for d in sel} and r[-6] == str(cfg.steps * g.layers)
    assert "crossover: route wins a chunk read at a new offset by 1 agent above" in " ".join(lines)
    # the summary: each path, its decisions and its partials against fp64
    checked = {"route": [1e-3] * 4, "fetch": [2e-3] * 8, "local": [3e-3] * 2}
    summary = check_lines(table, checked, plan.to_dict(), 5)
    assert summary[0] == (
        "\nper path, the predicate's decode (5 repeats); exact: every partial within one bf16 ulp"
        " of fp64"
    )
    for p, errs in checked.items():
        (line,) = [x for x in summary if x.split()[:1] == [p]]
        assert f"{counts[p]} (chunk, agent) decisions" in line
        assert f"{len(errs)} partials, max |err| {max(errs):.2e}: exact" in line
