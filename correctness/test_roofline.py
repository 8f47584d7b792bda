"""The cost model's holder term read against the device's memory ceiling (fp64 arithmetic on
synthetic records: nothing here is timed).

A holder's partial attention is §6.3's latency-bound constant at small chunks and memory-bound
at long ones: ``T_compute = max(t_compute_us, (c_t L b_KV + M_q (q + p)) / ceiling)``, the
ceiling being the device's kernel-measured read ceiling when the records have one (the
``ceiling`` records of ``perf/bench_copy.py``), else its HBM spec, named either way.
"""

from __future__ import annotations

import numpy as np
import pytest

from mqnc.cost import FABRICS, MachineProfile, t_compute_at, t_compute_floor
from mqnc.cost.ceilings import memory_ceiling
from mqnc.model import get_preset

G = get_preset("deepseek-v2-lite")
H200 = "NVIDIA H200"


def _read(gbps: float, device: str = H200, exact: bool = True) -> dict:
    return dict(bench="ceiling", variant="read", backend="triton", device=device, gbps=gbps,
                extra={"exact": exact})  # fmt: skip


def test_the_floor_is_the_bytes_at_the_ceiling():
    """``(c_t L b_KV + M_q (q + p)) / ceiling``: one layer of a 131072-token chunk (576 bf16
    values an entry) and 16 routed rows (1152 B in, 1032 B out each) at 4.8 TB/s."""
    want = (131072 * 576 * 2 + 16 * (1152 + 1032)) / 4.8e6
    assert t_compute_floor(G, 131072, 16, 4.8) == pytest.approx(want, rel=1e-15)
    two = t_compute_floor(G, 131072, 16, 4.8, layers=2)
    assert two == pytest.approx((2 * 131072 * 1152 + 16 * 2184) / 4.8e6, rel=1e-15)
    with pytest.raises(ValueError, match="read_tbps"):
        t_compute_floor(G, 2048, 1, 0.0)


def test_the_holder_term_is_the_constant_or_the_floor_whichever_is_larger():
    """At c_t 2048 the floor (0.49 us) is under §6.3's 15 us: the constant; at 131072 it is
    over (31.5 us): the floor; without a ceiling, the constant; arrays broadcast."""
    assert t_compute_at(G, 2048, 16, read_tbps=4.8) == 15.0
    assert t_compute_at(G, 131072, 16, read_tbps=4.8) == t_compute_floor(G, 131072, 16, 4.8)
    assert t_compute_at(G, 131072, 16) == 15.0
    c_t = np.array([2048.0, 131072.0])
    got = t_compute_at(G, c_t, 16, read_tbps=4.8)
    np.testing.assert_array_equal(got, [15.0, t_compute_floor(G, 131072, 16, 4.8)])


def test_a_profile_prices_its_holder_at_the_measured_ceiling_else_the_spec():
    """The profile's ``read_tbps`` (the measured ceiling, its source named) first, else the
    HBM spec of the device it was measured on, else no floor; kept through JSON."""
    fabric = FABRICS["h100-nvlink4"]
    measured = memory_ceiling([_read(4000.0), _read(4200.0), _read(9999.0, exact=False)], H200)
    p = MachineProfile(
        fabric,
        read_tbps=measured.tbps,
        sources={"read_tbps": measured.source},
        measured_with={"device_name": H200},
    )
    assert p.holder_read_tbps() == (4.1, measured.source)
    assert "measured read ceiling (2 records" in measured.source
    big = p.holder_compute_us(G, 131072, 16)
    assert big == pytest.approx((131072 * 1152 + 16 * 2184) / 4.1e6, rel=1e-15)
    assert MachineProfile.from_dict(p.to_dict()) == p
    spec = MachineProfile(fabric, measured_with={"device_name": H200})
    assert spec.holder_read_tbps() == (4.8, "HBM spec of NVIDIA H200")
    bare = MachineProfile(fabric)
    assert bare.holder_read_tbps() == (None, "none")
    assert bare.holder_compute_us(G, 131072, 16) == bare.t_compute_us
    with pytest.raises(ValueError, match="read_tbps"):
        MachineProfile(fabric, read_tbps=-1.0)


def test_the_demo_profile_takes_the_read_ceiling_of_its_device_from_the_records():
    """``mqnc.demo.calibration.read_ceiling``: the median of the device's exact read records
    and its source; None for a device with none (the profile then falls back to the spec)."""
    from mqnc.demo.calibration import read_ceiling

    recs = [_read(3900.0), _read(4100.0), _read(4300.0), _read(1.0, device="NVIDIA H100")]
    tbps, source = read_ceiling(H200, recs)
    assert tbps == 4.1 and source.startswith("measured read ceiling (3 records")
    assert read_ceiling("NVIDIA A100-SXM4-80GB", recs) is None
    assert read_ceiling("", recs) is None


def test_decide_prices_the_routed_holder_at_the_profiles_floor():
    """``decide``'s route term charges the holder ``max(T_compute, floor)`` at the profile's
    read ceiling: §6.3's constant at c_t 2048, the bytes at the ceiling at c_t 131072 (fp64
    arithmetic); a profile with no ceiling (the paper's fabrics) keeps the constant."""
    from mqnc.cost import Request, decide

    fabric = FABRICS["h100-nvlink4"]
    p = MachineProfile(fabric, read_tbps=4.0, measured_with={"device_name": H200})
    small = decide(G, p, Request(16, 2048))
    assert small.route.compute == p.t_compute_us == 15.0
    big = decide(G, p, Request(16, 131072))
    assert big.route.compute == pytest.approx((131072 * 1152 + 16 * 2184) / 4.0e6, rel=1e-15)
    bare = decide(G, MachineProfile(fabric), Request(16, 131072))
    assert bare.route.compute == 15.0
    assert big.route.total - bare.route.total == pytest.approx(big.route.compute - 15.0)
