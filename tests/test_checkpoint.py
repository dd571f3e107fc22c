"""HF-layout checkpoints written by the tests themselves: standalone and full Qwen3-Omni (sharded)."""

import json

import pytest
import torch
from conftest import random_codes, random_model
from safetensors.torch import save_file

from omni_lightning import Code2Wav


def write_full_qwen3_omni(folder, model: Code2Wav, extra_code2wav=None, drop=None):
    """A Qwen3-Omni-shaped folder: thinker-only shard, talker+code2wav shard, code2wav-only shard."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
        "thinker_config": {"hidden_size": 8}, "talker_config": {"hidden_size": 8},
        "code2wav_config": model.config.to_hf(),
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    state = {f"code2wav.{k}": v.contiguous() for k, v in model.state_dict().items()}
    state.update(extra_code2wav or {})
    for key in drop or []:
        del state[key]
    names = sorted(state)
    half = len(names) // 2
    shards = {
        "model-00002-of-00003.safetensors": {"talker.model.embed.weight": torch.randn(8, 8),
                                             **{k: state[k] for k in names[:half]}},
        "model-00003-of-00003.safetensors": {k: state[k] for k in names[half:]},
    }  # fmt: skip
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(folder / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    # the thinker shard is garbage: opening it at all would fail the load
    (folder / "model-00001-of-00003.safetensors").write_bytes(b"\x00not a safetensors file" * 1000)
    weight_map.update(dict.fromkeys(["thinker.model.embed.weight", "thinker.lm_head.weight"],
                                    "model-00001-of-00003.safetensors"))  # fmt: skip
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def model():
    return random_model("tiny", seed=7)


def same_outputs(a: Code2Wav, b: Code2Wav) -> bool:
    codes = random_codes(2, 9, seed=2)
    with torch.inference_mode():
        return torch.equal(a(codes), b(codes))


def test_standalone_round_trip(tmp_path, model):
    model.save_pretrained(tmp_path / "c2w")
    assert sorted(p.name for p in (tmp_path / "c2w").iterdir()) == ["config.json", "model.safetensors"]
    loaded = Code2Wav.from_pretrained(tmp_path / "c2w")
    assert loaded.config == model.config
    assert same_outputs(model, loaded)


def test_full_sharded_checkpoint_reads_only_code2wav(tmp_path, model):
    folder = write_full_qwen3_omni(tmp_path / "omni", model)
    loaded = Code2Wav.from_pretrained(folder)
    assert same_outputs(model, loaded)
    assert set(loaded.state_dict()) == set(model.state_dict())


def test_dtype_and_device(tmp_path, model):
    model.save_pretrained(tmp_path / "c2w")
    loaded = Code2Wav.from_pretrained(tmp_path / "c2w", dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.code_offset.device.type == "cpu" and loaded.code_offset.dtype == torch.long
    with torch.inference_mode():
        assert loaded(random_codes(1, 3)).dtype == torch.bfloat16


def test_mismatched_checkpoints_list_every_problem(tmp_path, model):
    state = model.state_dict()
    folder = write_full_qwen3_omni(
        tmp_path / "omni", model,
        extra_code2wav={"code2wav.decoder.99.weight": torch.zeros(2),
                        "code2wav.decoder.0.conv.bias": torch.zeros(3)},
        drop=["code2wav.pre_transformer.norm.weight"],
    )  # fmt: skip
    with pytest.raises(ValueError) as err:
        Code2Wav.from_pretrained(folder)
    msg = str(err.value)
    assert "1 missing keys: pre_transformer.norm.weight" in msg
    assert "1 unexpected keys: decoder.99.weight" in msg
    assert f"decoder.0.conv.bias (3,) != {tuple(state['decoder.0.conv.bias'].shape)}" in msg


def test_broken_folders(tmp_path, model):
    with pytest.raises(ValueError, match="does not exist"):
        Code2Wav.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        Code2Wav.from_pretrained(tmp_path / "empty")
    model.save_pretrained(tmp_path / "c2w")
    (tmp_path / "c2w" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="could not read"):
        Code2Wav.from_pretrained(tmp_path / "c2w")
    folder = write_full_qwen3_omni(tmp_path / "omni", model)
    (folder / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match="shard model-00003-of-00003.safetensors .* is missing"):
        Code2Wav.from_pretrained(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Code2Wav.from_pretrained(folder)


def test_config_fields_take_numpy_numbers_and_refuse_non_finite_ones():
    import numpy as np

    from omni_lightning import Code2WavConfig

    cfg = Code2WavConfig.from_name("tiny", hidden_size=np.int64(64), upsample_rates=np.array([8, 5, 4, 3]),
                                   rope_theta=np.float32(1e4))  # fmt: skip
    assert type(cfg.hidden_size) is int and cfg.upsample_rates == (8, 5, 4, 3) and type(cfg.rope_theta) is float
    with pytest.raises(ValueError, match="hidden_size must be an integer, got inf"):
        Code2WavConfig.from_name("tiny", hidden_size=float("inf"))


def test_integer_weights_are_refused_naming_the_tensor(tmp_path, model):
    folder = model.save_pretrained(tmp_path / "c2w")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    key = next(iter(state))
    state[key] = state[key].round().to(torch.int64)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"tensors that are not floating point.*{key} \(torch.int64\)"):
        Code2Wav.from_pretrained(folder)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: [1, 2], r"config.json holds \[1, 2\], not the JSON object of a model config"),
        (lambda c: None, r"config.json holds null"),
        (lambda c: "hello", r'config.json holds "hello"'),
        (lambda c: {"code2wav_config": 5}, r"config.json: a Code2Wav config is a JSON object, got int 5"),
        (lambda c: {**c, "upsample_rates": None}, r"config.json: .*upsample_rates must be a list of integers, got No"),
        (lambda c: {**c, "codebook_size": "big"}, r"config.json: .*codebook_size must be an integer, got 'big'"),
        (lambda c: {**c, "rope_parameters": "x"}, r"config.json: rope_parameters must be a JSON object, got 'x'"),
        (lambda c: {**c, "hidden_act": 3}, r"config.json: .*hidden_act must be a str, got 3"),
    ],
)
def test_a_malformed_config_json_is_a_value_error_naming_the_file_and_key(tmp_path, model, edit, match):
    """Not an AttributeError or TypeError from deep inside: the command line reports it as the user's."""
    folder = model.save_pretrained(tmp_path / "c2w")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(config)))
    with pytest.raises(ValueError, match=match):
        Code2Wav.from_pretrained(folder)


def test_transformers_loads_our_export_with_identical_outputs(tmp_path, model):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    model.save_pretrained(tmp_path / "c2w")
    ref = Qwen3OmniMoeCode2Wav.from_pretrained(tmp_path / "c2w").eval()
    codes = random_codes(2, 9, seed=4)
    with torch.inference_mode():
        assert (model(codes) - ref(codes)).abs().max() <= 1e-5
