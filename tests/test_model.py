"""Code2Wav against transformers' Qwen3OmniMoeCode2Wav, and the decode contracts."""

import os
import stat

import pytest
import torch
from conftest import micro_config, random_codes, random_model, reference_model

from omni_lightning import Code2Wav, Code2WavConfig


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def assert_lively(wav: torch.Tensor) -> None:
    """The comparison means something: a real signal, almost never clamped."""
    assert wav.std() > 0.05
    assert (wav.abs() < 1).float().mean() > 0.99


@pytest.mark.parametrize("frames", [1, 2, 7, 13, 50, 125])
def test_tiny_matches_transformers(tiny_model, frames):
    ref = reference_model(tiny_model)
    codes = random_codes(2, frames, seed=frames)
    with torch.inference_mode():
        ours, theirs = tiny_model(codes), ref(codes)
    assert ours.shape == (2, 1, tiny_model.output_length(frames))
    if frames > 1:
        assert_lively(ours)
    assert max_diff(ours, theirs) <= 1e-5


def test_non_default_config_matches_transformers():
    # grouped KV heads (4 query heads share 1), explicit head_dim, other rates, a short window
    config = Code2WavConfig(
        name="odd",
        codebook_size=100,
        num_quantizers=4,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=80,
        sliding_window=5,
        rope_theta=5000.0,
        upsampling_ratios=(3,),
        upsample_rates=(4, 3, 2),
        decoder_dim=48,
        hidden_act="gelu",
        sample_rate=7200,
    )
    model = random_model(config, seed=3)
    ref = reference_model(model)
    assert config.total_upsample == 72 and config.frame_rate == 100
    for frames in (1, 4, 23):
        codes = random_codes(3, frames, config, seed=frames)
        with torch.inference_mode():
            ours, theirs = model(codes), ref(codes)
        assert ours.shape[-1] == config.output_length(frames)
        assert max_diff(ours, theirs) <= 1e-5


def test_qwen3_omni_preset_matches_transformers_defaults_and_outputs():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

    hf = Qwen3OmniMoeCode2WavConfig().to_dict()
    ours = Code2WavConfig.from_name("qwen3-omni")
    for key, value in ours.to_hf().items():
        if key in hf:
            assert hf[key] == (list(value) if isinstance(value, tuple) else value), key
    assert ours.sample_rate == 24000 and ours.frame_rate == 12.5 and ours.tail == 555

    model = random_model("qwen3-omni", seed=1)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(216e6, rel=0.01)
    ref = reference_model(model)
    codes = random_codes(1, 6, ours, seed=5)
    with torch.inference_mode():
        a, b = model(codes), ref(codes)
    assert_lively(a)
    assert max_diff(a, b) <= 1e-4


def test_output_length_is_the_real_length_for_1_to_200_frames():
    config = micro_config()
    with torch.device("meta"):  # every layer's real shape arithmetic, no arithmetic on values
        meta = Code2Wav(config)
        for n in [*range(1, 41), 47, 64, 99, 128, 173, 200]:  # each layer's arithmetic is linear past a few
            codes = torch.zeros(1, 16, n, dtype=torch.long)
            assert meta(codes).shape[-1] == meta.output_length(n) == 1920 * n - 555
    model = random_model(config)
    codes = random_codes(1, 200, config)
    with torch.inference_mode():
        for n in (1, 2, 3, 17):
            assert model(codes[..., :n]).shape[-1] == model.output_length(n)


@pytest.mark.parametrize("lengths", [[1, 5, 17, 33], [33, 2, 9], [7]])
def test_batched_decode_equals_solo_decodes(tiny_model, lengths):
    codes = random_codes(len(lengths), max(lengths), seed=len(lengths))
    for i, n in enumerate(lengths):
        codes[i, :, n:] = -1  # pad value outside the codebook: must never be looked up
    with torch.inference_mode():
        batched = tiny_model.decode(codes, torch.tensor(lengths))
        for i, n in enumerate(lengths):
            alone = tiny_model(codes[i : i + 1, :, :n])[0]
            assert batched[i].shape == (1, tiny_model.output_length(n))
            assert max_diff(batched[i], alone) <= 1e-5


