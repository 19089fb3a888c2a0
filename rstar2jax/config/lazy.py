"""A package's lazy face: the names it offers load from their home modules on first use, so importing the
package starts nothing (no JAX); one table per package, ``{home module: [names]}``. The packages above
``config`` (``config``, ``policy``, ``schedules``, ``train``) share this loader: each ``__init__`` holds its
table, ``_LAZY = LazyNames(globals(), table).install()`` and a plain ``__all__`` list (griffe, which writes
the API pages, reads that assignment)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any


class LazyNames:
    """The names ``table`` gives (``{module: [names]}``) for the package whose ``globals()`` are
    ``namespace``; ``modules``: its submodules also offered as attributes (``train.lora``)."""

    def __init__(self, namespace: dict[str, Any], table: Mapping[str, Sequence[str]],
                 modules: Sequence[str] = ()):
        self._namespace, self._table, self._modules = namespace, table, tuple(modules)
        self.module_of = {name: module for module, names in table.items() for name in names}

    def install(self) -> LazyNames:
        """Make the package lazy (PEP 562): its ``__getattr__`` is :meth:`load` and its ``__dir__`` the names
        and modules it offers. Returns ``self``."""
        self._namespace["__getattr__"] = self.load
        self._namespace["__dir__"] = lambda: sorted({*self.module_of, *self._modules})
        return self

    @property
    def names(self) -> list[str]:
        """The table's names, sorted (a package's ``__all__``)."""
        return sorted(self.module_of)

    def load(self, name: str) -> Any:
        """The package's attribute ``name`` (its module's other names are bound too: one import, one
        lookup); ``AttributeError`` for a name the table lacks."""
        package = self._namespace["__name__"]
        if name in self._modules:
            return importlib.import_module(f"{package}.{name}")
        if name not in self.module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(self.module_of[name])
        for attr in self._table[self.module_of[name]]:
            self._namespace[attr] = getattr(module, attr)
        return self._namespace[name]
