"""A predict job's output folder: file names, audio formats, ``manifest.jsonl``, and what is finished.

This is the one place that decides what a rerun skips. A request is **finished** when a manifest of
the folder (``manifest.jsonl``, or a DDP rank's ``manifest.rank<r>.jsonl`` left by a killed run) has
an ``"ok"`` line for its id and the file that line names is in the folder. :meth:`Finished.read`
reads the manifests once; the command line (before torch loads), ``CodesDataModule`` (which then
never reads a finished request's codes) and ``WaveformWriter`` (which never writes a finished id
again) all decide from it. Error lines never count: a failed request is tried again.

- File names come from ids injectively (:func:`file_stem`): an id made of letters, digits, ``_``,
  ``-`` and ``.`` (not first), up to 100 characters, is its own name (``utt1`` -> ``utt1.wav``); any
  other id gets a readable part plus 16 hex digits of the SHA-256 of the exact id after a ``~``,
  which no plain id contains (``x/a b`` -> ``x_a_b~<hash>.wav``). A name never holds a path
  separator or starts with a dot, so no id writes outside the folder.
- Formats (:data:`FORMATS`): WAV as PCM_16, PCM_24 or FLOAT; FLAC as PCM_16 or PCM_24 (FLAC has no
  float samples). A manifest line names its file's ``format`` and ``subtype``.

Standard library only. What it does not do: write audio (``callbacks/writer.py`` does, durably), or
word what a job says of its folder (``data/job_lines.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_lightning.errors import UsageError

MANIFEST = "manifest.jsonl"
RANK_MANIFESTS = "manifest.rank*.jsonl"
FORMATS = {"wav": ("PCM_16", "PCM_24", "FLOAT"), "flac": ("PCM_16", "PCM_24")}

_PLAIN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


def file_stem(req_id: str) -> str:
    """The file name of a request id without its suffix; injective (see the module docstring)."""
    if _PLAIN_ID.fullmatch(req_id):
        return req_id
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", req_id)[:80].lstrip(".") or "id"
    digest = hashlib.sha256(req_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{readable}~{digest}"


def file_name(req_id: str, audio_format: str = "wav") -> str:
    """``<stem>.wav`` or ``<stem>.flac``."""
    return f"{file_stem(req_id)}.{audio_format}"


def check_format(audio_format: str, subtype: str) -> None:
    """UsageError naming the value unless ``audio_format`` is in :data:`FORMATS` with that ``subtype``."""
    if audio_format not in FORMATS:
        raise UsageError(f"--format {audio_format!r} is not an output format: use one of {', '.join(FORMATS)}")
    if subtype not in FORMATS[audio_format]:
        raise UsageError(
            f"--subtype {subtype!r} cannot be written as {audio_format}: use one of {', '.join(FORMATS[audio_format])}"
        )


def check_names(req_ids: Iterable[str], fold: bool = False) -> None:
    """UsageError, listing them, when two requests share an id or a file name (``fold``: names that
    differ only by case count as one, as on a case-insensitive file system)."""
    owners: dict[str, list[str]] = {}
    for req_id in req_ids:
        stem = file_stem(req_id)
        owners.setdefault(stem.casefold() if fold else stem, []).append(req_id)
    clashes = [ids for ids in owners.values() if len(ids) > 1]
    if clashes:
        shown = "; ".join(", ".join(repr(i) for i in ids) for ids in clashes[:10])
        more = f" ... ({len(clashes) - 10} more)" if len(clashes) > 10 else ""
        what = "ids or file names that differ only by case (this file system ignores case)" if fold else "ids"
        raise UsageError(
            f"{len(clashes)} group(s) of requests share {what}, so one file would overwrite another; nothing "
            f"was decoded. Make the ids unique: {shown}{more}"
        )


def case_insensitive(folder: Path) -> bool:
    """Whether ``folder``'s file system folds case (macOS and Windows defaults): probed with a file."""
    probe = folder / f".Case-Probe-{os.getpid()}.tmp"
    try:
        probe.touch()
        return (folder / probe.name.lower()).exists()
    finally:
        probe.unlink(missing_ok=True)


def read_manifest(path: Path) -> list[dict[str, Any]]:
    """The lines of a manifest that are JSON objects with a string ``id``; any other line (a torn last
    line of a killed writer, a hand edit: not UTF-8, not JSON, another kind of id) is ignored."""
    rows = []
    if path.is_file():
        for line in path.read_bytes().splitlines():
            try:
                row = json.loads(line.decode("utf-8"))
            except ValueError:  # UnicodeDecodeError and JSONDecodeError both are
                continue
            if isinstance(row, dict) and isinstance(row.get("id"), str):
                rows.append(row)
    return rows


def fsync_write(path: Path, text: str, mode: str = "a") -> None:
    """Writes (appends by default) ``text`` and returns once it is on disk."""
    with open(path, mode) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _names_a_file(out_dir: Path, name: Any) -> bool:
    # a plain name inside the folder: a hand-edited line cannot point elsewhere
    return (
        isinstance(name, str)
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
        and ((out_dir / name).is_file())
    )


