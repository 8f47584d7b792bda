"""Launch-time helpers shared by every kernel: interpreter mode, the launch lock, output allocation.

Nothing here touches a GPU at import time. Whether kernels run compiled or interpreted is decided
by ``TRITON_INTERPRET=1``, read by Triton when it is imported: the test suite and the CLI set it
when no CUDA device exists, and importing ``mqnc.triton_kernels`` sets it when torch was built
without CUDA (``mqnc.base.runtime.use_interpreter_on_cpu_only_torch``: no GPU probe, the build
says it). Otherwise a launcher given CPU tensors in compiled mode refuses them at once with the
one line that says how to interpret (:func:`check_launchable`), instead of Triton's
"0 active drivers".

Environment switches (the only ones the kernels read; parsed in :mod:`mqnc.base.env`):

``TRITON_INTERPRET=1``
    Run kernels under Triton's CPU interpreter. Launchers then take one process-wide lock (the
    interpreter is not thread-safe: two threads launching at once fail with "Did you forget to
    add @triton.jit ?", seen with triton 3.9.0), upcast ``tl.dot`` operands to fp32 (bf16
    dots are wrong under the interpreter) and round bf16 stores in software (the interpreter's
    fp32 -> bf16 cast truncates).
``MQNC_POISON_OUTPUTS=1``
    Fill every output a launcher allocates with NaN before the kernel writes it, so an element a
    kernel forgets to write fails the comparison. The test suite sets it.

Under the interpreter, importing this module also makes device-function calls cheaper
(:func:`skip_repatching_device_calls`): the same kernels, the same results, less Python.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from mqnc.base.env import interpreting, poisoning

__all__ = [
    "check_launchable",
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


def launch_lock():
    """The process-wide launch lock when interpreting, a no-op context on a GPU."""
    return _LOCK if interpreting() else contextlib.nullcontext()


def check_launchable(tensor: torch.Tensor, name: str) -> None:
    """Refuse a tensor the kernels cannot launch on: compiled kernels read only CUDA memory (a CPU
    tensor's pointer "cannot be accessed from Triton", or "0 active drivers" on a machine
    without one); under the interpreter any device works.

    Public launchers call it once per call (on their first tensor, after the same-device check,
    so one tensor stands for all), at planning time: a plan's ``run`` never does, and the
    unchecked internal plans (``plan_decode``, ``plan_sparse``, ``splice_launch``, ...) take CPU
    tensors, so that the sm_90 compile step can build launches without a GPU. The error names
    the argument and says how to fix it, in one line.
    """
    if tensor.device.type == "cuda" or interpreting():
        return
    got = "a CPU tensor" if tensor.device.type == "cpu" else f"a tensor on {tensor.device}"
    raise ValueError(
        f"{name}: expected a CUDA tensor (the kernels run compiled: TRITON_INTERPRET is not 1), "
        f"got {got}: move the inputs to the GPU (mqnc.base.kernel_device()), or run the kernels "
        "interpreted (set TRITON_INTERPRET=1 before importing triton, or call "
        "mqnc.base.use_interpreter_without_cuda() first)"
    )


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Constexpr flag for kernels: upcast ``tl.dot`` operands to fp32.

    Only under the interpreter and only for bf16 (its bf16 dot multiplies raw bit patterns);
    the compiled GPU path keeps bf16 operands on the tensor cores.
    """
    return interpreting() and dtype == torch.bfloat16


def bf16_rne_in_software(dtype: torch.dtype) -> bool:
    """Constexpr flag for kernels that store bf16: round to nearest even by integer arithmetic.

    Only under the interpreter, whose fp32 -> bf16 cast truncates (triton 3.9.0); see
    ``mqnc.triton_kernels._core.numerics.round_to``. The compiled path uses the hardware cast.
    """
    return interpreting() and dtype == torch.bfloat16


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output: uninitialised, or NaN-filled when poisoning is on."""
    if poisoning():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


if interpreting():
    skip_repatching_device_calls()
