"""What the quality metrics' worker processes run: one request's PESQ and STOI scores (numpy, pesq and
pystoi only: no torch, no CUDA), and how many workers a host starts. ``evaluation/quality.py`` says
what the metrics are and when a request gets NaN; it owns the pool and the Lightning side.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import warnings
from typing import NamedTuple

import numpy as np

PESQ_RATE = 16000
PESQ_MIN_S = 0.25  # pesq's BufferTooShortError below this
STOI_MIN_S = (29 * 128 + 256) / 10000  # pystoi: 30 frames of 256 samples, hop 128, at 10 kHz
SILENCE_DITHER = 1e-9  # a silent output's stand-in for PESQ (module docstring)


class RequestScores(NamedTuple):
    """One request's ``values`` (``{name: score}``, NaN where a metric cannot score it) and the CPU
    ``seconds`` a worker spent on them (CPU time: other processes on the host do not inflate it)."""

    values: dict[str, float]
    seconds: float


def score_request(
    names: tuple[str, ...],
    sample_rate: int,
    reference: np.ndarray,
    generated: np.ndarray,
    reference_16k: np.ndarray | None = None,
    generated_16k: np.ndarray | None = None,
) -> RequestScores:
    """One request's scores; ``*_16k``: both signals at 16 kHz, for PESQ. Runs in a worker process:
    numpy, pesq and pystoi only."""
    start = time.process_time()
    values = dict.fromkeys(names, math.nan)
    if np.any(reference) and np.isfinite(generated).all():  # else nothing to score against, or no output
        for name in names:
            if name == "pesq":
                values[name] = _pesq(reference_16k, generated_16k)
            else:
                values[name] = _stoi(reference, generated, sample_rate, extended=name == "estoi")
    return RequestScores(values, time.process_time() - start)


def _pesq(reference: np.ndarray, generated: np.ndarray) -> float:
    from pesq import BufferTooShortError, NoUtterancesError, pesq

    if len(reference) < PESQ_MIN_S * PESQ_RATE:
        return math.nan
    if not np.any(generated):  # pesq fails on exact zeros: a silent output scores as a -180 dB dither
        generated = SILENCE_DITHER * np.random.default_rng(0).standard_normal(len(generated)).astype(generated.dtype)
    try:
        return float(pesq(PESQ_RATE, reference, generated, "wb"))
    except (BufferTooShortError, NoUtterancesError):
        return math.nan


def _stoi(reference: np.ndarray, generated: np.ndarray, sample_rate: int, extended: bool) -> float:
    from pystoi import stoi

    if len(reference) < STOI_MIN_S * sample_rate:  # shorter than one STOI segment: pystoi fails on it
        return math.nan
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = float(stoi(reference, generated, sample_rate, extended=extended))
    if any("Not enough STFT frames" in str(w.message) for w in caught):  # pystoi returned 1e-5
        return math.nan
    return value


def usable_cpus() -> int:
    """The CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2


def default_workers(processes: int = 1) -> int:
    """Half the CPUs this process may use, shared by the ``processes`` training processes of the host; 1 to 8."""
    return max(1, min(8, usable_cpus() // (2 * max(1, processes))))


def start_worker(parent: int) -> None:
    """A worker's start: Ctrl-C left to the parent, a lower priority, and an exit when the parent dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it shuts the pool down
    os.nice(10)  # a CPU run's generation first: torch's threads stall when a scorer takes one of their cores

    def watch() -> None:  # a parent killed outright (kill -9) leaves no one to shut the pool down
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
