"""The FP8 cache in the benchmarks and their goals: record fields, never speed.

The FP8 goals (``perf/speed_targets.py``, ``FP8_TARGETS``) compare an FP8 record with its bf16
twin; their logic is checked here on synthetic records (no timing). ``perf.bench_mla
--kv-dtype`` is checked for what readers rely on: the cache format, the bytes at 656 B per
FP8 entry, the cache tokens per second, and the CPU stand-in's output against fp64 over the
dequantized cache.
"""

from __future__ import annotations

import json

import pytest
import torch

from mqnc.measure.targets import Speedup, Target, check_targets, kv_dtype

DEVICE = "NVIDIA H200"


def _rec(bench, variant, x, p50, kv=None, backend="triton", device=DEVICE, **extra):
    e = dict(extra)
    if kv is not None:
        e["kv_dtype"] = kv
    return dict(bench=bench, variant=variant, x=x, p50=p50, backend=backend, device=device, extra=e)


def _dense(B, ct, p50, kv=None, H=16, **kw):
    suffix = ",fp8" if kv == "fp8" else ""
    return _rec("mla_decode", f"H={H},B={B}{suffix}", ct, p50, kv, H=H, B=B, page=64, **kw)


def test_fp8_goals_compare_each_record_with_its_bf16_twin():
    """Dense (H 16, B >= 16, c_t >= 32768): met at 1.6x and above, missed below; a record
    without a twin (another B, device or backend) is not measured and counts neither way;
    records outside the goal's shapes are not held to it; the last twin wins."""
    from perf.speed_targets import FP8_TARGETS

    dense = FP8_TARGETS[0]
    recs = [
        _dense(16, 32768, 240.0, "bf16"),
        _dense(16, 32768, 150.0, "fp8"),  # 1.6x: met
        _dense(32, 65536, 900.0),  # a record without kv_dtype is bf16
        _dense(32, 65536, 600.0, "fp8"),  # 1.5x: missed
        _dense(64, 32768, 500.0, "fp8"),  # no twin
        _dense(8, 32768, 999.0, "fp8"),  # B < 16: not this goal's
        _dense(16, 8192, 999.0, "fp8"),  # c_t < 32768: not this goal's
        _dense(16, 32768, 1.0, "fp8", H=128),  # H 128: not this goal's
    ]
    v = check_targets(recs, [dense])
    assert (v.checked, v.missed) == (2, 1), v.lines
    assert len(v.lines) == 3
    assert v.lines[0].endswith("1.6x (at least 1.6x) met"), v.lines[0]
    assert v.lines[1].endswith("1.5x (at least 1.6x) MISSED"), v.lines[1]
    assert "x=65536 fp8 p50 600 us, bf16 900 us" in v.lines[1]
    assert "not measured (no bf16 twin in this run)" in v.lines[2]
    # the last twin of several is the one compared; another device's or backend's is none
    later = [*recs[:2], _dense(16, 32768, 300.0, "bf16")]
    assert check_targets(later, [dense]).lines[0].endswith("2x (at least 1.6x) met")
    wrong = _dense(16, 32768, 1.0, "fp8", ok=False)  # fast, but its output failed fp64
    v = check_targets([recs[0], wrong], [dense])
    assert (v.checked, v.missed) == (1, 1) and "failed its fp64 check" in v.lines[0]
    for other in (dict(device="NVIDIA H100"), dict(backend="interpreter")):
        twin = _rec("mla_decode", "H=16,B=16", 32768, 240.0, "bf16", **other, H=16, B=16, page=64)
        v = check_targets([twin, recs[1]], [dense])
        assert (v.checked, v.missed) == (0, 0) and "no bf16 twin" in v.lines[0]


