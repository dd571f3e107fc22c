"""Adversarial training parts: multi-period and multi-resolution STFT discriminators (plain
``nn.Module``s) and the LSGAN and feature-matching losses a LightningModule composes with them.

The discriminators' weights take the module's dtype (bf16-true converts them; the mixed precisions
keep fp32 and autocast). The STFT discriminator takes its FFT in fp32 and hands its convolutions
their weights' dtype. 2-D convolutions run channels-last (NHWC), cuDNN's layout for bf16 and fp16:
weights converted once, spectrograms built in that layout. Real and generated audio share one pass
where both need the same gradients (no layer mixes items, so that is exact); the losses loop over
discriminators and layers, never over items.

At speed: the first convolutions' one or two input channels are zero-padded to
:data:`INPUT_CHANNELS` (input and weight: exact), as cuDNN's tensor-core NHWC convolutions take 16-byte
channel rows and ran one or two channels on a direct fallback engine; each hidden convolution's bias
and leaky ReLU are one pass (``kernels/bias_leaky_relu.py``, on CUDA with Triton), not torch's
broadcast bias add and then the activation. Weight norm is computed once per pass: the discriminators'
own pass scores real and generated audio together, and the generator's pass caches it for both
(``parametrize.cached``); the weights change between the two (the discriminators' step), so once per
step is not possible. Not done: CUDA graphs of the discriminators (the GAN's memory is at its limit, and
a graph pool would hold a second copy of their activations).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omni_lightning.kernels import triton_available
from omni_lightning.kernels.bias_leaky_relu import bias_leaky_relu_reference, bias_leaky_relu_triton

INPUT_CHANNELS = 8  # the first convolutions' input channels, zero-padded (16 bytes in bf16: tensor cores)
SLOPE = 0.1  # the leaky ReLU's


def _conv_stack(convs: nn.ModuleList, out: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Leaky-ReLU conv stack on channels-last ``h``; the logits and every layer's feature map (for feature
    matching). The first convolution's input channels padded to :data:`INPUT_CHANNELS` (module docstring)."""
    fused = h.is_cuda and triton_available()
    features = []
    for i, conv in enumerate(convs):
        weight = conv.weight
        if i == 0 and h.shape[1] < INPUT_CHANNELS:
            pad = INPUT_CHANNELS - h.shape[1]  # NHWC memory [B, H, W, C] padded along C, then viewed as NCHW
            h = F.pad(h.permute(0, 2, 3, 1), (0, pad)).permute(0, 3, 1, 2)
            weight = F.pad(weight, (0, 0, 0, 0, 0, pad)).contiguous(memory_format=torch.channels_last)
        h = F.conv2d(h, weight, None, conv.stride, conv.padding)
        h = bias_leaky_relu_triton(h, conv.bias, SLOPE) if fused else bias_leaky_relu_reference(h, conv.bias, SLOPE)
        features.append(h)
    h = out(h)
    features.append(h)
    return h.flatten(1), features


