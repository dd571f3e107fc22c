"""A predict progress bar that counts audio seconds, not batches.

Batches are sorted by length (``LengthBucketBatchSampler``), so the last batches take far longer than
the first: a bar over batches shows a wrong ETA. This bar's total is the audio the dataloader will
produce (known before decoding from each request's frame count), its position the audio produced so
far, so its rate is audio seconds per second and its ETA holds on sorted batches; the postfix counts
requests (bad requests count as done; they produce no audio). Dataloaders whose dataset has no
``lengths`` fall back to Lightning's batch count.

:class:`PredictStartLine` prints, before a predict's first batch, one line saying what runs: the model
and its size, the weights, the device and precision (and a GPU left unused), the memory cap and frame
budget, and the job (requests and audio seconds to decode, requests already done if any). The bar is
made at the first batch, so the line comes first in a log file too. ``omni_lightning.Trainer`` installs both.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.callbacks.progress import tqdm_progress
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf

from omni_lightning.callbacks.progress_lines import BarLines, line_every, redraws, train_line
from omni_lightning.runner.cpu_threads import threads_said

# a model past this many parameters on the CPU gets a warning line (qwen3-omni is past it, tiny far below)
LARGE_ON_CPU = 50_000_000


class AudioProgressBar(TQDMProgressBar):
    """TQDM bar over audio seconds (see the module docstring); never waits for the GPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._audio = False  # the current dataloader is counted in audio seconds
        self._done_s, self._total_s = 0.0, 0.0
        self._done_reqs, self._total_reqs = 0, 0

    def init_validation_tqdm(self) -> Tqdm:
        """Lightning's validation bar, on the main bar's line where stdout is not a terminal: a bar on a
        line of its own moves the cursor with ANSI codes, which a log file would keep."""
        if redraws():
            return super().init_validation_tqdm()
        return self._bar(self.validation_description, leave=self.trainer.state.fn == "validate")

    # where stdout is not a terminal, plain lines (progress_lines.py): a fit's own, and the other bars' lines
    def init_train_tqdm(self) -> Tqdm:
        self._train_lines = (-1, time.monotonic())  # (the step of the last line, when training began)
        return super().init_train_tqdm() if redraws() else self._bar(self.train_description, True, False, smoothing=0)

    def init_sanity_tqdm(self) -> Tqdm:
        return super().init_sanity_tqdm() if redraws() else self._bar(self.sanity_check_description, False)

    def init_test_tqdm(self) -> Tqdm:
        return super().init_test_tqdm() if redraws() else self._bar(self.test_description, leave=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        if redraws() or self.is_disabled:
            return
        last, began = getattr(self, "_train_lines", (-1, time.monotonic()))
        step, every = trainer.global_step, line_every(trainer)
        if step // every > max(last, 0) // every or step == trainer.max_steps != last:
            print(train_line(trainer, self.get_metrics(trainer, pl_module), time.monotonic() - began), flush=True)
            last = step
        self._train_lines = (last, began)

    def on_sanity_check_start(self, *_: Any) -> None:
        """No bar yet: it is made at the sanity check's first batch, so a fit without validation data shows
        none (Lightning's stood at "0/?")."""
        self.val_progress_bar = self.train_progress_bar = tqdm_progress.Tqdm(disable=True)

    def on_validation_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx=0) -> None:
        if trainer.sanity_checking and self.val_progress_bar.disable and not self.is_disabled:
            self.val_progress_bar = self.init_sanity_tqdm()
        super().on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)

    def _bar(self, desc: str, leave: bool, lines: bool = True, **kwargs: Any) -> Tqdm:
        """A bar of the class Lightning's own bar uses, looked up at each call as Lightning does (a patched or
        replaced ``tqdm_progress.Tqdm`` is the one made, on a terminal or not); off a terminal it writes into
        ``BarLines`` (``lines``: its state as lines; False: none)."""
        lined = None if redraws() else BarLines(sys.stdout, quiet=not lines)
        bar = tqdm_progress.Tqdm(
            desc=desc,
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=leave,
            dynamic_ncols=True,
            file=lined or sys.stdout,
            bar_format=self.BAR_FORMAT,
            **kwargs,
        )
        if lined is not None:
            lined.bar = bar
        return bar

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Lightning's, less ``v_num`` (the logger's version number, not a measurement)."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Closes the bar after fit's last epoch, so that Lightning's "`Trainer.fit` stopped" line,
        logged before ``on_train_end``, starts a line of its own instead of ending the bar's."""
        super().on_train_epoch_end(trainer, pl_module)
        loop = trainer.fit_loop
        last_step = 0 <= loop.max_steps <= trainer.global_step
        last_epoch = loop.max_epochs is not None and 0 <= loop.max_epochs <= loop.epoch_progress.current.processed
        if (last_step or last_epoch) and self._train_progress_bar is not None:
            self.train_progress_bar.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Closes the open bars, so that what the stop prints next (the command's last line) starts a line."""
        for name in ("_train_progress_bar", "_val_progress_bar", "_test_progress_bar", "_predict_progress_bar"):
            bar = getattr(self, name, None)
            if bar is not None and not bar.disable:
                bar.close()

    def _plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, dataloader_idx: int) -> bool:
        """Total audio seconds and requests of this rank's share of the dataloader, when known."""
        config = getattr(pl_module, "config", None)
        loaders = trainer.predict_dataloaders
        loader = loaders[dataloader_idx] if isinstance(loaders, (list, tuple)) else loaders
        lengths = getattr(getattr(loader, "dataset", None), "lengths", None)
        # the batch sampler's own sampler (this rank's share), never the batch sampler itself: Lightning
        # wraps that in an object whose iterator is shared with the running loader
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        if config is None or lengths is None or sampler is None:
            return False
        indices = list(sampler)
        self._total_s = sum(config.output_length(lengths[i]) for i in indices) / config.sample_rate
        self._total_reqs, self._done_s, self._done_reqs = len(indices), 0.0, 0
        return True

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """No bar yet: it is made at the first batch, with its total, below the start-up line (which
        ``PredictStartLine`` prints after this hook, once the module's engine is built). A failed or
        interrupted predict skipped ``on_predict_end``: its bar is closed and the dataloader tracker reset
        here, so the first batch of this predict makes a new bar."""
        if self._predict_progress_bar is not None:
            self._predict_progress_bar.close()
        self._predict_progress_bar = None
        self.reset_dataloader_idx_tracker()

    def on_predict_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self.has_dataloader_changed(dataloader_idx):
            return
        self._audio = self._plan(trainer, pl_module, dataloader_idx)
        total = round(self._total_s, 1) if self._audio else convert_inf(self.total_predict_batches_current_dataloader)
        unit = "s" if self._audio else "it"
        # Lightning's description, but where one dataloader of audio needs no index
        several = len(trainer.num_predict_batches) > 1 or not self._audio
        desc = f"{self.predict_description} DataLoader {dataloader_idx}" if several else self.predict_description
        bar = self._predict_progress_bar
        if bar is None:  # made without a total, then reset to it, as Lightning's bar does for every dataloader
            bar = self.predict_progress_bar = self._bar(desc, leave=True, unit=unit, smoothing=0)
        bar.unit = unit
        bar.set_description(desc, refresh=False)
        bar.reset(total)

    def on_predict_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx=0):
        if not self._audio:
            super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
            return
        config = pl_module.config
        frames = batch.get("n_frames", []) if isinstance(batch, dict) else []
        self._done_s += sum(config.output_length(n) for n in frames) / config.sample_rate
        self._done_reqs += len(frames) + len(batch.get("errors", {}) if isinstance(batch, dict) else {})
        bar = self._predict_progress_bar
        if bar is not None and not bar.disable:
            bar.n = min(round(self._done_s, 1), bar.total)
            bar.set_postfix({"requests": f"{self._done_reqs}/{self._total_reqs}"}, refresh=False)
            bar.refresh()

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._predict_progress_bar is not None:
            self._predict_progress_bar.close()
        self.reset_dataloader_idx_tracker()


