"""Checks of the paths an ``omni-lightning`` command line names, before torch or Lightning load
(``preflight.py`` runs them): ``--ckpt_path``, ``--model.checkpoint``, ``--out_dir`` (and that a predict
source is not the manifest the job writes there), ``--timings``. Each raises :class:`UsageError` with a
one-line message naming the value and the fix. Not done: reading a checkpoint's contents (only that torch
saved the file: its first bytes), which takes torch.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

from omni_lightning.data.files import torch_save_format
from omni_lightning.data.output_folder import MANIFEST
from omni_lightning.errors import UsageError

CKPT_KEYWORDS = ("last", "best", "hpc")


def check_ckpt_path(sub: str, value: str) -> None:
    """A local ``--ckpt_path``: a file torch saved. Lightning's keywords only where a fit can have
    made that checkpoint (a resumed fit); elsewhere they would load nothing and run on random weights."""
    fix = "give a Lightning .ckpt file (fit saves them)"
    if value in CKPT_KEYWORDS:
        if sub != "fit":
            raise UsageError(
                f"--ckpt_path {value} names a checkpoint of a fit in this process, and {sub} runs no fit: {fix}"
            )
        return
    path = Path(value)
    if not path.exists():
        raise UsageError(f"--ckpt_path {value} does not exist: {fix}")
    if path.is_dir() or path.suffix == ".safetensors":
        what = "a folder" if path.is_dir() else "a safetensors file"
        raise UsageError(
            f"--ckpt_path {value} is {what}: {fix}; a Code2Wav or Qwen3-Omni checkpoint folder "
            "goes to --model.checkpoint"
        )
    if not os.access(path, os.R_OK):
        raise UsageError(f"--ckpt_path {value} cannot be read (no permission): {fix}")
    saved_as = torch_save_format(path)
    if saved_as is None:
        raise UsageError(f"--ckpt_path {value} is not a checkpoint torch saved: {fix}")
    if saved_as == "zip":
        _check_lightning_archive(value, fix)


def _check_lightning_archive(value: str, fix: str) -> None:
    """A zip that torch saved holds ``<name>/data.pkl``, the pickled object without its tensors (small);
    a Lightning checkpoint's names its ``pytorch-lightning_version``. Refuses a truncated archive, a
    saved tensor or state dict, or a code file, which Lightning would fail on deep inside."""
    try:
        with zipfile.ZipFile(value) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            data = archive.read(pickles[0]) if pickles else b""
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        raise UsageError(f"--ckpt_path {value} cannot be read as a checkpoint ({err}), truncated?: {fix}") from err
    if b"pytorch-lightning_version" not in data:
        raise UsageError(f"--ckpt_path {value} is not a Lightning checkpoint (a saved tensor or state dict?): {fix}")


def check_timings(value: str) -> None:
    """``--timings FILE``: a file that can be written when the job ends (its folder exists)."""
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"--timings {value} is a folder: give a file path for the JSON")
    if not path.parent.is_dir():
        raise UsageError(f"--timings {value}: its folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"--timings {value} cannot be written (no permission)")


def check_not_output_manifest(sources: Any, out_dir: str) -> None:
    """The predict source must not be the manifest this job writes (it would be replaced)."""
    written = (Path(out_dir) / MANIFEST).resolve()
    for source in sources if isinstance(sources, list) else [sources]:
        if isinstance(source, str) and Path(source).resolve() == written:
            raise UsageError(
                f"--data.predict {source} is the manifest this job writes in --out_dir {out_dir}: "
                "give another --out_dir, or move the input manifest"
            )


def check_checkpoint(value: str) -> None:
    path = Path(value)
    what = "give a Code2Wav or Qwen3-Omni checkpoint folder (config.json and model.safetensors or its index)"
    if not path.exists():
        raise UsageError(f"--model.checkpoint {value} does not exist: {what}")
    if not path.is_dir():
        raise UsageError(f"--model.checkpoint {value} is a file, not a folder: {what}")
    if not (path / "config.json").is_file():
        raise UsageError(f"--model.checkpoint {value} has no config.json: {what}")
    if not ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()):
        raise UsageError(f"--model.checkpoint {value} has no model.safetensors or model.safetensors.index.json: {what}")


def check_out_dir(value: str) -> None:
    path = Path(value)
    if path.is_symlink() and not path.exists():
        raise UsageError(f"--out_dir {value} is a link to {os.readlink(path)}, which does not exist: give a folder")
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out_dir {value} is a file: give a folder (it is created when missing)")
    if (path / "manifest.jsonl").is_dir():
        raise UsageError(
            f"--out_dir {value} holds a folder named manifest.jsonl, where the job's manifest goes: "
            "move it, or give another --out_dir"
        )
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--out_dir {value} cannot be created: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out_dir {value} cannot be written (no permission on {parent}): pick another folder")
