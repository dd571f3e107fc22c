"""The inference session owns the device weights (runner/session.py): the module composes it, the
engine reads its own copies without repointing parameters, and predict leaves plain host tensors."""

import logging
import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import micro_config, random_codes, random_model
from helpers import RecordingCapture, ReplayCapture, requests, trainer_kwargs, waveforms

from omni_lightning import Code2WavModule, CodesDataModule, DecodeEngine, Trainer
from omni_lightning.runner.session import InferenceSession

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


def test_a_state_dict_is_contiguous_even_while_a_stream_reads_channels_last_weights(tmp_path):
    """A streaming decoder over a module on the GPU lays its convolution weights out channels-last in
    place (its engine reads them there); the module's state dict still saves raw, with their values."""
    from safetensors.torch import load_file, save_file

    module = Code2WavModule(model=random_model("tiny", seed=3))
    module.session = InferenceSession(capture=ReplayCapture)  # the CUDA path's layout, on the CPU
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module.streaming_decoder(max_streams=2)
    assert any(not p.is_contiguous() for p in module.parameters())
    save_file(module.state_dict(), tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors")
    assert loaded.keys() == before.keys() and all(torch.equal(loaded[k], v) for k, v in before.items())


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
    armed = True

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.armed:
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


class RestoreFails(InferenceSession):
    def release_held(self):
        if self._held is not None:
            self._held = None
            raise OSError("the restore fails too")


def test_a_failed_restore_after_a_failed_predict_keeps_the_predicts_error(caplog):
    module = Code2WavModule(model=random_model("tiny", seed=3))
    module.session = RestoreFails()
    data = CodesDataModule(predict=requests([9, 14]), batch_size=2)
    with pytest.raises(RuntimeError, match="the predict fails here"):
        Trainer(**trainer_kwargs(callbacks=[FailsInABatch()])).predict(module, datamodule=data)
    assert "after RuntimeError, the weights stay where they are: the restore fails too" in caplog.text


def test_a_second_predict_on_one_trainer_keeps_its_callbacks_silently_and_still_restores(caplog):
    """The module's predict callback is already on the trainer the second time: no "will override" line,
    and a failure then still puts the weights back into their host tensors."""
    module, fails = Code2WavModule(model=random_model("tiny", seed=3)), FailsInABatch()
    fails.armed, trainer = False, Trainer(**trainer_kwargs(callbacks=[fails]))
    data = lambda: CodesDataModule(predict=requests([9, 14, 5]), batch_size=1)  # noqa: E731
    trainer.predict(module, datamodule=data())
    before, fails.armed = [p.data_ptr() for p in module.parameters()], True
    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match="the predict fails here"):
        trainer.predict(module, datamodule=data())
    assert "will override" not in caplog.text and [p.data_ptr() for p in module.parameters()] == before


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
def test_cuda_predicts_leave_contiguous_host_weights_that_save_raw(tmp_path, no_tf32):
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


# --- the CUDA path on the CPU: pinned memory and torch.cuda.graph given to the session as stand-ins ---


def cuda_path(module):
    """Gives ``module`` a session that takes its CUDA-only path on the CPU: a plain host buffer where it
    pins memory, and a capture that replays as a CUDA graph does. Returns the buffers it allocates."""
    buffers = []

    def host_buffer(nbytes):
        buffers.append(torch.empty(nbytes, dtype=torch.uint8))
        return buffers[-1]

    module.session = InferenceSession(host_buffers=host_buffer, capture=ReplayCapture)
    return buffers


def micro_module(**kw):
    return Code2WavModule(model=random_model(micro_config(), seed=3), frames_per_forward=32, graph_frames=16, **kw)


def reads_engine(module):
    """Whether the parameters are the engine's own tensors (lent, or the ones it was built over)."""
    engine = module.engine
    held = engine.weights.held if engine is not None and engine.weights is not None else []
    return bool(held) and all(p.data_ptr() == h.data_ptr() for p, h in zip(module.model.parameters(), held))


class WeightsSeen(pl.Callback):
    """Where the parameters are as predict starts (before the module's hook builds or refreshes its
    engine) and in each batch (the engine's tensors, convolution weights channels-last?)."""

    def __init__(self):
        self.at_start, self.in_batches = [], []

    def on_predict_start(self, trainer, pl_module):
        self.at_start.append(reads_engine(pl_module))

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        lent = reads_engine(pl_module) and all(w.stride(1) == 1 for w in convs(pl_module.model))
        self.in_batches.append(lent)


