"""Reconstruction losses for fine-tuning Code2Wav (multi-resolution mel L1 and STFT), as ``nn.Module``s.

Every loss takes ``lengths`` (real samples per item) so right-padding never enters a loss: each
item is cut to its own length before its spectrogram is taken. Losses compute in fp32 whatever the
model's precision: their filterbanks and windows are built in fp32 even when they are first built
inside a ``precision="bf16-true"`` step (Lightning sets bf16 as the default dtype there), and inputs
are cast to fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn


@contextlib.contextmanager
def _fp32_default() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _items(pred: torch.Tensor, target: torch.Tensor, lengths: torch.Tensor | Sequence[int] | None):
    """(pred_i, target_i) cut to item i's real length; pred/target are [B, T] or [B, 1, T]."""
    pred, target = pred.reshape(pred.shape[0], -1), target.reshape(target.shape[0], -1)
    n = min(pred.shape[-1], target.shape[-1])
    lengths = [n] * pred.shape[0] if lengths is None else [min(int(x), n) for x in lengths]
    return [(pred[i, :m], target[i, :m]) for i, m in enumerate(lengths)]


class MultiResolutionMelLoss(nn.Module):
    """Mean over resolutions of L1 between log-mel spectrograms (torchaudio ``MelSpectrogram``)."""

    def __init__(
        self,
        sample_rate: int = 24000,
        n_ffts: Sequence[int] = (512, 1024, 2048),
        n_mels: Sequence[int] = (40, 80, 128),
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        import torchaudio

        with _fp32_default():
            self.mels = nn.ModuleList(
                torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=n, hop_length=n // 4, n_mels=m, power=1.0)
                for n, m in zip(n_ffts, n_mels)
            )
        self.eps = eps

    def forward(self, pred: torch.Tensor, target: torch.Tensor, lengths=None) -> torch.Tensor:
        losses = []
        for p, t in _items(pred, target, lengths):
            for mel in self.mels:
                pm, tm = mel(p.float()), mel(t.float())
                losses.append(F.l1_loss(torch.log(pm + self.eps), torch.log(tm + self.eps)))
        return torch.stack(losses).mean()


class MultiResolutionSTFTLoss(nn.Module):
    """Spectral convergence + log-magnitude L1, averaged over STFT resolutions."""

    def __init__(self, n_ffts: Sequence[int] = (512, 1024, 2048), eps: float = 1e-7) -> None:
        super().__init__()
        self.n_ffts = tuple(n_ffts)
        self.eps = eps
        for n in self.n_ffts:
            self.register_buffer(f"window_{n}", torch.hann_window(n, dtype=torch.float32), persistent=False)

    def magnitude(self, x: torch.Tensor, n_fft: int) -> torch.Tensor:
        window = getattr(self, f"window_{n_fft}")
        spec = torch.stft(x.float(), n_fft, hop_length=n_fft // 4, window=window, return_complex=True)
        return spec.abs().clamp_min(self.eps)

    def forward(self, pred: torch.Tensor, target: torch.Tensor, lengths=None) -> torch.Tensor:
        losses = []
        for p, t in _items(pred, target, lengths):
            for n in self.n_ffts:
                pm, tm = self.magnitude(p, n), self.magnitude(t, n)
                convergence = torch.linalg.norm(tm - pm) / torch.linalg.norm(tm).clamp_min(self.eps)
                losses.append(convergence + F.l1_loss(torch.log(pm), torch.log(tm)))
        return torch.stack(losses).mean()


class ReconstructionLoss(nn.Module):
    """The fine-tuning objective: ``mel_weight`` * mel L1 + ``stft_weight`` * STFT loss, as a dict
    ``{"loss", "mel", "stft"}`` (the parts for logging)."""

    def __init__(self, sample_rate: int = 24000, mel_weight: float = 1.0, stft_weight: float = 1.0) -> None:
        super().__init__()
        self.mel, self.stft = MultiResolutionMelLoss(sample_rate), MultiResolutionSTFTLoss()
        self.mel_weight, self.stft_weight = mel_weight, stft_weight

    def forward(self, pred: torch.Tensor, target: torch.Tensor, lengths=None) -> dict[str, torch.Tensor]:
        mel, stft = self.mel(pred, target, lengths), self.stft(pred, target, lengths)
        return {"loss": self.mel_weight * mel + self.stft_weight * stft, "mel": mel, "stft": stft}
