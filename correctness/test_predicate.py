"""The route / fetch / local predicate (``mqnc.cost.predicate``): argmin, margins, grids,
closed forms.

Each check compares the predicate against the cost-model terms it is defined from (§5.1:
argmin over the three costs) or against an independently written formula.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mqnc import cost as cm
from mqnc.cost import FABRICS, get_fabric
from mqnc.cost import predicate as pr
from mqnc.model import get_preset

V2 = get_preset("deepseek-v2-lite")
IBGDA = get_fabric("h100-ibgda")
finite = dict(allow_nan=False, allow_infinity=False)
fabric_names = st.sampled_from(sorted(FABRICS))


@given(
    m_q=st.floats(1, 1e6, **finite),
    c_t=st.floats(1, 1e5, **finite),
    fab=fabric_names,
    c_us=st.floats(0.5, 1.5, **finite),
)
def test_decide_is_the_argmin_of_the_terms(m_q, c_t, fab, c_us):
    f = FABRICS[fab]
    d = pr.decide(V2, f, m_q, c_t, c_us=c_us)
    costs = {
        "route": cm.t_route(V2, f, m_q).total,
        "fetch": cm.t_fetch(V2, f, c_t).total,
        "local": cm.t_local(V2, c_t, c_us),
    }
    assert d.costs == pytest.approx(costs, rel=1e-12)
    ranked = sorted(costs, key=costs.get)
    assert costs[d.primitive] == costs[ranked[0]]
    assert d.margin_us == pytest.approx(costs[ranked[1]] - costs[ranked[0]], rel=1e-9, abs=1e-9)
    assert d.margin_us >= 0 and d.margin_ratio >= 1


def test_allow_restricts_the_choice():
    d = pr.decide(V2, IBGDA, 256, 2048, allow=("fetch", "local"))
    assert d.primitive == "fetch" and d.runner_up == "local"
    only = pr.decide(V2, IBGDA, 256, 2048, allow=("local",))
    assert only.primitive == "local" and only.runner_up is None and math.isinf(only.margin_us)


def test_decide_errors():
    with pytest.raises(TypeError, match="geometry: expected an MLAGeometry"):
        pr.decide("v2", IBGDA, 256, 2048)
    with pytest.raises(TypeError, match="fabric: expected a FabricProfile"):
        pr.decide(V2, "h100-ibgda", 256, 2048)
    with pytest.raises(ValueError, match="m_q: expected a finite number > 0, got -1"):
        pr.decide(V2, IBGDA, -1, 2048)
    with pytest.raises(ValueError, match="c_t: expected a finite number > 0"):
        pr.decide(V2, IBGDA, 1, float("nan"))
    with pytest.raises(TypeError, match="m_q: expected a number"):
        pr.decide(V2, IBGDA, "1", 2048)
    with pytest.raises(ValueError, match="allow: expected a non-empty subset"):
        pr.decide(V2, IBGDA, 1, 2048, allow=("teleport",))
    with pytest.raises(ValueError, match="use decide_grid"):
        pr.decide(V2, IBGDA, np.array([1.0, 2.0]), 2048)


# every proper, non-empty subset of the primitives (what ``allow`` restricts a decision to)
_ALLOWED = [("route", "fetch"), ("route", "local"), ("fetch", "local"), ("route",), ("fetch",),
            ("local",)]  # fmt: skip


@given(
    fab=fabric_names,
    seed=st.integers(0, 2**31 - 1),
    topk=st.sampled_from([None, 512, 2048]),
    holders=st.integers(1, 7),
    factor=st.floats(0.05, 1, **finite),
    allow=st.sampled_from([None, *_ALLOWED]),
)
def test_grid_matches_scalar_decisions(fab, seed, topk, holders, factor, allow):
    f = FABRICS[fab]
    rng = np.random.default_rng(seed)
    m = np.exp(rng.uniform(0, np.log(1e5), 6))
    c = np.exp(rng.uniform(0, np.log(1e4), 5))
    cong = cm.Congestion(bw_factor=factor, probe_add_us=5.0)
    kw = dict(topk=topk, holders=holders, congestion=cong)
    if allow is not None:
        kw["allow"] = allow
    grid = pr.crossover_map(V2, f, m, c, **kw)
    assert grid.choice.shape == (6, 5)
    for i in range(6):
        for j in range(5):
            d = pr.decide(V2, f, float(m[i]), float(c[j]), **kw)
            assert grid.primitive[i, j] == d.primitive
            assert grid.route_us[i, j] == pytest.approx(d.route.total, rel=1e-12)
            assert grid.fetch_us[i, j] == pytest.approx(d.fetch.total, rel=1e-12)
            assert grid.margin_us[i, j] == pytest.approx(d.margin_us, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("allow", _ALLOWED, ids="+".join)
def test_a_grid_restricted_by_allow_never_chooses_another_primitive(allow):
    """``allow`` masks the grid as it masks one decision: over a map where every primitive wins
    somewhere unrestricted, a restricted grid picks only allowed primitives, each point the
    cheapest of them, its margin over the allowed runner-up (infinite when one is allowed)."""
    m, c = np.geomspace(1, 1e5, 9), np.geomspace(16, 1e5, 8)
    free = pr.crossover_map(V2, IBGDA, m, c, c_us=np.geomspace(1.0, 1e5, 8)[None, :])
    assert set(free.primitive.ravel()) == set(pr.PRIMITIVES)  # the data can tell
    grid = pr.crossover_map(V2, IBGDA, m, c, c_us=np.geomspace(1.0, 1e5, 8)[None, :], allow=allow)
    assert set(grid.primitive.ravel()) <= set(allow)
    costs = {"route": grid.route_us, "fetch": grid.fetch_us, "local": grid.local_us}
    allowed = np.stack([costs[p] for p in allow])
    chosen = np.choose(grid.choice, [grid.route_us, grid.fetch_us, grid.local_us])
    assert np.array_equal(chosen, allowed.min(0))
    if len(allow) == 1:
        assert np.isinf(grid.margin_us).all()
    else:
        assert np.allclose(grid.margin_us, np.sort(allowed, 0)[1] - allowed.min(0))


def test_bw_sweep_sets_both_bandwidths():
    bw = np.geomspace(0.2, 1000, 7)
    sweep = pr.bw_sweep(V2, IBGDA, bw)
    for i, b in enumerate(bw):
        f = IBGDA.replace(bw_gbps=float(b), bulk_bw_gbps=float(b))
        d = pr.decide(V2, f, 256, 2048)
        assert sweep.route_us[i] == pytest.approx(d.route.total, rel=1e-12)
        assert sweep.fetch_us[i] == pytest.approx(d.fetch.total, rel=1e-12)
        # Fig. 6(a): route stays cheapest across the whole sweep.
        assert d.primitive == "route"
    assert sweep.fraction("route") == 1.0


@given(m_q=st.floats(1, 1e4, **finite), c_t=st.floats(1, 1e4, **finite))
def test_wire_break_even_and_saving(m_q, c_t):
    rows = pr.wire_break_even_rows(V2, c_t)
    assert rows * V2.qp_row_bytes == pytest.approx(c_t * V2.kv_bytes_per_token_layer)
    saving = pr.wire_byte_saving(V2, m_q, c_t)
    route_b = cm.route_bytes(V2, m_q)
    chunk_b = cm.fetch_bytes(V2, c_t, layers=1)
    assert saving == pytest.approx(1 - route_b / chunk_b)
    assert (saving > 0) == (m_q < rows) or math.isclose(m_q, rows, rel_tol=1e-12)


def test_selection_break_even_needs_a_budget():
    with pytest.raises(ValueError, match="no selection budget"):
        pr.selection_break_even_rows(V2)


@pytest.mark.parametrize("splice", [cm.SPLICE_PAPER, cm.SPLICE_NOMINAL], ids=["profile", "flat"])
@pytest.mark.parametrize("c_us", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("bw", [19.0, 70.0, 235.0])
def test_fetch_local_crossover_equalises_costs(splice, c_us, bw):
    x = pr.fetch_local_crossover_tokens(V2, IBGDA, c_us=c_us, splice=splice, bw_gbps=bw)
    fetch = cm.t_fetch(V2, IBGDA, x, splice=splice, bw_gbps=bw).total
    assert fetch == pytest.approx(cm.t_local(V2, x, c_us), rel=1e-7)
    for c_t, want in ((0.5 * x, "local"), (2 * x, "fetch")):
        d = pr.decide(
            V2,
            IBGDA.replace(bulk_bw_gbps=bw),
            1,
            c_t,
            c_us=c_us,
            splice=splice,
            allow=("fetch", "local"),
        )
        assert d.primitive == want


def test_fetch_local_crossover_infinite_when_pull_costs_more():
    slow = IBGDA.replace(bulk_bw_gbps=0.1)
    assert math.isinf(pr.fetch_local_crossover_tokens(V2, slow, c_us=0.5))


@pytest.mark.parametrize("fab", sorted(FABRICS))
@pytest.mark.parametrize("tp", [1, 2])
def test_route_fetch_inversion_equalises_costs(fab, tp):
    f = FABRICS[fab]
    rows = pr.route_fetch_inversion_rows(V2, f, 2048, tp=tp)
    assert cm.t_route(V2, f, rows, tp=tp).total == pytest.approx(
        cm.t_fetch(V2, f, 2048).total, rel=1e-9
    )


@given(
    m_q=st.floats(1, 1e6, **finite),
    c_t=st.floats(1, 1e4, **finite),
    shrink=st.floats(0.01, 1, **finite),
)
def test_route_region_is_closed_under_smaller_batches(m_q, c_t, shrink):
    """Route's cost grows with M_q and the others do not depend on it: fewer rows keep route."""
    if pr.decide(V2, IBGDA, m_q, c_t).primitive == "route":
        assert pr.decide(V2, IBGDA, m_q * shrink, c_t).primitive == "route"


