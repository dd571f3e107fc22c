"""``WaveformWriter``: each request's waveform to ``<out_dir>/<name>.wav``, resumable, nothing lost.

- File names come from ids injectively (:func:`wav_name`): an id made of letters, digits, ``_``,
  ``-`` and ``.`` (not first), up to 100 characters, is its own name (``utt1`` -> ``utt1.wav``);
  any other id gets a readable part plus 16 hex digits of the SHA-256 of the exact id after a ``~``,
  which no plain id contains (``x/a b`` -> ``x_a_b~<hash>.wav``). A name never holds a path
  separator or starts with a dot, so no id writes outside ``out_dir``. Before anything is decoded
  the writer refuses a job in which two requests share an id (over all predict sources) or a file
  name (on a case-insensitive file system, names that differ only by case). ``manifest.jsonl`` maps
  each id to its file (``path``).
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
  next start, after a killed run). The counts (``stats``: written, failed, audio seconds) are summed
  over ranks at the end, so every rank's ``summary()`` and ``all_written`` describe the whole job.
- At the end, every request the job was given is either written (now or by an earlier run) or
  recorded as failed; one that is neither is counted in ``stats["missing"]`` (a bug, never silent).
"""

from __future__ import annotations

import hashlib
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


_PLAIN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


def wav_name(req_id: str) -> str:
    """The WAV file name of a request id; injective (see the module docstring)."""
    if _PLAIN_ID.fullmatch(req_id):
        return f"{req_id}.wav"
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", req_id)[:80].lstrip(".") or "id"
    digest = hashlib.sha256(req_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{readable}~{digest}.wav"


def _case_insensitive(folder: Path) -> bool:
    """Whether ``folder``'s file system folds case (macOS and Windows defaults): probed with a file."""
    probe = folder / f".Case-Probe-{os.getpid()}.tmp"
    try:
        probe.touch()
        return (folder / probe.name.lower()).exists()
    finally:
        probe.unlink(missing_ok=True)


def check_names(req_ids: list[str], fold: bool = False) -> None:
    """ValueError, listing them, when two requests share an id or a file name (``fold``: names that
    differ only by case count as one, as on a case-insensitive file system)."""
    owners: dict[str, list[str]] = {}
    for req_id in req_ids:
        name = wav_name(req_id)
        owners.setdefault(name.casefold() if fold else name, []).append(req_id)
    clashes = [ids for ids in owners.values() if len(ids) > 1]
    if clashes:
        shown = "; ".join(", ".join(repr(i) for i in ids) for ids in clashes[:10])
        more = f" ... ({len(clashes) - 10} more)" if len(clashes) > 10 else ""
        what = "ids or file names that differ only by case (this file system ignores case)" if fold else "ids"
        raise ValueError(
            f"{len(clashes)} group(s) of requests share {what}, so one WAV would overwrite another; nothing "
            f"was decoded. Make the ids unique: {shown}{more}"
        )


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
        self.stats = self._zero_stats()
        self.unread: list[Path] = []  # input files that are not code files (listed in the summary)
        self._expected: set[str] = set()
        self._fold = False  # the file system ignores case
        self._names: dict[str, str] = {}  # file name (casefolded when _fold) -> the id written there
        self._written_now: set[str] = set()
        self._start = 0.0

    @staticmethod
    def _zero_stats() -> dict[str, Any]:
        return {"ok": 0, "error": 0, "skipped": 0, "missing": 0, "audio_s": 0.0, "seconds": 0.0}

    @property
    def all_written(self) -> bool:
        """True when every request of the job has its WAV (written now or by an earlier run)."""
        return self.stats["error"] == 0 and self.stats["missing"] == 0

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
        done_rows = [r for r in read_manifest(self.out_dir / MANIFEST) if r.get("status") == "ok"]
        self.done = {r["id"] for r in done_rows}
        self._fold = _case_insensitive(self.out_dir)
        self._names = {self._key(r.get("path", "")): r["id"] for r in done_rows}
        self._written_now = set()
        self.stats = self._zero_stats()
        datamodule = trainer.datamodule
        self._expected, self.unread = set(), []
        if datamodule is not None and hasattr(datamodule, "predict_ids"):
            ids = datamodule.predict_ids()
            check_names(ids, self._fold)  # before anything is decoded, on every rank alike
            self._expected = set(ids)
            self.unread = datamodule.unread_files()
        if self.skip_done and self.done and datamodule is not None and hasattr(datamodule, "skip_requests"):
            self.stats["skipped"] = datamodule.skip_requests(self.done)

    def _key(self, name: str) -> str:
        return name.casefold() if self._fold else name

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
            # the data module drops finished and checks ids up front; plain dataloaders get this net
            name = wav_name(req_id)
            owner = self._names.get(self._key(name))
            reason = None
            if req_id in self._written_now:
                reason = "duplicate id: a request with this id was already written in this run"
            elif req_id in self.done:  # finished by an earlier run, and the data was not told to skip it
                self.stats["skipped"] += 1
                continue
            elif owner is not None and owner != req_id:
                reason = f"its file name {name} is taken by request {owner!r}"
            if reason is not None:
                lines.append({"id": req_id, "status": "error", "reason": reason})
                self.stats["error"] += 1
                continue
            wav, sr = payload["model_outputs"], int(payload["sr"])
            data = wav.float().reshape(-1).numpy() if isinstance(wav, torch.Tensor) else wav
            tmp = self.out_dir / f".{name}.tmp"
            with open(tmp, "wb") as f:
                sf.write(f, data, sr, subtype=self.subtype, format="WAV")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.out_dir / name)
            n = int(data.shape[0])
            lines.append({"id": req_id, "path": name, "n_samples": n, "duration_s": n / sr, "sr": sr, "status": "ok"})
            self.done.add(req_id)
            self._written_now.add(req_id)
            self._names[self._key(name)] = req_id
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
            # every rank wrote its own share: sum the counts, so each rank reports the whole job
            own = [self.stats["ok"], self.stats["error"], self.stats["audio_s"]]
            total = trainer.strategy.reduce(
                torch.tensor(own, dtype=torch.float64, device=trainer.strategy.root_device), reduce_op="sum"
            )
            ok, error, audio_s = total.tolist()  # rank 0 merged before it joined this reduce
            self.stats.update(ok=round(ok), error=round(error), audio_s=audio_s)
        recorded = {r["id"] for r in read_manifest(self.out_dir / MANIFEST)}
        self.stats["missing"] = len(self._expected - recorded)

    def summary(self) -> str:
        s = self.stats
        rate = s["audio_s"] / s["seconds"] if s["seconds"] else 0.0
        text = (
            f"{s['ok']} requests written ({s['audio_s']:.1f} s of audio, {rate:.1f} audio s/s), "
            f"{s['skipped']} already done, {s['error']} failed -> {self.out_dir.resolve()}"
        )
        if s["missing"]:
            text += f"; {s['missing']} requests neither written nor failed (a bug: please report it)"
        if self.unread:
            names = ", ".join(str(p) for p in self.unread[:5]) + (", ..." if len(self.unread) > 5 else "")
            text += f"; {len(self.unread)} input files not read (not code files): {names}"
        return text
