"""The package's layout: every import points down the layers that ``mqnc/__init__.py`` lists.

An AST walk of every module in ``mqnc/`` and ``triton_kernels/`` (function-local imports
included; imports under ``if TYPE_CHECKING:`` never run and are skipped) checks that a module
imports only its own subpackage and the layers below it; that the kernels import nothing of mqnc
above the kernel layer; that the cost model imports no torch (also checked at run time, in a
fresh interpreter); that nothing imports the CLI; that nothing edits ``sys.path``; that
``pyproject.toml`` installs every subpackage; that no two modules import each other, directly or
through others; and that no code, test or doc cites an issue number.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top. A module may import its own subpackage and any lower layer, nothing else (not
# even a sibling subpackage of the same layer).
LAYERS = {
    "mqnc.base": 0,
    "mqnc.triton_kernels": 1,
    "mqnc.reference": 1,
    "mqnc.testing": 1,
    "mqnc.model": 2,
    "mqnc.transport": 3,
    "mqnc.cost": 3,
    "mqnc.serving": 4,
    "mqnc.measure": 5,
    "mqnc.integrations": 5,  # other people's models over holders; the demo layer uses it
    "mqnc.demo": 6,
    "mqnc.plots": 6,
    "mqnc.cli": 7,
    "mqnc.__main__": 8,  # ``python -m mqnc``: runs the CLI
}
ROOT_MODULE = "mqnc"  # __version__ and the layout map only: importable from every layer


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the installed package ``mqnc``."""
    out = {}
    for path in sorted((ROOT / "mqnc").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(p for p in parts if p != "__init__")] = path
    for path in sorted((ROOT / "triton_kernels").rglob("*.py")):
        parts = ("mqnc", *path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(p for p in parts if p != "__init__")] = path
    return out


MODULES = _modules()


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import statement that can run."""
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from pkg import submodule`` imports the submodule; ``pkg`` itself is named only
            # for a name its ``__init__`` defines (or ``*``)
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in MODULES]
            if len(subs) < len(node.names):
                found.append((module, node.lineno))
            found.extend((sub, node.lineno) for sub in subs)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _layer(module: str) -> str | None:
    """The layer (a key of LAYERS) a module of mqnc belongs to, None for the root."""
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return None


def test_every_module_belongs_to_a_layer():
    loose = [m for m in MODULES if m != ROOT_MODULE and _layer(m) is None]
    assert not loose, f"modules outside every layer (add them to a subpackage): {loose}"


def test_no_import_runs_uphill_or_sideways():
    bad = []
    for name, path in MODULES.items():
        mine = _layer(name)
        if mine is None:  # the root's __init__: the version and the layout map
            assert not [m for m, _ in _imports(name, path) if m.startswith("mqnc")], name
            continue
        for module, line in _imports(name, path):
            if not (module == "mqnc" or module.startswith("mqnc.")):
                continue
            theirs = _layer(module)
            if theirs is None or theirs == mine or LAYERS[theirs] < LAYERS[mine]:
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: {name} ({mine}) imports {module}")
    assert not bad, "imports that do not point down the layers:\n" + "\n".join(bad)


def _packages_above(module: str) -> list[str]:
    """The packages of mqnc that contain ``module`` (``mqnc.cost.terms``: ``mqnc.cost``,
    ``mqnc``): importing a module runs their ``__init__`` first."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in MODULES]


