"""``omni_lightning.Trainer``: ``lightning.Trainer`` with :class:`OmniPredictionLoop` installed."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from omni_lightning.runner.loop import OmniPredictionLoop


class Trainer(pl.Trainer):
    """A ``lightning.Trainer`` whose ``predict`` runs :class:`OmniPredictionLoop`.

    ``gpu_memory_utilization``: the fraction of the GPU this process may allocate during predict
    (vLLM's knob; applied with ``torch.cuda.set_per_process_memory_fraction``). None: no cap.
    """

    def __init__(self, *args: Any, gpu_memory_utilization: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.predict_loop = OmniPredictionLoop(
            self, inference_mode=kwargs.get("inference_mode", True), gpu_memory_utilization=gpu_memory_utilization
        )
