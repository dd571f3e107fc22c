"""Evaluation metrics against reference audio, correct under DDP (torchmetrics sum states).

Per request, on its real samples only: mel L1 distance (multi-resolution log-mel), multi-resolution
STFT distance (spectral convergence + log magnitude), SI-SDR and SNR (torchmetrics' functional ones,
without zero-mean). Run-level values are means over requests reduced across ranks, plus the request
count, audio seconds and audio seconds per wall-clock second; with no request scored the means are
NaN, not 0, so a checkpoint monitor never picks an epoch that scored nothing. The module's
reconstruction losses are accumulated here too and reduced at epoch end, so a rank with no batch to
score still joins the reduction.

A batch is scored on the device with no host sync: spectral distances through the losses' batched
path (``training/spectrogram.py``), SI-SDR and SNR with samples past each item's length zeroed in
both signals (the same values as cutting each request).

``QualityMetrics`` holds the sums and counts of the perceptual scores (PESQ, STOI) that
``evaluation/quality.py`` gathers from its worker processes, reduced the same way.
"""

from __future__ import annotations

import math
import time

import torch
from torchmetrics import Metric
from torchmetrics.functional.audio import scale_invariant_signal_distortion_ratio, signal_noise_ratio

from omni_lightning.training.losses import MultiResolutionMelLoss, MultiResolutionSTFTLoss

NAMES = ("mel_distance", "stft_distance", "si_sdr", "snr")
# what a vocoder is judged by: magnitudes and perceptual scores, blind to phase as a listener mostly is
HEARD = ("mel_distance", "stft_distance", "pesq", "stoi", "estoi")
WAVEFORM = ("si_sdr", "snr")  # sample-exact matches: a vocoder's phase is free, so they can fall as the audio improves
LOSSES = ("loss", "mel", "stft")  # the module's reconstruction losses (training/losses.py), batch means


def metrics_line(metrics: dict[str, float]) -> str:
    """A validate or test run's metrics as one line: first the ones that track what a listener hears
    (:data:`HEARD`, each with its ``_unscored`` count), then the rest by name, then SI-SDR and SNR
    apart, named as waveform measures (docs/evaluation.md#what-the-metrics-mean-for-a-vocoder).
    Nothing is left out: the loggers and ``trainer.validate``'s return hold the same values."""

    def place(key: str) -> tuple[int, str]:
        name = key.rsplit("/", 1)[-1].removesuffix("_unscored")
        return (HEARD.index(name), key) if name in HEARD else (len(HEARD), key)

    def listed(keys: list[str]) -> str:
        return ", ".join(f"{k}={metrics[k]:.4g}" for k in keys)

    waveform = sorted(k for k in metrics if k.rsplit("/", 1)[-1] in WAVEFORM)
    line = listed(sorted((k for k in metrics if k not in waveform), key=place))
    return line + (f"; waveform match (phase-sensitive): {listed(waveform)}" if waveform else "")


def batch_metrics(
    pred: torch.Tensor,
    target: torch.Tensor,
    lengths: torch.Tensor | None,
    mel: MultiResolutionMelLoss,
    stft: MultiResolutionSTFTLoss,
) -> dict[str, torch.Tensor]:
    """All four metrics of each request, ``[B]`` each: ``pred`` ``[B, 1, T]`` or ``[B, T]``, ``target``
    ``[B, N]``, ``lengths`` real samples per request (None: all). SI-SDR and SNR against a silent
    reference (every real sample 0) are undefined: NaN."""
    pred, target = pred.reshape(pred.shape[0], -1).float(), target.reshape(target.shape[0], -1).float()
    n = min(pred.shape[-1], target.shape[-1])
    pred, target = pred[:, :n], target[:, :n]
    if lengths is not None:
        real = torch.arange(n, device=pred.device)[None] < lengths.to(pred.device)[:, None]
        pred, target = pred * real, target * real
    spectra = mel.spectra(pred, target, lengths)
    silent = target.abs().amax(-1) == 0  # else eps over pred's energy: -90 dB that swamps the mean
    nan = torch.tensor(float("nan"), device=pred.device)
    return {
        "mel_distance": torch.stack(mel.item_losses(spectra)).mean(0),
        "stft_distance": torch.stack(stft.item_losses(spectra)).mean(0),
        "si_sdr": torch.where(silent, nan, scale_invariant_signal_distortion_ratio(pred, target)),
        "snr": torch.where(silent, nan, signal_noise_ratio(pred, target)),
    }


def request_metrics(
    pred: torch.Tensor, target: torch.Tensor, mel: MultiResolutionMelLoss, stft: MultiResolutionSTFTLoss
) -> dict[str, torch.Tensor]:
    """All four metrics of one request; ``pred``/``target`` are 1-D and already cut to its length."""
    return {name: value[0] for name, value in batch_metrics(pred[None], target[None], None, mel, stft).items()}


