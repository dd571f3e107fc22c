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
from omni_lightning.kernels.conv_snake import conv_snake_triton, conv_snake_triton_autograd, widths_supported
from omni_lightning.kernels.conv_transpose import conv_transpose_fp32_input_grad, conv_transpose_reference
from omni_lightning.kernels.last_conv import MAX_TAPS, last_conv_triton
from omni_lightning.kernels.snake_beta import snake_beta_reference, snake_beta_triton, snake_beta_triton_autograd


def triton_available() -> bool:
    return snake_beta.triton is not None


@dataclass(frozen=True)
class Kernels:
    """What a forward runs: ``snake_beta`` (``kernels/snake_beta.py``'s signature), the decoder's
    transposed convolution ``conv_transpose`` (``kernels/conv_transpose.py``'s), ``inplace``
    (residual 1x1 convolutions accumulate into the residual stream in place: inference only, since
    autograd needs the stream's earlier values), and for the residual units ``conv_snake``
    (``kernels/conv_snake.py``: the dilated convolution with its second SnakeBeta as the epilogue, for
    the widths it takes in ``conv_snake_dtypes``; also where autograd records when ``conv_snake_grad``:
    it is differentiable, ``conv_snake_triton_autograd``; None: the convolution, then SnakeBeta);
    ``last_conv`` (``kernels/last_conv.py``: the decoder's last SnakeBeta, its ``C -> 1`` convolution and the
    clamp as one pass, inference only; None: the layers)."""

    snake_beta: Callable[..., torch.Tensor] = snake_beta_reference
    inplace: bool = False
    name: str = "reference"
    conv_transpose: Callable[..., torch.Tensor] = conv_transpose_reference
    conv_snake: Callable[..., torch.Tensor] | None = None
    conv_snake_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    conv_snake_grad: bool = False
    last_conv: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def takes_last_conv(self, x: torch.Tensor, conv: torch.nn.Conv1d) -> bool:
        """Whether the output layer on the stream ``x`` with its convolution ``conv`` runs ``last_conv``: one
        given, no gradient recorded, ``x`` in 16 or 32 bits with its channels contiguous, a ``C -> 1``
        convolution of at most 8 taps."""
        return (
            self.last_conv is not None
            and not torch.is_grad_enabled()
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.stride(-1) == 1
            and conv.out_channels == 1
            and conv.groups == 1
            and conv.dilation[0] == 1
            and 2 <= conv.kernel_size[0] <= MAX_TAPS
        )

    def fuses_conv_snake(self, a: torch.Tensor, conv: torch.nn.Conv1d) -> bool:
        """Whether a residual unit's dilated convolution ``conv`` of its first SnakeBeta's output ``a`` runs
        as ``conv_snake``: one given, widths :func:`widths_supported` takes, ``a``'s dtype in
        ``conv_snake_dtypes`` with its channels contiguous, no gradient recorded unless ``conv_snake_grad``."""
        return (
            self.conv_snake is not None
            and a.dtype in self.conv_snake_dtypes
            and a.stride(-1) == 1
            and widths_supported(conv.in_channels, conv.out_channels)
            and (self.conv_snake_grad or not torch.is_grad_enabled())
        )

    @classmethod
    def for_inference(cls, device: torch.device | str, fused: bool = True, last_conv: bool = False) -> Kernels:
        """On CUDA (when Triton is installed and ``fused``): Triton SnakeBeta, in-place residuals and the
        residual units' dilated convolutions with their SnakeBeta fused (``conv_snake``: 16-bit, 32-256
        channels); with ``last_conv`` the output layer as one kernel (``kernels/last_conv.py``; off until a
        GPU measures it faster: docs/performance.md); elsewhere the torch reference with in-place residuals.
        Any other ``last_conv`` is a ValueError naming it."""
        if not isinstance(last_conv, bool):
            raise ValueError(f"last_conv must be True or False, got {last_conv!r}")
        if fused and torch.device(device).type == "cuda" and triton_available():
            return cls(snake_beta_triton, inplace=True, name="triton" + "+last-conv" * last_conv,
                       conv_snake=conv_snake_triton, last_conv=last_conv_triton if last_conv else None)  # fmt: skip
        return cls(snake_beta_reference, inplace=True, name="reference-inplace")

    @classmethod
    def for_call(cls, device: torch.device | str) -> Kernels:
        """What a plain ``model(codes)`` runs: :meth:`for_inference` where no gradient is recorded,
        else :meth:`for_training` (on the CPU both are the torch reference)."""
        return cls.for_training(device) if torch.is_grad_enabled() else cls.for_inference(device)

    @classmethod
    def for_training(cls, device: torch.device | str, fused: bool = True, fused_conv: bool = False) -> Kernels:
        """Triton SnakeBeta forward and backward (one autograd function) on CUDA when Triton is installed
        (and ``fused``), the torch reference elsewhere; residuals out of place (autograd keeps the stream).
        ``fused_conv``: the residual units' dilated convolutions with their SnakeBeta fused, forward and
        backward (16-bit, 32-256 channels): off by default, since on an H100 a bf16-true step ran at 0.87 of
        cuDNN's with it (it saves 1.4 GiB at batch 32 x 2 s: docs/performance.md). On the CPU, whatever
        ``fused``, transposed convolutions in bf16 take their input's gradient in fp32 (oneDNN's bf16 one is
        wrong on AMX: ``kernels/conv_transpose.py``)."""
        device = torch.device(device)
        if fused and device.type == "cuda" and triton_available():
            conv = {"conv_snake": conv_snake_triton_autograd, "conv_snake_grad": True} if fused_conv else {}
            return cls(snake_beta_triton_autograd, inplace=False, name="triton-autograd", **conv)
        if device.type == "cpu":
            return cls(conv_transpose=conv_transpose_fp32_input_grad, name="reference, fp32 conv-transpose input grads")
        return cls(snake_beta_reference, inplace=False, name="reference")
