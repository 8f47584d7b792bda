"""``mqnc calibrate`` (issue 8, item 2): a short probe + route sweep on this machine, fitted and
written as a fabric profile that ``mqnc predict --fabric FILE`` loads. The fitted constants are
checked against ``mqnc.cost.fit_results`` over the very records the run wrote (the same
samples must give the same constants), not against typed numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mqnc.cli import main
from mqnc.cost import FabricProfile, fit_results
from mqnc.model import get_preset

GEOM = get_preset("deepseek-v2-lite")
ROOT = Path(__file__).resolve().parent.parent


def test_calibrate_loopback_profile_matches_its_records(tmp_path, capsys):
    prof_path, results = tmp_path / "fab.json", tmp_path / "r.jsonl"
    rc = main(
        ["calibrate", "--reps", "4", "--m-q", "1,64,512,2048", "--fit-min-rows", "1",
         "--bulk-tokens", "16", "--out", str(prof_path), "--results", str(results), "--name",
         "this-box"]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    prof = FabricProfile.load(prof_path)
    assert prof.name == "this-box" and prof.source.startswith("mqnc calibrate")
    assert prof.t_probe_us > 0 and prof.bw_gbps > 0 and prof.turnaround_us >= 0
    assert prof.bulk_bw_gbps is not None and prof.bulk_bw_gbps > 0
    fits = fit_results(results, qp_row_bytes=GEOM.qp_row_bytes, fit_min_rows=1)
    assert set(fits) == {"loopback"}
    f = fits["loopback"]
    assert f.t_probe_us == pytest.approx(prof.t_probe_us, rel=1e-12)
    assert f.bw_gbps == pytest.approx(prof.bw_gbps, rel=1e-12)
    assert f.mape_amortised == pytest.approx(prof.mape_amortised, rel=1e-12)
    # The predicate loads it.
    capsys.readouterr()
    assert main(["predict", "--fabric", str(prof_path), "--m-q", "256", "--c-t", "2048"]) == 0
    assert "this-box" in capsys.readouterr().out


def test_calibrate_json_without_results_writes_no_records(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MQNC_RESULTS", str(tmp_path / "must-not-exist.jsonl"))
    prof_path = tmp_path / "fab.json"
    rc = main(
        ["calibrate", "--m-q", "16,2048", "--reps", "3", "--no-bulk", "--json", "--out",
         str(prof_path)]
    )  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["profile"] == FabricProfile.load(prof_path).to_dict()
    assert out["profile"]["bulk_bw_gbps"] is None
    assert out["fit"]["n_points"] == 2
    assert not (tmp_path / "must-not-exist.jsonl").exists()


def test_calibrate_bad_input(tmp_path, capsys):
    out = str(tmp_path / "f.json")
    assert main(["calibrate", "--m-q", "64", "--out", out]) == 2
    assert "at least two distinct" in capsys.readouterr().err
    assert main(["calibrate", "--m-q", "1,x", "--out", out]) == 2
    assert "argument --m-q: expected comma-separated ints" in capsys.readouterr().err
    assert main(["calibrate", "--transport", "infiniband"]) == 2
    assert "argument --transport: invalid choice" in capsys.readouterr().err
    assert main(["calibrate", "--reps", "0"]) == 2
    assert "argument --reps: expected a number >= 1" in capsys.readouterr().err
    from mqnc.measure.calibrate import calibrate

    with pytest.raises(ValueError, match="reps"):
        calibrate("loopback", reps=0)
    if not torch.cuda.is_available():
        assert main(["calibrate", "--transport", "nvshmem", "--out", out]) == 2
        assert "nvshmem" in capsys.readouterr().err


def test_calibrate_gloo_cli(tmp_path):
    """The installed command over gloo (an echo holder process on 127.0.0.1).

    On a loaded 2-core box a gloo wake-up can wait a scheduler slice (several ms), which can
    invert the p50 of two batch sizes; such a run fails with "does not grow with M_q" and is
    repeated (at most three runs), any other failure is reported at once.
    """
    prof_path = tmp_path / "gloo.json"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-m", "mqnc", "calibrate", "--transport", "gloo", "--m-q",
             "1,4096", "--fit-min-rows", "1", "--reps", "9", "--no-bulk", "--out",
             str(prof_path)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if "does not grow with M_q" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-2000:]
    prof = FabricProfile.load(prof_path)
    assert prof.t_probe_us > 0 and prof.bw_gbps > 0
    assert "gloo" in prof.name and "--transport gloo" in prof.source
