import pytest
from helpers import MICRO, micro_config, random_codes, random_model, reference_model  # noqa: F401  (re-exported)

from omni_lightning import Code2Wav


@pytest.fixture(scope="session")
def tiny_model() -> Code2Wav:
    return random_model("tiny")
