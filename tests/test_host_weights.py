"""After predict, the weights go back into the host tensors they left (runner/session.py, runner/host_weights.py)."""

import lightning.pytorch as pl
import pytest
import torch
from conftest import random_model
from helpers import requests, trainer_kwargs, waveforms

from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, Trainer
from omni_lightning.runner.session import HostWeights, pack_parameters

cuda = pytest.mark.gpu


def storages(module):
    return [p.data_ptr() for p in module.parameters()]


def test_restore_copies_current_values_into_the_held_tensors():
    module = Code2WavModule(model=random_model("tiny", seed=1))
    before = storages(module)
    held = HostWeights.hold(module)
    for p in module.parameters():  # a move: new storage, and values the run changed
        p.data = p.data * 2 + 1
    moved = [p.data.clone() for p in module.parameters()]
    assert storages(module) != before
    assert held.restore() == len(before)
    assert storages(module) == before
    assert all(torch.equal(p.data, m) for p, m in zip(module.parameters(), moved))
    assert held.restore() == 0  # released


def test_pinning_packs_the_weights_into_one_buffer_values_kept_and_only_once(tmp_path):
    """On CUDA the held tensors are packed into one pinned buffer (the moves then run at the copy
    engines' speed); here a plain host buffer stands in for the pinned allocation."""
    from omni_lightning.runner.host_weights import ALIGN

    module = Code2WavModule(model=random_model("tiny", seed=1))
    values = [p.detach().clone() for p in module.parameters()]
    buffers = []

    def allocate(nbytes):
        buffers.append(torch.empty(nbytes, dtype=torch.uint8))
        return buffers[-1]

    held = HostWeights.hold(module, pin=allocate)
    assert len(buffers) == 1
    flat = buffers[0].data_ptr()
    assert all(p.data.untyped_storage().data_ptr() == flat for p in module.parameters())
    assert all((p.data_ptr() - flat) % ALIGN == 0 for p in module.parameters())
    assert all(torch.equal(p.data, v) for p, v in zip(module.parameters(), values))
    for p in module.parameters():  # a move and a run
        p.data = p.data * 2 + 1
    assert held.restore() == len(values)
    assert all(p.data.untyped_storage().data_ptr() == flat for p in module.parameters())  # back into the buffer
    assert all(torch.equal(p.data, v * 2 + 1) for p, v in zip(module.parameters(), values))
    assert pack_parameters(list(module.parameters()), allocate) == 0 and len(buffers) == 1  # packed already
    # weights that are views of one buffer still save and load as themselves (safetensors, torch.save)
    folder = module.export_pretrained(str(tmp_path / "packed"))
    loaded = Code2Wav.from_pretrained(str(folder))
    assert all(torch.equal(a, b) for a, b in zip(module.model.state_dict().values(), loaded.state_dict().values()))
    torch.save(module.state_dict(), tmp_path / "sd.pt")
    again = torch.load(tmp_path / "sd.pt")
    assert all(torch.equal(v, again[k]) for k, v in module.state_dict().items())

    def no_pinned_memory(nbytes):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    other = Code2WavModule(model=random_model("tiny", seed=1))
    before = storages(other)
    assert HostWeights.hold(other, pin=no_pinned_memory) is not None and storages(other) == before  # pageable
    lin = torch.nn.Linear(4, 4)
    tied = [lin.weight, lin.bias, torch.nn.Parameter(lin.weight.data[0])]  # a view: weights sharing memory
    assert pack_parameters(tied, allocate) == 0 and tied[2].data_ptr() == lin.weight.data_ptr()  # left as they are


def test_a_cast_or_a_module_off_the_cpu_is_left_to_the_stock_move():
    module = Code2WavModule(model=random_model("tiny", seed=1))
    held = HostWeights.hold(module)
    module.to(torch.bfloat16)  # the first bf16-true predict casts the weights
    assert held.restore() == 0
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert len({p.untyped_storage().data_ptr() for p in module.parameters()}) > 1  # not packed


