"""The learning-rate schedule of fine-tuning: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math


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
