"""The speed targets the benchmarks check with ``--check`` (one table for all of them).

Each :class:`~mqnc.measure.targets.Target` bounds the p50 of the records it selects; GPU targets
select ``backend="triton"`` records only, so on a CPU they are reported as not measured and
neither pass nor fail. A bandwidth goal is the p50 bound its bytes give at that bandwidth
(:func:`at_tbps`): dense H 16 at B >= 16, c_t >= 32768 at >= 3.6 TB/s (75 % of the H200's
4.8 TB/s HBM spec). Every record with a byte count also carries its TB/s against the device's
kernel-measured read ceiling and the spec (``extra.pct_of_read``, ``extra.pct_of_spec``:
:func:`mqnc.measure.results_file.roofline`); no goal is stated against torch's ``copy_``.
"""

from __future__ import annotations

from mqnc.measure.targets import Target

D_QK, D_V = 576, 512
HEADS_16 = 16


def dense_bytes(B: int, H: int, ct: int, elt: int = 2) -> int:
    """The bytes a dense partial over ``B`` tokens x ``H`` heads x ``ct`` entries moves once, as
    ``perf.bench_mla`` counts them: the cache entries, the query rows, ``o`` and fp32 ``lse``."""
    return B * ct * D_QK * elt + B * H * D_QK * elt + B * H * (D_V * elt + 4)


def at_tbps(nbytes: int, tbps: float) -> float:
    """Microseconds that ``nbytes`` take at ``tbps`` TB/s (the p50 bound of a bandwidth goal)."""
    return nbytes / (tbps * 1e6)


TARGETS = [
    # the closed-form predicate on one CPU core (a decision per (chunk, request) must cost far
    # less than any primitive it chooses between)
    Target("predicate", 20.0, "scalar decide <= 20 us", variant="scalar"),
    Target("predicate", 0.2e6, "1000 x 1000 crossover grid <= 0.2 s", variant="grid", x=1_000_000),
    # the goals for the holder's partial attention on an H200 (§6.3)
    Target(
        "mla_fanin",
        15.0,
        "holder partial, N <= 16 requesters, H 16 <= 15 us",
        variant="H=16,*",
        x_max=16,
        backend="triton",
    ),
    Target(
        "mla_fanin",
        30.0,
        "holder partial, N <= 16 requesters, H 128 <= 30 us",
        variant="H=128,*",
        x_max=16,
        backend="triton",
    ),
    Target(
        "mla_sparse",
        30.0,
        "sparse top-2048 partial, H 128 <= 30 us",
        variant="H=128,corpus=*",
        x=2048,
        backend="triton",
    ),
    # §7: the one-launch splice of 27 layers x 2048 tokens (paper: ~3 ms per layer-launch loop)
    Target(
        "splice",
        60.0,
        "splice 27 layers x 2048 tokens <= 60 us",
        variant="one-launch",
        x=2048,
        backend="triton",
        extra={"layers": 27, "delta": "per-token"},
    ),
    # The production goal shapes, as the benchmarks' --goals sweeps record them (extra.shape is the
    # shape's label in mqnc.triton_kernels._variants.GOALS, where the kernels branch keeps them).
    Target(
        "mla_decode",
        15.0,
        "goal: holder partial (H 16, B 1, ct 2048) <= 15 us",
        backend="triton",
        extra={"shape": "mla_decode H=16 B=1 ct=2048"},
    ),
    Target(
        "mla_sparse",
        30.0,
        "goal: sparse top-2048 (H 128, B 1) <= 30 us",
        backend="triton",
        extra={"shape": "mla_sparse H=128 B=1 topk=2048"},
    ),
    Target(
        "merge",
        8.0,
        "goal: 8-way merge of 256 rows <= 8 us",
        backend="triton",
        extra={"shape": "merge M=8 rows=256"},
    ),
    Target(
        "splice",
        60.0,
        "goal: splice 27 layers x 2048 tokens, one delta <= 60 us",
        variant="one-launch",
        backend="triton",
        extra={"shape": "splice L=27 ct=2048 delta=int"},
    ),
]
# The host path (the package's software around a route) against the machine's floors, as
# same-run ratios (perf/bench_host.py, bench="host_ratio", unit "ratio"; its variant names the
# ratio). On a GPU the same records give absolute microseconds beside them (bench="host").
TARGETS += [
    Target("host_ratio", limit, f"host path: {what} <= {limit:g}", variant=variant)
    for variant, what, limit in (
        ("loopback: Requester.probe / cond", "loopback probe / Condition round trip", 3.0),
        ("gloo: Requester.probe / gloo_1B", "gloo probe / bare gloo round trip", 2.0),
        ("loopback: route M_q 1 (stub) / probe", "loopback route M_q 1 / probe", 1.5),
        ("gloo: route M_q 1 (stub) / probe", "gloo route M_q 1 / probe", 1.5),
        (
            "loopback: route M_q 256 (stub) / (2 probe + bytes at floor BW)",
            "loopback route M_q 256 / (2 probe + bytes at the floor's BW)",
            1.0,
        ),
        (
            "gloo: route M_q 256 (stub) / (2 probe + bytes at floor BW)",
            "gloo route M_q 256 / (2 probe + bytes at the floor's BW)",
            1.0,
        ),
    )
]

# The memory roofline and the microsecond (the H200 goals of the roofline work, docs/roofline.md),
# tighter than the goal shapes' own goals (``_variants.GOALS``) where both bound one shape:
ROOFLINE_TARGETS = [
    Target(
        "mla_decode",
        9.0,
        "holder partial (H 16, B 1, ct 2048), decode and combine <= 9 us (stretch 7)",
        backend="triton",
        extra={"shape": "mla_decode H=16 B=1 ct=2048"},
    ),
    Target(
        "splice",
        35.0,
        "splice 27 layers x 2048 tokens <= 35 us (>= 3.6 TB/s)",
        variant="one-launch",
        backend="triton",
        extra={"shape": "splice L=27 ct=2048 delta=int"},
    ),
    *(
        Target(
            "mla_decode",
            at_tbps(dense_bytes(B, HEADS_16, ct), 3.6),
            f"dense H 16 B {B} ct {ct} >= 3.6 TB/s (75% of the HBM3e spec)",
            backend="triton",
            extra={"shape": f"mla_decode H=16 B={B} ct={ct}"},
        )
        for B in (16, 32, 64, 128)
        for ct in (32768, 65536)
    ),
    Target(
        "host_launch",
        20.0,
        "one eager call of mla_decode_partial: <= 20 us of host time",
        variant="eager H=16,*",
        backend="triton",
    ),
    Target(
        "host_launch",
        20.0,
        "one plan.run: <= 20 us of host time",
        variant="plan.run H=16,*",
        backend="triton",
    ),
]
TARGETS += ROOFLINE_TARGETS