def _import_graph() -> dict[str, dict[str, int]]:
    """``{module: {module it imports: line}}`` over every module of mqnc and the kernels.

    An import statement reaches the module it names (:func:`_imports`: ``from pkg import sub``
    is ``pkg.sub``; ``pkg``'s ``__init__`` only for a name the ``__init__`` defines) and the
    packages above that, except the packages that hold the importer itself: those are already
    being imported when it runs, so that a package's ``__init__`` importing its own submodules
    is no cycle. Function-local imports count as module-level ones do.
    """
    graph: dict[str, dict[str, int]] = {}
    for name, path in MODULES.items():
        own = set(_packages_above(name)) | {name}
        edges: dict[str, int] = {}
        for module, line in _imports(name, path):
            if module not in MODULES:
                continue
            for target in (module, *_packages_above(module)):
                if target != name and (target == module or target not in own):
                    edges.setdefault(target, line)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Import cycles of ``graph``, each a path ``[a, b, ..., a]``: for every module on a cycle,
    the shortest one through it (breadth-first), each cycle reported once."""
    found: dict[tuple[str, ...], list[str]] = {}
    for start in sorted(graph):
        parent: dict[str, str] = {}
        frontier, closed = [start], False
        while frontier and not closed:
            nxt = []
            for node in frontier:
                for target in sorted(graph.get(node, {})):
                    if target == start:
                        parent[start], closed = node, True
                        break
                    if target not in parent:
                        parent[target] = node
                        nxt.append(target)
                if closed:
                    break
            frontier = nxt
        if not closed:
            continue
        path, node = [start], parent[start]
        while node != start:
            path.append(node)
            node = parent[node]
        path.reverse()  # start, ..., the module that imports start
        i = path.index(min(path))
        key = tuple(path[i:] + path[:i])
        found.setdefault(key, [*key, key[0]])
    return list(found.values())


def test_no_two_modules_import_each_other():
    """No import cycle among the modules of mqnc and the kernels, direct or through others
    (module-level and function-local imports alike)."""
    graph = _import_graph()
    lines = []
    for cycle in _cycles(graph):
        steps = [
            f"{MODULES[a].relative_to(ROOT)}:{graph[a][b]}: {a} imports {b}"
            for a, b in zip(cycle[:-1], cycle[1:], strict=True)
        ]
        lines.append(" -> ".join(cycle) + "\n    " + "\n    ".join(steps))
    assert not lines, "import cycles:\n" + "\n".join(lines)


def test_the_cycle_search_finds_cycles_and_only_real_ones(tmp_path):
    """The search itself: a cycle through three modules, a direct one and none in a chain; and
    ``from pkg import submodule`` inside ``pkg`` is an edge to the submodule, while a name that
    ``pkg``'s ``__init__`` defines is an edge to the ``__init__``."""
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {"e": 5}, "e": {"d": 6},
             "f": {"a": 7}}  # fmt: skip
    assert sorted(_cycles(graph)) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []
    src = tmp_path / "requester.py"
    src.write_text("from mqnc.serving import policy\nfrom mqnc.serving import Requester, pool\n")
    got = _imports("mqnc.serving.requester", src)
    assert got == [("mqnc.serving.policy", 1), ("mqnc.serving", 2), ("mqnc.serving.pool", 2)]
    assert _packages_above("mqnc.cost.terms") == ["mqnc.cost", "mqnc"]


# An issue cited by number ("issue", "issues", "Issue #", "issue-" then digits, even across a
# line break or a comment's "#"; or "(#" digits ")"): a pointer nobody reading the tree can follow.
_ISSUE_REF = re.compile(r"\bissues?[\s#-]*\d+|\(#\d+\)", re.IGNORECASE)
_TEXT_ROOTS = ("mqnc", "triton_kernels", "perf", "correctness", "notebooks", "docs", ".ci")
_TEXT_FILES = ("README.md", "Makefile", "pyproject.toml")


def _text_files() -> list[Path]:
    """Every text file of the code, tests, benchmarks, notebooks and docs (binary files, such as
    the docs' figures, and caches left out)."""
    out = [ROOT / name for name in _TEXT_FILES]
    for folder in _TEXT_ROOTS:
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            try:
                path.read_text()
            except UnicodeDecodeError:
                continue
            out.append(path)
    return [p for p in out if p.exists()]


def _issue_refs(text: str) -> list[tuple[int, str]]:
    """``(line, match)`` for every issue number cited in ``text``."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in _ISSUE_REF.finditer(text)]


def test_nothing_cites_an_issue_number():
    """Code, tests, benchmarks, notebooks and docs say what a thing does and why, never "see
    issue N": the tracker is not part of the tree, so such a pointer means nothing to a reader."""
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {found!r}"
        for path in _text_files()
        for line, found in _issue_refs(path.read_text())
    ]
    why = "issue numbers cited (say what the code does and why instead):\n"
    assert not bad, why + "\n".join(bad)


