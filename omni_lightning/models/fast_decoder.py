"""The waveform decoder for inference: channels-last activations, no separate bias or residual passes.

What the profile of the layer-by-layer decoder showed on an H200 (docs/performance.md): a quarter
of the kernel time in the convolutions' separate bias adds and a sixth in cuDNN's NCHW <-> NHWC
conversions around every convolution. This forward of ``Code2Wav.decoder`` (same parameters, same
function) avoids both:
- activations stay time-major ``[B, T, C]``, which is cuDNN's NHWC for a ``[B, C, 1, T]``
  convolution, so convolutions run as ``conv2d`` on channels-last views with no conversion;
- no convolution adds its bias: each bias is carried as a pending per-channel vector and added in
  fp32 inside the next fused SnakeBeta (``fused.snake_beta_tc``), which every convolution output
  meets first;
- each residual unit's second SnakeBeta (with the pending bias) is one fused pass and its 1x1
  convolution an ``addmm_`` into the residual stream, in place. ``FUSE_POINTWISE = True`` makes the
  two one Triton GEMM instead (``fused.snake_pointwise_residual_``: SnakeBeta in its prologue, the
  residual added in its epilogue, so the SnakeBeta output never goes to memory). It is off by
  default because it is slower where it matters (H200, docs/performance.md): the prologue recomputes
  the SnakeBeta of each ``h`` tile once per output-channel tile, so at 192-768 channels the GEMM
  takes 1.6-4x the time of the two separate passes and the mixed job drops from 4,222x to 3,892x;
  only at 96 channels (one output tile) is it faster (1.78 vs 2.14 ms per unit at batch 32). It is
  kept, tested (``tests/test_triton_kernels.py`` in Triton's interpreter, ``tests/test_fast_decoder.py``
  on CUDA) and timed (``scripts/bench_pointwise.py``, ``scripts/bench_gpu.py --fused-variant``) for
  that next step;
- dilated convolutions run as dilation-1 convolutions over a ``[B, C, T/d, d]`` view of the same
  memory (``_dilated_conv``): cuDNN's Hopper kernels take dilation 1 only;
- transposed convolutions trim their look-ahead with the convolution's own ``padding`` (a crop of
  the full output), so their output needs no copy.
Numerically it is the same function in a different order of roundings; ``tests/test_fast_decoder.py``
checks it against the layer-by-layer forward, and the fidelity guard (``scripts/bench_gpu.py``,
``tests/test_gpu_predict.py``) against fp32. Not done: the pre-transformer and the ConvNeXt
upsampler keep the layer-by-layer forward (about 5 % of the FLOPs); autograd never runs here
(training uses the layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_lightning.models.fused import snake_beta_tc, snake_beta_tc_into, snake_pointwise_residual_, triton_available
from omni_lightning.models.layers import CausalConv1d, CausalConvTranspose1d, DecoderBlock, SnakeBeta

FUSE_POINTWISE = False  # see the module docstring: the fused residual GEMM is opt-in (slower on an H200)


def _nhwc(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, C]`` (channels contiguous) as the ``[B, C, 1, T]`` channels-last view cuDNN takes."""
    return x.permute(0, 2, 1).unsqueeze(2)


def _time_major(y: torch.Tensor) -> torch.Tensor:
    return y.squeeze(2).permute(0, 2, 1)


