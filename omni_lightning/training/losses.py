"""Reconstruction losses for fine-tuning Code2Wav (multi-resolution mel L1 and STFT), as ``nn.Module``s.

One STFT per resolution for the whole batch (``training/spectrogram.py``), shared by the mel and STFT
terms of :class:`ReconstructionLoss`. Every loss takes ``lengths`` (real samples per item), so
right-padding never enters it, and each item weighs the same whatever its length (mean over items
of each item's mean over its frames). Losses compute in fp32 with autocast off, whatever the
model's precision (the mel filterbank's matmul too); their windows and filterbanks are built in fp32
even inside a bf16-true step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from omni_lightning.training.spectrogram import MultiResolutionSTFT, Spectrum

REDUCTIONS = ("mean", "none")


@contextlib.contextmanager
def _fp32_default() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _fp32(spectra: list[Spectrum]) -> contextlib.AbstractContextManager:
    """Autocast off on the spectra's device: a loss under bf16-mixed still computes in fp32."""
    return torch.autocast(spectra[0].pred.device.type, enabled=False)


def _reduce(per_resolution: list[torch.Tensor], reduction: str) -> torch.Tensor:
    """Per-item values of each resolution ``[B]`` to ``[B]`` (``"none"``) or their mean (``"mean"``)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    per_item = torch.stack(per_resolution).mean(0)
    return per_item if reduction == "none" else per_item.mean()


class MultiResolutionMelLoss(nn.Module):
    """Mean over resolutions of L1 between log-mel spectrograms (magnitude STFT, torchaudio's HTK
    filterbank: what ``torchaudio.transforms.MelSpectrogram(power=1.0)`` computes)."""

    def __init__(
        self,
        sample_rate: int = 24000,
        n_ffts: Sequence[int] = (512, 1024, 2048),
        n_mels: Sequence[int] = (40, 80, 128),
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        from omni_lightning.imports.torchaudio import import_torchaudio

        torchaudio = import_torchaudio()  # a broken install is one line naming the fix, not a traceback
        with _fp32_default():
            self.spectra = MultiResolutionSTFT(n_ffts)
            for n, m in zip(n_ffts, n_mels):
                fb = torchaudio.functional.melscale_fbanks(n // 2 + 1, 0.0, float(sample_rate // 2), m, sample_rate)
                self.register_buffer(f"filterbank_{n}", fb.T.contiguous(), persistent=False)
        self.eps = eps

    def item_losses(self, spectra: list[Spectrum]) -> list[torch.Tensor]:
        """Per resolution, each item's mean L1 between log-mels over its frames: ``[B]`` each."""
        out = []
        with _fp32(spectra):
            for n, s in zip(self.spectra.n_ffts, spectra):
                fb = getattr(self, f"filterbank_{n}")
                out.append(s.mean((torch.log(fb @ s.pred + self.eps) - torch.log(fb @ s.target + self.eps)).abs()))
        return out

    def forward(self, pred: torch.Tensor, target: torch.Tensor, lengths=None, reduction: str = "mean") -> torch.Tensor:
        return _reduce(self.item_losses(self.spectra(pred, target, lengths)), reduction)


