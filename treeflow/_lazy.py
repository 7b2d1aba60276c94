"""Lazy package exports: `from treeflow.stages import Pack` imports only what Pack needs.

A package `__init__` that imported every submodule would make `treeflow synth`,
`inspect` and `plan` pay for torch (about 2 s) although they never run a
model. Each package instead names where its public names live, and a module
`__getattr__` (PEP 562) imports a submodule the first time one of its names is
asked for. The trade-off: an import error in a submodule surfaces at first
use of the name instead of at `import treeflow.stages`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, tuple[str, ...]]
                 ) -> tuple[Callable, Callable, list[str]]:
    """`(__getattr__, __dir__, __all__)` for `package`; `exports` maps each submodule to the
    public names it holds."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        globals_ = importlib.import_module(package).__dict__
        globals_[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(where) | set(importlib.import_module(package).__dict__))

    return __getattr__, __dir__, sorted(where)