REQS = requests([9, 14, 3])


def predict_reqs(module, **kw):
    trainer = Trainer(**trainer_kwargs(**kw))
    return waveforms(trainer.predict(module, datamodule=CodesDataModule(predict=REQS, batch_size=2)))


def eager(module):
    with torch.inference_mode():
        return {r: module.model(c[None])[0] for r, c in REQS.items()}


# the engine's forwards against one whole eager forward in fp32: other reduction orders, up to ~1.2e-5
# after a fit at lr 1e-2 (seen over seeds); the bugs these tests guard give errors of 1e-2 and more
EAGER_TOL = 1e-4


def assert_same(got, want, tol=0.0):
    assert all(got[r].shape == want[r].shape and (got[r] - want[r]).abs().max() <= tol for r in REQS)


def test_on_the_cpu_predict_takes_the_cuda_path_packed_channels_last_lent_and_back_exact():
    """The session's CUDA-only path under a real Trainer: the host weights packed into one buffer, the
    convolution weights channels-last for the engine built over them, its graphs, the weights back into
    the host tensors (channels-last ones copied contiguous), the next predict lent the engine's copies.
    The audio is the plain session's, float for float (the same forwards), and the eager model's."""
    module, plain = micro_module(), micro_module()
    buffers, seen = cuda_path(module), WeightsSeen()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    for _ in range(2):
        got, want = predict_reqs(module, callbacks=[seen]), predict_reqs(plain)
        assert module.engine.ever == plain.engine.ever and module.engine.graphs.stats.replays > 0
        assert_same(got, want)
        assert_same(got, eager(plain), tol=EAGER_TOL)
        state = module.state_dict()
        assert all(t.is_contiguous() and torch.equal(t, before[k]) for k, t in state.items())
        assert len(buffers) == 1 and all(
            p.untyped_storage().data_ptr() == buffers[0].data_ptr() for p in module.parameters()
        )
        assert all(p.requires_grad and not p.is_inference() for p in module.parameters())
    assert seen.at_start == [False, True] and all(seen.in_batches)  # built over them, then lent


class BuffersSeen(pl.Callback):
    """Whether, in each batch, the module's buffers are the engine's own tensors (no functional_call)."""

    def __init__(self):
        self.in_batches = []

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        held = pl_module.engine.weights.held[len(list(pl_module.parameters())) :]
        self.in_batches.append([b.data_ptr() for b in pl_module.model.buffers()] == [h.data_ptr() for h in held])


def test_a_kept_engine_lends_its_buffers_with_its_parameters():
    """A move to the host and back replaces the module's buffers; the next predict lends the engine's, so
    its forwards read the engine's tensors as they are, and decode as the eager model does."""
    module = micro_module()
    cuda_path(module)
    predict_reqs(module)
    for m in module.model.modules():  # what Lightning's cpu() and move to the GPU do to buffers
        m._buffers.update({k: b.clone() for k, b in m._buffers.items() if b is not None})
    seen = BuffersSeen()
    assert_same(predict_reqs(module, callbacks=[seen]), eager(module), tol=EAGER_TOL)
    assert seen.in_batches and all(seen.in_batches)


def test_on_the_cpu_the_cuda_path_decodes_weights_changed_between_predicts_and_fit_still_trains():
    """A write between predicts (an optimizer step outside fit) is copied into the engine's copies
    before they are lent; fit releases the engine and trains the packed host weights; a predict that
    fails puts them back. Every predict decodes the weights the module has then."""
    module = micro_module(learning_rate=1e-3)
    cuda_path(module)
    predict_reqs(module)
    optimizer = torch.optim.SGD(module.model.parameters(), lr=1e-2)
    convs(module.model)[-1].sum().backward()  # a convolution weight: the engine holds a copy of its own
    optimizer.step()
    assert_same(predict_reqs(module), eager(module), tol=EAGER_TOL)
    cfg, n = module.config, module.config.output_length(6)
    batch = {
        "codes": random_codes(2, 6, cfg, seed=71),
        "audio": torch.randn(2, 1, n),
        "audio_lengths": torch.tensor([n, n]),
    }
    before = [p.detach().clone() for p in module.parameters()]
    for _ in range(2):  # fit after a predict, then again after the predicts that follow it
        Trainer(**trainer_kwargs(max_steps=1)).fit(
            module, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None)
        )
        assert not all(torch.equal(p, b) for p, b in zip(module.parameters(), before))  # it trained
        before = [p.detach().clone() for p in module.parameters()]
        assert_same(predict_reqs(module), eager(module), tol=EAGER_TOL)
    with pytest.raises(RuntimeError, match="the predict fails here"):
        predict_reqs(module, callbacks=[FailsInABatch()])
    assert all(torch.equal(p, b) and p.is_contiguous() for p, b in zip(module.parameters(), before))
    assert_same(predict_reqs(module), eager(module), tol=EAGER_TOL)