def test_chunked_decode_is_exact_with_memory_bounded_by_the_chunk(tiny_model):
    frames = 40
    codes = random_codes(2, frames, seed=11)
    seen = []
    handle = tiny_model.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[-1]))
    try:
        with torch.inference_mode():
            full = tiny_model(codes)
            seen.clear()
            chunked = tiny_model.chunked_decode(codes, chunk_size=9)
    finally:
        handle.remove()
    # [B, N]: one request gives [1, N], as decode() gives per request
    assert chunked.shape == full[:, 0].shape == (2, tiny_model.output_length(frames))
    assert seen == [9, 9, 9, 9, 4]  # every forward sees its own chunk only: no context re-decoded
    assert max_diff(chunked, full[:, 0]) <= 1e-5
    with torch.inference_mode():
        one = tiny_model.chunked_decode(codes[:1], chunk_size=9)
    assert one.shape == tiny_model.decode(codes[:1])[0].shape == (1, tiny_model.output_length(frames))
    # transformers' chunked_decode on the same model loses 555 samples per boundary
    ref = reference_model(tiny_model)
    with torch.inference_mode():
        theirs = ref.chunked_decode(codes, chunk_size=9, left_context_size=4)
    assert theirs.shape[-1] == full.shape[-1] - 555 * 4


def test_a_forward_with_state_runs_under_grad_mode_as_the_readme_shows(tiny_model):
    """README's snippet has no ``no_grad``: a forward with a state under grad mode (parameters that
    require grad, as ``from_pretrained`` gives them) returns audio with its graph and leaves the state
    detached; chunked decode works there too."""
    codes = random_codes(2, 30, seed=12)
    assert all(p.requires_grad for p in tiny_model.parameters())
    state = tiny_model.new_state(2)
    first, second = tiny_model(codes[..., :13], state), tiny_model(codes[..., 13:], state)
    assert first.requires_grad and not any(t.requires_grad for t in state.tensors.values())
    chunked = tiny_model.chunked_decode(codes, chunk_size=7)
    with torch.no_grad():
        full = tiny_model(codes)
    pieces = torch.cat([first, second], dim=-1)[..., tiny_model.config.tail :]
    assert max_diff(pieces.detach(), full) <= 1e-5 and max_diff(chunked.detach(), full[:, 0]) <= 1e-5


def test_chunked_decode_rejects_bad_chunking(tiny_model):
    codes = random_codes(1, 10)
    with pytest.raises(ValueError, match="chunk_size"):
        tiny_model.chunked_decode(codes, chunk_size=0)


def test_presets_and_config_errors():
    assert Code2WavConfig.from_name("tiny").total_upsample == 1920
    with pytest.raises(ValueError, match="unknown Code2Wav preset"):
        Code2WavConfig.from_name("qwen9")
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        Code2WavConfig.from_name("tiny", num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_act"):
        Code2WavConfig.from_name("tiny", hidden_act="swish2")
    with pytest.raises(ValueError, match="unknown Code2Wav config keys"):
        Code2WavConfig.from_hf({"hidden_size": 64, "hidden_sise": 3})


def test_from_hf_reads_standalone_and_full_configs(tmp_path):
    standalone = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "decoder_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e3},
        "model_type": "",
        "transformers_version": "5.17.0",
    }
    a = Code2WavConfig.from_hf(standalone)
    assert a.hidden_size == 64 and a.rope_theta == 5e3 and a.sample_rate == 24000
    full = {"model_type": "qwen3_omni_moe", "thinker_config": {}, "code2wav_config": standalone}
    (tmp_path / "config.json").write_text(__import__("json").dumps(full))
    b = Code2WavConfig.from_hf(tmp_path)
    assert b == a


def test_model_built_from_name(tiny_model):
    assert isinstance(Code2Wav("tiny"), Code2Wav)
    assert tiny_model.sample_rate == 24000


def test_saved_checkpoint_files_get_the_mode_open_gives(tmp_path, tiny_model):
    umask = os.umask(0o022)
    os.umask(umask)
    tiny_model.save_pretrained(tmp_path / "c2w")
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE(os.stat(tmp_path / "c2w" / name).st_mode) == 0o666 & ~umask