@dataclass
class Finished:
    """The finished requests of an output folder: id -> its ``"ok"`` manifest line (file present)."""

    out_dir: Path
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def read(cls, out_dir: str | Path) -> Finished:
        """One read of the folder's manifests (none yet: nothing is finished).

        Rank parts are read before ``manifest.jsonl``: a merge replaces ``manifest.jsonl`` before it
        removes the parts, so a reader racing a merge still sees every finished line.
        """
        folder = Path(out_dir)
        rows: dict[str, dict[str, Any]] = {}
        if folder.is_dir():
            for path in [*sorted(folder.glob(RANK_MANIFESTS)), folder / MANIFEST]:
                for row in read_manifest(path):
                    if row.get("status") == "ok" and row["id"] not in rows and _names_a_file(folder, row.get("path")):
                        rows[row["id"]] = row
        return cls(folder, rows)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def ids(self) -> set[str]:
        return set(self.rows)

    def owners(self, fold: bool = False) -> dict[str, str]:
        """File stem (casefolded with ``fold``) -> the finished id written there."""
        stems = {row["id"]: Path(row["path"]).stem for row in self.rows.values()}
        return {(s.casefold() if fold else s): req_id for req_id, s in stems.items()}

    def in_other_weights(self, req_ids: Iterable[str], weights: str) -> dict[str, int]:
        """Of ``req_ids``, how many are finished from weights other than ``weights`` (a
        :func:`~omni_lightning.data.job_lines.weights_label`), by label; lines that name no weights (older
        manifests) are not counted."""
        counts: dict[str, int] = {}
        for req_id in req_ids:
            written = self.rows.get(req_id, {}).get("weights")
            if isinstance(written, str) and written != weights:
                counts[written] = counts.get(written, 0) + 1
        return counts

    def in_other_format(self, req_ids: Iterable[str], audio_format: str, subtype: str | None = None) -> dict[str, int]:
        """Of ``req_ids``, how many are finished in a format other than ``audio_format`` (or, given
        ``subtype``, in that format with another subtype: ``"wav PCM_16"``), by format. They still count
        as finished: a rerun does not decode them again in the new format."""
        counts: dict[str, int] = {}
        for req_id in req_ids:
            row = self.rows.get(req_id)
            if row is not None:
                written = str(row.get("format") or Path(row["path"]).suffix.lstrip("."))
                if written == audio_format and subtype and row.get("subtype") not in (None, subtype):
                    written = f"{written} {row['subtype']}"
                if written != audio_format:
                    counts[written] = counts.get(written, 0) + 1
        return counts

    def compact(self) -> None:
        """Rewrites ``manifest.jsonl`` as these lines only (errors and torn lines dropped, so failed
        requests are tried again) and removes rank parts; atomic (temp file, then rename)."""
        write_manifest(self.out_dir, self.rows.values())


def manifest_text(rows: Iterable[dict[str, Any]]) -> str:
    """Manifest lines: one JSON object per line."""
    return "".join(json.dumps(r) + "\n" for r in rows)


def fsync_folder(folder: Path) -> None:
    """Makes the folder's entries (renames into it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(out_dir: Path, rows: Iterable[dict[str, Any]]) -> None:
    """``manifest.jsonl`` replaced by ``rows`` (atomic), then the rank parts removed (in this order:
    see :meth:`Finished.read`)."""
    tmp = out_dir / f".{MANIFEST}.tmp"
    fsync_write(tmp, manifest_text(rows), mode="w")
    os.replace(tmp, out_dir / MANIFEST)
    for part in out_dir.glob(RANK_MANIFESTS):
        part.unlink()


def merge_manifests(out_dir: Path) -> dict[str, dict[str, Any]]:
    """At a DDP run's end: the rank parts merged into ``manifest.jsonl``, one line per id (an ok line
    whose file exists wins, else the last error line); returns the merged lines by id."""
    rows: dict[str, dict[str, Any]] = {}
    for path in [out_dir / MANIFEST, *sorted(out_dir.glob(RANK_MANIFESTS))]:
        for row in read_manifest(path):
            ok = row.get("status") == "ok" and _names_a_file(out_dir, row.get("path"))
            if rows.get(row["id"], {}).get("status") != "ok" and (ok or row.get("status") == "error"):
                rows[row["id"]] = row
    write_manifest(out_dir, rows.values())
    return rows


def remove_temp_files(out_dir: Path) -> int:
    """Removes the temp files a killed writer left (``.<name>.wav.tmp``, ``.<name>.flac.tmp``, the
    manifest's, the case probe's); returns how many. A user's other ``.tmp`` files are kept."""
    patterns = (".*.wav.tmp", ".*.flac.tmp", f".{MANIFEST}.tmp", ".Case-Probe-*.tmp")
    temps = sorted({t for pattern in patterns for t in out_dir.glob(pattern)})
    temps = [t for t in temps if not t.is_dir() or t.is_symlink()]  # a folder so named is the user's
    for tmp in temps:
        tmp.unlink(missing_ok=True)
    return len(temps)


@dataclass
class PredictPlan:
    """What a predict job is, decided before anything is decoded: every request id (over all
    sources), the output folder's finished requests (not read, not decoded; None: no folder was
    read, every request is decoded), the input files not read."""

    finished: Finished | None
    ids: list[str]
    unread: list[Path] = field(default_factory=list)

    @property
    def out_dir(self) -> Path | None:
        return self.finished.out_dir if self.finished is not None else None

    def skipped_in(self, out_dir: Path) -> bool:
        """Whether the data left out ``out_dir``'s finished requests (so a writer there takes this plan)."""
        return self.out_dir is not None and self.out_dir.resolve() == Path(out_dir).resolve()

    @property
    def pending(self) -> list[str]:
        return [i for i in self.ids if self.finished is None or i not in self.finished]

    @property
    def skipped(self) -> int:
        return len(self.ids) - len(self.pending)
