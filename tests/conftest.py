import pytest
import torch

from omni_lightning import Code2Wav, Code2WavConfig, randomize_weights

# Small enough for many forwards in a test, with the real 1920x geometry.
MICRO = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=32, decoder_dim=16)  # fmt: skip


def micro_config(**overrides) -> Code2WavConfig:
    return Code2WavConfig.from_name("tiny", **{**MICRO, "name": "micro", **overrides})


def random_model(config: Code2WavConfig | str = "tiny", seed: int = 0) -> Code2Wav:
    return randomize_weights(Code2Wav(config), seed=seed).eval()


def random_codes(batch: int, frames: int, config: Code2WavConfig | None = None, seed: int = 0) -> torch.Tensor:
    config = config or Code2WavConfig.from_name("tiny")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.codebook_size, (batch, config.num_quantizers, frames), generator=gen)


def reference_model(model: Code2Wav):
    """transformers' Qwen3OmniMoeCode2Wav holding the same weights (the numerical reference)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    ref = Qwen3OmniMoeCode2Wav._from_config(Qwen3OmniMoeCode2WavConfig(**model.config.to_hf()))
    ref.load_state_dict(model.state_dict(), strict=True)
    return ref.eval()


@pytest.fixture(scope="session")
def tiny_model() -> Code2Wav:
    return random_model("tiny")
