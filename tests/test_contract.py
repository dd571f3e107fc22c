"""Lightning's predict contracts, held by ``lightning.Trainer`` and ``omni_lightning.Trainer`` alike.

Every test that takes the ``make_trainer`` fixture runs once per trainer with the same assertions,
written from Lightning's documented predict behaviour, so a divergence of ours shows as a failure of
the ``omni`` case only. The modules are BoringModel-sized and return anything but
``MultimodalOutputs``: this file is the pass-through side of the rule (tests/test_runner.py holds
the runner side). ``test_private_lightning_points_keep_their_shape`` pins the private Lightning
points OmniPredictionLoop relies on, and that its step makes the stock step's calls in order.
``OMNI_LIGHTNING_SLOW=1`` adds a ddp_spawn predict (slow).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import trainer_kwargs
from lightning.pytorch.callbacks import BasePredictionWriter, Callback
from lightning.pytorch.loops.prediction_loop import _PredictionLoop
from lightning.pytorch.profilers import AdvancedProfiler, SimpleProfiler
from torch.utils.data import DataLoader

import omni_lightning
from omni_lightning import OmniModelRunnerOutput, OmniPredictionLoop

TRAINERS = {"lightning": pl.Trainer, "omni": omni_lightning.Trainer}
QUIET = trainer_kwargs()
ROWS = torch.arange(28.0).view(7, 4)
ORDER = [5, 3, 0, 6, 1, 2, 4]  # a fixed sampler order: batch indices are the dataset's, not positions


@pytest.fixture(params=list(TRAINERS))
def trainer_cls(request):
    return TRAINERS[request.param]


@pytest.fixture
def make_trainer(trainer_cls):
    return lambda **kw: trainer_cls(**{**QUIET, **kw})


def loader(rows=ROWS, batch_size=3, sampler=ORDER):
    return DataLoader(list(rows), batch_size=batch_size, sampler=sampler)


def _y(batch, batch_idx, y):
    return y


class Net(pl.LightningModule):
    """One linear layer; ``make`` builds what ``predict_step`` returns from (batch, batch_idx, y)."""

    def __init__(self, make=None, log=None):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.make = make or _y  # picklable: ddp_spawn sends the module to its processes
        self.returned = []  # what predict_step returned, in order
        self.batch_end_outputs = []  # what on_predict_batch_end received
        self.log_ = log if log is not None else []
        self.seen = []  # (training, inference mode, grad enabled, batch dtype) inside predict_step

    def predict_step(self, batch, batch_idx):
        self.log_.append(("module", "predict_step", batch_idx))
        self.seen.append((self.training, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), batch.dtype))
        out = self.make(batch, batch_idx, self.layer(batch))
        self.returned.append(out)
        return out

    def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.batch_end_outputs.append(outputs)


# --- return values ---------------------------------------------------------------------------------


class Opaque:
    """An object Lightning knows nothing about: it comes back as is."""


class Movable:
    """Has ``to(device)``: Lightning's ``move_data_to_device`` calls it and keeps what it returns."""

    def __init__(self, y):
        self.y, self.moved_to = y, None

    def to(self, device):
        moved = Movable(self.y.to(device))
        moved.moved_to = torch.device(device)
        return moved


@dataclasses.dataclass
class Pair:
    y: torch.Tensor
    tag: str


SHAPES = {
    "tensor": lambda b, i, y: y,
    "int": lambda b, i, y: i,
    "list": lambda b, i, y: [y, i],
    "tuple": lambda b, i, y: (y, "x"),
    "dict": lambda b, i, y: {"y": y, "n": i},
    # shaped like a Code2Wav step's outputs, but a plain dict: not a multimodal output
    "dict_like_ours": lambda b, i, y: {"model_outputs": list(y), "sr": 24000},
    "object": lambda b, i, y: Opaque(),
    "movable": lambda b, i, y: Movable(y),
    "dataclass": lambda b, i, y: Pair(y, "t"),
}


