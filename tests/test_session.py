"""The inference session owns the device weights (runner/session.py): the module composes it, the
engine reads its own copies without repointing parameters, and predict leaves plain host tensors."""

import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import random_codes, random_model
from helpers import RecordingCapture, requests, trainer_kwargs, waveforms

from omni_lightning import Code2WavModule, CodesDataModule, DecodeEngine, Trainer

PACKAGE = Path(__file__).resolve().parents[1] / "omni_lightning"


def convs(model):
    return [m.weight for m in model.modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))
            and m.kernel_size[0] > 1 and m.weight.shape[1] > 1]  # fmt: skip


def test_one_file_repoints_parameters_and_the_module_composes_instead_of_overriding_lightning():
    owners = sorted(
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if re.search(r"\.data = ", p.read_text())
    )
    assert owners == ["runner/session.py"]
    assert Code2WavModule.__bases__ == (pl.LightningModule,)
    assert "cpu" not in vars(Code2WavModule) and Code2WavModule.trainer is pl.LightningModule.trainer


def test_an_engine_reads_its_own_copies_and_leaves_the_parameters_where_they_are():
    """Its convolution weights channels-last (cuDNN then converts nothing), the model's untouched."""
    model = random_model("tiny", seed=6)
    before = [(p.data_ptr(), p.stride()) for p in model.parameters()]
    engine = DecodeEngine(model, frames_per_forward=24, capture=RecordingCapture())
    assert [(p.data_ptr(), p.stride()) for p in model.parameters()] == before
    held = dict(zip(map(id, model.parameters()), engine.weights.held))
    assert all(held[id(w)].unsqueeze(2).is_contiguous(memory_format=torch.channels_last) for w in convs(model))
    codes = requests([7, 12], seed=72)
    out = engine.decode(torch.stack([c[:, :7] for c in codes.values()]), [7, 7])
    with torch.no_grad():
        assert all((o - model.decode(c[None, :, :7])[0]).abs().max() <= 1e-5 for o, c in zip(out, codes.values()))


def test_after_predict_the_state_dict_is_plain_contiguous_host_tensors(tmp_path):
    """The kept engine lends its channels-last copies to the parameters during predict; after it a raw
    ``safetensors`` save of ``state_dict()`` works and loads back the same values."""
    from safetensors.torch import load_file, save_file

    module = Code2WavModule(model=random_model("tiny", seed=3))
    module.engine = DecodeEngine(module.model, frames_per_forward=64, capture=RecordingCapture())  # set by hand
    reqs = requests([9, 14])
    for _ in range(2):  # the second predict is lent the engine's copies
        Trainer(**trainer_kwargs()).predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=2))
        state = module.state_dict()
        assert all(t.device.type == "cpu" and t.is_contiguous() for t in state.values())
        save_file(state, tmp_path / "weights.safetensors")
        loaded = load_file(tmp_path / "weights.safetensors")
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_an_engine_built_in_a_predict_takes_weights_written_after_it_and_leaves_them_trainable():
    """An engine built during a predict (in inference mode, as on CUDA) holds inference tensors: a weight
    written between predicts is copied into them in the next one's setup, and what goes back to the
    host (a cast packed by ``pin_cast`` too) stays a normal tensor that fit can train."""
    from omni_lightning.runner.session import HostWeights

    module = Code2WavModule(model=random_model("tiny", seed=3))
    with torch.inference_mode():
        module.engine = DecodeEngine(module.model, frames_per_forward=64, capture=RecordingCapture())
    reqs = requests([9, 14])
    Trainer(**trainer_kwargs()).predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=2))
    with torch.no_grad():
        module.model.pre_transformer.norm.weight.mul_(2)
        want = {r: module.model.decode(c[None])[0] for r, c in reqs.items()}
    got = waveforms(Trainer(**trainer_kwargs()).predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=2)))
    assert all((got[r] - want[r]).abs().max() <= 1e-5 for r in reqs)
    assert not any(p.is_inference() for p in module.parameters())
    module.session._held = HostWeights.hold(module, pin_cast=lambda n: torch.empty(n, dtype=torch.uint8))
    with torch.inference_mode():
        module.to(torch.bfloat16)  # a cast in a predict: packed on its way back
        module.session.release_held()
    assert all(p.dtype == torch.bfloat16 and not p.is_inference() for p in module.parameters())


