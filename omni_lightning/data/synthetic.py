"""Synthetic data for the demo and tests (documented as such): random codes and, for paired data,
the audio a fixed "teacher" Code2Wav with other weights makes from them; a speech-like signal for the
perceptual metrics' tests and benchmark.

Random codes are not speech. What the pairs are good for is showing the machinery: fine-tuning a
student measurably moves its output toward the teacher's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from omni_lightning.models import Code2Wav, Code2WavConfig, randomize_weights, resolve_config


def make_demo_data(
    folder: str | Path,
    n_requests: int = 12,
    min_seconds: float = 1.0,
    max_seconds: float = 4.0,
    config: Code2WavConfig | str = "tiny",
    teacher: Code2Wav | None = None,
    seed: int = 0,
    name: str = "manifest.jsonl",
) -> Path:
    """Writes ``codes/<id>.npy`` (and ``audio/<id>.wav`` from ``teacher``) and a JSONL manifest."""
    import soundfile as sf

    config = resolve_config(config)
    folder = Path(folder)
    (folder / "codes").mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_requests):
        seconds = min_seconds + (max_seconds - min_seconds) * torch.rand((), generator=gen).item()
        frames = max(1, round(seconds * config.frame_rate))
        codes = torch.randint(0, config.codebook_size, (config.num_quantizers, frames), generator=gen)
        req_id = f"demo-{seed}-{i:03d}"
        np.save(folder / "codes" / f"{req_id}.npy", codes.numpy().astype(np.int64))
        row = {"id": req_id, "codes": f"codes/{req_id}.npy"}
        if teacher is not None:
            (folder / "audio").mkdir(exist_ok=True)
            with torch.inference_mode():
                wav = teacher(codes[None].to(next(teacher.parameters()).device))[0, 0].float().cpu()
            sf.write(folder / "audio" / f"{req_id}.wav", wav.numpy(), config.sample_rate, subtype="FLOAT")
            row["audio"] = f"audio/{req_id}.wav"
        rows.append(row)
    manifest = folder / name
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def make_teacher(config: Code2WavConfig | str = "tiny", seed: int = 1234) -> Code2Wav:
    """The fixed synthetic teacher: the same architecture with other random weights."""
    return randomize_weights(Code2Wav(config), seed=seed).eval()


def speech_like(seconds: float, sample_rate: int = 24000, seed: int = 0) -> torch.Tensor:
    """A speech-like test signal, float32 ``[n]`` at about -25 dB RMS: voiced syllables of 0.22 s (harmonics
    of a pitch gliding around 120 Hz, shaped by three formants that move from syllable to syllable),
    one syllable in five a fricative (high-passed noise). Not speech: what perceptual metrics need to
    behave as on speech (PESQ detects utterances in it, STOI finds its modulations). Numpy, one thread."""
    rng = np.random.default_rng(seed)
    n, syllable = round(seconds * sample_rate), 0.22
    count = max(1, math.ceil(seconds / syllable))
    t = np.arange(n) / sample_rate
    index = np.minimum((t / syllable).astype(np.int64), count - 1)
    frac = np.clip(t / syllable - index, 0, 1)  # position within the syllable
    f0 = 120 + 40 * np.sin(2 * math.pi * 0.7 * t) + rng.uniform(-20, 30, count)[index]
    phase = 2 * math.pi * np.cumsum(f0) / sample_rate
    formants = np.stack([rng.uniform(300, 800, count), rng.uniform(900, 2300, count), rng.uniform(2400, 3200, count)])
    following = np.minimum(index + 1, count - 1)
    tracks = formants[:, index] * (1 - frac) + formants[:, following] * frac  # [3, n], gliding
    voiced = (rng.uniform(0, 1, count) > 0.2)[index]
    wav = np.zeros(n)
    for k in range(1, int(0.45 * sample_rate / 90)):  # harmonics below ~0.45 of the sample rate
        resonance = sum(1 / (1 + ((k * f0 - tracks[i]) / (60 + 40 * i)) ** 2) for i in range(3))
        wav += resonance / k**0.7 * (k * f0 < 0.45 * sample_rate) * np.sin(k * phase)
    noise = rng.standard_normal(n)
    envelope = np.sin(math.pi * frac)
    wav = wav * np.sqrt(envelope) * voiced + 0.15 * (noise - np.roll(noise, 1)) * envelope * ~voiced
    return torch.from_numpy(0.3 * wav / np.abs(wav).max()).float()
