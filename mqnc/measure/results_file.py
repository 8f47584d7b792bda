"""The one long-format results file every benchmark appends to and every figure reads.

Each record is one JSON line::

    {"bench", "variant", "x", "x_name", "p20", "p50", "p80", "unit", "bytes", "gbps",
     "device", "transport", "backend", "version", "commit", "date", "extra"}

``x`` is the swept quantity (M_q, c_t, N, ...), ``p20/p50/p80`` the percentiles of the timed
repetitions (:mod:`mqnc.measure.timing`), ``bytes`` the bytes the op moves once (for achieved
GB/s), ``device`` the device name (``torch.cuda.get_device_name`` or the CPU model),
``backend`` what ran (``triton``, ``torch-reference``, ``interpreter``). Plots and ``mqnc fit``
read this file, never typed numbers.

Two files, found from the repository root (the nearest folder at or above the working
directory that has ``perf/results/results.jsonl``: the root when a benchmark runs as
``python -m perf.bench_x`` there, or a notebook runs in ``notebooks/``):

- ``perf/results/results.jsonl``, tracked: the records the README's and docs/results.md's
  tables and the notebooks read (:func:`results_path`: the path given, else
  ``$MQNC_RESULTS``, else this file);
- ``perf/results/local.jsonl``, git-ignored: where records go by default
  (:func:`output_path`: the path given, else the tracked file when asked to ``record``, else
  ``$MQNC_RESULTS``, else this file), so that running a benchmark never changes the repository.

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
from mqnc.cost.results_reader import check_record, read_jsonl

__all__ = [
    "REPO_RESULTS",
    "LOCAL_RESULTS",
    "results_path",
    "output_path",
    "git_commit",
    "record",
    "roofline",
    "read_results",
    "read_new",
]

REPO_RESULTS = Path("perf") / "results" / "results.jsonl"
"""The tracked results file, relative to the repository root."""
LOCAL_RESULTS = Path("perf") / "results" / "local.jsonl"
"""The git-ignored default output of the benchmarks, relative to the repository root."""


def _repository() -> Path | None:
    """The nearest folder at or above the working directory that has :data:`REPO_RESULTS`."""
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / REPO_RESULTS).exists():
            return folder
    return None


def results_path(path: str | os.PathLike | None = None) -> Path:
    """The results file to read: ``path``, else ``$MQNC_RESULTS``, else the repository's
    tracked ``perf/results/results.jsonl``, else that path relative to the working directory."""
    if path is None:
        path = results_file()
    if path is not None:
        return Path(path)
    return (_repository() or Path.cwd().resolve()) / REPO_RESULTS


def output_path(path: str | os.PathLike | None = None, *, record: bool = False) -> Path:
    """The results file to append to: ``path``; else with ``record`` the repository's tracked
    ``perf/results/results.jsonl`` (a ValueError outside a checkout); else ``$MQNC_RESULTS``;
    else the git-ignored ``perf/results/local.jsonl`` beside it (under the working directory
    outside a checkout)."""
    if path is not None:
        if record:
            raise ValueError("--out and --record: expected at most one of them")
        return Path(path)
    root = _repository()
    if record:
        if root is None:
            raise ValueError(
                f"--record: no {REPO_RESULTS} at or above {Path.cwd()}; run from the repository "
                "or pass --out FILE"
            )
        return root / REPO_RESULTS
    env = results_file()
    if env is not None:
        return Path(env)
    return (root or Path.cwd().resolve()) / LOCAL_RESULTS


def read_results(path: str | os.PathLike | None = None) -> list[dict]:
    """Every record of the results file (``[]`` when it does not exist).

    A line that is not JSON is an error naming the file and line.
    """
    p = results_path(path)
    return read_jsonl(p) if p.exists() else []


def git_commit() -> str:
    """The commit a record carries: ``$MQNC_COMMIT`` when set (a copy without ``.git``, e.g.
    a GPU machine's copy: ``perf/gpu_check.sh`` sets it), else the short commit of the checkout
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


def read_new(path: str | os.PathLike, skip_lines: int) -> list[dict]:
    """The records of ``path`` after its first ``skip_lines`` lines (what one run appended);
    ``[]`` when the file does not exist. Each line is checked as :func:`read_jsonl` checks
    them (a ``ValueError`` naming the file, the line and the key)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for i, line in enumerate(p.read_text().splitlines()[skip_lines:], skip_lines + 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"results: {p} line {i} is not JSON ({exc})") from None
            out.append(check_record(rec, f"{p} line {i}"))
    return out


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
    """Append one record to ``path`` (default :func:`output_path`: ``$MQNC_RESULTS`` or the
    git-ignored ``perf/results/local.jsonl``)."""
    p20, p50, p80 = percentiles
    gbps = None
    if nbytes is not None and unit == "us" and p50 > 0:
        gbps = nbytes / (p50 * 1e-6) / 1e9
    out = output_path(path)
    extra = dict(extra or {})
    if gbps is not None:
        for k, v in roofline(gbps, device_name(), out).items():
            extra.setdefault(k, v)
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
        extra=extra,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def roofline(gbps: float, device: str, path: str | os.PathLike | None) -> dict:
    """A record's bandwidth against its device's ceilings (:mod:`mqnc.cost.ceilings`):
    ``tbps``, ``pct_of_read`` (the Triton read kernel's median in the records of ``path``: the
    GPU check's copy step writes them first into the file every later step appends to; None
    where none was measured), ``pct_of_spec`` (the HBM spec; None for a device without one) and
    ``read_tbps`` / ``spec_tbps``, both rounded to 0.1 %. What ``record`` adds to the ``extra``
    of every record with a byte count (a benchmark's own values of these keys win)."""
    from mqnc.cost.ceilings import memory_ceiling

    ceiling = memory_ceiling(_ceiling_records(path), device)
    pct = ceiling.percents(gbps / 1e3)
    return dict(
        tbps=gbps / 1e3,
        read_tbps=ceiling.read_tbps,
        pct_of_read=None if pct["pct_of_read"] is None else round(pct["pct_of_read"], 1),
        spec_tbps=ceiling.spec_tbps,
        pct_of_spec=None if pct["pct_of_spec"] is None else round(pct["pct_of_spec"], 1),
    )


def _ceiling_records(path) -> list[dict]:
    """The ``ceiling`` records of the results file ``path`` (none when it does not exist), read
    incrementally: a benchmark appends hundreds of records, each reads only what was appended
    since the last (the whole file again when it shrank)."""
    if path is None or not os.path.exists(path):
        return []
    name, size = os.fspath(path), os.path.getsize(path)
    done, recs = _CEILINGS.get(name, (0, []))
    if size < done:
        done, recs = 0, []
    if size > done:
        recs = list(recs)
        with open(path, "rb") as f:
            f.seek(done)
            chunk = f.read(size - done)
        whole = chunk.rfind(b"\n") + 1  # (a line still being written is read next time)
        size = done + whole
        if whole:
            for line in chunk[:whole].decode("utf-8", "replace").splitlines():
                if '"ceiling"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and rec.get("bench") == "ceiling":
                    recs.append(rec)
        _CEILINGS[name] = (size, recs)
    return recs


_CEILINGS: dict[str, tuple[int, list]] = {}
