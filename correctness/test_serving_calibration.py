"""The measuring the demo's and the Hugging Face session's calibrations share
(:mod:`mqnc.serving.calibration_samples`) and the lines they fit
(:mod:`mqnc.cost.calibration_fits`): the fits against known lines, the loop's order, and each
measurement against a loopback requester
(torch kernels) for its structure and for leaving the requester's pool as it found it. Nothing
here depends on how fast anything runs."""

from __future__ import annotations

import pytest
import torch

from mqnc.cost import bulk_rate_gbps, fit_pull, robust_affine, theil_sen
from mqnc.model import PRESETS, RopeSpec
from mqnc.serving import Corpus, LocalHolders
from mqnc.serving.calibration_samples import (
    FetchSample,
    RouteSample,
    fetch_samples,
    merge_times,
    probe_times,
    route_sweep,
    sample_rounds,
)

GEOM = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=4)
ROPE = RopeSpec.from_preset("deepseek-v2-lite")


# ---- the fits --------------------------------------------------------------------------------
def test_calibration_fits_recover_their_lines():
    pts = [(x, 100.0 + 0.5 * x) for x in (10, 20, 30, 40, 50, 60)] + [(30, 900.0)]
    assert robust_affine(pts) == pytest.approx((100.0, 0.5), rel=1e-9)
    pull = fit_pull([(1_000_000, 1500.0), (2_000_000, 2500.0), (1_000_000, 1500.0)])
    assert pull["fetch_fixed_us"] == pytest.approx(500.0)
    assert pull["bulk_bw_gbps"] == pytest.approx(1.0)  # 1e6 bytes per 1000 us
    # no rising line with a non-negative intercept: proportional through the origin
    assert robust_affine([(10, 50.0), (20, 40.0), (30, 30.0)]) == (0.0, pytest.approx(2.0))
    assert theil_sen([(5, 1.0), (5, 2.0)]) is None


def test_theil_sen_ignores_descheduled_calls_at_the_ends():
    """Repeated timings at four sizes on a known line, a fifth of them (at the two ends of the
    range, where they move a least-squares intercept most) slowed by the OS several-fold: the
    Theil-Sen line is still the true one, the least-squares line is not."""
    import numpy as np

    rng = np.random.default_rng(0)
    xs = np.repeat([1.2e6, 1.5e6, 1.85e6, 2.35e6], 10)
    ys = 300.0 + 1.4e-3 * xs + rng.normal(0.0, 20.0, xs.size)
    slow = rng.choice(np.flatnonzero((xs == xs.min()) | (xs == xs.max())), 8, replace=False)
    ys[slow] *= rng.uniform(2.0, 4.0, slow.size)
    intercept, slope = theil_sen(list(zip(xs, ys, strict=True)))
    assert slope == pytest.approx(1.4e-3, rel=0.05)
    assert intercept == pytest.approx(300.0, abs=100.0)
    ls_slope, ls_intercept = np.polyfit(xs, ys, 1)
    assert abs(ls_intercept - 300.0) > 300.0 or abs(ls_slope / 1.4e-3 - 1) > 0.2


