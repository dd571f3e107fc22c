"""The decoder's transposed convolution (``F.conv_transpose2d`` on ``[B, C, 1, T]`` views): the op, in one file.

Here are the torch reference (:func:`conv_transpose_reference`) and a version whose input gradient
runs in fp32 where the convolution runs in bf16 (:func:`conv_transpose_fp32_input_grad`), for
training on the CPU: oneDNN's bf16 input gradient of a transposed convolution is wrong on CPUs with
AMX (``brg_conv_fwd:avx10_1_512_amx``, torch 2.14.1): for the tiny preset's ``decoder.3`` (16 to 8
channels, stride 4, kernel 8) its relative error is 1.0, against 3e-3 without AMX
(``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``). Its forward, its weight gradient, fp16 and Qwen3-Omni's
shapes are right, so those stay as the reference computes them: the forward and the weight and bias
gradients in bf16, bit for bit the reference's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_transpose_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: tuple[int, int],
    padding: tuple[int, int],
) -> torch.Tensor:
    """``F.conv_transpose2d(x, weight, bias, stride, padding)``."""
    return F.conv_transpose2d(x, weight, bias, stride=stride, padding=padding)


def conv_transpose_fp32_input_grad(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: tuple[int, int],
    padding: tuple[int, int],
) -> torch.Tensor:
    """:func:`conv_transpose_reference`, with ``x``'s gradient computed in fp32 when the convolution
    runs in bf16 (bf16 tensors, or fp32 ones under a bf16 autocast) and ``x`` needs a gradient; the
    reference itself otherwise (inference, fp32, fp16)."""
    dtype = _computes_in(x)
    if dtype != torch.bfloat16 or not (torch.is_grad_enabled() and x.requires_grad):
        return conv_transpose_reference(x, weight, bias, stride, padding)
    return _Fp32InputGrad.apply(x, weight, bias, stride, padding, dtype)


def _computes_in(x: torch.Tensor) -> torch.dtype:
    """The dtype the convolution runs in: autocast's where it casts ``x``, else ``x``'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.dtype in (torch.float32, torch.get_autocast_dtype(device)):
        return torch.get_autocast_dtype(device)
    return x.dtype


class _Fp32InputGrad(torch.autograd.Function):
    """The reference's forward on ``dtype`` copies (what autocast would make); its backward takes the
    input's gradient in fp32 and the weight's and bias's in ``dtype``, as the reference does."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dtype):
        xc, wc = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(xc, wc)
        ctx.stride, ctx.padding = stride, padding
        ctx.dtypes = x.dtype, weight.dtype, bias.dtype if bias is not None else None
        return F.conv_transpose2d(xc, wc, bias.to(dtype) if bias is not None else None, stride=stride, padding=padding)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        xc, wc = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        # stride, padding, dilation, transposed, output_padding, groups
        args = (list(ctx.stride), list(ctx.padding), [1, 1], True, [0, 0], 1)
        dx = dw = db = None
        if need_x:
            g, x32, w32 = grad.float(), xc.float(), wc.float()
            dx = torch.ops.aten.convolution_backward(g, x32, w32, None, *args, [True, False, False])[0].to(x_dtype)
        if need_w or need_b:
            bias_sizes = [wc.shape[1]] if b_dtype is not None else None
            _, dw, db = torch.ops.aten.convolution_backward(grad, xc, wc, bias_sizes, *args, [False, need_w, need_b])
            dw = dw.to(w_dtype) if need_w else None
            db = db.to(b_dtype) if need_b else None
        return dx, dw, db, None, None, None
