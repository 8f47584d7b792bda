"""The suite catches what it claims to: every defect in ``correctness/planted.py``, planted alone
in a copy of the tree, makes its tests fail (the long tier: ``make test-long``).

The harness first runs every selection on the unchanged copy (the control), so a test that fails
anyway is never counted as a catch; each outcome is printed as the harness's own report does.
"""

from __future__ import annotations

import pytest
from planted import PLANTED, main, run_all


@pytest.fixture(scope="module")
def planted_run():
    """Every planted defect's outcome, by name (one run of the harness: minutes)."""
    return {o.planted.name: o for o in run_all()}


@pytest.mark.parametrize("name", [p.name for p in PLANTED])
def test_each_planted_defect_is_caught(planted_run, name):
    o = planted_run[name]
    print(f"{name}: {'caught' if o.caught else 'SURVIVED'} in {o.seconds:.1f} s ({o.planted.why})")
    assert o.caught, f"{name} survived its tests {o.planted.tests}: a missing test\n{o.tail}"


def test_the_report_says_caught_n_of_n(planted_run, capsys, monkeypatch):
    """``python correctness/planted.py`` prints one line per defect and "caught N of N" (here
    from the outcomes already run)."""
    import planted

    monkeypatch.setattr(planted, "run_all", lambda names=None: list(planted_run.values()))
    assert main([]) == 0
    out = capsys.readouterr().out
    assert f"caught {len(PLANTED)} of {len(PLANTED)}" in out


def test_a_planted_defect_names_a_unique_piece_of_source():
    """Each defect's ``old`` occurs exactly once in its file (a stale entry is an error, not a
    defect silently not planted): checked without running anything."""
    from planted import ROOT

    for p in PLANTED:
        n = (ROOT / p.path).read_text().count(p.old)
        assert n == 1, f"{p.name}: {p.old!r} occurs {n} times in {p.path}"
