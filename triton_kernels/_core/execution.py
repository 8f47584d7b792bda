"""Launch-time helpers shared by every kernel: interpreter or compiled, the launch lock, output
allocation.

Nothing here touches a GPU at import time. Each launch runs compiled or under Triton's CPU
interpreter by :func:`interpreted`: with ``TRITON_INTERPRET`` unset, by its tensors' device
(CUDA tensors compiled, CPU tensors interpreted), whatever was imported first and whichever
torch build; ``TRITON_INTERPRET=1`` interprets every launch, ``TRITON_INTERPRET=0`` compiles
every launch (CPU tensors are then refused by :func:`check_launchable`, in one line, instead of
Triton's "0 active drivers"). A kernel that Triton built compiled (``triton`` imported before
``TRITON_INTERPRET=1`` was set, or never set) is interpreted on demand
(:func:`as_interpreted`, :func:`interpreter_launch`).

Environment switches (the only ones the kernels read; parsed in :mod:`mqnc.base.env`):

``TRITON_INTERPRET``
    As above. Interpreted launches take one process-wide lock (the interpreter is not
    thread-safe: two threads launching at once fail with "Did you forget to add @triton.jit ?",
    seen with triton 3.9.0), upcast ``tl.dot`` operands to fp32 (bf16 dots are wrong under the
    interpreter) and round bf16 stores in software (the interpreter's fp32 -> bf16 cast
    truncates).
``MQNC_POISON_OUTPUTS=1``
    Fill every output a launcher allocates with NaN before the kernel writes it, so an element a
    kernel forgets to write fails the comparison. The test suite sets it.

Under the interpreter, device-function calls are made cheaper
(:func:`skip_repatching_device_calls`): the same kernels, the same results, less Python.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from mqnc.base.env import interpreting, poisoning
from mqnc.base.runtime import interpreted

__all__ = [
    "as_interpreted",
    "check_launchable",
    "interpreted",
    "interpreter_launch",
    "interpreting",
    "launch_lock",
    "dot_in_fp32",
    "bf16_rne_in_software",
    "new_output",
    "poisoning",
    "skip_repatching_device_calls",
]

_LOCK = threading.RLock()
_LAUNCHES = threading.local()  # per thread: the language modules each running launch patched


class _NothingPatched:
    """What a skipped patch returns (Triton's own patch returns a scope with ``restore``)."""

    @staticmethod
    def restore() -> None:
        pass


def skip_repatching_device_calls() -> bool:
    """Under Triton's interpreter, let a device function (a ``@triton.jit`` function a kernel
    calls: the package's helpers, ``tl.max``, ``tl.sum`` ...) skip re-patching the language
    modules its launch has already patched; returns whether it applies (idempotent).

    The interpreter (triton 3.9.0) patches ``triton.language`` and ``triton.language.core`` for
    interpretation at every launch (and restores them when the grid is done), and again at every
    device-function call, walking the modules with ``inspect.getmembers`` each time: ~15% of an
    interpreted kernel's run (~40% of a small merge), re-setting what the launch set already
    (every builtin it would patch is already patched, every attribute it sets is set to a
    function that does the same). Here a launch remembers which of the two modules it (and the
    device functions it called) patched, in its thread, and a device function whose modules are
    all among them is not patched again; one whose globals hold a module not yet patched is
    patched as before. Launches, restores and everything the kernels compute are unchanged; a
    compiled kernel never meets the interpreter, so a GPU run is untouched. With another Triton
    whose interpreter lacks these hooks nothing is changed.
    """
    try:
        from triton.runtime import interpreter as ti

        patch, run_grid, lang = ti._patch_lang, ti.GridExecutor.__call__, (ti.tl, ti.tl.core)
    except (ImportError, AttributeError):
        return False
    if getattr(patch, "mqnc_skips_repatching", False):
        return True

    def modules(fn) -> frozenset:
        # what Triton's patch picks: the globals that are triton.language or its core
        return frozenset(
            i for i, m in enumerate(lang) if any(v is m for v in fn.__globals__.values())
        )

    def patch_lang(fn):
        stack = getattr(_LAUNCHES, "stack", None)
        if stack:  # inside a launch (its own patch is the first call, with nothing patched)
            mods = modules(fn)
            if mods and mods <= stack[-1]:
                return _NothingPatched
            stack[-1].update(mods)
        return patch_lang.original(fn)

    def grid_call(self, *args, **kwargs):
        stack = _LAUNCHES.__dict__.setdefault("stack", [])
        stack.append(set())
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            stack.pop()

    patch_lang.mqnc_skips_repatching = True
    patch_lang.original = patch  # Triton's own (the tests compare against it)
    ti._patch_lang = patch_lang
    ti.GridExecutor.__call__ = grid_call
    return True


def launch_lock(device: torch.device | str | None = None):
    """The process-wide launch lock when a launch on ``device`` is interpreted
    (:func:`interpreted`), a no-op context for a compiled one."""
    return _LOCK if interpreted(device) else contextlib.nullcontext()


# id of a compiled kernel (Triton's JITFunction) -> (the kernel, kept alive; its interpreted
# twin); by id: a JITFunction hashes by its cache key, which walks its source and callees
_INTERPRETED: dict[int, tuple] = {}


def as_interpreted(kernel):
    """``kernel`` as Triton's interpreter runs it: a ``@triton.jit`` function that Triton built
    compiled (imported without ``TRITON_INTERPRET=1``) gets its interpreted twin (one per
    kernel, kept); an interpreted one is returned as it is."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        return kernel
    kept = _INTERPRETED.get(id(kernel))
    if kept is None:
        kept = _INTERPRETED[id(kernel)] = (kernel, InterpretedFunction(kernel.fn))
    return kept[1]


_HOOKED: list[bool] = []  # the interpreter hooks below installed (once per process)


@contextlib.contextmanager
def interpreter_launch():
    """The scope of one interpreted launch: the process-wide lock held, and every device
    function the kernel calls that Triton built compiled (the package's helpers, Triton's own
    ``tl.max``, ``tl.cdiv`` ... when ``triton`` was imported before ``TRITON_INTERPRET=1``, or
    without it) run by its interpreted twin (:func:`as_interpreted`) instead of raising
    "Cannot call @triton.jit'd outside of the scope of a kernel". Outside such a scope a
    compiled device function called from Python raises as Triton has it."""
    with _LOCK:
        if not _HOOKED:
            _calls_compiled_device_functions_interpreted()
            skip_repatching_device_calls()
            _HOOKED.append(True)
        depth = getattr(_LAUNCHES, "interpreting", 0)
        _LAUNCHES.interpreting = depth + 1
        try:
            yield
        finally:
            _LAUNCHES.interpreting = depth


def _calls_compiled_device_functions_interpreted() -> None:
    """Let a compiled device function called inside :func:`interpreter_launch` run interpreted
    (idempotent; Triton's ``JITFunction.__call__`` only ever raises, so outside the scope it is
    called as before)."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__
    if getattr(original, "mqnc_interprets", False):
        return

    def call(self, *args, **kwargs):
        if getattr(_LAUNCHES, "interpreting", 0):
            return as_interpreted(self)(*args, **kwargs)
        return original(self, *args, **kwargs)

    call.mqnc_interprets = True
    JITFunction.__call__ = call


def check_launchable(tensor: torch.Tensor, name: str) -> None:
    """Refuse a tensor the kernels cannot launch on: compiled kernels read only CUDA memory, so
    a CPU tensor is refused when ``TRITON_INTERPRET=0`` forces compiled launches (otherwise it
    is interpreted: :func:`interpreted`).

    Public launchers call it once per call (on their first tensor, after the same-device check,
    so one tensor stands for all), at planning time: a plan's ``run`` never does, and the
    unchecked internal plans (``plan_decode``, ``plan_sparse``, ``splice_launch``, ...) take CPU
    tensors, so that the sm_90 compile step can build launches without a GPU. The error names
    the argument and says how to fix it, in one line.
    """
    if tensor.device.type == "cuda" or interpreted(tensor.device):
        return
    got = "a CPU tensor" if tensor.device.type == "cpu" else f"a tensor on {tensor.device}"
    raise ValueError(
        f"{name}: expected a CUDA tensor (TRITON_INTERPRET=0: every launch compiled), got {got}: "
        "move the inputs to the GPU (mqnc.base.kernel_device()), or unset TRITON_INTERPRET "
        "(CPU tensors then run under Triton's interpreter)"
    )


def dot_in_fp32(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Constexpr flag for kernels: upcast ``tl.dot`` operands to fp32.

    Only for an interpreted launch on ``device`` (:func:`interpreted`) and only for bf16 (the
    interpreter's bf16 dot multiplies raw bit patterns); the compiled GPU path keeps bf16
    operands on the tensor cores.
    """
    return dtype == torch.bfloat16 and interpreted(device)


def bf16_rne_in_software(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Constexpr flag for kernels that store bf16: round to nearest even by integer arithmetic.

    Only for an interpreted launch on ``device`` (:func:`interpreted`), whose fp32 -> bf16 cast
    truncates (triton 3.9.0); see ``mqnc.triton_kernels._core.numerics.round_to``. The compiled
    path uses the hardware cast.
    """
    return dtype == torch.bfloat16 and interpreted(device)


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output: uninitialised, or NaN-filled when poisoning is on."""
    if poisoning():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


if interpreting():
    skip_repatching_device_calls()
