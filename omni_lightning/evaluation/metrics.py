"""Evaluation metrics against reference audio, correct under DDP (torchmetrics sum states).

Per request, on its real samples only: mel L1 distance (log-mel, multi-resolution), multi-resolution
STFT distance (spectral convergence + log magnitude), SI-SDR and SNR (torchmetrics' functional
implementations). The run-level values are means over requests, reduced across ranks, plus the
request count, audio seconds and audio seconds per wall-clock second since the last ``reset``.
"""

from __future__ import annotations

import time

import torch
from torchmetrics import Metric
from torchmetrics.functional.audio import scale_invariant_signal_distortion_ratio, signal_noise_ratio

from omni_lightning.training.losses import MultiResolutionMelLoss, MultiResolutionSTFTLoss

NAMES = ("mel_distance", "stft_distance", "si_sdr", "snr")


def request_metrics(
    pred: torch.Tensor, target: torch.Tensor, mel: MultiResolutionMelLoss, stft: MultiResolutionSTFTLoss
) -> dict[str, torch.Tensor]:
    """All four metrics of one request; ``pred``/``target`` are 1-D and already cut to its length."""
    p, t = pred.float(), target.float()
    return {
        "mel_distance": mel(p[None], t[None]),
        "stft_distance": stft(p[None], t[None]),
        "si_sdr": scale_invariant_signal_distortion_ratio(p, t),
        "snr": signal_noise_ratio(p, t),
    }


class AudioMetrics(Metric):
    """Means over requests of :data:`NAMES`, plus ``requests``, ``audio_s`` and ``audio_s_per_s``
    (summed over ranks, over rank 0's wall-clock time since ``reset``)."""

    full_state_update = False

    def __init__(self, sample_rate: int = 24000) -> None:
        super().__init__()
        self.sample_rate = sample_rate
        self.mel = MultiResolutionMelLoss(sample_rate)
        self.stft = MultiResolutionSTFTLoss()
        for name in NAMES:
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("requests", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("audio_s", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self._t0 = time.perf_counter()

    def reset(self) -> None:
        super().reset()
        self._t0 = time.perf_counter()

    def update(self, pred: torch.Tensor, target: torch.Tensor, lengths: torch.Tensor) -> None:
        """``pred`` [B, 1, T] or [B, T], ``target`` [B, N], ``lengths`` real samples per request."""
        pred, target = pred.reshape(pred.shape[0], -1), target.reshape(target.shape[0], -1)
        for i, n in enumerate(lengths.tolist()):
            n = min(n, pred.shape[-1], target.shape[-1])
            values = request_metrics(pred[i, :n], target[i, :n], self.mel, self.stft)
            for name, value in values.items():
                setattr(self, name, getattr(self, name) + value.double())
            self.requests += 1
            self.audio_s += n / self.sample_rate

    def compute(self) -> dict[str, torch.Tensor]:
        count = self.requests.clamp_min(1).double()
        out = {name: getattr(self, name) / count for name in NAMES}
        out["requests"] = self.requests.double()
        out["audio_s"] = self.audio_s
        out["audio_s_per_s"] = self.audio_s / max(time.perf_counter() - self._t0, 1e-9)
        return out