def _snake(act: SnakeBeta, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return snake_beta_tc(x, act.alpha, act.beta, bias)


def _snake_rows(act: SnakeBeta, x: torch.Tensor, bias: torch.Tensor | None, multiple: int) -> torch.Tensor:
    """``_snake`` into ``[B, T', C]`` rows, ``T'`` the next multiple of ``multiple``; rows past ``T`` zero."""
    batch, length, channels = x.shape
    rows = -(-length // multiple) * multiple
    if rows == length:
        return _snake(act, x, bias)
    out = torch.empty((batch, rows, channels), dtype=x.dtype, device=x.device)
    if x.is_cuda and triton_available():
        snake_beta_tc_into(x, out[:, :length], act.alpha, act.beta, bias, log_params=True)
    else:
        out[:, :length] = _snake(act, x, bias)
    out[:, length:].zero_()
    return out


def _dilated_conv(layer: CausalConv1d, x: torch.Tensor, length: int) -> torch.Tensor:
    """The causal convolution of dilation ``d`` on ``x [B, T', C]`` (``T'`` a multiple of ``d``) as a
    dilation-1 convolution: time-major ``[B, T', C]`` is the channels-last ``[B, C, T'/d, d]``, in which
    time step ``q * d + r`` is row ``q`` of column ``r``, and ``d`` steps apart are adjacent rows.
    cuDNN runs dilation 1 with Hopper kernels and dilations 3 and 9 with Ampere ones, at ~half their
    rate (docs/performance.md). Returns the first ``length`` steps ``[B, length, C_out]`` (a view)."""
    conv = layer.conv
    dilation = conv.dilation[0]
    batch, rows, channels = x.shape
    grid = x.view(batch, rows // dilation, dilation, channels).permute(0, 3, 1, 2)
    y = F.conv2d(grid, conv.weight.unsqueeze(3), None, padding=(layer.left_pad // dilation, 0), groups=conv.groups)
    return y.permute(0, 2, 3, 1).reshape(batch, -1, y.shape[1])[:, :length]


def _conv(layer: CausalConv1d, x: torch.Tensor, bias: bool = False) -> torch.Tensor:
    conv = layer.conv
    y = F.conv2d(_nhwc(x), conv.weight.unsqueeze(2), conv.bias if bias else None,
                 padding=(0, layer.left_pad), dilation=(1, conv.dilation[0]), groups=conv.groups)  # fmt: skip
    return _time_major(y)[:, : x.shape[1]]  # causal: drop the right overhang (a view)


def _conv_transpose(layer: CausalConvTranspose1d, x: torch.Tensor) -> torch.Tensor:
    conv = layer.conv
    y = F.conv_transpose2d(_nhwc(x), conv.weight.unsqueeze(2), None, stride=(1, conv.stride[0]),
                           padding=(0, layer.trim))  # fmt: skip
    return _time_major(y)


def _add_pointwise_conv_(x: torch.Tensor, layer: CausalConv1d, h: torch.Tensor) -> torch.Tensor:
    """``x += conv1x1(h)`` without the bias, as one GEMM with the residual in its epilogue."""
    if not x.is_contiguous():
        x = x.contiguous()
    channels = x.shape[-1]
    weight = layer.conv.weight.view(layer.conv.out_channels, -1)
    x.view(-1, channels).addmm_(h.reshape(-1, h.shape[-1]), weight.t())
    return x


def _block(block: DecoderBlock, x: torch.Tensor, pending: torch.Tensor | None):
    """One DecoderBlock on the time-major stream ``x`` whose true value is ``x + pending``."""
    act, upsample, *units = block.block
    x = _conv_transpose(upsample, _snake(act, x, pending))
    pending = upsample.conv.bias.float()
    for unit in units:
        dilation = unit.conv1.conv.dilation[0]
        if dilation > 1:
            h = _dilated_conv(unit.conv1, _snake_rows(unit.act1, x, pending, dilation), x.shape[1])
        else:
            h = _conv(unit.conv1, _snake(unit.act1, x, pending))
        if FUSE_POINTWISE:
            x = snake_pointwise_residual_(x if x.is_contiguous() else x.contiguous(), h, unit.act2.alpha,
                                          unit.act2.beta, unit.conv1.conv.bias, unit.conv2.conv.weight)  # fmt: skip
        else:
            h = _snake(unit.act2, h, unit.conv1.conv.bias)
            x = _add_pointwise_conv_(x, unit.conv2, h)
        pending = pending + unit.conv2.conv.bias.float()
    return x, pending


def decoder_forward(decoder: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    """``Code2Wav.decoder`` on ``h [B, hidden, T]``: ``[B, 1, output]`` before the clamp."""
    first, *blocks, last_act, last_conv = decoder
    x = _conv(first, h.transpose(1, 2).contiguous())
    pending = first.conv.bias.float()
    for block in blocks:
        x, pending = _block(block, x, pending)
    y = _conv(last_conv, _snake(last_act, x, pending), bias=True)
    return y.permute(0, 2, 1)
