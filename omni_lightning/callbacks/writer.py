"""``WaveformWriter``: each request's waveform to ``<out_dir>/<id>.wav``, resumable, nothing lost.

- Each WAV is written to a temp file in ``out_dir`` and renamed into place (atomic), then a line
  ``{"id", "path", "n_samples", "duration_s", "sr", "status": "ok"}`` is appended to
  ``manifest.jsonl``, flushed and fsynced per batch. Bad requests get ``{"id", "status": "error",
  "reason"}``.
- A rerun with the same ``out_dir`` skips ids that are complete (in the manifest and file present):
  the writer tells a ``CodesDataModule`` to drop them before any dataloader is built, and never
  writes an id twice. Temp files of a killed run are removed, and the manifest is compacted to one
  line per id (error lines are dropped so those requests are tried again).
- Writing lags one batch behind predict, so the host copy of a batch (``AsyncD2HCallback``) is
  waited for only while the next batch computes; the last batch is written at epoch end, and on an
  exception the batch already computed is written before the error propagates.
- Under DDP every rank writes only its own requests (the sampler gives each request to one rank)
  into ``manifest.rank<r>.jsonl``; rank 0 merges them into ``manifest.jsonl`` at the end (and at the
  next start, after a killed run).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from omni_lightning.runner.output import OmniModelRunnerOutput

MANIFEST = "manifest.jsonl"
SUBTYPES = ("PCM_16", "PCM_24", "FLOAT")


def safe_name(req_id: str) -> str:
    """A file name for a request id: path separators and odd characters become '_'."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", req_id)
    return f"_{name}" if name.startswith(".") or not name else name


def read_manifest(path: Path) -> list[dict[str, Any]]:
    """The lines of a manifest; a torn last line (a killed writer) is ignored."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "id" in row:
                rows.append(row)
    return rows


def _fsync_write(path: Path, text: str, mode: str = "a") -> None:
    with open(path, mode) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class WaveformWriter(BasePredictionWriter):
    """Writes WAV files and a manifest from ``OmniModelRunnerOutput``; see the module docstring."""

    def __init__(self, out_dir: str | Path, subtype: str = "PCM_16", skip_done: bool = True) -> None:
        super().__init__(write_interval="batch")
        if subtype not in SUBTYPES:
            raise ValueError(f"subtype must be one of {SUBTYPES}, got {subtype!r}")
        self.out_dir = Path(out_dir)
        self.subtype = subtype
        self.skip_done = skip_done
        self.done: set[str] = set()
        self._pending: OmniModelRunnerOutput | None = None
        self._manifest = self.out_dir / MANIFEST
        self.stats = {"ok": 0, "error": 0, "skipped": 0, "audio_s": 0.0, "seconds": 0.0}
        self._start = 0.0

    # --- run start: compact the manifest, clean up, tell the data what to skip -------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        rank, world = trainer.global_rank, trainer.world_size
        self._manifest = self.out_dir / (MANIFEST if world == 1 else f"manifest.rank{rank}.jsonl")
        if rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            for tmp in self.out_dir.glob(".*.tmp"):
                tmp.unlink()
            self._merge()
        trainer.strategy.barrier("WaveformWriter.setup")
        self.done = {r["id"] for r in read_manifest(self.out_dir / MANIFEST) if r.get("status") == "ok"}
        self.stats = {"ok": 0, "error": 0, "skipped": 0, "audio_s": 0.0, "seconds": 0.0}
        if self.skip_done and self.done:
            datamodule = trainer.datamodule
            if datamodule is not None and hasattr(datamodule, "skip_requests"):
                self.stats["skipped"] = datamodule.skip_requests(self.done)

    def _merge(self, keep_errors: bool = False) -> None:
        """Rank parts into manifest.jsonl, one line per id (an ok line whose file exists wins).

        At a run's start error lines are dropped (those requests are tried again); at a DDP run's
        end they are kept.
        """
        parts = sorted(self.out_dir.glob("manifest.rank*.jsonl"))
        rows: dict[str, dict[str, Any]] = {}
        for path in [self.out_dir / MANIFEST, *parts]:
            for row in read_manifest(path):
                ok = row.get("status") == "ok" and (self.out_dir / row.get("path", "")).is_file()
                if ok or (keep_errors and rows.get(row["id"], {}).get("status") != "ok"):
                    rows[row["id"]] = row
        tmp = self.out_dir / f".{MANIFEST}.tmp"
        _fsync_write(tmp, "".join(json.dumps(r) + "\n" for r in rows.values()), mode="w")
        os.replace(tmp, self.out_dir / MANIFEST)
        for path in parts:
            path.unlink()

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    # --- per batch, one batch behind ----------------------------------------------------------------

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        if not isinstance(prediction, OmniModelRunnerOutput):
            raise TypeError(f"WaveformWriter needs OmniPredictionLoop outputs, got {type(prediction).__name__}")
        previous, self._pending = self._pending, prediction
        if previous is not None:
            self._write(previous)

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:  # what was computed before the error is kept
            self._flush()
        except Exception:  # the original error matters more than a failed last write
            self._pending = None

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._write(pending)

    def _write(self, output: OmniModelRunnerOutput) -> None:
        import soundfile as sf

        lines = []
        for req_id, payload in zip(output.req_ids, output.pooler_output):
            if req_id in self.done:
                continue
            wav, sr = payload["model_outputs"], int(payload["sr"])
            data = wav.float().reshape(-1).numpy() if isinstance(wav, torch.Tensor) else wav
            name = safe_name(req_id) + ".wav"
            tmp = self.out_dir / f".{name}.tmp"
            with open(tmp, "wb") as f:
                sf.write(f, data, sr, subtype=self.subtype, format="WAV")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.out_dir / name)
            n = int(data.shape[0])
            lines.append({"id": req_id, "path": name, "n_samples": n, "duration_s": n / sr, "sr": sr, "status": "ok"})
            self.done.add(req_id)
            self.stats["ok"] += 1
            self.stats["audio_s"] += n / sr
        for req_id, reason in output.errors.items():
            lines.append({"id": req_id, "status": "error", "reason": reason})
            self.stats["error"] += 1
        if lines:
            _fsync_write(self._manifest, "".join(json.dumps(line) + "\n" for line in lines))

    # --- run end: merge, summary -------------------------------------------------------------------

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush()
        self.stats["seconds"] = time.perf_counter() - self._start
        if trainer.world_size > 1:
            trainer.strategy.barrier("WaveformWriter.end")
            if trainer.global_rank == 0:
                self._merge(keep_errors=True)
            trainer.strategy.barrier("WaveformWriter.merged")

    def summary(self) -> str:
        s = self.stats
        rate = s["audio_s"] / s["seconds"] if s["seconds"] else 0.0
        return (
            f"{s['ok']} requests written ({s['audio_s']:.1f} s of audio, {rate:.1f} audio s/s), "
            f"{s['skipped']} already done, {s['error']} errors -> {self.out_dir.resolve()}"
        )
