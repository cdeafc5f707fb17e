"""Names a package re-exports from its submodules, imported on first use (PEP 562's module `__getattr__`), so that
importing the package stays light and no submodule import can loop back into it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(
    package: str, names: Mapping[str, str], submodules: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`: `names` maps each re-exported name to the module that defines it
    (absolute, or relative to the package when it has no dot), `submodules` are reachable as attributes."""
    submodules = tuple(submodules)

    def home(module: str) -> str:
        return module if "." in module else f"{package}.{module}"

    def getattr_(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(home(names[name])), name)
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *names, *submodules})

    return getattr_, dir_
