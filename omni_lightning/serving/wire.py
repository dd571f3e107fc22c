"""The messages between front processes and an engine process (ZeroMQ, ``engine_process.py`` and
``engine_client.py``): a small msgpack header, then raw buffers. Codes cross as little-endian int16 (a
codebook of at most 32768 entries; the front has checked them), audio as the engine's float32, one frame
per piece; never JSON or per-sample Python.

Front to engine: ``[op, key, frames, request id, sent]`` + the codes' bytes for ``submit`` and ``push`` (``key``:
the job's number in that front). Engine to front: ``[kind, key, value, sent]`` + one frame per audio piece;
``kind`` is ``audio`` (value: the pieces' sample counts), ``end`` or ``error`` (value: ``[status, message]``).
``sent``: the sender's ``time.perf_counter()``, added by :func:`pack` (a clock of the whole machine on Linux,
the processes' one host), from which the receiver times a stream's hand-offs (``ServeMetrics``).
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import numpy as np
import torch

SUBMIT, OPEN, PUSH, FINISH, ABORT = "submit", "open", "push", "finish", "abort"
CODE_DTYPE = np.dtype("<i2")


def pack(*header: Any) -> bytes:
    """``header`` with ``sent`` (now) after it, as one msgpack frame."""
    return msgpack.packb((*header, time.perf_counter()))


def unpack(frame: bytes | memoryview) -> list[Any]:
    return msgpack.unpackb(frame)


def codes_frame(codes: torch.Tensor) -> memoryview:
    """``codes [Q, n]`` (checked, values below 32768) as the bytes of a C-ordered int16 array."""
    return memoryview(np.ascontiguousarray(codes.numpy(), dtype=CODE_DTYPE)).cast("B")


def frame_codes(frame: Any, frames: int) -> torch.Tensor:
    """The codes ``[Q, frames]`` (int64) of a codes frame."""
    array = np.frombuffer(frame, dtype=CODE_DTYPE)
    return torch.from_numpy(array.astype(np.int64).reshape(-1, frames))


def audio_frames(pieces: list[torch.Tensor]) -> tuple[list[int], list[memoryview]]:
    """A step's pieces (float32 ``[1, m]`` on the host) as their sizes and one buffer each."""
    arrays = [np.ascontiguousarray(p.reshape(-1).numpy(), dtype="<f4") for p in pieces]
    return [a.shape[0] for a in arrays], [memoryview(a).cast("B") for a in arrays]


def frame_audio(frame: Any) -> torch.Tensor:
    """One audio piece's frame as float32 ``[1, m]``."""
    return torch.from_numpy(np.frombuffer(frame, dtype="<f4").copy()).reshape(1, -1)
