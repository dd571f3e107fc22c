import pytest
from helpers import MICRO, micro_config, random_codes, random_model, reference_model  # noqa: F401  (re-exported)

from omni_lightning import Code2Wav


@pytest.fixture(scope="session")
def tiny_model() -> Code2Wav:
    return random_model("tiny")


@pytest.fixture
def no_tf32():
    """fp32 means fp32 in the test: cuDNN and cuBLAS would otherwise round inputs to TF32. Saved and
    restored by hand: torch's backend flags are properties that pytest's monkeypatch cannot undo."""
    import torch

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
