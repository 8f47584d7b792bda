"""Smoke tests of the benchmarks (``perf/bench_*.py``): structure, never speed.

Each benchmark runs with tiny settings into a temporary results file; what is checked is what
readers rely on: the records' fields and conventions (``mqnc fit``, ``mqnc.plots``), where
records go (an untracked file by default, the repository's only with ``--record``), the flag
set every benchmark shares, and exit statuses (``--check``: 1 on a missed target). Timings are
never asserted beyond their order (p20 <= p50 <= p80) and sign, and nothing here fits noisy
timed numbers: on a loaded 2-core machine a fit of three repetitions can come out with any
slope. The CPU holder path of ``bench_holder`` is checked against the fp64 reference.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mqnc.measure import Target, check_targets
from mqnc.model import get_preset

GEOM = get_preset("deepseek-v2-lite")
ROOT = Path(__file__).resolve().parent.parent
BENCHES = sorted(p.stem for p in (ROOT / "perf").glob("bench_*.py"))
SHARED_FLAGS = ("--quick", "--reps", "--warmup", "--out", "--record", "--check")
FIELDS = {
    "bench",
    "variant",
    "x",
    "x_name",
    "p20",
    "p50",
    "p80",
    "unit",
    "bytes",
    "device",
    "transport",
    "backend",
    "version",
    "commit",
    "date",
    "extra",
}


def _records(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_common(recs: list[dict], transport: str | None) -> None:
    assert recs, "no records written"
    for r in recs:
        assert FIELDS <= set(r), f"missing fields {FIELDS - set(r)} in {r}"
        assert 0 < r["p20"] <= r["p50"] <= r["p80"], r
        assert r["unit"] == "us"
        if transport is not None:
            assert r["transport"] == transport


@pytest.mark.parametrize("bench", BENCHES)
def test_every_benchmark_takes_the_shared_flags(bench, capsys):
    """One flag set for all benchmarks (``mqnc.measure.options.bench_parser``)."""
    mod = importlib.import_module(f"perf.{bench}")
    assert '\nif __name__ == "__main__":\n' in Path(mod.__file__).read_text(), "not runnable"
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in SHARED_FLAGS:
        assert flag in text, f"{bench}: no {flag}"
    assert "``" not in text and ":mod:" not in text and ":func:" not in text
    with pytest.raises(SystemExit) as exc:  # --out and --record exclude each other
        mod.main(["--out", "x.jsonl", "--record"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_bench_route_loopback(tmp_path, capsys):
    from mqnc.cost import fit_groups
    from perf import bench_route

    out = tmp_path / "r.jsonl"
    rc = bench_route.main(
        ["--quick", "--m-q", "1,16,512", "--payloads", "900,2184", "--reps", "3", "--warmup",
         "1", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    assert f"7 records appended to {out}" in capsys.readouterr().out
    recs = _records(out)
    _check_common(recs, "loopback")
    probes = [r for r in recs if r["bench"] == "probe"]
    routes = [r for r in recs if r["bench"] == "route"]
    assert len(probes) == 1 and probes[0]["variant"] == "loopback"
    assert {(r["extra"]["qp_row_bytes"], r["x"]) for r in routes} == {
        (qp, m) for qp in (900, 2184) for m in (1, 16, 512)
    }
    for r in routes:
        qp = r["extra"]["qp_row_bytes"]
        assert r["variant"] == "loopback" and r["x_name"] == "m_q"
        assert r["bytes"] == r["x"] * qp
        assert r["extra"]["q_row_bytes"] + r["extra"]["p_row_bytes"] == qp
    real = [r for r in routes if r["extra"]["payload"] == "real"]
    assert {r["extra"]["q_row_bytes"] for r in real} == {GEOM.q_row_bytes}
    # `mqnc fit` groups them: one sweep per payload (same device and commit), each paired with
    # this run's probe. Whether a fit of 3 noisy repetitions exists is not this test's concern.
    groups = fit_groups(out, qp_row_bytes=GEOM.qp_row_bytes, fit_min_rows=1)
    assert {(g.label, g.qp_row_bytes) for g in groups} == {
        ("loopback@900B", 900),
        ("loopback@2184B", 2184),
    }
    assert {(g.device, g.commit) for g in groups} == {(probes[0]["device"], probes[0]["commit"])}
    for g in groups:
        assert g.fit is not None or "does not grow" in g.error
        assert g.fit is None or (g.fit.probe_measured and g.fit.t_probe_us == probes[0]["p50"])


def test_bench_route_gloo_subprocess(tmp_path):
    """Two processes over gloo on 127.0.0.1, as a researcher runs it; ``$MQNC_RESULTS`` is
    where records go when no flag says otherwise."""
    out = tmp_path / "g.jsonl"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MQNC_RESULTS=str(out))
    proc = subprocess.run(
        [sys.executable, "-m", "perf.bench_route", "--transport", "gloo", "--quick", "--m-q",
         "1,64", "--reps", "3", "--warmup", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = _records(out)
    _check_common(recs, "gloo")
    assert sorted(r["x"] for r in recs if r["bench"] == "route") == [1, 64]
    assert [r["bench"] for r in recs].count("probe") == 1


def test_bench_host_loopback(tmp_path, capsys):
    """The host path against its floors, loopback only: every case recorded in us,
    every ratio recorded with its unit, and ``--check`` judging the ratios against the goals
    (which way it goes is the machine's business, not this test's)."""
    from perf import bench_host

    out = tmp_path / "h.jsonl"
    rc = bench_host.main(
        ["--quick", "--transport", "loopback", "--reps", "3", "--warmup", "1", "--out", str(out)]
    )
    assert rc == 0
    assert f"records appended to {out}" in capsys.readouterr().out
    recs = _records(out)
    cases = [r for r in recs if r["bench"] == "host"]
    _check_common(cases, None)
    assert {r["variant"] for r in cases} == {
        "cond",
        "cond_payload",
        "pack",
        "pack_twice",
        "wake_only",
        "wake_pack",
        *(f"loopback.{k}" for k in ("echo_probe", "echo_route1", "echo_route256", "probe")),
        *(f"loopback.{k}" for k in ("route1", "route256", "holder4")),
        *(f"loopback.{k}" for k in ("probe_ready", "route1_ready", "route256_ready")),
    }
    ratios = {r["variant"]: r for r in recs if r["bench"] == "host_ratio"}
    # the wake penalty's ratio is left out when 3 repetitions cannot resolve its two differences
    wake = "host work after a 150 us idle wait / the same warm"
    assert len(ratios) == 9 + (wake in ratios)
    assert all(r["transport"] is None for r in ratios.values())
    assert wake not in ratios or ratios[wake]["unit"] == "ratio"
    assert all(r["p20"] == r["p50"] == r["p80"] for r in ratios.values())
    assert ratios["loopback: Requester.probe / cond"]["unit"] == "ratio"
    assert ratios["loopback: ready holder: route M_q 1 / probe"]["extra"]["goal"] == "- (floor)"
    assert ratios["loopback: holder, 4 requesters: routes/s"]["unit"] == "routes/s"
    assert ratios["loopback: host overhead fit: fixed (us)"]["unit"] == "us"
    rc = bench_host.main(["--quick", "--transport", "loopback", "--reps", "2", "--warmup", "0",
                          "--out", str(tmp_path / "c.jsonl"), "--check"])  # fmt: skip
    text = capsys.readouterr().out
    assert rc in (0, 1) and ("TARGETS MISSED" in text) == (rc == 1)
    assert text.count("target host path: gloo") == 3 and "not measured" in text


def test_bench_host_wake_penalty_is_left_out_when_noise_swamps_it():
    """The wake penalty's ratio is (wake_pack - wake_only) / (pack_twice - pack); when either
    difference is not positive (noise in a short run) no row is made, never a NaN or a
    negative ratio (a NaN record would fail the results file's own check)."""
    from perf import bench_host

    p50 = dict(pack=10.0, pack_twice=18.0, wake_only=150.0, wake_pack=174.0)
    assert bench_host._ratios(p50, []) == [
        ("host work after a 150 us idle wait / the same warm", 3.0, "-")
    ]
    for bad in (dict(p50, pack_twice=10.0), dict(p50, wake_pack=149.0)):
        assert bench_host._ratios(bad, []) == []


def test_bench_fetch_loopback(tmp_path):
    from perf import bench_fetch

    out = tmp_path / "f.jsonl"
    rc = bench_fetch.main(
        ["--quick", "--c-t", "16,64", "--max-holders", "3", "--topk", "64", "--m-q", "32",
         "--pool-rows", "256", "--reps", "3", "--warmup", "1", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    recs = _records(out)
    _check_common(recs, "loopback")
    contiguous = [r for r in recs if r["variant"].startswith("contiguous")]
    assert sorted(r["x"] for r in contiguous) == [16, 64]
    assert all(r["bytes"] == GEOM.chunk_bytes(r["x"]) and r["x_name"] == "c_t" for r in contiguous)
    gather = [r for r in recs if r["bench"] == "fetch" and r["x_name"] == "holders"]
    fan = [r for r in recs if r["bench"] == "route_fanout"]
    assert sorted(r["x"] for r in gather) == sorted(r["x"] for r in fan) == [1, 2, 3]
    assert all(r["bytes"] == 64 * GEOM.kv_bytes_per_token_layer for r in gather)
    assert all(r["bytes"] == r["x"] * 32 * GEOM.qp_row_bytes for r in fan)


def test_bench_congestion_loopback(tmp_path):
    from perf import bench_congestion

    out = tmp_path / "c.jsonl"
    rc = bench_congestion.main(
        ["--k", "0,2", "--m-q", "16,64", "--background-m-q", "64", "--reps", "3", "--warmup",
         "1", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    recs = _records(out)
    _check_common(recs, "loopback")
    assert all(r["bench"] == "congestion" and r["x_name"] == "flows" for r in recs)
    assert {(r["variant"], r["x"]) for r in recs} == {
        (v, k) for v in ("probe", "M_q=16", "M_q=64") for k in (0, 2)
    }
    assert all(r["extra"]["m_q"] == int(r["variant"][4:]) for r in recs if r["variant"] != "probe")


def test_bench_holder_cpu(tmp_path, capsys):
    from perf import bench_holder

    out = tmp_path / "h.jsonl"
    rc = bench_holder.main(
        ["--n", "1,4", "--heads", "16", "--c-t", "128", "--streams", "1,4", "--requests", "4",
         "--staging-c-t", "64", "--reps", "2", "--warmup", "1", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    recs = _records(out)
    _check_common(recs, None)
    batched = [r for r in recs if r["x_name"] == "requesters"]
    assert [r["x"] for r in batched] == [1, 4]
    assert all(r["bench"] == "holder" and r["variant"] == "h_q=16 c_t=128" for r in batched)
    staging = [r for r in recs if r["x_name"] == "streams"]
    if torch.cuda.is_available():
        assert all(r["backend"] == "triton" for r in batched)
        assert [(r["variant"], r["x"]) for r in staging] == [("staging", 1), ("staging", 4)]
    else:
        assert all(r["backend"] == "torch-reference" for r in batched)
        # No CUDA: the K-stream staging pool is not measured, and the run says why.
        assert not staging and "staging pool not measured" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bench, argv, expect",
    [
        ("bench_merge", ["--quick", "--reps", "2"], {("merge", "M=2"), ("merge", "M=8")}),
        ("bench_copy", ["--gib", "0.001", "--reps", "2"],
         {("copy", "host"), ("ceiling", "read"), ("ceiling", "read-tma"), ("ceiling", "copy")}),
        ("bench_predicate", ["--grid", "20", "--reps", "3"],
         {("predicate", "scalar"), ("predicate", "grid")}),
        ("bench_mla", ["--quick", "--only", "sparse", "--reps", "2"],
         {("mla_sparse", "H=16,corpus=8192")}),
        ("bench_splice", ["--quick", "--c-t", "55", "--layers", "2", "--reps", "1"],
         {("splice", v)
          for v in ("one-launch", "per-layer", "persistent", "torch", "torch-per-layer")}),
    ],
)  # fmt: skip
def test_kernel_and_predicate_benches_write_records(tmp_path, bench, argv, expect):
    if torch.cuda.is_available() and bench in ("bench_copy", "bench_merge", "bench_mla"):
        pytest.skip("the GPU tier runs these at full size (perf/gpu_check.sh)")
    out = tmp_path / "k.jsonl"
    assert importlib.import_module(f"perf.{bench}").main([*argv, "--out", str(out)]) == 0
    recs = _records(out)
    _check_common(recs, None)
    assert {(r["bench"], r["variant"]) for r in recs} == expect


def test_default_output_is_untracked_and_record_writes_the_repository(tmp_path, monkeypatch):
    """Without a flag, records go to ``perf/results/local.jsonl`` beside the repository's
    results (git-ignored); ``--record`` appends to the tracked ``perf/results/results.jsonl``."""
    from perf import bench_predicate

    repo = tmp_path / "checkout"
    tracked = repo / "perf" / "results" / "results.jsonl"
    tracked.parent.mkdir(parents=True)
    tracked.write_text('{"bench": "old"}\n')
    monkeypatch.chdir(repo / "perf")  # found from a subfolder too
    monkeypatch.delenv("MQNC_RESULTS", raising=False)
    assert bench_predicate.main(["--grid", "10", "--reps", "2"]) == 0
    local = repo / "perf" / "results" / "local.jsonl"
    assert tracked.read_text() == '{"bench": "old"}\n'
    assert [r["bench"] for r in _records(local)] == ["predicate", "predicate"]
    assert bench_predicate.main(["--grid", "10", "--reps", "2", "--record"]) == 0
    assert [r["bench"] for r in _records(tracked)] == ["old", "predicate", "predicate"]
    assert len(_records(local)) == 2
    # Outside a checkout --record is an error that says what to do.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        bench_predicate.main(["--record"])
    assert exc.value.code == 2


def test_the_repository_ignores_local_results():
    git = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True)
    if git.returncode != 0:
        pytest.skip("not a git checkout")
    for path, ignored in (
        ("perf/results/local.jsonl", True),
        ("perf/results/results.jsonl", False),
    ):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert (r.returncode == 0) == ignored, path


def test_check_makes_a_missed_target_the_exit_status(tmp_path, monkeypatch, capsys):
    """``--check``: exit 1 when a record misses its target, 0 otherwise; without it a miss is
    printed and the status stays 0. Limits of 0 us (missed by any timing) and 1e12 us (met
    by any) make the outcome independent of the machine's speed."""
    from perf import bench_predicate

    out = str(tmp_path / "p.jsonl")
    argv = ["--grid", "10", "--reps", "2", "--out", out]
    never = [Target("predicate", 0.0, "impossible", variant="scalar")]
    always = [Target("predicate", 1e12, "trivial", variant="*")]
    monkeypatch.setattr(bench_predicate, "TARGETS", never)
    assert bench_predicate.main([*argv, "--check"]) == 1
    assert "TARGETS MISSED" in capsys.readouterr().out
    assert bench_predicate.main(argv) == 0
    assert "--check makes it 1" in capsys.readouterr().out
    monkeypatch.setattr(bench_predicate, "TARGETS", always)
    assert bench_predicate.main([*argv, "--check"]) == 0
    text = capsys.readouterr().out
    assert "targets met" in text and text.count(": predicate ") == 2


def test_a_runs_new_records_are_checked_line_by_line(tmp_path):
    """``read_new`` (what ``--check`` holds to the targets) reads only the lines a run appended
    and refuses one that is not a record, naming the file and the line."""
    from mqnc.measure.results_file import read_new

    path = tmp_path / "r.jsonl"
    old = '{"bench": "old", "x": 1, "p50": 2.0}\n'
    new = '{"bench": "new", "x": 4, "p50": 5.0}\n'
    path.write_text(old + new)
    assert [r["bench"] for r in read_new(path, 1)] == ["new"]
    assert read_new(tmp_path / "none.jsonl", 0) == []
    path.write_text(old + '{"bench": "new", "x": 4, "p50": NaN}\n')
    with pytest.raises(ValueError, match=r"r.jsonl line 2: key 'p50': expected a finite number"):
        read_new(path, 1)
    path.write_text(old + "not json\n")
    with pytest.raises(ValueError, match=r"r.jsonl line 2 is not JSON"):
        read_new(path, 1)


def test_targets_select_records():
    recs = [
        dict(bench="mla_fanin", variant="H=16,ct=2048", x=8, p50=10.0, backend="triton"),
        dict(bench="mla_fanin", variant="H=16,ct=2048", x=64, p50=99.0, backend="triton"),
        dict(bench="mla_fanin", variant="H=128,ct=2048", x=8, p50=99.0, backend="triton"),
        dict(bench="mla_fanin", variant="H=16,ct=2048", x=8, p50=99.0, backend="torch"),
    ]
    t = Target("mla_fanin", 15.0, "fan-in", variant="H=16,*", x_max=16, backend="triton")
    v = check_targets(recs, [t])
    assert (v.checked, v.missed) == (1, 0)
    v = check_targets(recs[3:], [t])  # a CPU run: not measured, neither met nor missed
    assert (v.checked, v.missed) == (0, 0) and "not measured" in v.lines[0]
    v = check_targets(recs, [Target("splice", 1.0, "other bench")])
    assert v.lines == []


def test_holder_cpu_path_matches_fp64_reference():
    """The CPU stand-in for the holder's batched call equals the fp64 reference."""
    from mqnc.reference import mla_decode_reference
    from mqnc.testing import TOLERANCES, assert_close
    from perf.bench_holder import batched_partial_torch, holder_inputs, softmax_scale_of

    scale = softmax_scale_of(GEOM)
    q, pool, bt, lens = holder_inputs(3, 4, 150, GEOM, dtype=torch.float32, seed=3)
    o, lse = batched_partial_torch(q, pool, bt, lens, scale, GEOM.d_v)
    o_ref, lse_ref = mla_decode_reference(q, pool, bt, lens, scale, GEOM.d_v)
    assert_close(o, o_ref, TOLERANCES[("mla", "float32")], name="holder o")
    assert_close(lse, lse_ref, TOLERANCES[("mla_lse", "float32")], name="holder lse")
    with pytest.raises(ValueError, match="same chunk"):
        batched_partial_torch(q, pool, bt, lens + torch.tensor([0, 1, 0], dtype=torch.int32), 1.0)


def _deterministic(recs: list[dict]) -> list[dict]:
    """The records with their timings replaced by an exact affine law of the bytes moved: the
    figures then draw the benchmarks' real record format without fitting noise."""
    out = []
    for r in recs:
        t = 100.0 + (r["bytes"] or 0) / 2e3 + 10.0 * (r["x"] if r["bench"] == "congestion" else 0)
        out.append(dict(r, p20=0.9 * t, p50=t, p80=1.1 * t))
    return out


def test_figures_read_the_records(tmp_path):
    """The records draw Fig. 2(b), 4(a), 4(b) and 7 through mqnc.plots (the notebook's path)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mqnc import plots
    from perf import bench_congestion, bench_fetch, bench_holder, bench_route

    out = str(tmp_path / "all.jsonl")
    common = ["--reps", "2", "--warmup", "1", "--out", out]
    bench_route.main(["--m-q", "1,2048,4096", "--payloads", "2184", *common])
    bench_fetch.main(["--c-t", "16", "--max-holders", "2", "--topk", "32", "--m-q", "16",
                      "--pool-rows", "64", *common])  # fmt: skip
    bench_holder.main(["--n", "1,2,4", "--heads", "16", "--c-t", "64", *common])
    bench_congestion.main(["--k", "0,1", "--m-q", "1,4096", "--background-m-q", "16", *common])
    recs = _deterministic(plots.read_results(out))
    fig, axes = plt.subplots(1, 4)
    try:
        fits = plots.route_round_trip(axes[0], recs, GEOM, fit_min_rows=1)
        assert {k[1] for k in fits} == {"loopback"}
        assert next(iter(fits.values())).probe_measured
        fan = plots.gather_vs_route(axes[1], recs)
        assert {k[0] for k in fan} == {"fetch", "route_fanout"}
        assert len(plots.holder_compute(axes[2], recs)) == 1
        plots.congestion_plot(axes[3], recs, GEOM)
    finally:
        plt.close(fig)


def test_bad_transport_and_nvshmem_skip(tmp_path, capsys):
    from perf import bench_route

    with pytest.raises(SystemExit) as exc:
        bench_route.main(["--transport", "ethernet", "--out", str(tmp_path / "x.jsonl")])
    assert exc.value.code == 2 and "argument --transport" in capsys.readouterr().err
    if not torch.cuda.is_available():
        out = tmp_path / "n.jsonl"
        assert bench_route.main(["--transport", "nvshmem", "--quick", "--out", str(out)]) == 0
        assert "skipped" in capsys.readouterr().out and not out.exists()


def test_benchmarks_refuse_bad_sweep_names_and_counts_by_flag(tmp_path, capsys):
    from perf import bench_mla, bench_splice

    out = str(tmp_path / "x.jsonl")
    for main, argv, flag in (
        (bench_mla.main, ["--quick", "--only", "dnse,sparce"], "argument --only"),
        (bench_splice.main, ["--quick", "--layers", "0"], "argument --layers"),
    ):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--out", out])
        assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_benchmarks_follow_a_model_whose_partial_row_is_wider_than_its_query_row(tmp_path):
    """DeepSeek-V4-Flash: q 1024 B, p 1032 B per row. The slots hold the partials coming back,
    and the holders of bench_host get the model the requester's queries are shaped for."""
    from perf import bench_congestion, bench_fetch, bench_host

    g = get_preset("deepseek-v4-flash")
    assert g.p_row_bytes > g.q_row_bytes
    out = str(tmp_path / "v4.jsonl")
    common = ["--model", "deepseek-v4-flash", "--reps", "2", "--warmup", "0", "--out", out]
    assert bench_congestion.main(["--k", "0", "--m-q", "256", "--background-m-q", "256",
                                  *common]) == 0  # fmt: skip
    assert bench_fetch.main(["--quick", "--c-t", "16", "--max-holders", "1", "--topk", "8",
                             "--m-q", "256", "--pool-rows", "64", *common]) == 0  # fmt: skip
    assert bench_host.main(["--quick", "--transport", "loopback", *common]) == 0
    recs = _records(tmp_path / "v4.jsonl")
    assert {r["bench"] for r in recs} >= {"congestion", "fetch", "host"}


def test_goal_targets_match_the_goal_shapes(tmp_path, capsys):
    """perf/speed_targets.py bounds every goal shape with a number in its goal, by the label the
    --goals sweeps record; a CPU run of them is reported as not measured."""
    import re

    from mqnc.triton_kernels.sm90.variants import GOALS
    from perf import bench_merge
    from perf.speed_targets import ROOFLINE_TARGETS, TARGETS

    limit = re.compile(r"<= ([\d.]+) us")
    numeric = {s.label: float(limit.search(s.goal)[1]) for s in GOALS if limit.search(s.goal)}
    own = [t for t in TARGETS if "shape" in t.extra and t not in ROOFLINE_TARGETS]
    assert {t.extra["shape"]: t.limit for t in own} == numeric
    # the roofline goals bound goal shapes too, each at most the shape's own goal
    for t in ROOFLINE_TARGETS:
        if "shape" in t.extra:
            assert t.extra["shape"] in {s.label for s in GOALS}, t
            assert t.limit <= numeric.get(t.extra["shape"], float("inf")), t
    if torch.cuda.is_available():
        return
    out = tmp_path / "g.jsonl"
    assert bench_merge.main(["--goals", "--reps", "2", "--check", "--out", str(out)]) == 0
    assert {r["extra"]["shape"] for r in _records(out)} == {
        s.label for s in GOALS if s.op == "merge"
    }
    assert "goal: 8-way merge of 256 rows <= 8 us: not measured" in capsys.readouterr().out


@pytest.mark.parametrize("transport", ["loopback", "gloo"])
def test_ready_holder_answers_routes_and_probes(transport):
    """``bench_host``'s floor of any holder (:class:`mqnc.measure.holders.ReadyHolder`): a
    checked reply to every probe and route, one per shape packed once and restamped under each
    request's ids (the requester checks ids, shape and dtype): ``o = 0``, ``lse = 0`` exactly,
    over the in-process engine and a holder process on gloo (``--ready``)."""
    from mqnc.measure.holders import HolderFabric
    from mqnc.serving.client import RemoteError

    g = get_preset("deepseek-v2-lite")
    with HolderFabric(transport, max_rows=16, ready=True, model=g, lanes=1) as fab:
        req = fab.requester
        assert req.probe(1) > 0
        for B, H in ((1, 1), (2, 3), (1, 1), (2, 3)):
            q = torch.randn(B, H, g.d_qk).to(torch.bfloat16)
            part = req.route(1, q, 0)
            assert part.o.shape == (B, H, g.d_v) and part.o.dtype == torch.bfloat16
            assert bool((part.o == 0).all()) and bool((part.lse == 0).all())
        assert [r.ok for r in req.costs] == [True] * 5
        with pytest.raises(RemoteError, match="answers probes and routes only, got kind 5"):
            req.fetch(1)  # answered with an ERROR; the holder keeps serving
        assert req.probe(1) > 0
        if transport == "loopback":
            assert fab._holders[0].served == 7 and fab._holders[0].failure is None


@pytest.mark.parametrize("words", [8192 * 3, 8192 * 2 + 256 * 5 + 100, 37])
def test_ceiling_kernels_read_and_copy_exactly(words):
    """perf/bench_copy.py's ceiling kernels in the interpreter: the read kernels' sums of int32
    words (wrapping, mod 2**32: exact in any order) equal torch's (the TMA kernel over whole
    1 KiB rows, a partial last box among them), and the copy is bit for bit, whole blocks and a
    ragged tail alike, on a grid that strides (fewer programs than blocks) and one with idle
    programs (more); the copy's destination starts poisoned."""
    from perf.bench_copy import TMA_COLS, copy_launch, read_launch, read_sum, read_tma_launch

    gen = torch.Generator().manual_seed(words)
    src = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, generator=gen)
    want = int(src.to(torch.int64).sum()) % 2**32
    whole = src[: words // TMA_COLS * TMA_COLS]  # (the TMA kernel reads whole 1 KiB rows)
    for grid in (2, 5):
        partial = torch.full((grid,), 7, dtype=torch.int32)
        read_launch(src, partial)()
        assert read_sum(partial) == want
        if whole.numel():
            read_tma_launch(whole, partial)()
            assert read_sum(partial) == int(whole.to(torch.int64).sum()) % 2**32
        dst = torch.full_like(src, -1)
        copy_launch(src, dst, grid)()
        assert torch.equal(dst, src)


def test_ceiling_records_give_percent_of_the_read_ceiling_and_the_spec():
    """mqnc.cost.ceilings: the read ceiling is the larger median of the device's exact Triton
    read records per read kernel (plain 4.2 over TMA 4.0 here; other devices, other benches and
    inexact runs ignored), the spec is the vendor's (4.8 TB/s for an H200), and a device with
    neither refuses to give a ceiling."""
    from mqnc.cost.ceilings import memory_ceiling, spec_tbps

    def rec(bench, variant, gbps, device="NVIDIA H200", backend="triton", exact=True):
        return dict(bench=bench, variant=variant, gbps=gbps, device=device, backend=backend,
                    extra={"exact": exact})  # fmt: skip

    recs = [
        rec("ceiling", "read", 4000.0),
        rec("ceiling", "read", 4200.0),
        rec("ceiling", "read", 4400.0),
        rec("ceiling", "read", 9000.0, exact=False),
        rec("ceiling", "read-tma", 3900.0),
        rec("ceiling", "read-tma", 4100.0),
        rec("ceiling", "read", 1.0, device="NVIDIA H100 80GB HBM3"),
        rec("ceiling", "copy", 3600.0),
        rec("copy", "d2d", 2711.0, backend="torch"),
    ]
    c = memory_ceiling(recs, "NVIDIA H200")
    assert (c.read_tbps, c.copy_tbps, c.torch_copy_tbps, c.spec_tbps) == (4.2, 3.6, 2.711, 4.8)
    assert c.tbps == 4.2 and c.records == 3 and "measured read ceiling" in c.source
    pct = c.percents(3.6)
    assert pct["pct_of_read"] == pytest.approx(100 * 3.6 / 4.2, rel=1e-15)
    assert pct["pct_of_spec"] == pytest.approx(75.0, rel=1e-15)
    h100 = memory_ceiling(recs, "NVIDIA H100 80GB HBM3")
    assert h100.read_tbps == 0.001 and h100.spec_tbps == spec_tbps("NVIDIA H100") == 3.35
    spec_only = memory_ceiling([], "NVIDIA H200")
    assert spec_only.tbps == 4.8 and spec_only.source.startswith("HBM spec")
    with pytest.raises(ValueError, match="device"):
        _ = memory_ceiling(recs, "CPU: AMD EPYC (2 cores)").tbps


def test_records_with_bytes_carry_their_bandwidth_against_the_read_ceiling_and_spec(tmp_path):
    """``record`` adds to a record with a byte count its TB/s, the device's read ceiling (the
    median of the exact Triton read records already in the same file) and the spec, and both
    percentages; a benchmark's own values win; no ceiling measured: None, not a guess."""
    from mqnc.base.runtime import device_name
    from mqnc.cost.ceilings import spec_tbps
    from mqnc.measure import record

    out = tmp_path / "r.jsonl"
    first = record("mla_decode", "H=16,B=1", 2048, (2.0, 2.0, 2.0), nbytes=4_000_000, path=out)
    assert first["extra"]["read_tbps"] is None and first["extra"]["pct_of_read"] is None
    assert first["extra"]["tbps"] == pytest.approx(2.0, rel=1e-12)
    for gbps in (3000.0, 4000.0, 5000.0):
        with open(out, "a") as f:
            rec = dict(bench="ceiling", variant="read", device=device_name(), backend="triton",
                       gbps=gbps, extra={"exact": True})  # fmt: skip
            f.write(json.dumps(rec) + "\n")
    r = record("mla_decode", "H=16,B=1", 2048, (1.0, 1.0, 1.0), nbytes=3_000_000, path=out)
    e = r["extra"]
    assert e["tbps"] == pytest.approx(3.0, rel=1e-12) and e["read_tbps"] == 4.0
    assert e["pct_of_read"] == 75.0
    assert e["spec_tbps"] == spec_tbps(device_name())
    own = record("x", "v", 1, (1.0, 1.0, 1.0), nbytes=10, path=out, extra={"pct_of_read": 1})
    assert own["extra"]["pct_of_read"] == 1


def test_bandwidth_goals_are_p50_bounds_of_their_bytes():
    """The 3.6 TB/s dense goal as p50 bounds: B 16, c_t 32768 (604 MB of cache) in <= 167.9 us,
    each bound the goal shape's bytes (as bench_mla counts them) at 3.6e6 bytes per us."""
    from perf.speed_targets import ROOFLINE_TARGETS, at_tbps, dense_bytes

    b = 16 * 32768 * 576 * 2 + 16 * 16 * 576 * 2 + 16 * 16 * (512 * 2 + 4)
    assert dense_bytes(16, 16, 32768) == b
    (t,) = [t for t in ROOFLINE_TARGETS if t.extra.get("shape") == "mla_decode H=16 B=16 ct=32768"]
    assert t.limit == at_tbps(b, 3.6) == pytest.approx(b / 3.6e6, rel=1e-15)
    shapes = {t.extra.get("shape") for t in ROOFLINE_TARGETS if "3.6 TB/s" in t.what}
    assert len(shapes) == 9  # eight dense shapes and the splice
