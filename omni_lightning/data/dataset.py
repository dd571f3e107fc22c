"""``CodesDataset``: requests of codec codes (and, for fit, validate and test, their audio) from a
manifest, a folder or memory.

Sources:
- a JSONL manifest, one request a line: ``{"id": "utt1", "codes": "codes/utt1.npy", "audio": "wav/utt1.wav"}``
  (paths relative to the manifest's folder; ``audio`` optional; no ``id``: the codes file's stem);
- a folder of code files (``.npy``, ``.pt``, ``.safetensors``), subfolders included, the id being the
  file's relative path without its suffix (``x/a.npy`` -> ``x/a``); any other file is listed
  (``unread`` and a warning), never skipped silently;
- in memory: a list (ids ``"0"``, ``"1"``, ...) or a dict id -> value, each value codes ``[Q, T]`` or
  a ``(codes, audio)`` pair; tensors or NumPy arrays. Audio in memory is float ``[n]`` or ``[1, n]``
  at the model's sample rate (``config.sample_rate``); it is not resampled.
Codes are one integer array ``[Q, T]`` (``[1, Q, T]`` accepted) of any integer dtype, widened to int64
on the CPU; a float, bool or complex array is a bad request naming its dtype.

Ids must be unique: ``duplicate_ids="error"`` refuses the source, listing every repeated id;
``"rename"`` numbers the repeats (``a``, ``a#2``, ...). ``skip``: ids left out, never opened.

Every entry is checked at the build (``on_bad_input="raise"``: every file read, every bad entry
listed; ``"skip"``: only the header of ``.npy`` and ``.safetensors`` files) and fully when loaded (a
tensor in memory unwritten since its check is not read again). A request that fails when loaded
becomes an error item that flows to the writer; any exception from one request's data is that
request's failure, never the run's.

Audio files are read with soundfile, mixed to mono and resampled to the model's rate. The alignment
rule, for files and memory alike: a request's target is the first ``output_length(n_frames)``
samples of its audio; longer audio is cut; shorter audio is zero-padded and ``audio_length`` marks
the real samples, so the pad never enters a loss. Pairs whose audio looks wrong (far from its codes'
length, or past [-1, 1]: ``io.scan_audio``) are named in one warning at the build.
"""

from __future__ import annotations

import random
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.utils.data import Dataset

from omni_lightning.data.files import CODE_SUFFIXES
from omni_lightning.data.io import codes_file_layout, in_memory, load_audio, load_codes_file, scan_audio, warn_audio
from omni_lightning.data.sources import Entry, list_source, relative_path_hint, unique_ids
from omni_lightning.errors import UsageError
from omni_lightning.models import Code2WavConfig, resolve_config
from omni_lightning.models.codes import CheckedCodes, check_request_codes, geometry

BAD_INPUT_MODES = ("raise", "skip")


def check_request(codes: Any, config: Code2WavConfig, req_id: str, values: bool = True) -> torch.Tensor:
    """One request's codes as int64 ``[Q, T]`` on the CPU, or a ValueError naming it (see
    ``check_request_codes``; ``values=False``: the layout only)."""
    return check_request_codes(codes, config, f"request {req_id!r}", values=values).cpu()