class MultiResolutionSTFTLoss(nn.Module):
    """Spectral convergence + log-magnitude L1, averaged over STFT resolutions.

    The log magnitudes are of ``hypot(|X|, floor)``, ``floor`` being ``rel_floor`` times the item's
    largest target magnitude at that resolution (over its own frames; at least ``eps``). ``log|X|``'s
    gradient is ``1/|X|``: a bin passing near zero (frame 0 of a reflect-padded STFT is nearly real)
    took over whole steps, and where it lands is decided by rounding, so bf16 steps could raise the
    loss. The floor bounds a bin's gradient by ``1 / (2 floor)`` and leaves bins well above it
    unchanged. 1e-3 (-60 dB) is the range of a speech spectrum above its noise floor, and of what bf16
    (2^-9 relative rounding per sample) resolves: bins below it are noise in the target and rounding
    in a bf16 prediction."""

    def __init__(self, n_ffts: Sequence[int] = (512, 1024, 2048), eps: float = 1e-7, rel_floor: float = 1e-3) -> None:
        super().__init__()
        with _fp32_default():
            self.spectra = MultiResolutionSTFT(n_ffts)
        self.eps, self.rel_floor = eps, rel_floor

    def item_losses(self, spectra: list[Spectrum]) -> list[torch.Tensor]:
        """Per resolution, each item's spectral convergence plus mean log-magnitude L1: ``[B]`` each.
        Against a silent target (no bin above ``eps``: digital silence) the convergence, relative to
        the target's norm, is undefined and left out; the log-magnitude term (floored at ``eps``)
        still pulls towards it."""
        out = []
        with _fp32(spectra):
            for s in spectra:
                pm, tm = s.pred.clamp_min(self.eps), s.target.clamp_min(self.eps)
                audible = s.norm(tm - self.eps) > 0  # else pred's norm over 1e-7: a loss of millions
                convergence = torch.where(audible, s.norm(tm - pm) / s.norm(tm).clamp_min(self.eps), 0.0)
                floor = (self.rel_floor * s.peak(s.target)).clamp_min(self.eps)[:, None, None]
                log_ratio = torch.log(torch.hypot(s.pred, floor)) - torch.log(torch.hypot(s.target, floor))
                out.append(convergence + s.mean(log_ratio.abs()))
        return out

    def forward(self, pred: torch.Tensor, target: torch.Tensor, lengths=None, reduction: str = "mean") -> torch.Tensor:
        return _reduce(self.item_losses(self.spectra(pred, target, lengths)), reduction)


def waveform_l1(pred: torch.Tensor, target: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over items of each item's mean absolute sample difference over its real samples, in fp32."""
    pred, target = pred.reshape(pred.shape[0], -1), target.reshape(target.shape[0], -1)
    t = min(pred.shape[-1], target.shape[-1])
    with torch.autocast(pred.device.type, enabled=False):
        diff = (pred[:, :t].float() - target[:, :t].float()).abs()
        if lengths is None:
            return diff.mean()
        lengths = lengths.to(pred.device).clamp(1, t)
        real = torch.arange(t, device=pred.device)[None] < lengths[:, None]
        return ((diff * real).sum(1) / lengths).mean()


class ReconstructionLoss(nn.Module):
    """The fine-tuning objective: ``mel_weight`` * mel L1 + ``stft_weight`` * STFT loss + ``waveform_weight``
    * waveform L1, as a dict ``{"loss", "mel", "stft"}`` (the parts for logging; ``"waveform"`` too when its
    weight is not 0). One set of STFTs serves the spectral terms, which compare magnitudes only; the
    waveform term compares the samples, phases included."""

    def __init__(
        self, sample_rate: int = 24000, mel_weight: float = 1.0, stft_weight: float = 1.0, waveform_weight: float = 0.0
    ) -> None:
        super().__init__()
        self.mel, self.stft = MultiResolutionMelLoss(sample_rate), MultiResolutionSTFTLoss()
        self.mel_weight, self.stft_weight, self.waveform_weight = mel_weight, stft_weight, waveform_weight

    def forward(self, pred: torch.Tensor, target: torch.Tensor, lengths=None) -> dict[str, torch.Tensor]:
        spectra = self.mel.spectra(pred, target, lengths)
        mel, stft = _reduce(self.mel.item_losses(spectra), "mean"), _reduce(self.stft.item_losses(spectra), "mean")
        out = {"loss": self.mel_weight * mel + self.stft_weight * stft, "mel": mel, "stft": stft}
        if self.waveform_weight:
            out["waveform"] = waveform_l1(pred, target, lengths)
            out["loss"] = out["loss"] + self.waveform_weight * out["waveform"]
        return out
