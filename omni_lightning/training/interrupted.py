"""``InterruptedFitCheckpoint``: a fit stopped before its end (Ctrl-C, SIGTERM, an error) saves where it was.

Lightning's ``OnExceptionCheckpoint`` does the saving (``trainer.save_checkpoint`` from ``on_exception``);
this callback differs in three ways. Its folder may be left unset: the run's ``ModelCheckpoint`` folder
is used, found when the fit stops (``configs/finetune.yaml`` writes a new ``version_N`` folder per run,
unknown before). It acts in fit only, and not before the first optimizer step (nothing to resume).
And it is not an ``OnExceptionCheckpoint``: Lightning turns a fit given one and no ``ckpt_path`` into
``ckpt_path="last"``, with two warnings on every fresh run; here resuming is explicit (``ckpt_path=`` the
saved file, which the command line prints). A fit that reaches its end removes the file, as Lightning's does.
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

    def path(self, trainer: pl.Trainer) -> Path:
        """Where the file goes for ``trainer``'s fit."""
        folder = self.dirpath
        if folder is None:
            found = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
            folder = found[0] if found else trainer.default_root_dir
        return Path(folder) / f"{self.filename}.ckpt"

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.saved, self.saved_step = None, 0

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.state.fn != "fit" or trainer.global_step == 0:
            return
        path = self.path(trainer)
        trainer.save_checkpoint(path)
        self.saved, self.saved_step = path, trainer.global_step

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # only after a fit that ended normally (Lightning calls no teardown hook after an exception)
        if stage == "fit":
            trainer.strategy.remove_checkpoint(self.path(trainer))
