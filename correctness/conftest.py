"""Test-suite set-up: interpreter mode without CUDA, NaN-poisoned outputs, Hypothesis profiles.

- ``TRITON_INTERPRET=1`` is set here, before anything imports Triton, when no CUDA device exists;
  on a GPU the same tests run the compiled kernels.
- ``MQNC_POISON_OUTPUTS=1``: every output a launcher allocates starts as NaN, so an element a
  kernel leaves unwritten fails the comparison.
- Hypothesis profiles: ``ci`` (bounded, derandomized, no deadline; the default, what
  ``make test`` uses) and ``thorough`` (``HYPOTHESIS_PROFILE=thorough``, for long runs).
- Tensors go to :func:`mqnc.testing.default_device` (a module-level ``DEVICE`` in the kernel
  tests): the GPU when there is one, else the CPU; the same tests run on both.
"""

from __future__ import annotations

import os

from mqnc.base.env import MQNC_POISON_OUTPUTS
from mqnc.base.runtime import use_interpreter_without_cuda

use_interpreter_without_cuda()
os.environ.setdefault(MQNC_POISON_OUTPUTS, "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
