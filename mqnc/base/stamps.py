"""Per-stage timestamps of a call, for ``perf/bench_host --breakdown`` (where a routed call's
host time goes, stage by stage).

Off unless :func:`enable` is called (a benchmark's holder process does it when asked): a stamp
site costs one module-attribute test then. When on, :func:`stamp` appends
``(name, time.perf_counter_ns())``; on Linux that clock is ``CLOCK_MONOTONIC``, one clock for
every process of the machine, so a holder process's stamps line up with the requester's.

The sites (requester ``req.*``, holder ``hold.*``) are listed in :data:`STAGES` in call order.
"""

from __future__ import annotations

import time

__all__ = ["ON", "STAGES", "enable", "stamp", "take"]

ON = False
STAGES = (
    "req.start",
    "req.packed",
    "req.put",
    "hold.woke",
    "hold.parsed",
    "hold.computed",
    "hold.packed",
    "hold.put",
    "req.woke",
    "req.parsed",
    "req.done",
)
_buf: list[tuple[str, int]] = []


def enable(on: bool = True) -> None:
    """Start (or stop) recording; the record is kept until :func:`take`."""
    global ON
    ON = bool(on)


def stamp(name: str) -> None:
    """Record ``name`` now (call only under ``if stamps.ON``)."""
    _buf.append((name, time.perf_counter_ns()))


def take() -> list[tuple[str, int]]:
    """The stamps recorded so far (and forget them)."""
    out = list(_buf)
    _buf.clear()
    return out
