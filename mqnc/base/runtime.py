"""Choose between compiled and interpreted kernels for the whole process, before Triton is
imported; the device the kernels run on; the device's name.

Without a choice here, each launch chooses by its tensors' device (CUDA tensors compiled, CPU
tensors under Triton's interpreter: :func:`mqnc.triton_kernels._core.execution.interpreted`),
whatever was imported first; these functions set ``TRITON_INTERPRET`` for the whole process,
which also lets Triton build its own helpers interpreted (a little less work per launch).
Called by the CLI commands that run kernels, the benchmarks and the test suite; never at import
time of ``mqnc`` (importing the package must not probe the GPU). The functions that ask torch
about CUDA import it inside their bodies, so that this module (and the torch-free layers
that import it) load neither torch nor triton.
"""

from __future__ import annotations

import os
import platform
import sys

from mqnc.base.env import TRITON_INTERPRET, interpret_choice, interpreting

__all__ = [
    "interpreted",
    "use_interpreter_without_cuda",
    "use_interpreter_on_cpu_only_torch",
    "use_compiled_kernels",
    "kernel_mode",
    "kernel_device",
    "synchronize",
    "device_name",
]


def use_interpreter_without_cuda() -> bool:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device exists; returns whether it is set.

    Takes effect only before ``triton`` is imported (Triton then builds every ``@triton.jit``
    function interpreted); if Triton is already imported the environment is left as it is (CPU
    tensors are interpreted anyway, launch by launch) and the current setting is returned.
    """
    if TRITON_INTERPRET not in os.environ and "triton" not in sys.modules:
        import torch  # here, not at the top: see the module docstring

        if not torch.cuda.is_available():
            os.environ[TRITON_INTERPRET] = "1"
    return interpreting()


def use_interpreter_on_cpu_only_torch() -> bool:
    """Set ``TRITON_INTERPRET=1`` when torch was built without CUDA (and ROCm); returns whether
    it is set. Called by ``mqnc.triton_kernels`` as it is imported.

    Asks torch's build (``torch.version.cuda`` / ``torch.version.hip``), never the GPU: a CPU-only
    torch cannot hold CUDA tensors, so every launch in this process is interpreted and Triton may
    as well build its own helpers that way. Like :func:`use_interpreter_without_cuda` it takes
    effect only before Triton is imported and leaves a ``TRITON_INTERPRET`` set by the user as
    it is. Without it (Triton imported first, or a CUDA build of torch on a machine without a
    GPU) CPU tensors still run, interpreted launch by launch
    (``mqnc.triton_kernels._core.execution.interpreted``).
    """
    if TRITON_INTERPRET not in os.environ and "triton" not in sys.modules:
        import torch  # here, not at the top: see the module docstring

        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            os.environ[TRITON_INTERPRET] = "1"
    return interpreting()


def use_compiled_kernels() -> bool:
    """Set ``TRITON_INTERPRET=0`` unless it is set already; returns whether the kernels are
    compiled (False: the user asked for the interpreter).

    For the tools that compile kernels for a GPU target and never launch them on this machine
    (``mqnc kernel-report``, ``perf/warmup.py``): compiled mode is the only one they can use,
    and their launches are built on CPU tensors, which would otherwise choose the interpreter's
    constexprs (:func:`mqnc.triton_kernels._core.execution.interpreted`). ``0`` is what Triton
    reads as unset, so it is safe after Triton was imported too.
    """
    if not os.environ.get(TRITON_INTERPRET):
        os.environ[TRITON_INTERPRET] = "0"
    return not interpreting()


def interpreted(device=None) -> bool:
    """Whether a kernel launch on ``device`` runs under Triton's interpreter: ``TRITON_INTERPRET=1``
    always, ``TRITON_INTERPRET=0`` never, unset: any device but CUDA (CPU tensors interpret,
    CUDA tensors compile). ``device`` None: the process's setting alone (unset: compiled).
    Reads the environment and the device's type, never the GPU."""
    choice = interpret_choice()
    if choice is not None or device is None:
        return bool(choice)
    kind = getattr(device, "type", None)
    if kind is None:
        import torch  # here, not at the top: see the module docstring

        kind = torch.device(device).type
    return kind != "cuda"


def kernel_mode() -> str:
    """``"interpreted"`` (TRITON_INTERPRET=1) or ``"compiled"``."""
    return "interpreted" if interpreting() else "compiled"


def kernel_device():
    """Where pools, queries and kernel outputs live by default: ``cuda`` when the kernels run
    compiled and a CUDA device exists, else ``cpu`` (the interpreter's). A ``torch.device``;
    an explicit ``device=`` always wins over it (Holder, Requester, the tests' tensors)."""
    import torch  # here, not at the top: see the module docstring

    if not interpreting() and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def synchronize(device) -> None:
    """Wait until ``device``'s queued work is done (a CUDA device); a no-op on the CPU, whose
    work is done when the call returns. For timing a GPU call on the host clock."""
    import torch  # here, not at the top: see the module docstring

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name() -> str:
    """The CUDA device's name, or the CPU's model string on a CPU-only machine."""
    import torch  # here, not at the top: see the module docstring

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {model} ({os.cpu_count()} cores)"
