"""The speed targets the benchmarks check with ``--check`` (one table for all of them).

Each :class:`~mqnc.measure.targets.Target` bounds the p50 of the records it selects; GPU targets
select ``backend="triton"`` records only, so on a CPU they are reported as not measured and
neither pass nor fail. A bandwidth goal is the p50 bound its bytes give at that bandwidth
(:func:`at_tbps`): dense H 16 at B >= 16, c_t >= 32768 at >= 3.6 TB/s (75 % of the H200's
4.8 TB/s HBM spec). Every record with a byte count also carries its TB/s against the device's
kernel-measured read ceiling and the spec (``extra.pct_of_read``, ``extra.pct_of_spec``:
:func:`mqnc.measure.results_file.roofline`); no goal is stated against torch's ``copy_``.

Every :class:`~mqnc.measure.targets.Target` holds bf16 records only (``kv_dtype``); the FP8
cache's goals (:data:`FP8_TARGETS`) are :class:`~mqnc.measure.targets.Speedup` s: an FP8 record
against its bf16 twin at the same shape in the same records (``perf.bench_mla --kv-dtype both``
measures both).

``python -m perf.speed_targets RESULTS.jsonl`` prints every target against the records of a
results file (what ``perf/gpu_check.sh`` prints last, for the whole run).
"""

from __future__ import annotations

import argparse
import os

from mqnc.measure.targets import Speedup, Target, check_targets
from mqnc.model.kv_format import kv_bytes_per_token

D_QK, D_V = 576, 512
HEADS_16 = 16
FP8_ENTRY = kv_bytes_per_token("fp8_e4m3", D_V, D_QK - D_V)  # 656 B, DeepSeek-V3.2's entry


def dense_bytes(B: int, H: int, ct: int, elt: int = 2, entry: int | None = None) -> int:
    """The bytes a dense partial over ``B`` tokens x ``H`` heads x ``ct`` entries moves once, as
    ``perf.bench_mla`` counts them: the cache entries (``entry`` bytes each, default ``576 x
    elt``; :data:`FP8_ENTRY` for the FP8 cache), the query rows, ``o`` and fp32 ``lse``."""
    entry = D_QK * elt if entry is None else entry
    return B * ct * entry + B * H * D_QK * elt + B * H * (D_V * elt + 4)


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
    # shape's label in mqnc.triton_kernels.sm90.variants.GOALS, where the kernels branch keeps
    # them).
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
# tighter than the goal shapes' own goals (``sm90.variants.GOALS``) where both bound one shape:
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

# The FP8 cache's goals on an H200 (DeepSeek-V3.2's 656-byte entry, docs/fp8-cache.md): FP8
# records (``extra.kv_dtype`` "fp8") against their bf16 twins at the same shape, both timed by
# ``perf.bench_mla --kv-dtype both`` (the GPU check: ``--goals`` at the two shapes below).
FP8_TARGETS = [
    # memory-bound dense decode: 656 B per token instead of 1152 is at most 1.76x; the goal
    # leaves 10% of that to the dequantization and the unchanged query and output bytes
    Speedup(
        "mla_decode",
        1.6,
        "FP8 dense decode (H 16, B >= 16, c_t >= 32768): >= 1.6x the bf16 cache tokens/s",
        x_min=32768,
        backend="triton",
        extra={"H": 16},
        extra_min={"B": 16},
    ),
    # sparse top-2048 at H 128 is bound by its MMAs more than by its bytes: no slower
    Speedup(
        "mla_sparse",
        1.0,
        "FP8 sparse top-2048 (H 128, B 8): no slower than bf16",
        x=2048,
        backend="triton",
        extra={"H": 128, "B": 8},
    ),
]
TARGETS += FP8_TARGETS


def at_tflops(B: int, H: int, ct: int, tflops: float) -> float:
    """Microseconds that a dense partial's ``2 B H c_t (576 + 512)`` flops take at ``tflops``."""
    return 2 * B * H * ct * (D_QK + D_V) / (tflops * 1e6)


def _fast(H: int, B: int, ct: int, limit: float, what: str) -> Target:
    return Target("fastpath", limit, what, variant=f"H={H},B={B}", x=ct, backend="triton")


def _loop(case: str, limit: float, what: str) -> Target:
    return Target("host_loop", limit, what, variant=f"{case} *", backend="triton")


