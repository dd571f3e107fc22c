"""EMA weights for fine-tuning: Lightning's ``WeightAveraging`` callback with an exponential average.

``Code2WavModule(ema_decay=...)`` adds :class:`EMAWeights` to ``fit``. The average is updated after
every optimizer step and swapped in for validation; after fit the module holds it (for validate,
test, predict, export) and ``Code2WavModule.use_ema(False)`` puts the raw weights back. Checkpoints
hold the average as ``state_dict`` and the raw weights under ``current_model_state``, as Lightning does.

Unlike ``EMAWeightAveraging``: the average warms up (:func:`warmed_up_weight`: a short fit's average is
not its starting weights); the update is ``torch.lerp`` (a frozen parameter never drifts by
rounding); buffers are copied, not averaged (Code2Wav's int64 offsets would truncate); the average
is fp32 whatever the module's dtype; the update never waits for the device; at the end of fit the
weights are swapped, not copied, so the raw ones can be restored.
Not done: the discriminators are averaged too (Lightning averages the whole module); a module loaded
from a checkpoint holds no raw weights in memory.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import WeightAveraging
from torch.optim.swa_utils import AveragedModel


def warmed_up_weight(weight: float, count: int) -> float:
    """The weight of update ``count`` (>= 1; update 0 copies): ``1 - decay``, but no less than
    ``9 / (10 + count)`` (TensorFlow's ``ExponentialMovingAverage(num_updates=...)``), so the average
    spans about a ninth of the steps so far until ``1 / (1 - decay)`` is shorter. A plain 0.999 average
    would still hold 55 % of the starting weights after 600 steps, 96 % after 40."""
    return max(weight, 9.0 / (10.0 + count))


@torch.no_grad()
def _lerp(weight: float, average: torch.Tensor, current: torch.Tensor, n_averaged: Any) -> torch.Tensor:
    return torch.lerp(average, current.to(average.dtype), warmed_up_weight(weight, int(n_averaged)))


class _HostCountedAverage(AveragedModel):
    """torch's ``AveragedModel``, updated without waiting for the device.

    torch's own ``update_parameters`` reads the update count from the device (a host sync) and
    launches per parameter. Here the count is read once per fit and then kept on the host, and every
    parameter is averaged in one ``torch._foreach_lerp_`` (bit for bit :func:`_lerp`), after one
    ``torch._foreach_copy_`` casting parameters held below fp32 (bf16-true). The device's
    count still advances, for checkpoints. :class:`EMAWeights` gives Lightning's model this class.
    """

    weight: float = 0.0  # 1 - decay, set by EMAWeights
    count: int | None = None  # updates so far, on the host; None: read from the device once

    def update_parameters(self, model: torch.nn.Module) -> None:
        count = int(self.n_averaged) if self.count is None else self.count
        averaged = [p.detach() for p in self.parameters()]
        current = [p.detach() for p in model.parameters()]
        with torch.no_grad():
            if count == 0:
                for a, c in zip(averaged, current):
                    a.copy_(c)
            else:
                if any(c.dtype != a.dtype for a, c in zip(averaged, current)):  # bf16-true: cast in one launch
                    cast = [torch.empty_like(a) for a in averaged]  # per dtype, not one per parameter
                    torch._foreach_copy_(cast, current)
                    current = cast
                torch._foreach_lerp_(averaged, current, warmed_up_weight(self.weight, count))
            self.n_averaged += 1
        self.count = count + 1


def _swap(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Exchanges the parameter and buffer values of two modules of the same structure, through
    ``detach()`` (not ``.data``), so their version counters record the write a kept engine must see."""
    pairs = zip(itertools.chain(a.parameters(), a.buffers()), itertools.chain(b.parameters(), b.buffers()))
    with torch.no_grad():
        for x, y in pairs:
            x, y = x.detach(), y.detach()
            tmp = x.clone()
            x.copy_(y)
            y.copy_(tmp)


class EMAWeights(WeightAveraging):
    """Exponential moving average of the weights, updated after every optimizer step (see the module docstring)."""

    def __init__(self, decay: float = 0.999) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {decay}")
        super().__init__(use_buffers=False, avg_fn=partial(_lerp, 1.0 - decay))  # a partial pickles
        self.decay = decay
        self._held: torch.nn.Module | None = None  # after fit: the weights not in the module (raw or average)
        self._average_in = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._held, self._average_in = None, False  # a new fit averages from the weights it starts with
            # and counts its own steps (the callback outlives a fit; a resumed fit loads its count later)
            self._latest_update_step, self._latest_update_epoch = 0, -1
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._average_model.float()
            self._average_model.__class__ = _HostCountedAverage  # Lightning builds a plain AveragedModel
            self._average_model.weight = 1.0 - self.decay

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Nothing here: the swap waits for ``on_fit_end``, after every callback's ``on_train_end``,
        where ``ModelCheckpoint`` may save ``last.ckpt``: that checkpoint must hold both weights and the
        averaging state, as every checkpoint written during fit does (Lightning moves checkpoint
        callbacks after this one)."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._average_model is None:
            return
        _swap(self._average_model.module, pl_module)
        self._held, self._average_model, self._average_in = self._average_model.module, None, True

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        """During fit, Lightning's (the average as ``state_dict``, the raw weights beside it). Outside fit
        (``trainer.save_checkpoint`` after it), the checkpoint holds the weights the module holds, the
        average unless ``use_ema(False)``, with no averaging state to resume: said here, not in Lightning's
        note on every such save."""
        if self._average_model is not None:
            super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def use_average(self, pl_module: pl.LightningModule, on: bool) -> bool:
        """After fit: the averaged weights (``on``) or the raw ones into ``pl_module``; before, nothing.
        Returns whether the averaged weights were in before."""
        previous = self._average_in
        if self._held is not None and on != self._average_in:
            _swap(self._held, pl_module)
            self._average_in = on
        return previous
