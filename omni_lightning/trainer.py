"""``omni_lightning.Trainer``: ``lightning.Trainer`` with :class:`OmniPredictionLoop` installed."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, ProgressBar

from omni_lightning.callbacks.model_summary import ParameterSummary
from omni_lightning.callbacks.progress import AudioProgressBar, PredictStartLine
from omni_lightning.runner.loop import OmniPredictionLoop


class Trainer(pl.Trainer):
    """A Lightning Trainer whose predict runs the omni_lightning decode loop.

    Every argument of ``lightning.Trainer`` means what it means there (``inference_mode`` included);
    a ``predict_step`` that does not return ``MultimodalOutputs`` runs exactly as on a stock trainer.
    Besides the loop it installs, unless given, an ``AudioProgressBar`` (predict counts audio seconds;
    none with ``enable_progress_bar=False``), a ``PredictStartLine`` (one line before predict's first
    batch saying what runs) and a ``ParameterSummary`` (Lightning's model summary less its FLOPs column
    of zeros; none with ``enable_model_summary=False``). It does not change Lightning's logger or
    checkpointing defaults. It silences, each by its one message, what a user cannot act on
    (:func:`quiet_known_noise`), and Lightning's "GPU available: ..." / "TPU available: ..." lines (the
    start-up line says the device; Lightning's warning of a GPU left unused stays).

    Args:
        gpu_memory_utilization: Fraction of the GPU this process may allocate during predict, in (0, 1]
            (vLLM's knob; set with torch.cuda.set_per_process_memory_fraction when predict starts, the
            earlier share put back when it ends); None: no cap.
        async_d2h: Overlap each predict step's device-to-host copy with the next step (an
            AsyncD2HCallback, added unless given; it acts on CUDA only).
    """

    def __init__(
        self, *args: Any, gpu_memory_utilization: float | None = None, async_d2h: bool = True, **kwargs: Any
    ) -> None:
        kwargs["callbacks"] = _with_defaults(kwargs, async_d2h)
        quiet_known_noise()
        rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        rank_zero.addFilter(_drop_device_lines)  # this trainer's only: a stock Trainer still prints them
        try:
            super().__init__(*args, **kwargs)
        finally:
            rank_zero.removeFilter(_drop_device_lines)
        for logger in self.loggers:
            _quiet_wandb_init(logger)
        # the loop takes the trainer's inference_mode from the stock loop it replaces
        self.predict_loop = OmniPredictionLoop(self, gpu_memory_utilization=gpu_memory_utilization)


def _with_defaults(kwargs: dict[str, Any], async_d2h: bool) -> list[Any]:
    """The trainer's callbacks plus the default ones the class docstring lists (a function of its own:
    jsonargparse reads ``__init__``'s body, and would list the keys read here as more options)."""
    given = kwargs.get("callbacks") or []
    callbacks = list(given) if isinstance(given, (list, tuple)) else [given]
    if async_d2h:
        from omni_lightning.callbacks.async_d2h import AsyncD2HCallback

        if not any(isinstance(cb, AsyncD2HCallback) for cb in callbacks):
            callbacks.append(AsyncD2HCallback())
    # Lightning's default (a rich bar) counts batches, and shows "Epoch 4/-2" for a fit bounded by steps
    wants_bar = kwargs.get("enable_progress_bar", not kwargs.get("barebones")) is not False
    if wants_bar and not any(isinstance(cb, ProgressBar) for cb in callbacks):
        callbacks.append(AudioProgressBar())
    if not any(isinstance(cb, PredictStartLine) for cb in callbacks):
        callbacks.append(PredictStartLine())
    wants_summary = kwargs.get("enable_model_summary", not kwargs.get("barebones")) is not False
    if wants_summary and not any(isinstance(cb, ModelSummary) for cb in callbacks):
        callbacks.append(ParameterSummary())  # Lightning's table less its FLOPs column of zeros
    return callbacks


