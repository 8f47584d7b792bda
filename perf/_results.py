"""The one long-format results file every benchmark appends to, and the timing helpers.

Each record is one JSON line::

    {"bench", "variant", "x", "x_name", "p20", "p50", "p80", "unit", "bytes", "gbps",
     "device", "transport", "backend", "version", "commit", "date", "extra"}

``x`` is the swept quantity (M_q, c_t, N, ...), ``p20/p50/p80`` the percentiles of the timed
repetitions, ``bytes`` the bytes the op moves once (for achieved GB/s), ``device`` the device
name (``torch.cuda.get_device_name`` or the CPU model), ``backend`` what ran (``triton``,
``torch-reference``, ``interpreter``). Plots and ``mqnc fit`` read this file, never typed numbers.

Timing: CUDA events through ``triton.testing.do_bench``-style repetition on a GPU, and
``time.perf_counter_ns`` on the CPU, warm-up first.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mqnc import __version__
from mqnc.runtime import device_name

__all__ = ["DEFAULT_RESULTS", "device_name", "git_commit", "time_fn", "record", "read_results"]

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "results.jsonl"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def time_fn(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    reps: int = 20,
    min_time_s: float = 0.0,
    cuda: bool | None = None,
):
    """Time ``fn`` and return (p20, p50, p80) in microseconds.

    With ``cuda`` (default: whether a CUDA device exists) each repetition is bracketed by CUDA
    events; otherwise by ``time.perf_counter_ns`` (pass ``cuda=False`` for host-only work on a
    GPU machine). ``reps`` repetitions after ``warmup`` untimed ones (at least ``min_time_s`` of
    timed work when given).
    """
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    samples: list[float] = []
    start_all = time.perf_counter()
    while len(samples) < reps or time.perf_counter() - start_all < min_time_s:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - t0) / 1e3)
    p20, p50, p80 = np.percentile(np.asarray(samples), [20, 50, 80])
    return float(p20), float(p50), float(p80)


def record(
    bench: str,
    variant: str,
    x: float,
    percentiles: tuple[float, float, float],
    *,
    x_name: str = "x",
    unit: str = "us",
    nbytes: int | None = None,
    transport: str | None = None,
    backend: str = "torch-reference",
    extra: dict | None = None,
    path: str | os.PathLike | None = None,
) -> dict:
    """Append one record to the results file (default ``perf/results/results.jsonl``)."""
    p20, p50, p80 = percentiles
    gbps = None
    if nbytes is not None and unit == "us" and p50 > 0:
        gbps = nbytes / (p50 * 1e-6) / 1e9
    rec = dict(
        bench=bench,
        variant=variant,
        x=x,
        x_name=x_name,
        p20=p20,
        p50=p50,
        p80=p80,
        unit=unit,
        bytes=nbytes,
        gbps=gbps,
        device=device_name(),
        transport=transport,
        backend=backend,
        version=__version__,
        commit=git_commit(),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        extra=extra or {},
    )
    out = Path(path or os.environ.get("MQNC_RESULTS") or DEFAULT_RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def read_results(path: str | os.PathLike | None = None) -> list[dict]:
    """All records of a results file."""
    from mqnc.costmodel import read_jsonl

    p = Path(path or os.environ.get("MQNC_RESULTS") or DEFAULT_RESULTS)
    return read_jsonl(p) if p.exists() else []
