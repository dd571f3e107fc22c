"""Which kernels fine-tuning and evaluation run the model with: chosen once per run, where it runs.

:class:`TrainingKernels` is a LightningModule mixin: in ``setup`` (fit, validate, test and predict
alike; the trainer's device is known there) it sets ``training_kernels`` from
:meth:`~TrainingKernels.configure_training_kernels`, by default ``Kernels.for_training``: on CUDA the
Triton SnakeBeta with its Triton backward (``kernels/snake_beta.py``), elsewhere the torch reference.
The module passes ``training_kernels`` to its model in the training, validation and test steps.
With ``fast_training = False`` it is the torch reference everywhere (one switch, no global state).
Predict does not read it: the decode engine chooses its own (``Kernels.for_inference``).
"""

from __future__ import annotations

import torch

from omni_lightning.kernels import Kernels


class TrainingKernels:
    """LightningModule mixin (before ``LightningModule`` in the bases): ``training_kernels``, set in
    ``setup``. The module declares ``fast_training`` and ``training_kernels`` in its ``__init__``."""

    fast_training: bool
    training_kernels: Kernels

    def setup(self, stage: str) -> None:
        super().setup(stage)
        trainer = self._trainer  # None when a user calls setup by hand: the weights' device then
        device = trainer.strategy.root_device if trainer is not None else next(self.parameters()).device
        self.training_kernels = self.configure_training_kernels(device) if self.fast_training else Kernels()

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