def test_sparse_fp8_goal_is_no_slower_than_bf16():
    """Sparse top-2048 at H 128, B 8: equal time is met, slower missed, twins matched on the
    corpus too; a CPU run (no triton records) is not measured."""
    from perf.speed_targets import FP8_TARGETS

    sparse = FP8_TARGETS[1]

    def rec(p50, kv, corpus=32768, B=8, backend="triton"):
        variant = f"H=128,B={B}" + (",fp8" if kv == "fp8" else "")
        return _rec("mla_sparse", variant, 2048, p50, kv, backend, H=128, B=B, corpus=corpus)

    v = check_targets([rec(30.0, "bf16"), rec(30.0, "fp8")], [sparse])
    assert (v.checked, v.missed) == (1, 0) and v.lines[0].endswith("1x (at least 1x) met")
    v = check_targets([rec(30.0, "bf16"), rec(31.0, "fp8")], [sparse])
    assert (v.checked, v.missed) == (1, 1)
    v = check_targets([rec(30.0, "bf16", corpus=8192), rec(20.0, "fp8")], [sparse])
    assert (v.checked, v.missed) == (0, 0) and "no bf16 twin" in v.lines[0]
    v = check_targets([rec(9.0, "fp8", B=1)], [sparse])  # B 1: not this goal's shape
    assert v.lines == ["target FP8 sparse top-2048 (H 128, B 8): no slower than bf16: "
                       "not measured in this run"]  # fmt: skip
    cpu = [rec(30.0, "bf16", backend="interpreter"), rec(1.0, "fp8", backend="interpreter")]
    assert check_targets(cpu, [sparse]).checked == 0


def test_bf16_targets_leave_fp8_records_alone():
    """A p50 bound set for the bf16 cache holds bf16 records only (``kv_dtype``, bf16 when a
    record does not say): an FP8 record at the same shape label is neither met nor missed."""
    t = Target("mla_decode", 10.0, "bf16 bound", extra={"shape": "s"})
    fp8 = _rec("mla_decode", "H=16,B=1,fp8", 2048, 99.0, "fp8", shape="s")
    assert kv_dtype(fp8) == "fp8" and kv_dtype({"extra": None}) == "bf16"
    v = check_targets([fp8], [t])
    assert (v.checked, v.missed) == (0, 0) and "not measured" in v.lines[0]
    v = check_targets([fp8], [Target("mla_decode", 10.0, "fp8 bound", kv_dtype="fp8")])
    assert (v.checked, v.missed) == (1, 1)
    # x_min and extra_min select from below (the dense goal's c_t >= 32768, B >= 16)
    t = Target("mla_decode", 1e9, "big", x_min=32768, extra_min={"B": 16})
    small = [_dense(16, 8192, 1.0), _dense(8, 32768, 1.0), _rec("mla_decode", "?", 32768, 1.0)]
    assert not any(t.selects(r) for r in small)
    assert t.selects(_dense(16, 32768, 1.0))
    assert Speedup("mla_decode", 1.0, "w").selects(_dense(1, 1, 1.0, "fp8"))


def test_speed_targets_prints_every_target_against_a_results_file(tmp_path, capsys):
    """``python -m perf.speed_targets FILE`` (what the GPU check prints last): each target's
    verdicts, the counts; ``--check`` makes a miss the exit status; a missing file is refused."""
    from perf import speed_targets

    path = tmp_path / "r.jsonl"
    recs = [_dense(16, 32768, 240.0, "bf16"), _dense(16, 32768, 200.0, "fp8")]
    path.write_text("".join(json.dumps({**r, "x_name": "ct", "unit": "us"}) + "\n" for r in recs))
    assert speed_targets.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "1.2x (at least 1.6x) MISSED" in out and out.rstrip().endswith("checked, 1 missed")
    assert speed_targets.main([str(path), "--check"]) == 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        speed_targets.main([str(tmp_path / "none.jsonl")])
    assert exc.value.code == 2 and "no such file" in capsys.readouterr().err


