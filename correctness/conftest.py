"""Test-suite set-up: interpreter mode without CUDA, NaN-poisoned outputs, Hypothesis profiles.

- ``TRITON_INTERPRET=1`` is set here, before anything imports Triton, when no CUDA device exists;
  on a GPU the same tests run the compiled kernels.
- ``MQNC_POISON_OUTPUTS=1``: every output a launcher allocates starts as NaN, so an element a
  kernel leaves unwritten fails the comparison.
- Hypothesis profiles: ``ci`` (bounded, derandomized, no deadline; the default, what
  ``make test`` uses) and ``thorough`` (``HYPOTHESIS_PROFILE=thorough``, for long runs).
"""

from __future__ import annotations

import os

from mqnc.runtime import use_interpreter_without_cuda

use_interpreter_without_cuda()
os.environ.setdefault("MQNC_POISON_OUTPUTS", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
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


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (compiled path)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """Where tensors live: the GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
