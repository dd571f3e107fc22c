"""Synthetic data for the demo and tests (documented as such): random codes and, for paired data,
the audio a fixed "teacher" Code2Wav with other weights makes from them.

Random codes are not speech. What the pairs are good for is showing the machinery: fine-tuning a
student measurably moves its output toward the teacher's.
"""

from __future__ import annotations

import json
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