def test_cast_weights_are_packed_on_the_way_back_so_the_next_predict_finds_them_packed():
    """A bf16-true predict over fp32 weights casts them: they cannot go back into the fp32 tensors
    held, so ``pin_cast`` packs them into one new buffer (on CUDA: pinned, copied from the device);
    here a plain host buffer stands in for the pinned allocation and a CPU cast for the device's."""
    module = Code2WavModule(model=random_model("tiny", seed=1))
    buffers = []

    def allocate(nbytes):
        buffers.append(torch.empty(nbytes, dtype=torch.uint8))
        return buffers[-1]

    held = HostWeights.hold(module, pin_cast=allocate)
    assert not buffers  # fp32 weights about to be cast are not packed on the way in
    module.to(torch.bfloat16)
    cast = [p.detach().clone() for p in module.parameters()]
    assert held.restore() == 0 and len(buffers) == 1
    flat = buffers[0].data_ptr()
    assert all(p.untyped_storage().data_ptr() == flat and p.dtype == torch.bfloat16 for p in module.parameters())
    assert all(torch.equal(p.data, c) for p, c in zip(module.parameters(), cast))
    again = HostWeights.hold(module, pin=allocate, pin_cast=allocate)  # the next predict: packed already
    assert len(buffers) == 1 and again.restore() == 0
    assert HostWeights.hold(torch.nn.Linear(2, 2, device="meta")) is None
    assert HostWeights.hold(torch.nn.ReLU()) is None  # no parameters


def test_only_predict_holds_weights():
    module = Code2WavModule(model=random_model("tiny", seed=1))
    for stage in ("fit", "validate", "test"):
        module.setup(stage)
        assert module.session._held is None
    module.setup("predict")
    assert isinstance(module.session._held, HostWeights)
    module.on_predict_end()
    assert module.session._held is None


def test_real_trainers_predict_and_leave_the_weights_in_their_host_tensors():
    module = Code2WavModule(model=random_model("tiny", seed=2))
    reqs = requests()
    before = storages(module)
    trainer = Trainer(**trainer_kwargs())
    first = waveforms(trainer.predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=3)))
    second = waveforms(trainer.predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=3)))
    assert storages(module) == before and module.session._held is None
    # the same weights; not bitwise the same floats: the engine's planner prefers the shapes it has run,
    # so the second call may split the batch differently (every split is exact to fp32 rounding)
    assert all(torch.allclose(first[r], second[r], rtol=0, atol=1e-5) for r in reqs)


@cuda
def test_a_cuda_bf16_predict_over_fp32_weights_leaves_them_packed_in_pinned_memory():
    module = Code2WavModule(model=random_model("tiny", seed=2))  # fp32: bf16-true casts them on the device
    reqs = requests()
    kwargs = {**trainer_kwargs(precision="bf16-true"), "accelerator": "gpu"}
    first = waveforms(Trainer(**kwargs).predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=3)))
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 and p.is_pinned() for p in module.parameters())
    assert len({p.untyped_storage().data_ptr() for p in module.parameters()}) == 1
    before = storages(module)
    second = waveforms(Trainer(**kwargs).predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=3)))
    assert storages(module) == before  # the second predict found them packed and returned them there
    assert all(torch.allclose(first[r], second[r], rtol=0, atol=2e-2) for r in reqs)


@cuda
def test_cuda_predicts_return_the_weights_to_their_host_tensors():
    module = Code2WavModule(model=random_model("tiny", seed=2).to(torch.bfloat16))
    reqs = requests()
    want = {n: p.detach().clone() for n, p in module.named_parameters()}
    kwargs = {**trainer_kwargs(precision="bf16-true"), "accelerator": "gpu"}
    before = None
    for _ in range(3):
        Trainer(**kwargs).predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=3))
        assert all(p.device.type == "cpu" for p in module.parameters())  # as stock Lightning leaves it
        # the first predict packs them into one pinned buffer; every later one returns them there
        assert all(p.is_pinned() for p in module.parameters())
        assert len({p.untyped_storage().data_ptr() for p in module.parameters()}) == 1
        assert before is None or storages(module) == before
        before = storages(module)
        assert all(torch.equal(p, want[n]) for n, p in module.named_parameters())


def test_a_lent_parameter_goes_back_uncopied_unless_written_to():
    module = Code2WavModule(model=random_model("tiny", seed=1))
    params = list(module.parameters())
    host = [p.detach().clone() for p in params]
    held = HostWeights.hold(module)
    copies = [p.detach() * 0 + 7 for p in params]  # stand-ins for device copies (different values: seen if copied)
    for p, c in zip(params, copies):
        held.lend(p, c)
    assert all(p.data_ptr() == c.data_ptr() for p, c in zip(params, copies))
    with torch.no_grad():
        params[0].add_(1)  # written to during the run: its values must come back
    assert held.restore() == len(params)
    assert torch.equal(params[0], copies[0]) and torch.all(params[0] == 8)
    assert all(torch.equal(p, h) for p, h in zip(params[1:], host[1:]))  # unwritten: pointed back, not copied