def test_fits_of_exact_lines_and_rates():
    """An exact line is its own Theil-Sen line; a rate is bytes per microsecond / 1e3."""
    line = [(x, 7.0 + 3.0 * x) for x in (1, 2, 5, 9)]
    assert theil_sen(line) == pytest.approx((7.0, 3.0), rel=1e-12)
    assert theil_sen([(1, 2.0)]) is None and theil_sen([]) is None
    assert bulk_rate_gbps(2_000_000, 1000.0) == pytest.approx(2.0, rel=1e-12)
    pull = fit_pull([(b, 40.0 + b / 4e3) for b in (1e5, 2e5, 4e5)])  # 4 GB/s, 40 us fixed
    assert pull == pytest.approx(dict(fetch_fixed_us=40.0, bulk_bw_gbps=4.0), rel=1e-9)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: robust_affine([]), "pairs: expected at least one"),
        (lambda: robust_affine([(0, 1.0), (0, 2.0)]), "pairs: the proportional fit needs"),
        (lambda: theil_sen([(1, float("nan")), (2, 1.0)]), "pairs: expected finite numbers"),
        (lambda: theil_sen([(1, 2, 3)]), "pairs: expected \\(x, y\\) pairs"),
        (lambda: fit_pull([(1e6, -5.0), (1e6, -6.0)]), "points: expected a pull that grows"),
        (lambda: bulk_rate_gbps(1e6, 0.0), "us: expected a finite time > 0, got 0.0"),
    ],
)
def test_fits_refuse_bad_input_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- the loop --------------------------------------------------------------------------------
def test_sample_rounds_warm_up_then_interleave_or_not():
    log: list[str] = []

    def make(k):
        return lambda: (log.append(k), f"{k}{len(log)}")[1]

    got = sample_rounds({"a": make("a"), "b": make("b")}, reps=2, warmup=1)
    assert log == ["a", "b", "a", "b", "a", "b"] and got == {"a": ["a3", "a5"], "b": ["b4", "b6"]}
    log.clear()
    got = sample_rounds({"a": make("a"), "b": make("b")}, reps=2, interleave=False)
    assert log == ["a", "a", "b", "b"] and got == {"a": ["a1", "a2"], "b": ["b3", "b4"]}
    with pytest.raises(ValueError, match="reps: expected an int >= 1, got 0"):
        sample_rounds({"a": make("a")}, reps=0)
    with pytest.raises(ValueError, match="warmup: expected an int >= 0, got -1"):
        sample_rounds({"a": make("a")}, reps=1, warmup=-1)


# ---- against holders -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def holders():
    """Three chunks (16, 16, 8 tokens at positions 100..139) on holders 1 and 2 over loopback,
    the torch kernels on both sides; the requester's pool has room for more copies."""
    gen = torch.Generator().manual_seed(0)
    entries = (0.5 * torch.randn(GEOM.layers, 40, GEOM.d_qk, generator=gen)).to(torch.bfloat16)
    corpus = Corpus.partition(
        entries,
        GEOM,
        ROPE.softmax_scale,
        chunk_tokens=16,
        holders=[1, 2],
        position=100,
        rope=ROPE,
        block_size=16,
    )
    with LocalHolders(corpus, transport="loopback", kernels="torch", timeout_s=30.0) as hs:
        yield corpus, hs.requester()


def test_probes_and_route_sweep_against_holders(holders):
    corpus, req = holders
    n = len(req.costs)
    probes = probe_times(req, 2, reps=3, warmup=2)
    assert len(probes) == 3 and all(p > 0 for p in probes)
    assert [r.primitive for r in req.costs[n:]] == ["probe"] * 5
    n = len(req.costs)
    gen = torch.Generator().manual_seed(1)
    sweep = route_sweep(req, 1, (1, 3), reps=2, warmup=1, generator=gen, offset=117)
    assert list(sweep) == [1, 3]
    recs = req.costs[n:]
    assert [(r.primitive, r.chunk_id, r.m_q) for r in recs] == [
        ("route", 1, m) for m in (4, 12) * 3
    ]
    for b, got in sweep.items():
        assert len(got) == 2 and all(isinstance(s, RouteSample) for s in got)
        for s, rec in zip(got, recs[2 + (b == 3) :: 2], strict=True):  # the timed calls
            assert (s.tokens, s.rows, s.work) == (b, 4 * b, 4 * b * 16)
            assert s.round_trip_us == rec.total_us - rec.compute_us > 0
            assert s.compute_us == rec.compute_us >= 0 and s.send_us == rec.transfer_us >= 0
    # one query per size drawn from the generator, in the order of the sizes
    ref = torch.Generator().manual_seed(1)
    torch.randn(1, GEOM.heads, GEOM.d_qk, generator=ref)
    torch.randn(3, GEOM.heads, GEOM.d_qk, generator=ref)
    assert torch.equal(torch.randn(5, generator=gen), torch.randn(5, generator=ref))
    with pytest.raises(ValueError, match="sizes: expected an int >= 1, got 0"):
        route_sweep(req, 1, (0,), reps=1, warmup=0, generator=gen)


