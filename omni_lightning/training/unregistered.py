"""``Unregistered``: an ``nn.Module`` that a LightningModule uses without registering it as a submodule.

The fine-tuning losses and the evaluation metrics hold fp32 constants (STFT windows, mel
filterbanks) that must stay out of checkpoints and out of ``module.to(torch.bfloat16)`` (bf16-true).
Held here, they are built in their owner's ``__init__`` and placed on the device where they are
used, outside inference mode (a buffer moved under ``inference_mode`` could not be saved for a
later ``fit``'s backward).
"""

from __future__ import annotations

from typing import Generic, TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)


class Unregistered(Generic[M]):
    """Holds ``module`` outside its owner's module tree; :meth:`on` gives it on a device."""

    def __init__(self, module: M) -> None:
        self.module = module

    def on(self, device: torch.device | str) -> M:
        """The module, moved to ``device`` first if it is elsewhere (outside inference mode)."""
        with torch.inference_mode(False):
            return self.module.to(device)
