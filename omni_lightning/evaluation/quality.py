"""PESQ and STOI beside the spectral distances (the measures of HiFi-GAN, BigVGAN, Vocos), scored per
request in worker processes, off the step's path, and reduced over DDP ranks as sums and counts.

- ``pesq``: wide-band PESQ (ITU-T P.862.2, MOS-LQO about 1.0 to 4.64) at 16 kHz, the standard's rate:
  both signals resampled from the model's rate with torchaudio, batched, on the step's device. A silent
  output is scored, not dropped: pesq cannot take exact zeros, so it scores a -180 dB dither in its
  place (about 1.03, the scale's floor), and a model that falls silent cannot raise its mean.
- Both ignore level: an output scaled by 1e-12 or 1e6 scores as the output itself. Read them beside
  ``snr`` and the spectral distances.
- ``stoi`` and ``estoi``: STOI and extended STOI (about 0 to 1); pystoi resamples to its 10 kHz itself.

A request a metric cannot score gets NaN for it, counted in ``<name>_unscored`` and left out of that
metric's mean (never a zero averaged in): shorter than 0.25 s (PESQ) or than 30 STOI frames after
pystoi drops the silent ones (about 0.4 s of sound), a silent reference, a non-finite output, or one
in which PESQ detects no utterance.

Not done, and why:

- torchmetrics' PESQ and STOI are not used: their metrics score inside ``update``, on the step's
  thread, and their functions raise for a request PESQ finds no speech in and return pystoi's 1e-5
  for one too short (a near zero averaged in). The packages' own functions are called here; the
  tests compare the values with them.
- No threads: pesq's C code holds the GIL for a whole request (about 0.15 s for 5 s of audio), which
  would stall the training loop. Worker processes score instead, forked on Linux (they run numpy,
  pesq and pystoi only: no torch, no CUDA), spawned elsewhere.
- ``estoi`` shares no work with ``stoi``: asked for both, pystoi reads a request twice.
- No MOS predictor (UTMOS, DNSMOS): they need model weights; no metric downloads anything at run time.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from omni_lightning.errors import UsageError
from omni_lightning.evaluation.metrics import QualityMetrics
from omni_lightning.evaluation.scoring import PESQ_RATE, default_workers, score_request, start_worker, usable_cpus

QUALITY_METRICS = ("pesq", "stoi", "estoi")
PACKAGES = {"pesq": "pesq", "stoi": "pystoi", "estoi": "pystoi"}
INSTALL = 'pip install "omni-lightning[quality]" (in a checkout: pip install -e ".[quality]")'


def check_quality_metrics(names: Any) -> tuple[str, ...]:
    """The names asked for (duplicates dropped), or a ``UsageError`` naming the bad value or the install
    command when the ``quality`` extra is missing; None: none."""
    if names is None:
        return ()
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise UsageError(f"quality_metrics must be a list of names from {', '.join(QUALITY_METRICS)}, got {names!r}")
    for name in names:
        if name not in QUALITY_METRICS:
            raise UsageError(f"quality_metrics: unknown metric {name!r}; choose from {', '.join(QUALITY_METRICS)}")
    names = tuple(dict.fromkeys(names))
    missing = []
    for package in dict.fromkeys(PACKAGES[n] for n in names):
        try:
            __import__(package)  # here, in the parent: forked workers find it imported
        except ImportError:
            missing.append(package)
    if missing:
        raise UsageError(f"quality_metrics {list(names)} need the {' and '.join(missing)} package: {INSTALL}")
    return names


class QualityScorer(pl.Callback):
    """Scores requests in a pool of ``workers`` processes (None: :func:`default_workers` per training
    process) and logs the means as ``val/<name>`` and ``test/<name>``.

    The module hands each evaluation batch to :meth:`submit` (one host copy: the step's one sync) and
    goes on; the workers score while the next batches generate. ``validate`` and ``test`` wait for the
    last scores at their epoch's end and log them with the other metrics. A fit's validation waits only
    for those its W&B samples table shows (:meth:`wait`); the rest are logged at its own step when the
    next validation starts or fit ends, so a ``ModelCheckpoint`` cannot monitor them. More than
    ``pending_audio_s`` of audio handed over and not scored (600 s: about 200 MB of host copies) makes
    :meth:`submit` wait for the oldest, so memory stays bounded when scoring is slower than generation.

    As a callback (the module adds it to fit, validate and test) it owns its pool: started at the first
    request, shut down when the run ends (``teardown``) or fails (``on_exception``). A worker's error,
    or a worker's death, is raised where the scores are gathered.
    """

    def __init__(
        self,
        names: tuple[str, ...],
        sample_rate: int = 24000,
        workers: int | None = None,
        pending_audio_s: float = 600.0,
    ) -> None:
        self.names, self.sample_rate = tuple(names), sample_rate
        self.workers, self.pending_audio_s = workers, pending_audio_s
        self.metrics = QualityMetrics(self.names)
        self._pool: ProcessPoolExecutor | None = None
        self._processes = 1  # training processes of this host (setup)
        self._reset()

    def _reset(self) -> None:
        self._futures: list[Future] = []  # each request's scores, in the order handed over
        self._unscored: deque[tuple[Future, float]] = deque()  # (scores, audio seconds) not seen done yet
        self._unscored_s = 0.0
        self._deferred: tuple[str, int] | None = None  # a fit's validation not logged yet: (stage, step)
        self._waited = 0.0  # seconds waited for scores outside gather (wait), not yet in the metrics

    def __getstate__(self) -> dict[str, Any]:  # a copy or pickle (ddp_spawn) keeps the settings only
        return {k: getattr(self, k) for k in ("names", "sample_rate", "workers", "pending_audio_s")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    # --- scoring ------------------------------------------------------------------------------------------------

    def submit(self, pred: torch.Tensor, target: torch.Tensor, lengths: torch.Tensor) -> list[Future]:
        """Hands each request of a batch to the workers: ``pred`` [B, 1, T] or [B, T], ``target`` [B, N],
        ``lengths`` real samples per request. One future per request, of its :class:`RequestScores`."""
        pred, target = pred.reshape(pred.shape[0], -1).float(), target.reshape(target.shape[0], -1).float()
        n = min(pred.shape[-1], target.shape[-1])
        lengths = lengths.to(pred.device).clamp(max=n)
        real = torch.arange(n, device=pred.device)[None] < lengths[:, None]  # a cut request's zeros past its end
        signals = [target[:, :n] * real, pred[:, :n] * real]
        if "pesq" in self.names:
            from omni_lightning.imports.torchaudio import import_torchaudio

            resample = import_torchaudio().functional.resample
            signals += [resample(s, self.sample_rate, PESQ_RATE) for s in signals]
        host = [s.cpu().numpy() for s in signals]
        pool = self._start()
        futures = []
        for i, length in enumerate(lengths.tolist()):
            rows = [h[i, :length] for h in host[:2]]
            rows += [h[i, : math.ceil(length * PESQ_RATE / self.sample_rate)] for h in host[2:]]
            self._wait_below(self.pending_audio_s)
            future = pool.submit(score_request, self.names, self.sample_rate, *rows)
            self._futures.append(future)
            self._unscored.append((future, length / self.sample_rate))
            self._unscored_s += length / self.sample_rate
            futures.append(future)
        return futures

    def _start(self) -> ProcessPoolExecutor:
        if self._pool is None:
            workers = self.workers or default_workers(self._processes)
            cpus = usable_cpus()
            if workers > cpus:
                rank_zero_warn(f"quality_workers={workers}: this machine has {cpus} CPUs; scoring in {cpus} processes")
                workers = cpus
            context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
            self._pool = ProcessPoolExecutor(workers, context, initializer=start_worker, initargs=(os.getpid(),))
        return self._pool

    def _wait_below(self, audio_s: float) -> None:
        """Waits for the oldest requests while more than ``audio_s`` of audio is not scored yet."""
        while self._unscored and (self._unscored[0][0].done() or self._unscored_s > audio_s):
            future, seconds = self._unscored.popleft()
            future.exception()  # waits; an error is raised where the scores are gathered
            self._unscored_s -= seconds

    @property
    def pending(self) -> int:
        """Requests handed to the workers and not gathered yet (scored or not)."""
        return len(self._futures)

    def wait(self, futures: list[Future | None]) -> list[dict[str, float]]:
        """The scores of requests handed over (``{}`` for None), waiting for them: the time counts in
        ``quality_wait_s`` (the W&B media's table waits here for the requests it shows)."""
        start = time.perf_counter()
        scores = [f.result().values if f is not None else {} for f in futures]
        self._waited += time.perf_counter() - start
        return scores

    def gather(self) -> None:
        """Waits for every request handed over and adds its scores to :attr:`metrics`; raises a worker's error."""
        waited = time.perf_counter()
        scores = [f.result() for f in self._futures]
        waited = self._waited + time.perf_counter() - waited
        self.metrics.update([s.values for s in scores], sum(s.seconds for s in scores), waited)
        self._futures, self._unscored, self._unscored_s, self._waited = [], deque(), 0.0, 0.0

    def results(self, device: torch.device) -> dict[str, float]:
        """Gathers, reduces across ranks (every rank must call it) and resets: ``{name: value}``."""
        self.metrics.to(device)
        self.gather()
        values = {k: float(v) for k, v in self.metrics.compute().items()}
        self.metrics.reset()
        return values

    def close(self) -> None:
        """Shuts the pool down (its running requests finish, queued ones are dropped) and forgets them."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._reset()
        self.metrics.reset()

    # --- Lightning hooks ------------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()  # what a failed run left
        self._processes = trainer.num_devices

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close()

    def _epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.sanity_checking:
            return
        if trainer.state.fn == "fit":  # the training goes on: logged when the next validation starts or fit ends
            self._deferred = (stage, trainer.fit_loop.epoch_loop._batches_that_stepped)  # the step Lightning logs at
            return
        pl_module.log_dict({f"{stage}/{k}": v for k, v in self.results(pl_module.device).items()})

    def _log_deferred(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deferred is None:
            return
        (stage, step), self._deferred = self._deferred, None
        values = {f"{stage}/{k}": v for k, v in self.results(pl_module.device).items()}
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end(trainer, pl_module, "test")

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_deferred(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_deferred(trainer, pl_module)