def test_fetches_leave_the_pool_as_they_found_it(holders):
    """Copies already kept stay (their offsets are skipped); each round's copies are evicted:
    the same chunks kept and the same free blocks after as before."""
    corpus, req = holders
    req.fetch(0, offset=101)  # kept where round 0 would splice chunk 0
    req.fetch(2)  # kept at its canonical position
    kept, free = dict(req.local_chunks), req.kept.pool.free_blocks
    n = len(req.costs)
    got = fetch_samples(req, [0, 2], rounds=2, warmup=1)
    assert len(req.costs) - n == 6 and {r.primitive for r in req.costs[n:]} == {"fetch"}
    assert all(isinstance(s, FetchSample) for s in got)
    # rounds 1 and 2 (round 0 warms up): chunk 0 at 100 + 1 + k, chunk 2 at 132 + 1 + k
    assert [(s.chunk_id, s.offset, s.tokens) for s in got] == [
        (0, 102, 16),
        (2, 134, 8),
        (0, 103, 16),
        (2, 135, 8),
    ]
    for s, rec in zip(got, req.costs[n + 2 :], strict=True):
        assert (s.bytes, s.total_us, s.return_us, s.splice_us) == (
            rec.bytes_recv,
            rec.total_us,
            rec.return_us,
            rec.splice_us,
        )
        assert s.pull_us == rec.total_us - rec.splice_us
        assert s.splice_us_per_token == rec.splice_us / s.tokens
    # the chunk's entries and a fixed part: 16 tokens against 8
    assert got[0].bytes - got[1].bytes == GEOM.chunk_bytes(16) - GEOM.chunk_bytes(8)
    assert dict(req.local_chunks) == kept and req.kept.pool.free_blocks == free
    # the pool write alone, at the canonical position: not where a copy is kept already
    home = fetch_samples(req, [0], rounds=1, moved=False)
    assert [(s.chunk_id, s.offset) for s in home] == [(0, 100)]
    assert dict(req.local_chunks) == kept and req.kept.pool.free_blocks == free
    with pytest.raises(ValueError, match="chunk_ids: expected chunks not kept .* got \\[2\\]"):
        fetch_samples(req, [0, 2], rounds=1, moved=False)
    with pytest.raises(ValueError, match="rounds: expected an int >= 1, got 0"):
        fetch_samples(req, [0], rounds=0)
    req.clear_local()


def test_merge_times_on_the_requesters_kernels():
    gen = torch.Generator().manual_seed(2)
    times = merge_times("torch", 3, GEOM, generator=gen, dtype=torch.bfloat16, device="cpu", reps=4)
    assert len(times) == 4 and all(t > 0 for t in times)
    # the partials are the generator's: o [3, 1, H, d_v] then lse [3, 1, H]
    ref = torch.Generator().manual_seed(2)
    torch.randn(3, 1, GEOM.heads, GEOM.d_v, generator=ref)
    torch.randn(3, 1, GEOM.heads, generator=ref)
    assert torch.equal(torch.randn(5, generator=gen), torch.randn(5, generator=ref))
    narrow = torch.Generator().manual_seed(2)
    merge_times(
        "torch", 3, GEOM, generator=narrow, dtype=torch.float32, device="cpu", reps=1, width=8
    )
    ref = torch.Generator().manual_seed(2)
    torch.randn(3, 1, GEOM.heads, 8, generator=ref)
    torch.randn(3, 1, GEOM.heads, generator=ref)
    assert torch.equal(torch.randn(5, generator=narrow), torch.randn(5, generator=ref))
    with pytest.raises(ValueError, match="partials: expected an int >= 1, got 0"):
        merge_times("torch", 0, GEOM, generator=gen, dtype=torch.float32, device="cpu", reps=1)
    with pytest.raises(ValueError, match="kernels: expected one of"):
        merge_times("cuda", 2, GEOM, generator=gen, dtype=torch.float32, device="cpu", reps=1)
