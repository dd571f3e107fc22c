"""``CodesDataset``: requests of codec codes (and, for training, their audio) from a manifest, a folder
or tensors in memory.

Sources:
- a JSONL manifest, one request a line: ``{"id": "utt1", "codes": "codes/utt1.npy", "audio": "wav/utt1.wav"}``
  (paths relative to the manifest's folder; ``audio`` optional; no ``id``: the codes file's stem);
- a folder of code files (``.npy``, ``.pt``, ``.safetensors``), subfolders included, the id being the
  file's relative path without its suffix (``x/a.npy`` -> ``x/a``); any other file in it is not read
  and is listed (``unread`` and a warning), never skipped silently;
- a list of tensors (ids ``"0"``, ``"1"``, ...) or a dict id -> tensor.
Each codes file holds one integer array ``[Q, T]`` (``[1, Q, T]`` is accepted) of any integer dtype
(int8 ... int64, uint8 ... uint64); it is widened to int64 on load, on the CPU, before its range is
checked. A float, bool or complex file is a bad request naming its dtype.

Ids must be unique: ``duplicate_ids="error"`` (default) refuses the whole source before anything is
decoded, listing every repeated id and where it occurs; ``"rename"`` keeps the first occurrence's id and
numbers the repeats (``a``, ``a#2``, ``a#3``, skipping ids that exist).

Every entry is checked once when the dataset is built (file readable, integer ``[Q, T]``, codes in
range, audio readable) and again when it is loaded. Any exception from one request's files is that
request's failure, never the run's. ``on_bad_input="raise"`` stops at construction, listing every bad
entry; ``"skip"`` keeps bad entries as error items (``{"id", "error"}``) that flow through the batches
to the writer, which records them, while the rest is predicted.

Audio (paired data for fine-tuning and evaluation) is read with soundfile, mixed to mono, resampled
with torchaudio to the model's rate when it differs, and aligned to the codes by this rule: request
i's target is the first ``output_length(n_frames)`` samples of its audio; longer audio is cut; shorter
audio is zero-padded and ``audio_length`` marks the real samples, so the pad never enters a loss.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from omni_lightning.data.files import CODE_SUFFIXES, scan_folder
from omni_lightning.data.io import check_audio, load_audio, load_codes_file
from omni_lightning.models import Code2WavConfig, resolve_config, validate_codes

BAD_INPUT_MODES = ("raise", "skip")
DUPLICATE_ID_MODES = ("error", "rename")


@dataclass
class Entry:
    id: str
    codes: Path | torch.Tensor
    audio: Path | None = None
    n_frames: int = 0
    error: str | None = None
    where: str = ""  # "line 3" of a manifest, a file of a folder: where a duplicate id comes from


def check_request(codes: Any, config: Code2WavConfig, req_id: str) -> torch.Tensor:
    """One request's codes as Long ``[Q, T]`` (any integer dtype widened), or a ValueError naming it."""
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"request {req_id!r}: codes must be a tensor, got {type(codes).__name__}")
    if codes.dtype == torch.bool or codes.is_floating_point() or codes.is_complex():
        raise ValueError(f"request {req_id!r}: codes have dtype {str(codes.dtype).replace('torch.', '')}; "
                         "codes must be integers (int8 ... int64 or uint8 ... uint64)")  # fmt: skip
    if codes.dim() == 3 and codes.shape[0] == 1:
        codes = codes[0]
    if codes.dim() != 2:
        raise ValueError(f"request {req_id!r}: codes must have shape [codebooks, frames], got {tuple(codes.shape)}")
    if codes.dtype == torch.uint64 and codes.numel():  # values past int64's range would wrap negative
        top = int(codes.numpy().max())
        if top >= config.codebook_size:
            raise ValueError(f"request {req_id!r}: code {top} is outside [0, {config.codebook_size})")
    codes = codes.to(device="cpu", dtype=torch.long)
    validate_codes(codes[None], config, req_ids=[req_id])
    return codes