def same_after_move(got, sent):
    """What Lightning documents for returned predictions: ``move_data_to_device(sent, "cpu")``."""
    if isinstance(sent, torch.Tensor):
        return got is sent  # already on the CPU: .to("cpu") is the tensor itself
    if isinstance(sent, Movable):
        return isinstance(got, Movable) and got.moved_to == torch.device("cpu") and torch.equal(got.y, sent.y)
    if isinstance(sent, Pair):
        return type(got) is Pair and got.y is sent.y and got.tag == sent.tag
    if isinstance(sent, (list, tuple)):
        return type(got) is type(sent) and len(got) == len(sent) and all(map(same_after_move, got, sent))
    if isinstance(sent, dict):
        return type(got) is dict and got.keys() == sent.keys() and all(same_after_move(got[k], sent[k]) for k in sent)
    return got is sent


@pytest.mark.parametrize("shape", list(SHAPES))
def test_return_values_of_every_shape(make_trainer, shape):
    net = Net(SHAPES[shape])
    writer = Writer("batch")
    preds = make_trainer(callbacks=[writer]).predict(net, loader())
    assert len(net.returned) == 3 and len(preds) == 3
    # the hooks and writers get the very object predict_step returned
    assert all(a is b for a, b in zip(net.batch_end_outputs, net.returned))
    assert all(call["prediction"] is sent for call, sent in zip(writer.batch_calls, net.returned))
    assert all(same_after_move(got, sent) for got, sent in zip(preds, net.returned))
    assert not any(isinstance(p, OmniModelRunnerOutput) for p in preds)


