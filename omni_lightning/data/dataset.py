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
numbers the repeats (``a``, ``a#2``, ``a#3``, skipping ids that exist). Ids and files come from
``sources.py``, which the command line also uses before torch loads. ``skip``: ids left out (a
resumed job's finished requests, see ``output_folder.py``): their files are never opened.

Every entry is checked when the dataset is built and again, fully, when it is loaded (a tensor in
memory whose version counter shows no write since its check is not read again: a batch's codes are
checked once more by the module before any lookup). With
``on_bad_input="raise"`` the build reads every file and stops, listing every bad entry, before
anything is decoded. With ``"skip"`` (what a prediction job uses) the build reads only the header of
``.npy`` and ``.safetensors`` files (shape and dtype: enough to size, sort and refuse most bad
files), so each file's codes are read once, when loaded; a request whose values turn out bad there
(codes out of range, a file changed since) becomes an error item (``{"id", "error"}``) that flows
through the batches to the writer, which records it, while the rest is predicted. Any exception from
one request's files is that request's failure, never the run's.

Audio (paired data for fine-tuning and evaluation) is read with soundfile, mixed to mono, resampled
with torchaudio to the model's rate when it differs, and aligned to the codes by this rule: request
i's target is the first ``output_length(n_frames)`` samples of its audio; longer audio is cut; shorter
audio is zero-padded and ``audio_length`` marks the real samples, so the pad never enters a loss.
"""

from __future__ import annotations

import random
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from omni_lightning.data.files import CODE_SUFFIXES
from omni_lightning.data.io import check_audio, codes_file_layout, load_audio, load_codes_file
from omni_lightning.data.sources import Entry, list_source, unique_ids
from omni_lightning.errors import UsageError
from omni_lightning.models import Code2WavConfig, resolve_config, validate_codes
from omni_lightning.models.codes import check_codes_layout

BAD_INPUT_MODES = ("raise", "skip")


def check_layout(codes: Any, config: Code2WavConfig, req_id: str) -> torch.Tensor:
    """One request's codes as ``[Q, T]`` after the checks that read no value (type, dtype, shape,
    codebook count, emptiness); works on meta tensors. ValueError naming the request."""
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"request {req_id!r}: codes must be a tensor, got {type(codes).__name__}")
    if codes.dtype == torch.bool or codes.is_floating_point() or codes.is_complex():
        raise ValueError(f"request {req_id!r}: codes have dtype {str(codes.dtype).replace('torch.', '')}; "
                         "codes must be integers (int8 ... int64 or uint8 ... uint64)")  # fmt: skip
    if codes.dim() == 3 and codes.shape[0] == 1:
        codes = codes[0]
    if codes.dim() != 2:
        raise ValueError(f"request {req_id!r}: codes must have shape [codebooks, frames], got {tuple(codes.shape)}")
    check_codes_layout(codes[None], config, req_ids=[req_id])
    return codes


def check_request(codes: Any, config: Code2WavConfig, req_id: str, values: bool = True) -> torch.Tensor:
    """One request's codes as Long ``[Q, T]`` (any integer dtype widened), or a ValueError naming it.
    ``values=False``: the layout only (values checked before and unchanged since)."""
    codes = check_layout(codes, config, req_id)
    if not values:
        return codes.to(device="cpu", dtype=torch.long)
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
    span) per item; shorter requests are kept whole. Once ``set_epoch`` is called (the data module's
    batch sampler does, each epoch) a crop is drawn from ``(seed, epoch, index)`` alone, so a fit
    resumed from a checkpoint takes the crops of an uninterrupted one, on any rank, with or without
    loader workers (the data module's training loader starts them once the epoch is set; see
    ``datamodule.StartsAtFirstBatch``). Before ``set_epoch``, crops come from a generator (per loader
    worker, see ``_crop_rng``).
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
        skip: Collection[str] = (),
        paired: bool = False,
    ) -> None:
        if on_bad_input not in BAD_INPUT_MODES:
            raise UsageError(f"on_bad_input must be one of {BAD_INPUT_MODES}, got {on_bad_input!r}")
        if crop_frames is not None and crop_frames < 1:
            raise UsageError(f"crop_frames must be >= 1, got {crop_frames}")
        self.config = resolve_config(config)
        self.on_bad_input = on_bad_input
        self.load_audio = load_audio
        self.crop_frames = crop_frames
        self.seed, self._rng = seed, random.Random(seed)
        self.epoch: int | None = None  # set by set_epoch: crops keyed on (seed, epoch, index)
        self.source = source if isinstance(source, (str, Path)) else "<memory>"
        self.unread: list[Path] = []  # files of a source folder that are not code files
        if isinstance(source, (str, Path)):
            self.entries, self.unread = list_source(source, duplicate_ids)
        else:
            if not hasattr(source, "__iter__"):
                raise UsageError(f"a data source is a folder, a JSONL manifest, or a list or dict of codes; got "
                                 f"{type(source).__name__} {source!r:.60}")  # fmt: skip
            items = source.items() if isinstance(source, Mapping) else enumerate(source)
            self.entries = [Entry(str(k), v) for k, v in items]
            unique_ids(self.entries, self.source, duplicate_ids)
        if self.unread:
            from lightning.fabric.utilities.rank_zero import rank_zero_warn

            suffixes = ", ".join(CODE_SUFFIXES)
            what = f"not code files ({suffixes}) or links to folders"
            rank_zero_warn(f"{_listing(self.unread, self.source)} not read: {what}")
        self.skipped = [e.id for e in self.entries if e.id in skip]  # finished already: never opened
        if self.skipped:
            self.entries = [e for e in self.entries if e.id not in skip]
        for entry in self.entries:
            if entry.error is None:
                self._scan(entry)
        if paired:  # fit, validate and test compare with the audio: a request without it is bad input
            if self.entries and all(e.audio is None for e in self.entries):
                raise UsageError(f"{self.source} has no audio: fit, validate and test need paired data, a "
                                 "manifest whose lines have an 'audio' path")  # fmt: skip
            for entry in self.entries:
                if entry.error is None and entry.audio is None:
                    entry.error = "no 'audio' path in its manifest line: fit, validate and test compare against it"
        bad = [e for e in self.entries if e.error is not None]
        if bad and on_bad_input == "raise":
            lines = "\n".join(f"  {e.id}: {e.error}" for e in bad)
            raise UsageError(f"{len(bad)} bad request(s) in {self.source}:\n{lines}")

    def _scan(self, entry: Entry) -> None:
        try:
            # a file's header first, in either mode: a corrupt one is named by what is wrong with it
            layout = codes_file_layout(entry.codes) if isinstance(entry.codes, Path) else None
            codes = check_layout(layout, self.config, entry.id) if layout is not None else None
            if codes is None or self.on_bad_input == "raise":  # raise: the values too, before any compute
                codes = self._load_codes(entry)
            entry.n_frames = codes.shape[-1]
            if entry.audio is not None and self.load_audio:
                check_audio(entry.audio)
        except Exception as err:  # whatever one request's files hold, it is that request's failure
            entry.error = _reason(err)

    def _load_codes(self, entry: Entry) -> torch.Tensor:
        if isinstance(entry.codes, Path):
            return check_request(load_codes_file(entry.codes), self.config, entry.id)
        # a tensor in memory whose values passed and have not been written since (its version counter
        # counts in-place writes) is not read again: a 600 s request's check cost 16 ms on the H200 host.
        # An inference tensor (made under torch.inference_mode) has no version counter: checked every time.
        codes = entry.codes
        tracked = isinstance(codes, torch.Tensor) and not codes.is_inference()
        version = codes._version if tracked else None
        trusted = version is not None and version == entry.checked_version
        out = check_request(codes, self.config, entry.id, values=not trusted)
        entry.checked_version = version
        return out

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _crop_rng(self, index: int) -> random.Random:
        """After ``set_epoch``, a generator of ``(seed, epoch, index)``. Before it, in a loader worker, a
        generator seeded by torch's per-worker, per-epoch seed (each worker holds a copy of this
        dataset, and copies of one generator would crop alike in every worker and every epoch)."""
        from torch.utils.data import get_worker_info

        if self.epoch is not None:  # a str seed is hashed with SHA-512: the same in every process
            return random.Random(f"{self.seed}:{self.epoch}:{index}")
        info = get_worker_info()
        if info is None:
            return self._rng
        if getattr(self, "_worker_seed", None) != info.seed:
            self._worker_seed, self._worker_rng = info.seed, random.Random(info.seed)
        return self._worker_rng

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
            last = codes.shape[-1] - self.crop_frames
            if audio is not None:  # a crop starts inside the real audio: past its end the target is all padding
                covered = -(-audio.shape[0] // self.config.total_upsample)  # frames the audio reaches into
                last = max(0, min(last, covered - self.crop_frames))
            start = self._crop_rng(index).randrange(last + 1)
            item["codes"] = codes = codes[:, start : start + self.crop_frames]
        if audio is not None:
            # the rule: request samples [start * up, start * up + output_length(n)) of the audio
            offset = start * self.config.total_upsample
            target = self.config.output_length(codes.shape[-1])
            span = audio[offset : offset + target]
            item["audio_length"] = span.shape[0]
            item["audio"] = torch.nn.functional.pad(span, (0, target - span.shape[0]))
        return item


def _reason(err: Exception, limit: int = 300) -> str:
    """A failure's reason, one line: our own ValueErrors say it all; anything else also names its
    type. Only the first line of a library's message is kept (torch's unpickling errors run to
    paragraphs, with terminal colour codes), cut at ``limit`` characters."""
    text = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
    line = re.sub(r"\x1b\[[0-9;]*m", "", text).strip().splitlines()[0] if text.strip() else type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _listing(paths: Sequence[Path], folder: Any, limit: int = 10) -> str:
    names = [str(p.relative_to(folder)) if isinstance(folder, (str, Path)) else str(p) for p in paths[:limit]]
    more = f", ... ({len(paths) - limit} more)" if len(paths) > limit else ""
    return f"{len(paths)} file(s) in {folder} ({', '.join(names)}{more})"
