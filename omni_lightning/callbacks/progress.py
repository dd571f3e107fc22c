"""A progress bar that shows audio seconds per second during predict."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar


class AudioProgressBar(TQDMProgressBar):
    """TQDM bar with ``audio_s/s``; counted from the batch's frame counts, so it never waits for the GPU."""

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_predict_epoch_start(trainer, pl_module)
        self._audio_s, self._t0 = 0.0, time.perf_counter()

    def on_predict_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx=0):
        super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        config = getattr(pl_module, "config", None)
        if config is not None and isinstance(batch, dict) and "n_frames" in batch:
            self._audio_s += sum(config.output_length(n) for n in batch["n_frames"]) / config.sample_rate
            rate = self._audio_s / max(time.perf_counter() - self._t0, 1e-9)
            if self.predict_progress_bar is not None:
                self.predict_progress_bar.set_postfix({"audio_s": f"{self._audio_s:.1f}", "audio_s/s": f"{rate:.1f}"})
