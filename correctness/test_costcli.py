"""``mqnc predict | crossover | fit | presets`` through ``mqnc.cli.main``.

The fit test feeds a results file written by ``mqnc.measure.results_file.record`` from known
constants plus noise and checks the command recovers them; the others check the commands
against the library functions they wrap and their errors.
"""

from __future__ import annotations

import csv
import json
import re

import numpy as np
import pytest

from mqnc.cli import main
from mqnc.cost import FABRICS, FabricProfile, get_fabric
from mqnc.cost import predicate as pr
from mqnc.model import PRESETS, get_preset


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_presets_lists_models_and_fabrics(capsys):
    rc, out, _ = run(capsys, "presets")
    assert rc == 0
    for name in list(PRESETS) + list(FABRICS):
        assert name in out
    rc, out, _ = run(capsys, "presets", "--json")
    data = json.loads(out)
    assert data["fabrics"]["h100-ibgda"]["t_probe_us"] == FABRICS["h100-ibgda"].t_probe_us
    assert data["models"]["deepseek-v2-lite"]["qp_row_bytes"] == 2184


@pytest.mark.parametrize(
    "argv",
    [
        ["--m-q", "256", "--c-t", "2048"],
        ["--m-q", "64", "--c-t", "32", "--fabric", "a40-pcie4", "--c-us", "0.5"],
        ["--m-q", "1024", "--topk", "2048", "--holders", "7", "--model", "deepseek-v3.2"],
        ["--m-q", "256", "--congestion-bw", "0.4", "--congestion-probe-us", "25", "--tp", "2"],
        ["--mq", "100", "--ct", "300"],  # the old spellings, kept as hidden aliases
    ],
)
def test_predict_matches_decide(capsys, argv):
    rc, out, _ = run(capsys, "predict", "--json", *argv)
    assert rc == 0
    got = json.loads(out)
    rc, table, _ = run(capsys, "predict", *argv)
    assert rc == 0 and f"decision: {got['primitive']}" in table
    inputs = got["inputs"]
    from mqnc.cost import Congestion

    cong = inputs["congestion"]
    d = pr.decide(
        get_preset(inputs["model"]),
        get_fabric(inputs["fabric"]),
        inputs["m_q"],
        inputs["c_t"],
        topk=inputs["topk"],
        holders=inputs["holders"],
        c_us=inputs["c_us"],
        tp=inputs["tp"],
        congestion=Congestion(**cong) if cong else None,
    )
    assert got["primitive"] == d.primitive
    assert got["costs"] == pytest.approx(d.costs, rel=1e-12)


def test_predict_flags(capsys):
    rc, out, _ = run(
        capsys,
        "predict",
        "--json",
        "--splice-ms",
        "1",
        "--host-overhead",
        "--allow",
        "fetch,local",
    )
    d = json.loads(out)
    assert rc == 0 and d["fetch"]["splice"] == 1000 and d["route"]["host"] > 3500
    assert d["primitive"] in ("fetch", "local")
    rc, out, _ = run(capsys, "predict", "--json", "--no-splice")
    assert json.loads(out)["fetch"]["splice"] == 0


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["predict", "--fabric", "nvlink9"], "argument --fabric: "),
        (["predict", "--fabric", "nvlink9"], "h100-ibgda"),
        (["predict", "--model", "gpt-5"], "argument --model: "),
        (["predict", "--model", "gpt-5"], "deepseek-v2-lite"),
        (["predict", "--m-q", "-3"], "argument --m-q: expected a number > 0, got '-3'"),
        (["predict", "--congestion-bw", "-1"], "argument --congestion-bw: expected a number > 0"),
        (["predict", "--congestion-probe-us", "x"], "argument --congestion-probe-us: expected"),
        (["predict", "--holders", "0"], "argument --holders: expected a number >= 1"),
        (["predict", "--allow", "fetch,teleport"], "argument --allow: expected comma-separated"),
        (["predict", "--splice-ms", "1", "--no-splice"], "at most one of"),
        (["predict", "--allow", "route,route"], "each once"),
        (["predict", "--holders", "7"], "--holders: only means something with --topk"),
        (["predict", "--splice-variant", "v"], "--splice-variant: only means something with"),
        (["predict", "--splice-device", "d"], "--splice-device: only means something with"),
        (["predict", "--splice-backend", "b"], "--splice-backend: only means something with"),
        (["predict", "--congestion-route-only"], "--congestion-route-only: only means"),
        (["crossover", "--out", "/nonexistent/x", "--holders", "3"], "--holders: only"),
        (
            ["crossover", "--out", "/nonexistent/x", "--m-q-min", "9", "--m-q-max", "3"],
            "--m-q-min/--m-q-max",
        ),
        (["crossover", "--out", "/nonexistent/x", "--points", "1"], "--points: expected >= 2"),
        (["fit", "/nonexistent/results.jsonl"], "no such file"),
    ],
)
def test_errors_name_the_flag(capsys, argv, needle):
    """A bad value is reported against the flag the user typed, never an internal name (exit
    status 2, no work done)."""
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and needle in err and not out
    assert "bw_factor" not in err and "Congestion" not in err


