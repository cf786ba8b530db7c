"""Lazy exports for a package's `__init__`: its public names load on first use.

    __getattr__, __dir__ = lazy_exports(__name__, {"Varuna": "engine"})

Importing a package then costs nothing (the CLI starts without torch), and no package's
`__init__` imports its own modules, so a module may import a sibling package's modules without
running into a partly initialised package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose public name N lives in `package.where[N]`."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
