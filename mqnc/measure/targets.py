"""Speed targets as data, checked against the records a benchmark run wrote (``--check``).

A :class:`Target` selects records (bench, a glob of the variant, an exact ``x`` or an upper
bound on it, the backend, fields of ``extra``, the cache format) and bounds one statistic
(``p50`` by default) from above. A :class:`Speedup` holds a record of one cache format against
its twin of another (same bench, ``x``, device, backend and shape fields) measured in the same
records: the twin's p50 over the record's must reach a ratio (the FP8 cache's goals: its cache
tokens per second over the bf16 path's at the same shape). :func:`check_targets` applies every
target to the records of one run: each selected record passes or misses; a target that selects
no record (a GPU target on a CPU run, or a sweep not run) is reported as not measured and
neither passes nor fails.

A record's cache format is ``extra.kv_dtype`` (``"bf16"``, ``"fp8"``); a record without it is
bf16 (every record before the FP8 cache, and every bench that has no cache). The targets
themselves (the project's goal numbers) are in ``perf/speed_targets.py``; torch-free.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Target", "Speedup", "Verdicts", "check_targets", "kv_dtype"]


def kv_dtype(rec: Mapping[str, Any]) -> str:
    """The cache format a record measured: ``extra.kv_dtype``, ``"bf16"`` when absent."""
    return str((rec.get("extra") or {}).get("kv_dtype", "bf16"))


def _selects(t, rec: Mapping[str, Any]) -> bool:
    """The selection a :class:`Target` and a :class:`Speedup` share: bench, variant glob,
    ``x`` / ``x_max`` / ``x_min``, backend, ``extra`` values and minimums, cache format."""
    if rec.get("bench") != t.bench or kv_dtype(rec) != t.kv_dtype:
        return False
    if not fnmatch.fnmatchcase(str(rec.get("variant")), t.variant):
        return False
    x = rec.get("x")
    if t.x is not None and x != t.x:
        return False
    if t.x_max is not None and (x is None or x > t.x_max):
        return False
    if t.x_min is not None and (x is None or x < t.x_min):
        return False
    if t.backend is not None and rec.get("backend") != t.backend:
        return False
    extra = rec.get("extra") or {}
    if not all(extra.get(k) == v for k, v in t.extra.items()):
        return False
    return all(
        isinstance(extra.get(k), (int, float)) and extra[k] >= v for k, v in t.extra_min.items()
    )


@dataclasses.dataclass(frozen=True)
class Target:
    """An upper bound on ``stat`` of the records it selects.

    Parameters
    ----------
    bench : str
        The records' ``bench``.
    limit : float
        Largest allowed value of ``stat``, in the record's unit (us).
    what : str
        The target in words (where it comes from).
    variant : str
        A glob of the records' ``variant`` (``"H=128,*"``); ``"*"`` selects all.
    x, x_max, x_min : float or None
        Select records whose ``x`` equals ``x`` / is at most ``x_max`` / at least ``x_min``.
    backend : str or None
        Select records of this ``backend`` only (``"triton"``: compiled kernels on a GPU).
    extra : mapping
        Select records whose ``extra`` has these values.
    extra_min : mapping
        Select records whose ``extra`` has numbers at least these (``{"B": 16}``).
    kv_dtype : str
        Select records of this cache format (``extra.kv_dtype``, bf16 when absent): every goal
        set against the bf16 cache holds bf16 records only.
    stat : str
        The bounded statistic (``"p50"``).
    """

    bench: str
    limit: float
    what: str
    variant: str = "*"
    x: float | None = None
    x_max: float | None = None
    backend: str | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    stat: str = "p50"
    x_min: float | None = None
    extra_min: Mapping[str, float] = dataclasses.field(default_factory=dict)
    kv_dtype: str = "bf16"

    def selects(self, rec: Mapping[str, Any]) -> bool:
        """Whether ``rec`` is one this target bounds."""
        return _selects(self, rec)

    def verdicts(self, records: Sequence[Mapping[str, Any]]) -> list[tuple[str, bool | None]]:
        """``(line, met)`` per selected record (``met`` None: not measured, one line)."""
        hits = [r for r in records if self.selects(r)]
        if not hits:
            return [(f"target {self.what}: not measured in this run", None)]
        out = []
        for r in hits:
            value = float(r[self.stat])
            out.append(
                _verdict(
                    f"target {self.what}: {r['bench']} {r['variant']} x={r['x']:g} {self.stat} "
                    f"{value:.4g} {r.get('unit', 'us')} (limit {self.limit:g})",
                    value <= self.limit,
                )
            )
        return out


@dataclasses.dataclass(frozen=True)
class Speedup:
    """A lower bound on how much faster the records it selects (cache format ``kv_dtype``) are
    than their twins of cache format ``baseline``: ``twin.p50 / record.p50 >= ratio``.

    Both calls attend the same cache tokens, so the ratio of p50s is the ratio of cache tokens
    per second (FP8 over bf16: ``ratio`` 1.6 is "1.6x the tokens per second", 1.0 "no
    slower"). A record's twin is a record of the baseline format with the same ``bench``,
    ``x``, ``device`` and ``backend`` and the same values of the ``extra`` fields in ``match``
    (the last such record, as the kernel report joins); a selected record without one is
    reported as not measured, neither met nor missed, and one whose ``extra.ok`` is False (its
    output failed the benchmark's check against fp64) is missed whatever its speed.

    Parameters
    ----------
    bench, what, variant, x, x_max, x_min, backend, extra, extra_min
        As :class:`Target` (the selection of the records held to the ratio).
    ratio : float
        Least allowed ``twin.p50 / record.p50``.
    kv_dtype : str
        The cache format of the records held to the ratio (``"fp8"``).
    baseline : str
        The cache format of their twins (``"bf16"``).
    match : tuple of str
        The ``extra`` fields a twin must share (head count, batch, corpus, page, tile).
    """

    bench: str
    ratio: float
    what: str
    variant: str = "*"
    x: float | None = None
    x_max: float | None = None
    x_min: float | None = None
    backend: str | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    extra_min: Mapping[str, float] = dataclasses.field(default_factory=dict)
    kv_dtype: str = "fp8"
    baseline: str = "bf16"
    match: tuple[str, ...] = ("H", "B", "corpus", "page", "tile")

    def selects(self, rec: Mapping[str, Any]) -> bool:
        """Whether ``rec`` is one this target holds to the ratio."""
        return _selects(self, rec)

    def twin(self, rec: Mapping[str, Any], records: Sequence[Mapping[str, Any]]):
        """The last record of the baseline format measuring what ``rec`` measures, or None."""
        extra = rec.get("extra") or {}
        found = None
        for r in records:
            e = r.get("extra") or {}
            if (
                kv_dtype(r) == self.baseline
                and all(r.get(k) == rec.get(k) for k in ("bench", "x", "device", "backend"))
                and all(e.get(k) == extra.get(k) for k in self.match)
            ):
                found = r
        return found

    def verdicts(self, records: Sequence[Mapping[str, Any]]) -> list[tuple[str, bool | None]]:
        """``(line, met)`` per selected record (``met`` None: not measured)."""
        hits = [r for r in records if self.selects(r)]
        if not hits:
            return [(f"target {self.what}: not measured in this run", None)]
        out = []
        for r in hits:
            head = f"target {self.what}: {r['bench']} {r['variant']} x={r['x']:g}"
            if (r.get("extra") or {}).get("ok") is False:  # a wrong output's speed counts not
                out.append((f"{head}: its output failed its fp64 check (extra.ok) MISSED", False))
                continue
            base = self.twin(r, records)
            if base is None:
                out.append((f"{head}: not measured (no {self.baseline} twin in this run)", None))
                continue
            got = float(base["p50"]) / float(r["p50"])
            out.append(
                _verdict(
                    f"{head} {self.kv_dtype} p50 {float(r['p50']):.4g} us, {self.baseline} "
                    f"{float(base['p50']):.4g} us: {got:.3g}x (at least {self.ratio:g}x)",
                    got >= self.ratio,
                )
            )
        return out


def _verdict(text: str, ok: bool) -> tuple[str, bool]:
    """A target's ``(line, met)``: ``text`` then ``met`` or ``MISSED``."""
    return f"{text} {'met' if ok else 'MISSED'}", ok


@dataclasses.dataclass(frozen=True)
class Verdicts:
    """What :func:`check_targets` found: ``checked`` records compared, ``missed`` of them over
    their limit, and one printable line per target of the run's benches."""

    checked: int
    missed: int
    lines: list[str]


def check_targets(
    records: Sequence[Mapping[str, Any]], targets: Sequence[Target | Speedup]
) -> Verdicts:
    """Compare every record with every target that selects it (targets of benches the run did
    not write are skipped silently)."""
    benches = {r.get("bench") for r in records}
    checked = missed = 0
    lines = []
    for t in targets:
        if t.bench not in benches:
            continue
        for line, ok in t.verdicts(records):
            lines.append(line)
            if ok is not None:
                checked, missed = checked + 1, missed + (not ok)
    return Verdicts(checked=checked, missed=missed, lines=lines)
