"""HF-layout checkpoints for Code2Wav: load a standalone or full Qwen3-Omni folder, save standalone.

Layouts read:
  (a) a full Qwen3-Omni folder: ``config.json`` with ``code2wav_config``; ``model.safetensors`` or a
      ``model.safetensors.index.json`` whose shards hold ``code2wav.*`` beside thinker/talker tensors.
      Only the shards that hold ``code2wav.*`` are opened, and only those tensors are read.
  (b) a standalone folder: ``config.json`` (a Code2Wav config) + ``model.safetensors`` or an index.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from omni_lightning.models.config import Code2WavConfig, read_config_json

Model = TypeVar("Model", bound=nn.Module)  # Code2Wav, which imports this module (never the other way)

FULL_MODEL_PREFIX = "code2wav."
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


def _listing(title: str, items: list[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
    return f"{len(items)} {title}: {shown}"


def _weight_files(folder: Path, prefix: str) -> dict[Path, list[str]]:
    """Safetensors file -> the tensor names in it that start with ``prefix``."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index_path} is not a safetensors index ({err})") from err
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name, shard in weight_map.items():
            if name.startswith(prefix):
                by_file[folder / shard].append(name)
        if not by_file:
            raise ValueError(f"{index_path} lists no tensor starting with {prefix!r}")
        return dict(by_file)
    single = folder / WEIGHTS_FILE
    if single.is_file():
        return {single: []}  # names read from the file's own header
    raise ValueError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {folder}")


def read_state_dict(
    folder: str | Path, prefix: str = "", device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Reads the tensors whose names start with ``prefix`` (prefix stripped) and nothing else."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    state: dict[str, torch.Tensor] = {}
    for path, names in _weight_files(folder, prefix).items():
        if not path.is_file():
            raise ValueError(f"shard {path.name} named by {INDEX_FILE} is missing from {folder}")
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in names or [k for k in f.keys() if k.startswith(prefix)]:  # noqa: SIM118
                    state[name[len(prefix) :]] = f.get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"could not read {path}: {err}") from err
    return state


def load_pretrained(
    build: Callable[[Code2WavConfig], Model],
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Model:
    """``Code2Wav.from_pretrained``: the model ``build`` makes (on the meta device) from the folder's config,
    its weights in ``dtype`` (default float32) on ``device`` (default CPU); its buffers are the caller's."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} does not exist")
    raw = read_config_json(folder)
    config = Code2WavConfig.from_hf(raw, where=folder / "config.json")
    prefix = FULL_MODEL_PREFIX if "code2wav_config" in raw else ""
    device = torch.device(device or "cpu")
    state = read_state_dict(folder, prefix, device)

    with torch.device("meta"):
        model = build(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = sorted(
        f"{k} {tuple(state[k].shape)} != {tuple(shape)}"
        for k, shape in expected.items()
        if k in state and state[k].shape != shape
    )
    # an integer or bool tensor where a weight goes: a damaged or foreign file, not weights to cast
    not_float = sorted(f"{k} ({state[k].dtype})" for k in expected if k in state and not state[k].is_floating_point())
    if missing or unexpected or misshaped or not_float:
        parts = [
            _listing(title, items)
            for title, items in (
                ("missing keys", missing),
                ("unexpected keys", unexpected),
                ("mis-shaped tensors (checkpoint != model)", misshaped),
                ("tensors that are not floating point", not_float),
            )
            if items
        ]
        raise ValueError(f"checkpoint {folder} does not match {config.name!r}: " + "; ".join(parts))
    dtype = dtype or torch.float32
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return model


def _plain_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 minus the process's umask (read without changing it
    where Linux reports it, else by setting and restoring it)."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def save_pretrained(model: nn.Module, config: Code2WavConfig, path: str | Path) -> Path:
    """Writes the standalone layout; files land atomically (temp name, then rename)."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    tmp = folder / f".{WEIGHTS_FILE}.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, _plain_file_mode())  # safetensors creates its files 0600; others may need to read them
    os.replace(tmp, folder / WEIGHTS_FILE)
    hf_config = config.to_hf()
    hf_config["architectures"] = ["Qwen3OmniMoeCode2Wav"]
    tmp = folder / ".config.json.tmp"
    tmp.write_text(json.dumps(hf_config, indent=2) + "\n")
    os.replace(tmp, folder / "config.json")
    return folder
