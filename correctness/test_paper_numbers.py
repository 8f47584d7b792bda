"""The paper's numbers, reproduced from the paper's constants through this package's model.

Every expected value here is a number printed in the paper (section cited beside it), or
arithmetic on such numbers; none is an output of our code typed back in. Where the paper's
prose and its own arithmetic part, the test states both and the docstring says why (see also
``mqnc/cost/predicate.py``'s module docstring).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mqnc import cost as cm
from mqnc.cost import FABRICS, get_fabric
from mqnc.cost import predicate as pr
from mqnc.model import get_preset

V2 = get_preset("deepseek-v2-lite")
IBGDA = get_fabric("h100-ibgda")

# Paper constants (§ cited).
Q_ROW, P_ROW = 576 * 2, 512 * 2 + 2 * 4  # §3.2: q = 576 x 2 = 1152 B, p = 512 x 2 + 2 x 4 = 1032 B
PROBE_US, BW_GBPS, TURNAROUND_US = 16.0, 25.0, 9.0  # §4.3
ROUTE_1024_MEASURED_US = 116.0  # §4.3 ("≈116 us measured"); Table 1 prints 115.8
SPLICE_NOMINAL_US = 3000.0  # §2.2 ("≈3 ms splice")
TABLE2 = {  # fabric: (T_probe us, BW GB/s, MAPE amortised, MAPE full)
    "h100-ibgda": (16, 25, 0.07, 0.16),
    "h100-nvlink4": (1.2, 21, 0.03, 0.18),
    "a100-nvlink3": (1.6, 18, 0.04, 0.22),
    "rtx-pro-6000-pcie5": (4.8, 22, 0.02, 0.07),
    "a40-pcie4": (8.7, 19, 0.13, 0.16),
}


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_presets_are_table_2():
    for name, (probe, bw, m_am, m_full) in TABLE2.items():
        f = FABRICS[name]
        assert (f.t_probe_us, f.bw_gbps, f.mape_amortised, f.mape_full) == (probe, bw, m_am, m_full)


def test_wire_row_bytes():
    """§3.2: q + p = 2184 B per routed row, derived from the geometry."""
    assert (V2.q_row_bytes, V2.p_row_bytes, V2.qp_row_bytes) == (Q_ROW, P_ROW, 2184)


def test_chunk_sizes():
    """Fig. 1(a): one layer of a 2048-token chunk ≈ 2.3 MB, all 27 layers ≈ 61 MB; §5.4: ≈64 MB.

    The paper mixes units: 2048 x 27 x 1152 B = 63.7e6 B is "≈64 MB" (decimal, §5.4) and
    "≈61 MB" (60.75 MiB, Fig. 1(a)); one layer is 2.36e6 B = 2.25 MiB, printed "≈2.3 MB".
    """
    one = V2.chunk_bytes(2048, layers=1)
    every = V2.chunk_bytes(2048)
    assert rel(one / 1e6, 2.3) < 0.03 and rel(one / 2**20, 2.3) < 0.03
    assert rel(every / 2**20, 61) < 0.01  # Fig. 1(a), MiB
    assert rel(every / 1e6, 64) < 0.01  # §5.4, MB
    assert round(one / V2.qp_row_bytes) == 1080  # Fig. 1(a): "x1,080", "∼1000x smaller"


def test_route_moves_76_percent_fewer_bytes_at_decode():
    """§5.2: at c_t = 2048, route moves ≥76% fewer wire bytes for M_q ≤ 256 (76% at 256)."""
    m = np.arange(1, 257)
    saving = pr.wire_byte_saving(V2, m, 2048)
    assert saving.min() >= 0.76 and math.floor(100 * saving[-1]) == 76
    assert np.all(np.diff(saving) < 0)  # "rising toward ∼100% for smaller batches"


def test_break_even_near_1080_rows():
    """§5.2 "breaks even near M_q ≈ 10^3" and §5.4 "≈1080 (top-2048)": the same 1080.3 rows."""
    rows = pr.wire_break_even_rows(V2, 2048)
    assert round(rows) == 1080 and abs(math.log10(rows) - 3) < 0.05
    assert abs(pr.wire_byte_saving(V2, rows, 2048)) < 1e-12
    # V3.2 and GLM-5.1 select top-2048 (§5.4) over the same 576-wide entry: 1080 as well.
    for name in ("deepseek-v3.2", "glm-5.1"):
        assert round(pr.selection_break_even_rows(get_preset(name))) == 1080


def test_selection_budget_v4_flash_disagreement():
    """§5.4 "≈270 query rows (V4-Flash's top-512)" is V2-Lite's entry at k = 512.

    V4-Flash's own published geometry (a 512-wide entry: 1024 B; q = 1024 B, p = 512 x 2 + 8 B)
    gives 512 x 1024 / 2056 = 255 rows, just below the 256-row decode batch the paper says it
    "stays above"; on V4's own dims the wire-byte margin at M_q = 256 is slightly negative.
    """
    assert round(pr.selection_break_even_rows(V2, 512)) == 270
    v4 = get_preset("deepseek-v4-flash")
    expected = 512 * (512 * 2) / (512 * 2 + 512 * 2 + 8)
    assert pr.selection_break_even_rows(v4) == pytest.approx(expected, rel=1e-12)
    assert pr.selection_break_even_rows(v4) < 256


def test_pull_of_the_all_layer_chunk():
    """§2.2: pulling a 2048-token chunk, all 27 layers, at ≈25 GB/s is ≈2.5 ms."""
    assert rel(cm.t_pull(V2, IBGDA, 2048), 2500.0) < 0.03


def test_route_at_1024_within_7_percent_of_measured():
    """§4.3: T_route at M_q = 1024 ≈ 116 us measured; the model reproduces it to the paper's 7%.

    The paper's two-constant form 16 + M_q (q+p) / 25 GB/s gives 105.5 us (9% low at this one
    point: its 7% is a mean over M_q ≥ 512, and the error falls with M_q); with the ≈9 us
    turnaround of §4.3 it is 114.5 us (1.3%).
    """
    route = cm.t_route(V2, IBGDA, 1024)
    assert rel(route.transport, ROUTE_1024_MEASURED_US) < 0.07
    two_constant = cm.t_route(V2, IBGDA.replace(turnaround_us=0.0), 1024).transport
    assert rel(two_constant, ROUTE_1024_MEASURED_US) > rel(route.transport, 116.0)
    assert two_constant == pytest.approx(PROBE_US + 1024 * (Q_ROW + P_ROW) / (BW_GBPS * 1e3))


@pytest.mark.parametrize(
    "qp, sig_rt, full_rt, eff_bw",
    [
        (900, 16.2, 62.8, 24.6),
        (2184, 15.9, 115.8, 24.7),
        (4368, 16.6, 207.7, 24.7),
        (8736, 16.1, 389.1, 24.7),
    ],
)
def test_table_1_eff_bw_is_the_slope(qp, sig_rt, full_rt, eff_bw):
    """Table 1: the effBW column is the large-M_q slope, not the caption's formula.

    The caption defines effBW = M_q (q+p) / (full_rt - probe), which at M_q = 1024 gives
    19.8-24.0 GB/s, not the printed 24.6-24.7; the printed value is the slope, and the
    difference is the ≈9 us turnaround (§4.3): probe + 9 + M_q (q+p) / effBW reproduces every
    full_rt to within 1%.
    """
    caption = 1024 * qp / (full_rt - sig_rt) / 1e3
    assert caption < eff_bw
    fabric = IBGDA.replace(t_probe_us=sig_rt, bw_gbps=eff_bw)
    modelled = cm.t_probe(fabric) + cm.t_turnaround(fabric) + cm.bytes_to_us(1024 * qp, eff_bw)
    assert rel(modelled, full_rt) < 0.01


def test_mape_7_and_3_percent_follow_from_the_turnaround():
    """§4.3: the two-constant model is ≈7% MAPE over M_q ≥ 512 and ≈3% over M_q ≥ 2048.

    Round trips that are exactly probe + 9 us + bytes / BW on the paper's power-of-two sweep
    give those numbers through our fit (6.9% and 3.4%). Over the whole sweep (1..4096) the
    same turnaround gives ≈24%, above the paper's 16% (Table 2): the measured small-M_q points
    must sit closer to the probe than a constant turnaround implies (not resolvable without
    the raw data). Recorded, not bent.
    """
    m = 2.0 ** np.arange(0, 13)
    rt = PROBE_US + TURNAROUND_US + m * V2.qp_row_bytes / (BW_GBPS * 1e3)
    res = cm.fit(np.c_[m, rt], qp_row_bytes=V2.qp_row_bytes, probe_us=PROBE_US)
    assert res.bw_gbps == pytest.approx(BW_GBPS) and res.turnaround_us == pytest.approx(9.0)
    assert abs(res.mape_amortised - 0.07) < 0.005
    hi = cm.fit(
        np.c_[m, rt], qp_row_bytes=V2.qp_row_bytes, probe_us=PROBE_US, amortised_min_rows=2048
    )
    assert abs(hi.mape_amortised - 0.03) < 0.005
    assert res.mape_full > 0.16  # the disagreement with Table 2's full MAPE


def test_route_26x_and_125x_under_the_splice():
    """§4.3: route is ≈26x cheaper than the ≈3 ms splice at M_q = 1024, ∼125x at M_q = 1."""
    assert rel(SPLICE_NOMINAL_US / cm.t_route(V2, IBGDA, 1024).transport, 26) < 0.05
    assert rel(SPLICE_NOMINAL_US / cm.t_route(V2, IBGDA, 1).transport, 125) < 0.05


def test_fetch_local_crossover_75_to_220_tokens():
    """§5.1 / Fig. 1(b) (70 GB/s): fetch overtakes local above ≈75-220 tokens.

    The printed band is T_splice / (L c) with a flat 3 ms splice and the pull neglected (74,
    222); with Fig. 1(b)'s 70 GB/s pull it is 75-230, with the measured §7 profile 69-212.
    """
    nominal = pr.local_band_tokens(V2, IBGDA, splice=cm.SPLICE_NOMINAL, bw_gbps=70.0)
    measured = pr.local_band_tokens(V2, IBGDA, splice=cm.SPLICE_PAPER, bw_gbps=70.0)
    no_pull = pr.local_band_tokens(V2, IBGDA, splice=cm.SPLICE_NOMINAL, bw_gbps=1e12)
    for band, tol in ((nominal, 0.05), (measured, 0.1), (no_pull, 0.02)):
        assert rel(band[0], 75) < tol and rel(band[1], 220) < tol


def test_fig_6b_cluster_at_decode():
    """Fig. 6(b) / §8: the five fabrics cluster at ≈31-48 us at M_q = 256, within 1.5x.

    Table 2's two-constant form gives 27.8-38.4 us; every fabric lands in [31, 48] us within
    its own full-sweep MAPE (M_q = 256 is below the amortised regime), the three points §8
    prints (IBGDA 45.6, A100 39, RTX Pro 6000 32 us) are within that MAPE, and all five sit
    over 60x below the ≈3 ms splice (§5.5: 60-100x).
    """
    transport = {
        n: cm.t_route(V2, f.replace(turnaround_us=0.0), 256).transport for n, f in FABRICS.items()
    }
    for name, t in transport.items():
        m_full = TABLE2[name][3]
        assert 31 / (1 + m_full) <= t <= 48 * (1 + m_full), name
        assert SPLICE_NOMINAL_US / t > 60
    assert max(transport.values()) / min(transport.values()) <= 1.5
    for name, measured in (
        ("h100-ibgda", 45.6),
        ("a100-nvlink3", 39.0),
        ("rtx-pro-6000-pcie5", 32.0),
    ):
        assert rel(transport[name], measured) <= TABLE2[name][3], name
    # §8: peak bandwidth does not order the fabrics at decode: the A100 (235 GB/s peak) is
    # slower than the RTX Pro 6000 (41 GB/s) -- 39 vs 32 us measured.
    assert transport["a100-nvlink3"] > transport["rtx-pro-6000-pcie5"]


def test_nvlink4_leads_ibgda_only_to_about_1000_rows():
    """§8: "NVLink 4.0 leads only out to M_q ≈1000 ... before the InfiniBand path takes over"."""
    nv, ib = FABRICS["h100-nvlink4"], IBGDA.replace(turnaround_us=0.0)  # Table 2 form
    m = np.arange(1, 5000)
    lead = cm.t_route(V2, nv, m).transport < cm.t_route(V2, ib, m).transport
    crossing = m[np.argmin(lead)]
    assert lead[: crossing - 1].all() and not lead[crossing:].any()
    assert rel(crossing, 1000) < 0.15


def test_route_fetch_ranking_inverts_only_near_1e5_rows():
    """§5.5: the route/fetch ranking inverts only near M_q ≳ 10^5 (≈6 x 10^4 in the model)."""
    rows = pr.route_fetch_inversion_rows(V2, IBGDA, 2048)
    assert abs(math.log10(rows) - 5) < 0.5
    d = pr.decide(V2, IBGDA, 1.01 * rows, 2048, allow=("route", "fetch"))
    assert d.primitive == "fetch"


def test_congestion_threshold_and_robustness():
    """§8 (i): route loses to fetch only below M_q (q+p) / T_splice ≈ 0.2 GB/s at M_q = 256,
    a ∼125x degradation from 25 GB/s; (ii) a 10x probe inflation leaves route an order of
    magnitude below fetch."""
    thr = pr.congestion_bw_threshold_gbps(V2, 256, SPLICE_NOMINAL_US)
    assert rel(thr, 0.2) < 0.1 and rel(BW_GBPS / thr, 125) < 0.1
    inflated = cm.Congestion(probe_add_us=9 * PROBE_US)
    d = pr.decide(V2, IBGDA, 256, 2048, congestion=inflated)
    assert d.primitive == "route" and d.fetch.total / d.route.transport > 10


def test_congestion_model_predicts_the_k3_point():
    """§8 / Fig. 7(a), K = 3 on one NDR-200 link: probe 14.5 -> 39.5 us, M_q = 1024:
    114 -> 250 us, M_q = 256: 45.6 -> 95 us. Both congestion terms fitted on the probe and the
    1024 point predict the 256 point within IBGDA's full-sweep MAPE (16%)."""
    c = cm.fit_congestion(
        V2,
        IBGDA,
        1024,
        probe_idle_us=14.5,
        probe_congested_us=39.5,
        rt_idle_us=114.0,
        rt_congested_us=250.0,
    )
    assert c.probe_add_us == pytest.approx(25.0)
    transfer_256 = cm.bytes_to_us(256 * V2.qp_row_bytes, IBGDA.bw_gbps)
    predicted = 45.6 + c.probe_add_us + transfer_256 * (1 / c.bw_factor - 1)
    assert rel(predicted, 95.0) < 0.16
    # "Even fully congested, that M_q = 1024 round trip stays ∼12x below fetch's splice."
    assert rel(SPLICE_NOMINAL_US / 250.0, 12) < 0.05
    assert not pr.congestion_reprices(V2, IBGDA, 1024, 2048, c)


