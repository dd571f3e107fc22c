"""The decode engine's life across ``predict`` calls, as a LightningModule mixin (``EngineOnPredict``).

The engine (``engine/engine.py``) is built at the first predict on a device and kept while it serves
the model where it is: its weights are refreshed, so its CUDA graphs survive from one predict to the
next. Under a ``gpu_memory_utilization`` cap it is released at the end of each predict, because the
next one moves the weights in again and the engine's copy, graphs and state must not hold the budget
meanwhile. Not done: releasing it between predicts with no cap (a process that predicts once and
goes on with other GPU work calls ``module.engine.close()``, or sets ``module.engine = None``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from omni_lightning.engine import DecodeEngine
from omni_lightning.kernels import Kernels


class EngineOnPredict:
    """LightningModule mixin: ``decode_engine()`` and the predict hooks that build, report and release
    it. The module declares ``engine``, ``engine_stats``, ``model``, ``frames_per_forward``, ``fast_path``
    and the ``graph_frames`` hyperparameter in its ``__init__``."""

    engine: DecodeEngine | None
    engine_stats: dict[str, float]
    model: Any
    frames_per_forward: int | None
    fast_path: bool

    def decode_engine(self) -> DecodeEngine:
        """The engine predict runs on: kept while it serves the model where it is (weights refreshed,
        so graphs survive across predict calls), else built for the model's device and dtype."""
        if self.engine is None or self.engine.model is not self.model or not self.engine.refresh():
            if self.engine is not None:
                self.engine.close()
            loop = self._trainer.predict_loop if self._trainer is not None else None
            self.engine = DecodeEngine(
                self.model, frames_per_forward=self.frames_per_forward, cuda_graphs=self.fast_path,
                graph_frames=self.hparams.graph_frames,
                gpu_memory_utilization=getattr(loop, "gpu_memory_utilization", None),
                kernels=None if self.fast_path else Kernels(inplace=True),
            )  # fmt: skip
        return self.engine

    def on_predict_start(self) -> None:
        self.decode_engine()

    def on_predict_end(self) -> None:
        if self.engine is not None:
            self.engine_stats = self.engine.stats()
        if self.engine is not None and self.engine.device.type == "cuda":
            pl.utilities.rank_zero_info(self.engine.report())
            if getattr(self._trainer.predict_loop, "gpu_memory_utilization", None) is not None:
                # a capped process: the next predict moves the weights here again, and the engine's
                # copy, graphs and state must not hold the budget meanwhile
                self.engine.close()
                self.engine = None
                torch.cuda.empty_cache()