class CodesDataset(Dataset):
    """Requests of codec codes; see the module docstring for sources, checks and the audio rule.

    ``crop_frames``: training crops: a random window of that many frames (with the matching audio
    span) per item; shorter requests are kept whole.
    """

    def __init__(
        self,
        source: str | Path | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        config: Code2WavConfig | str = "qwen3-omni",
        on_bad_input: str = "raise",
        load_audio: bool = True,
        crop_frames: int | None = None,
        seed: int = 0,
        duplicate_ids: str = "error",
    ) -> None:
        if on_bad_input not in BAD_INPUT_MODES:
            raise ValueError(f"on_bad_input must be one of {BAD_INPUT_MODES}, got {on_bad_input!r}")
        if duplicate_ids not in DUPLICATE_ID_MODES:
            raise ValueError(f"duplicate_ids must be one of {DUPLICATE_ID_MODES}, got {duplicate_ids!r}")
        if crop_frames is not None and crop_frames < 1:
            raise ValueError(f"crop_frames must be >= 1, got {crop_frames}")
        self.config = resolve_config(config)
        self.on_bad_input = on_bad_input
        self.load_audio = load_audio
        self.crop_frames = crop_frames
        self._rng = random.Random(seed)
        self.source = source if isinstance(source, (str, Path)) else "<memory>"
        self.unread: list[Path] = []  # files of a source folder that are not code files
        self.entries = self._entries(source)
        _unique_ids(self.entries, self.source, rename=duplicate_ids == "rename")
        if self.unread:
            from lightning.fabric.utilities.rank_zero import rank_zero_warn

            suffixes = ", ".join(CODE_SUFFIXES)
            rank_zero_warn(f"{_listing(self.unread, self.source)} not read: not code files ({suffixes})")
        for entry in self.entries:
            if entry.error is None:
                self._scan(entry)
        bad = [e for e in self.entries if e.error is not None]
        if bad and on_bad_input == "raise":
            lines = "\n".join(f"  {e.id}: {e.error}" for e in bad)
            raise ValueError(f"{len(bad)} bad request(s) in {self.source}:\n{lines}")

    def _entries(self, source: Any) -> list[Entry]:
        if isinstance(source, Mapping):
            return [Entry(str(k), v) for k, v in source.items()]
        if isinstance(source, (list, tuple)):
            return [Entry(str(i), v) for i, v in enumerate(source)]
        path = Path(source)
        if path.is_dir():
            files, self.unread = scan_folder(path)
            if not files:
                raise ValueError(f"no code files ({', '.join(CODE_SUFFIXES)}) in {path}")
            return [Entry(req_id, p, where=str(p.relative_to(path))) for req_id, p in files]
        if path.is_file():
            return _read_manifest(path)
        raise ValueError(f"data source {path} is neither a manifest file nor a folder")

    def _scan(self, entry: Entry) -> None:
        try:
            codes = self._load_codes(entry)
            entry.n_frames = codes.shape[-1]
            if entry.audio is not None and self.load_audio:
                check_audio(entry.audio)
        except Exception as err:  # whatever one request's files hold, it is that request's failure
            entry.error = _reason(err)

    def _load_codes(self, entry: Entry) -> torch.Tensor:
        codes = load_codes_file(entry.codes) if isinstance(entry.codes, Path) else entry.codes
        return check_request(codes, self.config, entry.id)

    def _crop_rng(self) -> random.Random:
        """In a loader worker, a generator seeded by torch's per-worker, per-epoch seed: each worker
        holds a copy of this dataset, and copies of one generator would crop alike in every worker
        and every epoch."""
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is None:
            return self._rng
        if getattr(self, "_worker_seed", None) != info.seed:
            self._worker_seed, self._worker_rng = info.seed, random.Random(info.seed)
        return self._worker_rng

    def drop(self, ids: set[str]) -> int:
        """Removes the entries with these ids (a resumed run's finished requests); returns how many."""
        before = len(self.entries)
        self.entries = [e for e in self.entries if e.id not in ids]
        return before - len(self.entries)

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.entries]

    @property
    def lengths(self) -> list[int]:
        """Frames per entry (0 for bad entries), for length bucketing."""
        return [e.n_frames for e in self.entries]

    @property
    def bad(self) -> dict[str, str]:
        return {e.id: e.error for e in self.entries if e.error is not None}

    @property
    def reads_files(self) -> bool:
        """Whether loading an item reads a file (else every item is already in memory)."""
        return any(isinstance(e.codes, Path) or e.audio is not None for e in self.entries)

    @property
    def has_audio(self) -> bool:
        return any(e.audio is not None for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, Any]:
        entry = self.entries[index]
        if entry.error is not None:
            return {"id": entry.id, "error": entry.error}
        try:  # files can change after the scan
            codes = self._load_codes(entry)
            audio = load_audio(entry.audio, self.config.sample_rate) if entry.audio and self.load_audio else None
        except Exception as err:  # whatever one request's files hold, it is that request's failure
            if self.on_bad_input == "raise":
                raise
            return {"id": entry.id, "error": _reason(err)}
        item: dict[str, Any] = {"id": entry.id, "codes": codes}
        start = 0
        if self.crop_frames is not None and codes.shape[-1] > self.crop_frames:
            start = self._crop_rng().randrange(codes.shape[-1] - self.crop_frames + 1)
            item["codes"] = codes = codes[:, start : start + self.crop_frames]
        if audio is not None:
            # the rule: request samples [start * up, start * up + output_length(n)) of the audio
            offset = start * self.config.total_upsample
            target = self.config.output_length(codes.shape[-1])
            span = audio[offset : offset + target]
            item["audio_length"] = span.shape[0]
            item["audio"] = torch.nn.functional.pad(span, (0, target - span.shape[0]))
        return item


