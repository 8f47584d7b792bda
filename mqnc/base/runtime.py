"""Choose between compiled and interpreted kernels, once, before Triton is imported.

Called by the CLI commands that run kernels, the benchmarks and the test suite; never at import
time of ``mqnc`` (importing the package must not probe the GPU). The two functions that ask
torch about CUDA import it inside their bodies, so that this module (and the torch-free layers
that import it) load neither torch nor triton.
"""

from __future__ import annotations

import os
import platform
import sys

from mqnc.base.env import TRITON_INTERPRET, interpreting

__all__ = [
    "use_interpreter_without_cuda",
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
