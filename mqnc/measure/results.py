"""The one long-format results file every benchmark appends to and every figure reads.

Each record is one JSON line::

    {"bench", "variant", "x", "x_name", "p20", "p50", "p80", "unit", "bytes", "gbps",
     "device", "transport", "backend", "version", "commit", "date", "extra"}

``x`` is the swept quantity (M_q, c_t, N, ...), ``p20/p50/p80`` the percentiles of the timed
repetitions (:mod:`mqnc.measure.timing`), ``bytes`` the bytes the op moves once (for achieved
GB/s), ``device`` the device name (``torch.cuda.get_device_name`` or the CPU model),
``backend`` what ran (``triton``, ``torch-reference``, ``interpreter``). Plots and ``mqnc fit``
read this file, never typed numbers.

Where the file is (:func:`results_path`): the path given, else ``$MQNC_RESULTS``, else
``perf/results/results.jsonl`` in the nearest folder at or above the working directory that has
one (the repository root when a benchmark runs as ``python -m perf.bench_x`` there, or a
notebook runs in ``notebooks/``).

torch-free at import (the device name is asked for when a record is written), so the figures
read records without loading torch.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from pathlib import Path

from mqnc import __version__
from mqnc.base.env import commit, results_file
from mqnc.base.runtime import device_name
from mqnc.cost.fitting import read_jsonl

__all__ = ["results_path", "git_commit", "record", "read_results"]


def results_path(path: str | os.PathLike | None = None) -> Path:
    """The results file: ``path``, else ``$MQNC_RESULTS``, else ``perf/results/results.jsonl``
    in the nearest folder at or above the working directory that has one, else that path
    relative to the working directory."""
    if path is None:
        path = results_file()
    if path is not None:
        return Path(path)
    rel = Path("perf") / "results" / "results.jsonl"
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / rel).exists():
            return folder / rel
    return here / rel


def read_results(path: str | os.PathLike | None = None) -> list[dict]:
    """Every record of the results file (``[]`` when it does not exist).

    A line that is not JSON is an error naming the file and line.
    """
    p = results_path(path)
    return read_jsonl(p) if p.exists() else []


def git_commit() -> str:
    """The commit a record carries: ``$MQNC_COMMIT`` when set (a copy without ``.git``, e.g.
    the lent GPU machine's: ``perf/gpu_check.sh`` sets it), else the short commit of the checkout
    holding this package, else ``"unknown"``."""
    given = commit()
    if given:
        return given
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
    """Append one record to the results file (:func:`results_path`)."""
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
    out = results_path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec
