"""The speed targets the benchmarks check with ``--check`` (one table for all of them).

Each :class:`~mqnc.measure.targets.Target` bounds the p50 of the records it selects; GPU targets
select ``backend="triton"`` records only, so on a CPU they are reported as not measured and
neither pass nor fail. Not expressible as one record's bound, and so not here: dense decode at
>= 80% of the copy ceiling (it needs the ``copy`` record of the same device).
"""

from __future__ import annotations

from mqnc.measure.targets import Target

TARGETS = [
    # issue 5: the closed-form predicate on one CPU core
    Target("predicate", 20.0, "scalar decide <= 20 us", variant="scalar"),
    Target("predicate", 0.2e6, "1000 x 1000 crossover grid <= 0.2 s", variant="grid", x=1_000_000),
    # issue targets for the holder's partial attention on an H200 (§6.3)
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
        variant="H=128,*",
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
        extra={"layers": 27},
    ),
]
