"""Multi-resolution magnitude spectrograms of a right-padded batch, each item as if cut to its own length.

One STFT per resolution covers the whole batch's predictions, and one its targets (no graph).
:func:`reflect_at_lengths` reflects each item at its own end, as ``torch.stft(center=True)`` would
pad the cut item, so no padded sample enters a frame; :class:`Spectrum` masks each item's frames to
the ``1 + length // hop`` its cut has. Against a per-item cut only float rounding differs
(``tests/test_losses.py``), except an item shorter than half the longest window: it is reflected
once and held at its edges, where ``torch.stft`` on the cut item raises. Everything runs in fp32
with autocast off (log-magnitudes of quiet bins need the precision).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


def reflect_index(lengths: torch.Tensor, t: int, pad: int) -> torch.Tensor:
    """``[B, t + 2 pad]`` indices into ``[B, t]`` rows: see :func:`reflect_at_lengths`."""
    last = (lengths.clamp(1, t) - 1)[:, None]
    index = torch.arange(-pad, t + pad, device=lengths.device).abs()[None]  # reflected at the start
    index = torch.where(index > last, 2 * last - index, index)  # ... and at each item's end
    return torch.minimum(index.clamp_min(0), last)


def reflect_at_lengths(x: torch.Tensor, lengths: torch.Tensor, pad: int) -> torch.Tensor:
    """``x [B, T]`` to ``[B, T + 2 pad]``: each item reflect-padded by ``pad`` at its start and at its
    own end ``lengths[i]`` (what ``F.pad(x[i, :n], (pad, pad), "reflect")`` gives, then anything)."""
    return x.gather(1, reflect_index(lengths, x.shape[-1], pad))


@dataclass
class Spectrum:
    """One resolution's magnitudes, fp32: ``pred`` and ``target`` ``[B, F, frames]``; ``mask``
    ``[B, frames]`` 1.0 on the frames an item's cut has; ``frames`` ``[B]`` their count."""

    pred: torch.Tensor
    target: torch.Tensor
    mask: torch.Tensor
    frames: torch.Tensor

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per item, the mean of ``values [B, C, frames]`` over its own frames: ``[B]``."""
        return (values.sum(1) * self.mask).sum(1) / (self.frames * values.shape[1])

    def peak(self, values: torch.Tensor) -> torch.Tensor:
        """Per item, the largest of ``values [B, C, frames]`` over its own frames: ``[B]``."""
        return torch.where(self.mask[:, None] > 0, values, float("-inf")).amax(dim=(1, 2))

    def norm(self, values: torch.Tensor) -> torch.Tensor:
        """Per item, the Frobenius norm of ``values [B, C, frames]`` over its own frames: ``[B]``."""
        return torch.linalg.vector_norm(torch.linalg.vector_norm(values, dim=1) * self.mask, dim=1)


class MultiResolutionSTFT(nn.Module):
    """Magnitude STFTs (Hann window, hop ``n_fft // 4``) of predictions and targets at several resolutions."""

    def __init__(self, n_ffts: Sequence[int] = (512, 1024, 2048)) -> None:
        super().__init__()
        self.n_ffts = tuple(n_ffts)
        for n in self.n_ffts:
            self.register_buffer(f"window_{n}", torch.hann_window(n, dtype=torch.float32), persistent=False)

    def forward(self, pred: torch.Tensor, target: torch.Tensor, lengths: torch.Tensor | None = None) -> list[Spectrum]:
        """``pred`` and ``target`` ``[B, T]`` or ``[B, 1, T]`` (cut to the shorter ``T``); ``lengths``
        real samples per item (None: all of ``T``), a tensor on their device."""
        pred, target = pred.reshape(pred.shape[0], -1), target.reshape(target.shape[0], -1)
        b, t = pred.shape[0], min(pred.shape[-1], target.shape[-1])
        if lengths is None:
            lengths = torch.full((b,), t, device=pred.device)
        lengths = lengths.to(pred.device).clamp(max=t)
        pad = max(self.n_ffts) // 2
        with torch.autocast(pred.device.type, enabled=False):
            index = reflect_index(lengths, t, pad)
            pred_signal = pred[:, :t].float().gather(1, index)
            with torch.no_grad():  # the targets need no graph: their FFTs get no backward
                target_signal = target[:, :t].float().gather(1, index)
            spectra = []
            for n in self.n_ffts:
                hop, window = n // 4, getattr(self, f"window_{n}")
                pm, tm = (
                    torch.stft(
                        x[:, pad - n // 2 : pad - n // 2 + t + n],
                        n,
                        hop,
                        window=window,
                        center=False,
                        return_complex=True,
                    ).abs()
                    for x in (pred_signal, target_signal)
                )
                mask = (torch.arange(pm.shape[-1], device=pm.device)[None] <= (lengths // hop)[:, None]).float()
                spectra.append(Spectrum(pm, tm, mask, mask.sum(1)))
        return spectra