def test_fit_recovers_constants_from_a_results_file(tmp_path, capsys):
    from mqnc.measure import record

    rng = np.random.default_rng(1)
    path = tmp_path / "results.jsonl"
    probe, bw, turn = 6.5, 30.0, 4.0
    for _ in range(5):
        p = probe * (1 + 0.01 * rng.standard_normal())
        record("probe", "my-fabric", 1, (p, p, p), x_name="bytes", path=path)
    for m in 2 ** np.arange(0, 13):
        for _ in range(3):
            t = (probe + turn + m * 2184 / (bw * 1e3)) * (1 + 0.01 * rng.standard_normal())
            record("route", "my-fabric", int(m), (t, t, t), x_name="M_q", path=path)
    record("splice", "kernel", 2048, (900.0, 1000.0, 1100.0), x_name="c_t", path=path)
    out_json = tmp_path / "fab.json"
    rc, out, _ = run(
        capsys, "fit", str(path), "--json", "--save", str(out_json), "--link-peak-gbps", "50"
    )
    assert rc == 0
    res = json.loads(out)["my-fabric"]
    assert abs(res["bw_gbps"] - bw) / bw < 0.03
    assert abs(res["t_probe_us"] - probe) < 0.2 and abs(res["turnaround_us"] - turn) < 2.0
    assert res["mape_amortised_affine"] < 0.03
    prof = FabricProfile.load(out_json)
    assert prof.name == "my-fabric" and prof.link_peak_gbps == 50.0
    rc, table, _ = run(capsys, "fit", str(path))
    assert rc == 0 and "my-fabric" in table
    # the saved profile and the measured splice feed `mqnc predict`
    rc, out, _ = run(
        capsys, "predict", "--json", "--fabric", str(out_json), "--splice-from", str(path)
    )
    d = json.loads(out)
    assert rc == 0 and d["inputs"]["fabric"] == "my-fabric" and d["fetch"]["splice"] == 1000.0
    assert d["route"]["probe"] == pytest.approx(prof.t_probe_us)


