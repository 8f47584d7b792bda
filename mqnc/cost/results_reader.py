"""The records of a results file: the long format :mod:`mqnc.measure.results_file` writes and the
cost layer reads (``mqnc fit``, :meth:`mqnc.cost.terms.SpliceProfile.from_results`).

- :data:`RECORD_NUMBERS`: the fields every record carries as a finite number;
- :func:`check_record`: one record checked, or a ``ValueError`` naming where and which key;
- :func:`read_jsonl`: every record of a JSON-lines file, each checked.

Standard library only (the fitting and the terms both read records; neither imports the other
for it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from mqnc.base.checks import check_int, is_number

__all__ = ["RECORD_NUMBERS", "check_record", "read_jsonl"]


RECORD_NUMBERS = ("x", "p50")
"""The fields every results record carries as a finite number (:mod:`mqnc.measure.results_file`
writes them; ``mqnc fit`` and ``SpliceProfile.from_results`` read them)."""


def check_record(record: object, where: str, *, required: Sequence[str] = RECORD_NUMBERS) -> dict:
    """``record`` if it is a results record, else a ``ValueError`` naming ``where`` (the file
    and line, or the list and index) and the key.

    A record is a JSON object whose ``x`` and ``p50`` are finite numbers (not bools; both
    required, or those in ``required``: a probe needs no ``x``), whose ``extra`` is an object
    (or absent / null) and whose ``extra["qp_row_bytes"]``, when given, is a positive int.
    """
    if not isinstance(record, dict):
        raise ValueError(
            f"results: {where}: expected a JSON object (a record), got {type(record).__name__}"
        )
    for key in RECORD_NUMBERS:
        if key not in record and key not in required:
            continue
        if key not in record:
            raise ValueError(f"results: {where}: key {key!r} missing; expected a finite number")
        value = record[key]
        if not (is_number(value) and math.isfinite(value)):
            raise ValueError(
                f"results: {where}: key {key!r}: expected a finite number, got {value!r}"
            )
    extra = record.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(
            f"results: {where}: key 'extra': expected a JSON object, got {type(extra).__name__}"
        )
    if extra and "qp_row_bytes" in extra:
        try:
            check_int("'extra.qp_row_bytes'", extra["qp_row_bytes"], minimum=1)
        except ValueError as exc:
            raise ValueError(f"results: {where}: key {exc}") from None
    return record


def read_jsonl(path: str | os.PathLike, *, required: Sequence[str] = RECORD_NUMBERS) -> list[dict]:
    """Every record of a JSON-lines results file (:mod:`mqnc.measure.results_file`' format); a
    missing file is a ``FileNotFoundError``, a line that is not JSON or not a record
    (:func:`check_record`: an object whose ``x`` and ``p50`` are finite numbers; those not in
    ``required`` may be absent) a ``ValueError`` naming the file, the line and the key."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"results: no such file {os.fspath(path)!r}")
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"results: {path} line {i} is not JSON ({exc})") from None
                out.append(check_record(rec, f"{path} line {i}", required=required))
    return out
