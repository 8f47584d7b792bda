"""Scalar argument checks shared by every layer: each error names the argument, the expected
and the received value.

Python's ``bool`` is an ``int`` (``True == 1``), so a flag passed where a count belongs would
pass a plain ``isinstance(x, int)``; these checks reject it. numpy integer and float scalars
count as ints and numbers. Failures raise ``ValueError`` for ints (the historical behaviour of
every check these replace) and ``TypeError`` / ``ValueError`` for numbers.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["is_int", "is_number", "check_int", "check_number"]


def is_int(value: object) -> bool:
    """An integer (Python or numpy) that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real number (Python or numpy int or float) that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(
    name: str, value: object, *, minimum: int | None = None, below: int | None = None
) -> int:
    """``value`` as an ``int``, or a ``ValueError`` naming ``name``.

    ``minimum`` is inclusive, ``below`` exclusive: ``check_int("peer", p, minimum=0, below=4)``
    accepts 0..3 (message: "expected an int in [0, 4)").
    """
    ok = is_int(value)
    if ok and minimum is not None and value < minimum:
        ok = False
    if ok and below is not None and value >= below:
        ok = False
    if not ok:
        if minimum is not None and below is not None:
            want = f"an int in [{minimum}, {below})"
        elif minimum is not None:
            want = f"an int >= {minimum}"
        elif below is not None:
            want = f"an int < {below}"
        else:
            want = "an int"
        raise ValueError(f"{name}: expected {want}, got {value!r}")
    return int(value)


def check_number(
    name: str, value: object, *, positive: bool = False, nonnegative: bool = False
) -> float:
    """``value`` as a finite ``float``: ``TypeError`` if it is not a number, ``ValueError`` if it
    is not finite (or not ``> 0`` / ``>= 0`` when asked)."""
    if not is_number(value):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or (positive and v <= 0) or (nonnegative and v < 0):
        want = (
            "a finite number > 0"
            if positive
            else "a finite number >= 0"
            if nonnegative
            else "a finite number"
        )
        raise ValueError(f"{name}: expected {want}, got {value!r}")
    return v
