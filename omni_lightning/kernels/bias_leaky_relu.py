"""A convolution's bias and the leaky ReLU after it, ``y = leaky_relu(x + bias[c], slope)``: the op, in one file.

The discriminators' convolutions (``training/discriminators.py``) run channels-last (NHWC). Their bias
is a separate broadcast pass in torch (``_convolution`` adds it after cuDNN, a strided elementwise
kernel) and the leaky ReLU another; here both are one pass over ``x``, seen as ``[rows, C]`` (the
channels-last layout's memory), and the backward one pass over the output's gradient, with the
bias's gradient summed per channel in fp32 (per-program partial sums, then one sum).

Here are the torch reference (:func:`bias_leaky_relu_reference`, any device and layout, autograd) and
the Triton kernels as one autograd function (:func:`bias_leaky_relu_triton`, CUDA, 4-D channels-last
tensors). The backward reads the output, not the input (its sign is the input's, as ``slope > 0``),
so the function saves what the next layer keeps anyway. Not here: ``slope <= 0`` (refused: the
output's sign would not tell the input's), double backward, layouts other than channels-last (the
launcher copies into it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_lightning.kernels.launches import KernelLaunch, MockTensor, launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves
    triton = None

BLOCK_ROWS, BLOCK_C = 64, 64  # 4,096 elements a program; channels (32-128 here) in one or two tiles
BACKWARD_ROWS = 16  # row tiles a backward program sums before writing its partial sums


def bias_leaky_relu_reference(x: torch.Tensor, bias: torch.Tensor, slope: float) -> torch.Tensor:
    """The op in torch: ``x [B, C, H, W]`` (any layout), ``bias [C]``."""
    return F.leaky_relu(x + bias.view(1, -1, *([1] * (x.dim() - 2))).to(x.dtype), slope)


def bias_leaky_relu_triton(x: torch.Tensor, bias: torch.Tensor, slope: float) -> torch.Tensor:
    """:func:`bias_leaky_relu_reference` as Triton kernels on CUDA, forward and backward (one autograd
    function); ``x`` 4-D, channels-last (copied into that layout otherwise); the output channels-last."""
    if not slope > 0:
        raise ValueError(f"bias_leaky_relu_triton needs slope > 0 (the backward reads the output), got {slope}")
    return _BiasLeakyReLU.apply(x, bias, float(slope))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 4-D tensor's channels-last memory as ``[rows, C]`` (a copy into that layout where it is not)."""
    t = t.contiguous(memory_format=torch.channels_last)
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])


class _BiasLeakyReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, slope):
        rows = _rows(x)
        y = torch.empty_like(x, memory_format=torch.channels_last)
        out = y.permute(0, 2, 3, 1).view(-1, x.shape[1])
        grid = (triton.cdiv(rows.shape[0], BLOCK_ROWS), triton.cdiv(rows.shape[1], BLOCK_C))
        _forward_kernel[grid](*_forward_args(rows, bias, out, slope))
        ctx.save_for_backward(y, bias)
        ctx.slope = slope
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        y, bias = ctx.saved_tensors
        out, g = _rows(y), _rows(grad)
        dx = torch.empty_like(y, memory_format=torch.channels_last)
        programs = triton.cdiv(out.shape[0], BLOCK_ROWS * BACKWARD_ROWS)
        partial = torch.empty((programs, out.shape[1]), dtype=torch.float32, device=y.device)
        grid = (programs, triton.cdiv(out.shape[1], BLOCK_C))
        _backward_kernel[grid](*_backward_args(out, g, dx.permute(0, 2, 3, 1).view(-1, y.shape[1]), partial, ctx.slope))
        need = ctx.needs_input_grad
        return dx if need[0] else None, partial.sum(0).to(bias.dtype) if need[1] else None, None


def _forward_args(rows, bias, out, slope: float) -> tuple:
    return (rows, bias, out, rows.shape[0], rows.shape[1], slope, BLOCK_ROWS, BLOCK_C)


def _backward_args(out, grad, dx, partial, slope: float) -> tuple:
    return (out, grad, dx, partial, out.shape[0], out.shape[1], slope, BACKWARD_ROWS, BLOCK_ROWS, BLOCK_C)


def hopper_launches(layers) -> list[KernelLaunch]:
    """The launches (``kernels/launches.py``'s convention) are the discriminators', not the model's: ``layers``
    does not describe them, so one forward and one backward are listed at 32 channels, bf16 (the
    channel count, rows and slope are runtime arguments: one compile serves every layer)."""
    x, bias = MockTensor(torch.bfloat16, (4096, 32)), MockTensor(torch.bfloat16, (32,))
    partial = MockTensor(torch.float32, (1, 32))
    args = _forward_args(x, bias, x, 0.1)
    out = [launch("bias_leaky_relu", _forward_kernel, args[:-2], dict(BLOCK_ROWS=BLOCK_ROWS, BLOCK_C=BLOCK_C),
                  "discriminators", "bf16")]  # fmt: skip
    args = _backward_args(x, x, x, partial, 0.1)
    kwargs = dict(BLOCK_ROWS=BLOCK_ROWS, BLOCK_C=BLOCK_C)
    out.append(launch("bias_leaky_relu.backward", _backward_kernel, args[:-2], kwargs, "discriminators", "bf16"))
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["n_rows", "channels", "slope"])
    def _forward_kernel(x_ptr, bias_ptr, y_ptr, n_rows, channels, slope, BLOCK_ROWS: tl.constexpr,
                        BLOCK_C: tl.constexpr):  # fmt: skip
        first = tl.program_id(0).to(tl.int64) * BLOCK_ROWS  # 64-bit where the tile starts, 32-bit within it
        r = tl.arange(0, BLOCK_ROWS)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (first + r < n_rows)[:, None] & (c < channels)[None, :]
        offsets = r[:, None] * channels + c[None, :]
        x_ptr += first * channels
        y_ptr += first * channels
        v = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v += tl.load(bias_ptr + c, mask=c < channels, other=0.0).to(tl.float32)[None, :]
        v = tl.where(v > 0, v, v * slope)
        tl.store(y_ptr + offsets, v.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["n_rows", "channels", "slope", "steps"])
    def _backward_kernel(y_ptr, g_ptr, dx_ptr, partial_ptr, n_rows, channels, slope, steps, BLOCK_ROWS: tl.constexpr,
                         BLOCK_C: tl.constexpr):  # fmt: skip
        """``steps`` row tiles from program ``p``'s first (a runtime count: not unrolled, which spilled);
        ``dx = g`` where ``y > 0``, else ``slope * g``; the channels' sums of ``dx`` into ``partial[p]``."""
        p = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        total = tl.zeros([BLOCK_ROWS, BLOCK_C], dtype=tl.float32)
        for i in range(steps):
            r = (p.to(tl.int64) * steps + i) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            mask = (r < n_rows)[:, None] & (c < channels)[None, :]
            offsets = r[:, None] * channels + c[None, :]
            y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            dx = tl.where(y > 0, g, g * slope)
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            total += dx
        tl.store(partial_ptr + p * channels + c, tl.sum(total, axis=0), mask=c < channels)