class FailsInABatch(pl.Callback):
    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        raise RuntimeError("the predict fails here")


def test_a_failed_predict_leaves_the_weights_in_their_host_tensors():
    """The engine's copies were lent to the parameters when the predict failed: they go back into the
    host tensors they left, and the next predict decodes exactly."""
    module = Code2WavModule(model=random_model("tiny", seed=3))
    module.engine = DecodeEngine(module.model, frames_per_forward=64, capture=RecordingCapture())  # set by hand
    reqs = requests([9, 14])
    dm = lambda: CodesDataModule(predict=reqs, batch_size=2)  # noqa: E731
    first = waveforms(Trainer(**trainer_kwargs()).predict(module, datamodule=dm()))
    before = [p.data_ptr() for p in module.parameters()]
    with pytest.raises(RuntimeError, match="the predict fails here"):
        Trainer(**trainer_kwargs(callbacks=[FailsInABatch()])).predict(module, datamodule=dm())
    assert [p.data_ptr() for p in module.parameters()] == before and module.session._held is None
    again = waveforms(Trainer(**trainer_kwargs()).predict(module, datamodule=dm()))
    assert all(torch.allclose(first[r], again[r], rtol=0, atol=1e-5) for r in reqs)


def predict(module):
    codes = list(requests([5, 6]).values())
    return Trainer(**trainer_kwargs()).predict(module, datamodule=CodesDataModule(predict=codes, batch_size=2))


def random_weights_warnings(module, times=1):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(times):
            predict(module)
    return [str(w.message) for w in seen if issubclass(w.category, UserWarning) and "random weights" in str(w.message)]


def test_predict_on_random_weights_nobody_asked_for_warns_once():
    said = random_weights_warnings(Code2WavModule(config="tiny"), times=2)
    assert len(said) == 1 and "checkpoint=" in said[0] and "random_weights=True" in said[0], said
    assert random_weights_warnings(Code2WavModule(config="tiny", random_weights=True)) == []
    assert random_weights_warnings(Code2WavModule(model=random_model("tiny", seed=1))) == []  # the caller's weights
    loaded = Code2WavModule(config="tiny")
    loaded.load_state_dict(Code2WavModule(model=random_model("tiny", seed=1)).state_dict())
    assert random_weights_warnings(loaded) == []


def test_predict_after_fit_does_not_warn_of_random_weights():
    module = Code2WavModule(config="tiny")
    cfg = module.config
    codes = random_codes(2, 6, cfg, seed=71)
    n = cfg.output_length(6)
    batch = {"codes": codes, "audio": torch.randn(2, 1, n), "audio_lengths": torch.tensor([n, n])}
    Trainer(**trainer_kwargs(max_steps=1)).fit(
        module, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None)
    )
    assert random_weights_warnings(module) == []


@pytest.mark.gpu
def test_cuda_predicts_leave_contiguous_host_weights_that_save_raw(tmp_path):
    from safetensors.torch import save_file

    module = Code2WavModule(model=random_model("tiny", seed=2))
    reqs = requests()
    kwargs = {**trainer_kwargs(), "accelerator": "gpu"}
    outs = [waveforms(Trainer(**kwargs).predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=3)))
            for _ in range(2)]  # fmt: skip
    assert all(torch.allclose(outs[0][r], outs[1][r], rtol=0, atol=1e-4) for r in reqs)
    state = module.state_dict()
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in state.values())
    save_file(state, tmp_path / "weights.safetensors")
