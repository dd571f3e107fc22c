"""``WaveformWriter``: each request's waveform to ``<out_dir>/<name>.wav`` (or ``.flac``), written off the
predict loop's thread, exactly once, resumable.

- **Names and formats** are ``data/output_folder.py``'s: file names come from ids injectively and never
  leave ``out_dir``. Two requests sharing an id, or a file name on a case-insensitive file system, are
  refused before anything is decoded (ids a ``CodesDataModule`` listed) or at the first repeat.
- **Off the critical path.** At each batch end the writer takes the previous batch's runner output
  (its host copy ran under the step that just launched), decides on the loop's thread what to write
  (``FileClaims``) and queues it (``WriteQueue``). A background thread encodes the files on ``encoders``
  threads into fsynced temp files, renames them into place, fsyncs the folder, then appends the batch's
  lines to ``manifest.jsonl`` and fsyncs it. The loop waits only when ``max_pending`` batches are queued.
- **Exactly once, kill -9 safe.** A manifest line is written only after its file is durable (a crash
  leaves at worst temp files, removed at the next start). A rerun writes no finished id again and
  compacts the manifest to its finished lines (failed requests are tried again). With
  ``CodesDataModule(skip_done=out_dir)`` finished requests are not even decoded.
- **Failures.** A request whose file cannot be written, or whose input was bad, gets an error line and
  the others go on. A failure of the background thread itself is raised in the loop at the next batch or
  at the end. On an exception or Ctrl-C the batches already computed are written before it propagates.
- **One job per folder**: rank 0 holds the folder's lock (``data/folder_lock.py``) from set-up to
  teardown. **DDP**: each rank writes ``manifest.rank<r>.jsonl``, rank 0 merges them at the end, and
  the counts (``stats``) are summed over ranks.
- At the end every request is written (now or earlier) or recorded as failed; one that is neither is
  counted in ``stats["missing"]`` (never silent; ``stats["limited"]`` when the trainer limited batches).

What it does not do: decode, validate codes, or write outputs other than runner outputs' waveforms.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_warn

from omni_lightning.callbacks.audio_files import discard, encode_durably
from omni_lightning.callbacks.file_claims import (
    FileClaims,
    error_line,
    unwritten_warnings,
    weights_at_start,
    written_line,
)
from omni_lightning.callbacks.write_queue import WriteQueue
from omni_lightning.data.folder_lock import lock_output_folder, unlock_output_folder
from omni_lightning.data.job_lines import summary_line
from omni_lightning.data.output_folder import (
    MANIFEST,
    Finished,
    PredictPlan,
    case_insensitive,
    check_format,
    check_names,
    file_name,
    fsync_folder,
    fsync_write,
    manifest_text,
    merge_manifests,
    remove_temp_files,
)
from omni_lightning.errors import UsageError, check_count
from omni_lightning.runner.output import OmniModelRunnerOutput


class WaveformWriter(BasePredictionWriter):
    """Writes audio files and a manifest from ``OmniModelRunnerOutput``; see the module docstring.

    ``max_pending``: batches queued for the background thread before the loop waits for it.
    ``encoders``: threads that encode and fsync files in parallel (None: up to 4, one per core).
    """

    def __init__(
        self,
        out_dir: str | Path,
        subtype: str = "PCM_16",
        audio_format: str = "wav",
        max_pending: int = 4,
        encoders: int | None = None,
    ) -> None:
        super().__init__(write_interval="batch")
        check_format(audio_format, subtype)
        check_count("max_pending", max_pending)
        check_count("encoders", encoders, none_ok=True)  # None: up to 4, one per core
        self.out_dir = Path(out_dir)
        self.subtype, self.audio_format = subtype, audio_format
        self.max_pending = max_pending
        self.encoders = encoders or min(4, os.cpu_count() or 1)
        # outputs not yet queued for the background thread, each with a number that the thread handles once
        self._unsent: list[tuple[int, OmniModelRunnerOutput]] = []
        self._numbered, self._handled, self._skipped_here = 0, set(), 0
        self._manifest = self.out_dir / MANIFEST
        self.stats = self._zero_stats()
        self.failed: dict[str, str] = {}  # id -> reason, this run's (under DDP, rank 0: every rank's)
        self.unread: list[Path] = []  # input files that are not code files (listed in the summary)
        self.timing: dict[str, float] = {}
        self._expected: set[str] = set()
        self._finished = Finished(self.out_dir)
        self._claims = FileClaims(self._finished)
        self._ok_now: set[str] = set()  # ids the background thread wrote in this run
        self._queue: WriteQueue | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._start = 0.0
        self._weights: str | None = None  # what the manifest lines name as the weights (on_predict_start)

    @staticmethod
    def _zero_stats() -> dict[str, Any]:
        return {"ok": 0, "error": 0, "skipped": 0, "missing": 0, "audio_s": 0.0, "seconds": 0.0}

    @property
    def all_written(self) -> bool:
        """True when every request of the job has its file (written now or by an earlier run)."""
        return self.stats["error"] == 0 and self.stats["missing"] == 0

    @property
    def any_failed(self) -> bool:
        """A request failed, or one was neither written nor failed without the trainer limiting the
        batches (``limit_predict_batches``, ``fast_dev_run``: those requests were not run, on purpose)."""
        return self.stats["error"] > 0 or (self.stats["missing"] > 0 and not self.stats.get("limited"))

    # --- run start: what is finished, clean up, start the background thread ---------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        rank, world = trainer.global_rank, trainer.world_size
        self._manifest = self.out_dir / (MANIFEST if world == 1 else f"manifest.rank{rank}.jsonl")
        listed = getattr(trainer.datamodule, "predict_plan", None)  # the job's ids, listed by the data module
        listed = listed if isinstance(listed, PredictPlan) else None
        plan = listed if listed is not None and listed.skipped_in(self.out_dir) else None
        finished = plan.finished if plan is not None else None  # else the writer reads the folder itself
        if rank == 0:
            try:  # a read-only file system, a folder where the manifest goes: the folder is the user's choice
                self.out_dir.mkdir(parents=True, exist_ok=True)
                lock_output_folder(self.out_dir, owner=self)  # until teardown; another job's is a UsageError
                remove_temp_files(self.out_dir)
                finished = finished or Finished.read(self.out_dir)
                finished.compact()
            except OSError as err:
                problem = "is a file, not a folder" if self.out_dir.is_file() else f"cannot be used ({err})"
                raise UsageError(f"output folder {self.out_dir} {problem}: pick another") from err
        trainer.strategy.barrier("WaveformWriter.setup")
        self._finished = finished or Finished.read(self.out_dir)
        fold = case_insensitive(self.out_dir)
        self._claims = FileClaims(self._finished, fold, self.audio_format)
        self._ok_now, self.failed = set(), {}
        self._unsent, self._handled, self._skipped_here = [], set(), 0
        self.stats = self._zero_stats()
        self._expected, self.unread = set(), []
        if listed is not None:  # before anything is decoded, on every rank alike
            check_names(listed.ids, fold)
        for warning in unwritten_warnings(listed, plan is not None, self._finished, self.audio_format, self.subtype):
            rank_zero_warn(warning)
        if plan is not None:
            self._expected, self.unread = set(plan.ids), plan.unread
            self.stats["skipped"] = plan.skipped
        limit = trainer.limit_predict_batches  # 0 runs no predict hook after this one: the counts stand as set here
        limited = isinstance(limit, int) or (limit if limit is not None else 1.0) < 1.0
        self.stats["limited"] = bool(trainer.fast_dev_run) or limited
        self.stats["missing"] = len(self._expected - self._finished.ids)  # none run yet
        self._close(drain=False)
        self._pool = ThreadPoolExecutor(self.encoders, thread_name_prefix="omni-lightning-encoder")
        self._queue = WriteQueue(self._write_batch, self.max_pending)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()
        self._weights = weights_at_start(trainer, pl_module, self._finished)  # the checkpoint is loaded by now

    # --- per batch, one batch behind: decided here, written on the background thread -------------------

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        if not isinstance(prediction, OmniModelRunnerOutput):
            raise TypeError(f"WaveformWriter needs OmniPredictionLoop outputs, got {type(prediction).__name__}")
        self._numbered += 1
        self._unsent.append((self._numbered, prediction))
        self._send(keep=1)  # the newest stays: its host copy runs under the next step

    def _flush(self) -> None:
        self._send(keep=0)

    def _send(self, keep: int) -> None:
        """Queues the unsent outputs but the last ``keep``. One leaves ``_unsent`` only once queued: a
        Ctrl-C while the queue is full (``put`` waits) leaves it there for ``on_exception`` to send; an
        output that cannot be written (its error raised) leaves it, so the others still can be."""
        while len(self._unsent) > keep:
            try:
                self._submit(*self._unsent[0])
            except Exception:
                del self._unsent[0]
                raise
            del self._unsent[0]

    def _submit(self, number: int, output: OmniModelRunnerOutput) -> None:
        """Decides, on the loop's thread, what to write; queues it (waits only on a full queue)."""
        decision = self._claims.decide(output)
        if decision.files or decision.lines:
            self._queue.put((number, decision.files, decision.lines))
        self._claims.commit(decision)  # once queued: an interrupted call is made again alike
        self.stats["skipped"] += decision.skipped
        self._skipped_here += decision.skipped  # this rank's (the plan's count is the whole job's)

    # --- on the background thread --------------------------------------------------------------------

    def _write_batch(self, work: tuple[int, list, list]) -> None:
        number, files, lines = work
        if number in self._handled:  # queued twice: an interrupt came after the put, before its bookkeeping
            return
        self._handled.add(number)
        written = list(self._pool.map(self._encode, files))
        committed = []
        for req_id, name, n_samples, sr, problem in written:
            if problem is None:
                try:
                    os.replace(self.out_dir / f".{name}.tmp", self.out_dir / name)
                except OSError as err:
                    problem = f"could not write {name}: {type(err).__name__}: {err}"
                    discard(self.out_dir / f".{name}.tmp")
            if problem is not None:
                lines.append(error_line(req_id, problem))
                continue
            committed.append(req_id)
            lines.append(written_line(req_id, name, self.audio_format, self.subtype, n_samples, sr, self._weights))
            self.stats["audio_s"] += n_samples / sr
        if committed:
            fsync_folder(self.out_dir)  # the renames are durable before any line names their files
        fsync_write(self._manifest, manifest_text(lines))
        self._ok_now.update(committed)
        self.stats["ok"] += len(committed)
        for line in lines:
            if line["status"] == "error":
                self.failed[line["id"]] = line["reason"]
                self.stats["error"] += 1

    def _encode(self, file: tuple[str, Any, int]) -> tuple[str, str, int, int, str | None]:
        req_id, wav, sr = file
        name = file_name(req_id, self.audio_format)
        n_samples, problem = encode_durably(self.out_dir / f".{name}.tmp", wav, sr, self.audio_format, self.subtype)
        return req_id, name, n_samples, sr, problem and f"could not write {name}: {problem}"

    # --- run end or error: drain, merge, summary -------------------------------------------------------

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:  # what was computed before the error is kept, each batch that can be written
            while self._unsent:
                with contextlib.suppress(Exception):  # that batch's own problem: the others go on
                    self._send(keep=len(self._unsent) - 1)
            self._close(drain=True)
        except Exception:  # the original error matters more than a failed last write
            self._close(drain=False)
        finally:
            unlock_output_folder(self.out_dir, owner=self)  # Lightning runs no teardown hook after an error

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            self._close(drain=False)  # already closed, unless predict ended on a path that skipped its hooks
        finally:
            unlock_output_folder(self.out_dir, owner=self)

    def _close(self, drain: bool) -> None:
        queue, self._queue = self._queue, None
        try:
            if queue is not None:
                start = time.perf_counter()
                queue.close(drain=drain)
                drain_s = time.perf_counter() - start
                self.timing = {"queue_wait_s": queue.waited_s, "write_busy_s": queue.busy_s, "drain_s": drain_s}
        finally:
            pool, self._pool = self._pool, None  # the background thread has stopped using it
            if pool is not None:
                pool.shutdown(wait=True)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush()
        self._close(drain=True)
        self.stats["seconds"] = time.perf_counter() - self._start
        if trainer.world_size == 1:
            recorded = self._finished.ids | self._ok_now | set(self.failed)
            self.stats["missing"] = len(self._expected - recorded)
            return
        trainer.strategy.barrier("WaveformWriter.end")
        missing = 0
        if trainer.global_rank == 0:
            rows = merge_manifests(self.out_dir)
            missing = len(self._expected - set(rows))
            self.failed = {i: r.get("reason", "?") for i, r in rows.items() if r.get("status") == "error"}
        # every rank wrote its own share: sum the counts, so each rank reports the whole job
        own = [self.stats["ok"], self.stats["error"], self.stats["audio_s"], missing, self._skipped_here]
        total = trainer.strategy.reduce(
            torch.tensor(own, dtype=torch.float64, device=trainer.strategy.root_device), reduce_op="sum"
        )
        ok, error, audio_s, missing, skipped = total.tolist()  # rank 0 merged before it joined this reduce
        skipped += self.stats["skipped"] - self._skipped_here  # the plan's: the same on every rank
        counts = {"ok": ok, "error": error, "missing": missing, "skipped": skipped}
        self.stats.update({k: round(v) for k, v in counts.items()}, audio_s=audio_s)

    def summary(self) -> str:
        return summary_line(self.stats, self.out_dir, self.unread)
