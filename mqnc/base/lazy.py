"""Re-exports that import their module on first use (PEP 562 module ``__getattr__``).

A subpackage whose ``__init__`` re-exports torch-backed names would load torch for every
import of any of its modules: ``mqnc.model``'s geometry is read by the torch-free cost model,
``mqnc.demo``'s configuration by ``mqnc --help``. Such a package lists those names here
instead; ``from mqnc.model import MLAModel`` imports ``mqnc.model.mla`` only then.

:func:`public_names` reads a submodule's ``__all__`` from its source (no import), so
that a package re-exports a module's names without writing them out a second time.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from collections.abc import Callable

__all__ = ["lazy_exports", "public_names"]


def public_names(package: str, module: str, *, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The names in ``__all__`` of ``module`` (relative to ``package``, e.g. ``".mla"``), read
    from its source without importing it, less ``exclude``. ``__all__`` must be assigned once
    at the top level, as a literal list or tuple of strings (a ``ValueError`` names the module
    otherwise)."""
    spec = importlib.util.find_spec(module, package)
    if spec is None or spec.origin is None:
        raise ValueError(f"module: {module!r} of {package!r} not found")
    with open(spec.origin, encoding="utf-8") as f:
        found = _ALL.search(f.read())
    try:
        names = ast.literal_eval(found.group(1)) if found else None
    except (ValueError, SyntaxError):
        names = None
    if not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"module: {spec.origin} has no literal __all__ of strings")
    return tuple(n for n in names if n not in exclude)


_ALL = re.compile(r"^__all__\s*=\s*(\[.*?\]|\(.*?\))", re.M | re.S)


def lazy_exports(package: str, names: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` resolving ``name -> module`` on first access.

    ``names`` maps each exported name to the module (relative to ``package``, e.g.
    ``".mla"``) that defines it.
    """

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__
