"""The optimizer and learning-rate schedule of fine-tuning: AdamW, linear warm-up, then cosine
decay to a floor, stepped once per batch."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


class WarmupCosine:
    """``LambdaLR`` factor: ``(step + 1) / warmup`` during warm-up, then cosine from 1 down to
    ``min_ratio`` at ``total`` steps (and ``min_ratio`` after). A class, not a closure, so a
    scheduler holding it pickles into a Lightning checkpoint."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float) -> None:
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, max(total_steps, 1), min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1), 1.0)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def adamw_with_schedule(
    params: Iterable[torch.nn.Parameter], schedule: WarmupCosine, **adamw: Any
) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """An AdamW optimizer and its Lightning ``lr_scheduler`` entry, stepped every batch."""
    opt = torch.optim.AdamW(params, **adamw)
    return opt, {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"}
