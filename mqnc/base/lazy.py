"""Re-exports that import their module on first use (PEP 562 module ``__getattr__``).

A subpackage whose ``__init__`` re-exports torch-backed names would load torch for every
import of any of its modules: ``mqnc.model``'s geometry is read by the torch-free cost model,
``mqnc.demo``'s configuration by ``mqnc --help``. Such a package lists those names here
instead; ``from mqnc.model import MLAModel`` imports ``mqnc.model.mla`` only then.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["lazy_exports"]


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