def test_on_the_cpu_a_bf16_true_predict_packs_the_cast_weights_on_the_way_back():
    """bf16-true casts the fp32 weights after ``setup``: they go back packed into one new buffer (the
    pinned one on CUDA), where the next bf16-true predict finds them and is lent the engine's copies."""
    module, plain = micro_module(), micro_module()
    buffers, seen = cuda_path(module), WeightsSeen()
    for _ in range(2):
        got = predict_reqs(module, precision="bf16-true", callbacks=[seen])
        assert_same(got, predict_reqs(plain, precision="bf16-true"))
        assert len(buffers) == 1 and all(p.dtype == torch.bfloat16 for p in module.parameters())
        assert all(
            p.untyped_storage().data_ptr() == buffers[0].data_ptr() and p.is_contiguous() for p in module.parameters()
        )
    assert seen.at_start == [False, True] and all(seen.in_batches)


def test_outside_a_predict_a_decode_copies_the_callers_weights_and_a_stream_reads_them_in_place():
    """Only a predict's parameters, which go back into their host tensors, are laid channels-last for
    its engine; a decode of a module where the caller put it (a GPU, say) copies them, refreshed at
    each call, so its ``state_dict`` stays contiguous (Lightning's ``cpu()`` after a predict keeps a
    layout). A stream's engine holds the parameters themselves: it sees weights loaded in place."""
    module, other = micro_module(), Code2WavModule(model=random_model(micro_config(), seed=4))
    cuda_path(module)
    before = [(p.data_ptr(), p.stride()) for p in module.parameters()]
    codes = torch.stack([c[:, :3] for c in REQS.values()])

    def decoded(stream=True):
        with torch.inference_mode():
            wavs = module.decode_batch({"codes": codes, "n_frames": [3] * len(codes)})
            wavs += [torch.cat(list(module.stream(codes[0].split(1, dim=1))), dim=-1)] if stream else []
            want = [module.model(c[None])[0] for c in [*codes, codes[0]]]
        assert all((w - v).abs().max() <= 1e-5 for w, v in zip(wavs, want))

    decoded(stream=False)
    assert [(p.data_ptr(), p.stride()) for p in module.parameters()] == before
    decoded()
    module.load_state_dict(other.state_dict())  # in place: the same tensors, new values
    decoded()
    assert module.engine.graphs.stats.replays > 0 and module.session.stream_decoder.engine.graphs.stats.replays > 0


def test_a_predict_after_use_ema_decodes_the_weights_swapped_in():
    """``use_ema(False)`` between two predicts swaps the raw weights in: the second predict must copy
    them into the kept engine's copies before lending them (a changed stamp), not decode the EMA ones."""
    module = micro_module(ema_decay=0.5, learning_rate=1e-2)
    cuda_path(module)
    cfg, n = module.config, module.config.output_length(6)
    batch = {
        "codes": random_codes(2, 6, cfg, seed=71),
        "audio": torch.randn(2, 1, n),
        "audio_lengths": torch.tensor([n, n]),
    }
    Trainer(**trainer_kwargs(max_steps=2)).fit(
        module, train_dataloaders=torch.utils.data.DataLoader([batch] * 2, batch_size=None)
    )
    assert_same(predict_reqs(module), eager(module), tol=EAGER_TOL)
    module.use_ema(False)
    assert_same(predict_reqs(module), eager(module), tol=EAGER_TOL)


@pytest.mark.gpu
def test_a_cuda_predict_of_a_module_the_caller_put_on_the_gpu_leaves_contiguous_weights(tmp_path):
    from safetensors.torch import save_file

    module = Code2WavModule(model=random_model("tiny", seed=2)).cuda()
    kwargs = {**trainer_kwargs(), "accelerator": "gpu"}
    for _ in range(2):  # on the GPU by hand, then where Lightning's teardown left it (the CPU)
        Trainer(**kwargs).predict(module, datamodule=CodesDataModule(predict=REQS, batch_size=2))
        state = module.state_dict()
        assert all(t.device.type == "cpu" and t.is_contiguous() for t in state.values())
        save_file(state, tmp_path / "weights.safetensors")