# The default path on an H200 (perf.bench_fastpath: the dispatch table's choice, each case
# checked against fp64 first, CUDA-graph timed over inputs larger than twice the L2; the host
# loop of a user's 200 back-to-back calls). FlashMLA reports 660 TFLOP/s on an H800, whose
# tensor cores are the H200's.
FASTPATH_TARGETS = [
    _fast(128, 64, 8192, at_tflops(64, 128, 8192, 600), "H 128 B 64 c_t 8192 >= 600 TFLOP/s"),
    _fast(128, 8, 32768, at_tflops(8, 128, 32768, 540), "H 128 B 8 c_t 32768 >= 540 TFLOP/s"),
    _fast(128, 128, 4096, at_tflops(128, 128, 4096, 580), "H 128 B 128 c_t 4096 >= 580 TFLOP/s"),
    _fast(64, 32, 8192, at_tflops(32, 64, 8192, 420), "H 64 B 32 c_t 8192 >= 420 TFLOP/s"),
    _fast(
        16, 16, 32768, at_tbps(dense_bytes(16, 16, 32768), 4.2), "H 16 B 16 c_t 32768 >= 4.2 TB/s"
    ),
    _fast(
        16, 64, 32768, at_tbps(dense_bytes(64, 16, 32768), 4.2), "H 16 B 64 c_t 32768 >= 4.2 TB/s"
    ),
    _fast(16, 1, 2048, 8.0, "H 16 B 1 c_t 2048 decode + combine <= 8 us"),
    _loop("mla_decode_with_kvcache checks=off", 30.0, "FlashMLA's call, eager, <= 30 us of host"),
    _loop("mla_decode_partial checks=off", 30.0, "mla_decode_partial, eager, <= 30 us of host"),
    _loop("plan.run", 10.0, "plan.run <= 10 us of host"),
    _loop("mla_decode_with_kvcache checks=on", 60.0, "checks on <= 2 x the 30 us goal"),
    _loop("mla_decode_partial checks=on", 60.0, "checks on <= 2 x the 30 us goal"),
]


def _sparse(B: int, limit: float, what: str) -> Target:
    return Target(
        "fastpath_sparse", limit, what, variant=f"H=128,B={B}@gluon", x=2048, backend="triton"
    )


# DeepSeek-V3.2's sparse top-2048 decode on the gather see-saw (opt-in until its records verify
# it, then the default: the goals are the default path's). FlashMLA's sparse FP8 decode: 410
# TFLOP/s on an H800.
SPARSE_TARGETS = [
    _sparse(1, 12.0, "sparse top-2048 H 128 B 1 <= 12 us"),
    _sparse(8, 20.0, "sparse top-2048 H 128 B 8 <= 20 us"),
    _sparse(64, at_tflops(64, 128, 2048, 350), "sparse top-2048 H 128 B 64 >= 350 TFLOP/s"),
]
FASTPATH_TARGETS += SPARSE_TARGETS


def _fp8(kind: str, H: int, B: int, n: int) -> dict:
    return dict(variant=f"{kind} H={H},B={B}@gluon", x=n, backend="triton", extra={"kind": kind})


# DeepSeek-V3.2's FP8 cache on the fast path (perf.bench_fastpath's fp8 stage: the FP8 see-saw
# forced until its records verify it, then the default; its bf16 twin is the same values
# dequantized, by the table's choice, in the same run).
FP8_FASTPATH_TARGETS = [
    Speedup(
        "fastpath_fp8",
        1.3,
        "FP8 sparse top-2048 H 128 B 8: >= 1.3x its bf16 twin",
        match=("H", "B", "kind"),
        **_fp8("sparse", 128, 8, 2048),
    ),  # fmt: skip
    Target(
        "fastpath_fp8",
        at_tflops(64, 128, 2048, 400),
        "FP8 sparse top-2048 H 128 B 64 >= 400 TFLOP/s",
        **_fp8("sparse", 128, 64, 2048),
    ),
    Speedup(
        "fastpath_fp8",
        1.6,
        "FP8 dense H 16 B 16 c_t 32768: >= 1.6x its bf16 twin's tokens/s",
        match=("H", "B", "kind"),
        **_fp8("dense", 16, 16, 32768),
    ),  # fmt: skip
    Target(
        "fastpath_fp8",
        at_tflops(64, 128, 8192, 550),
        "FP8 dense H 128 B 64 c_t 8192 >= 550 TFLOP/s",
        **_fp8("dense", 128, 64, 8192),
    ),
]
FASTPATH_TARGETS += FP8_FASTPATH_TARGETS
TARGETS += FASTPATH_TARGETS


def main(argv=None) -> int:
    """Print every target against the records of a results file; exit status 1 with
    ``--check`` when one is missed."""
    from mqnc.measure.results_file import read_results

    ap = argparse.ArgumentParser(description="every speed target against a results file")
    ap.add_argument("results", help="a results JSON-lines file (perf/gpu_check.sh's)")
    ap.add_argument("--check", action="store_true", help="exit status 1 when a target is missed")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.results):
        ap.error(f"results: expected a results file, got {args.results!r} (no such file)")
    recs = read_results(args.results)
    v = check_targets(recs, TARGETS)
    print(f"targets against {len(recs)} records of {args.results}:")
    for line in v.lines:
        print(line)
    print(f"{v.checked} checked, {v.missed} missed")
    return 1 if (args.check and v.missed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
