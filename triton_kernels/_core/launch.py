"""A kernel launch as data: what a launcher runs on the device and what the compile step builds.

Every launcher plans its launch as a :class:`Launch` (the ``@triton.jit`` function, its grid,
its positional arguments and its keyword arguments: constexprs and options such as
``num_warps``), then calls it. The sm_90 compile step (:mod:`mqnc.triton_kernels.sm90.compile`)
compiles the very same object through Triton's own launch path, so the variant it checks is the
variant a launch compiles: same argument specialisation (16-byte divisibility of pointers and
ints, ints equal to 1 as constexprs), same constexprs, same options.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import triton

from mqnc.triton_kernels._core.execution import as_interpreted, interpreted, interpreter_launch

__all__ = ["Launch", "LaunchRunner"]


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
        """Launch: compiled, or under the interpreter (its process-wide lock held) when its
        tensors' device says so (:func:`~mqnc.triton_kernels._core.execution.interpreted`)."""
        if interpreted(self.device):
            with interpreter_launch():
                return as_interpreted(self.kernel)[self.grid](*self.args, **self.kwargs)
        return self.kernel[self.grid](*self.args, **self.kwargs)

    @property
    def device(self) -> torch.device | None:
        """The device of the launch's first tensor argument (None: it has none)."""
        for a in self.args:
            if isinstance(a, torch.Tensor):
                return a.device
        return None

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


class LaunchRunner:
    """A planned launch whose first ``k`` arguments come new with every call (a plan's
    ``run``), the rest fixed: the hot path of :class:`~mqnc.triton_kernels.mla.plan.
    AttentionPlan`.

    Compiled (on a GPU): the first call goes through Triton's JIT (``kernel[grid](...)``: the
    argument binding, specialisation and cache lookup) and keeps the ``CompiledKernel`` it
    returns; every later call launches that kernel through its launcher (``CompiledKernel.run``,
    what ``compiled[grid](*args)`` calls last: the C launch and its scratch buffers) with the
    grid, the current stream, the fixed arguments and the constexprs already in parameter
    order, as long as the new tensors' 16-byte alignment (the one property of a tensor argument
    the JIT specialises on that a plan's shape check does not fix) and the current device are
    those of that first call. ``compiled[grid]``'s own wrapper is skipped while no launch hook
    is registered (``triton.knobs.runtime.launch_enter_hook`` / ``launch_exit_hook``: a
    profiler's); with one, or with a Triton whose compiled kernel lacks that launcher, the
    wrapper runs, hooks and all. A different alignment or device goes through the JIT again
    (which may compile another variant, then kept). Interpreted: ``kernel[grid](...)`` in an
    interpreted launch's scope (the lock held) every time.
    """

    __slots__ = (
        "kernel", "grid", "k", "tail", "kwargs", "_fast", "_run", "_head", "_align", "_device",
        "_rest",
    )  # fmt: skip

    def __init__(self, launch: Launch, k: int) -> None:
        self.kernel, self.grid, self.k = launch.kernel, launch.grid, k
        self.tail = launch.args[k:]
        self.kwargs = launch.kwargs
        self._fast = self._run = self._head = self._align = self._device = None
        self._rest = self._parameter_tail(launch)

    def _parameter_tail(self, launch: Launch) -> tuple | None:
        """The fixed arguments then every constexpr, in the kernel's parameter order (what a
        compiled kernel's launcher takes after the run's tensors); None when a parameter has no
        value (the JIT path is then the only one)."""
        names = getattr(self.kernel, "arg_names", None)
        params = getattr(self.kernel, "params", None)
        if names is None or params is None:
            return None
        rest = list(self.tail)
        for i in range(len(launch.args), len(names)):
            name = names[i]
            if name in self.kwargs:
                rest.append(self.kwargs[name])
            elif (
                getattr(params[i], "default", inspect.Parameter.empty)
                is not inspect.Parameter.empty
            ):
                rest.append(params[i].default)
            else:
                return None
        return tuple(rest)

    def __call__(self, interpreted: bool, *tensors) -> None:
        """Launch on ``tensors`` (the first ``k`` arguments); ``interpreted``: the plan's mode."""
        if interpreted:
            with interpreter_launch():
                as_interpreted(self.kernel)[self.grid](*tensors, *self.tail, **self.kwargs)
            return
        if self._fast is not None:
            device = torch._C._cuda_getDevice()
            if self.alignment(tensors) == self._align and device == self._device:
                run = self._run
                if run is not None and _no_launch_hooks():
                    stream = torch._C._cuda_getCurrentRawStream(device)
                    run(*self._head[0], stream, *self._head[1:], None, None, None, *tensors,
                        *self._rest)  # fmt: skip
                else:
                    self._fast(*tensors, *self._rest)
                return
        compiled = self.kernel[self.grid](*tensors, *self.tail, **self.kwargs)
        if self._rest is not None and hasattr(compiled, "__getitem__"):
            self._align = self.alignment(tensors)
            self._device = torch.cuda.current_device()
            self._fast = compiled[_grid3(self.grid)]
            run, function = getattr(compiled, "run", None), getattr(compiled, "function", None)
            meta = getattr(compiled, "packed_metadata", None)
            if callable(run) and function is not None and meta is not None:
                self._run, self._head = run, (_grid3(self.grid), function, meta)

    @staticmethod
    def alignment(tensors) -> tuple:
        """The 16-byte alignment of each of ``tensors`` (a tensor, or a TMA descriptor: its
        base's), what the JIT specialises a pointer on."""
        return tuple(getattr(t, "base", t).data_ptr() & 15 == 0 for t in tensors)


def _no_launch_hooks() -> bool:
    """True when no Triton launch hook is registered (a hook chain without calls, or none)."""
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    if rt is None:  # (a Triton without knobs: its wrapper decides)
        return False
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return not (getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