def test_amortisation_steps():
    n = pr.amortisation_steps(V2, IBGDA, 256, 2048)
    r = cm.t_route(V2, IBGDA, 256)
    fetch = cm.t_fetch(V2, IBGDA, 2048).total
    assert fetch + n * r.compute == pytest.approx(n * r.total)
    # congestion prices both sides (as route_fetch_inversion_rows does), unless route-only
    for c in (cm.Congestion(0.25, 5.0), cm.Congestion(0.25, 5.0, on_fetch=False)):
        n = pr.amortisation_steps(V2, IBGDA, 256, 2048, congestion=c)
        r = cm.t_route(V2, IBGDA, 256, congestion=c)
        fetch = cm.t_fetch(V2, IBGDA, 2048, congestion=c).total
        assert fetch + n * r.compute == pytest.approx(n * r.total)


@pytest.mark.parametrize("topk", [0, -2048, float("nan"), float("inf")])
def test_decide_grid_refuses_a_bad_topk_as_decide_does(topk):
    for call in (pr.decide, pr.decide_grid):
        with pytest.raises(ValueError, match="topk"):
            call(V2, IBGDA, 256.0, 2048.0, topk=topk)


def test_allow_names_each_primitive_once():
    with pytest.raises(ValueError, match="each once"):
        pr.decide(V2, IBGDA, 256, 2048, allow=("route", "route"))


