"""``InterruptedFitCheckpoint``: a fit stopped inside a training step and resumed from the file it saved
runs on the steps an uninterrupted fit runs on: its validations at the same steps, its last checkpoint
at ``max_steps``, its metrics logged at the same steps, its learning rate where the schedule says.

Lightning's own progress counters, saved mid-step, count the unfinished batch as begun; its restart
logic then puts every later step-based check one step early (the last optimizer step was never
checkpointed). The CLI test in ``test_cli_startup.py`` stops between steps, where this does not show. The
resumed fit ends with the uninterrupted fit's weights: the training loader resumes within its epoch.
"""

import csv

import pytest
import torch
from conftest import random_model
from helpers import trainer_kwargs
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from omni_lightning import Code2WavModule, CodesDataModule, InterruptedFitCheckpoint, Trainer
from omni_lightning.data.synthetic import make_demo_data, make_teacher

STEPS, EVERY = 8, 4


class StopInStep(Callback):
    """Raises inside the training step of the batch after optimizer step ``at`` (before its backward)."""

    def __init__(self, at):
        self.at = at

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step == self.at:
            raise RuntimeError(f"stopped in the step after {self.at}")


class Seen(Callback):
    def __init__(self):
        self.validated = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validated.append(trainer.global_step)


def fit(folder, data, ckpt_path=None, stop_at=None):
    seen = Seen()
    callbacks = [seen, InterruptedFitCheckpoint(folder), ModelCheckpoint(folder, save_last=True, save_top_k=0)]
    callbacks += [StopInStep(stop_at)] if stop_at is not None else []
    trainer = Trainer(**trainer_kwargs(max_steps=STEPS, val_check_interval=EVERY, check_val_every_n_epoch=None,
                                       num_sanity_val_steps=0, callbacks=callbacks, enable_checkpointing=True,
                                       logger=CSVLogger(folder, name="log", version=0)))  # fmt: skip
    module = Code2WavModule(model=random_model("tiny", seed=1), total_steps=STEPS, warmup_steps=1)
    if stop_at is None:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    else:
        with pytest.raises(RuntimeError, match="stopped in the step"):
            trainer.fit(module, datamodule=data)
    rows = list(csv.DictReader((folder / "log/version_0/metrics.csv").open()))
    val_steps = [int(r["step"]) for r in rows if r.get("val/loss")]
    return seen.validated, val_steps, module


@pytest.mark.parametrize("stop_at", [5, 4])  # mid-epoch; the first batch of an epoch, just after a validation
def test_a_fit_stopped_inside_a_step_resumes_on_the_uninterrupted_fits_steps(tmp_path, stop_at):
    pairs = make_demo_data(tmp_path / "data", 4, 1.0, 1.2, teacher=make_teacher(), seed=0, name="pairs.jsonl")

    def data():  # 2 batches an epoch, so step 4 and 8 end epochs and a stop at 5 is mid-epoch
        return CodesDataModule(train=pairs, val=pairs, batch_size=2, crop_frames=6, num_workers=0)

    whole_validated, whole_logged, whole = fit(tmp_path / "whole", data())
    assert whole_validated == [4, 8]

    fit(tmp_path / "stopped", data(), stop_at=stop_at)
    saved = tmp_path / "stopped" / "interrupted.ckpt"
    assert torch.load(saved, weights_only=False)["global_step"] == stop_at
    validated, logged, resumed = fit(tmp_path / "resumed", data(), ckpt_path=saved)
    assert validated == [v for v in whole_validated if v > stop_at]
    assert logged == [s for s in whole_logged if s >= stop_at]
    last = torch.load(tmp_path / "resumed" / "last.ckpt", weights_only=False)
    assert last["global_step"] == STEPS
    lr = [m.trainer.optimizers[0].param_groups[0]["lr"] for m in (whole, resumed)]
    assert lr[0] == lr[1]  # the schedule stepped once per optimizer step, the unfinished one not counted
    # the resumed epoch went on with the batches the uninterrupted fit took there: the same weights at the end
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
