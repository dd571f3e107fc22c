"""The requests a data source lists, without reading any code file: each request's id, files and where
it comes from (a folder's code files, a JSONL manifest's lines), repeated ids refused or numbered.

Standard library only: the command line lists a job with it before torch loads (a rerun with nothing
left to do ends there), and ``CodesDataset`` builds its entries with it, so both see the same ids.
What it does not do: open a code file (``CodesDataset`` checks them) or look at an output folder
(``output_folder.py`` decides what is finished).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_lightning.data.files import CODE_SUFFIXES, scan_folder
from omni_lightning.errors import UsageError

DUPLICATE_ID_MODES = ("error", "rename")
SOURCE_FIX = f"give a folder of code files ({', '.join(CODE_SUFFIXES)}) or a JSONL manifest"


@dataclass
class Entry:
    id: str
    codes: Any  # a Path, or codes held in memory
    audio: Any = None  # a Path, audio held in memory, or None
    n_frames: int = 0
    error: str | None = None
    where: str = ""  # "line 3" of a manifest, a file of a folder: where a duplicate id comes from
    checked_version: int | None = None  # a tensor in memory: its version counter when its values passed


def list_source(
    source: str | Path, duplicate_ids: str = "error", name: str = "data source"
) -> tuple[list[Entry], list[Path]]:
    """``(entries, unread files)`` of a folder or a manifest, ids made unique (see :func:`unique_ids`).

    UsageError naming ``name`` and the source when it is neither (see :func:`check_source`), a folder
    holds no code file or a manifest no request.
    """
    path = Path(source)
    unread: list[Path] = []
    if path.is_dir():
        files, unread = scan_folder(path)
        if not files:
            raise _no_code_files(name, source, unread)
        entries = [Entry(req_id, p, where=str(p.relative_to(path))) for req_id, p in files]
    else:
        if not path.exists() or path.suffix in CODE_SUFFIXES:
            check_source(name, source)  # raises, saying which; a manifest is read once, below
        entries = read_manifest_entries(path)  # a bad line is one bad entry; unreadable or empty: UsageError
    unique_ids(entries, source, duplicate_ids)
    return entries, unread


def check_source(flag: str, value: str | Path) -> None:
    """A data source: a folder holding code files, or a non-empty JSONL manifest whose first non-blank
    line is a JSON object (the command line's guard against a file of another kind; a dataset reads
    such a line as one bad entry). UsageError naming ``flag`` and ``value`` otherwise (a single code
    file, a binary or unreadable file, ...)."""
    path = Path(value)
    if not path.exists():
        pattern = " (a pattern is not expanded)" if any(c in str(value) for c in "*?[") else ""
        raise UsageError(f"{flag} {value} does not exist{pattern}: {SOURCE_FIX}")
    if path.is_dir():
        codes, others = scan_folder(path)
        if not codes:
            raise _no_code_files(flag, value, others)
        return
    if path.suffix in CODE_SUFFIXES:
        raise UsageError(f"{flag} {value} is a single code file: give its folder, or a JSONL manifest listing it")
    try:
        with open(path, encoding="utf-8-sig") as f:
            first = next((line for line in f if line.strip() and not line.lstrip().startswith("#")), None)
    except (OSError, UnicodeDecodeError) as err:
        problem = type(err).__name__
        raise UsageError(f"{flag} {value} cannot be read as a JSONL manifest ({problem}): {SOURCE_FIX}") from err
    if first is None:
        raise UsageError(
            f"{flag} {value} is empty: a manifest lists one JSON request per line, e.g. "
            '{"id": "utt1", "codes": "codes/utt1.npy"}'
        )
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        row = None
    if not isinstance(row, dict):
        raise UsageError(f"{flag} {value} is not a JSONL manifest (its first line is not a JSON object): {SOURCE_FIX}")


def _no_code_files(flag: str, value: str | Path, others: list[Path]) -> UsageError:
    seen = f" (it holds {len(others)} other file(s), e.g. {others[0].name})" if others else " (it is empty)"
    return UsageError(f"{flag} {value} holds no code files{seen}: {SOURCE_FIX}")


def read_manifest_entries(path: Path) -> list[Entry]:
    """One entry per non-blank line; a line that is not a JSON object, names no codes or has an id that
    is not a string or number is a bad entry (its id ``line-<n>`` or its own), never the end of the
    job. No ``id`` (or ``""``): the codes file's stem."""
    entries = []
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"manifest {path} cannot be read as UTF-8 JSON lines ({type(err).__name__}: {err})") from err
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):  # a blank line or a comment
            continue
        where = f"line {line_no}"
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            reason = f"{path}:{line_no}: invalid JSON ({err})"
            entries.append(Entry(f"line-{line_no}", Path(), error=reason, where=where))
            continue
        codes = row.get("codes")
        req_id = row.get("id")
        if isinstance(req_id, bool) or not isinstance(req_id, (str, int, float, type(None))):
            reason = f"{path}:{line_no}: 'id' must be a string (or a number), got {json.dumps(req_id)}"
            entries.append(Entry(f"line-{line_no}", Path(), error=reason, where=where))
            continue
        req_id = str(req_id) if req_id not in (None, "") else (Path(codes).stem if isinstance(codes, str) else "")
        req_id = req_id or f"line-{line_no}"
        if not isinstance(codes, str):
            entries.append(Entry(req_id, Path(), error=f"{path}:{line_no}: no 'codes' path", where=where))
            continue
        audio = row.get("audio")
        entries.append(Entry(req_id, path.parent / codes, path.parent / audio if audio else None, where=where))
    if not entries:
        raise UsageError(f"manifest {path} lists no request")
    return entries


def relative_path_hint(source: Any, entry: Entry) -> str:
    """For a manifest's request whose file is missing: a hint when its path, taken from the current
    folder rather than the manifest's, names a file (a manifest's paths are relative to its folder)."""
    folder = Path(source).parent if isinstance(source, (str, Path)) and Path(source).is_file() else None
    for path in (entry.codes, entry.audio) if folder is not None and folder != Path(".") else ():
        given = path.relative_to(folder) if isinstance(path, Path) and path.is_relative_to(folder) else None
        if given is not None and not path.exists() and given.exists():
            return f" (paths in a manifest are relative to its folder {folder}; {given} is relative to the current one)"
    return ""


def unique_ids(entries: list[Entry], source: Any, duplicate_ids: str = "error") -> None:
    """Refuses repeated ids (``"error"``: UsageError listing each with where it occurs) or numbers the
    repeats (``"rename"``: the first keeps its id, then ``a#2``, ``a#3``, skipping ids that exist)."""
    if duplicate_ids not in DUPLICATE_ID_MODES:
        raise UsageError(f"duplicate_ids must be one of {DUPLICATE_ID_MODES}, got {duplicate_ids!r}")
    places: dict[str, list[Entry]] = {}
    for entry in entries:
        places.setdefault(entry.id, []).append(entry)
    repeated = {req_id: group for req_id, group in places.items() if len(group) > 1}
    if not repeated:
        return
    if duplicate_ids == "error":
        shown = [f"  {req_id!r}: {', '.join(e.where or '?' for e in group)}" for req_id, group in repeated.items()]
        more = [f"  ... ({len(shown) - 20} more)"] if len(shown) > 20 else []
        raise UsageError(
            f"{len(repeated)} request id(s) occur more than once in {source}; each id names one request (in "
            "predict, its output file), so nothing was read. Make the ids unique, or number the repeats with "
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
