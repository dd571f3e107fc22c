"""What a predict job says of its output folder, in words: the end-of-job summary line, and one
``warning:`` line each for requests it keeps that were written in another format or from other weights.

A manifest line (:func:`weights_label`) names the weights that made its file: a
checkpoint's absolute path and modification time, or ``random weights``, ``weights fine-tuned in
this process (N steps)``, ... A rerun with other weights, like one in another format, counts the
requests finished and says so in one warning line (:func:`other_weights_line`); it does not decode them
again. Not done: telling apart two fits in two processes of the same length (the same label).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from omni_lightning.data.output_folder import Finished


def weights_label(description: str, path: str | Path | None = None) -> str:
    """What a manifest line records of the weights that made its file: ``path`` (a Lightning checkpoint,
    or a checkpoint folder: its newest file) absolute, with its modification time, so that a checkpoint
    written again under the same name is other weights; without a local path, ``description``."""
    if path is None or "://" in str(path) or not Path(path).exists():
        return description
    where = Path(path).resolve()
    try:
        files = [where] if where.is_file() else [f for f in where.iterdir() if f.is_file()]
        stamp = max((f.stat().st_mtime for f in files), default=where.stat().st_mtime)
    except OSError:
        return str(where)
    return f"{where} (modified {datetime.fromtimestamp(stamp).isoformat(timespec='seconds')})"


def weights_source(ckpt_path: Any, checkpoint: Any, otherwise: str | None) -> str | None:
    """The :func:`weights_label` of a predict's weights: a Lightning checkpoint (``ckpt_path``), else a
    checkpoint folder (``checkpoint``), else ``otherwise`` (``random weights``, a fit in this process;
    None: unknown). The command line (before anything loads) and the writer (at predict start) both
    ask here, so they name the same weights alike."""
    if ckpt_path:
        return weights_label(str(ckpt_path), ckpt_path)
    if checkpoint:
        return weights_label(f"weights from {checkpoint}", checkpoint)
    return otherwise


def other_format_line(
    finished: Finished, req_ids: Iterable[str], audio_format: str, subtype: str | None = None
) -> str | None:
    """One ``warning:`` line for requests finished in another format than ``--format`` (or subtype than
    ``--subtype``; they are not decoded again), saying what to do; None when there are none."""
    counts = finished.in_other_format(req_ids, audio_format, subtype)
    wanted = f"{audio_format} {subtype}" if any(" " in written for written in counts) else audio_format
    return _not_again_line(finished, counts, f"already written as {' and '.join(sorted(counts))}, not {wanted}",
                           f"as {wanted}")  # fmt: skip


def other_weights_line(finished: Finished, req_ids: Iterable[str], weights: str | None) -> str | None:
    """One ``warning:`` line for requests finished from other weights than ``weights`` (a
    :func:`weights_label`; None: unknown, nothing said); they are not decoded again."""
    counts = finished.in_other_weights(req_ids, weights) if weights is not None else {}
    return _not_again_line(finished, counts, f"written with other weights ({'; '.join(sorted(counts))}), not {weights}",
                           "from these weights")  # fmt: skip


def _not_again_line(finished: Finished, counts: dict[str, int], what: str, wanted: str) -> str | None:
    if not counts:
        return None
    n = sum(counts.values())
    are, they = ("is", "it counts") if n == 1 else ("are", "they count")
    return (
        f"warning: {counted(n, 'request')} in {finished.out_dir} {are} {what}: {they} as done and {are} not "
        f"decoded again; use another output folder (--out_dir) to have every request {wanted}"
    )


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"  # 1 request, 2 requests


def summary_line(stats: dict[str, Any], out_dir: Path, unread: list[Path] | None = None) -> str:
    """The end-of-job line: written, already done, failed (and any request neither, or unread files)."""
    s, n = stats, counted
    rate = s.get("audio_s", 0.0) / s["seconds"] if s.get("seconds") else 0.0
    text = (
        f"{n(s.get('ok', 0), 'request')} written ({s.get('audio_s', 0.0):.1f} s of audio, {rate:.1f} audio s/s), "
        f"{s.get('skipped', 0)} already done, {s.get('error', 0)} failed -> {out_dir.resolve()}"
    )
    if s.get("missing") and s.get("limited"):
        text += f"; {n(s['missing'], 'request')} not run (the trainer limits predict batches: limit_predict_batches)"
    elif s.get("missing"):
        text += f"; {n(s['missing'], 'request')} neither written nor failed (a bug: please report it)"
    if unread:
        names = ", ".join(str(p) for p in unread[:5]) + (", ..." if len(unread) > 5 else "")
        text += f"; {n(len(unread), 'input file')} not read (not code files, hidden, or links to folders): {names}"
    return text
