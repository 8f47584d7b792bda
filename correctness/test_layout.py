"""The package's layout: every import points down the layers that ``mqnc/__init__.py`` lists.

An AST walk of every module in ``mqnc/`` and ``triton_kernels/`` (function-local imports
included; imports under ``if TYPE_CHECKING:`` never run and are skipped) checks that a module
imports only its own subpackage and the layers below it; that the kernels import nothing of mqnc
above the kernel layer; that the cost model imports no torch (also checked at run time, in a
fresh interpreter); that nothing imports the CLI; that nothing edits ``sys.path``; and that
``pyproject.toml`` installs every subpackage.
"""

from __future__ import annotations

import ast
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
            found.append((module, node.lineno))
            # ``from pkg import submodule`` imports the submodule
            for a in node.names:
                if f"{module}.{a.name}" in MODULES:
                    found.append((f"{module}.{a.name}", node.lineno))
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
    assert listed == folders | {"mqnc.triton_kernels"}
    assert setuptools["package-dir"] == {"mqnc": "mqnc", "mqnc.triton_kernels": "triton_kernels"}


@pytest.mark.parametrize(
    ("package", "module", "exclude"),
    [("mqnc.model", ".mla", ()), ("mqnc.measure", ".echo", ("TRANSPORTS",)),
     ("mqnc.measure", ".timing", ()), ("mqnc.measure", ".sweep", ())],
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
