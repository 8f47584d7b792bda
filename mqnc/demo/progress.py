"""What the demo tells the person running it while it works: one line per phase with the
seconds since the start, and a bar for each long loop (prefill, calibration, decode), on stderr
(the table goes to stdout). Silent when ``enabled`` is false."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """Phase lines and bars, timed from ``t0`` (``time.perf_counter()`` at the start of the
    run; default: now)."""

    def __init__(self, enabled: bool, t0: float | None = None) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter() if t0 is None else t0

    @property
    def elapsed_s(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.t0

    def phase(self, text: str) -> None:
        """One line: ``[  12.3 s] text``."""
        if self.enabled:
            print(f"[{self.elapsed_s:6.1f} s] {text}", file=sys.stderr, flush=True)

    def bar(self, total: int, desc: str) -> tqdm:
        """A bar of ``total`` steps (a context manager; disabled when not ``enabled``)."""
        return tqdm(
            total=total,
            desc=f"[{self.elapsed_s:6.1f} s] {desc}",
            bar_format="{desc}: {n_fmt}/{total_fmt} {bar} {elapsed}<{remaining}",
            file=sys.stderr,
            disable=not self.enabled,
            leave=True,
            dynamic_ncols=True,
        )
