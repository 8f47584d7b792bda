"""Input validation shared by the launchers: every error names the argument, expected and got.

Validation is by exceptions (``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong
shape, device or value), never by ``assert``, which ``python -O`` removes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch

__all__ = [
    "argument_names",
    "check_flags",
    "check_tensor",
    "check_dtype_matches",
    "check_same_device",
    "check_int",
    "check_num_splits",
    "check_softmax_scale",
    "FLOAT_DTYPES",
    "dtype_name",
]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    contiguous_last: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; ``shape`` entries of None match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        expected = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(
            f"{name}: invalid dtype, expected one of ({expected}), got {dtype_name(t.dtype)}"
        )
    if shape is not None:
        if len(shape) != t.dim() or any(
            s is not None and s != got for s, got in zip(shape, t.shape, strict=True)
        ):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if contiguous_last and t.dim() and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride on the last dim, got strides {t.stride()}")
    return t


def check_dtype_matches(name: str, t: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """``t``'s dtype is ``like``'s (a cache and its query rows): a ``TypeError`` naming both."""
    if t.dtype != like.dtype:
        raise TypeError(
            f"{name}: invalid dtype, must match {like_name}'s ({dtype_name(like.dtype)}), got "
            f"{dtype_name(t.dtype)}"
        )


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; returns it."""
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(f"{name}: expected device {first} (as {first_name}), got {dev}")
    return first


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """An int that is not a bool, optionally ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_num_splits(num_splits: object) -> int | None:
    """``None`` (the launcher chooses) or an int >= 1."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits: expected None or an int, got {type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"num_splits: expected None or an int >= 1, got {num_splits}")
    return num_splits


def check_softmax_scale(softmax_scale: object) -> float:
    """A finite positive float (an int is accepted, a bool is not)."""
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale: expected a finite positive float, got {softmax_scale!r}")
    return scale


def check_flags(**flags: object) -> None:
    """Each keyword a bool (``causal``, ``return_lse``, ...), else a ``TypeError`` naming it."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


@contextlib.contextmanager
def argument_names(names: dict[str, str]):
    """Errors raised inside name the caller's arguments: a ``ValueError`` / ``TypeError`` whose
    message starts ``internal:`` is raised again as ``names[internal]:`` (an adapter runs the
    kernels' own checks, which know the kernels' names: ``kv_pool``, ``lse_acc``, ...)."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        head, sep, rest = str(exc).partition(":")
        if sep and head in names and type(exc) in (ValueError, TypeError):
            raise type(exc)(f"{names[head]}:{rest}") from exc
        raise
