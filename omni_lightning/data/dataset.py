"""``CodesDataset``: requests of codec codes (and, for training, their audio) from a manifest, a folder
or tensors in memory.

Sources:
- a JSONL manifest, one request a line: ``{"id": "utt1", "codes": "codes/utt1.npy", "audio": "wav/utt1.wav"}``
  (paths relative to the manifest's folder; ``audio`` optional);
- a folder of code files (``.npy``, ``.pt``, ``.safetensors``), the id being the file's stem;
- a list of tensors (ids ``"0"``, ``"1"``, ...) or a dict id -> tensor.
Each codes file holds one integer array ``[Q, T]`` (``[1, Q, T]`` is accepted).

Every entry is checked once when the dataset is built (file readable, integer ``[Q, T]``, codes in
range, audio readable) and again when it is loaded. ``on_bad_input="raise"`` stops at construction,
listing every bad entry; ``"skip"`` keeps bad entries as error items (``{"id", "error"}``) that flow
through the batches to the writer, which records them, while the rest is predicted.

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

from omni_lightning.data.io import CODE_SUFFIXES, check_audio, load_audio, load_codes_file
from omni_lightning.models import Code2WavConfig, resolve_config, validate_codes

BAD_INPUT_MODES = ("raise", "skip")


@dataclass
class Entry:
    id: str
    codes: Path | torch.Tensor
    audio: Path | None = None
    n_frames: int = 0
    error: str | None = None


def check_request(codes: Any, config: Code2WavConfig, req_id: str) -> torch.Tensor:
    """One request's codes as Long ``[Q, T]``, or a ValueError naming the request."""
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"request {req_id!r}: codes must be a tensor, got {type(codes).__name__}")
    if codes.dim() == 3 and codes.shape[0] == 1:
        codes = codes[0]
    if codes.dim() != 2:
        raise ValueError(f"request {req_id!r}: codes must have shape [codebooks, frames], got {tuple(codes.shape)}")
    validate_codes(codes[None], config, req_ids=[req_id])
    return codes.long()


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
    ) -> None:
        if on_bad_input not in BAD_INPUT_MODES:
            raise ValueError(f"on_bad_input must be one of {BAD_INPUT_MODES}, got {on_bad_input!r}")
        if crop_frames is not None and crop_frames < 1:
            raise ValueError(f"crop_frames must be >= 1, got {crop_frames}")
        self.config = resolve_config(config)
        self.on_bad_input = on_bad_input
        self.load_audio = load_audio
        self.crop_frames = crop_frames
        self._rng = random.Random(seed)
        self.source = source if isinstance(source, (str, Path)) else "<memory>"
        self.entries = self._entries(source)
        for entry in self.entries:
            if entry.error is None:
                self._scan(entry)
        bad = [e for e in self.entries if e.error is not None]
        if bad and on_bad_input == "raise":
            lines = "\n".join(f"  {e.id}: {e.error}" for e in bad)
            raise ValueError(f"{len(bad)} bad request(s) in {self.source}:\n{lines}")

    @staticmethod
    def _entries(source: Any) -> list[Entry]:
        if isinstance(source, Mapping):
            return [Entry(str(k), v) for k, v in source.items()]
        if isinstance(source, (list, tuple)):
            return [Entry(str(i), v) for i, v in enumerate(source)]
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in CODE_SUFFIXES and p.is_file())
            if not files:
                raise ValueError(f"no code files ({', '.join(CODE_SUFFIXES)}) in {path}")
            entries = [Entry(p.stem, p) for p in files]
        elif path.is_file():
            entries = _read_manifest(path)
        else:
            raise ValueError(f"data source {path} is neither a manifest file nor a folder")
        seen: set[str] = set()
        for entry in entries:
            if entry.id in seen and entry.error is None:
                entry.error = f"duplicate id {entry.id!r}"
            seen.add(entry.id)
        return entries

    def _scan(self, entry: Entry) -> None:
        try:
            codes = self._load_codes(entry)
            entry.n_frames = codes.shape[-1]
            if entry.audio is not None and self.load_audio:
                check_audio(entry.audio)
        except ValueError as err:
            entry.error = str(err)

    def _load_codes(self, entry: Entry) -> torch.Tensor:
        codes = load_codes_file(entry.codes) if isinstance(entry.codes, Path) else entry.codes
        return check_request(codes, self.config, entry.id)

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
        except ValueError as err:
            if self.on_bad_input == "raise":
                raise
            return {"id": entry.id, "error": str(err)}
        item: dict[str, Any] = {"id": entry.id, "codes": codes}
        start = 0
        if self.crop_frames is not None and codes.shape[-1] > self.crop_frames:
            start = self._rng.randrange(codes.shape[-1] - self.crop_frames + 1)
            item["codes"] = codes = codes[:, start : start + self.crop_frames]
        if audio is not None:
            # the rule: request samples [start * up, start * up + output_length(n)) of the audio
            offset = start * self.config.total_upsample
            target = self.config.output_length(codes.shape[-1])
            span = audio[offset : offset + target]
            item["audio_length"] = span.shape[0]
            item["audio"] = torch.nn.functional.pad(span, (0, target - span.shape[0]))
        return item


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
            entries.append(Entry(f"line-{line_no}", Path(), error=f"{path}:{line_no}: invalid JSON ({err})"))
            continue
        req_id = str(row.get("id") or (Path(row["codes"]).stem if isinstance(row.get("codes"), str) else ""))
        req_id = req_id or f"line-{line_no}"
        if not isinstance(row.get("codes"), str):
            entries.append(Entry(req_id, Path(), error=f"{path}:{line_no}: no 'codes' path"))
            continue
        audio = row.get("audio")
        entries.append(Entry(req_id, path.parent / row["codes"], path.parent / audio if audio else None))
    if not entries:
        raise ValueError(f"manifest {path} lists no request")
    return entries