def quiet_known_noise() -> None:
    """Silences, each by its one message, what a user can do nothing about: torch's deprecation of
    ``isinstance(x, LeafSpec)``, which Lightning's own ``_pytree`` still calls; Lightning's
    advertisements for the litlogger and litmodels packages, printed by every trainer (and two notes
    :func:`_drop_lightning_tips` names); its warning
    that a ``*_dataloader`` returned an empty list (``CodesDataModule``'s fit without ``val``: no
    validation); its warning that an epoch has fewer batches than ``log_every_n_steps`` (it counts the
    interval over the whole fit, so such a fit logs all the same); its warning that the model summary
    sizes a mixed precision's weights at 32 bits (which they are); its note that ``save_checkpoint``
    was not told ``weights_only`` (it writes the whole checkpoint, as a resumed fit needs); and its
    "Detected KeyboardInterrupt, attempting graceful shutdown" (the user pressed Ctrl-C; the shutdown
    still runs, callbacks' ``on_exception`` included, and ends in ``SystemExit(1)`` as Lightning's does)."""
    leafspec = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
    warnings.filterwarnings("ignore", message=leafspec, category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero\.")
    warnings.filterwarnings("ignore", message=r"The number of training batches \(\d+\) is smaller than the logging")
    warnings.filterwarnings("ignore", message=r"Precision (bf)?16-mixed is not supported by the model summary")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _drop_lightning_tips not in logger.filters:
            logger.addFilter(_drop_lightning_tips)
    checkpoints = logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector")
    if _drop_weights_only_note not in checkpoints.filters:
        checkpoints.addFilter(_drop_weights_only_note)


def quiet_checkpoint_callbacks_warning() -> None:
    """For validate, test and predict only: a ``ckpt_path`` checkpoint's callback states (ModelCheckpoint's,
    EMA's) restore nothing that matters there, yet Lightning warns that those callbacks should be given,
    and that a ModelCheckpoint writing to another folder than the fit's does not take its best scores."""
    warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used to create")
    warnings.filterwarnings("ignore", message="The dirpath has changed from .* won't be reloaded")


@contextmanager
def quiet_cli_trainer(subcommand: str) -> Iterator[None]:
    """While the command line builds its trainer: Lightning's advice to install tensorboard (its default
    logger is then a CSV one, whose folder the command's last line names) is dropped; for predict and serve,
    whose start-up line says the device, the precision and a GPU left unused, so is Lightning's "GPU
    available but not used" warning. Put back after."""
    messages = ["Starting from v1.9.0, `tensorboardX`"]
    if subcommand in ("predict", "serve"):
        messages.append("GPU available but not used")
    added = []
    for message in messages:
        warnings.filterwarnings("ignore", message=re.escape(message))
        added.append(warnings.filters[0])
    try:
        yield
    finally:
        for entry in added:
            if entry in warnings.filters:
                warnings.filters.remove(entry)


def _drop_device_lines(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(("GPU available: ", "TPU available: "))


def _drop_weights_only_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("`weights_only` was not set")


def _drop_lightning_tips(record: logging.LogRecord) -> bool:
    """Lightning's package advertisements; its note that it adds no summary beside this trainer's own;
    WeightAveraging's note, on every resume, that the checkpoint's raw weights initialize the model; and
    the line it says on Ctrl-C."""
    message = str(record.msg)
    if message.startswith("\nDetected KeyboardInterrupt, attempting graceful shutdown"):
        return False
    if message.startswith("Trainer already configured with model summary callbacks"):
        return "ParameterSummary" not in message
    if message.startswith("Found current_model_state in the checkpoint"):
        return False
    return not message.startswith("💡 Tip") or ("litlogger" not in message and "litmodels" not in message)


def _quiet_wandb_init(logger: Any) -> None:
    """Lightning's ``WandbLogger`` passes ``anonymous=None`` to ``wandb.init``, which wandb warns has no
    effect, and a ``save_dir`` that does not exist yet, which wandb warns is no git root: the unset
    option is dropped and the folder made (the run writes there anyway). Nothing else changes."""
    init = getattr(logger, "_wandb_init", None)
    if type(logger).__name__ != "WandbLogger" or not isinstance(init, dict):
        return
    if "anonymous" in init and init["anonymous"] is None:
        del init["anonymous"]
    if isinstance(init.get("dir"), (str, Path)) and getattr(logger, "_experiment", None) is None:
        Path(init["dir"]).mkdir(parents=True, exist_ok=True)
