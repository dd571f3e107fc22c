"""Reading requests' data: code files (``.npy``, ``.pt``, ``.safetensors``), audio files (soundfile),
and codes and audio held in memory (tensors or NumPy arrays).

Every failure is a ``ValueError`` naming the file or the request, never the reader's own exception
type, so one bad request is one recorded failure. :func:`codes_file_layout` reads only a file's
header (shape and dtype), so a job's requests can be sized and sorted without reading their codes twice.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from omni_lightning.data.files import CODE_SUFFIXES, torch_save_format


def load_codes_file(path: Path) -> torch.Tensor:
    """Reads one code file; raises ValueError (never anything else) when it cannot."""
    if path.suffix not in CODE_SUFFIXES:
        raise ValueError(f"codes file {path}: unsupported suffix {path.suffix!r} (use {', '.join(CODE_SUFFIXES)})")
    require_file(path, "codes")
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
        if path.suffix == ".pt" and torch_save_format(path) is None:
            raise ValueError(f"codes file {path} is not a file torch.save wrote (corrupt, or another format)") from err
        if type(err).__name__ == "UnpicklingError" and "Weights only load failed" in str(err):
            raise ValueError(
                f"codes file {path} holds objects other than tensors (a numpy array saved with "
                "torch.save?): save a torch tensor, or the array as .npy"
            ) from err
        raise ValueError(f"codes file {path} could not be read ({type(err).__name__}: {err})") from err
    if path.suffix == ".npy":
        value = numpy_to_tensor(value, f"codes file {path}")
    return _codes_tensor(value, f"codes file {path}")


def load_codes_bytes(data: bytes, suffix: str, where: str) -> torch.Tensor:
    """Reads the bytes of a ``.npy`` or ``.safetensors`` code file (a request body; no pickle: no ``.pt``);
    raises ValueError starting with ``where`` (never anything else) when it cannot."""
    if suffix not in (".npy", ".safetensors"):
        raise ValueError(f"{where}: unsupported format {suffix!r} (use .npy or .safetensors)")
    try:
        if suffix == ".npy":
            import io

            import numpy as np

            value: Any = numpy_to_tensor(np.load(io.BytesIO(data), allow_pickle=False), where)
        else:
            from safetensors.torch import load

            value = load(data)
    except ValueError as err:
        said = str(err) if where in str(err) else f"{where} could not be read as {suffix} ({err})"
        raise ValueError(said) from err
    except Exception as err:  # corrupt bytes raise anything from numpy or safetensors
        raise ValueError(f"{where} could not be read as {suffix} ({type(err).__name__}: {err})") from err
    return _codes_tensor(value, where)


def _codes_tensor(value: Any, where: str) -> torch.Tensor:
    """A code file's tensor: safetensors' tensor named 'codes' (or its only one); ValueError for anything else."""
    if isinstance(value, dict):
        if "codes" not in value and len(value) != 1:
            raise ValueError(f"{where} holds tensors {sorted(value)}; name one 'codes'")
        value = value.get("codes", next(iter(value.values()), None))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} holds a {type(value).__name__}, not a tensor")
    return value


def require_file(path: Path, what: str) -> None:
    """ValueError naming ``path`` unless it is a file (``what``: "codes" or "audio")."""
    if not path.is_file():
        raise ValueError(f"{what} file {path} {'is a folder, not a file' if path.is_dir() else 'does not exist'}")


def numpy_to_tensor(array: Any, where: str) -> torch.Tensor:
    """A NumPy array as a tensor sharing its memory (native byte order); ValueError starting with
    ``where`` for values torch cannot hold (strings, objects, records)."""
    import numpy as np

    if not isinstance(array, np.ndarray):
        raise ValueError(f"{where} holds a {type(array).__name__}, not an array")
    _check_numpy_dtype(where, array.dtype)
    if not array.dtype.isnative:  # big-endian files: torch takes native byte order only
        array = array.astype(array.dtype.newbyteorder("="))
    return torch.from_numpy(np.ascontiguousarray(array))


def in_memory(value: Any, where: str) -> Any:
    """``value`` as a tensor when it is a NumPy array, else unchanged (the checks name other types)."""
    numpy = sys.modules.get("numpy")
    return numpy_to_tensor(value, where) if numpy is not None and isinstance(value, numpy.ndarray) else value


def _check_numpy_dtype(where: Any, dtype: Any) -> None:
    if dtype.kind not in "biuf":  # strings, objects, records: nothing torch can hold
        raise ValueError(f"{where} holds {dtype} values; codes must be integers")


# safetensors' header dtype names
_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


def codes_file_layout(path: Path) -> torch.Tensor | None:
    """An empty tensor on the meta device with the shape and dtype of a code file, read from its
    header only (``.npy``, ``.safetensors``); None for ``.pt`` (a pickle: only a full read tells).
    ValueError naming the file when the header cannot be read."""
    if path.suffix not in (".npy", ".safetensors"):
        return None
    require_file(path, "codes")
    try:
        header = _npy_header(path) if path.suffix == ".npy" else _safetensors_header(path)
    except Exception as err:  # a corrupt header raises anything from numpy, json or a short read
        raise ValueError(f"codes file {path} could not be read ({type(err).__name__}: {err})") from err
    if path.suffix == ".npy":
        import numpy as np

        shape, dtype = header
        _check_numpy_dtype(f"codes file {path}", dtype)
        torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype
    else:
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        if "codes" not in tensors and len(tensors) != 1:
            raise ValueError(f"codes file {path} holds tensors {sorted(tensors)}; name one 'codes'")
        info = tensors.get("codes") or next(iter(tensors.values()))
        shape, torch_dtype = tuple(info["shape"]), _SAFETENSORS_DTYPES.get(info["dtype"])
        if torch_dtype is None:
            raise ValueError(f"codes file {path} holds {info['dtype']} values; codes must be integers")
    return torch.empty(shape, dtype=torch_dtype, device="meta")


def _npy_header(path: Path) -> tuple[tuple[int, ...], Any]:
    import numpy as np

    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
    return shape, dtype


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size + 8 > path.stat().st_size:  # not a safetensors file (a huge read, or a MemoryError)
            raise ValueError(f"its header length {size} runs past the file's {path.stat().st_size} bytes")
        header = json.loads(f.read(size))
    for name, info in header.items():  # the shape of every entry is checked here, inside the caller's try
        if name != "__metadata__" and not (isinstance(info["shape"], list) and isinstance(info["dtype"], str)):
            raise ValueError(f"tensor {name!r} has no valid shape and dtype")
    return header


def check_audio(path: Path, values: bool = False) -> tuple[float, float | None]:
    """Its duration in seconds from the header, and with ``values`` the peak of a float file, whose
    samples are read in blocks and refused when one is NaN or Inf (integer and FLAC samples are
    finite and within [-1, 1]: peak None). A scan under ``skip`` does not read every waveform."""
    import numpy as np
    import soundfile as sf

    require_file(path, "audio")
    try:
        info = sf.info(str(path))
        bad, peak = 0, None
        if values and info.subtype in ("FLOAT", "DOUBLE") and info.frames:
            for block in sf.blocks(str(path), blocksize=1 << 20):
                bad += int(block.size - np.isfinite(block).sum())
                peak = max(peak or 0.0, float(np.abs(block).max()))
    except Exception as err:
        raise _unreadable_audio(path, err) from err
    if info.frames == 0:
        raise ValueError(f"audio file {path} is empty")
    if bad:
        raise _non_finite(f"audio file {path}", bad)
    return info.frames / info.samplerate, peak


def scan_audio(audio: Any, req_id: str, n_frames: int, config: Any, values: bool) -> tuple[Any, str | None]:
    """A request's audio as the build checks it (a file: :func:`check_audio`; in memory:
    :func:`audio_tensor`), and why it looks wrong, or None: a length far (20%, two frames) from its
    codes' decode (a wrong pair or sample rate), or samples past the model's clamped [-1, 1]."""
    rate = config.sample_rate
    if isinstance(audio, Path):
        seconds, peak = check_audio(audio, values)
    else:
        audio = audio_tensor(audio, req_id, rate)
        seconds, peak = audio.shape[0] / rate, float(audio.abs().max())
    span = config.output_length(n_frames) / rate
    far = abs(seconds - span) > max(0.2 * span, 2 / config.frame_rate)
    doubts = [f"{seconds:.2f} s of audio, {span:.2f} s of codes"] if far else []
    doubts += [f"peak {peak:.3g}, past the model's [-1, 1]"] if peak is not None and peak > 1 else []
    return audio, "; ".join(doubts) or None


def warn_audio(doubtful: list[str], source: Any) -> None:
    """One warning naming the pairs whose audio looks wrong (``"id (why)"`` each, from :func:`scan_audio`)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    more = f", ... ({len(doubtful) - 5} more)" if len(doubtful) > 5 else ""
    rank_zero_warn(
        f"{len(doubtful)} pair(s) in {source} whose audio looks wrong: {', '.join(doubtful[:5])}{more}; a target "
        "is the first output_length(frames) samples (longer audio is cut, shorter is padded and masked) and the "
        "model's output is clamped to [-1, 1]: check the pairing, the sample rate and the scale (int16 samples "
        "as floats need / 32768)"
    )