def test_crossover_writes_csv_and_png(tmp_path, capsys):
    out = tmp_path / "xo"
    rc, stdout, _ = run(capsys, "crossover", "--out", str(out), "--points", "6")
    assert rc == 0
    names = {p.name for p in out.iterdir()}
    assert names == {
        "fig3b_wire_bytes.csv",
        "crossover_cost.csv",
        "fig6a_bw_sweep.csv",
        "fig3b_crossover.png",
        "fig6a_bw_sweep.png",
    }
    assert all((out / n).stat().st_size > 0 for n in names)
    v2 = get_preset("deepseek-v2-lite")
    with open(out / "fig3b_wire_bytes.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 36
    for r in rows:
        m, c = float(r["m_q"]), float(r["c_t"])
        assert float(r["route_saving_pct"]) == pytest.approx(
            100 * (1 - m * 2184 / (c * v2.kv_bytes_per_token_layer))
        )
    with open(out / "fig6a_bw_sweep.csv") as f:
        sweep = list(csv.DictReader(f))
    assert len(sweep) == 6 and all(r["primitive"] == "route" for r in sweep)
    assert float(sweep[0]["bw_gbps"]) == pytest.approx(0.2)
    with open(out / "crossover_cost.csv") as f:
        cost = list(csv.DictReader(f))
    for r in cost:
        d = pr.decide(v2, FABRICS["h100-ibgda"], float(r["m_q"]), float(r["c_t"]))
        assert r["primitive"] == d.primitive


def test_crossover_csv_only(tmp_path, capsys):
    rc, _, _ = run(capsys, "crossover", "--out", str(tmp_path), "--points", "4", "--no-png")
    assert rc == 0 and not list(tmp_path.glob("*.png"))


def _sweep(device, commit, date, qp, probe, bw, turn, variant="gloo"):
    """Records of one route sweep (exact constants), in the results file's long format."""
    base = dict(variant=variant, device=device, commit=commit, date=date, unit="us")
    recs = [dict(base, bench="probe", x=1, p20=probe, p50=probe, p80=probe, extra={})]
    for m in (64, 512, 1024, 2048, 4096):
        t = probe + turn + m * qp / (bw * 1e3)
        recs.append(dict(base, bench="route", x=m, p20=t, p50=t, p80=t, extra={"qp_row_bytes": qp}))
    return recs


def test_fit_groups_by_device_transport_payload_and_commit(tmp_path, capsys):
    """Sweeps of two machines, two commits and a payload sweep are fitted apart (pooled, none
    of them would come out right); --save takes the newest sweep at the model's row unless
    --group (or a filter) says otherwise; a negative turnaround is reported."""
    old = _sweep("gpu-a", "aaaa", "2026-01-01T00:00:00+00:00", 2184, 10.0, 20.0, 5.0)
    new = _sweep("cpu-b", "bbbb", "2026-02-01T00:00:00+00:00", 2184, 100.0, 2.0, 50.0)
    payload = _sweep("cpu-b", "bbbb", "2026-03-01T00:00:00+00:00", 8736, 100.0, 2.0, -40.0)
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in old + payload + new))
    prof = tmp_path / "fab.json"
    rc, table, err = run(capsys, "fit", str(path), "--save", str(prof))
    assert rc == 0
    for label in ("gloo@2184B/aaaa", "gloo@2184B/bbbb", "gloo@8736B"):
        assert label in table
    assert "> gloo@2184B/bbbb" in table and f"saved {prof}" in table
    saved = FabricProfile.load(prof)
    assert saved.name == "gloo@2184B/bbbb"
    assert saved.bw_gbps == pytest.approx(2.0) and saved.t_probe_us == pytest.approx(100.0)
    assert saved.turnaround_us == pytest.approx(50.0)
    assert "negative turnaround in gloo@8736B (-40.0 us)" in err and "not a time" in err
    rc, out, _ = run(capsys, "fit", str(path), "--json", "--group", "gloo@2184B/aaaa", "--save",
                     str(prof))  # fmt: skip
    got = json.loads(out)
    assert rc == 0 and list(got) == ["gloo@2184B/aaaa"] and got["gloo@2184B/aaaa"]["saved"]
    assert got["gloo@2184B/aaaa"]["device"] == "gpu-a"
    assert got["gloo@2184B/aaaa"]["bw_gbps"] == pytest.approx(20.0)
    assert FabricProfile.load(prof).t_probe_us == pytest.approx(10.0)
    rc, out, _ = run(capsys, "fit", str(path), "--json", "--device", "GPU", "--save", str(prof))
    assert rc == 0 and [k for k, v in json.loads(out).items() if v["saved"]] == ["gloo@2184B/aaaa"]
    rc, _, err = run(capsys, "fit", str(path), "--group", "nope")
    assert rc == 2 and "--group: no sweep 'nope'" in err and "gloo@8736B" in err
    rc, _, err = run(capsys, "fit", str(path), "--commit", "cccc")
    assert rc == 2 and "no sweep matches" in err


