"""The progress bar counts audio seconds, not batches, and ends its line before Lightning's last words."""

import io
import logging
import sys

import lightning.pytorch.demos.boring_classes
import pytest
import torch
from conftest import random_codes
from helpers import TINY, trainer_kwargs
from lightning.pytorch.callbacks.progress import tqdm_progress
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch.utils.data import DataLoader

from omni_lightning import Code2WavModule, CodesDataModule, Trainer
from omni_lightning.callbacks.progress import AudioProgressBar
from omni_lightning.data.synthetic import make_demo_data, make_teacher


def test_progress_bar_counts_audio_seconds_on_length_sorted_batches(model):
    lengths = [2, 30, 3, 25, 4]
    job = {f"r{i}": random_codes(1, n, seed=i)[0] for i, n in enumerate(lengths)}
    job["bad"] = torch.full((16, 3), -1)
    bar = AudioProgressBar()
    kw = {**trainer_kwargs(callbacks=[bar]), "enable_progress_bar": True}
    data = CodesDataModule(predict=job, batch_size=2, config="tiny")
    Trainer(**kw).predict(Code2WavModule(model=model), datamodule=data, return_predictions=False)
    total = sum(TINY.output_length(n) for n in lengths) / TINY.sample_rate
    tqdm = bar.predict_progress_bar
    assert tqdm.total == pytest.approx(total, abs=0.05) and tqdm.n == tqdm.total  # audio seconds, not batches
    assert "requests=6/6" in tqdm.postfix
    # a second predict with the same bar gets a bar of its own, counting its own requests
    trainer = Trainer(**kw)
    trainer.predict(Code2WavModule(model=model), datamodule=CodesDataModule(predict={"a": job["r1"]}, batch_size=1))
    assert bar.predict_progress_bar is not tqdm and bar.predict_progress_bar.n == bar.predict_progress_bar.total > 0


def test_the_bar_ends_its_line_before_lightning_says_fit_stopped(tmp_path, capsys):
    """Where stdout and stderr share a terminal or a log file, Lightning's "`Trainer.fit` stopped" line
    came after the bar on its line; the logger's version number (``v_num``) is not in the bar."""
    from lightning.pytorch.loggers import CSVLogger

    train = make_demo_data(tmp_path / "data", 2, 1.0, 1.2, teacher=make_teacher(), seed=0, name="train.jsonl")
    lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    shared = logging.StreamHandler(sys.stdout)  # the bar's stream (captured)
    lightning_log.addHandler(shared)
    try:
        kw = trainer_kwargs(max_steps=2, limit_val_batches=0, log_every_n_steps=1, enable_progress_bar=True)
        kw["logger"] = CSVLogger(tmp_path)
        data = CodesDataModule(train=str(train), batch_size=2, crop_frames=12)
        Trainer(**kw).fit(Code2WavModule(config="tiny", random_weights=True), datamodule=data)
    finally:
        lightning_log.removeHandler(shared)
    out = capsys.readouterr().out
    assert "\n`Trainer.fit` stopped: `max_steps=2` reached." in out and "train/loss" in out, out
    assert "v_num" not in out, out
    # stdout is not a terminal here: whole lines, one each tenth of the steps, no "\r" redraws
    assert "\r" not in out and "\x1b" not in out, repr(out)
    steps = [line.split(" (")[0] for line in out.splitlines() if line.startswith("Epoch ")]
    assert steps == ["Epoch 0, step 1/2", "Epoch 1, step 2/2"], out


class FailsOnce(Code2WavModule):
    """Raises in its second predict step the first time it predicts (a crash mid-job)."""

    failed = False

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 1 and not self.failed:
            type(self).failed = True
            raise RuntimeError("crash mid-job")
        return super().predict_step(batch, batch_idx, dataloader_idx)


def test_a_predict_after_a_failed_one_on_the_same_trainer_completes_with_its_own_bar(model):
    job = {f"r{i}": random_codes(1, n, seed=i)[0] for i, n in enumerate([3, 5, 7, 9])}
    kw = {**trainer_kwargs(), "enable_progress_bar": True}
    trainer = Trainer(**kw)
    module = FailsOnce(model=model)
    with pytest.raises(RuntimeError, match="crash mid-job"):
        trainer.predict(module, datamodule=CodesDataModule(predict=job, batch_size=2, config="tiny"))
    bar = next(cb for cb in trainer.callbacks if isinstance(cb, AudioProgressBar))
    failed_bar = bar.predict_progress_bar
    preds = trainer.predict(module, datamodule=CodesDataModule(predict=job, batch_size=2, config="tiny"))
    assert sorted(r for o in preds for r in o.req_ids) == sorted(job)
    assert bar.predict_progress_bar is not failed_bar and "requests=4/4" in bar.predict_progress_bar.postfix


class RecordingTqdm(Tqdm):
    """A user's ``Tqdm`` (Lightning's own tests patch one in the same way): records each bar's totals."""

    def __init__(self, *args, **kwargs):
        self.total_values = []
        super().__init__(*args, **kwargs)
        self.total_values = []  # the totals set after the bar was made: one per dataloader

    @property
    def total(self):
        return self._total

    @total.setter
    def total(self, value):
        self._total = value
        self.total_values.append(value)


class Terminal(io.StringIO):
    def isatty(self):
        return True


class TwoLoaders(lightning.pytorch.demos.boring_classes.BoringModel):
    def val_dataloader(self):
        return [DataLoader(RandomDataset(32, 64)), DataLoader(RandomDataset(32, 64))]

    predict_dataloader = val_dataloader

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        return None


@pytest.mark.parametrize("terminal", [False, True], ids=["log-file", "terminal"])
def test_a_patched_tqdm_is_the_class_every_bar_is_made_from(tmp_path, monkeypatch, capsys, terminal):
    """``tqdm_progress.Tqdm`` patched, as a user or Lightning's own tests do it, is what the bar makes its bars
    from, on a terminal or in a log file (where they write lines); each bar counts its dataloaders' batches."""
    if terminal:
        monkeypatch.setattr(sys, "stdout", Terminal())
    monkeypatch.setattr(tqdm_progress, "Tqdm", RecordingTqdm)
    kw = {**trainer_kwargs(max_epochs=1, limit_train_batches=3, limit_val_batches=2, num_sanity_val_steps=1),
          "enable_progress_bar": True, "default_root_dir": tmp_path}  # fmt: skip
    trainer = Trainer(**kw)
    bar = trainer.progress_bar_callback
    trainer.fit(TwoLoaders())
    assert isinstance(bar.train_progress_bar, RecordingTqdm) and isinstance(bar.val_progress_bar, RecordingTqdm)
    assert bar.train_progress_bar.total == bar.train_progress_bar.n == 3
    assert bar.val_progress_bar.total_values == [2, 2]  # one reset per dataloader
    trainer.predict(TwoLoaders(), return_predictions=False)
    assert isinstance(bar.predict_progress_bar, RecordingTqdm) and bar.predict_progress_bar.n == 64
    assert bar.predict_progress_bar.total_values == [64, 64]
    out = sys.stdout.getvalue() if terminal else capsys.readouterr().out
    assert ("\r" in out) == terminal  # a terminal's bars redraw; a log file's are lines
    if not terminal:
        assert "Predicting DataLoader 1: 64/64" in out and "Epoch 0, step 3" in out, out
