"""Planted defects: small source mutations the suite must catch, and the harness that plants them.

Each :class:`Planted` names one file of the package, one exact piece of its source, what that
piece becomes (a defect a kernel or a model could plausibly carry: a loop bound, a rounding
mode, a sign, a mask, a checksum), and the tests that must fail with it. :func:`run` copies the
tracked tree (the working tree's contents) into a temporary directory, plants the defect there
(the original is never touched, so other tests may run meanwhile), runs those tests in a fresh
Python whose imports resolve to the copy, and reports whether they failed: caught. A planted
defect that survives is a missing test.

``make test-long`` runs every one (``correctness/test_planted_defects.py``); by hand::

    python correctness/planted.py            # all: "caught N of N"
    python correctness/planted.py merge-max  # one, by name

Curated rather than generated: a generic mutation tool (mutmut, cosmic-ray) mutates every
operator of every file and reruns the suite for each, which under Triton's interpreter would take
days, and it cannot tell the mutations of a kernel that matter (a loop bound, a store's rounding)
from those that only slow it; each entry here is one the package's exactness claims depend on.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900  # a bound on one planted defect's tests, never a speed check

__all__ = ["Planted", "PLANTED", "Outcome", "run", "run_all", "main"]


@dataclasses.dataclass(frozen=True)
class Planted:
    """One defect: in ``path`` (from the repository root), ``old`` (occurring exactly once)
    becomes ``new``; ``tests`` (pytest node ids or ``file -k expr`` selections, relative to
    ``correctness/``) must fail; ``why``: what the defect breaks."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str


PLANTED: tuple[Planted, ...] = (
    Planted(
        "merge-max",
        "triton_kernels/merge/partials.py",
        "    for m0 in range(0, M, LSE_BLOCK):\n        x = tl.load(lse_row",
        "    for m0 in range(0, LSE_BLOCK, LSE_BLOCK):\n        x = tl.load(lse_row",
        ("test_merge.py::test_many_partials_beyond_one_lse_block",),
        "the merge's row max over the first 256 partials only: exp(lse - max) overflows when "
        "a larger lse sits further on (inf lse, NaN o)",
    ),
    Planted(
        "merge-fold-order",
        "triton_kernels/merge/partials.py",
        '            x = tl.load(lse_row + i * stride_lm, mask=i < M, other=-float("inf"))',
        '            x = tl.load(lse_row + i * stride_lm, mask=i < M - 1, other=-float("inf"))',
        ("test_merge.py -k 'matches_reference or empty or beyond'",),
        "the merge drops its last partial",
    ),
    Planted(
        "decode-bf16-truncating-store",
        "triton_kernels/mla/decode.py",
        "BF16_RNE=bf16_rne_in_software(o_part.dtype, o_part.device),",
        "BF16_RNE=False,",
        ("test_mla_decode.py::test_decode_matches_fp64_reference",),
        "the dense kernel's bf16 output truncated instead of rounded to nearest (a whole ulp "
        "off where half is due)",
    ),
    Planted(
        "decode-softmax-scale",
        "triton_kernels/mla/decode.py",
        "scale * LOG2E",
        "scale * LOG2E * 1.001",
        ("test_mla_decode.py::test_decode_matches_fp64_reference",),
        "the dense kernel's softmax scale off by 0.1%",
    ),
    Planted(
        "sparse-index-zero",
        "triton_kernels/mla/sparse.py",
        "    valid = idx >= 0\n",
        "    valid = idx > 0\n",
        (
            "test_mla_sparse.py::test_sparse_matches_fp64_reference",
            "test_mla_sparse.py::test_sparse_wide_tiles_match_fp64",
        ),
        "the sparse kernel drops the cache's first entry (index 0 read as unused)",
    ),
    Planted(
        "splice-sign",
        "triton_kernels/splice/rotate.py",
        "    y1 = x1 * c - x2 * s\n    y2 = x2 * c + x1 * s\n",
        "    y1 = x1 * c + x2 * s\n    y2 = x2 * c - x1 * s\n",
        ("test_splice.py::test_splice_matches_reference",),
        "the splice rotates by -delta (the RoPE part moved the wrong way)",
    ),
    Planted(
        "wire-crc-unchecked",
        "mqnc/transport/wire.py",
        "        if got != h.payload_crc:\n",
        "        if got != h.payload_crc and False:\n",
        ("test_wire.py",),
        "a payload whose checksum does not match is accepted",
    ),
    Planted(
        "predicate-allow-grid",
        "mqnc/cost/predicate.py",
        "        if name not in req.allow:\n            stack[i] = np.inf\n",
        "        if name not in req.allow:\n            pass\n",
        ("test_predicate.py -k 'grid'",),
        "decide_grid ignores a restricted allow (the scalar decide honours it)",
    ),
    Planted(
        "fp8-scale-group",
        "triton_kernels/fp8/quant.py",
        "+ g, mask=mask, other=1.0)",
        "+ 0, mask=mask, other=1.0)",
        ("test_fp8_cache.py",),
        "every FP8 latent value dequantized with its entry's first scale",
    ),
    Planted(
        "pass-pack",
        "triton_kernels/route/holder_pass.py",
        "    off = base + ahead\n",
        "    off = base\n",
        ("test_device_route.py -k 'packs_one_chunk'",),
        "the holder's pass packs every request of one (chunk, layer) at its key's first row: "
        "their rows overwrite each other, all but the last answered with another's partial",
    ),
)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What planting one defect gave: ``caught`` (its tests failed), the pytest exit code, the
    seconds, and the tail of pytest's output."""

    planted: Planted
    caught: bool
    returncode: int
    seconds: float
    tail: str


