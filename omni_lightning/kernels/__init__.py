"""Kernels: one op per file (its Triton kernel, launcher and torch reference together), and
:class:`Kernels`, the choice of implementations a ``Code2Wav`` forward runs with.

The model is plain torch and takes a ``Kernels`` argument; whoever runs it (the decode engine, the
training step) picks one when it is built. There is no global switch to flip: a choice is a value
that travels with the call, so a captured CUDA graph and the kernels it ran cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from omni_lightning.kernels import snake_beta
from omni_lightning.kernels.conv_transpose import conv_transpose_fp32_input_grad, conv_transpose_reference
from omni_lightning.kernels.residual_unit import MAX_CHANNELS, residual_unit_triton
from omni_lightning.kernels.snake_beta import snake_beta_reference, snake_beta_triton, snake_beta_triton_autograd


def triton_available() -> bool:
    return snake_beta.triton is not None


@dataclass(frozen=True)
class Kernels:
    """What a forward runs: ``snake_beta`` (``kernels/snake_beta.py``'s signature), the decoder's
    transposed convolution ``conv_transpose`` (``kernels/conv_transpose.py``'s), ``inplace``
    (residual 1x1 convolutions accumulate into the residual stream in place: inference only, since
    autograd needs the stream's earlier values) and ``residual_unit`` (``kernels/residual_unit.py``:
    a residual unit's convolutions and second SnakeBeta in one pass, in place; None: layer by layer)."""

    snake_beta: Callable[..., torch.Tensor] = snake_beta_reference
    inplace: bool = False
    name: str = "reference"
    conv_transpose: Callable[..., torch.Tensor] = conv_transpose_reference
    residual_unit: Callable[..., torch.Tensor] | None = None

    def fused_unit(self, x: torch.Tensor) -> bool:
        """Whether a residual unit on the stream ``x`` runs as ``residual_unit`` (in place, so inference
        only; channels within one tile; a contiguous stream)."""
        return (
            self.residual_unit is not None
            and self.inplace
            and x.shape[-1] <= MAX_CHANNELS
            and x.is_contiguous()
            and not torch.is_grad_enabled()
        )

    @classmethod
    def for_inference(cls, device: torch.device | str, fused: bool = True, fused_units: bool = False) -> Kernels:
        """Triton SnakeBeta on CUDA (when Triton is installed and ``fused``), in-place residuals;
        ``fused_units``: the residual units of up to ``MAX_CHANNELS`` channels as one kernel each
        (``kernels/residual_unit.py``). Off by default: checked in Triton's interpreter, not yet
        measured or run on a GPU (``scripts/bench_units.py`` is the A/B that decides)."""
        if fused and torch.device(device).type == "cuda" and triton_available():
            units = residual_unit_triton if fused_units else None
            return cls(snake_beta_triton, inplace=True, name="triton" + "-units" * fused_units, residual_unit=units)
        return cls(snake_beta_reference, inplace=True, name="reference-inplace")

    @classmethod
    def for_call(cls, device: torch.device | str) -> Kernels:
        """What a plain ``model(codes)`` runs: :meth:`for_inference` where no gradient is recorded,
        else :meth:`for_training` (on the CPU both are the torch reference)."""
        return cls.for_training(device) if torch.is_grad_enabled() else cls.for_inference(device)

    @classmethod
    def for_training(cls, device: torch.device | str, fused: bool = True) -> Kernels:
        """Triton SnakeBeta forward and backward (one autograd function) on CUDA when Triton is
        installed (and ``fused``), the torch reference elsewhere; residuals out of place (autograd
        keeps the stream). On the CPU, whatever ``fused``, transposed convolutions in bf16 take their
        input's gradient in fp32 (oneDNN's bf16 one is wrong on AMX: ``kernels/conv_transpose.py``)."""
        device = torch.device(device)
        if fused and device.type == "cuda" and triton_available():
            return cls(snake_beta_triton_autograd, inplace=False, name="triton-autograd")
        if device.type == "cpu":
            return cls(conv_transpose=conv_transpose_fp32_input_grad, name="reference, fp32 conv-transpose input grads")
        return cls(snake_beta_reference, inplace=False, name="reference")
