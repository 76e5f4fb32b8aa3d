"""Lazy package exports (PEP 562): a package's public names are imported on first use.

A package whose public face re-exports torch-heavy modules (``async_rl.algorithms``,
``async_rl.weights``) would otherwise import torch whenever any of its light submodules (the
configs) is imported. Type checkers see the real imports under ``TYPE_CHECKING`` in the package.

May import: nothing of async_rl.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``; ``exports`` maps each public name to its submodule."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