class AudioMetrics(Metric):
    """Means over requests of :data:`NAMES` (SI-SDR and SNR over those whose reference is not
    silent), plus ``requests``, ``audio_s`` and ``audio_s_per_s`` (summed over ranks, over rank 0's
    wall-clock time since ``reset``)."""

    full_state_update = False

    def __init__(self, sample_rate: int = 24000) -> None:
        super().__init__()
        self.sample_rate = sample_rate
        self.mel = MultiResolutionMelLoss(sample_rate)
        self.stft = MultiResolutionSTFTLoss()
        for name in NAMES:
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        for name in LOSSES:
            self.add_state(f"sum_{name}", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("requests", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("audible", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")  # scored by SI-SDR, SNR
        self.add_state("loss_requests", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("audio_s", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self._t0 = time.perf_counter()

    def reset(self) -> None:
        super().reset()
        self._t0 = time.perf_counter()

    def update(
        self,
        pred: torch.Tensor,
        target: torch.Tensor,
        lengths: torch.Tensor,
        losses: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``pred`` [B, 1, T] or [B, T], ``target`` [B, N], ``lengths`` real samples per request;
        ``losses``: the batch's mean reconstruction losses (:data:`LOSSES`), if any."""
        lengths = lengths.to(pred.device).clamp(max=min(pred.shape[-1], target.shape[-1]))
        for name, value in (losses or {}).items():
            if name in LOSSES:
                setattr(self, f"sum_{name}", getattr(self, f"sum_{name}") + value.detach().double() * lengths.numel())
        if losses:
            self.loss_requests += lengths.numel()
        n = min(pred.shape[-1], target.shape[-1])
        audible = (target[:, :n].ne(0) & (torch.arange(n, device=lengths.device)[None] < lengths[:, None])).any(-1)
        for name, values in batch_metrics(pred, target, lengths, self.mel, self.stft).items():
            values = values.where(audible, 0.0) if name in ("si_sdr", "snr") else values  # NaN when silent
            setattr(self, name, getattr(self, name) + values.double().sum())
        self.requests += lengths.numel()
        self.audible += audible.sum()
        self.audio_s += lengths.sum().double() / self.sample_rate

    def compute(self) -> dict[str, torch.Tensor]:
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=self.requests.device)
        counts = {name: self.audible if name in ("si_sdr", "snr") else self.requests for name in NAMES}
        out = {name: getattr(self, name) / counts[name].double() if counts[name] else nan for name in NAMES}
        if self.loss_requests:  # every rank has the same states here: they were reduced
            out.update({name: getattr(self, f"sum_{name}") / self.loss_requests.double() for name in LOSSES})
        out["requests"] = self.requests.double()
        out["audio_s"] = self.audio_s
        out["audio_s_per_s"] = self.audio_s / max(time.perf_counter() - self._t0, 1e-9)
        return out


class QualityMetrics(Metric):
    """Means over requests of each metric of ``names``, over the requests it scored (``<name>_unscored``
    counts the others), reduced across ranks as sums and counts; ``quality_s``, the CPU seconds the
    workers spent scoring (summed over requests and ranks), and ``quality_wait_s``, how long the run waited for
    scores after its last batch (the slowest rank's)."""

    full_state_update = False

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = tuple(names)
        for name in self.names:
            self.add_state(f"sum_{name}", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
            self.add_state(f"scored_{name}", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("requests", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("seconds", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("wait_s", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, scores: list[dict[str, float]], seconds: float = 0.0, wait_s: float = 0.0) -> None:
        """``scores``: one ``{name: value}`` per request (NaN: not scored); ``seconds`` spent scoring them;
        ``wait_s`` waited for them."""
        device = self.requests.device
        for name in self.names:
            values = torch.tensor([s[name] for s in scores], dtype=torch.float64, device=device)
            scored = values.isfinite()
            setattr(self, f"sum_{name}", getattr(self, f"sum_{name}") + values[scored].sum())
            setattr(self, f"scored_{name}", getattr(self, f"scored_{name}") + scored.sum())
        self.requests += len(scores)
        self.seconds += seconds
        self.wait_s = torch.maximum(self.wait_s, torch.tensor(wait_s, dtype=torch.float64, device=device))

    def compute(self) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.names:
            total, scored = getattr(self, f"sum_{name}"), getattr(self, f"scored_{name}")
            out[name] = total / scored.double() if scored else torch.tensor(math.nan, dtype=torch.float64)
            out[f"{name}_unscored"] = (self.requests - scored).double()
        return {**out, "quality_s": self.seconds, "quality_wait_s": self.wait_s}