def _copy_tree(dst: Path) -> None:
    """The working tree's files (tracked, and new ones git does not ignore) under ``dst``; the
    package laid out
    as installed (``mqnc.triton_kernels`` is the top-level ``triton_kernels/`` folder: a link
    inside the copy's ``mqnc/``), so that a Python started in ``dst`` imports the copy."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    for rel in filter(None, (f.decode() for f in files)):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    (dst / "mqnc" / "triton_kernels").symlink_to(dst / "triton_kernels", target_is_directory=True)


def _plant(tree: Path, p: Planted) -> None:
    path = tree / p.path
    text = path.read_text()
    n = text.count(p.old)
    if n != 1:
        raise ValueError(f"{p.name}: expected {p.old!r} once in {p.path}, found it {n} times")
    path.write_text(text.replace(p.old, p.new))


def _pytest_args(tests: tuple[str, ...]) -> list[list[str]]:
    """One pytest argument list per selection (``file -k expr`` or a node id)."""
    out = []
    for t in tests:
        if " -k " in t:
            f, expr = t.split(" -k ", 1)
            out.append([f"correctness/{f.strip()}", "-k", expr.strip().strip("'\"")])
        else:
            out.append([f"correctness/{t}"])
    return out


_WHERE = (
    "import mqnc.triton_kernels.merge.partials as m, mqnc.cost as c; print(m.__file__, c.__file__)"
)


def run(p: Planted, *, plant: bool = True) -> Outcome:
    """Plant ``p`` in a copy of the tree and run its tests there (one process each, ``-x``);
    ``plant=False``: the same tests on the unchanged copy (the control: they must pass)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mqnc-planted-{p.name}-") as tmp:
        tree = Path(tmp).resolve()
        _copy_tree(tree)
        if plant:
            _plant(tree, p)
        # Hypothesis's "planted" profile: the ci draws without the shrink phase (a caught defect
        # needs one failing example, not the smallest: shrinking interpreted kernels takes minutes)
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1",
                   HYPOTHESIS_PROFILE="planted")  # fmt: skip
        env.pop("PYTEST_XDIST_WORKER", None)
        env.pop("PYTEST_ADDOPTS", None)
        where = subprocess.run([sys.executable, "-c", _WHERE], cwd=tree, env=env,
                               capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
        files = where.stdout.split()
        if where.returncode or not files or not all(f.startswith(str(tree)) for f in files):
            raise RuntimeError(f"{p.name}: the copy's package is not the one imported: "
                               f"{where.stdout}{where.stderr[-1000:]}")  # fmt: skip
        failed, codes, tails = False, [], []
        for args in _pytest_args(p.tests):
            r = subprocess.run(
                [sys.executable, "-m", "pytest", *args, "-x", "-q", "-p", "no:cacheprovider",
                 "-p", "no:randomly", "-o", "addopts="],
                cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
            )  # fmt: skip
            codes.append(r.returncode)
            tails.append((r.stdout + r.stderr)[-1500:])
            if r.returncode == 5:  # no test collected: the selection is stale, not a catch
                raise ValueError(f"{p.name}: {' '.join(args)} selects no test")
            if r.returncode == 1:  # tests failed: caught (2+ are usage / internal errors)
                failed = True
                break
            if r.returncode != 0:
                raise RuntimeError(f"{p.name}: pytest exited {r.returncode}:\n{tails[-1]}")
    return Outcome(p, failed, codes[-1], time.monotonic() - start, "\n".join(tails)[-3000:])


def run_all(names: list[str] | None = None) -> list[Outcome]:
    """Every planted defect (or those named), in order, after the control: all their tests on
    the unchanged copy, which must pass (else a failure would be counted as a catch)."""
    chosen = [p for p in PLANTED if not names or p.name in names]
    unknown = set(names or ()) - {p.name for p in PLANTED}
    if unknown:
        have = [p.name for p in PLANTED]
        raise ValueError(f"names: no planted defect {sorted(unknown)} (have {have})")
    tests = tuple(dict.fromkeys(t for p in chosen for t in p.tests))
    control = run(Planted("control", "", "", "", tests, "nothing planted"), plant=False)
    if control.caught:
        raise RuntimeError(
            f"the control failed: the tests fail on the unchanged tree\n{control.tail}"
        )
    return [run(p) for p in chosen]


def main(argv: list[str] | None = None) -> int:
    outcomes = run_all(list(argv if argv is not None else sys.argv[1:]))
    for o in outcomes:
        mark = "caught  " if o.caught else "SURVIVED"
        print(f"{mark} {o.planted.name:<30} {o.seconds:6.1f} s  {o.planted.why}")
    caught = sum(o.caught for o in outcomes)
    print(f"caught {caught} of {len(outcomes)}")
    return 0 if caught == len(outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
