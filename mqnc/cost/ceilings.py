"""A device's memory ceilings: the HBM spec and what kernels measured (``perf/bench_copy.py``).

Every "% of ceiling" the package states (the benchmarks' records, the kernel report, the speed
targets, the cost model's holder term) is against two numbers of the device, never against
torch's ``copy_`` alone (which moved 2.71 TB/s on an H200 whose splice kernel moved 3.0):

- the **read ceiling**: the median TB/s of the Triton streaming read kernel's records
  (``bench="ceiling", variant="read"`` or ``"read-tma"``, whichever median is larger) on that
  device, when there are any;
- the **spec**: the HBM bandwidth the vendor states (:data:`HBM_SPEC_TBPS`), the fallback.

:func:`memory_ceiling` reads both from records (dicts of the long-format results file);
:attr:`MemoryCeiling.tbps` is the one a prediction uses and :attr:`MemoryCeiling.source` says
which (``"measured read ceiling (N records)"`` or ``"HBM spec"``). Pure Python.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable

__all__ = ["HBM_SPEC_TBPS", "READ_VARIANTS", "MemoryCeiling", "spec_tbps", "memory_ceiling"]

READ_VARIANTS = ("read", "read-tma")
"""The read kernels of ``perf/bench_copy.py`` (plain 16-byte loads, TMA boxes): the read ceiling
is the larger of their medians."""

# (a part of the device name as torch reports it, HBM TB/s, what the number is): the first
# entry whose part the name contains wins, so the longer names come first.
HBM_SPEC_TBPS: tuple[tuple[str, float, str], ...] = (
    ("H200", 4.8, "H200 SXM, HBM3e 141 GB"),
    ("H100 NVL", 3.9, "H100 NVL, HBM3 94 GB"),
    ("H100 PCIe", 2.0, "H100 PCIe, HBM2e 80 GB"),
    ("H100", 3.35, "H100 SXM5, HBM3 80 GB"),
    ("H800", 3.35, "H800 SXM5, HBM3 80 GB"),
    ("H20", 4.0, "H20, HBM3 96 GB"),
    ("A100-SXM4-80GB", 2.039, "A100 SXM4 80 GB, HBM2e"),
    ("A100-SXM4-40GB", 1.555, "A100 SXM4 40 GB, HBM2"),
)


def spec_tbps(device: str) -> float | None:
    """The HBM bandwidth (TB/s) the vendor states for ``device`` (a name such as ``"NVIDIA
    H200"``), or None for a device :data:`HBM_SPEC_TBPS` does not list (a CPU)."""
    if not isinstance(device, str):
        raise TypeError(f"device: expected a str, got {type(device).__name__}")
    for part, tbps, _ in HBM_SPEC_TBPS:
        if part in device:
            return tbps
    return None


@dataclasses.dataclass(frozen=True)
class MemoryCeiling:
    """The memory ceilings of one device (TB/s; None: not known).

    ``read_tbps`` / ``copy_tbps``: medians of the Triton read (the faster read kernel's) / copy
    kernels' records (``copy_tbps`` counts bytes read plus written); ``torch_copy_tbps``:
    torch's ``copy_`` (read plus written); ``spec_tbps``: the HBM spec; ``records``: how many
    read records the median is of."""

    device: str
    read_tbps: float | None = None
    copy_tbps: float | None = None
    torch_copy_tbps: float | None = None
    spec_tbps: float | None = None
    records: int = 0

    @property
    def tbps(self) -> float:
        """The ceiling a prediction uses: the measured read ceiling, else the spec (a
        ``ValueError`` when neither is known)."""
        if self.read_tbps is not None:
            return self.read_tbps
        if self.spec_tbps is not None:
            return self.spec_tbps
        raise ValueError(
            f"device: expected a device with a measured read ceiling or a known HBM spec, got "
            f"{self.device!r} (run python -m perf.bench_copy on it)"
        )

    @property
    def source(self) -> str:
        """Where :attr:`tbps` comes from, in words."""
        if self.read_tbps is not None:
            return f"measured read ceiling ({self.records} records, perf/bench_copy.py)"
        if self.spec_tbps is not None:
            return "HBM spec (no read ceiling measured on this device)"
        return "none"

    def percents(self, tbps: float) -> dict:
        """``tbps`` as ``{"pct_of_read": .., "pct_of_spec": ..}`` (None where not known)."""
        return dict(
            pct_of_read=None if not self.read_tbps else 100.0 * tbps / self.read_tbps,
            pct_of_spec=None if not self.spec_tbps else 100.0 * tbps / self.spec_tbps,
        )


def _tbps(records: list[dict], bench: str, variant: str | None, backend: str) -> list[float]:
    out = []
    for r in records:
        if r.get("bench") != bench or r.get("backend") != backend or not r.get("gbps"):
            continue
        if variant is not None and r.get("variant") != variant:
            continue
        if (r.get("extra") or {}).get("exact") is False:
            continue  # a kernel that read or copied wrongly measured nothing
        out.append(float(r["gbps"]) / 1e3)
    return out


def memory_ceiling(records: Iterable[dict], device: str) -> MemoryCeiling:
    """The ceilings of ``device`` from ``records`` (results-file dicts; those of other devices
    are ignored): medians of its ``ceiling`` read / copy records and its ``copy`` records
    (torch), and the spec."""
    if not isinstance(device, str):
        raise TypeError(f"device: expected a str, got {type(device).__name__}")
    mine = [r for r in records if isinstance(r, dict) and r.get("device") == device]
    reads = {v: _tbps(mine, "ceiling", v, "triton") for v in READ_VARIANTS}
    copy = _tbps(mine, "ceiling", "copy", "triton")
    torch_copy = _tbps(mine, "copy", None, "torch")

    def median(v):
        return statistics.median(v) if v else None

    best = max((v for v in READ_VARIANTS if reads[v]), key=lambda v: median(reads[v]), default=None)
    return MemoryCeiling(
        device,
        read_tbps=None if best is None else median(reads[best]),
        copy_tbps=median(copy),
        torch_copy_tbps=median(torch_copy),
        spec_tbps=spec_tbps(device),
        records=0 if best is None else len(reads[best]),
    )