class PeriodDiscriminator(nn.Module):
    """Looks at the waveform folded into [T / period, period] (HiFi-GAN's MPD, one period)."""

    def __init__(self, period: int, channels: Sequence[int] = (32, 64, 128)) -> None:
        super().__init__()
        self.period = period
        dims = [1, *channels]
        self.convs = nn.ModuleList(
            nn.utils.parametrizations.weight_norm(nn.Conv2d(a, b, (5, 1), (3, 1), padding=(2, 0)))
            for a, b in zip(dims[:-1], dims[1:])
        )
        self.out = nn.utils.parametrizations.weight_norm(nn.Conv2d(dims[-1], 1, (3, 1), padding=(1, 0)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        b, _, t = x.shape
        x = F.pad(x, (0, (-t) % self.period), mode="reflect" if t > self.period else "constant")
        # [B, 1, T / period, period] with channels-last strides (a view): one channel fits either
        # layout, and with contiguous strides the convolutions would pick channels-first
        return _conv_stack(self.convs, self.out, x.view(b, -1, self.period, 1).permute(0, 3, 1, 2))


class STFTDiscriminator(nn.Module):
    """Looks at one resolution's complex spectrogram (real and imaginary parts as channels)."""

    def __init__(self, n_fft: int, channels: int = 32) -> None:
        super().__init__()
        self.n_fft = n_fft
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        wn = nn.utils.parametrizations.weight_norm
        self.convs = nn.ModuleList(
            [wn(nn.Conv2d(2, channels, (3, 9), padding=(1, 4)))]
            + [wn(nn.Conv2d(channels, channels, (3, 9), (1, 2), padding=(1, 4))) for _ in range(3)]
        )
        self.out = wn(nn.Conv2d(channels, 1, (3, 3), padding=(1, 1)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.autocast(x.device.type, enabled=False):
            window = self.window.float()  # a buffer: bf16-true rounds it with the weights
            spec = torch.stft(x[:, 0].float(), self.n_fft, self.n_fft // 4, window=window, return_complex=True)
        # [B, 2, frames, bins], channels-last (one copy), in the weights' dtype: under bf16-true
        # nothing else would cast an fp32 spectrogram for them
        spec = spec.transpose(1, 2)
        spec = torch.stack([spec.real, spec.imag], dim=-1).permute(0, 3, 1, 2).to(self.out.bias.dtype)
        return _conv_stack(self.convs, self.out, spec)


class Discriminators(nn.Module):
    """Multi-period plus multi-resolution STFT discriminators."""

    def __init__(self, periods: Sequence[int] = (2, 3, 5, 7, 11), n_ffts: Sequence[int] = (512, 1024, 2048)) -> None:
        super().__init__()
        self.discriminators = nn.ModuleList(
            [PeriodDiscriminator(p) for p in periods] + [STFTDiscriminator(n) for n in n_ffts]
        )
        self.to(memory_format=torch.channels_last)  # the 4-D weights (weight norm's direction and scale)

    @property
    def min_samples(self) -> int:
        """The shortest input they take: the longest STFT's centre padding must be shorter than it."""
        return max([d.n_fft // 2 + 1 for d in self.discriminators if isinstance(d, STFTDiscriminator)] + [1])

    def forward(self, x: torch.Tensor) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        return [d(x) for d in self.discriminators]

    def discriminator_loss(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        """The discriminators' LSGAN loss on real and generated audio (no gradient to the generator),
        both in one pass."""
        b = real.shape[0]
        logits = [out for out, _ in self(torch.cat([real, fake.detach().to(real.dtype)]))]
        return discriminator_loss([x[:b] for x in logits], [x[b:] for x in logits])

    def generator_losses(self, real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The generator's adversarial and feature-matching losses on real and generated audio.

        The real pass only gives feature-matching targets, so it records no graph; the weight-normed
        weights are computed once for both passes (``parametrize.cached``)."""
        with torch.nn.utils.parametrize.cached():
            fake_out = self(fake)
            with torch.no_grad():
                real_out = self(real)
        adversarial = generator_adversarial_loss([out for out, _ in fake_out])
        return adversarial, feature_matching_loss([f for _, f in real_out], [f for _, f in fake_out])


def discriminator_loss(real: list[torch.Tensor], fake: list[torch.Tensor]) -> torch.Tensor:
    """Least-squares GAN over discriminators' logits: real toward 1, generated toward 0."""
    return sum(((1 - r) ** 2).mean() + (f**2).mean() for r, f in zip(real, fake)) / len(real)


def generator_adversarial_loss(fake: list[torch.Tensor]) -> torch.Tensor:
    """Least-squares GAN for the generator: its logits toward 1."""
    return sum(((1 - f) ** 2).mean() for f in fake) / len(fake)


def feature_matching_loss(real: list[list[torch.Tensor]], fake: list[list[torch.Tensor]]) -> torch.Tensor:
    """L1 between the discriminators' feature maps (one list per discriminator) on real and generated audio."""
    losses = [F.l1_loss(ff, rf.detach()) for rfs, ffs in zip(real, fake) for rf, ff in zip(rfs, ffs)]
    return torch.stack(losses).mean()
