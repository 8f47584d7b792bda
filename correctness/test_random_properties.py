"""The property tests with new draws: the ``ci`` profile that ``make test`` uses is derandomized
at 25 examples (every run draws the same); here (the long tier, ``make test-long``) the property
files of the cost model, the predicate, the split policy, the wire, the merge and RoPE run under
the ``random`` profile (``correctness/conftest.py``: 100 examples, a new seed each run). A
failure prints the seed (``--hypothesis-seed``) and Hypothesis's reproduction blob."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = ("test_costmodel.py", "test_predicate.py", "test_grid.py", "test_wire.py",
         "test_merge.py", "test_rope.py")  # fmt: skip


@pytest.fixture(scope="module")
def random_run():
    """One run of the property files under the ``random`` profile: (seed, pytest's result)."""
    seed = random.SystemRandom().randrange(2**32)
    env = dict(os.environ, HYPOTHESIS_PROFILE="random")
    env.pop("PYTEST_XDIST_WORKER", None)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *(f"correctness/{f}" for f in FILES), "-q",
         "-p", "no:cacheprovider", "-m", "not long", f"--hypothesis-seed={seed}",
         "--hypothesis-show-statistics"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    return seed, r


def test_properties_hold_for_new_draws(random_run):
    seed, r = random_run
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, f"--hypothesis-seed={seed} (HYPOTHESIS_PROFILE=random):\n{tail}"
    # Hypothesis's statistics: the properties drew the profile's 100 examples (not the ci's 25)
    assert "passed" in r.stdout and "settings.max_examples=100" in r.stdout, tail