def test_rank_fabrics_is_sorted_by_route_round_trip():
    ranked = pr.rank_fabrics(V2, FABRICS.values(), 256)
    times = [t for _, t in ranked]
    assert times == sorted(times) and {n for n, _ in ranked} == set(FABRICS)
    for name, t in ranked:
        assert t == pytest.approx(cm.t_route(V2, FABRICS[name], 256).transport)


def test_decision_to_dict_is_json_ready():
    import json

    d = pr.decide(V2, IBGDA, 256, 2048, congestion=cm.Congestion(0.5, 10.0), host=cm.HOST_PAPER)
    out = json.loads(json.dumps(d.to_dict()))
    assert out["primitive"] == d.primitive
    assert out["route"]["total"] == pytest.approx(d.route.total)
    assert out["inputs"]["congestion"]["bw_factor"] == 0.5


# ---- the predicate's two inputs: the machine profile and the request --------------------------


def _full_profile() -> cm.MachineProfile:
    """A profile with every field set to a value of its own."""
    return cm.MachineProfile(
        IBGDA.replace(host_fixed_us=100.0, host_per_row_us=0.5),
        splice=cm.SpliceProfile((16, 4096), (300.0, 900.0), "measured"),
        scatter=cm.SpliceProfile.flat(50.0),
        gather=cm.GatherProfile(400.0, 3.0, "g"),
        host=cm.HostOverhead(10.0, 0.25),
        t_compute_us=20.0,
        t_merge_us=5.0,
        **{k: 1.0 + i for i, k in enumerate(cm.MEASURED_TERMS)},
        measured_with=dict(device="cpu", kernels="torch"),
        sources=dict(c_us="calibrated"),
    )


def test_machine_profile_json_round_trip(tmp_path):
    p = _full_profile()
    path = tmp_path / "p.json"
    p.save(path)
    data = json.loads(path.read_text())
    assert (data["schema"], data["version"]) == (cm.PROFILE_SCHEMA, cm.PROFILE_VERSION)
    assert cm.MachineProfile.load(path) == p == cm.MachineProfile.from_dict(p.to_dict())
    assert cm.load_profile(str(path)) == p
    assert cm.FabricProfile.load(path) == p.fabric  # a fabric reader takes its fabric
    assert cm.load_profile("h100-ibgda") == cm.MachineProfile(IBGDA)


