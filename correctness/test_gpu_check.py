"""The one-call GPU check runs right the first time (GPU time is scarce): ``bash perf/gpu_check.sh
--dry-run`` runs every step's real command on this CPU machine, with the interpreter and tiny
sizes (the same argument parsing, imports, ``-m`` module paths, record writing and budget
arithmetic as on the GPU), and every step must pass; a GPU run then differs only in sizes and
the compiled path. Also: the budget check refuses caps that do not fit, records carry the
commit without ``.git``, and the GPU tier names collected tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GPU_TIER

from mqnc.measure import results_file as results

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "perf" / "gpu_check.sh"
KERNEL_BENCHES = {"copy", "merge", "mla_decode", "mla_sparse", "splice", "holder"}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MQNC_RESULTS")}
    return {**env, "PY": sys.executable, **extra}


def _script_dry_run(script: Path, out: Path, timeout: float, **env) -> subprocess.CompletedProcess:
    """``bash script --dry-run`` from the root, its records to ``out`` with the commit
    ``dryrun0commit``, bounded by ``timeout`` s."""
    return subprocess.run(
        ["bash", str(script), "--dry-run"],
        cwd=ROOT,
        env=_env(OUT=str(out), MQNC_COMMIT="dryrun0commit", **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _steps() -> list[str]:
    text = SCRIPT.read_text()
    body = re.search(r"^STEPS=\(([^)]*)\)", text, re.M).group(1)
    return body.split()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu_check")
    r = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        cwd=ROOT,
        env=_env(OUT=str(out), MQNC_COMMIT="dryrun0commit", SITE=str(out / "site")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return out


def _log(out: Path, step: str) -> str:
    return subprocess.run(
        ["tar", "xzf", str(out / "logs.tgz"), "-O", f"logs/{step}.log"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_dry_run_runs_every_step(dry_run):
    summary = (dry_run / "summary.txt").read_text().splitlines()
    assert re.match(r"budget: \d+ steps, caps \d+ s \+ reserve 20 s <= 450 s", summary[0])
    ran = {line.split()[0]: line for line in summary[1:] if line.strip()}
    assert list(ran) == _steps()
    for line in ran.values():
        assert line.rstrip().endswith(" ok"), line


def test_dry_run_records_say_how_they_were_timed_and_the_commit(dry_run):
    recs = [json.loads(x) for x in (dry_run / "results.jsonl").read_text().splitlines()]
    benches = {r["bench"] for r in recs}
    assert KERNEL_BENCHES | {"probe", "route", "fetch"} <= benches, benches
    assert {r["commit"] for r in recs} == {"dryrun0commit"}
    for r in recs:
        if r["bench"] in KERNEL_BENCHES:
            assert r["extra"]["timing"]["method"] == "host-clock", r  # cuda-graph on a GPU
            assert 0 < r["p20"] <= r["p50"] <= r["p80"]
    # the kernels themselves ran (interpreted), not a torch stand-in
    kernels = {r["bench"] for r in recs if r["backend"] == "interpreter"}
    assert {"merge", "mla_decode", "mla_sparse", "splice", "holder"} <= kernels
    nvshmem = [r for r in recs if r["variant"].endswith("-1gpu-2pe")]
    assert nvshmem and all("wait_path" in r["extra"] for r in nvshmem)


def test_dry_run_report_and_tier(dry_run):
    report = (dry_run / "kernel_report.txt").read_text()
    assert "| merge M=8 rows=256 | <= 8 us |" in report
    assert "| mla_decode H=16 B=1 ct=2048 | holder partial <= 15 us |" in report  # every op
    collected = [ln for ln in _log(dry_run, "tests").splitlines() if "::" in ln]
    for entry in GPU_TIER:
        assert any(ln.split("correctness/", 1)[-1].startswith(entry) for ln in collected), entry
    assert collected[0].split("correctness/", 1)[-1].startswith(GPU_TIER[0])  # kernels first
    assert "0 failed" in _log(dry_run, "warmup")


def test_dry_run_leaves_what_the_device_tool_brings_back(dry_run):
    """At most 8 files in $OUT (the device tool returns no more), env.json valid JSON (stderr
    kept in env.log), the NVSHMEM summary packed in logs.tgz."""
    files = [
        p for p in dry_run.rglob("*") if p.is_file() and "site" not in p.relative_to(dry_run).parts
    ]
    assert len(files) <= 8, sorted(str(p.relative_to(dry_run)) for p in files)
    env = json.loads((dry_run / "env.json").read_text())
    assert "torch" in json.dumps(env)
    summary = json.loads(_log_file(dry_run, "logs/nvshmem_check.json"))
    assert summary["transport"] == "gloo" and summary["paths"]


def _log_file(out: Path, member: str) -> str:
    return subprocess.run(
        ["tar", "xzf", str(out / "logs.tgz"), "-O", member],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_caps_over_the_budget_are_refused_before_anything_runs(tmp_path):
    r = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        cwd=ROOT,
        env=_env(OUT=str(tmp_path), BUDGET="100"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 3 and "caps sum to" in r.stderr
    assert not (tmp_path / "results.jsonl").exists()


def test_only_runs_the_named_steps(tmp_path):
    """``ONLY=`` (a second call that measures one change): an unknown step name is refused
    before anything runs; the named steps run and every other one is logged as skipped."""

    def dry(only: str, out: Path):
        return subprocess.run(
            ["bash", str(SCRIPT), "--dry-run"],
            cwd=ROOT,
            env=_env(OUT=str(out), ONLY=only, MQNC_COMMIT="dryrun0commit", SITE=str(out / "s")),
            capture_output=True,
            text=True,
            timeout=300,
        )

    r = dry("env,bench_nope", tmp_path / "bad")
    assert r.returncode == 3 and "ONLY: expected step names out of install" in r.stderr
    assert "got 'bench_nope'" in r.stderr and not (tmp_path / "bad" / "env.json").exists()
    r = dry(" ,\t", tmp_path / "none")
    assert r.returncode == 3 and r.stderr.rstrip().endswith("got none"), r.stderr
    r = dry(" env,\n", tmp_path / "ok")  # commas, spaces, tabs and newlines separate names
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = (tmp_path / "ok" / "summary.txt").read_text().splitlines()[1:]
    steps = {line.split()[0]: line for line in lines if line.strip()}
    assert "ok" in steps.pop("env") and "torch" in (tmp_path / "ok" / "env.json").read_text()
    assert steps and all("skipped (not in ONLY)" in line for line in steps.values()), steps


def test_a_stale_commit_file_is_refused_before_anything_runs(tmp_path):
    """The records' commit comes from ``.mqnc-commit`` before git (the device copy's ``.git`` is
    what has landed, older than the tree it runs); the dry run, where git is right, refuses a
    file that is not HEAD's commit, and lets HEAD's own through (here to the budget check)."""
    repo = tmp_path / "repo"
    (repo / "perf").mkdir(parents=True)
    for script in (SCRIPT, SCRIPT.parent / "gpu_common.sh"):  # the script and its prelude
        (repo / "perf" / script.name).write_text(script.read_text())
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    for cmd in (["init", "-q"], ["add", "perf"], ["commit", "-qm", "x"]):
        subprocess.run([*git, *cmd], check=True, capture_output=True)
    head = subprocess.run(
        [*git, "rev-parse", "--short=12", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    env = _env(OUT=str(tmp_path / "out"), BUDGET="100")
    env.pop("MQNC_COMMIT", None)

    def dry(commit_file: str):
        (repo / ".mqnc-commit").write_text(commit_file)
        return subprocess.run(
            ["bash", "perf/gpu_check.sh", "--dry-run"],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = dry("c1acbb2dab5e\n")
    assert r.returncode == 3
    assert f".mqnc-commit: expected HEAD's commit {head}, got c1acbb2dab5e" in r.stderr
    r = dry(head + "\n")
    assert r.returncode == 3 and "caps sum to" in r.stderr and ".mqnc-commit" not in r.stderr


def test_nvshmem_check_names_its_poll_rounds(capsys):
    """``gpu_check_nvshmem --poll-spins 4096,64``: each put path at each bound of the device-side
    poll, the records told apart by variant (the default bound keeps the first run's name)."""
    from perf.gpu_check_nvshmem import DEFAULT_SPINS, _variant, main

    assert DEFAULT_SPINS == 4096
    assert _variant("nvshmem", "host", 4096) == "nvshmem-host-1gpu-2pe"
    assert _variant("nvshmem", "device", 64) == "nvshmem-device-1gpu-2pe-spins64"
    assert _variant("gloo", "host", 64) == "gloo-host-1gpu-2pe"  # gloo has no device polls
    for bad in ("0", "64,-1", "x", ","):
        with pytest.raises(SystemExit) as exc:
            main(["--transport", "gloo", "--poll-spins", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --poll-spins: expected comma-separated ints >= 1, got {bad!r}" in err


def test_commit_without_git(monkeypatch):
    """``MQNC_COMMIT`` first (the GPU copy may have no ``.git``), then git, then "unknown"."""
    monkeypatch.setenv("MQNC_COMMIT", "abc123")
    assert results.git_commit() == "abc123"
    monkeypatch.delenv("MQNC_COMMIT")

    def no_git(*args, **kwargs):
        raise OSError("git: not found")

    monkeypatch.setattr(results.subprocess, "run", no_git)
    assert results.git_commit() == "unknown"


TILES_SCRIPT = ROOT / "perf" / "gpu_tiles.sh"


@pytest.fixture(scope="module")
def tiles_dry_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("gpu_tiles")
    r = _script_dry_run(TILES_SCRIPT, out, timeout=900)
    print(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return out, r.stdout


def test_tile_sweep_dry_run_times_every_candidate_against_default_and_fp64(tiles_dry_run):
    """``perf/gpu_tiles.sh --dry-run``: every candidate (``SWEEP_TILES``) at each dense shape
    (a goal shape and one added by ``--dense-shapes``, FlashMLA's on the GPU) and the sparse one,
    each record with its tile, its check against the default tile and against fp64, and its
    TFLOP/s from FLOPs per query row 2 H c_t (576 + 512); the budget line is printed."""
    from mqnc.triton_kernels.mla.plan import SWEEP_TILES

    out, stdout = tiles_dry_run
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert re.search(r"sweep took \d+s of 480s", stdout), stdout[-2000:]
    for bench, kind, shapes in (
        ("mla_decode", "dense", {"mla_decode H=16 B=1 ct=128", "mla_decode H=40 B=1 ct=100"}),
        ("mla_sparse", "sparse", {"mla_sparse H=16 B=1 topk=128"}),
    ):
        mine = [r for r in recs if r["bench"] == bench]
        want = {(s, t.label) for s in shapes for t in SWEEP_TILES[kind]}
        assert {(r["extra"]["shape"], r["extra"]["tile"]) for r in mine} == want
        for r in mine:
            e = r["extra"]
            assert e["ok"] and e["vs_default"]["ok"] and e["vs_fp64"]["ok"], e
            assert r["commit"] == "dryrun0commit"
            words = dict(w.split("=") for w in e["shape"].split()[1:])
            n = int(words.get("ct") or words["topk"])
            assert e["flops"] == 2 * e["B"] * e["H"] * n * (576 + 512)
            assert e["tflops"] == pytest.approx(e["flops"] / (r["p50"] * 1e6))
    assert sum(r["bench"] == "copy" for r in recs) == 2


def test_tile_check_against_fp64_fails_a_wrong_kernel(monkeypatch):
    """The sweep's fp64 check (``perf.bench_mla._vs_fp64``) marks a tile whose output is off
    ``ok: false`` with the error, instead of passing it."""
    import torch

    import perf.bench_mla as bench

    gen = torch.Generator().manual_seed(0)
    good = bench._vs_fp64("mla_decode", 16, "cpu", torch.float32, gen)
    assert good["ok"] and good["o_max_abs"] < 1e-4, good
    real = bench._dense_fn

    def off(*args):
        call = real(*args)
        return lambda: (lambda o, lse: (o * 1.01, lse))(*call())

    monkeypatch.setattr(bench, "_dense_fn", off)
    bad = bench._vs_fp64("mla_decode", 16, "cpu", torch.float32, gen)
    assert not bad["ok"] and "o" in bad["error"], bad


def test_dense_shapes_are_refused_unless_well_formed():
    r = subprocess.run(
        [sys.executable, "-m", "perf.bench_mla", "--tiny", "--dense-shapes", "H=128 B=0 ct=64"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "expected 'H=<heads> B=<tokens> ct=<entries>'" in r.stderr


GLUON_SCRIPT = ROOT / "perf" / "gpu_gluon.sh"


def _gluon_dry_run(out: Path, **env) -> subprocess.CompletedProcess:
    return _script_dry_run(GLUON_SCRIPT, out, timeout=600, **env)


def test_gluon_check_dry_run_records_each_kernel_against_tl_and_fp64(tmp_path):
    """``perf/gpu_gluon.sh --dry-run`` (the Gluon kernel stood in by the default path: no
    interpreter runs Gluon): the fp64 step on a NaN-padded partial page and a length-1 row, then
    one record per kernel (the default path "tl" first, then "gluon", "gluon128", "seesaw")
    with the commit, its check against the default path and fp64, and TFLOP/s from FLOPs per
    query row 2 H c_t (576 + 512)."""
    r = _gluon_dry_run(tmp_path)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "gluon vs fp64 H=16 lens=1,70: o max_abs=" in r.stdout
    assert re.search(r"gluon check took \d+s of 240s", r.stdout), r.stdout[-1000:]
    recs = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [rec["extra"]["kernel"] for rec in recs] == ["tl", "gluon", "gluon128", "seesaw"]
    for rec in recs:
        e = rec["extra"]
        assert rec["bench"] == "mla_decode_gluon" and rec["commit"] == "dryrun0commit"
        assert rec["device"] and rec["p20"] <= rec["p50"] <= rec["p80"]
        assert e["ok"] and e["vs_tl"]["ok"] and e["vs_fp64"]["ok"], e
        assert e["flops"] == 2 * e["B"] * e["H"] * rec["x"] * (576 + 512)
        assert e["tflops"] == pytest.approx(e["flops"] / (rec["p50"] * 1e6))
        assert e.get("standin") == (None if e["kernel"] == "tl" else "tl")


def test_gluon_check_fails_a_wrong_kernel(tmp_path):
    """The Gluon check's comparisons catch an output 1% off (the dry run's stand-in scaled by
    ``$GLUON_DRY_OFF``): fp64 and the default path both MISMATCH and the run fails."""
    r = _gluon_dry_run(tmp_path, GLUON_DRY_OFF="1.01")
    assert r.returncode != 0, r.stdout[-2000:]
    assert "MISMATCH gluon vs fp64" in r.stdout and "MISMATCHED" in r.stdout, r.stdout[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [rec["extra"]["ok"] for rec in recs] == [True, False, False, False]


FASTPATH_SCRIPT = ROOT / "perf" / "gpu_fastpath.sh"


@pytest.fixture(scope="module")
def fastpath_dry_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``bash perf/gpu_fastpath.sh --dry-run`` (long tier: ~9-15 s of a loaded 2-core
    machine; its cases and benches are tested one by one elsewhere)."""
    out = tmp_path_factory.mktemp("fastpath")
    return out, _script_dry_run(FASTPATH_SCRIPT, out, timeout=600)


@pytest.fixture(scope="module")
def fastpath_dry_run_off(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The same with its outputs scaled 1% off (``$FASTPATH_DRY_OFF``), long tier."""
    out = tmp_path_factory.mktemp("fastpath_off")
    return out, _script_dry_run(FASTPATH_SCRIPT, out, timeout=600, FASTPATH_DRY_OFF="1.01")


def test_fastpath_dry_run_records_every_part(fastpath_dry_run):
    """``perf/gpu_fastpath.sh --dry-run``: the warm-up, then every exactness case through the
    public default path against fp64 (each naming its backend: the interpreter's ``tl``), the
    goal shapes timed (FLOPs ``2 B H c_t (576 + 512)``, bytes, the fp64 check of the first
    set) and the user's loop per call (host and CPU microseconds), each record with the
    commit; the FP8 calls (dense, ``s_q`` 2 causal, sparse) among the exact cases; the fast-path
    targets printed (not measured off a GPU)."""
    tmp_path, r = fastpath_dry_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert re.search(r"fast-path check took \d+s of 420s", r.stdout), r.stdout[-1000:]
    assert "warm: 1 cases, 0 failed" in r.stdout and "not measured in this run" in r.stdout
    recs = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    by = {b: [x for x in recs if x["bench"] == b] for b in ("fastpath_exact", "fastpath",
                                                            "host_loop")}  # fmt: skip
    assert len(by["fastpath_exact"]) == 17 and len(by["fastpath"]) == 2
    kinds = [x["extra"]["spec"]["kind"] for x in by["fastpath_exact"]]
    assert kinds.count("fp8_dense") == 2 and kinds.count("fp8_sparse") == 2, kinds
    assert len(by["host_loop"]) == 5
    for rec in recs:
        e = rec["extra"]
        assert rec["commit"] == "dryrun0commit" and e["backend"] == "tl" and e["triton"]
        assert e.get("ok", True), rec
    for rec in by["fastpath"]:
        e = rec["extra"]
        assert e["flops"] == 2 * e["B"] * e["H"] * rec["x"] * (576 + 512)
        assert e["vs_fp64"]["ok"] and e["tflops"] == pytest.approx(e["flops"] / (rec["p50"] * 1e6))
    for rec in by["host_loop"]:
        assert rec["p20"] <= rec["p50"] <= rec["p80"] and len(rec["extra"]["cpu_us"]) == 3
    kinds = {rec["extra"]["spec"]["kind"] for rec in by["fastpath_exact"]}
    assert kinds == {
        "partial", "flashmla", "csr", "plan", "out", "flashinfer", "sparse", "fp8_dense",
        "fp8_sparse",
    }  # fmt: skip


def test_fastpath_check_fails_a_wrong_answer(fastpath_dry_run_off):
    """The fast path's fp64 comparisons catch an output 1% off (the dry run's outputs scaled by
    ``$FASTPATH_DRY_OFF``): every exactness case MISMATCHes and the run fails."""
    tmp_path, r = fastpath_dry_run_off
    assert r.returncode != 0, r.stdout[-2000:]
    assert "MISMATCH partial" in r.stdout and "MISMATCHED" in r.stdout, r.stdout[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert not any(x["extra"]["ok"] for x in recs if x["bench"] == "fastpath_exact")


def test_gluon_decode_checks_its_arguments_then_refuses_a_cpu():
    """``mla.gluon`` names a bad argument (ValueError / TypeError) and, given good ones on
    a CPU, raises RuntimeError saying Gluon needs a CUDA sm_90 device (Gluon never runs in the
    interpreter); ``import mqnc`` did not import Gluon for it."""
    import torch

    from mqnc.triton_kernels.mla.gluon import mla_decode_gluon

    q = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16)
    table = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([1, 100], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="sm_90|interpreter"):
        mla_decode_gluon(q, kv, table, lens, softmax_scale=0.1)
    bad = [
        (dict(q=q.float()), TypeError, "q: invalid dtype"),
        (dict(q=q[..., :512]), ValueError, "q: expected"),
        (dict(kv_cache=kv[:, :32]), ValueError, "kv_cache: expected pages of 64"),
        (dict(kv_cache=torch.zeros(4, 64, 1, 1152, dtype=q.dtype)[..., ::2]), ValueError, "rows"),
        (dict(block_table=table.long()), TypeError, "block_table"),
        (dict(cache_seqlens=lens[:1]), ValueError, "cache_seqlens"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
        (dict(block_n=32), ValueError, "block_n"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(schedule="pingpong"), ValueError, "schedule"),
        (dict(schedule="seesaw", block_n=128), ValueError, "block_n: the see-saw"),
    ]
    good = dict(q=q, kv_cache=kv, block_table=table, cache_seqlens=lens, softmax_scale=0.1)
    for change, exc, text in bad:
        with pytest.raises(exc, match=text):
            mla_decode_gluon(**{**good, **change})


def test_tile_sweep_dry_run_times_the_16_head_candidates(tiles_dry_run):
    """The 16-head section of ``perf/gpu_tiles.sh --dry-run``: every ``SWEEP_TILES["dense16"]``
    candidate (the two-CTA-per-SM tiles, the fused combine) at the 16-head shape, each record in
    ``results_h16.jsonl`` with its tile, checked against the default tile and fp64, with its
    GB/s and TFLOP/s; the run counts that file's records."""
    from mqnc.triton_kernels.mla.plan import SWEEP_TILES

    out, stdout = tiles_dry_run
    recs = [json.loads(x) for x in (out / "results_h16.jsonl").read_text().splitlines()]
    want = {("mla_decode H=16 B=1 ct=128", t.label) for t in SWEEP_TILES["dense16"]}
    assert {(r["extra"]["shape"], r["extra"]["tile"]) for r in recs} == want
    for r in recs:
        e = r["extra"]
        assert r["bench"] == "mla_decode" and r["commit"] == "dryrun0commit"
        assert e["ok"] and e["vs_default"]["ok"] and e["vs_fp64"]["ok"], e
        assert r["gbps"] > 0 and e["tflops"] == pytest.approx(e["flops"] / (r["p50"] * 1e6))
    assert f"{len(recs)} records at 16 heads" in stdout


ROUTE_SCRIPT = ROOT / "perf" / "gpu_route.sh"


@pytest.fixture(scope="module")
def route_dry_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``bash perf/gpu_route.sh --dry-run`` (long tier: ~7-12 s of a loaded 2-core machine,
    the bench's every step interpreted; its pieces are tested one by one in
    test_device_route.py)."""
    out = tmp_path_factory.mktemp("gpu_route")
    return out, _script_dry_run(ROUTE_SCRIPT, out, timeout=900)


def test_dry_run_of_the_device_route_records_probe_and_route_with_host_calls(route_dry_run):
    """``perf/gpu_route.sh --dry-run``: the device route's bench runs its real commands
    interpreted and tiny (its warm-up in-process) and records the probe, the route (16 heads
    with 1 and 2 requesters at c_t 128, 1 requester at c_t 256, 128 heads), the holder's
    compute beside the default kernel's and the fetch of both chunks (its pull and splice
    alone beside it), each with the commit, transport ``device-local``, the fp64 check and
    ``extra.host_calls_per_layer`` counted (every launch a host call in the dry run, which has
    no graph: ``host_free`` false there); the budget line is printed."""
    out, r = route_dry_run
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert re.search(r"route run took \d+s of 300s", r.stdout), r.stdout[-2000:]
    assert "warm: 1 specs, 0 failed" in (out / "logs" / "bench.log").read_text()
    recs = [json.loads(x) for x in (out / "results_route.jsonl").read_text().splitlines()]
    got = [(r["bench"], r["x"], r["extra"]["heads"], r["extra"].get("requesters"),
            r["extra"]["c_t"]) for r in recs]  # fmt: skip
    assert got == [("probe", 1, 16, None, 128), ("route", 16, 16, 1, 128),
                   ("holder_attend", 16, 16, None, 128), ("default_attend", 16, 16, None, 128),
                   ("route", 16, 16, 2, 128), ("fetch", 128, 16, None, 128),
                   ("route", 16, 16, 1, 256), ("fetch", 256, 16, None, 256),
                   ("route", 128, 128, 1, 128)]  # fmt: skip
    for rec in recs:
        e = rec["extra"]
        assert rec["commit"] == "dryrun0commit" and rec["transport"] == "device-local"
        assert e["host_free"] is False and e["host_calls_per_layer"] >= 1, e
        if rec["bench"] == "route":  # put, the pass (take, gather, attend, reply), wait, merge
            assert e["host_calls_per_layer"] >= 2 and e["vs_fp64"] >= 0.0, e
        if rec["bench"] == "fetch":
            assert e["pull_us"] > 0 and e["splice_us"] > 0 and e["vs_fp64"] >= 0.0, e


@pytest.fixture(scope="module")
def suite_dry_run(tmp_path_factory) -> Path:
    """``SHARD=2/3 bash perf/gpu_suite.sh --dry-run``: the tests the GPU run would run."""
    out = tmp_path_factory.mktemp("suite")
    r = _script_dry_run(ROOT / "perf" / "gpu_suite.sh", out, 600, SHARD="2/3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_the_gpu_suite_dry_run_lists_every_test_and_shards_every_file(suite_dry_run):
    """The whole suite (less the long tier) is what a GPU runs compiled: every test file is in
    exactly one shard, and the listed tests include the device route's and the merge's (files a
    GPU once failed for CPU tensors in the tests), not a hand-kept subset."""
    tests = (suite_dry_run / "suite_tests.txt").read_text().split()
    files = sorted(p.name for p in (ROOT / "correctness").glob("test_*.py"))
    shards = [ln.split() for ln in (suite_dry_run / "suite_shards.txt").read_text().splitlines()]
    assert sorted(f for _, f in shards) == files and {k for k, _ in shards} == {"1", "2", "3"}
    listed = {t.split("::")[0].split("/")[-1] for t in tests}
    assert {"test_device_route.py", "test_merge.py", "test_mla_decode.py"} <= listed
    assert len(tests) > 1000 and len(tests) > 10 * len(GPU_TIER)
    assert "shard 2/3" in (suite_dry_run / "summary.txt").read_text()