def test_a_kept_engine_lends_its_weights_to_the_next_predict_until_a_weight_changes():
    """Real Trainers on the CPU with an engine set by hand (a capture stand-in gives it weight tensors
    of its own, as on CUDA). After a predict, the engine's copies hold the parameters' values, so the
    next predict points the parameters at them instead of moving the weights in and out. To see which
    values a predict reads, the engine's copies are then set to other values by hand (a state the
    engine never reaches by itself): the next predict decodes those and leaves the host weights
    uncopied. A write to one parameter between predicts makes the next one copy the host values into
    the engine's copies before lending them: it decodes them exactly."""
    from helpers import RecordingCapture

    from omni_lightning import DecodeEngine

    module = Code2WavModule(model=random_model("tiny", seed=3))
    model = module.model
    module.engine = DecodeEngine(model, frames_per_forward=64, capture=RecordingCapture())  # set by hand
    reqs = requests([9, 14])
    dm = lambda: CodesDataModule(predict=reqs, batch_size=2)  # noqa: E731
    with torch.inference_mode():
        want = {r: model(c[None])[0] for r, c in reqs.items()}
    first = waveforms(Trainer(**trainer_kwargs()).predict(module, datamodule=dm()))
    assert all((first[r] - want[r]).abs().max() <= 1e-5 for r in reqs)
    copies = module.engine.weights.held
    host = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for c in copies[: len(host)]:
            c.data = c.data.clone().mul_(0.5)  # now apart from the host tensors
    lent = waveforms(Trainer(**trainer_kwargs()).predict(module, datamodule=dm()))
    assert any((lent[r] - want[r]).abs().max() > 1e-3 for r in reqs)  # it decoded the engine's copies
    assert all(torch.equal(p, h) for p, h in zip(model.parameters(), host))  # and copied nothing back
    assert all(p.data_ptr() != c.data_ptr() for p, c in zip(model.parameters(), copies))  # home again
    with torch.no_grad():
        next(model.parameters()).add_(0)  # a write (even of the same values): the copies are refreshed
    again = waveforms(Trainer(**trainer_kwargs()).predict(module, datamodule=dm()))
    assert all((again[r] - want[r]).abs().max() <= 1e-5 for r in reqs)


class SeesTheMove(pl.Callback):
    """Whether each predict's parameters arrived on the device in the kept engine's tensors (lent),
    seen before the engine's own refresh (callbacks' on_predict_start runs before the module's)."""

    def __init__(self):
        self.lent = []

    def on_predict_start(self, trainer, pl_module):
        engine = pl_module.engine
        params = list(pl_module.model.parameters())
        held = engine.weights.held if engine is not None and engine.weights is not None else []
        self.lent.append(bool(held) and all(p.data_ptr() == h.data_ptr() for p, h in zip(params, held)))


@cuda
def test_cuda_predicts_lend_the_kept_engine_its_weights_and_return_them_uncopied():
    module = Code2WavModule(model=random_model("tiny", seed=2).to(torch.bfloat16))
    reqs = requests()
    want = {n: p.detach().clone() for n, p in module.named_parameters()}
    seen = SeesTheMove()
    kwargs = {**trainer_kwargs(precision="bf16-true"), "accelerator": "gpu", "callbacks": [seen]}
    outs = [
        waveforms(Trainer(**kwargs).predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=3)))
        for _ in range(3)
    ]
    assert seen.lent == [False, True, True]  # the first predict builds the engine; the next two borrow it
    assert all(torch.equal(p, want[n]) and p.device.type == "cpu" for n, p in module.named_parameters())
    assert all(torch.allclose(outs[0][r], o[r], rtol=0, atol=2e-2) for o in outs[1:] for r in reqs)
    with torch.no_grad():
        module.model.pre_transformer.norm.weight.mul_(2)  # a change on the host between predicts
    changed = waveforms(Trainer(**kwargs).predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=3)))
    assert seen.lent[-1] is True  # lent again, its copies refreshed from the host first
    assert any((changed[r] - outs[0][r]).abs().max() > 1e-2 for r in reqs)
    fresh = Code2WavModule(model=random_model("tiny", seed=2).to(torch.bfloat16))
    fresh.load_state_dict(module.state_dict())
    ref = waveforms(
        Trainer(**{**kwargs, "callbacks": []}).predict(fresh, datamodule=CodesDataModule(predict=reqs, batch_size=3))
    )
    assert all(torch.allclose(changed[r], ref[r], rtol=0, atol=2e-2) for r in reqs)
