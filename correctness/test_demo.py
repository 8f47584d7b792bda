"""The demo end to end (issue: main job): small configurations on loopback and gloo, the three
``--force`` paths agreeing, and a holder killed mid-run with every request still answered
correctly through the fallback. Every partial and merged answer inside the demo is checked
against the fp64 single-instance reference (``run_demo`` raises beyond the bounds)."""

from __future__ import annotations

import json

import pytest
import torch

from mqnc.demo import DemoConfig, run_demo

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
)


def _run(tmp_path, name, **kw) -> dict:
    return run_demo(DemoConfig(**{**SMALL, "out": str(tmp_path / name), **kw}))


def test_demo_loopback_decides_executes_and_verifies(tmp_path):
    r = _run(tmp_path, "lb", transport="loopback")
    assert (tmp_path / "lb" / "demo.json").exists()
    png = tmp_path / "lb" / "measured_vs_predicted.png"
    assert png.exists() and png.stat().st_size > 5000
    on_disk = json.loads((tmp_path / "lb" / "demo.json").read_text())
    assert on_disk["checked"]["merged"] == SMALL["steps"] * SMALL["layers"] * 2
    # every (chunk, agent) got a decision from the predicate, executed as decided
    assert r["decisions"] and all(d["primitive"] == d["predicate"] for d in r["decisions"])
    assert not r["fallbacks"]
    for prim, row in r["primitives"].items():
        assert row["count"] > 0 and row["measured_us"]["total"] > 0
        assert row["predicted_us"]["total"] > 0, prim


def test_demo_gloo_processes(tmp_path):
    r = _run(tmp_path, "gloo", transport="gloo")
    assert r["checked"]["merged"] == SMALL["steps"] * SMALL["layers"] * 2
    assert sum(row["count"] for row in r["primitives"].values()) > 0


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forced")
    return {p: _run(tmp, p, transport="loopback", force=p) for p in ("route", "fetch", "local")}


@pytest.mark.parametrize("primitive", ["route", "fetch", "local"])
def test_force_runs_every_request_through_one_primitive(forced, primitive):
    r = forced[primitive]
    assert {d["primitive"] for d in r["decisions"]} == {primitive}
    # the selection agent's chunks sit at canonical positions: its fetch splices nothing
    assert set(r["primitives"]) == {primitive}


def test_force_paths_agree(forced):
    """Identical work through route, fetch and local ends in the same agent states, to the
    bf16 floor (each path rounds its queries or keys once more than the reference)."""
    base = forced["route"]["final_hidden"]
    for other in ("fetch", "local"):
        for agent, h in forced[other]["final_hidden"].items():
            a, b = torch.tensor(h), torch.tensor(base[agent])
            scale = float(b.abs().max())
            assert float((a - b).abs().max()) <= 2**-6 * scale, (other, agent)


def test_killed_holder_every_request_answered_through_fallback(tmp_path):
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
    assert r["fallbacks"], "the killed holder's chunks must have been served by the fallback"
    # with a replica, route goes on: to the other holder
    assert all(f["holder"] == 1 and f["peer"] == 2 for f in r["fallbacks"])
    assert {f["used"] for f in r["fallbacks"]} == {"route"}
    assert r["checked"]["merged"] == SMALL["steps"] * SMALL["layers"] * 2


def test_killed_holder_process_gloo(tmp_path):
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
    assert r["fallbacks"]
    assert {f["used"] for f in r["fallbacks"]} <= {"fetch", "local"}
    assert r["checked"]["merged"] == SMALL["steps"] * SMALL["layers"] * 2


def test_bad_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="transport"):
        DemoConfig(transport="carrier-pigeon")
    with pytest.raises(ValueError, match="device"):
        DemoConfig(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="nvshmem.*needs a CUDA device"):
            run_demo(DemoConfig(**{**SMALL, "out": str(tmp_path), "transport": "nvshmem"}))
    with pytest.raises(ValueError, match="replicas"):
        DemoConfig(holders=1, replicas=2)
