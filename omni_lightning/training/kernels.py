"""Which kernels fine-tuning and evaluation run the model with: chosen once per run, where it runs.

:class:`TrainingKernels` is a LightningModule mixin: in ``setup`` (fit, validate, test and predict
alike; the trainer's device is known there) it sets ``training_kernels`` from
:meth:`~TrainingKernels.configure_training_kernels`, by default ``Kernels.for_training``: on CUDA the
Triton SnakeBeta with its Triton backward (``kernels/snake_beta.py``), elsewhere the torch reference.
The module passes ``training_kernels`` to its model in the training, validation and test steps.
With ``fast_training = False`` it is the torch reference everywhere (one switch, no global state).
Predict does not read it: the decode engine chooses its own (``Kernels.for_inference``).

In ``setup`` of fit it also sets ``training_graph`` from :meth:`~TrainingKernels.configure_training_graph`:
by default a :class:`~omni_lightning.training.graphs.TrainingGraph` where
:func:`~omni_lightning.training.graphs.training_graphs_allowed` says so (CUDA, a plain precision, one
process, no accumulation), else None; ``fast_training = False`` turns it off too. The module runs its
model through :meth:`~TrainingKernels.generate` in the training, validation and test steps.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_lightning.kernels import Kernels
from omni_lightning.training.graphs import TrainingGraph, training_graphs_allowed


class TrainingKernels:
    """LightningModule mixin (before ``LightningModule`` in the bases): ``training_kernels``, set in
    ``setup``, and ``training_graph``. The module declares ``fast_training``, ``training_kernels`` and
    ``training_graph`` in its ``__init__``."""

    fast_training: bool
    training_kernels: Kernels
    training_graph: TrainingGraph | None

    def setup(self, stage: str) -> None:
        super().setup(stage)
        trainer = self._trainer  # None when a user calls setup by hand: the weights' device then
        device = trainer.strategy.root_device if trainer is not None else next(self.parameters()).device
        self.training_kernels = self.configure_training_kernels(device) if self.fast_training else Kernels()
        if stage == "fit":  # a new graph each fit: one fit's shapes, weights and trainable set
            self.training_graph = self.configure_training_graph(trainer) if self.fast_training else None

    def teardown(self, stage: str) -> None:
        """The end of fit frees its graph: its pool holds a step's activations, which predict (under a
        memory cap, say) must not pay for."""
        if stage == "fit":
            self.training_graph = None
        super().teardown(stage)

    def generate(self, codes: torch.Tensor) -> torch.Tensor:
        """The model's waveform for a training or evaluation batch: ``training_kernels``, and the
        captured graph where ``training_graph`` has one for this batch (it steps aside without grad)."""
        if self.training_graph is not None:
            return self.training_graph(self.model, codes, self.training_kernels)
        return self.model(codes, kernels=self.training_kernels)

    def configure_training_graph(self, trainer: Any) -> TrainingGraph | None:
        """How fit replays the generator's forward and backward (default: a :class:`TrainingGraph`
        where :func:`training_graphs_allowed`, else None: eager), called in ``setup`` of each fit;
        not called with ``fast_training = False``. ``trainer`` is None when ``setup`` is called by hand."""
        if trainer is None:
            return None
        accumulate = trainer.accumulate_grad_batches if self.automatic_optimization else 1
        allowed = training_graphs_allowed(trainer.strategy.root_device, trainer.precision_plugin,
                                          trainer.world_size, accumulate)  # fmt: skip
        return TrainingGraph() if allowed else None

    def configure_training_kernels(self, device: torch.device) -> Kernels:
        """The kernels fit, validate and test run the model with (default ``Kernels.for_training``),
        called once per run in ``setup``; not called with ``fast_training = False``.

        Args:
            device: where the trainer runs the module.

        Example::

            class Interpreted(Code2WavModule):  # Triton's kernels on the CPU, in its interpreter
                def configure_training_kernels(self, device):  # (TRITON_INTERPRET=1 before the import)
                    return Kernels(partial(snake_beta_triton_autograd, precise=True), name="interpreted")
        """
        return Kernels.for_training(device)
