"""``Unregistered``: an ``nn.Module`` that a LightningModule uses without registering it as a submodule.

The fine-tuning losses and the evaluation metrics hold constants (STFT windows, mel filterbanks)
that must stay fp32 and stay out of checkpoints. Registered, they would follow the LightningModule
everywhere: into its ``state_dict``, and through ``module.to(torch.bfloat16)``, which Lightning's
bf16-true applies to the whole module (rounding every window and filterbank to 8 bits). Held here,
they are built with their owner, in its ``__init__``, and placed on the device where they are used.

Placement runs outside inference mode on purpose: ``validate``, ``test`` and ``predict`` run under
``torch.inference_mode``, where a moved buffer would become an inference tensor, and a later
``fit`` could not save it for backward.
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
