"""What fit, validate and test run the generator with: :class:`TrainingKernels`, a collaborator of the module.

The module chooses both in its ``setup`` through its override hooks (``configure_training_kernels``,
``configure_training_graph``) and hands them here; :meth:`TrainingKernels.generate` runs the model
with them. Predict does not read them: the decode engine chooses its own (``Kernels.for_inference``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omni_lightning.kernels import Kernels
from omni_lightning.training.step_graph import TrainingGraph, training_graphs_allowed


class TrainingKernels:
    """The kernels (``kernels``; the torch reference until set) and fit's CUDA graph of the generator
    (``graph``; None: eager). Holds no weights and no trainer."""

    def __init__(self) -> None:
        self.kernels = Kernels()
        self.graph: TrainingGraph | None = None

    def generate(self, model: nn.Module, codes: torch.Tensor) -> torch.Tensor:
        """``model``'s waveform for a training or evaluation batch: through ``graph`` where it has one
        for this batch (it steps aside without grad), else eagerly with ``kernels``."""
        if self.graph is not None:
            return self.graph(model, codes, self.kernels)
        return model(codes, kernels=self.kernels)


def default_training_graph(trainer: Any, automatic_optimization: bool) -> TrainingGraph | None:
    """A :class:`TrainingGraph` where :func:`training_graphs_allowed` says so for ``trainer``, else None
    (also for no trainer: ``setup`` called by hand)."""
    if trainer is None:
        return None
    accumulate = trainer.accumulate_grad_batches if automatic_optimization else 1
    allowed = training_graphs_allowed(
        trainer.strategy.root_device, trainer.precision_plugin, trainer.world_size, accumulate
    )
    return TrainingGraph() if allowed else None
