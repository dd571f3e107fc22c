"""Which files of an input folder are requests. Standard library only: the CLI checks a folder with it
before torch or Lightning is imported.

Every code file under the folder is a request, subfolders included (``x/a.npy`` has the id ``x/a``).
Every other file is listed as not read (never dropped silently); the dataset reports them.
Symbolic links to folders are not followed (a link cycle cannot make a scan endless, and a link
cannot pull in files from outside the folder): they are listed as not read too.
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
        dirs.sort()
        others.extend(Path(root) / d for d in dirs if os.path.islink(os.path.join(root, d)))
        for name in sorted(files):
            path = Path(root) / name
            if path.suffix in CODE_SUFFIXES:
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
