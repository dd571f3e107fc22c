"""``lazy_exports``: a package's public names imported on first use (PEP 562).

``omni-lightning``'s command line checks its arguments before torch and Lightning load, and
``omni_lightning.models.config`` (presets) imports without torch: the packages on the way there
must not import their heavy modules eagerly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a module path) on first access and
    caches the attribute in ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(exports[name]), name)
        return value

    return __getattr__