class PredictStartLine(Callback):
    """Prints the line the module docstring describes once per ``predict`` (rank 0), after the model
    is on its device and its decode engine is built, before the first batch; plus one ``warning:``
    line for a large model on the CPU. Prints nothing for a module without a Code2Wav ``config``, and
    nothing where Lightning's own info lines are silenced (its ``rank_zero`` logger's level)."""

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        config = getattr(pl_module, "config", None)
        if not trainer.is_global_zero or config is None or not hasattr(config, "output_length"):
            return
        from tqdm import tqdm  # prints above a progress bar, not through it

        params = sum(p.numel() for p in getattr(pl_module, "model", pl_module).parameters())
        lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # silenced with Lightning's lines
        for line in start_lines(trainer, pl_module, config, params):
            if lightning_log.isEnabledFor(logging.WARNING if line.startswith("warning:") else logging.INFO):
                tqdm.write(line)


def start_lines(trainer: pl.Trainer, pl_module: Any, config: Any, params: int) -> list[str]:
    """The start-up line, and a warning line for a large model on the CPU."""
    device = trainer.strategy.root_device
    what = what_runs(pl_module, config, params, getattr(trainer, "ckpt_path", None), device, trainer.precision)
    cap = getattr(trainer.predict_loop, "gpu_memory_utilization", None)
    if cap is None:
        memory = "no memory cap"
    elif device.type == "cuda":
        memory = f"memory cap {cap:.0%} of the GPU"
    else:  # torch caps the memory of a CUDA device only
        memory = f"no memory cap (gpu_memory_utilization {cap:g} applies on a GPU)"
    engine = getattr(pl_module, "engine", None)
    frames = getattr(engine, "frames_per_forward", None) or getattr(pl_module, "frames_per_forward", None)
    budget = f"{frames} frames per forward" if frames else "frames per forward from the memory budget"
    requests, audio_s = _job(trainer, config)
    plan = getattr(getattr(trainer, "datamodule", None), "predict_plan", None)
    done = f", {plan.skipped} already done" if getattr(plan, "skipped", 0) else ""
    ranks = f" over {trainer.world_size} processes" if trainer.world_size > 1 else ""
    job = f"{requests} request{'s' * (requests != 1)} to decode ({audio_s:.1f} s of audio){ranks}{done}"
    lines = [f"predict: {what}; {memory}, {budget}; {job}"]
    if device.type == "cpu" and params > LARGE_ON_CPU:
        size = f"{params / 1e6:.0f} M parameters"
        lines.append(
            f"warning: the {config.name} model ({size}) on the CPU is slow: the bar's time left, measured from the "
            "first batches, says how slow; a GPU (--trainer.accelerator gpu) is faster, --model.config tiny a quick try"
        )
    return lines


