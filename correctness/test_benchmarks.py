"""Smoke tests of the transport benchmarks (issue 8): each runs with tiny ``--quick`` settings into
a temporary results file, and its records carry the fields, sizes and conventions that
``mqnc fit`` and ``mqnc.plots`` read. Timings themselves are not asserted (they are what the
benchmarks measure); their order (p20 <= p50 <= p80) and positivity are. The CPU holder path
of ``bench_holder`` is checked against the fp64 reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mqnc.model import get_preset

GEOM = get_preset("deepseek-v2-lite")
ROOT = Path(__file__).resolve().parent.parent
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


def test_bench_route_loopback(tmp_path):
    from perf import bench_route

    out = tmp_path / "r.jsonl"
    rc = bench_route.main(
        ["--quick", "--m-q", "1,16,512", "--payloads", "900,2184", "--reps", "3", "--warmup",
         "1", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
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
    # `mqnc fit` reads them: one fit per payload, each with the measured probe.
    from mqnc.cost import fit_results

    fits = fit_results(out, qp_row_bytes=GEOM.qp_row_bytes, fit_min_rows=1)
    assert set(fits) == {"loopback@900B", "loopback@2184B"}
    assert all(f.probe_measured and f.t_probe_us == probes[0]["p50"] for f in fits.values())


def test_bench_route_gloo_subprocess(tmp_path):
    """Two processes over gloo on 127.0.0.1, as a researcher runs it."""
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


def test_bench_fetch_loopback(tmp_path):
    from perf import bench_fetch

    out = tmp_path / "f.jsonl"
    rc = bench_fetch.main(
        ["--quick", "--ct", "16,64", "--max-holders", "3", "--topk", "64", "--m-q", "32",
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
        ["--n", "1,4", "--heads", "16", "--ct", "128", "--streams", "1,4", "--requests", "4",
         "--staging-ct", "64", "--reps", "2", "--warmup", "1", "--out", str(out)]
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
    # A wide M_q span and more repetitions: the fit needs a slope whose sign survives the
    # noise of a loaded 2-core CI box.
    route = ["--m-q", "1,2048,4096", "--payloads", "2184", "--reps", "7", "--out", out]
    bench_route.main(route)
    bench_fetch.main(["--ct", "16", "--max-holders", "2", "--topk", "32", "--m-q", "16",
                      "--pool-rows", "64", *common])  # fmt: skip
    bench_holder.main(["--n", "1,2,4", "--heads", "16", "--ct", "64", *common])
    bench_congestion.main(["--k", "0,1", "--m-q", "1,4096", "--background-m-q", "16", *route[4:]])
    recs = plots.read_results(out)
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

    with pytest.raises(ValueError, match="--transport"):
        bench_route.main(["--transport", "ethernet", "--out", str(tmp_path / "x.jsonl")])
    if not torch.cuda.is_available():
        out = tmp_path / "n.jsonl"
        assert bench_route.main(["--transport", "nvshmem", "--quick", "--out", str(out)]) == 0
        assert "skipped" in capsys.readouterr().out and not out.exists()
