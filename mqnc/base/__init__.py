"""The bottom layer: tiny helpers every other layer may import, kernels included.

Nothing here imports torch or triton at module level (``mqnc.base.runtime`` imports torch inside
the functions that must ask it about CUDA), so the torch-free cost model and ``mqnc --help``
can use it.

- :mod:`mqnc.base.env`: every environment switch mqnc reads, each parsed in one place.
- :mod:`mqnc.base.checks`: scalar argument checks (an int that is not a bool, a positive number).
- :mod:`mqnc.base.runtime`: interpreter or compiled kernels, chosen once; the device the kernels
  run on; the device's name.
- :mod:`mqnc.base.lazy`: re-exports that import their module on first use (PEP 562).
"""

from mqnc.base.checks import check_int, check_number, is_int, is_number
from mqnc.base.env import interpreting, poisoning
from mqnc.base.runtime import (
    device_name,
    kernel_device,
    kernel_mode,
    use_interpreter_without_cuda,
)

__all__ = [
    "check_int",
    "check_number",
    "is_int",
    "is_number",
    "interpreting",
    "poisoning",
    "device_name",
    "kernel_device",
    "kernel_mode",
    "use_interpreter_without_cuda",
]
