"""A kernel launch as data: what a launcher runs on the device and what the compile step builds.

Every launcher plans its launch as a :class:`Launch` (the ``@triton.jit`` function, its grid,
its positional arguments and its keyword arguments: constexprs and options such as
``num_warps``), then calls it. The sm_90 compile step (:mod:`mqnc.triton_kernels._compile`)
compiles the very same object through Triton's own launch path, so the variant it checks is the
variant a launch compiles: same argument specialisation (16-byte divisibility of pointers and
ints, ints equal to 1 as constexprs), same constexprs, same options.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mqnc.triton_kernels._runtime import launch_lock

__all__ = ["Launch"]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of ``kernel[grid](*args, **kwargs)``.

    ``name`` names the compiled variant (op, dtypes, tile, warps, stages: what decides its
    registers and shared memory; the key of the sm_90 table and of the compile report),
    ``args`` are the kernel's runtime arguments in order (tensors, ints, floats), ``kwargs`` its
    constexprs by name plus launch options (``num_warps``, ``num_stages``).
    """

    name: str
    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict

    def __call__(self):
        """Launch (under the interpreter's process-wide lock when interpreting)."""
        with launch_lock():
            return self.kernel[self.grid](*self.args, **self.kwargs)

    @property
    def programs(self) -> int:
        """Programs (CTAs) in the grid."""
        n = 1
        for g in self.grid:
            n *= g
        return n

    @property
    def num_warps(self) -> int:
        return int(self.kwargs.get("num_warps", 4))