def test_the_issue_search_finds_every_spelling():
    """The spellings the tree used, built here so that this file cites none: a number after
    "issue" / "issues" / "Issue #" / "issue-", across a line break and a comment's "#", and "(#"
    digits ")"; words that only look alike are not references."""
    word = "iss" + "ue"
    cited = [f"({word} 14)", f"{word}s 14 and 15", f"{word.title()} #7", f"{word}-3",
             f"(``out=``, {word}\n    14)", f"# {word}\n    # 16", "fixed (#" + "14)"]  # fmt: skip
    for text in cited:
        assert len(_issue_refs(text)) == 1, text
    assert _issue_refs(f"x\n{word} 5")[0][0] == 2
    for text in (f"{word} puts from a kernel", f"the {word}'s bound", "(#x)", "tissue 4"):
        assert not _issue_refs(text), text
    assert ROOT / "README.md" in _text_files() and Path(__file__) in _text_files()


def test_kernels_import_nothing_of_mqnc_above_the_kernel_layer():
    bad = []
    for name, path in MODULES.items():
        if _layer(name) != "mqnc.triton_kernels":
            continue
        for module, line in _imports(name, path):
            layer = _layer(module) if module.startswith("mqnc.") else None
            if layer in (None, "mqnc.base", "mqnc.triton_kernels"):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert not bad, bad


def test_nothing_imports_the_cli():
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for name, path in MODULES.items()
        if _layer(name) not in ("mqnc.cli", "mqnc.__main__")
        for module, line in _imports(name, path)
        if module == "mqnc.cli" or module.startswith("mqnc.cli.")
    ]
    assert not bad, f"the CLI is the top layer; imported by {bad}"


def test_the_cost_model_imports_no_torch():
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for name, path in MODULES.items()
        if _layer(name) == "mqnc.cost"
        for module, line in _imports(name, path)
        if module.split(".")[0] in ("torch", "triton")
    ]
    assert not bad, bad
    code = (
        "import sys; import mqnc.cost; "
        "bad = [m for m in ('torch', 'triton') if m in sys.modules]; assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_nothing_edits_sys_path():
    bad = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"sys.path used in {bad}"


def test_pyproject_installs_every_subpackage():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mqnc").rglob("__init__.py")
    }
    kernels = {
        ".".join(("mqnc", *p.parent.relative_to(ROOT).parts))
        for p in (ROOT / "triton_kernels").rglob("__init__.py")
    }
    assert listed == folders | kernels
    assert setuptools["package-dir"] == {"mqnc": "mqnc", "mqnc.triton_kernels": "triton_kernels"}


@pytest.mark.parametrize(
    ("package", "module", "exclude"),
    [("mqnc.model", ".mla", ()), ("mqnc.measure", ".echo", ("TRANSPORTS",)),
     ("mqnc.measure", ".timing", ()), ("mqnc.measure", ".sweep", ()),
     ("mqnc.transport", ".registry", ())],
)  # fmt: skip
def test_lazy_reexports_are_the_modules_own_names(package, module, exclude):
    """A package's lazy re-exports are read from the module's ``__all__`` (no second list):
    they are exactly its names, each resolves to the module's object, and the package lists
    them in its own ``__all__``."""
    import importlib

    from mqnc.base.lazy import public_names

    pkg = importlib.import_module(package)
    mod = importlib.import_module(module, package)
    names = public_names(package, module, exclude=exclude)
    assert set(names) == set(mod.__all__) - set(exclude)
    for name in names:
        assert getattr(pkg, name) is getattr(mod, name), name
        assert name in pkg.__all__, name


def test_public_names_refuses_what_it_cannot_read():
    from mqnc.base.lazy import public_names

    with pytest.raises(ValueError, match="not found"):
        public_names("mqnc.measure", ".no_such_module")
    with pytest.raises(ValueError, match="no literal __all__"):
        public_names("mqnc", ".measure")  # its __all__ is computed (``*_LAZY``)


def test_module_basenames_are_unique():
    """No two modules of ``mqnc/``, ``triton_kernels/`` and ``perf/`` share a file name (a
    package's ``__init__`` / ``__main__`` aside), nor does a module share its name with a folder
    beside the modules (``perf/results/``): a name found in a traceback, a grep or an editor's
    tab says which file it is."""
    seen: dict[str, list[str]] = {}
    for top in ("mqnc", "triton_kernels", "perf"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name not in ("__init__.py", "__main__.py"):
                seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
        for folder in sorted(p for p in (ROOT / top).rglob("*") if p.is_dir()):
            if folder.name != "__pycache__" and not (folder / "__init__.py").exists():
                seen.setdefault(folder.name, []).append(str(folder.relative_to(ROOT)) + "/")
    shared = {name: where for name, where in seen.items() if len(where) > 1}
    assert not shared, f"module names used twice: {shared}"
