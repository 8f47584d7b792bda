"""Speed targets as data, checked against the records a benchmark run wrote (``--check``).

A :class:`Target` selects records (bench, a glob of the variant, an exact ``x`` or an upper
bound on it, the backend, fields of ``extra``) and bounds one statistic (``p50`` by default) from
above. :func:`check_targets` applies every target to the records of one run: each selected
record passes or misses; a target that selects no record (a GPU target on a CPU run, or a
sweep not run) is reported as not measured and neither passes nor fails.

The targets themselves (the project's goal numbers) are in ``perf/speed_targets.py``; torch-free.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Target", "Verdicts", "check_targets"]


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
    x, x_max : float or None
        Select records whose ``x`` equals ``x`` / is at most ``x_max``.
    backend : str or None
        Select records of this ``backend`` only (``"triton"``: compiled kernels on a GPU).
    extra : mapping
        Select records whose ``extra`` has these values.
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

    def selects(self, rec: Mapping[str, Any]) -> bool:
        """Whether ``rec`` is one this target bounds."""
        if rec.get("bench") != self.bench:
            return False
        if not fnmatch.fnmatchcase(str(rec.get("variant")), self.variant):
            return False
        x = rec.get("x")
        if self.x is not None and x != self.x:
            return False
        if self.x_max is not None and (x is None or x > self.x_max):
            return False
        if self.backend is not None and rec.get("backend") != self.backend:
            return False
        extra = rec.get("extra") or {}
        return all(extra.get(k) == v for k, v in self.extra.items())


@dataclasses.dataclass(frozen=True)
class Verdicts:
    """What :func:`check_targets` found: ``checked`` records compared, ``missed`` of them over
    their limit, and one printable line per target of the run's benches."""

    checked: int
    missed: int
    lines: list[str]


def check_targets(records: Sequence[Mapping[str, Any]], targets: Sequence[Target]) -> Verdicts:
    """Compare every record with every target that selects it (targets of benches the run did
    not write are skipped silently)."""
    benches = {r.get("bench") for r in records}
    checked = missed = 0
    lines = []
    for t in targets:
        if t.bench not in benches:
            continue
        hits = [r for r in records if t.selects(r)]
        if not hits:
            lines.append(f"target {t.what}: not measured in this run")
            continue
        for r in hits:
            value = float(r[t.stat])
            ok = value <= t.limit
            checked, missed = checked + 1, missed + (not ok)
            lines.append(
                f"target {t.what}: {r['bench']} {r['variant']} x={r['x']:g} {t.stat} "
                f"{value:.4g} {r.get('unit', 'us')} (limit {t.limit:g}) "
                + ("met" if ok else "MISSED")
            )
    return Verdicts(checked=checked, missed=missed, lines=lines)
