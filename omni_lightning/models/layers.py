"""The layers of Code2Wav, named as in transformers' ``Qwen3OmniMoeCode2Wav`` (so state_dict keys match).

Activations are time-major, ``[B, T, C]``: cuDNN's NHWC for a ``[B, C, 1, T]`` convolution, so
convolutions run on channels-last views with no layout conversion. Every layer takes the forward's
:class:`~omni_lightning.models.state.Step` (the kernels, and for a stateful forward each layer's
history). Causal everywhere but the decoder's transposed convolutions, which look one sample ahead.

Three rewrites of transformers' layers, each the same function up to rounding order:
- **No bias pass in the decoder**: a convolution's bias is carried as a pending per-channel vector
  into the next SnakeBeta, which adds it on the way in (the residual stream's true value is
  ``x + pending``).
- **Look-ahead as history**: a decoder transposed convolution's input is prefixed with the previous
  input sample instead of trimming ``rate`` samples from both ends, so ``T`` frames give
  ``T * rate`` outputs. At a request's start those first ``junk`` samples (``junk = (junk + 1) *
  rate``, ``tail`` at the output) stand for time before it: zeroed where they enter a causal
  convolution, cut from the output.
- **Dilation 1**: dilated convolutions run over a ``[B, C, T/d, d]`` view of the same memory; the
  SnakeBeta before them pads to whole rows of ``d`` (``multiple``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_lightning.models.state import Step


def _nhwc(x: torch.Tensor) -> torch.Tensor:
    """Time-major ``[B, T, C]`` as the channels-last ``[B, C, 1, T]`` view cuDNN takes."""
    return x.permute(0, 2, 1).unsqueeze(2)


def _time_major(y: torch.Tensor) -> torch.Tensor:
    return y.squeeze(2).permute(0, 2, 1)


class CausalConv1d(nn.Module):
    """Stride-1 convolution that sees ``context = (kernel - 1) * dilation`` samples of history and no
    future. It reads a buffer whose first ``context`` steps are that history (:meth:`Step.with_history`,
    or the SnakeBeta before it, which writes its output after the history)."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation
        self.state_name = ""  # set by Code2Wav: the key of its history in a DecodeState

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {self.state_name: (self.context, self.conv.in_channels)} if self.context else {}

    def forward(self, buf: torch.Tensor, length: int, bias: bool = True) -> torch.Tensor:
        """The valid convolution of ``buf [B, context + length (+ padding), C_in]``: ``[B, length, C_out]``."""
        conv, d = self.conv, self.conv.dilation[0]
        b = conv.bias if bias else None
        if d == 1:
            y = _time_major(F.conv2d(_nhwc(buf), conv.weight.unsqueeze(2), b, groups=conv.groups))
        else:  # step q*d + r is row q of column r: d steps apart are adjacent rows (see module docstring)
            batch, rows, channels = buf.shape
            grid = buf.view(batch, rows // d, d, channels).permute(0, 3, 1, 2)
            y = F.conv2d(grid, conv.weight.unsqueeze(3), b, groups=conv.groups)
            y = y.permute(0, 2, 3, 1).reshape(batch, -1, y.shape[1])
        return y[:, :length]


class CausalConvTranspose1d(nn.Module):
    """x``stride`` transposed convolution. With ``kernel == stride`` (the upsampler) every input sample
    makes its own outputs; with ``kernel == 2 * stride`` (the decoder blocks) each output also needs the
    next input sample, so the input is prefixed with the previous one (module docstring)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        if kernel_size not in (stride, 2 * stride):
            raise ValueError(
                f"a transposed convolution needs kernel == stride or 2 * stride, got {kernel_size}, stride {stride}"
            )
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.trim = kernel_size - stride
        self.context = 1 if self.trim else 0
        self.state_name = ""

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {self.state_name: (1, self.conv.in_channels)} if self.context else {}

    def forward(self, buf: torch.Tensor, step: Step, bias: bool = True) -> torch.Tensor:
        """``buf [B, context + T, C_in]`` to ``[B, T * stride, C_out]``, by the forward's kernels."""
        conv = self.conv
        y = step.kernels.conv_transpose(
            _nhwc(buf), conv.weight.unsqueeze(2), conv.bias if bias else None, (1, conv.stride[0]), (0, self.trim)
        )
        return _time_major(y)


class SnakeBeta(nn.Module):
    """``x + sin^2(x * e^alpha) / e^beta`` per channel (alpha and beta kept in log scale), computed by
    the forward's kernels (``kernels/snake_beta.py``), into the buffer of the convolution after it."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(
        self,
        x: torch.Tensor,
        step: Step,
        bias: torch.Tensor | None = None,
        before: CausalConv1d | CausalConvTranspose1d | None = None,
        junk: int = 0,
    ) -> torch.Tensor:
        """snake(x + bias), after ``before``'s history (the result is that layer's input; saved)."""
        context = before.context if before is not None else 0
        history = step.history(before.state_name) if context else None
        dilation = before.conv.dilation[0] if isinstance(before, CausalConv1d) else 1
        buf = step.kernels.snake_beta(
            x,
            self.alpha,
            self.beta,
            bias,
            context=history,
            context_len=context,
            fresh=step.fresh,
            junk=junk,
            multiple=dilation,
        )
        if context:
            step.save(before.state_name, buf, x.shape[1])
        return buf


def output_waveform(
    act: SnakeBeta, conv: CausalConv1d, x: torch.Tensor, pending: torch.Tensor, step: Step, junk: int
) -> torch.Tensor:
    """The decoder's last SnakeBeta and ``C -> 1`` convolution on the stream ``x`` (true value ``x + pending``),
    clamped to [-1, 1]: ``[B, 1, T]``; with a state, the first ``junk`` samples of fresh rows (time before
    the request) are zero. One kernel where the forward's kernels take it (``kernels/last_conv.py``)."""
    if step.kernels.takes_last_conv(x, conv.conv):
        history = step.history(conv.state_name)
        ends = step.window_ends(x.shape[1]) if step.state is not None else None
        wav, window = step.kernels.last_conv(x, act.alpha, act.beta, pending, conv.conv.weight, conv.conv.bias,
                                             history=history, fresh=step.fresh, junk=junk, window_end=ends)  # fmt: skip
        if window is not None:
            step.save_window(conv.state_name, window)
        return wav.unsqueeze(1)
    wav = conv(act(x, step, pending, before=conv, junk=junk), x.shape[1])
    wav = wav.clamp(-1.0, 1.0).transpose(1, 2)
    if step.state is not None:
        wav[..., :junk].masked_fill_(step.fresh.view(-1, 1, 1), 0.0)  # a fresh row's time before its start, in place
    return wav


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        h = self.dwconv(step.with_history(self.dwconv.state_name, self.dwconv.context, x), x.shape[1])
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + self.gamma * h