def what_runs(pl_module: Any, config: Any, params: int, ckpt_path: str | None, device: Any, precision: str) -> str:
    """A start-up line's first part (predict's, serve's): the model, its size, the weights, the device and
    precision (and a GPU left unused)."""
    checkpoint = getattr(pl_module, "hparams", {}).get("checkpoint")
    model = f"checkpoint {checkpoint}" if checkpoint else f"{config.name} preset"
    # the module's own account (its constructor's, a fit's or a load's) unless the trainer loaded a checkpoint
    origin = getattr(pl_module, "weights_origin", None)
    origin = origin or (f"weights from {checkpoint}" if checkpoint else "its weights")
    weights = f"weights from {ckpt_path}" if ckpt_path else origin
    where = f"{device.type} {precision}" + (" (a GPU is available, unused)" if _gpu_unused(device) else "")
    where += f", {threads_said()}" if device.type == "cpu" else ""
    return f"{model}, {params / 1e6:.1f} M parameters, {weights}; {where}"


def _job(trainer: pl.Trainer, config: Any) -> tuple[int, float]:
    """Requests and audio seconds in the predict dataloaders' datasets (every rank's, not only this one's)."""
    loaders = trainer.predict_dataloaders
    requests, samples = 0, 0
    for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        dataset = getattr(loader, "dataset", None)
        lengths = getattr(dataset, "lengths", None)
        if dataset is None or lengths is None:
            continue
        requests += len(dataset)
        samples += sum(config.output_length(n) for n in lengths if n)
    return requests, samples / config.sample_rate


def _gpu_unused(device: Any) -> bool:
    """Whether this process runs on the CPU while a GPU (CUDA or MPS) is available to it."""
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    return device.type == "cpu" and (CUDAAccelerator.is_available() or MPSAccelerator.is_available())
