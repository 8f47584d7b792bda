"""The command-line options the transport benchmarks (``perf/``) and ``mqnc calibrate`` share
(torch-free: ``mqnc --help`` reads them)."""

from __future__ import annotations

import argparse

__all__ = ["TRANSPORTS", "add_transport_args", "transports_of", "ints_of"]

TRANSPORTS = ("loopback", "gloo", "nvshmem")
"""Transport engines by name (the echo fabric runs loopback and gloo; nvshmem on a GPU)."""


def add_transport_args(ap: argparse.ArgumentParser, *, default_reps: int = 20) -> None:
    """``--transport``, ``--quick``, ``--reps``, ``--warmup``, ``--model``, ``--out``."""
    ap.add_argument(
        "--transport",
        default="loopback",
        help=f"comma-separated engines out of {', '.join(TRANSPORTS)} (default loopback)",
    )
    ap.add_argument("--quick", action="store_true", help="a small sweep (CPU smoke run)")
    ap.add_argument("--reps", type=int, default=default_reps, help="timed repetitions per point")
    ap.add_argument("--warmup", type=int, default=3, help="untimed repetitions first")
    ap.add_argument("--model", default="deepseek-v2-lite", help="geometry preset (row sizes)")
    ap.add_argument("--out", default=None, help="results file (default $MQNC_RESULTS or perf/)")


def transports_of(arg: str) -> list[str]:
    """Parse ``--transport`` (comma-separated); unknown names are a ValueError naming them."""
    names = [t.strip() for t in arg.split(",") if t.strip()]
    bad = [t for t in names if t not in TRANSPORTS]
    if not names or bad:
        raise ValueError(f"--transport: expected names out of {TRANSPORTS}, got {arg!r}")
    return names


def ints_of(arg: str, name: str) -> list[int]:
    """Parse a comma-separated list of positive ints (``--m-q 1,4,16``)."""
    try:
        vals = [int(v) for v in arg.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated ints, got {arg!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{name}: expected positive ints, got {arg!r}")
    return vals
