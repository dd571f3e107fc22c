"""``omni_lightning.Trainer``: ``lightning.Trainer`` with :class:`OmniPredictionLoop` installed."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from omni_lightning.runner.loop import OmniPredictionLoop


class Trainer(pl.Trainer):
    """A ``lightning.Trainer`` whose ``predict`` runs :class:`OmniPredictionLoop`.

    Every argument of ``lightning.Trainer`` means what it means there (``inference_mode`` included);
    a ``predict_step`` that does not return ``MultimodalOutputs`` runs exactly as on a stock trainer.

    ``gpu_memory_utilization``: the fraction of the GPU this process may allocate during predict
    (vLLM's knob; applied with ``torch.cuda.set_per_process_memory_fraction`` when predict starts, the
    process's earlier share put back when it ends). None: no cap.
    ``async_d2h``: add an ``AsyncD2HCallback`` unless one is given (it only acts on CUDA); without it
    every step blocks on its device-to-host copy (docs/performance.md).
    """

    def __init__(
        self, *args: Any, gpu_memory_utilization: float | None = None, async_d2h: bool = True, **kwargs: Any
    ) -> None:
        if async_d2h:
            from omni_lightning.callbacks.async_d2h import AsyncD2HCallback

            callbacks = kwargs.get("callbacks") or []
            callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
            if not any(isinstance(cb, AsyncD2HCallback) for cb in callbacks):
                callbacks.append(AsyncD2HCallback())
            kwargs["callbacks"] = callbacks
        super().__init__(*args, **kwargs)
        # the loop takes the trainer's inference_mode from the stock loop it replaces
        self.predict_loop = OmniPredictionLoop(self, gpu_memory_utilization=gpu_memory_utilization)
