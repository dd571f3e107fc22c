"""Which files of an input folder are requests. Standard library only: the CLI checks a folder with it
before torch or Lightning is imported.

Every code file under the folder is a request, subfolders included (``x/a.npy`` has the id ``x/a``).
Every other file is listed as not read (never dropped silently); the dataset reports them.
Symbolic links to folders are not followed (a link cycle cannot make a scan endless, and a link
cannot pull in files from outside the folder): they are listed as not read too. So are hidden files
and folders (a name starting with ``.``: macOS's ``._a.npy`` resource forks, ``.ipynb_checkpoints/``),
whose contents are not read.
"""

from __future__ import annotations

import os
from pathlib import Path

CODE_SUFFIXES = (".npy", ".pt", ".safetensors")


def scan_folder(folder: str | Path) -> tuple[list[tuple[str, Path]], list[Path]]:
    """``([(id, code file), ...], [other files])`` under ``folder``, both sorted.

    The id is the file's path relative to ``folder`` in POSIX form, without its suffix.
    """
    folder = Path(folder)
    codes: list[tuple[str, Path]] = []
    others: list[Path] = []
    for root, dirs, files in os.walk(folder):
        skipped = {d for d in dirs if d.startswith(".") or os.path.islink(os.path.join(root, d))}
        dirs[:] = sorted(set(dirs) - skipped)  # os.walk descends only into what is left here
        others.extend(Path(root) / d for d in sorted(skipped))
        for name in sorted(files):
            path = Path(root) / name
            if path.suffix in CODE_SUFFIXES and not name.startswith("."):
                codes.append((path.relative_to(folder).with_suffix("").as_posix(), path))
            else:
                others.append(path)
    return codes, others


def torch_save_format(path: str | Path) -> str | None:
    """How ``path`` begins: as ``torch.save``'s zip archive (``"zip"``), as its legacy pickle
    (``"pickle"``), or as neither, or unreadable (None)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return None
    return "zip" if head == b"PK\x03\x04" else "pickle" if head.startswith(b"\x80") else None
