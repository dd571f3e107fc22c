"""With the GAN on, one training batch is one ``trainer.global_step``, as with it off: ``max_steps``,
step-based validation and checkpoints, the schedules and EMA count batches, in every precision, and a
resumed fit goes on from the saved step with both optimizers' state."""

import lightning.pytorch as pl
import pytest
import torch
from conftest import random_model
from helpers import cli, precision_kwargs, trainer_kwargs
from lightning.pytorch.callbacks import ModelCheckpoint

from omni_lightning import Code2WavModule, CodesDataModule, Trainer
from omni_lightning.data.synthetic import make_demo_data, make_teacher


@pytest.fixture(scope="module")
def gan_pairs(tmp_path_factory):
    """Three short pairs (2-4 frames, each long enough for the discriminators): three batches of one an epoch."""
    folder = tmp_path_factory.mktemp("gan_pairs")
    return make_demo_data(folder, 3, 0.16, 0.32, teacher=make_teacher("tiny"), seed=3, name="train.jsonl")


def gan_module(**kw):
    return Code2WavModule(model=random_model("tiny", seed=7), adversarial=True, learning_rate=1e-3, **kw)


def data(manifest):
    return CodesDataModule(train=str(manifest), batch_size=1)


class Counted(pl.Callback):
    """What a user sees per batch: the global step after it, and each optimizer step's optimizer."""

    def __init__(self):
        self.steps_after_batches, self.stepped, self.ema_updates = [], [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps_after_batches.append(trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.stepped.append(optimizer)

    def on_train_end(self, trainer, pl_module):
        if pl_module.ema is not None:  # before on_fit_end swaps the average in
            self.ema_updates = int(pl_module.ema._average_model.n_averaged)


def adam_steps(optimizer):
    """AdamW's step count for each parameter it holds state for (MasterWeightAdamW: its inner fp32 AdamW's)."""
    inner = getattr(optimizer, "fp32", None) or optimizer
    return {int(s["step"]) for s in inner.state.values()}


def saved_adam_steps(state):
    state = state.get("fp32", state)
    return {int(s["step"]) for s in state["state"].values()}


@pytest.mark.parametrize("max_steps", [1, 4])
def test_max_steps_trains_that_many_batches_and_each_steps_both_optimizers_once(gan_pairs, max_steps):
    module, counted = gan_module(ema_decay=0.9, min_lr_ratio=0.1), Counted()
    trainer = Trainer(**trainer_kwargs(max_steps=max_steps, callbacks=[counted]))
    trainer.fit(module, datamodule=data(gan_pairs))  # 4 steps cross an epoch's end (3 batches)

    assert counted.steps_after_batches == list(range(1, max_steps + 1))
    assert trainer.global_step == max_steps
    opt_g, opt_d = trainer.optimizers
    assert adam_steps(opt_g) == {max_steps} and adam_steps(opt_d) == {max_steps}
    # Lightning's hooks (the module's clipping among them) ran for both optimizers, discriminators first
    assert counted.stepped == [opt_d, opt_g] * max_steps
    assert counted.ema_updates == max_steps  # EMA updates once a batch
    # both schedules went once a batch, over a run as long as max_steps: the cosine ends at its floor
    assert [s.last_epoch for s in module.lr_schedulers()] == [max_steps, max_steps]
    assert opt_g.param_groups[0]["lr"] == pytest.approx(0.1 * 1e-3)
    assert opt_d.param_groups[0]["lr"] == pytest.approx(0.1 * module.hparams.discriminator_lr)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed", "16-mixed"])
def test_one_batch_is_one_step_in_every_precision(gan_pairs, precision):
    """16-mixed: a CPU GradScaler; the discriminators' step goes through it too (unscaled before the
    clipping and the logged norm, stepped by the scaler)."""
    module, counted = gan_module(), Counted()
    trainer = Trainer(**trainer_kwargs(max_steps=2, callbacks=[counted], **precision_kwargs(precision)))
    trainer.fit(module, datamodule=data(gan_pairs))
    assert counted.steps_after_batches == [1, 2] and trainer.global_step == 2
    opt_g, opt_d = trainer.optimizers
    assert adam_steps(opt_g) == {2} and adam_steps(opt_d) == {2}  # a scaler's skipped step would not count
    assert counted.stepped == [opt_d, opt_g] * 2
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    # unscaled: a discriminator norm still multiplied by the loss scale (4,096) would be far above 200
    assert 0 < metrics["train/disc_grad_norm"] < 200 and 0 < metrics["train/grad_norm"] < 200
    if precision == "16-mixed":
        assert trainer.precision_plugin.scaler is not None and trainer.precision_plugin.scaler.get_scale() > 0


def test_checkpoints_every_n_steps_and_resume_reach_the_uninterrupted_run(gan_pairs, tmp_path):
    """Saved every 3 steps (an epoch's end), resumed from step 3 to 6: the same step, optimizer states,
    schedules, EMA and weights as the run that went straight to 6."""
    torch.manual_seed(0)
    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    straight = gan_module(ema_decay=0.9)
    trainer = Trainer(**trainer_kwargs(max_steps=6, callbacks=[every], enable_checkpointing=True))
    trainer.fit(straight, datamodule=data(gan_pairs))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=3.ckpt", "step=6.ckpt"]
    saved = torch.load(tmp_path / "ckpt" / "step=3.ckpt", weights_only=False)
    assert saved["global_step"] == 3
    assert [saved_adam_steps(s) for s in saved["optimizer_states"]] == [{3}, {3}]

    torch.manual_seed(0)
    resumed, counted = gan_module(ema_decay=0.9), Counted()
    again = Trainer(**trainer_kwargs(max_steps=6, callbacks=[counted]))
    again.fit(resumed, datamodule=data(gan_pairs), ckpt_path=tmp_path / "ckpt" / "step=3.ckpt")
    assert counted.steps_after_batches == [4, 5, 6] and again.global_step == 6
    assert counted.ema_updates == 6
    for a, b in zip(trainer.optimizers, again.optimizers):
        assert adam_steps(a) == adam_steps(b) == {6}
    assert [s.last_epoch for s in resumed.lr_schedulers()] == [6, 6]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6), name  # the EMA weights and the discriminators


@pytest.mark.slow  # two CLI fits in subprocesses (~20 s); the Trainer tests above hold the same in the default run
def test_cli_fit_with_the_gan_counts_batches_then_resumes(gan_pairs, tmp_path):
    runs = tmp_path / "runs"
    common = ("--config", "configs/finetune.yaml", "--data.train", str(gan_pairs), "--data.val", str(gan_pairs),
              "--model.adversarial", "true", "--trainer.precision", "32-true", "--trainer.accelerator", "cpu",
              "--trainer.val_check_interval", "3", "--trainer.logger.init_args.save_dir", str(runs),
              "--data.num_workers", "0", "--data.batch_size", "1")  # fmt: skip
    proc = cli("fit", *common, "--trainer.max_steps", "3")
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log
    assert "step 3/3" in log, log  # the progress lines count batches against max_steps
    (said,) = [line for line in log.splitlines() if line.startswith("fit: val/mel_distance ")]
    assert "(step 3, one validation)" in said and "epoch=0-step=3.ckpt" in said, said  # named by batches
    last = next(runs.rglob("last.ckpt"))
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 3
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 3
    assert [saved_adam_steps(s) for s in saved["optimizer_states"]] == [{3}, {3}]

    proc = cli("fit", *common, "--trainer.max_steps", "5", "--ckpt_path", str(last))
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log
    resumed = max(runs.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)
    saved = torch.load(resumed, weights_only=False)
    assert resumed != last and saved["global_step"] == 5
    assert [saved_adam_steps(s) for s in saved["optimizer_states"]] == [{5}, {5}]
