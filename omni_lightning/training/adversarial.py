"""The GAN step of fine-tuning, under Lightning's manual optimization: the discriminators, then the generator.

HiFi-GAN's order: the discriminators learn from real and (detached) generated audio, then the
generator takes the reconstruction, adversarial and feature-matching losses against them. Every item
is cut to the batch's shortest real length (read on the CPU where the batch carries it), so padding
never reaches a discriminator.

One batch is one ``trainer.global_step``, as without the GAN. Under manual optimization Lightning
counts every ``LightningOptimizer.step()`` (the loop's ``optim_step_progress``), so the generator steps
through it and the discriminators through ``trainer.strategy.optimizer_step``, the call that
``LightningOptimizer.step`` makes once it has counted: the same precision plugin (GradScaler unscale,
step and update; autocast's and master weights' handling), the same ``on_before_optimizer_step`` hooks
and the same DDP handling, without the count. So ``max_steps``, checkpoints' ``every_n_train_steps``
and names, the schedules' length and EMA count batches (``val_check_interval`` always did).

Gradients are clipped in :meth:`AdversarialStep.clip`, called from ``on_before_optimizer_step``,
where 16-mixed's GradScaler has unscaled them. Under 16-mixed each backward is unscaled by the scale
it was made with, and a step with non-finite gradients is skipped. The generator's backward runs with
the discriminators frozen (``toggle_optimizer``).
Not done: gradient accumulation (Lightning refuses it under manual optimization) and separate
update rates for the two networks.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import do_nothing_closure

from omni_lightning.errors import UsageError
from omni_lightning.training.discriminators import Discriminators


class AdversarialStep:
    """One batch of GAN training for a LightningModule with ``automatic_optimization = False`` and
    the optimizers ``[generator, discriminators]``; the losses' weights are those of the objective."""

    def __init__(
        self,
        discriminators: Discriminators,
        adversarial_weight: float = 1.0,
        feature_matching_weight: float = 2.0,
        grad_clip: float | None = 1.0,
    ) -> None:
        self.discriminators = discriminators
        self.adversarial_weight = adversarial_weight
        self.feature_matching_weight = feature_matching_weight
        self.grad_clip = grad_clip
        self._stepping = ""  # the norm being measured: "grad_norm" (generator) or "disc_grad_norm"
        self._norms: dict[str, torch.Tensor] = {}

    def __call__(
        self,
        module: pl.LightningModule,
        wav: torch.Tensor,
        audio: torch.Tensor,
        shortest: int,
        reconstruction_loss: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Steps both optimizers and their schedules; returns what to log: the generator's total
        ``loss``, ``adv``, ``feature_matching``, ``disc`` and both gradient norms (before clipping).

        ``wav`` [B, 1, T] generated, ``audio`` [B, N] the targets, ``shortest`` the shortest item's
        real length in samples."""
        opt_g, opt_d = module.optimizers()
        real, fake = audio[:, None, :shortest], wav[..., :shortest]
        d_loss = self.discriminators.discriminator_loss(real, fake)
        d_norm = self._step(module, opt_d, d_loss, "disc_grad_norm", counted=False)
        module.toggle_optimizer(opt_g)
        try:
            adv, fm = self.discriminators.generator_losses(real, fake)
            g_loss = reconstruction_loss + self.adversarial_weight * adv + self.feature_matching_weight * fm
            g_norm = self._step(module, opt_g, g_loss, "grad_norm", counted=True)
        finally:
            module.untoggle_optimizer(opt_g)
        for scheduler in module.lr_schedulers():
            scheduler.step()
        return {
            "loss": g_loss,
            "adv": adv,
            "feature_matching": fm,
            "disc": d_loss,
            "grad_norm": g_norm,
            "disc_grad_norm": d_norm,
        }

    def segment(self, batch: dict[str, Any], lengths: torch.Tensor) -> int:
        """The samples every item is cut to: the batch's shortest real audio, read on the CPU before the
        transfer (``batch["shortest"]``), else here, before the forward is queued (a host sync: the
        device drains the last step first). A batch shorter than the discriminators take is refused,
        naming its short requests."""
        shortest = batch.get("shortest")
        if shortest is None:
            shortest = int(lengths.min())
        need = self.discriminators.min_samples
        if shortest < need:
            short = [r for r, n in zip(batch["req_ids"], lengths.tolist()) if n < need]
            raise UsageError(
                f"the GAN cuts a batch to its shortest real audio, and the discriminators need >= "
                f"{need} samples: request(s) {short[:5]} have fewer (shortest {shortest}); longer "
                "crops (crop_frames) or longer audio"
            )
        return shortest

    def _step(
        self, module: pl.LightningModule, optimizer: Any, loss: torch.Tensor, norm: str, counted: bool
    ) -> torch.Tensor:
        """Backward and step; Lightning calls ``on_before_optimizer_step``, hence :meth:`clip`, inside.
        ``counted``: through the ``LightningOptimizer`` (one ``global_step``), else the strategy's step alone."""
        optimizer.zero_grad()
        module.manual_backward(loss)
        self._stepping = norm
        if counted:
            optimizer.step()
        else:  # what LightningOptimizer.step runs between its count's two halves (core/optimizer.py)
            trainer = module.trainer
            with trainer.profiler.profile("optimizer_step"):
                trainer.strategy.optimizer_step(getattr(optimizer, "optimizer", optimizer), do_nothing_closure)
        if norm not in self._norms:
            raise RuntimeError("on_before_optimizer_step must call AdversarialStep.clip (a subclass overrode it?)")
        return self._norms.pop(norm)

    def clip(self, optimizer: torch.optim.Optimizer) -> None:
        """Clips ``optimizer``'s gradients to ``grad_clip`` (none: measures only) and keeps their
        norm for the step's logs. Call it from ``on_before_optimizer_step``, where they are unscaled."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.grad_clip:
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, total)
        self._norms[self._stepping] = total


def find_unused_parameters_under_ddp(trainer: pl.Trainer) -> None:
    """The GAN's two backward passes each leave the other network's parameters without a gradient, so
    DDP must look for unused parameters or its first step fails. Called from the module's ``setup``
    (before the strategy wraps the module): on Lightning's ``DDPStrategy`` it sets the keyword that
    ``strategy="ddp_find_unused_parameters_true"`` would have (``_ddp_kwargs``: the strategy keeps its
    DDP constructor keywords there and reads them when it wraps). Other strategies are left alone."""
    from lightning.pytorch.strategies import DDPStrategy

    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy) and not strategy._ddp_kwargs.get("find_unused_parameters"):
        strategy._ddp_kwargs["find_unused_parameters"] = True
