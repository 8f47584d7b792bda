"""The sizes the project holds itself to: no class over 300 and no function over 80 code lines.

An AST walk of every module in ``mqnc/``, ``triton_kernels/`` and ``perf/`` measures every class
and every function (methods and nested functions included). A node's code lines are the lines
from its ``def``/``class`` line (the signature; decorators are not counted) to its last line that
carry a token of code: blank lines, comment-only lines and docstrings (of the node and of
everything nested in it) do not count; the lines of any other multi-line string do. The test
fails listing every offender with its count and location.

``ALLOWED`` holds the offenders that sit in files another contributor is changing now, each with
its exact current count: the entry passes only at that count or below it, so a function on the
list that grows fails, and an entry whose node shrank to the limit or went away fails too, so the
list cannot outlive its reason.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("mqnc", "triton_kernels", "perf")
MAX_CLASS = 300
MAX_FUNCTION = 80

# (path, qualified name) -> its exact code lines, for a node over the limit while its split is under
# way (the entry goes when it lands). Empty: every node is within the limits.
ALLOWED: dict[tuple[str, str], int] = {}

_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _code_lines(source: str) -> set[int]:
    """The line numbers that carry at least one token of code (multi-line tokens: every line)."""
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _NOT_CODE:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def _docstring_lines(tree: ast.Module) -> set[int]:
    """The lines of every docstring: module, class and function."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, *_DEFS)) or not node.body:
            continue
        first = node.body[0]
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _measure(path: Path) -> list[tuple[str, str, int, int]]:
    """(kind, qualified name, first line, code lines) for every class and function in ``path``."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    code = _code_lines(source) - _docstring_lines(tree)
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _DEFS):
                name = f"{prefix}{child.name}"
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                n = sum(1 for line in range(child.lineno, child.end_lineno + 1) if line in code)
                out.append((kind, name, child.lineno, n))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _sizes() -> list[tuple[str, str, str, int, int]]:
    """(path, kind, qualified name, first line, code lines) over every module measured."""
    rows = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            rows.extend((rel, *row) for row in _measure(path))
    return rows


SIZES = _sizes()


def test_the_walk_sees_the_package():
    """The walk found modules in every folder, and both kinds of node."""
    paths = {row[0] for row in SIZES}
    for folder in FOLDERS:
        assert any(p.startswith(f"{folder}/") for p in paths), f"no module measured in {folder}/"
    assert {row[1] for row in SIZES} == {"class", "function"}


def test_counting_excludes_docstrings_comments_and_blank_lines(tmp_path):
    """The count on a known snippet: signature and body lines only."""
    path = tmp_path / "m.py"
    path.write_text(
        '"""Module."""\n'
        "\n"
        "class A:\n"
        '    """Doc\n'
        '    on two lines."""\n'
        "\n"
        "    # a comment\n"
        "    x = 1\n"
        "\n"
        "    @staticmethod\n"
        "    def f(a,\n"
        "          b):\n"
        '        """Doc."""\n'
        "        s = '''not a\n"
        "        docstring'''\n"
        "        def g():\n"
        "            return s  # trailing comment\n"
        "        return g\n"
    )
    got = {name: (kind, line, n) for kind, name, line, n in _measure(path)}
    assert got == {
        "A": ("class", 3, 10),
        "A.f": ("function", 11, 7),
        "A.f.g": ("function", 16, 2),
    }


def test_no_class_or_function_over_the_limits():
    """Every class within 300 code lines and every function within 80, but for ``ALLOWED``."""
    offenders = []
    seen = set()
    for path, kind, name, line, n in SIZES:
        limit = MAX_CLASS if kind == "class" else MAX_FUNCTION
        allowed = ALLOWED.get((path, name))
        if allowed is not None:
            seen.add((path, name))
            if n > allowed:
                offenders.append(f"{path}:{line} {kind} {name}: {n} code lines (allowed {allowed})")
            elif n <= limit:
                offenders.append(
                    f"{path}:{line} {kind} {name}: {n} code lines, within {limit}: "
                    "remove its ALLOWED entry"
                )
        elif n > limit:
            offenders.append(f"{path}:{line} {kind} {name}: {n} code lines (limit {limit})")
    offenders.extend(
        f"{path} {name}: ALLOWED but not found: remove its entry"
        for path, name in sorted(set(ALLOWED) - seen)
    )
    if offenders:
        pytest.fail(f"{len(offenders)} over the size limits:\n" + "\n".join(offenders))
