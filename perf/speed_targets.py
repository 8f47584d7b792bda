"""The speed targets the benchmarks check with ``--check`` (one table for all of them).

Each :class:`~mqnc.measure.targets.Target` bounds the p50 of the records it selects; GPU targets
select ``backend="triton"`` records only, so on a CPU they are reported as not measured and
neither pass nor fail. Not expressible as one record's bound, and so not here: dense decode at
>= 80% of the copy ceiling (it needs the ``copy`` record of the same device).
"""

from __future__ import annotations

from mqnc.measure.targets import Target

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
