"""The optimizers and learning-rate schedules of fine-tuning: AdamW, linear warm-up, then cosine
decay to a floor (over the whole run, or only its last part: ``decay_fraction``), stepped once per batch;
with adversarial training a second AdamW for the discriminators, on the same schedule. Parameters below fp32
(bf16-true) get AdamW with fp32 master weights (``master_weights.py``): plain AdamW on bf16 weights rounds most
updates away.

AdamW runs torch's fused kernel where :func:`fused_adamw` allows it: a foreach step's many kernel
launches would bound the generator's step on the host."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from omni_lightning.training.master_weights import MasterWeightAdamW, below_fp32


class WarmupCosine:
    """``LambdaLR`` factor: ``(step + 1) / warmup`` during warm-up, then 1 until the last ``decay_fraction``
    of the steps after warm-up, then cosine from 1 down to ``min_ratio`` at ``total`` steps (and ``min_ratio``
    after). ``decay_fraction`` 1.0 is a plain warm-up-cosine; below it, the rate stays at its peak longer
    (warm-up, stable, decay). A class, not a closure, so a scheduler holding it pickles into a Lightning
    checkpoint (one saved before ``decay_fraction`` existed resumes with the module's, 1.0 by default)."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float, decay_fraction: float = 1.0) -> None:
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, max(total_steps, 1), min_ratio
        self.decay_fraction = decay_fraction

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay = max(round((self.total_steps - self.warmup_steps) * self.decay_fraction), 1)
        progress = min(max(step - (self.total_steps - decay), 0) / decay, 1.0)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def short_run_warmup(warmup_steps: int, total_steps: int) -> int:
    """The warm-up a run of ``total_steps`` gets: ``warmup_steps``, but at most a tenth of the run, so a
    short fit (the README's 40 steps under ``configs/finetune.yaml``'s 100 warm-up steps) trains at its
    learning rate for most of its steps instead of spending them all warming up."""
    return min(warmup_steps, max(total_steps, 0) // 10)


NON_NEGATIVE = (
    "learning_rate",
    "discriminator_lr",
    "weight_decay",
    "mel_weight",
    "stft_weight",
    "waveform_weight",
    "adversarial_weight",
    "feature_matching_weight",
    "warmup_steps",
)


def check_fine_tuning_settings(hparams: Mapping[str, Any]) -> None:
    """Refuses, by name, a negative or NaN learning rate, weight decay, loss weight or warm-up
    (:data:`NON_NEGATIVE`), ``min_lr_ratio`` outside [0, 1], ``decay_fraction`` outside (0, 1], a negative
    ``grad_clip``: checked when the module is built, not at the first optimizer step."""
    for name in (*NON_NEGATIVE, "min_lr_ratio", "decay_fraction"):  # a config file's null reaches here
        if isinstance(hparams[name], bool) or not isinstance(hparams[name], numbers.Real):
            raise ValueError(f"{name} must be a number, got {hparams[name]!r}")
    for name in NON_NEGATIVE:
        if not hparams[name] >= 0:  # NaN too
            raise ValueError(f"{name} must be >= 0, got {hparams[name]}")
    if not 0 <= hparams["min_lr_ratio"] <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {hparams['min_lr_ratio']}")
    if not 0 < hparams["decay_fraction"] <= 1:
        raise ValueError(f"decay_fraction must be in (0, 1], got {hparams['decay_fraction']}")
    clip = hparams["grad_clip"]
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, numbers.Real) or not clip >= 0):
        raise ValueError(f"grad_clip must be >= 0 or None, got {clip!r}")
    betas = hparams.get("betas")
    if not (
        isinstance(betas, (tuple, list))
        and len(betas) == 2
        and all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
    ):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")


def plain_precision(precision_plugin: Any) -> bool:
    """Whether ``precision_plugin`` is one of Lightning's plain ones (32-true, bf16-true, 16-true,
    64-true): no autocast, no gradient scaler; not ``MixedPrecision`` nor a plugin this does not know
    (FSDP's, DeepSpeed's, a user's)."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, Precision

    return type(precision_plugin) in (Precision, HalfPrecision, DoublePrecision)


def bf16_autocast(precision_plugin: Any) -> bool:
    """Whether ``precision_plugin`` is Lightning's own ``MixedPrecision`` in ``bf16-mixed``: autocast
    with no weight cache (``cache_enabled=False``: each cast runs where the weight is used) and no
    gradient scaler, so gradients are never scaled."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return (
        type(precision_plugin) is MixedPrecision
        and precision_plugin.precision == "bf16-mixed"
        and precision_plugin.scaler is None
    )