def test_predict_step_returning_none_warns_once(make_trainer):
    net = Net(lambda b, i, y: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        preds = make_trainer().predict(net, loader())
    assert preds == [None, None, None] and net.batch_end_outputs == [None, None, None]
    assert sum("predict returned None" in str(w.message) for w in caught) == 1


# --- writers and return_predictions ------------------------------------------------------------------


class Writer(BasePredictionWriter):
    def __init__(self, interval):
        super().__init__(interval)
        self.batch_calls, self.epoch_calls = [], []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        call = dict(prediction=prediction, indices=list(batch_indices), batch=batch, batch_idx=batch_idx)
        self.batch_calls.append({**call, "dataloader_idx": dataloader_idx})

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epoch_calls.append((list(predictions), batch_indices))


@pytest.mark.parametrize("return_predictions", [True, False])
@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
def test_prediction_writer_intervals_and_batch_indices(make_trainer, interval, return_predictions):
    net = Net()
    writer = Writer(interval)
    preds = make_trainer(callbacks=[writer]).predict(net, loader(), return_predictions=return_predictions)
    indices = [[5, 3, 0], [6, 1, 2], [4]]
    if interval in ("batch", "batch_and_epoch"):
        assert [c["indices"] for c in writer.batch_calls] == indices
        assert [c["batch_idx"] for c in writer.batch_calls] == [0, 1, 2]
        assert [c["dataloader_idx"] for c in writer.batch_calls] == [0, 0, 0]
        assert all(torch.equal(c["batch"], ROWS[i]) for c, i in zip(writer.batch_calls, indices))
        assert [c["prediction"] for c in writer.batch_calls] == net.returned
    else:
        assert writer.batch_calls == []
    if interval in ("epoch", "batch_and_epoch"):
        ((predictions, batch_indices),) = writer.epoch_calls
        assert batch_indices == [indices]  # per dataloader, even for one
        assert len(predictions) == 3 and all(p is r for p, r in zip(predictions, net.returned))
    else:
        assert writer.epoch_calls == []
    if return_predictions:
        assert len(preds) == 3 and all(p is r for p, r in zip(preds, net.returned))
    else:
        assert preds is None


# --- hooks ---------------------------------------------------------------------------------------------

CALLBACK_HOOKS = [
    "setup",
    "on_predict_start",
    "on_predict_epoch_start",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_predict_epoch_end",
    "on_predict_end",
    "teardown",
]
MODULE_HOOKS = [
    "setup",
    "on_predict_model_eval",
    "on_predict_start",
    "on_predict_epoch_start",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_predict_epoch_end",
    "on_predict_end",
    "teardown",
]


class HookLog(Callback):
    def __init__(self, log):
        self.entries = log
        for name in CALLBACK_HOOKS:
            setattr(self, name, self._recorder(name))

    def _recorder(self, name):
        def hook(trainer, pl_module, *args, **kwargs):
            self.entries.append(("callback", name, *_batch_args(name, args)))

        return hook


def _batch_args(name, args):
    """The (batch_idx, dataloader_idx) a batch hook received; its outputs' type for batch-end hooks."""
    if name in ("on_predict_batch_start", "on_predict_batch_end"):
        outputs, rest = (args[0], args[1:]) if name.endswith("end") else (None, args)
        kept = (rest[1], rest[2] if len(rest) > 2 else "no dataloader_idx")
        return (*kept, type(outputs).__name__) if name.endswith("end") else kept
    return ()


class HookNet(Net):
    """Records every predict hook of the module."""

    def __init__(self, log, **kw):
        super().__init__(log=log, **kw)
        for name in MODULE_HOOKS:
            setattr(self, name, self._recorder(name, getattr(self, name)))

    def _recorder(self, name, original):
        def hook(*args, **kwargs):
            self.log_.append(("module", name, *_batch_args(name, args)))
            return original(*args, **kwargs)

        return hook


def expected_hooks(batches_per_loader):
    """Lightning's documented predict hook order; batch hooks get a dataloader_idx with several loaders."""
    log = [
        ("callback", "setup"),
        ("module", "setup"),
        ("module", "on_predict_model_eval"),
        ("callback", "on_predict_start"),
        ("module", "on_predict_start"),
        ("callback", "on_predict_epoch_start"),
        ("module", "on_predict_epoch_start"),
    ]
    for dataloader_idx, batches in enumerate(batches_per_loader):
        dl = dataloader_idx if len(batches_per_loader) > 1 else "no dataloader_idx"
        for i in range(batches):
            log += [
                ("module", "on_before_batch_transfer"),
                ("module", "transfer_batch_to_device"),
                ("module", "on_after_batch_transfer"),
                ("callback", "on_predict_batch_start", i, dl),
                ("module", "on_predict_batch_start", i, dl),
                ("module", "predict_step", i),
                ("callback", "on_predict_batch_end", i, dl, "Tensor"),
                ("module", "on_predict_batch_end", i, dl, "Tensor"),
            ]
    log += [
        ("callback", "on_predict_epoch_end"),
        ("module", "on_predict_epoch_end"),
        ("callback", "on_predict_end"),
        ("module", "on_predict_end"),
        ("callback", "teardown"),
        ("module", "teardown"),
    ]
    return log


class TwoLoaderHookNet(HookNet):
    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return super().predict_step(batch, batch_idx)


def test_hook_order(make_trainer):
    log = []
    make_trainer(callbacks=[HookLog(log)]).predict(HookNet(log), loader())
    assert log == expected_hooks([3])


def test_hook_order_with_two_dataloaders(make_trainer):
    log = []
    make_trainer(callbacks=[HookLog(log)]).predict(TwoLoaderHookNet(log), [loader(), loader(ROWS[:2], 2, sampler=None)])
    assert log == expected_hooks([3, 1])


# --- dataloaders and limits ----------------------------------------------------------------------------


class TwoLoaderNet(Net):
    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        out = (dataloader_idx, batch_idx, self.layer(batch))
        self.returned.append(out)
        return out


def test_multiple_dataloaders(make_trainer):
    net, writer = TwoLoaderNet(), Writer("batch_and_epoch")
    preds = make_trainer(callbacks=[writer]).predict(net, [loader(), loader(ROWS[:4], 2, sampler=None)])
    assert [len(p) for p in preds] == [3, 2]  # one list per dataloader
    assert [(p[0], p[1]) for p in preds[0] + preds[1]] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    steps = [(c["dataloader_idx"], c["batch_idx"]) for c in writer.batch_calls]
    assert steps == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    ((predictions, batch_indices),) = writer.epoch_calls
    assert batch_indices == [[[5, 3, 0], [6, 1, 2], [4]], [[0, 1], [2, 3]]]
    assert [len(p) for p in predictions] == [3, 2]


def test_multiple_dataloaders_need_dataloader_idx(make_trainer):
    with pytest.raises(RuntimeError, match="dataloader_idx"):
        make_trainer().predict(Net(), [loader(), loader()])


@pytest.mark.parametrize(("limit", "batches"), [(2, 2), (0.5, 1), (0, 0)])
def test_limit_predict_batches(make_trainer, limit, batches):
    net = Net()
    trainer = make_trainer(limit_predict_batches=limit)
    preds = trainer.predict(net, loader())
    assert len(net.returned) == batches
    if batches:
        assert len(preds) == batches and trainer.num_predict_batches == [batches]
    else:
        assert preds is None


def test_module_mode_restored(make_trainer):
    net = Net()
    net.extra = torch.nn.Dropout()
    net.train()
    net.extra.eval()
    make_trainer().predict(net, loader())
    assert net.training and net.layer.training and not net.extra.training
    assert {seen[0] for seen in net.seen} == {False}
    net.eval()
    make_trainer().predict(net, loader())
    assert not net.training and not net.layer.training


# --- profiler, inference mode, precision ---------------------------------------------------------------


class Started:
    """Records the action names a profiler is asked to start."""

    def start(self, action_name):
        self.started.append(action_name)
        super().start(action_name)


class RecordingSimple(Started, SimpleProfiler):
    started: list


class RecordingAdvanced(Started, AdvancedProfiler):
    started: list


@pytest.mark.parametrize("profiler_cls", [RecordingSimple, RecordingAdvanced])
def test_profiler_action_names(make_trainer, profiler_cls, tmp_path):
    profiler = profiler_cls(dirpath=tmp_path, filename="profile")
    profiler.started = []
    make_trainer(profiler=profiler).predict(Net(), loader())
    names = set(profiler.started)
    strategy = "[Strategy]SingleDeviceStrategy."
    want = {
        "[_PredictionLoop].predict_next",
        f"{strategy}predict_step",
        f"{strategy}batch_to_device",
        f"{strategy}on_predict_start",
        f"{strategy}on_predict_end",
        "[LightningModule]Net.on_predict_batch_end",
        "[LightningModule]Net.on_predict_start",
    }
    assert want <= names
    assert {n for n in names if "Loop" in n} == {"[_PredictionLoop].predict_next"}
    assert profiler.started.count(f"{strategy}predict_step") == 3


@pytest.mark.parametrize("inference_mode", [True, False])
def test_inference_mode(make_trainer, inference_mode):
    net = Net()
    make_trainer(inference_mode=inference_mode).predict(net, loader())
    assert {seen[1:3] for seen in net.seen} == {(inference_mode, False)}


@pytest.mark.parametrize("inference_mode", [True, False])
def test_inference_mode_when_the_loop_is_installed_on_a_stock_trainer(inference_mode):
    trainer = pl.Trainer(**QUIET, inference_mode=inference_mode)
    trainer.predict_loop = OmniPredictionLoop(trainer)
    net = Net()
    trainer.predict(net, loader())
    assert {seen[1:3] for seen in net.seen} == {(inference_mode, False)}


@pytest.mark.parametrize("inference_mode", [True, False])
def test_inference_mode_through_lightning_cli(trainer_cls, inference_mode):
    from lightning.pytorch.cli import LightningCLI

    args = [f"--trainer.{k}={v}" for k, v in QUIET.items()] + [f"--trainer.inference_mode={inference_mode}"]
    cli = LightningCLI(Net, trainer_class=trainer_cls, args=args, run=False, save_config_callback=None)
    cli.trainer.predict(cli.model, loader())
    assert {seen[1:3] for seen in cli.model.seen} == {(inference_mode, False)}


def test_precision_plugin_converts_the_input(make_trainer):
    net = Net()
    preds = make_trainer(precision="64-true").predict(net, loader())
    assert {seen[3] for seen in net.seen} == {torch.float64} and preds[0].dtype == torch.float64


# --- dataloader_iter, exceptions, checkpoints, tuner ---------------------------------------------------


class IterNet(Net):
    """``predict_step(dataloader_iter)``: the step pulls ``per_step`` batches itself."""

    def __init__(self, per_step):
        super().__init__()
        self.per_step = per_step
        self.batch_end_idx = []

    def predict_step(self, dataloader_iter):
        pulled = [next(dataloader_iter) for _ in range(self.per_step)]
        self.returned.append([(batch_idx, float(batch.sum())) for batch, batch_idx, _ in pulled])
        return self.returned[-1]

    def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.batch_end_idx.append((batch_idx, float(batch.sum())))


@pytest.mark.parametrize("per_step", [1, 2])
def test_dataloader_iter_step(make_trainer, per_step):
    net = IterNet(per_step)
    rows = ROWS[:6]
    preds = make_trainer().predict(net, loader(rows, 1, sampler=None))
    sums = [float(r.sum()) for r in rows]
    want = [[(i + j, sums[i + j]) for j in range(per_step)] for i in range(0, 6, per_step)]
    assert preds == want
    # the batch-end hooks get the batch the step pulled last
    assert net.batch_end_idx == [step[-1] for step in want]


class Failing(Net):
    def predict_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise ValueError("boom at batch 1")
        return super().predict_step(batch, batch_idx)


class ExceptionLog(Callback):
    def __init__(self):
        self.exceptions, self.ended = [], False

    def on_exception(self, trainer, pl_module, exception):
        self.exceptions.append(exception)

    def on_predict_end(self, trainer, pl_module):
        self.ended = True


@pytest.mark.parametrize("progress_bar", [False, True])
def test_exception_in_predict_step(make_trainer, progress_bar):
    log = ExceptionLog()
    trainer = make_trainer(callbacks=[log], enable_progress_bar=progress_bar)
    net = Failing()
    net.train()
    with pytest.raises(ValueError, match="boom at batch 1") as err:
        trainer.predict(net, loader())
    assert log.exceptions == [err.value] and not log.ended
    assert trainer.interrupted and trainer.state.status == "interrupted"
    progress = trainer.predict_loop.batch_progress.current
    assert (progress.ready, progress.started, progress.processed, progress.completed) == (2, 2, 1, 1)
    # the same trainer predicts again from a clean start
    preds = trainer.predict(Net(), loader())
    assert len(preds) == 3 and trainer.state.status == "finished"
    assert trainer.predict_loop.batch_progress.current.completed == 3


def test_ckpt_path_loads_the_weights(make_trainer, tmp_path):
    trained = Net()
    with torch.no_grad():
        trained.layer.weight.fill_(0.5)
    stock = pl.Trainer(**QUIET, default_root_dir=tmp_path)
    stock.predict(trained, loader())
    stock.save_checkpoint(tmp_path / "net.ckpt")
    preds = make_trainer().predict(Net(), loader(), ckpt_path=tmp_path / "net.ckpt")
    with torch.no_grad():
        assert all(torch.equal(p, trained.layer(ROWS[i])) for p, i in zip(preds, [[5, 3, 0], [6, 1, 2], [4]]))


class SizedNet(Net):
    def __init__(self):
        super().__init__()
        self.batch_size = 2

    def predict_dataloader(self):
        return DataLoader(list(ROWS), batch_size=self.batch_size)


def test_batch_size_tuner_on_predict(make_trainer):
    from lightning.pytorch.tuner import Tuner

    net = SizedNet()
    trainer = make_trainer()
    found = Tuner(trainer).scale_batch_size(net, method="predict", mode="power", max_trials=2, init_val=2)
    assert found == 4 and net.batch_size == 4  # 2, then 4: two trials, no failure on a CPU
    assert len(trainer.predict(net)) == 2


# --- the private Lightning points OmniPredictionLoop relies on (lightning>=2.6,<2.7) -----------------------


# what a predict step does, in order: hook calls, progress counters and the stock helpers it runs
STEP_CALLS = re.compile(
    r'_call_\w+\(\s*trainer, "\w+"|increment_\w+|_store_data_for_prediction_writer|_build_step_args_from_hook_kwargs'
    r"|_build_kwargs|_warning_cache\.warn|convert_input|_on_before_batch_transfer|move_data_to_device"
)


def test_private_lightning_points_keep_their_shape():
    """Fails loudly when a Lightning upgrade moves what OmniPredictionLoop relies on (see its module
    docstring): re-check its step against the new ``_PredictionLoop._predict_step`` before widening the pin."""

    def params(fn):
        return list(inspect.signature(fn).parameters)

    assert params(_PredictionLoop.__init__) == ["self", "trainer", "inference_mode"]
    assert params(_PredictionLoop._predict_step) == ["self", "batch", "batch_idx", "dataloader_idx", "dataloader_iter"]
    for name in ("_on_before_fetch", "_on_after_fetch", "on_run_start", "on_run_end", "teardown"):
        assert params(getattr(_PredictionLoop, name)) == ["self"], name
    # the step OmniPredictionLoop rewrites: the same calls in the same order as the stock one
    stock, ours = _PredictionLoop._predict_step, OmniPredictionLoop._predict_step
    assert STEP_CALLS.findall(inspect.getsource(stock)) == STEP_CALLS.findall(inspect.getsource(ours))
    assert params(_PredictionLoop._build_kwargs) == ["self", "batch", "batch_idx", "dataloader_idx"]
    assert params(_PredictionLoop._build_step_args_from_hook_kwargs) == ["self", "hook_kwargs", "step_hook_name"]
    assert params(_PredictionLoop._store_data_for_prediction_writer) == ["self", "batch_idx", "dataloader_idx"]
    assert params(pl.LightningModule._on_before_batch_transfer) == ["self", "batch", "dataloader_idx"]
    for name in ("_call_strategy_hook", "_call_callback_hooks", "_call_lightning_module_hook"):
        assert params(getattr(pl.trainer.call, name))[:3] == ["trainer", "hook_name", "args"], name
    assert {"_predictions", "_return_predictions", "_warning_cache"} <= set(vars(pl.Trainer(**QUIET).predict_loop))
    # stock hands the step no dataloader_iter unless the step takes one, and its hooks get the batch pulled last
    assert "dataloader_iter = None" in inspect.getsource(inspect.getmodule(_PredictionLoop))
    assert "batch = data_fetcher._batch" in inspect.getsource(stock)
    # the stock fetch action is named after the loop's class, the name OmniPredictionLoop keeps
    assert "[{type(self).__name__}].predict_next" in inspect.getsource(_PredictionLoop._on_before_fetch)
    assert pl.Trainer(**QUIET, inference_mode=False).predict_loop.inference_mode is False


class RankWriter(BasePredictionWriter):
    """Saves what each spawned process's writer received (callbacks live in the children)."""

    def __init__(self, out):
        super().__init__("batch_and_epoch")
        self.out, self.batches = out, []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((list(batch_indices), prediction))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        epoch = (batch_indices, list(predictions))
        torch.save({"batches": self.batches, "epoch": epoch}, self.out / f"rank{trainer.global_rank}.pt")


@pytest.mark.skipif(
    not os.environ.get("OMNI_LIGHTNING_SLOW"),
    reason="spawns two processes (about a minute per trainer on 2 CPU cores); OMNI_LIGHTNING_SLOW=1 runs it",
)
def test_ddp_spawn_predict(make_trainer, tmp_path):
    net = Net()
    trainer = make_trainer(strategy="ddp_spawn", devices=2, callbacks=[RankWriter(tmp_path)])
    assert trainer.predict(net, loader(sampler=None), return_predictions=False) is None
    seen = []
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert [indices for indices, _ in saved["batches"]] == saved["epoch"][0][0]
        for (indices, prediction), epoch_prediction in zip(saved["batches"], saved["epoch"][1]):
            with torch.no_grad():
                assert torch.allclose(prediction, net.layer(ROWS[indices]))
            assert torch.equal(prediction, epoch_prediction)
            seen += indices
    assert sorted(seen) == list(range(7))  # every row once across the two processes
