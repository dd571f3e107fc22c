import sys

import pytest
import torch
from helpers import MICRO, micro_config, random_codes, random_model, reference_model  # noqa: F401  (re-exported)

from omni_lightning import Code2Wav

REPORTED = ("torch", "lightning", "torchaudio", "numpy", "triton", "transformers", "wandb", "soundfile", "jsonargparse")


def pytest_terminal_summary(terminalreporter):
    """The versions this run tested, last in its output (CI's log says what a fresh install got)."""
    from importlib.metadata import PackageNotFoundError, version

    def found(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    versions = ", ".join(f"{name} {found(name)}" for name in REPORTED)
    terminalreporter.write_line(f"tested with {versions}; Python {sys.version.split()[0]}; {device}")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped where CUDA is not available; ``pytest -m gpu`` selects them."""
    if torch.cuda.is_available():
        return
    needs_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(needs_cuda)


@pytest.fixture(scope="session")
def tiny_model() -> Code2Wav:
    return random_model("tiny")


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    """A tiny model with random weights, one per test module."""
    return random_model("tiny", seed=6)


@pytest.fixture
def no_tf32():
    """Turns TF32 off in cuDNN and cuBLAS for the test, so fp32 means fp32, then restores both flags.
    Saved by hand: pytest's monkeypatch cannot undo torch's backend flag properties."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
