"""Packages that export their names lazily: `import zrl.<package>.<module>` then loads that module alone,
without the package's other modules and what they import (torch, most often)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def module_getattr(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module-level `__getattr__` for `package`: name -> the attribute of `package.<exports[name]>`,
    imported on first use."""
    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
    return __getattr__