def _reason(err: Exception) -> str:
    """A failure's reason: our own ValueErrors say it all; anything else also names its type."""
    return str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"


def _listing(paths: Sequence[Path], folder: Any, limit: int = 10) -> str:
    names = [str(p.relative_to(folder)) if isinstance(folder, (str, Path)) else str(p) for p in paths[:limit]]
    more = f", ... ({len(paths) - limit} more)" if len(paths) > limit else ""
    return f"{len(paths)} file(s) in {folder} ({', '.join(names)}{more})"


def _unique_ids(entries: list[Entry], source: Any, rename: bool) -> None:
    """Refuses repeated ids, listing each with where it occurs; or, with ``rename``, numbers the repeats."""
    places: dict[str, list[Entry]] = {}
    for entry in entries:
        places.setdefault(entry.id, []).append(entry)
    repeated = {req_id: group for req_id, group in places.items() if len(group) > 1}
    if not repeated:
        return
    if not rename:
        shown = [f"  {req_id!r}: {', '.join(e.where or '?' for e in group)}" for req_id, group in repeated.items()]
        more = [f"  ... ({len(shown) - 20} more)"] if len(shown) > 20 else []
        raise ValueError(
            f"{len(repeated)} request id(s) occur more than once in {source}; each id names one output "
            "file, so nothing was decoded. Make the ids unique, or number the repeats with "
            "duplicate_ids='rename' (CLI: --data.duplicate_ids rename):\n" + "\n".join(shown[:20] + more)
        )
    taken = set(places)
    for req_id, group in repeated.items():
        k = 2
        for entry in group[1:]:
            while f"{req_id}#{k}" in taken:
                k += 1
            entry.id = f"{req_id}#{k}"
            taken.add(entry.id)


def _read_manifest(path: Path) -> list[Entry]:
    entries = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            entries.append(Entry(f"line-{line_no}", Path(), error=f"{path}:{line_no}: invalid JSON ({err})",
                                 where=f"line {line_no}"))  # fmt: skip
            continue
        codes = row.get("codes")
        req_id = row.get("id")
        req_id = str(req_id) if req_id is not None else (Path(codes).stem if isinstance(codes, str) else "")
        req_id = req_id or f"line-{line_no}"
        where = f"line {line_no}"
        if not isinstance(codes, str):
            entries.append(Entry(req_id, Path(), error=f"{path}:{line_no}: no 'codes' path", where=where))
            continue
        audio = row.get("audio")
        entries.append(Entry(req_id, path.parent / codes, path.parent / audio if audio else None, where=where))
    if not entries:
        raise ValueError(f"manifest {path} lists no request")
    return entries
