"""Evidence before default: the GPU record that verified each Gluon kernel, by its source.

Gluon kernels do not run under Triton's interpreter, so the CPU test suite cannot show one exact.
A Gluon kernel becomes a default of the dispatch table (:mod:`mqnc.triton_kernels.dispatch`)
only while its device code is the code a GPU run checked against fp64 and timed: each entry of
:data:`VERIFIED` holds the kernel's **fingerprint** at that run and the records the run wrote
(``perf/results/results.jsonl``, found by commit, device, bench and variant). A change to the
kernel's device code changes its fingerprint; the kernel is then no longer a default (the
dispatch serves its cases with the portable ``tl`` kernel and says why) until a new GPU run
records the new fingerprint (``perf/gpu_fastpath.sh`` writes it into each Gluon record,
``extra.fingerprint``). ``correctness/test_dispatch.py`` fails while a Gluon kernel that the
table names as a default has a fingerprint no record verified.

The fingerprint of a kernel is the SHA-256 of its device code: the ``@gluon.jit`` kernel
function and every module-level function and constant of its module that it reaches by name,
transitively, each as its syntax tree without docstrings (``ast.dump``: comments, formatting,
line numbers and the module's imports and docstring do not count; any change to an expression,
a constant, a layout, a helper's body or a new helper reached does). The launcher (grid,
descriptors, constexprs) is host code, checked on the CPU by the launch-argument tests and the
launch-exact sm_90 compiles (``correctness/test_compile_sm90.py``).

Evidence is also per Triton version: the code a GPU verified was compiled by the Triton named in
the entry (``triton``: major, minor); another Triton may compile it to other code (or refuse it),
so the table treats the kernel as unverified there.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
from pathlib import Path

__all__ = [
    "Evidence",
    "KERNELS",
    "VERIFIED",
    "current_fingerprint",
    "fingerprint",
    "kernel_source",
    "verified",
    "why_unverified",
]

_HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Evidence:
    """One GPU verification of a Gluon kernel.

    ``kernel``: the dispatch table's name of it; ``module`` / ``function``: where its device code
    lives (a file under ``triton_kernels/``, the ``@gluon.jit`` entry point); ``fingerprint``:
    :func:`fingerprint` of that code as verified; ``triton``: the ``(major, minor)`` that
    compiled it; ``device``: the GPU; ``commit``: the tree the run measured; ``records``: the
    ``(bench, variant)`` of the records that run wrote (the fp64 check's verdict is each
    record's ``extra.vs_fp64.ok``)."""

    kernel: str
    module: str
    function: str
    fingerprint: str
    triton: tuple[int, int]
    device: str
    commit: str
    records: tuple[tuple[str, str], ...]


VERIFIED: dict[str, Evidence] = {
    e.kernel: e
    for e in (
        Evidence(
            kernel="mla_decode_gluon[seesaw]",
            module="mla/gluon_kernels.py",
            function="gluon_mla_seesaw_kernel",
            fingerprint="e9a5c1a38db0a54b2c8bcb0d17eb6d93b51d25af2246483f046a559502c9f051",
            triton=(3, 6),
            device="NVIDIA H200",
            commit="933b242ea5f9",
            records=(
                ("mla_decode_gluon", "H=128,B=64@seesaw"),
                ("mla_decode_gluon", "H=128,B=8@seesaw"),
                ("mla_decode_gluon", "H=128,B=128@seesaw"),
            ),
        ),
    )
}
"""The Gluon kernels a GPU run verified, by the dispatch table's kernel name. The see-saw was
checked against fp64 (128 heads over lengths 1 / 65 / 200, split and unsplit; 16 heads; ``s_q``
2 causal; pages past each length NaN, unused table entries -1) and timed at 506-578 TFLOP/s
(H 128) by ``perf/gpu_gluon.sh`` on an H200 under triton 3.6.0 at commit 933b242."""


KERNELS: dict[str, tuple[str, str]] = {
    "mla_decode_gluon[seesaw]": ("mla/gluon_kernels.py", "gluon_mla_seesaw_kernel"),
    "mla_decode_gluon[seesaw-split]": ("mla/gluon_kernels.py", "gluon_mla_seesaw_split_kernel"),
    "mla_sparse_gluon[seesaw]": ("mla/gluon_kernels.py", "gluon_mla_sparse_seesaw_kernel"),
    "mla_decode_gluon[seesaw-fp8]": ("mla/gluon_kernels.py", "gluon_mla_seesaw_fp8_kernel"),
    "mla_sparse_gluon[seesaw-fp8]": ("mla/gluon_kernels.py", "gluon_mla_seesaw_fp8_kernel"),
}
"""Every Gluon kernel the dispatch table names, by name: ``(module, function)`` of its device
code (what :func:`current_fingerprint` hashes; a GPU run records it beside its results)."""


def kernel_source(module: str) -> str:
    """The text of ``module`` (a path under ``triton_kernels/``), read, not imported (importing
    a Gluon module needs a Triton with Gluon)."""
    return (_HERE / module).read_text()


def _without_docstring(node: ast.AST) -> ast.AST:
    body = getattr(node, "body", None)
    if (
        isinstance(body, list)
        and body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        node.body = body[1:] or [ast.Pass()]
    return node


def _definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level functions and assigned names (constants, layouts) by name."""
    defs: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    defs[t.id] = node
    return defs


def fingerprint(source: str, function: str) -> str:
    """SHA-256 (hex) of ``function``'s device code in ``source`` (module docstring): the
    function and every module-level definition it reaches by name, transitively, as syntax
    trees without docstrings, in name order. ``ValueError`` when ``source`` defines no
    ``function``."""
    defs = _definitions(ast.parse(source))
    if function not in defs:
        raise ValueError(f"function: expected a module-level definition, got {function!r}")
    reached, todo = set(), [function]
    while todo:
        name = todo.pop()
        if name in reached or name not in defs:
            continue
        reached.add(name)
        for node in ast.walk(defs[name]):
            if isinstance(node, ast.Name) and node.id in defs:
                todo.append(node.id)
    h = hashlib.sha256()
    for name in sorted(reached):
        node = _without_docstring(ast.parse(ast.unparse(defs[name])).body[0])
        h.update(name.encode() + b"\0" + ast.dump(node, include_attributes=False).encode())
    return h.hexdigest()


@functools.cache
def current_fingerprint(kernel: str) -> str:
    """The fingerprint of ``kernel``'s device code as it is in this tree (cached per process:
    the source does not change under a running program)."""
    module, function = KERNELS[kernel]
    return fingerprint(kernel_source(module), function)


def why_unverified(kernel: str, triton_version: tuple[int, int] | None = None) -> str | None:
    """None when ``kernel`` is verified for this tree (and ``triton_version``, when given), else
    why not, in one sentence."""
    e = VERIFIED.get(kernel)
    if e is None:
        return (
            f"{kernel} has no GPU record against fp64 yet (perf/gpu_fastpath.sh checks it, "
            f"forced, and records its fingerprint)"
        )
    now = current_fingerprint(kernel)
    if now != e.fingerprint:
        return (
            f"{kernel}'s device code changed since the GPU run that verified it (fingerprint "
            f"{now[:12]}, verified {e.fingerprint[:12]} at {e.commit} on {e.device}): a new "
            f"GPU record against fp64 is needed before it is a default"
        )
    if triton_version is not None and tuple(triton_version[:2]) != e.triton:
        return (
            f"{kernel} was verified under triton {e.triton[0]}.{e.triton[1]}, this is "
            f"triton {triton_version[0]}.{triton_version[1]}"
        )
    return None


def verified(kernel: str, triton_version: tuple[int, int] | None = None) -> bool:
    """True when ``kernel`` may be a default here (:func:`why_unverified` is None)."""
    return why_unverified(kernel, triton_version) is None
