"""One predict job at a time per output folder: an advisory lock on ``<out_dir>/.omni-lightning.lock``.

Two jobs writing one folder lose work: the second one's start tidies the folder (removes the temp
files the first is writing, rewrites the manifest from what it read) while the first appends to it,
so ids end up in the manifest twice or not at all. The first job to take the lock keeps it until its
writer finishes (or the process ends: the kernel releases it, even after kill -9); another job is
refused, naming the process that holds it. The lock file holds that pid; it is removed when the lock
is released (a killed job leaves it, unlocked: the next job takes it).

Standard library only (the command line takes the lock before torch loads). Re-entrant within a
process: the command line's checks take it, the writer then finds it held. What it does not do:
lock on Windows (no ``fcntl``: nothing is locked there), or lock a folder this process cannot write
(the writer's set-up reports that folder as unusable).
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
from pathlib import Path

from omni_lightning.errors import UsageError

LOCK_NAME = ".omni-lightning.lock"
_held: dict[Path, list] = {}  # folder (resolved) -> [open lock file, owner, pid] held by this process


def lock_output_folder(out_dir: str | Path, owner: object = None) -> bool:
    """Takes ``out_dir``'s lock for this process (True), or does nothing when it cannot be taken here
    (False: no ``fcntl``, no such folder, a file system without locks). UsageError when another
    process holds it, or another ``owner`` of this process (two writers on one folder). ``owner``
    None reserves it for the first owner that asks (the command line's checks, for the job's writer).
    A rank that the holder started through ``multiprocessing`` (``ddp_spawn``, ``ddp_fork``) goes on
    without it: its job holds it."""
    try:
        import fcntl
    except ImportError:
        return False
    folder = Path(out_dir).resolve()
    held = _held.get(folder)
    if held is not None and held[2] != os.getpid():
        return False  # inherited by a fork of the holder: that process holds it for this job
    if held is not None:
        if held[1] is None or owner is None or held[1] is owner:
            held[1] = held[1] if owner is None else owner
            return True
        raise UsageError(
            f"output folder {out_dir} is in use by another writer of this process: two writers on one "
            "folder would write each request twice. Give each its own folder"
        )
    path = folder / LOCK_NAME
    while True:
        fd = _open(path)
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if err.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                return False  # no locks on this file system (ENOLCK, EOPNOTSUPP): nothing to hold
            if holder == str(os.getppid()) and multiprocessing.parent_process() is not None:
                return False  # a rank its job's launcher started (ddp_spawn): the launcher holds it
            raise UsageError(
                f"output folder {out_dir} is in use by another predict job (process {holder}): two jobs writing "
                "one folder would lose or repeat requests. Wait for it to end, or give another --out_dir"
            ) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # the holder removed that file as it released it: lock the one there now
    with contextlib.suppress(OSError):  # a lock file another user made is read-only here: locked all the same
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[folder] = [fd, owner, os.getpid()]
    return True


def _open(path: Path) -> int | None:
    """The lock file, made if missing; read-only when another user made it (a lock needs no write)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        with contextlib.suppress(OSError):
            return os.open(path, os.O_RDONLY)
    except OSError:
        pass
    return None  # a folder this process cannot use: the writer's set-up says so


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def unlock_output_folder(out_dir: str | Path, owner: object = None) -> None:
    """Releases ``out_dir``'s lock if this process holds it for ``owner`` (None: whoever holds it),
    removing the lock file first (a process that opened it meanwhile finds it gone once it has the
    lock, and tries again)."""
    folder = Path(out_dir).resolve()
    held = _held.get(folder)
    if held is None or (owner is not None and held[1] is not owner) or held[2] != os.getpid():
        return  # not ours to release (a fork's copy of its parent's lock is the parent's)
    del _held[folder]
    with contextlib.suppress(OSError):
        os.unlink(folder / LOCK_NAME)
    os.close(held[0])  # closing the file releases its lock


def unlock_all(keep: set[Path] | frozenset = frozenset()) -> None:
    """Releases the locks this process holds but those of ``keep`` (a command ending inside a program
    that held ``keep`` before it)."""
    for folder in list(_held):
        if folder not in keep:
            unlock_output_folder(folder)


def held() -> frozenset[Path]:
    """The folders whose locks this process holds."""
    return frozenset(_held)