def _add_pointwise_(x: torch.Tensor, h: torch.Tensor, conv: CausalConv1d, step: Step) -> torch.Tensor:
    """``x + conv1x1(h)`` without the bias, one GEMM with the residual as its accumulator (in place in
    inference; autograd needs ``x`` kept)."""
    channels = x.shape[-1]
    # under autocast (bf16-mixed) the stream is in the autocast dtype and the weights are not: the
    # in-place GEMM is not autocast, so it takes the stream's dtype explicitly
    weight = conv.conv.weight.view(conv.conv.out_channels, -1).t().to(x.dtype)
    h = h.to(x.dtype)
    if step.kernels.inplace and x.is_contiguous():
        return x.view(-1, channels).addmm_(h.reshape(-1, h.shape[-1]), weight).view(x.shape)
    return torch.addmm(x.reshape(-1, channels), h.reshape(-1, h.shape[-1]), weight).view(x.shape)


class DecoderResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor, pending: torch.Tensor, step: Step, junk: int):
        """The unit on the stream ``x`` whose true value is ``x + pending``; returns both, updated."""
        a = self.act1(x, step, pending, before=self.conv1, junk=junk)
        conv1, act2 = self.conv1.conv, self.act2
        if step.kernels.fuses_conv_snake(a, conv1):  # the convolution's output never reaches memory
            h = step.kernels.conv_snake(
                a, conv1.weight, conv1.bias, act2.alpha, act2.beta, conv1.dilation[0], x.shape[1]
            )
        else:
            h = act2(self.conv1(a, x.shape[1], bias=False), step, conv1.bias)
        return _add_pointwise_(x, h, self.conv2, step), pending + self.conv2.conv.bias.float()


class DecoderBlock(nn.Module):
    """SnakeBeta, x``rate`` transposed conv halving the channels, three dilated residual units."""

    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
            + [DecoderResidualUnit(out_dim, dilation) for dilation in (1, 3, 9)]
        )
        self.junk = 0  # samples before time 0 at this block's output (set by Code2Wav)

    def forward(self, x: torch.Tensor, pending: torch.Tensor, step: Step):
        act, upsample, *units = self.block
        x = upsample(act(x, step, pending, before=upsample), step, bias=False)
        pending = upsample.conv.bias.float()
        for unit in units:
            x, pending = unit(x, pending, step, self.junk)
        return x, pending