def test_fit_reports_a_sweep_it_cannot_fit(tmp_path, capsys):
    good = _sweep("cpu", "c1", "2026-01-01T00:00:00+00:00", 2184, 10.0, 5.0, 1.0)
    flat = _sweep("cpu", "c1", "2026-01-01T00:00:00+00:00", 2184, 10.0, 5.0, 1.0, variant="bad")
    for r in flat:
        r["p50"] = 500.0 - r["x"] / 100  # a round trip that shrinks with M_q
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good + flat))
    rc, table, err = run(capsys, "fit", str(path), "--save", str(tmp_path / "f.json"))
    assert rc == 0 and "bad" in table and "no fit: samples: round trip does not grow" in table
    assert "not fitted: bad" in err
    assert FabricProfile.load(tmp_path / "f.json").name == "gloo"


def test_readme_fit_and_predict_on_the_repository_results(tmp_path, capsys):
    """docs/cost-model.md's fit and predict lines, on the committed results file."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "perf" / "results" / "results.jsonl"
    prof = tmp_path / "my_fabric.json"
    rc, table, err = run(capsys, "fit", str(results), "--save", str(prof))
    assert rc == 0, err
    one = ["--splice-device", "NVIDIA H200", "--splice-backend", "triton"]
    argv = ["predict", "--fabric", str(prof), "--splice-from", str(results), *one]
    rc, out, err = run(capsys, *argv, "--splice-variant", "one-launch")
    assert rc == 0 and "decision:" in out, err
    assert "measured: NVIDIA H200, triton backend, variant one-launch" in out


def test_predict_splice_from_takes_one_device_and_backend(capsys):
    """``--splice-from`` on the repository's results (CPU interpreter, CPU torch, H200 Triton,
    H200 torch): refused, listing each, until one device, backend and variant is picked; the
    H200 Triton kernel's splice at 2048 is its own (42.5 and 44.5 us), not a pool's median."""
    from pathlib import Path

    results = str(Path(__file__).resolve().parents[1] / "perf" / "results" / "results.jsonl")
    rc, _, err = run(capsys, "predict", "--json", "--c-t", "2048", "--splice-from", results)
    assert rc != 0 and "one device, backend and variant" in err
    for listed in ("'NVIDIA H200'", "'CPU: ", "'interpreter'", "'triton'", "'torch'"):
        assert listed in err, listed
    one = ["--splice-device", "NVIDIA H200", "--splice-backend", "triton"]
    rc, out, err = run(
        capsys, "predict", "--json", "--c-t", "2048", "--splice-from", results, *one,
        "--splice-variant", "one-launch",
    )  # fmt: skip
    d = json.loads(out)
    assert rc == 0 and d["fetch"]["splice"] == pytest.approx((42.528 + 44.464) / 2, rel=1e-3)
    assert (
        "NVIDIA H200, triton backend" in d["inputs"]["splice"]
        and "bb7e891ac886" in d["inputs"]["splice"]
    )


def test_fit_negative_intercept_without_probe(tmp_path, capsys):
    recs = _sweep("cpu", "c1", "2026-01-01T00:00:00+00:00", 2184, 10.0, 5.0, -30.0)
    recs = [r for r in recs if r["bench"] == "route"]  # no probe: the intercept is T_probe
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rc, table, err = run(capsys, "fit", str(path))
    assert rc == 0 and "gloo" in table and "negative intercept without a probe record" in err
    rc, _, err = run(capsys, "fit", str(path), "--save", str(tmp_path / "f.json"))
    assert rc == 2 and "--save: gloo has no probe record and a negative intercept" in err
    assert not (tmp_path / "f.json").exists()


def test_fabric_file_with_a_wrong_field_type_names_the_file_and_field(tmp_path, capsys):
    bad = tmp_path / "strprobe.json"
    bad.write_text(json.dumps(dict(name="x", t_probe_us="16", bw_gbps=25.0)))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    for path, field in ((bad, "t_probe_us: expected a number, got str"), (listed, "a dict")):
        rc, out, err = run(capsys, "predict", "--fabric", str(path))
        assert rc == 2 and not out
        assert f"argument --fabric: {path}" in err and field in err, err


def test_predict_shows_a_profiles_host_term_and_charges_it_per_round_trip(tmp_path, capsys):
    """A calibrated profile's host overhead (§5.3) is in route's printed terms whenever it is in
    its total, once per routed call (``--round-trips``)."""
    prof = tmp_path / "host.json"
    fab = FabricProfile("calibrated", 200.0, 2.0, host_fixed_us=1000.0, host_per_row_us=1.0)
    prof.write_text(json.dumps(fab.to_dict()))
    for trips in (1, 27):
        rc, out, _ = run(capsys, "predict", "--fabric", str(prof), "--m-q", "16",
                         "--round-trips", str(trips))  # fmt: skip
        assert rc == 0
        line = next(x for x in out.splitlines() if x[1:].startswith("route "))
        assert f"+ host {trips * 1016.0:.1f}" in line, line
        total, *terms = [float(v) for v in re.findall(r"(\d+\.\d)", line)]
        assert total == pytest.approx(sum(terms), abs=0.05 * len(terms)), line


@pytest.mark.parametrize(
    "lines, needle",
    [
        (['{"bench":"route","x":16,"p50":1}', '{"bench":"route","x":512}'], "line 2: key 'p50'"),
        (["[1, 2]"], "line 1: expected a JSON object (a record), got list"),
        (['{"bench":"route","x":"abc","p50":1}'], "line 1: key 'x': expected a finite number"),
        (['{"bench":"route","x":true,"p50":1}'], "line 1: key 'x': expected a finite number"),
        (['{"bench":"route","x":16,"p50":NaN}'], "line 1: key 'p50': expected a finite number"),
        (['{"bench":"route","x":16,"p50":1,"extra":[1]}'], "line 1: key 'extra': expected"),
        (
            ['{"bench":"route","x":16,"p50":1,"extra":{"qp_row_bytes":2.5}}'],
            "line 1: key 'extra.qp_row_bytes': expected an int >= 1, got 2.5",
        ),
        (['{"bench":"probe","p50":5}', '{"bench":"route","p50":3}'], "record 2 (bench 'route')"),
    ],
)
@pytest.mark.parametrize("command", ["fit", "splice"])
def test_malformed_results_records_are_one_line_errors(tmp_path, capsys, lines, needle, command):
    """Every record `mqnc fit` and `--splice-from` read is checked: a line that is not an object,
    or whose x / p50 / extra is missing or not a number, is one line naming file, line and key
    (exit status 2), never a KeyError, AttributeError or a float() message without a place."""
    path = tmp_path / "bad.jsonl"
    if command == "splice":
        lines = [s.replace('"route"', '"splice"') for s in lines]
        needle = needle.replace("record 2 (bench 'route')", "line 1: key 'x'")
        argv = ["predict", "--splice-from", str(path)]
    else:
        argv = ["fit", str(path)]
    path.write_text("\n".join(lines) + "\n")
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and not out, err
    assert needle in err and str(path) in err and len(err.strip().splitlines()) == 1, err


def test_fit_probe_records_need_no_x(tmp_path, capsys):
    """A probe measures a fixed payload: `mqnc fit` takes its p50 without an x."""
    path = tmp_path / "ok.jsonl"
    recs = [
        {"bench": "route", "variant": "gloo", "x": 16, "p50": 100},
        {"bench": "route", "variant": "gloo", "x": 512, "p50": 300},
        {"bench": "probe", "variant": "gloo", "p50": 50},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rc, out, err = run(capsys, "fit", str(path), "--json")
    assert rc == 0, err
    assert json.loads(out)["gloo"]["t_probe_us"] == 50.0


@pytest.mark.parametrize("flag", [["--name", "mine"], ["--link-peak-gbps", "50"]])
def test_fit_save_only_flags_without_save_are_an_error(tmp_path, capsys, flag):
    """--name and --link-peak-gbps describe the saved profile: without --save they would be
    ignored, so they are a one-line error naming the flag (exit status 2)."""
    recs = _sweep("cpu", "c1", "2026-01-01T00:00:00+00:00", 2184, 10.0, 5.0, 1.0)
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rc, out, err = run(capsys, "fit", str(path), *flag)
    assert rc == 2 and not out
    assert f"{flag[0]}: only applies with --save" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--m-q", "256", "--c-t", "2048"],
        ["--m-q", "1024", "--topk", "2048", "--holders", "7", "--host-overhead"],
    ],
)
def test_predict_prints_the_decisions_own_explanation(capsys, argv):
    """One formatter: ``mqnc predict``'s table is ``Decision.explain()`` of the decision its
    ``--json`` describes, and the JSON's wire bytes are the decision's."""
    from mqnc.cost import HOST_PAPER

    rc, out, _ = run(capsys, "predict", "--json", *argv)
    got = json.loads(out)
    i = got["inputs"]
    kw = dict(topk=i["topk"], holders=i["holders"])
    if "--host-overhead" in argv:
        kw["host"] = HOST_PAPER
    d = pr.decide(get_preset(i["model"]), get_fabric(i["fabric"]), i["m_q"], i["c_t"], **kw)
    rc, table, _ = run(capsys, "predict", *argv)
    assert rc == 0 and table == d.explain() + "\n"
    assert got["wire"] == pytest.approx(d.wire)


def test_an_fp8_cache_is_priced_with_its_own_splice(tmp_path, capsys):
    """DeepSeek-V3.2's FP8 cache splices 656-byte entries, not 1152-byte rows: ``mqnc predict
    --kv-dtype fp8 --splice-from`` reads the FP8 splice records only (``extra.kv_dtype`` fp8),
    bf16 the others (a record without the field is bf16's); with no FP8 record it is refused,
    naming the benchmark that measures one. A profile prices an FP8 geometry's fetch with
    ``splice_fp8`` (per token when only that is measured), else its bf16 splice named as a
    stand-in, and the profile's JSON keeps it."""
    from mqnc.cost import MachineProfile, SpliceProfile
    from mqnc.measure.results_file import record

    path = tmp_path / "r.jsonl"
    for ct, us in ((1024, 600.0), (2048, 1000.0)):
        record("splice", "one-launch", ct, (us, us, us), x_name="c_t", path=path)
        record("splice", "one-launch", ct, (us / 2,) * 3, x_name="c_t", path=path,
               extra={"kv_dtype": "fp8"})  # fmt: skip
    argv = ["predict", "--json", "--c-t", "2048", "--splice-from", str(path)]
    rc, out, _ = run(capsys, *argv)
    assert rc == 0 and json.loads(out)["fetch"]["splice"] == 1000.0
    rc, out, _ = run(capsys, *argv, "--kv-dtype", "fp8")
    assert rc == 0 and json.loads(out)["fetch"]["splice"] == 500.0
    bf16_only = tmp_path / "bf16.jsonl"
    record("splice", "one-launch", 2048, (900.0,) * 3, x_name="c_t", path=bf16_only)
    rc, _, err = run(capsys, "predict", "--c-t", "2048", "--splice-from", str(bf16_only),
                     "--kv-dtype", "fp8")  # fmt: skip
    assert rc != 0 and "perf.bench_splice --kv-dtype fp8" in err, err

    g = get_preset("deepseek-v3").replace(cache_dtype="fp8_e4m3")
    fabric = get_fabric("h100-ibgda")
    measured = MachineProfile(fabric, splice=SpliceProfile.flat(3000.0, "bf16 one"),
                              splice_fp8=SpliceProfile.flat(1200.0, "fp8 one"))  # fmt: skip
    d = pr.decide(g, measured, 16, 2048)
    assert d.fetch.splice == 1200.0 and d.inputs["splice"] == "fp8 one"
    assert pr.decide(g.replace(cache_dtype="bf16"), measured, 16, 2048).fetch.splice == 3000.0
    per_token = MachineProfile(fabric, splice_fp8_us_per_token=0.25)
    assert pr.decide(g, per_token, 16, 2048).fetch.splice == pytest.approx(512.0)
    stand_in = pr.decide(
        g, MachineProfile(fabric, splice=SpliceProfile.flat(3000.0, "x")), 16, 2048
    )
    assert stand_in.fetch.splice == 3000.0 and "no FP8 splice measured" in stand_in.inputs["splice"]
    again = MachineProfile.from_dict(json.loads(json.dumps(measured.to_dict())))
    assert again.splice_fp8 == measured.splice_fp8
