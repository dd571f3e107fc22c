"""Reading requests' files: code files (``.npy``, ``.pt``, ``.safetensors``) and audio (soundfile).

Every failure is a ``ValueError`` naming the file, never the reader's own exception type, so one bad
file is one recorded bad request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni_lightning.data.files import CODE_SUFFIXES


def load_codes_file(path: Path) -> torch.Tensor:
    """Reads one code file; raises ValueError (never anything else) when it cannot."""
    if path.suffix not in CODE_SUFFIXES:
        raise ValueError(f"codes file {path}: unsupported suffix {path.suffix!r} (use {', '.join(CODE_SUFFIXES)})")
    if not path.is_file():
        raise ValueError(f"codes file {path} does not exist")
    try:
        if path.suffix == ".npy":
            import numpy as np

            value: Any = np.load(path, allow_pickle=False)
        elif path.suffix == ".pt":
            value = torch.load(path, map_location="cpu", weights_only=True)
        else:
            from safetensors.torch import load_file

            value = load_file(str(path))
    except Exception as err:  # corrupt files raise anything from pickle, zip, numpy or safetensors
        raise ValueError(f"codes file {path} could not be read ({type(err).__name__}: {err})") from err
    if path.suffix == ".npy":
        value = _numpy_to_tensor(path, value)
    if isinstance(value, dict):  # safetensors: the tensor named 'codes', or the only one
        if "codes" not in value and len(value) != 1:
            raise ValueError(f"codes file {path} holds tensors {sorted(value)}; name one 'codes'")
        value = value.get("codes", next(iter(value.values()), None))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"codes file {path} holds a {type(value).__name__}, not a tensor")
    return value


def _numpy_to_tensor(path: Path, array: Any) -> torch.Tensor:
    import numpy as np

    if not isinstance(array, np.ndarray):
        raise ValueError(f"codes file {path} holds a {type(array).__name__}, not an array")
    if array.dtype.kind not in "biuf":  # strings, objects, records: nothing torch can hold
        raise ValueError(f"codes file {path} holds {array.dtype} values; codes must be integers")
    if not array.dtype.isnative:  # big-endian files: torch takes native byte order only
        array = array.astype(array.dtype.newbyteorder("="))
    return torch.from_numpy(np.ascontiguousarray(array))


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