def fused_adamw(device: torch.device, precision_plugin: Any) -> bool:
    """Whether fine-tuning's AdamW uses torch's fused kernel for parameters on ``device``: on a device
    torch has fused AdamW for (CUDA, the CPU, ...), under Lightning's plain precision plugins
    (:func:`plain_precision`) and bf16-mixed (:func:`bf16_autocast`: no scaler, so nothing to unscale;
    Lightning's plugin refuses to clip a fused optimizer's gradients all the same, so the module clips
    them itself: :func:`clip_gradients`). Not under 16-mixed (a fused optimizer unscales its own
    gradients, after the clipping), nor under plugins this does not know. The fused step agrees with
    the foreach one to rounding (``tests/test_master_weights.py``)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    plain = plain_precision(precision_plugin) or bf16_autocast(precision_plugin)
    return plain and device.type in _get_fused_kernels_supported_devices()


def clip_gradients(module: Any, optimizer: torch.optim.Optimizer, value: float, algorithm: str | None) -> None:
    """``module.clip_gradients``, except under :func:`bf16_autocast`, where Lightning's plugin would refuse
    a fused AdamW: there its base class clips, as under a plain precision (no scaler: nothing to unscale)."""
    plugin = module.trainer.precision_plugin
    if not bf16_autocast(plugin):
        module.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm=algorithm)
        return
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType

    algorithm = GradClipAlgorithmType(algorithm or module.trainer.gradient_clip_algorithm or "norm")
    Precision.clip_gradients(plugin, optimizer, value, algorithm)


def adamw_with_schedule(
    params: Iterable[torch.nn.Parameter], schedule: WarmupCosine, fused: bool = False, **adamw: Any
) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """An AdamW optimizer (with fp32 master weights for parameters below fp32), torch's fused kernel
    when ``fused``, and its Lightning ``lr_scheduler`` entry, stepped every batch."""
    params = list(params)
    if below_fp32(params):
        opt = MasterWeightAdamW(params, fused=fused, **adamw)
    else:
        opt = torch.optim.AdamW(params, fused=fused or None, **adamw)  # False would also turn foreach off
    return opt, {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"}


def fine_tuning_optimizers(
    generator: Iterable[torch.nn.Parameter],
    discriminators: torch.nn.Module | None,
    *,
    learning_rate: float,
    betas: Sequence[float],
    weight_decay: float,
    discriminator_lr: float,
    warmup_steps: int,
    min_lr_ratio: float,
    total_steps: int | None,
    estimated_stepping_batches: float,
    fused: bool = False,
    decay_fraction: float = 1.0,
) -> Any:
    """What ``configure_optimizers`` returns: the trainable generator parameters' AdamW and schedule,
    and with ``discriminators`` theirs too (no weight decay). The schedule spans ``total_steps``
    batches, or Lightning's estimate (one step a batch, the GAN's too: ``adversarial.py``); its
    warm-up is at most a tenth of them (:func:`short_run_warmup`); the decay spans the last ``decay_fraction``
    of the rest (:class:`WarmupCosine`).
    ``fused``: torch's fused AdamW kernel (:func:`fused_adamw` decides)."""
    params = [p for p in generator if p.requires_grad]
    if not params:
        raise ValueError("every model parameter is frozen: nothing to fine-tune")
    total = total_steps or int(estimated_stepping_batches)
    schedule = WarmupCosine(short_run_warmup(warmup_steps, total), max(total, 1), min_lr_ratio, decay_fraction)
    opt, sched = adamw_with_schedule(
        params, schedule, fused, lr=learning_rate, betas=tuple(betas), weight_decay=weight_decay
    )
    if discriminators is None:
        return {"optimizer": opt, "lr_scheduler": sched}
    opt_d, sched_d = adamw_with_schedule(
        discriminators.parameters(), schedule, fused, lr=discriminator_lr, betas=tuple(betas), weight_decay=0.0
    )  # AdamW's default is 1e-2
    return [opt, opt_d], [sched, sched_d]
