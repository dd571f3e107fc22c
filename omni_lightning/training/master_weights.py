"""fp32 master weights for parameters held in bf16 or fp16 (``bf16-true``): AdamW steps an fp32 copy,
and the parameters take its values, rounded to nearest.

With bf16 weights, an AdamW update below half a bf16 step of its weight is rounded away; the fp32
copy keeps every update. ``fine_tuning_optimizers`` uses :class:`MasterWeightAdamW` whenever a
trainable parameter is below fp32. Cost: 16 bytes a parameter instead of 8, and per step a cast of
the gradients to fp32 and a copy back, one foreach launch per dtype each. A change made to the
parameters outside the optimizer is overwritten at its next step; the optimizer's ``state_dict``
holds the copy, so a resumed fit goes on unrounded. Not done: other optimizers; fp32 parameters in a
mixed module get a copy too. Not chosen: stochastic rounding (right only on average).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def below_fp32(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` is a floating-point tensor narrower than fp32 (bf16, fp16)."""
    return any(p.is_floating_point() and p.element_size() < 4 for p in params)


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over fp32 copies of ``params``; after each step the parameters take the copies' values.

    Its ``param_groups`` hold the model's parameters (Lightning clips their gradients, a schedule
    sets their ``lr``, ``toggle_optimizer`` freezes them); each step copies the groups'
    hyperparameters and the gradients (in fp32) to an inner ``torch.optim.AdamW`` over the copies."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        fused: bool = False,
    ) -> None:
        self.fp32: torch.optim.AdamW | None = None  # the inner AdamW, built with the first group
        self.fused = fused  # the inner AdamW's torch ``fused`` kernel (``schedule.fused_adamw``)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        with torch.no_grad():
            copies = [p.detach().to(torch.float32, copy=True) for p in group["params"]]
        inner = {"params": copies, **{k: group[k] for k in _HYPERPARAMETERS}}
        if self.fp32 is None:
            self.fp32 = torch.optim.AdamW([inner], fused=self.fused or None)  # None: torch's foreach default
        else:
            self.fp32.add_param_group(inner)

    def master_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, its fp32 copy)`` for every parameter, in group order."""
        return [
            (p, m)
            for group, inner in zip(self.param_groups, self.fp32.param_groups)
            for p, m in zip(group["params"], inner["params"])
        ]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # Lightning's automatic optimization runs forward and backward here
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.fp32.param_groups):
            inner.update({k: group[k] for k in _HYPERPARAMETERS})  # a schedule changes the outer lr
        stepped = [(p, m) for p, m in self.master_weights() if p.grad is not None]
        if not stepped:
            return loss
        params, copies = [p for p, _ in stepped], [m for _, m in stepped]
        # the gradients cast to fp32 in one launch per dtype, not one per parameter (empty_like only
        # takes memory from the allocator); freed after the step: an fp32 gradient lives only here
        grads = [torch.empty_like(m) for m in copies]
        torch._foreach_copy_(grads, [p.grad for p in params])
        for m, g in zip(copies, grads):
            m.grad = g
        self.fp32.step()
        torch._foreach_copy_(params, copies)  # rounded back in one launch per dtype, not one per parameter
        for m in copies:
            m.grad = None
        return loss

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # the groups' hyperparameters; no state of its own
        state["fp32"] = self.fp32.state_dict()
        state["master_weights"] = [m.detach() for _, m in self.master_weights()]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        fp32, copies = state_dict.pop("fp32"), state_dict.pop("master_weights")
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for (_, m), saved in zip(self.master_weights(), copies, strict=True):
                m.copy_(saved)
        self.fp32.load_state_dict(fp32)
