"""The repository is ruff-clean: ``ruff check`` and ``ruff format --check`` pass with pyproject.toml's settings.

Skipped where ruff is not installed (it is in the ``dev`` extra).
"""

import subprocess
import sys

import pytest
from helpers import ROOT


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_passes_over_the_repository(command):
    pytest.importorskip("ruff")
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"ruff {' '.join(command)} found problems:\n{done.stdout[-5000:]}{done.stderr[-2000:]}"