def test_version0_files_load(tmp_path):
    """A fabric profile saved before the schema (FabricProfile.save, mqnc calibrate, mqnc fit
    --save) and a demo profile (``kind``) load as version 0."""
    fabric = tmp_path / "fabric.json"
    IBGDA.save(fabric)
    assert cm.MachineProfile.load(fabric) == cm.MachineProfile(IBGDA)
    demo = tmp_path / "demo_profile.json"
    terms = {k: 2.0 for k in cm.MEASURED_TERMS}
    demo.write_text(
        json.dumps(
            dict(
                kind=cm.DEMO_PROFILE_KIND,
                fabric=IBGDA.to_dict(),
                terms=dict(terms, unknown_term=1.0),
                measured_with=dict(device="cpu"),
                sources=dict(c_us="calibrated"),
            )
        )
    )
    p = cm.MachineProfile.load(demo)
    assert p.fabric == IBGDA and p.terms() == terms and p.measured_with == dict(device="cpu")
    assert p.sources == dict(c_us="calibrated") and p.c_us == 2.0


def test_machine_profile_errors_name_the_version_and_the_field(tmp_path):
    data = _full_profile().to_dict()
    with pytest.raises(ValueError, match="version 2 is not supported"):
        cm.MachineProfile.from_dict(dict(data, version=2))
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(dict(data, version=2)))
    for load in (cm.MachineProfile.load, cm.FabricProfile.load):
        with pytest.raises(ValueError, match="version 2 .*not supported"):
            load(path)
    with pytest.raises(ValueError, match=r"unknown keys \['splice_ms'\]"):
        cm.MachineProfile.from_dict(dict(data, splice_ms=3.0))
    with pytest.raises(ValueError, match="MachineProfile.c_us: expected a finite number > 0"):
        cm.MachineProfile.from_dict(dict(data, c_us=-1.0))
    with pytest.raises(TypeError, match="MachineProfile.merge_us: expected a number, got str"):
        cm.MachineProfile.from_dict(dict(data, merge_us="1"))
    with pytest.raises(TypeError, match="profile.gather: .*unexpected keyword"):
        cm.MachineProfile.from_dict(dict(data, gather=dict(speed=1.0)))
    with pytest.raises(TypeError, match="MachineProfile.fabric: expected a FabricProfile"):
        cm.MachineProfile("h100-ibgda")
    with pytest.raises(ValueError, match="kind 'other' is not a profile"):
        cm.MachineProfile.from_dict(dict(kind="other"))
    with pytest.raises(FileNotFoundError, match="no/such.json"):
        cm.MachineProfile.load("no/such.json")


def test_decide_on_a_profile_and_a_request_is_the_convenience_form():
    """``decide(geometry, profile, request)`` prices what the convenience form's options ask
    (every profile and request field the predicate reads)."""
    p = _full_profile()
    cong = cm.Congestion(0.5, 7.0)
    for moved in (True, False):
        for topk in (None, 512):
            r = cm.Request(300, 1500, topk=topk, holders=3 if topk else 1, moved=moved,
                           tp=2, round_trips=4, shared_uplink=True, congestion=cong)  # fmt: skip
            d = pr.decide(V2, p, r)
            splice = p.splice if moved else p.scatter
            kw = dict(topk=r.topk, holders=r.holders, congestion=cong, tp=2, round_trips=4,
                      shared_uplink=True, host=p.host, gather=p.gather)  # fmt: skip
            want = {
                "route": cm.t_route(
                    V2,
                    p.fabric,
                    300,
                    t_compute_us=20.0,
                    t_merge_us=5.0,
                    **{
                        k: kw[k]
                        for k in (
                            "congestion",
                            "tp",
                            "round_trips",
                            "shared_uplink",
                            "host",
                            "holders",
                        )
                    },
                ).total,  # fmt: skip
                "fetch": cm.t_fetch(
                    V2,
                    p.fabric,
                    1500,
                    splice=splice,
                    topk=topk,
                    holders=r.holders,
                    gather=p.gather,
                    congestion=cong,
                ).total,  # fmt: skip
                "local": cm.t_local(V2, 1500, p.c_us),
            }
            assert d.costs == want
            old = pr.decide(V2, p.fabric, 300, 1500, moved=moved, splice=p.splice,
                            scatter=p.scatter, c_us=p.c_us, t_compute_us=20.0, t_merge_us=5.0,
                            **kw)  # fmt: skip
            assert old.costs == d.costs and old.inputs == d.inputs