def test_tp_rank_pairing_halves_per_rank_bytes():
    """§8: per-rank inter-node bytes fall by 1/N (50% at N = 2, measured)."""
    assert cm.route_bytes(V2, 256, tp=2) == 0.5 * cm.route_bytes(V2, 256)


def test_selection_gather_grows_3x_from_one_to_seven_holders():
    """§5.4 / Fig. 4(a): gathering top-2048 grows ≈1.3 -> ≈3.9 ms per layer for M = 1 -> 7
    ("≈3x from one to seven", §5.5); route's fan-out stays flat."""
    g1 = cm.t_gather(V2, 2048, 1) / V2.layers
    g7 = cm.t_gather(V2, 2048, 7) / V2.layers
    assert rel(g1, 1300) < 1e-9 and rel(g7, 3900) < 1e-9 and rel(g7 / g1, 3) < 1e-9
    assert cm.t_route(V2, IBGDA, 256, holders=7).total == cm.t_route(V2, IBGDA, 256).total
    d = pr.decide(V2, IBGDA, 256, 2048, topk=2048, holders=7)
    assert d.fetch.splice == 0 and d.primitive == "route"


def test_host_overhead_dwarfs_the_wire():
    """§5.3: through the Python client route's TTFT is ≈3.5 ms + 12.5 us M_q, "a fixed host
    overhead [that] dwarfs the microsecond-scale wire cost"."""
    r = cm.t_route(V2, IBGDA, 256, host=cm.HOST_PAPER)
    assert r.host == pytest.approx(3500 + 12.5 * 256)
    assert r.host / r.transport > 50
