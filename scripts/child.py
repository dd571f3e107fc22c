"""How a benchmark starts the package in a child process so that an A/B measures the tree it was given.

A before/after run selects its tree with ``PYTHONPATH`` (``device/device_battery.py``). Started from the
checkout, ``python -m omni_lightning.cli`` would import the checkout's package whatever ``PYTHONPATH`` says
(``-m`` puts the current folder first on ``sys.path``): every GPU "before" of the server's A/B once ran the
tree after. So a child runs ``python -P`` (no current folder on ``sys.path``) with the given ``PYTHONPATH``
first and this checkout after it. Standard library only: importing it costs nothing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> list[str]:
    """The command line of ``omni-lightning *args`` in a child (``python -P -m omni_lightning.cli``)."""
    return [sys.executable, "-P", "-m", "omni_lightning.cli", *args]


def package_env(*first: str, **extra: str) -> dict[str, str]:
    """This process's environment for such a child: ``PYTHONPATH`` = ``first`` (folders a child needs before
    the package, a script's own, say), the ``PYTHONPATH`` given, then this checkout; ``extra`` added."""
    path = [*first, os.environ.get("PYTHONPATH", ""), str(ROOT)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), **extra}
