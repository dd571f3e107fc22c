"""A predict progress bar that counts audio seconds, not batches.

Batches are sorted by length (``LengthBucketBatchSampler``), so the last batches take far longer than
the first: a bar over batches shows a wrong ETA. This bar's total is the audio the dataloader will
produce (known before decoding from each request's frame count), its position the audio produced so
far, so its rate is audio seconds per second and its ETA holds on sorted batches; the postfix counts
requests (bad requests count as done; they produce no audio). Dataloaders whose dataset has no
``lengths`` fall back to Lightning's batch count.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar


class AudioProgressBar(TQDMProgressBar):
    """TQDM bar over audio seconds (see the module docstring); never waits for the GPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._audio = False  # the current dataloader is counted in audio seconds
        self._done_s, self._total_s = 0.0, 0.0
        self._done_reqs, self._total_reqs = 0, 0

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

    def on_predict_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        changed = self._current_eval_dataloader_idx != dataloader_idx  # what Lightning's reset asks, unrecorded
        super().on_predict_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
        if not changed:
            return
        self._audio = self._plan(trainer, pl_module, dataloader_idx)
        if self._audio and self._predict_progress_bar is not None:
            bar = self.predict_progress_bar
            bar.unit, bar.unit_scale = "s", False
            bar.total = round(self._total_s, 1)

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
