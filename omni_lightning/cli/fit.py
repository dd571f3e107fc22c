"""What ``lightning_cli`` does around a fit beyond LightningCLI: callbacks a flag turned off dropped from the
config, a fit that saves where it was when it is stopped (and the line saying how to resume), a
``--ckpt_path last`` that would find nothing refused, and what the monitored metric did (the last line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from omni_lightning.errors import UsageError
from omni_lightning.training.interrupted import InterruptedFitCheckpoint


def save_on_stop(trainer: Any) -> None:
    """A fit that checkpoints also saves when it is stopped: an :class:`InterruptedFitCheckpoint` (in the
    ModelCheckpoint's folder) unless the trainer has one."""
    saves = trainer.checkpoint_callback is not None
    if saves and not any(isinstance(cb, InterruptedFitCheckpoint) for cb in trainer.callbacks):
        trainer.callbacks.append(InterruptedFitCheckpoint())


def stopped_fit_note(trainer: Any) -> str:
    """What the command's last line adds for a stopped fit: where it saved and how to resume ("" with no
    :class:`InterruptedFitCheckpoint`)."""
    saver = next((cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, InterruptedFitCheckpoint)), None)
    if saver is None:
        return ""
    if saver.saved is None:
        return " before the first step: nothing to save"
    saved = saver.saved
    return f" at step {saver.saved_step}: saved {saved}; the same command with --ckpt_path {saved} resumes it"


def check_resume_last(trainer: Any) -> None:
    """``--ckpt_path last`` resumes from a ModelCheckpoint's ``last.ckpt``. Lightning only looks in a
    ``dirpath`` given to the callback: with the folder the logger makes per run (``configs/finetune.yaml``:
    a new ``version_N`` each time) it finds none, warns, and trains from scratch. That is refused here
    (UsageError), listing the ``last.ckpt`` files there are to resume from."""
    if not trainer.checkpoint_callbacks:
        return
    root = Path(trainer.default_root_dir)
    folder = root / "checkpoints"  # where a ModelCheckpoint without dirpath will write (as Lightning works it out)
    if trainer.loggers:
        logger = trainer.loggers[0]
        root = Path(logger.save_dir or root)
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        folder = root / str(logger.name) / version / "checkpoints"
    if trainer.loggers and trainer.loggers[0].version is None:
        return  # a logger that names its folder once it runs (W&B): nothing to mirror; Lightning decides
    folders = [Path(cb.dirpath) if cb.dirpath else folder for cb in trainer.checkpoint_callbacks]
    if any(f.is_dir() and any(f.glob("last*.ckpt")) for f in folders):  # last.ckpt, last-v1.ckpt, ...
        return
    found = sorted(root.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)[-3:] if root.is_dir() else []
    hint = f" ({', '.join(str(p) for p in reversed(found))}, newest first)" if found else ""
    raise UsageError(
        f"--ckpt_path last finds no last checkpoint in {folders[0]}: this run checkpoints into a "
        f"new folder; give the checkpoint to resume from by its path{hint}"
    )


def drop_callbacks_turned_off(trainer: Any) -> None:
    """A flag that turns a feature off wins over the config's callbacks for it, which Lightning would
    refuse beside the flag: ``--trainer.enable_progress_bar false`` drops a progress bar
    (``configs/predict.yaml`` lists ``AudioProgressBar``), ``--trainer.logger false`` a
    ``LearningRateMonitor`` (``configs/finetune.yaml`` lists one; with no logger it has nowhere to log)."""
    if trainer is None or not trainer.get("callbacks"):
        return
    import importlib

    from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar

    flags = ((ProgressBar, "enable_progress_bar"), (LearningRateMonitor, "logger"))
    off = tuple(cls for cls, flag in flags if trainer.get(flag) is False)
    if not off:
        return

    def turned_off(callback: Any) -> bool:
        path = callback.get("class_path") if hasattr(callback, "get") else None
        if not isinstance(path, str) or "." not in path:
            return isinstance(callback, off)
        module, name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name, None)
        return isinstance(cls, type) and issubclass(cls, off)

    callbacks = trainer.callbacks
    one = not isinstance(callbacks, (list, tuple))  # a single callback given as one mapping, not a list
    kept = [c for c in ([callbacks] if one else callbacks) if not turned_off(c)]
    trainer.callbacks = (kept[0] if kept else None) if one else kept


class MonitoredMetric(Callback):
    """The monitored metric (the ``ModelCheckpoint``'s, else ``val/mel_distance``) after each validation of
    a fit, with its step, for the command's last line: a short fit shows whether it learned."""

    def __init__(self, name: str) -> None:
        self.name, self.values = name, []

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        value = trainer.callback_metrics.get(self.name)
        if not trainer.sanity_checking and value is not None:
            self.values.append((trainer.global_step, float(value)))


def watch_fit(trainer: Any) -> None:
    """Before a fit: saves on a stop (:func:`save_on_stop`) and records the monitored metric
    (:class:`MonitoredMetric`, unless the trainer has one) for :func:`fit_moved`."""
    save_on_stop(trainer)
    if not any(isinstance(cb, MonitoredMetric) for cb in trainer.callbacks):
        monitor = getattr(trainer.checkpoint_callback, "monitor", None)
        trainer.callbacks.append(MonitoredMetric(monitor or "val/mel_distance"))


def fit_moved(trainer: Any) -> list[str]:
    """What the fit's last line says the monitored metric did, its first and last validations' values:
    ``["val/mel_distance 0.61 (step 20) -> 0.45 (step 40)"]``; [] with no validation."""
    watcher = next((cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, MonitoredMetric)), None)
    if watcher is None or not watcher.values:
        return []
    (first_step, first), (last_step, last) = watcher.values[0], watcher.values[-1]
    if len(watcher.values) == 1:
        return [f"{watcher.name} {first:.4g} (step {first_step}, one validation)"]
    return [f"{watcher.name} {first:.4g} (step {first_step}) -> {last:.4g} (step {last_step})"]
