"""Test-suite set-up: interpreter mode without CUDA, NaN-poisoned outputs, Hypothesis profiles.

- ``TRITON_INTERPRET=1`` is set here, before anything imports Triton, when no CUDA device exists;
  on a GPU the same tests run the compiled kernels.
- ``MQNC_POISON_OUTPUTS=1``: every output a launcher allocates starts as NaN, so an element a
  kernel leaves unwritten fails the comparison.
- Hypothesis profiles: ``ci`` (bounded, derandomized, no deadline; the default, what
  ``make test`` uses) and ``thorough`` (``HYPOTHESIS_PROFILE=thorough``, for long runs).
- Tensors go to :func:`mqnc.testing.default_device` (a module-level ``DEVICE`` in the kernel
  tests): the GPU when the kernels are compiled, else the CPU; the same tests run on both.
- The GPU tier, :data:`GPU_TIER`: the tests a lent GPU's one short run executes
  (``pytest -m gpu``, from ``perf/gpu_check.sh``), marked ``gpu`` here, in this order.
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

# The GPU tier: fixed production shapes only (a Hypothesis draw is a new compile on a GPU, 1-25 s
# each), kernels first, on the variants perf/warmup.py compiles before the tier runs; then the
# launchers' refusal of CPU tensors and the holder and requester with pools and queries on the
# device (their 4-head test geometry compiles a few small variants, ~1 s each). The NVSHMEM
# kernels are compiled and run by the GPU check's nvshmem step, not here. Node ids relative to
# correctness/; an entry ending in "::" takes the whole file, one without "[" every
# parametrisation. correctness/test_gpu_check.py checks that each entry names collected tests.
GPU_TIER = (
    "test_goal_shapes.py::",
    "test_mla_decode.py::test_decode_production_geometry_default_splits",
    "test_device_placement.py::test_launchers_reject_a_cpu_tensor_when_compiled",
    "test_holder_requester.py::test_route_bf16_matches_reference_over_the_sent_rows",
    "test_holder_requester.py::test_dispatcher_batches_waiting_requesters_into_one_call",
    "test_holder_requester.py::test_probe_and_cost_terms",
)


def in_gpu_tier(nodeid: str) -> bool:
    """Whether a test (``correctness/<file>::<name>[<params>]``) is in :data:`GPU_TIER`."""
    rel = nodeid.split("correctness/", 1)[-1]
    return any(
        rel.startswith(entry) if entry.endswith("::") else rel.split("[", 1)[0] == entry
        for entry in GPU_TIER
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: the GPU tier (correctness/conftest.py GPU_TIER), run by perf/gpu_check.sh"
    )


def pytest_ignore_collect(collection_path, config):
    """Under ``-m gpu`` only the tier's files are imported (no transformers, no notebooks)."""
    if config.getoption("-m") == "gpu" and collection_path.name.startswith("test_"):
        return collection_path.name not in {entry.split("::")[0] for entry in GPU_TIER}
    return None


def pytest_collection_modifyitems(config, items):
    import pytest

    def rank(item):
        rel = item.nodeid.split("correctness/", 1)[-1]
        return min((i for i, e in enumerate(GPU_TIER) if rel.startswith(e)), default=len(GPU_TIER))

    for item in items:
        if in_gpu_tier(item.nodeid):
            item.add_marker(pytest.mark.gpu)
    if config.getoption("-m") == "gpu":  # the tier runs in its listed order: kernels first
        items.sort(key=rank)