def test_bench_mla_records_the_cache_format_bytes_and_tokens_per_second(tmp_path):
    """``--kv-dtype both`` on the CPU stand-in: each point in bf16 (fp32 there) and then FP8,
    the FP8 record's bytes at 656 B per entry, its cache tokens and tokens per second."""
    from perf import bench_mla

    out = tmp_path / "m.jsonl"
    argv = ["--quick", "--only", "sparse", "--kv-dtype", "both", "--reps", "1", "--warmup", "0"]
    assert bench_mla.main([*argv, "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["x"]) for r in recs] == [
        ("H=16,corpus=8192", 512), ("H=16,corpus=8192,fp8", 512),
        ("H=16,corpus=8192", 2048), ("H=16,corpus=8192,fp8", 2048),
    ]  # fmt: skip
    for r in recs:
        e, n, H = r["extra"], r["x"], 16
        fp8 = e["kv_dtype"] == "fp8"
        assert e["kv_dtype"] == ("fp8" if fp8 else "fp32") and r["backend"] == "torch-reference"
        assert e["entry_bytes"] == (656 if fp8 else 576 * 4) and e["cache_tokens"] == n
        assert r["bytes"] == n * e["entry_bytes"] + H * 576 * 4 + H * (512 * 4 + 4)
        assert e["tokens_per_s"] == pytest.approx(n / (r["p50"] * 1e-6), rel=1e-12)
    with pytest.raises(SystemExit) as exc:
        bench_mla.main(["--goals", "--tiles", "32x32w8s5", "--kv-dtype", "fp8", "--out", "x"])
    assert exc.value.code == 2


def test_bench_mla_cpu_stand_in_attends_the_dequantized_cache():
    """What the CPU path times over an FP8 pool is attention over its dequantized entries: the
    stand-in's ``o`` and ``lse`` against the fp64 reference over the same entries."""
    from mqnc.reference.attention_ref import mla_decode_reference, mla_sparse_reference
    from mqnc.testing import assert_close, tolerance
    from perf import bench_mla as b

    gen = torch.Generator().manual_seed(3)
    q, pool, table, lens = b._dense_case(2, 4, 100, "cpu", torch.float32, False, gen, "fp8", False)
    assert pool.dtype == torch.uint8 and pool.shape[-1] == 656
    o, lse = b._dense_fn(q, pool, table, lens, False)()
    ref_o, ref_lse = mla_decode_reference(q.double(), rows_of(pool), table, lens, b.SCALE)
    assert_close(o, ref_o, tolerance("mla", torch.float32), name="o")
    assert_close(lse, ref_lse, tolerance("mla_lse", "float32"), name="lse")
    q, pool, idx = b._sparse_case(1, 4, 40, 128, "cpu", torch.float32, gen, "fp8", False)
    o, lse = b._sparse_fn(q, pool, idx, False)()
    ref_o, ref_lse = mla_sparse_reference(q.double(), rows_of(pool), idx, b.SCALE)
    assert_close(o, ref_o, tolerance("mla", torch.float32), name="o")
    assert_close(lse, ref_lse, tolerance("mla_lse", "float32"), name="lse")


def rows_of(pool):
    """An FP8 pool's entries dequantized, in fp64 (exact in fp32: power-of-two scales)."""
    from mqnc.reference.fp8_ref import fp8_dequantize_reference

    return fp8_dequantize_reference(pool, 512, 64, torch.float32).double()  # exact


def test_bench_splice_splices_fp8_entries_and_counts_656_bytes(tmp_path):
    """``bench_splice --kv-dtype fp8``: every variant (the Triton ones interpreted) splices the
    same FP8 pool bit for bit in its latent and scales (checked before timing), records
    variant ``...,fp8``, ``kv_dtype`` fp8 and ``2 L c_t 656`` bytes."""
    from perf import bench_splice

    out = tmp_path / "s.jsonl"
    argv = ["--quick", "--c-t", "55", "--layers", "2", "--reps", "1", "--kv-dtype", "fp8"]
    assert bench_splice.main([*argv, "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["variant"] for r in recs} == {
        f"{v},fp8" for v in ("one-launch", "per-layer", "persistent", "torch", "torch-per-layer")
    }
    for r in recs:
        assert r["extra"]["kv_dtype"] == "fp8" and r["extra"]["entry_bytes"] == 656
        assert r["bytes"] == 2 * 2 * 55 * 656


def test_gpu_check_times_each_fp8_goal_shape_in_both_formats():
    """``perf/gpu_check.sh``'s ``bench_fp8`` step (GPU run) names goal shapes by ``--shapes``;
    each part matches exactly one goal shape, each FP8 goal selects the FP8 record bench_mla
    writes at one of them, and the step times bf16 too (``--kv-dtype both``: the twins)."""
    import re
    import shlex
    from pathlib import Path

    from mqnc.triton_kernels.sm90.variants import GOALS
    from perf.speed_targets import FP8_TARGETS

    script = (Path(__file__).resolve().parent.parent / "perf" / "gpu_check.sh").read_text()
    gpu_args = re.findall(r"^  FP8_ARGS=\((.*)\)", script, re.M)[-1]  # the GPU run's, second
    args = shlex.split(gpu_args)
    assert args[args.index("--kv-dtype") + 1] == "both" and "--goals" in args
    parts = args[args.index("--shapes") + 1].split(",")
    shapes = []
    for part in parts:
        (shape,) = [s for s in GOALS if part in s.label]
        shapes.append(shape)
    for goal in FP8_TARGETS:
        recs = [
            _rec(s.op, f"H={s.H},B={s.B},fp8", s.ct, 1.0, "fp8", H=s.H, B=s.B, page=64)
            for s in shapes
        ]
        assert sum(goal.selects(r) for r in recs) == 1, goal.what


def test_kernel_report_lists_the_fp8_variants_beside_their_bf16_twins(tmp_path):
    """``kernel_report --kv-dtype both``: the FP8 shapes' launches are the ``-fp8`` variants,
    compiled spill-free for sm_90; their bytes count 656 B per cache token; the FP8 table puts
    each beside its bf16 twin, predicted and (``--measured``) measured, with their ratios."""
    import os
    import subprocess
    import sys

    from mqnc.measure.kernel_report import FP8_SHAPES

    measured = tmp_path / "results.jsonl"
    base = "mla_sparse H=128 B=8 topk=2048"
    recs = [  # the bf16 twin and the FP8 record of the sparse FP8 goal, GPU-timed
        _rec("mla_sparse", "H=128,B=8", 2048, 100.0, "bf16", shape=base),
        _rec("mla_sparse", "H=128,B=8,fp8", 2048, 80.0, "fp8", shape=base + " fp8"),
    ]
    for r in recs:
        r["extra"]["timing"] = {"method": "cuda-graph"}
    measured.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "k.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    argv = ["--kv-dtype", "both", "--ops", "mla_sparse", "--measured", str(measured)]
    r = subprocess.run(
        [sys.executable, "-m", "mqnc.measure.kernel_report", *argv, "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    fp8 = {x["shape"]: x for x in rows if x["kind"] == "shape" and x["kv_dtype"] == "fp8"}
    labels = {f"mla_sparse H={H} B={B} topk={n} fp8" for op, B, H, n, _ in FP8_SHAPES if "sp" in op}
    assert set(fp8) == labels
    for x in rows:
        if x["kind"] == "launch" and x["shape"] in fp8 and x["variant"].startswith("mla_"):
            assert "-fp8[" in x["variant"] and x["spill"] == 0, x
    s = fp8[base + " fp8"]
    rows_ = 8 * 128
    assert s["essential_bytes"] == 8 * 2048 * 656 + rows_ * 576 * 2 + rows_ * (512 * 2 + 4)
    line = [x for x in r.stdout.splitlines() if x.startswith(f"| {base} fp8 | no slower")][-1]
    assert line.endswith("| 100.0 | 80.0 | 1.25x |"), line


def test_fp8_records_are_checked_against_fp64_before_timing(monkeypatch):
    """The FP8 kernel's check in ``bench_mla`` (``_vs_fp64`` with ``kv="fp8"``, what a GPU run
    records as ``extra.vs_fp64`` / ``extra.ok`` on FP8 records): the interpreted kernel passes
    against fp64 over the dequantized cache at ``("mla_fp8", bf16)``; an output off by 1% fails
    with the error instead of passing."""
    from perf import bench_mla as b

    monkeypatch.setattr(b, "SMALL_TOPK", 40)  # a partial last tile still; the corpus 2 pages
    monkeypatch.setattr(b, "SMALL_CORPUS", 128)
    gen = torch.Generator().manual_seed(0)
    good = b._vs_fp64("mla_sparse", 16, "cpu", torch.bfloat16, gen, "fp8")
    assert good["ok"] and good["o_max_abs"] < 3.2e-2, good
    real = b._sparse_fn

    def off(*args):
        call = real(*args)
        return lambda: (lambda o, lse: (o * 1.01, lse))(*call())

    monkeypatch.setattr(b, "_sparse_fn", off)
    bad = b._vs_fp64("mla_sparse", 16, "cpu", torch.bfloat16, gen, "fp8")
    assert not bad["ok"] and "o" in bad["error"], bad
