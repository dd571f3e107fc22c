"""One waveform into a durable audio file: what ``WaveformWriter``'s encoder threads run.

Not done here: names, formats and the manifest (``data/output_folder.py``), the rename into place
and the order of commits (``callbacks/writer.py``).
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch


def encode_durably(path: Path, wav: Any, sr: int, audio_format: str, subtype: str) -> tuple[int, str | None]:
    """Writes ``wav`` (a tensor or array, any shape holding one channel) to ``path`` in ``audio_format``
    and ``subtype``, then fsyncs it. Returns ``(samples, None)``, or ``(0, reason)`` with ``path``
    removed: whatever encoding or the disk raises is that request's failure, never the job's."""
    import soundfile as sf

    try:
        data = wav.float().reshape(-1).numpy() if isinstance(wav, torch.Tensor) else np.asarray(wav).reshape(-1)
        if subtype == "PCM_16":  # libsndfile truncates toward -inf (a -0.5 LSB bias): round here
            data = np.clip(np.rint(data * np.float32(32768)), -32768, 32767).astype(np.int16)
        # encoded in memory, then written: libsndfile hides the disk's error (a full disk); os.write names it
        encoded = io.BytesIO()
        sf.write(encoded, data, sr, subtype=subtype, format=audio_format.upper())
        with open(path, "wb") as f:
            f.write(encoded.getbuffer())
            f.flush()
            os.fsync(f.fileno())
    except Exception as err:
        discard(path)
        return 0, f"{type(err).__name__}: {err}"
    return int(data.shape[0]), None


def discard(path: Path) -> None:
    """Removes ``path`` if it can: on a file system gone read-only the removal fails too, and the
    request's failure (already recorded) is what matters; the next run's start removes the temp file."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
