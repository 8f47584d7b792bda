"""Choose between compiled and interpreted kernels, once, before Triton is imported.

Called by the CLI commands that run kernels, the benchmarks and the test suite; never at import
time of ``mqnc`` (importing the package must not probe the GPU). The functions that ask torch
about CUDA import it inside their bodies, so that this module (and the torch-free layers
that import it) load neither torch nor triton.
"""

from __future__ import annotations

import os
import platform
import sys

from mqnc.base.env import TRITON_INTERPRET, interpreting

__all__ = [
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

    Must run before ``triton`` is imported to take effect; if Triton is already imported the
    environment is left as it is and the current mode is returned.
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
    torch cannot hold CUDA tensors, so compiled kernels could never run in this process and the
    interpreter is the only choice. Like :func:`use_interpreter_without_cuda` it takes effect only
    before Triton is imported (Triton's own ``@triton.jit`` helpers, e.g. ``tl.cdiv``, are built
    as it is imported) and leaves a ``TRITON_INTERPRET`` set by the user as it is. A CUDA build
    of torch on a machine without a GPU is left alone (that would need a GPU probe); its
    launchers then refuse CPU tensors with the one line that says what to set
    (``mqnc.triton_kernels._core.execution.check_launchable``).
    """
    if TRITON_INTERPRET not in os.environ and "triton" not in sys.modules:
        import torch  # here, not at the top: see the module docstring

        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            os.environ[TRITON_INTERPRET] = "1"
    return interpreting()


def use_compiled_kernels() -> bool:
    """Set ``TRITON_INTERPRET=0`` unless it is set already or Triton was imported first; returns
    whether the kernels are compiled (False: the user asked for the interpreter).

    For the tools that compile kernels for a GPU target and never launch them on this machine
    (``mqnc kernel-report``, ``perf/warmup.py``): compiled mode is the only one they can use,
    and on a CPU-only torch importing ``mqnc.triton_kernels`` would otherwise choose the
    interpreter (:func:`use_interpreter_on_cpu_only_torch`).
    """
    if TRITON_INTERPRET not in os.environ and "triton" not in sys.modules:
        os.environ[TRITON_INTERPRET] = "0"
    return not interpreting()


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