def test_request_attention_and_measured_splice():
    """``attention=False`` leaves the holder's partial and the merge out of route; a profile's
    measured splice per token prices a moved chunk at ``k c_t`` (exactly), the pool write per
    token an unmoved one, and a grid agrees with the scalar decisions."""
    p = cm.MachineProfile(IBGDA, splice_us_per_token=0.75, scatter_us_per_token=0.125, c_us=0.6)
    r = cm.Request(256, 1000, attention=False)
    d = pr.decide(V2, p, r)
    assert (d.route.compute, d.route.merge) == (0.0, 0.0)
    assert d.fetch.splice == 0.75 * 1000 and d.inputs["splice"] == "measured"
    assert pr.decide(V2, p, r.replace(moved=False)).fetch.splice == 0.125 * 1000
    assert pr.decide(V2, cm.MachineProfile(IBGDA), r.replace(moved=False)).fetch.splice == 0.0
    c = np.array([16.0, 300.0, 5000.0])
    for moved in (True, False):
        grid = pr.decide_grid(V2, p, 256.0, c, request=r.replace(moved=moved))
        for j, ct in enumerate(c):
            one = pr.decide(V2, p, r.replace(c_t=float(ct), moved=moved))
            assert grid.fetch_us[j] == pytest.approx(one.fetch.total, rel=1e-12)
            assert grid.route_us[j] == pytest.approx(one.route.total, rel=1e-12)
            assert grid.primitive[j] == one.primitive


def test_request_and_decide_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"options: unexpected \['c_u'\]"):
        pr.decide(V2, IBGDA, 256, 2048, c_u=1.0)
    with pytest.raises(TypeError, match="expected no c_t and no options"):
        pr.decide(V2, cm.MachineProfile(IBGDA), cm.Request(1, 2), topk=4)
    with pytest.raises(TypeError, match="profile: expected a MachineProfile with a Request"):
        pr.decide(V2, IBGDA, cm.Request(1, 2))
    with pytest.raises(ValueError, match="holders: expected an int >= 1, got 0"):
        cm.Request(1, 2, holders=0)
    with pytest.raises(TypeError, match="moved: expected a bool"):
        cm.Request(1, 2, moved=1)
    assert cm.Request(1, 2, moved=np.int64(3) != 0).moved is True  # a numpy bool is a bool
    with pytest.raises(TypeError, match="congestion: expected a Congestion"):
        cm.Request(1, 2, congestion=0.5)


def test_decision_explains_itself_as_mqnc_predict_prints_it():
    """``str(decision)`` / ``explain()``: the request, each primitive's total and every term
    (the terms sum to the total), the choice marked, the margin and one layer's wire bytes;
    ``repr`` is one line with the totals rounded."""
    d = pr.decide(V2, IBGDA, 256, 2048, host=cm.HostOverhead(10.0, 0.25), allow=("route", "fetch"))
    text = d.explain()
    assert str(d) == text
    lines = text.splitlines()
    assert lines[0] == "model deepseek-v2-lite  fabric h100-ibgda  M_q 256  c_t 2048"
    rows = {line[1:].split()[0]: line for line in lines[2:5]}
    assert rows["route"][0] == "*" and rows["fetch"][0] == " " and rows["local"][0] == "-"
    for name, line in rows.items():
        total, *terms = [float(v) for v in re.findall(r"(?<![\w.])(\d+\.\d)(?![\d])", line)]
        assert total == pytest.approx(d.costs[name], abs=0.05), line
        if name != "local":  # local's numbers are its band, not terms
            assert total == pytest.approx(sum(terms), abs=0.05 * len(terms)), line
    assert f"+ host {d.route.host:.1f}" in rows["route"]
    assert lines[5] == f"decision: route (runner-up fetch by {d.margin_us:.1f} us " + (
        f"({d.margin_ratio:.1f}x))"
    )
    assert "559,104 B vs chunk 2,359,296 B (76.3% fewer); break-even M_q = 1080.3" in lines[6]
    assert d.wire["break_even_rows"] == pytest.approx(pr.wire_break_even_rows(V2, 2048))
    assert "\n" not in repr(d) and "primitive='route'" in repr(d)
    assert f"'route': {d.route.total:.1f}" in repr(d)
    sel = pr.decide(V2, IBGDA, 256, 2048, topk=2048, holders=7, allow=("fetch",))
    assert "top-k 2048 over 7 holder(s)" in str(sel) and "gather" in str(sel)
    assert "decision: fetch (only allowed primitive)" in str(sel)
