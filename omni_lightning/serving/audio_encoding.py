"""Audio as a response's bytes: WAV (its header first, with the length known from the codes, so it can be
sent before the first sample), raw PCM, and FLAC (soundfile, whole responses only).

Samples are the engine's float32 as they are (``FLOAT``, the default: what ``decode`` gives, bit for bit),
or 16-bit PCM (``PCM_16``, clipped to [-1, 1]). Not done: FLAC streamed as it is decoded (soundfile
encodes a whole file; a FLAC request with ``stream=true`` is refused with a 400), MP3 or Opus.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import torch

FORMATS = ("wav", "flac", "pcm")
SUBTYPES = ("FLOAT", "PCM_16")
MEDIA_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "pcm": "application/octet-stream"}
PCM_NAMES = {"FLOAT": "f32le", "PCM_16": "s16le"}  # the X-Sample-Format header of raw PCM


def sample_bytes(samples: torch.Tensor, subtype: str) -> bytes:
    """``samples [1, m]`` (float) as little-endian ``subtype`` bytes."""
    values = samples.detach().reshape(-1).float().cpu().numpy()
    if subtype == "PCM_16":
        return (np.clip(values, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()
    return values.astype("<f4", copy=False).tobytes()


def wav_header(n_samples: int, sample_rate: int, subtype: str) -> bytes:
    """The header of a mono WAV file of ``n_samples`` samples (float: IEEE format 3 with its fact chunk)."""
    floating = subtype == "FLOAT"
    width = 4 if floating else 2
    data = n_samples * width
    fmt = struct.pack("<HHIIHH", 3 if floating else 1, 1, sample_rate, sample_rate * width, width, width * 8)
    if floating:  # a non-PCM format: cbSize 0, and the fact chunk with the sample count
        fmt += struct.pack("<H", 0)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    if floating:
        chunks += b"fact" + struct.pack("<II", 4, n_samples)
    riff = struct.pack("<I", 4 + len(chunks) + 8 + data)
    return b"RIFF" + riff + b"WAVE" + chunks + b"data" + struct.pack("<I", data)


def flac_bytes(samples: torch.Tensor, sample_rate: int, subtype: str) -> bytes:
    """A whole FLAC file of ``samples [1, m]`` (16-bit: FLAC holds no floats)."""
    import soundfile

    out = io.BytesIO()
    values = samples.detach().reshape(-1).float().cpu().numpy()
    soundfile.write(out, np.clip(values, -1.0, 1.0), sample_rate, format="FLAC", subtype="PCM_16")
    return out.getvalue()


def check_output(audio_format: str, subtype: str, stream: bool) -> str | None:
    """The one-line problem with a response's ``format``, ``subtype`` and ``stream``, or None."""
    if audio_format not in FORMATS:
        return f"format {audio_format!r} is not one of {', '.join(FORMATS)}"
    if subtype not in SUBTYPES:
        return f"subtype {subtype!r} is not one of {', '.join(SUBTYPES)}"
    if audio_format == "flac" and stream:
        return "format 'flac' is not streamed (a FLAC file is encoded whole): use wav or pcm with stream=true"
    return None
