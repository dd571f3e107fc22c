"""Adversarial training parts: multi-period and multi-resolution STFT discriminators (plain
``nn.Module``s) and the LSGAN and feature-matching losses a LightningModule composes with them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _conv_stack(convs: nn.ModuleList, out: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Leaky-ReLU conv stack; the logits and every layer's feature map (for feature matching)."""
    features = []
    for conv in convs:
        h = F.leaky_relu(conv(h), 0.1)
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
        return _conv_stack(self.convs, self.out, x.view(b, 1, -1, self.period))


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
        spec = torch.stft(x[:, 0].float(), self.n_fft, self.n_fft // 4, window=self.window, return_complex=True)
        return _conv_stack(self.convs, self.out, torch.stack([spec.real, spec.imag], dim=1).transpose(2, 3))


class Discriminators(nn.Module):
    """Multi-period plus multi-resolution STFT discriminators."""

    def __init__(self, periods: Sequence[int] = (2, 3, 5, 7, 11), n_ffts: Sequence[int] = (512, 1024, 2048)) -> None:
        super().__init__()
        self.discriminators = nn.ModuleList(
            [PeriodDiscriminator(p) for p in periods] + [STFTDiscriminator(n) for n in n_ffts]
        )

    def forward(self, x: torch.Tensor) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        return [d(x) for d in self.discriminators]

    def discriminator_loss(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        """The discriminators' LSGAN loss on real and generated audio (no gradient to the generator)."""
        return discriminator_loss(self(real), self(fake.detach()))

    def generator_losses(self, real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The generator's adversarial and feature-matching losses on real and generated audio."""
        real_out, fake_out = self(real), self(fake)
        return generator_adversarial_loss(fake_out), feature_matching_loss(real_out, fake_out)


def discriminator_loss(real: list, fake: list) -> torch.Tensor:
    """Least-squares GAN: real logits toward 1, generated toward 0."""
    return sum(((1 - r) ** 2).mean() + (f**2).mean() for (r, _), (f, _) in zip(real, fake)) / len(real)


def generator_adversarial_loss(fake: list) -> torch.Tensor:
    return sum(((1 - f) ** 2).mean() for f, _ in fake) / len(fake)


def feature_matching_loss(real: list, fake: list) -> torch.Tensor:
    """L1 between the discriminators' feature maps on real and generated audio."""
    losses = [F.l1_loss(ff, rf.detach()) for (_, rfs), (_, ffs) in zip(real, fake) for rf, ff in zip(rfs, ffs)]
    return torch.stack(losses).mean()
