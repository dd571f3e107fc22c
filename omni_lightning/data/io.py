"""Reading requests' files: code files (``.npy``, ``.pt``, ``.safetensors``) and audio (soundfile).

Every failure is a ``ValueError`` naming the file, never the reader's own exception type, so one bad
file is one recorded bad request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CODE_SUFFIXES = (".npy", ".pt", ".safetensors")


def load_codes_file(path: Path) -> torch.Tensor:
    """Reads one code file; raises ValueError (never anything else) when it cannot."""
    if path.suffix not in CODE_SUFFIXES:
        raise ValueError(f"codes file {path}: unsupported suffix {path.suffix!r} (use {', '.join(CODE_SUFFIXES)})")
    if not path.is_file():
        raise ValueError(f"codes file {path} does not exist")
    try:
        if path.suffix == ".npy":
            import numpy as np

            value: Any = torch.from_numpy(np.array(np.load(path, allow_pickle=False)))
        elif path.suffix == ".pt":
            value = torch.load(path, map_location="cpu", weights_only=True)
        else:
            from safetensors.torch import load_file

            value = load_file(str(path))
    except Exception as err:  # corrupt files raise anything from pickle, zip, numpy or safetensors
        raise ValueError(f"codes file {path} could not be read ({type(err).__name__}: {err})") from err
    if isinstance(value, dict):  # safetensors: the tensor named 'codes', or the only one
        if "codes" not in value and len(value) != 1:
            raise ValueError(f"codes file {path} holds tensors {sorted(value)}; name one 'codes'")
        value = value.get("codes", next(iter(value.values()), None))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"codes file {path} holds a {type(value).__name__}, not a tensor")
    return value


def check_audio(path: Path) -> None:
    """Header check only: the scan must not read every waveform."""
    import soundfile as sf

    if not path.is_file():
        raise ValueError(f"audio file {path} does not exist")
    try:
        info = sf.info(str(path))
    except Exception as err:
        raise ValueError(f"audio file {path} could not be read ({type(err).__name__}: {err})") from err
    if info.frames == 0:
        raise ValueError(f"audio file {path} is empty")


def load_audio(path: Path, sample_rate: int) -> torch.Tensor:
    """Mono float32 at ``sample_rate``."""
    import soundfile as sf

    if not path.is_file():
        raise ValueError(f"audio file {path} does not exist")
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as err:
        raise ValueError(f"audio file {path} could not be read ({type(err).__name__}: {err})") from err
    audio = torch.from_numpy(data).mean(dim=1)
    if sr != sample_rate:
        import torchaudio

        audio = torchaudio.functional.resample(audio, sr, sample_rate)
    return audio