def _memory_entry(req_id: str, value: Any) -> Entry:
    """An entry of a source in memory: codes, or a ``(codes, audio)`` pair."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            kind = type(value).__name__
            codes = f"codes alone must be a tensor or NumPy array [codebooks, frames], not a {kind}"
            return Entry(req_id, None, error=f"a pair is (codes, audio), got a {kind} of {len(value)}; {codes}")
        return Entry(req_id, value[0], value[1])
    return Entry(req_id, value)


class CodesDataset(Dataset):
    """Requests of codec codes, and for fit, validate and test their audio; see the module docstring
    for sources, checks and the audio rule. Items are ``{"id", "codes": Long[Q, T]}`` (paired:
    ``"audio": Float[output_length(T)]``, ``"audio_length"``), or ``{"id", "error"}`` for a bad
    request kept by ``on_bad_input="skip"``. Items carry a ``"checked"`` mark (``CheckedCodes``).

    Args:
        source: a folder of code files, a JSONL manifest, a list or dict (id -> value) of codes
            ``[Q, T]``, or of ``(codes, audio)`` pairs (audio ``[n]`` or ``[1, n]`` at the model's rate).
        config: the preset name or config whose codebook geometry the codes are checked against.
        on_bad_input: ``"raise"`` stops at the build, listing every bad request; ``"skip"`` turns each
            into an error item.
        load_audio: read the audio of paired sources (False: codes only).
        crop_frames: training crops: a random window of that many frames (and its audio) per item;
            shorter requests are kept whole.
        seed: seeds the crops; after ``set_epoch`` a crop depends on ``(seed, epoch, index)`` only, so a
            resumed fit takes the crops of an uninterrupted one, with or without loader workers.
        duplicate_ids: ``"error"`` refuses repeated ids; ``"rename"`` numbers the repeats.
        skip: ids left out unread (a resumed job's finished requests).
        paired: every request must have audio (fit, validate and test); one without it is bad input.
    """

    def __init__(
        self,
        source: str | Path | Sequence[Any] | Mapping[str, Any],
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
        self.doubtful: list[str] = []  # pairs whose audio looks wrong (io.scan_audio)
        if isinstance(source, (str, Path)):
            self.entries, self.unread = list_source(source, duplicate_ids)
        else:
            if not hasattr(source, "__iter__"):
                raise UsageError(
                    "a data source is a folder, a JSONL manifest, or a list or dict of codes or (codes, audio) "
                    f"pairs; got {type(source).__name__} {source!r:.60}"
                )
            shape = getattr(source, "shape", None)  # a tensor or array: a batch, one request a row
            if shape is not None and len(shape) != 3:
                raise UsageError(
                    f"a {type(source).__name__} source is a batch [requests, codebooks, frames], got shape "
                    f"{tuple(shape)}: give one request [codebooks, frames] as [codes] or {{id: codes}}"
                )
            items = source.items() if isinstance(source, Mapping) else enumerate(source)
            self.entries = [_memory_entry(str(k), v) for k, v in items]
            unique_ids(self.entries, self.source, duplicate_ids)
        if self.unread:
            suffixes = ", ".join(CODE_SUFFIXES)
            what = f"not code files ({suffixes}), hidden, or links to folders"
            rank_zero_warn(f"{_listing(self.unread, self.source)} not read: {what}")
        self.skipped = [e.id for e in self.entries if e.id in skip]  # finished already: never opened
        if self.skipped:
            self.entries = [e for e in self.entries if e.id not in skip]
        for entry in self.entries:
            if entry.error is None:
                self._scan(entry)
        if self.doubtful:
            warn_audio(self.doubtful, self.source)
        if paired:  # fit, validate and test compare with the audio: a request without it is bad input
            self._require_audio()
        bad = [e for e in self.entries if e.error is not None]
        if bad and on_bad_input == "raise":
            lines = "\n".join(f"  {e.id}: {e.error}" for e in bad)
            raise UsageError(f"{len(bad)} bad request(s) in {self.source}:\n{lines}")

    def _require_audio(self) -> None:
        files = any(isinstance(e.codes, Path) for e in self.entries)
        if self.entries and all(e.audio is None for e in self.entries):
            given = "a manifest whose lines have an 'audio' path" if files else "(codes, audio) pairs"
            raise UsageError(f"{self.source} has no audio: fit, validate and test need paired data, {given}")
        missing = "no 'audio' path in its manifest line" if files else "codes without audio, not a (codes, audio) pair"
        for entry in self.entries:
            if entry.error is None and entry.audio is None:
                entry.error = f"{missing}: fit, validate and test compare against it"

    def _scan(self, entry: Entry) -> None:
        try:
            # a file's header first, in either mode: a corrupt one is named by what is wrong with it
            layout = codes_file_layout(entry.codes) if isinstance(entry.codes, Path) else None
            who = f"request {entry.id!r}"
            codes = check_request_codes(layout, self.config, who, values=False) if layout is not None else None
            if codes is None or self.on_bad_input == "raise":  # raise: the values too, before any compute
                codes = self._load_codes(entry)
            entry.n_frames = codes.shape[-1]
            if entry.audio is not None and self.load_audio:
                values = self.on_bad_input == "raise"  # a float file's samples too, as the codes' values
                entry.audio, doubt = scan_audio(entry.audio, entry.id, entry.n_frames, self.config, values)
                self.doubtful += [f"{entry.id} ({doubt})"] if doubt else []
        except Exception as err:  # whatever one request's files hold, it is that request's failure
            entry.error = _reason(err) + relative_path_hint(self.source, entry)

    def _load_codes(self, entry: Entry) -> torch.Tensor:
        if isinstance(entry.codes, Path):
            return check_request(load_codes_file(entry.codes), self.config, entry.id)
        # a tensor in memory whose values passed and have not been written since (its version counter
        # counts in-place writes) is not read again; an inference tensor has none: checked every time
        codes = entry.codes = in_memory(entry.codes, f"request {entry.id!r}: codes")
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
        return any(isinstance(e.codes, Path) or isinstance(e.audio, Path) for e in self.entries)

    @property
    def has_audio(self) -> bool:
        return any(e.audio is not None for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, Any]:
        entry = self.entries[index]
        if entry.error is not None:
            return {"id": entry.id, "error": entry.error}
        with torch.inference_mode(False):  # plain tensors: the "checked" mark reads their version counters
            try:  # files can change after the scan
                codes = self._load_codes(entry)
                audio = self._audio(entry)
            except Exception as err:  # whatever one request's files hold, it is that request's failure
                if self.on_bad_input == "raise":
                    raise
                return {"id": entry.id, "error": _reason(err)}
            return self._item(index, entry.id, codes, audio)

    def _audio(self, entry: Entry) -> torch.Tensor | None:
        if entry.audio is None or not self.load_audio:
            return None
        if isinstance(entry.audio, Path):
            return load_audio(entry.audio, self.config.sample_rate)
        return entry.audio  # checked at the build (audio_tensor)

    def _item(self, index: int, req_id: str, codes: torch.Tensor, audio: torch.Tensor | None) -> dict[str, Any]:
        start = 0
        if self.crop_frames is not None and codes.shape[-1] > self.crop_frames:
            last = codes.shape[-1] - self.crop_frames
            if audio is not None:  # a crop starts inside the real audio: past its end the target is all padding
                covered = -(-audio.shape[0] // self.config.total_upsample)  # frames the audio reaches into
                last = max(0, min(last, covered - self.crop_frames))
            start = self._crop_rng(index).randrange(last + 1)
            codes = codes[:, start : start + self.crop_frames]
        item: dict[str, Any] = {"id": req_id, "codes": codes, "checked": CheckedCodes(codes, geometry(self.config))}
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
