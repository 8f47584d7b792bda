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
  (``pytest -m gpu``, from ``perf/gpu_check.sh``), marked ``gpu`` here (the marker is
  registered in ``pyproject.toml``), in this order.
- The long tier, :data:`LONG_TIER`: the tests using the GPU scripts' dry-run fixtures (minutes
  each on a 2-core machine) and the sm_90 compiles against NVSHMEM's device bitcode, marked
  ``long``. ``make test`` (``pytest correctness``) deselects
  them; ``make test-long`` (``-m long``) runs them alone; they run with the rest when
  ``MQNC_TEST_LONG=1`` or when their file is named on the command line, and under any ``-m`` its
  expression decides.
  ``.ci/run`` runs both; docs/testing-time.md says what is where and why.
"""

from __future__ import annotations

import os

from mqnc.base.env import MQNC_POISON_OUTPUTS
from mqnc.base.runtime import use_interpreter_without_cuda

use_interpreter_without_cuda()
os.environ.setdefault(MQNC_POISON_OUTPUTS, "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: one core each, subprocesses too
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

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
# the long tier's randomized run (test_random_properties.py): new draws each run, four times
# the ci profile's examples; a failure prints the seed and the blob that reproduce it
settings.register_profile(
    "random",
    max_examples=100,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# correctness/planted.py's runs: the ci profile's draws, no shrinking (one failing example is
# the catch; shrinking an interpreted kernel's input takes minutes)
settings.register_profile(
    "planted",
    parent=settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The GPU tier: fixed shapes only (a Hypothesis draw is a new compile on a GPU, 1-25 s each),
# kernels first, on the variants perf/warmup.py compiles before the tier runs; then the bf16
# ecosystem layouts (FlashMLA's s_q = 2 causal MTP rows, split ckv / kpe caches, SGLang's page
# 1; a few small variants, ~1 s each), the launchers' refusal of CPU tensors, the holder and
# requester with pools and queries on the device (their 4-head test geometry compiles a few small
# variants, ~1 s each), and last the routed holder step in a CUDA graph and under
# torch.compile(mode="reduce-overhead") (Inductor's compile, ~10-20 s: last, so a cap cuts it
# alone). The NVSHMEM kernels are compiled and run by the GPU check's nvshmem step, not here.
# Node ids relative to correctness/; an entry ending in "::" takes the whole file, one with
# "[...]" that parametrisation, one without it every parametrisation.
# correctness/test_gpu_check.py checks that each entry names collected tests.
GPU_TIER = (
    "test_goal_shapes.py::",
    "test_mla_decode.py::test_decode_production_geometry_default_splits",
    "test_adapters.py::test_flashmla_layout_equals_the_plain_call[bf16-2-True]",
    "test_adapters.py::test_split_caches_equal_the_fused_cache[bf16]",
    "test_adapters.py::test_padded_tables_take_any_power_of_two_page[1]",
    "test_device_placement.py::test_launchers_reject_a_cpu_tensor_when_compiled",
    "test_holder_requester.py::test_route_bf16_matches_reference_over_the_sent_rows",
    "test_holder_requester.py::test_dispatcher_batches_waiting_requesters_into_one_call",
    "test_holder_requester.py::test_probe_and_cost_terms",
    "test_mla_sparse.py::test_the_gather_seesaw_matches_fp64",
    "test_cuda_graph.py::",
)


# The long tier: (file, module fixture) pairs; a test of that file using that fixture is long.
# perf/gpu_check.sh --dry-run (``dry_run``) and perf/gpu_tiles.sh --dry-run (``tiles_dry_run``)
# run every step of the GPU check and every tile candidate in the interpreter (the fixtures took
# 125 s and 153 s in a suite run on this 2-core machine at a load of ~10): they rehearse a GPU
# run's commands, whose kernels, benches and tier the rest of the suite checks one by one.
# ``nvshmem_device_bitcode`` (below): the sm_90 compiles against NVSHMEM's device bitcode, of the
# opt-in ``nvshmem`` backend that no default path launches (the device route's kernels, the FP8
# holder kernel's, the engine's put / wait / poll): linking the bitcode costs ~3-5 s of a CPU a
# kernel, 14 kernels, most of the ~110 s their three tests took in a loaded suite run with a cold
# Triton cache; the same route and holder kernels on the ``local`` backend stay in ``make test``,
# and make test-long (CI) compiles the NVSHMEM ones. ``planted_run``: every planted defect of
# correctness/planted.py in a copy of the tree, its tests run there (and once unchanged, the
# control): minutes of reruns of tests the suite runs anyway, to show they catch each defect.
# ``suite_dry_run``: perf/gpu_suite.sh --dry-run, the whole suite collected (~30-60 s).
# ``route_dry_run``: perf/gpu_route.sh --dry-run, the device route's bench interpreted;
# ``fastpath_dry_run`` (and ``_off``, its outputs 1% off): perf/gpu_fastpath.sh --dry-run.
# ``random_run``: the property tests of the model, the predicate, the wire, the merge and RoPE
# under the ``random`` Hypothesis profile (new draws each run, 100 examples each).
LONG_TIER = (
    ("test_gpu_check.py", "dry_run"),
    ("test_gpu_check.py", "tiles_dry_run"),
    ("test_gpu_check.py", "route_dry_run"),
    ("test_gpu_check.py", "fastpath_dry_run"),
    ("test_gpu_check.py", "fastpath_dry_run_off"),
    ("test_compile_sm90.py", "nvshmem_device_bitcode"),
    ("test_transport.py", "nvshmem_device_bitcode"),
    ("test_nvshmem_kernels.py", "nvshmem_device_bitcode"),
    ("test_planted_defects.py", "planted_run"),
    ("test_gpu_check.py", "suite_dry_run"),
    ("test_random_properties.py", "random_run"),
)
MQNC_TEST_LONG = "MQNC_TEST_LONG"


def _rel(nodeid: str) -> str:
    return nodeid.split("correctness/", 1)[-1]


def _matches(nodeid: str, tier: tuple[str, ...]) -> bool:
    rel = _rel(nodeid)
    return any(
        rel.startswith(entry)
        if entry.endswith("::")
        else rel == entry
        if "[" in entry
        else rel.split("[", 1)[0] == entry
        for entry in tier
    )


def in_gpu_tier(nodeid: str) -> bool:
    """Whether a test (``correctness/<file>::<name>[<params>]``) is in :data:`GPU_TIER`."""
    return _matches(nodeid, GPU_TIER)


def long_fixture(item) -> str | None:
    """The :data:`LONG_TIER` fixture a collected test uses, or None."""
    here = _rel(item.nodeid).split("::", 1)[0]
    names = getattr(item, "fixturenames", ())
    return next((fx for f, fx in LONG_TIER if f == here and fx in names), None)


def _runs_long(config, item) -> bool:
    """Long tests run when asked for: ``MQNC_TEST_LONG=1``, or their file named on the command
    line (``pytest correctness/test_gpu_check.py``); under any ``-m`` (``-m long``, ``-m "not
    long"``) the marker expression decides."""
    if os.environ.get(MQNC_TEST_LONG, "") not in ("", "0"):
        return True
    if config.getoption("-m"):  # the marker expression decides (-m long, -m "not long")
        return True
    named = {os.path.realpath(a.split("::", 1)[0]) for a in config.args}
    return os.path.realpath(str(item.path)) in named


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

    files = {_rel(item.nodeid).split("::", 1)[0] for item in items}
    used = {long_fixture(item) for item in items}
    for f, fx in LONG_TIER:  # a renamed fixture must not leave the tier silently
        if f in files and fx not in used and not config.getoption("-k"):
            raise pytest.UsageError(f"conftest LONG_TIER: no test of {f} uses {fx!r}")
    kept, long_out = [], []
    for item in items:
        if in_gpu_tier(item.nodeid):
            item.add_marker(pytest.mark.gpu)
        fixture = long_fixture(item)
        if fixture:
            item.add_marker(pytest.mark.long)
            item.add_marker(pytest.mark.xdist_group(fixture))  # --dist loadgroup: one per fixture
            if not _runs_long(config, item):
                long_out.append(item)
                continue
        kept.append(item)
    if long_out:  # reported as "N deselected"; make test-long runs them
        config.hook.pytest_deselected(items=long_out)
        items[:] = kept
    if config.getoption("-m") == "gpu":  # the tier runs in its listed order: kernels first
        items.sort(key=rank)


@pytest.fixture(scope="session")
def nvshmem_device_bitcode() -> str:
    """Path of NVSHMEM's device bitcode for sm_90 (``libnvshmem_device.bc``, the
    ``nvidia-nvshmem`` wheel); the test is skipped where it is not installed. A test using it
    compiles against it: it is in :data:`LONG_TIER`."""
    from mqnc.transport.nvshmem import device_library_path

    try:
        return device_library_path(90)
    except RuntimeError as exc:
        pytest.skip(f"NVSHMEM's device bitcode is not installed: {exc}")
