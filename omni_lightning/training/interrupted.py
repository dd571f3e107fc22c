"""``InterruptedFitCheckpoint``: a fit stopped before its end (Ctrl-C, SIGTERM, an error) saves where it was.

Lightning's ``OnExceptionCheckpoint`` does the saving (``trainer.save_checkpoint`` from ``on_exception``);
this callback differs in three ways. Its folder may be left unset: the run's ``ModelCheckpoint`` folder
is used, found when the fit stops (``configs/finetune.yaml`` writes a new ``version_N`` folder per run,
unknown before). It acts in fit only, and not before the first optimizer step (nothing to resume).
And it is not an ``OnExceptionCheckpoint``: Lightning turns a fit given one and no ``ckpt_path`` into
``ckpt_path="last"``, with two warnings on every fresh run; here resuming is explicit (``ckpt_path=`` the
saved file, which the command line prints). A fit that reaches its end removes the file, as Lightning's does.

A stop inside a training step leaves Lightning's progress counters counting that batch as begun, and its
restart logic (2.6) resets only the current epoch's: the fit resumed from such a file ran every later
step-based check one step early (a validation at step 7 of 8, the last step never checkpointed). The
file saved here holds the loops as they were after the last finished batch (:func:`unfinished_batch_undone`),
so the resumed fit redoes that batch and checks on the steps an uninterrupted fit does; ``CodesDataModule``'s
training loader resumes within its epoch (``StartsAtFirstBatch``), so it also takes the same batches.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint


class InterruptedFitCheckpoint(Callback):
    """Saves ``<dirpath>/<filename>.ckpt`` (a whole checkpoint: weights, optimizers, loops, EMA) when a fit
    stops with an exception; see the module docstring.

    Args:
        dirpath: the folder; None: the first ``ModelCheckpoint``'s, else the trainer's ``default_root_dir``.
        filename: the file's name without ``.ckpt``.

    Example::

        saved = Path("runs/tune/interrupted.ckpt")
        trainer = Trainer(max_steps=1000, callbacks=[InterruptedFitCheckpoint("runs/tune")])
        trainer.fit(module, datamodule=data, ckpt_path=saved if saved.exists() else None)
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str = "interrupted") -> None:
        if not filename:
            raise ValueError("InterruptedFitCheckpoint: filename is empty; give a name such as 'interrupted'")
        self.dirpath, self.filename = dirpath, filename
        self.saved: Path | None = None  # the file this callback wrote at the last stop, if any
        self.saved_step = 0
        self._validated_step: int | None = None  # the optimizer step the fit's last validation followed
        self._saving = False

    def path(self, trainer: pl.Trainer) -> Path:
        """Where the file goes for ``trainer``'s fit."""
        folder = self.dirpath
        if folder is None:
            found = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
            folder = found[0] if found else trainer.default_root_dir
        return Path(folder) / f"{self.filename}.ckpt"

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.saved, self.saved_step, self._validated_step = None, 0, None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._validated_step = trainer.global_step

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.state.fn != "fit" or trainer.global_step == 0:
            return
        path = self.path(trainer)
        self._saving = True
        try:
            trainer.save_checkpoint(path)
        finally:
            self._saving = False
        self.saved, self.saved_step = path, trainer.global_step

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self._saving:
            validated = self._validated_step == trainer.global_step
            unfinished_batch_undone(checkpoint.get("loops", {}).get("fit_loop", {}), validated)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # only after a fit that ended normally (Lightning calls no teardown hook after an exception)
        if stage == "fit":
            trainer.strategy.remove_checkpoint(self.path(trainer))


def unfinished_batch_undone(fit_loop: dict, validated: bool) -> None:
    """``fit_loop``'s saved state (a checkpoint's ``loops.fit_loop``), in place, as it was after the last
    training batch that finished: the training batches' and optimizer steps' counters (total and this
    epoch's) that count a batch begun and not completed count it no more. A state saved between batches,
    or in a validation, is left as it is (Lightning's restart logic handles those).

    ``validated``: a validation followed that last batch. Lightning then takes the state for one saved at
    that validation's end, before it counted the batch for its loggers, and counts it on restart: the
    loggers' count is saved one lower so that they log at an uninterrupted fit's steps."""
    batches = fit_loop.get("epoch_loop.batch_progress", {}).get("total", {})
    if not batches or batches.get("ready", 0) <= batches.get("processed", 0):
        return  # no batch was inside its step
    optimizer = fit_loop.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {})
    progresses = [fit_loop["epoch_loop.batch_progress"], *optimizer.values()]
    for tracker in (p[k] for p in progresses for k in ("total", "current") if k in p):
        for key in ("ready", "started", "processed"):
            if key in tracker:
                tracker[key] = tracker["completed"]
    state = fit_loop.get("epoch_loop.state_dict", {})
    if validated and "_batches_that_stepped" in state:
        state["_batches_that_stepped"] -= 1