def load_audio(path: Path, sample_rate: int) -> torch.Tensor:
    """Mono float32 at ``sample_rate``; refused when it holds a non-finite sample."""
    import numpy as np
    import soundfile as sf

    require_file(path, "audio")
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as err:
        raise _unreadable_audio(path, err) from err
    bad = int(data.size - np.isfinite(data).sum())
    if bad:
        raise _non_finite(f"audio file {path}", bad)
    audio = torch.from_numpy(data).mean(dim=1)
    if sr != sample_rate:
        from omni_lightning.imports.torchaudio import import_torchaudio

        audio = import_torchaudio().functional.resample(audio, sr, sample_rate)
    return audio


def audio_tensor(audio: Any, req_id: str, sample_rate: int) -> torch.Tensor:
    """In-memory audio (a float tensor or array ``[n]`` or ``[1, n]`` at ``sample_rate``) as float32
    ``[n]`` on the CPU; ValueError naming the request for another type, dtype or shape, no sample, or
    a non-finite sample. It is not resampled: the rate cannot be read from a tensor."""
    who = f"request {req_id!r}: audio"
    audio = in_memory(audio, who)
    want = f"a float tensor [samples] or [1, samples] at {sample_rate} Hz"
    if not isinstance(audio, torch.Tensor):
        raise ValueError(f"{who} must be {want}, got {type(audio).__name__}")
    if not audio.is_floating_point():
        raise ValueError(f"{who} has dtype {str(audio.dtype).removeprefix('torch.')}; it must be {want}")
    if audio.dim() == 2 and audio.shape[0] == 1:
        audio = audio[0]
    if audio.dim() != 1:
        raise ValueError(f"{who} has shape {tuple(audio.shape)}; it must be {want} (mono)")
    if audio.shape[0] == 0:
        raise ValueError(f"{who} is empty")
    audio = audio.to(device="cpu", dtype=torch.float32)
    bad = int(audio.numel() - torch.isfinite(audio).sum())
    if bad:
        raise _non_finite(who, bad)
    return audio


def _unreadable_audio(path: Path, err: Exception) -> ValueError:
    text = str(err)
    if "File does not exist" in text and path.is_file():  # libsndfile's words for an undecodable file
        text = "corrupt, or in a format libsndfile cannot decode"
    return ValueError(f"audio file {path} could not be read ({type(err).__name__}: {text})")


def _non_finite(who: str, count: int) -> ValueError:
    # one such target turns every weight of a fit into NaN
    return ValueError(f"{who} holds {count} non-finite sample(s) (NaN or Inf)")
