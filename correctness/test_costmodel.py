"""Cost model (``mqnc.cost``: terms, fabric profiles, fit): terms, profiles, fit.

Expected values are the model's defining formulas (§4) evaluated independently here, or known
constants that synthetic data was generated from; never outputs of the code under test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mqnc import cost as cm
from mqnc.cost import FABRICS, FabricProfile, get_fabric, load_fabric
from mqnc.model import get_preset

V2 = get_preset("deepseek-v2-lite")
IBGDA = get_fabric("h100-ibgda")
finite = dict(allow_nan=False, allow_infinity=False)


def test_cost_modules_import_without_torch_or_triton():
    code = (
        "import sys; import mqnc.cost, mqnc.plots, mqnc.measure.results_file, mqnc.cli.cmd_cost, "
        "mqnc.cli;"
        "mqnc.cli.build_parser();"
        "bad = [m for m in ('torch', 'triton', 'matplotlib') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- fabric profiles ---------------------------------------------------------------------------


def test_fabric_json_round_trip(tmp_path):
    for f in FABRICS.values():
        path = tmp_path / f"{f.name}.json"
        f.save(path)
        assert FabricProfile.load(path) == f
        assert load_fabric(path) == f
        assert json.loads(path.read_text())["t_probe_us"] == f.t_probe_us


def test_fabric_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown preset 'x'.*h100-ibgda"):
        get_fabric("x")
    with pytest.raises(ValueError, match="t_probe_us.*> 0.*-1"):
        FabricProfile("f", -1.0, 25.0)
    with pytest.raises(TypeError, match="bw_gbps.*number.*str"):
        FabricProfile("f", 1.0, "25")
    with pytest.raises(ValueError, match="unknown keys.*bogus"):
        FabricProfile.from_dict({"name": "f", "t_probe_us": 1.0, "bw_gbps": 2.0, "bogus": 1})
    with pytest.raises(ValueError, match="missing keys.*bw_gbps"):
        FabricProfile.from_dict({"name": "f", "t_probe_us": 1.0})
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_fabric(tmp_path / "nope.json")


def test_bulk_bw_fallbacks():
    f = FabricProfile("f", 1.0, 20.0)
    assert f.bulk_bw == 20.0
    assert f.replace(link_peak_gbps=125.0).bulk_bw == 125.0
    assert f.replace(link_peak_gbps=125.0, bulk_bw_gbps=70.0).bulk_bw == 70.0


# ---- route terms -------------------------------------------------------------------------------


@given(
    m_q=st.integers(1, 1 << 16),
    probe=st.floats(0.1, 100, **finite),
    bw=st.floats(0.1, 1000, **finite),
    turn=st.floats(0, 50, **finite),
    tp=st.integers(1, 8),
    rt=st.integers(1, 64),
)
def test_route_terms(m_q, probe, bw, turn, tp, rt):
    f = FabricProfile("f", probe, bw, turnaround_us=turn)
    r = cm.t_route(V2, f, m_q, t_compute_us=20.0, t_merge_us=5.0, tp=tp, round_trips=rt)
    q_us = m_q * 1152 / tp / (bw * 1e3)
    p_us = m_q * 1032 / tp / (bw * 1e3)
    assert r.transfer == pytest.approx(rt * q_us) and r.return_ == pytest.approx(rt * p_us)
    assert r.transport == pytest.approx(rt * (probe + turn + q_us + p_us))
    assert r.total == pytest.approx(rt * (probe + turn + q_us + p_us + 25.0))
    assert r.host == 0


def test_route_fan_out_and_host():
    flat = cm.t_route(V2, IBGDA, 256, holders=7)
    shared = cm.t_route(V2, IBGDA, 256, holders=7, shared_uplink=True)
    one = cm.t_route(V2, IBGDA, 256)
    assert flat.total == one.total
    assert shared.transfer == pytest.approx(7 * one.transfer)
    host = cm.HostOverhead(100.0, 2.0)
    assert cm.t_route(V2, IBGDA, 10, host=host).host == 120.0
    # each round trip is a routed call of its own: the host overhead is paid each time
    assert cm.t_route(V2, IBGDA, 10, host=host, round_trips=27).host == 27 * 120.0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tp: expected an int >= 1"):
            cm.t_route(V2, IBGDA, 256, tp=bad)


def test_route_terms_broadcast():
    m = np.array([1.0, 16.0, 256.0])
    bw = np.array([[1.0], [25.0]])
    arr = cm.t_route(V2, IBGDA, m, bw_gbps=bw).total
    assert arr.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            scalar = cm.t_route(V2, IBGDA.replace(bw_gbps=float(bw[i, 0])), float(m[j])).total
            assert arr[i, j] == pytest.approx(scalar, rel=1e-12)


# ---- congestion --------------------------------------------------------------------------------


@given(
    factor=st.floats(0.01, 1.0, **finite),
    add=st.floats(0, 200, **finite),
    m_q=st.integers(16, 8192),
)
def test_congestion_terms_and_fit_round_trip(factor, add, m_q):
    c = cm.Congestion(bw_factor=factor, probe_add_us=add)
    r0 = cm.t_route(V2, IBGDA, m_q)
    r1 = cm.t_route(V2, IBGDA, m_q, congestion=c)
    assert r1.probe == pytest.approx(r0.probe + add)
    assert r1.transfer + r1.return_ == pytest.approx((r0.transfer + r0.return_) / factor)
    assert cm.t_pull(V2, IBGDA, 2048, congestion=c) == pytest.approx(
        cm.t_pull(V2, IBGDA, 2048) / factor
    )
    route_only = cm.Congestion(factor, add, on_fetch=False)
    assert cm.t_pull(V2, IBGDA, 2048, congestion=route_only) == cm.t_pull(V2, IBGDA, 2048)
    fitted = cm.fit_congestion(
        V2,
        IBGDA,
        m_q,
        probe_idle_us=IBGDA.t_probe_us,
        probe_congested_us=r1.probe,
        rt_idle_us=r0.transport,
        rt_congested_us=r1.transport,
    )
    assert fitted.bw_factor == pytest.approx(factor, rel=1e-6)
    assert fitted.probe_add_us == pytest.approx(add, abs=1e-9)


def test_congestion_errors():
    with pytest.raises(ValueError, match="bw_factor.*> 0.*0"):
        cm.Congestion(bw_factor=0)
    with pytest.raises(ValueError, match="probe_add_us.*>= 0"):
        cm.Congestion(probe_add_us=-1)
    with pytest.raises(ValueError, match="no faster than idle"):
        cm.fit_congestion(
            V2,
            IBGDA,
            256,
            probe_idle_us=20,
            probe_congested_us=10,
            rt_idle_us=50,
            rt_congested_us=60,
        )
    # a congested round trip faster than the idle one (bw_factor > 1) is refused too
    with pytest.raises(ValueError, match="no faster than idle"):
        cm.fit_congestion(
            V2, IBGDA, 1024, probe_idle_us=16, probe_congested_us=16, rt_idle_us=116,
            rt_congested_us=100,
        )  # fmt: skip
    same = cm.fit_congestion(
        V2, IBGDA, 1024, probe_idle_us=16, probe_congested_us=16, rt_idle_us=116,
        rt_congested_us=116,
    )  # fmt: skip
    assert same.bw_factor == 1.0 and same.probe_add_us == 0.0


# ---- fetch and local ---------------------------------------------------------------------------


def test_pull_and_local():
    assert cm.t_pull(V2, IBGDA, 2048) == pytest.approx(2048 * 27 * 1152 / 25e3)
    assert cm.t_pull(V2, IBGDA, 2048, bw_gbps=70.0) == pytest.approx(2048 * 27 * 1152 / 70e3)
    assert cm.t_local(V2, 100, 0.5) == pytest.approx(100 * 27 * 0.5)
    assert cm.t_local_range(V2, 100) == pytest.approx((100 * 27 * 0.5, 100 * 27 * 1.5))
    f = cm.t_fetch(V2, IBGDA, 2048)
    assert f.total == pytest.approx(f.pull + f.splice) and not f.selection


def test_splice_profile_interpolation():
    s = cm.SPLICE_PAPER
    for tok, us in zip((55, 1024, 2048, 4096), (2770, 2780, 2910, 3060), strict=True):
        assert s.at(tok) == pytest.approx(us)
    assert s.at(1) == 2770  # flat below the first point
    assert s.at(1536) == pytest.approx((2780 + 2910) / 2)
    assert s.at(8192) == pytest.approx(3060 + 150 * (8192 - 4096) / 2048)  # last slope
    assert cm.SPLICE_NOMINAL.at(17) == 3000 and cm.SpliceProfile.none().at(2048) == 0


@given(st.lists(st.floats(1, 20000, **finite), min_size=1, max_size=20))
def test_splice_profile_array_matches_scalar(xs):
    arr = cm.SPLICE_PAPER.at(np.asarray(xs))
    assert arr == pytest.approx([cm.SPLICE_PAPER.at(x) for x in xs], rel=1e-12)


def test_splice_profile_errors_and_results(tmp_path):
    with pytest.raises(ValueError, match="strictly increasing"):
        cm.SpliceProfile((2, 1), (1, 1))
    with pytest.raises(ValueError, match="equal, non-empty"):
        cm.SpliceProfile((1, 2), (1,))
    path = tmp_path / "r.jsonl"
    rows = [
        ("splice", 64, 900.0),
        ("splice", 64, 1100.0),
        ("splice", 2048, 1500.0),
        ("route", 256, 40.0),
    ]
    path.write_text(
        "".join(
            json.dumps({"bench": b, "variant": "v", "x": x, "p50": p}) + "\n" for b, x, p in rows
        )
    )
    s = cm.SpliceProfile.from_results(path)
    assert s.tokens == (64.0, 2048.0) and s.us == (1000.0, 1500.0)
    with pytest.raises(ValueError, match="no records with bench='nope'"):
        cm.SpliceProfile.from_results(path, bench="nope")


@given(m=st.integers(1, 16), k=st.integers(64, 4096))
def test_gather_is_affine_in_holders(m, k):
    per_layer = cm.t_gather(V2, k, m) / V2.layers
    g = cm.GATHER_PAPER
    assert per_layer == pytest.approx(m * g.handshake_us + k * 1152 / (g.gather_gbps * 1e3))
    f = cm.t_fetch(V2, IBGDA, 99999, topk=k, holders=m)
    assert f.selection and f.splice == 0 and f.total == pytest.approx(per_layer * V2.layers)


# ---- fit ---------------------------------------------------------------------------------------


@given(
    probe=st.floats(0.5, 50, **finite),
    bw=st.floats(5, 300, **finite),
    turn=st.floats(0, 30, **finite),
)
def test_fit_recovers_exact_constants(probe, bw, turn):
    m = 2.0 ** np.arange(0, 13)
    rt = probe + turn + m * 2184 / (bw * 1e3)
    res = cm.fit(np.c_[m, rt], qp_row_bytes=2184, probe_us=probe)
    assert res.bw_gbps == pytest.approx(bw, rel=1e-6)
    assert res.t_probe_us == probe and res.turnaround_us == pytest.approx(turn, abs=1e-6)
    assert res.mape_full_affine < 1e-6 and res.probe_measured
    assert res.n_fit == 4  # 512, 1024, 2048, 4096
    expected_two = np.mean(turn / rt[m >= 512])
    assert res.mape_amortised == pytest.approx(expected_two, rel=1e-6, abs=1e-12)


def test_fit_with_noise_and_without_probe():
    rng = np.random.default_rng(0)
    m = np.repeat(2.0 ** np.arange(0, 13), 5)
    truth = 16.0 + 9.0 + m * 2184 / 25e3
    rt = truth * (1 + 0.01 * rng.standard_normal(m.size))
    probes = 16.0 + 0.2 * rng.standard_normal(20)
    res = cm.fit(list(zip(m, rt, strict=True)), qp_row_bytes=2184, probe_us=probes)
    assert abs(res.bw_gbps - 25.0) / 25.0 < 0.03
    assert abs(res.t_probe_us - 16.0) < 0.3 and abs(res.turnaround_us - 9.0) < 3.0
    blind = cm.fit(np.c_[m, rt], qp_row_bytes=2184)
    assert not blind.probe_measured and blind.turnaround_us == 0
    assert blind.t_probe_us == pytest.approx(blind.intercept_us)
    prof = res.to_fabric("mine", link_peak_gbps=50.0)
    assert (prof.t_probe_us, prof.bw_gbps, prof.link_peak_gbps) == (
        res.t_probe_us,
        res.bw_gbps,
        50.0,
    )
    assert res.predict(1024) == pytest.approx(res.intercept_us + 1024 * 2184 / (res.bw_gbps * 1e3))


def test_fit_uses_all_points_when_too_few_are_large():
    m = np.array([1.0, 4, 16, 64, 256, 1024])
    rt = 10 + m * 2184 / 20e3
    res = cm.fit(np.c_[m, rt], qp_row_bytes=2184)
    assert res.n_fit == 6 and res.bw_gbps == pytest.approx(20.0)


def test_fit_errors():
    with pytest.raises(ValueError, match=r"shape \[n, 2\].*\[3\]"):
        cm.fit([1, 2, 3], qp_row_bytes=2184)
    with pytest.raises(ValueError, match="two distinct M_q"):
        cm.fit([(4, 10.0), (4, 11.0)], qp_row_bytes=2184)
    with pytest.raises(ValueError, match="finite, positive"):
        cm.fit([(4, 10.0), (8, float("nan"))], qp_row_bytes=2184)
    with pytest.raises(ValueError, match="does not grow"):
        cm.fit([(4, 10.0), (8, 9.0)], qp_row_bytes=2184)
    with pytest.raises(ValueError, match="qp_row_bytes: expected a positive int"):
        cm.fit([(4, 10.0), (8, 11.0)], qp_row_bytes=0)


def test_fit_results_reads_the_results_format(tmp_path):
    """Records written by mqnc.measure.results_file.record (the real writer) fit back to their
    constants."""
    from mqnc.measure import record

    path = tmp_path / "results.jsonl"
    for variant, probe, bw, turn in (("fab-a", 2.0, 40.0, 3.0), ("fab-b", 12.0, 18.0, 7.0)):
        record("probe", variant, 1, (probe, probe, probe), x_name="bytes", path=path)
        for m in (64, 256, 512, 1024, 2048, 4096):
            t = probe + turn + m * 2184 / (bw * 1e3)
            record("route", variant, m, (t, t, t), x_name="M_q", path=path)
    fits = cm.fit_results(path, qp_row_bytes=2184)
    assert sorted(fits) == ["fab-a", "fab-b"]
    assert fits["fab-a"].bw_gbps == pytest.approx(40.0)
    assert fits["fab-b"].turnaround_us == pytest.approx(7.0)
    with pytest.raises(ValueError, match="no records with bench='rt'.*found benches"):
        cm.fit_results(path, qp_row_bytes=2184, route_bench="rt")
    # A sweep that cannot be fitted is an error naming it (fit_groups keeps it, with why).
    record("route", "fab-c", 64, (5.0, 5.0, 5.0), x_name="M_q", path=path)
    with pytest.raises(ValueError, match="cannot fit fab-c: samples: expected at least two"):
        cm.fit_results(path, qp_row_bytes=2184)
    groups = {g.label: g for g in cm.fit_groups(path, qp_row_bytes=2184)}
    assert groups["fab-c"].fit is None and "two distinct" in groups["fab-c"].error
    assert cm.newest_group(list(groups.values()), 2184).label in ("fab-a", "fab-b")


def test_splice_profile_takes_one_device_and_backend(tmp_path):
    """``from_results`` never pools devices, backends or variants (as ``mqnc fit`` never pools
    devices): a file with several is refused, listing them; a selection gives that one's
    points, and the profile's name says device, backend, variant and commit."""
    path = tmp_path / "r.jsonl"
    rows = [
        ("cpu", "torch", "torch", "c1", 2048, 250000.0),
        ("cpu", "torch", "torch", "c2", 4096, 370000.0),
        ("gpu", "triton", "one-launch", "c3", 2048, 42.0),
        ("gpu", "triton", "one-launch", "c3", 2048, 44.0),
        ("gpu", "triton", "per-layer", "c3", 2048, 140.0),
        ("gpu", "torch", "torch", "c3", 2048, 440.0),
    ]
    path.write_text(
        "".join(
            json.dumps(
                {"bench": "splice", "device": d, "backend": b, "variant": v, "commit": c}
                | {"x": x, "p50": p}
            )
            + "\n"
            for d, b, v, c, x, p in rows
        )
    )
    with pytest.raises(ValueError, match="one device, backend and variant") as err:
        cm.SpliceProfile.from_results(path)
    for listed in ("'cpu'", "'gpu'", "'triton'", "'torch'", "'one-launch'", "'per-layer'"):
        assert listed in str(err.value)
    with pytest.raises(ValueError, match="variant='one-launch'.*variant='per-layer'"):
        cm.SpliceProfile.from_results(path, device="gpu", backend="triton")
    s = cm.SpliceProfile.from_results(path, device="gpu", backend="triton", variant="one-launch")
    assert s.tokens == (2048.0,) and s.us == (43.0,)
    assert "gpu" in s.name and "triton" in s.name and "c3" in s.name and str(path) in s.name
    cpu = cm.SpliceProfile.from_results(path, device="cpu")  # the only backend and variant there
    assert cpu.us == (250000.0, 370000.0) and "c1, c2" in cpu.name
    with pytest.raises(ValueError, match="no records with bench='splice' and device='tpu'"):
        cm.SpliceProfile.from_results(path, device="tpu")
