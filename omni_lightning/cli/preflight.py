"""Checks of an ``omni-lightning`` command line that need neither torch nor Lightning, run before
either is imported (which takes seconds): data sources and their ids (repeated ids listed; audio for
fit, validate, test), checkpoints, presets, the numbers and precision read here, ``--ckpt_path``,
``--out_dir``, the format, config files, and the weights guard: ``predict``, ``validate``, ``test``, ``serve``
need ``--model.checkpoint`` or ``--ckpt_path`` unless ``--model.random_weights true``.

A problem raises :class:`UsageError` whose message is one line, ``<what> <value>: <fix>`` (a repeated-id
listing follows its line). Values come from the subcommand's ``--config`` files (a top-level
``--config`` too, under the subcommand's key) and from ``--key value`` / ``--key=value`` options, the
last one winning as in jsonargparse. What these checks cannot see (a value set through an environment
variable, a custom ``class_path`` for the model or data, a whole group given as ``--data file.yaml``)
is left to the parser, to ``lightning_cli`` (which applies the weights guard again to the parsed
config) and to the classes, whose ``UsageError``s the CLI prints the same way.

:func:`finished_job`: a predict job whose output folder already holds every request is done here,
before torch loads (the folder's temp files removed and its manifest compacted, as a run's start does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_lightning.cli.arguments import SUBCOMMANDS, first_unknown, is_set, lightning_precisions, read_arguments
from omni_lightning.cli.path_checks import check_checkpoint, check_ckpt_path, check_not_output_manifest, check_out_dir
from omni_lightning.cli.serve_options import check_serve_values
from omni_lightning.data.files import CODE_SUFFIXES
from omni_lightning.data.folder_lock import lock_output_folder, unlock_output_folder
from omni_lightning.data.job_lines import other_format_line, other_weights_line, summary_line, weights_source
from omni_lightning.data.output_folder import Finished, check_format, check_names, remove_temp_files
from omni_lightning.data.sources import check_source, list_source
from omni_lightning.errors import UsageError

# the data source each subcommand needs (fit may add data.val)
REQUIRED_DATA = {"fit": "train", "validate": "val", "test": "test", "predict": "predict"}
# options these checks read (the no-op rerun may decide on them); of the Trainer's, those a multi-GPU or
# multi-node rerun of a finished job passes (a bad device count, say, is then not seen: nothing runs)
RERUN_TRAINER = ("accelerator", "strategy", "devices", "num_nodes", "precision", "gpu_memory_utilization")
READ_HERE = {
    *("out_dir", "format", "subtype", "ckpt_path", "seed_everything", "data.predict", "data.duplicate_ids"),
    *("model.checkpoint", "model.config", "model.random_weights", "model.frames_per_forward", "model.fast_path"),
    *("data.batch_size", "data.num_workers", "data.config", "trainer.enable_progress_bar"),
    *(f"trainer.{k}" for k in RERUN_TRAINER),
}
LISTED_DATA = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}
NEEDS_WEIGHTS = ("predict", "validate", "test", "serve")
PAIRED = 'a JSONL manifest naming codes and their audio, e.g. {"id": "u1", "codes": "u1.npy", "audio": "u1.wav"}'
__all__ = ["UsageError", "CommandLine", "check_command_line", "check_weights", "finished_job"]


@dataclass
class CommandLine:
    """A checked command line: the subcommand, the values seen, and (predict) the job's requests."""

    sub: str
    values: dict[str, Any]
    predict_ids: list[str] | None = None  # None: the sources are not all folders or manifests
    unread: list[Path] = field(default_factory=list)
    finished: Finished | None = None  # --out_dir's finished requests, as finished_job read them
    unchecked: list[str] = field(default_factory=list)  # options only the parser can check
    other_format: str | None = None  # a warning: requests finished in --out_dir in another format
    other_weights: str | None = None  # a warning: requests finished in --out_dir from other weights


def check_command_line(argv: list[str]) -> CommandLine | None:
    """Raises UsageError for the first problem found in ``argv`` (the arguments after the program);
    None when there is nothing to check (help)."""
    if any(a in ("-h", "--help") or a.startswith("--print_config") for a in argv):
        return None  # help and config printing need nothing to exist
    args = read_arguments(argv, SUBCOMMANDS)
    unknown_key = first_unknown(args)  # before any other check: a misspelled option is named as such
    if unknown_key:
        raise UsageError(unknown_key)
    callbacks = any(k.startswith("trainer.callbacks") for k in args.given)  # (+= too) a writer may be one
    command = _check(args.sub, args.values, callbacks)
    # the no-op rerun decides before the parser runs: only on options a config file also sets (or that
    # these checks read), so a misspelled key, an appended list (+=) or an option without its value goes
    # to the parser, which refuses it
    unknown = [k for k in args.given if k.endswith("+") or not (k in READ_HERE or is_set(args.files, k))]
    command.unchecked = unknown + args.valueless
    return command


def set_by_user(argv: list[str], keys: list[str]) -> list[str]:
    """Those of ``keys`` (dotted) that a config file or an option of ``argv`` sets."""
    try:
        args = read_arguments(argv, SUBCOMMANDS)
    except UsageError:
        return []
    return [k for k in keys if args.sets(k)]


def _group(values: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The init arguments of ``model`` or ``data``; None when the parser must judge them: a whole group
    given as a file or string, or a ``class_path`` (the command line takes the package's own classes,
    configured by their arguments; the parser names what it does not take)."""
    group = values.get(name)
    if group is None:
        return {}
    if not isinstance(group, dict) or "class_path" in group or "init_args" in group:
        return None
    return group


def _check(sub: str, values: dict[str, Any], callbacks: bool = False) -> CommandLine:
    command = CommandLine(sub, values)
    seed = _as_number(int, values.get("seed_everything"))  # options stay text
    if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < 2**32:
        raise UsageError(f"--seed_everything {seed} is out of range: give a seed in [0, 2**32 - 1], or true")
    # values may come from environment variables the checks do not read (jsonargparse's default_env)
    from_env = os.environ.get("JSONARGPARSE_DEFAULT_ENV", "").lower() in ("1", "true", "yes", "on")
    data = _group(values, "data") if sub in REQUIRED_DATA else None  # serve reads no data
    if data is not None:
        required = REQUIRED_DATA[sub]
        if not data.get(required) and not from_env:
            what = (
                f"a folder of code files ({', '.join(CODE_SUFFIXES)}) or a JSONL manifest"
                if sub == "predict"
                else PAIRED
            )
            raise UsageError(f"{sub} needs data: --data.{required} is not set: give {what}")
        for key in ("train", "val", "test", "predict"):
            source = data.get(key)
            for item in source if isinstance(source, list) else [source]:
                if key != "predict" and key in LISTED_DATA[sub] and isinstance(item, str) and Path(item).is_dir():
                    raise UsageError(
                        f"--data.{key} {item} is a folder of code files, without audio: {sub} needs {PAIRED}"
                    )
                # a folder the subcommand reads is scanned once, by _list_requests, which checks it alike
                if isinstance(item, str) and not (key in LISTED_DATA[sub] and Path(item).is_dir()):
                    check_source(f"--data.{key}", item)
        _list_requests(command, data)
    model = _group(values, "model")
    if model is not None:
        checkpoint = model.get("checkpoint")
        if isinstance(checkpoint, str):
            check_checkpoint(checkpoint)
        preset = model.get("config")
        if isinstance(preset, str) and checkpoint in (None, ""):
            check_preset(preset)
    if data is not None and isinstance(data.get("config"), str):
        check_preset(data["config"], "--data.config")
    _check_settings(values)
    ckpt_path = values.get("ckpt_path")
    local = isinstance(ckpt_path, str) and "://" not in ckpt_path and not ckpt_path.startswith("registry")
    if local:
        check_ckpt_path(sub, ckpt_path)
    if sub == "predict":
        out_dir, trainer = values.get("out_dir"), values.get("trainer")
        callbacks |= not isinstance(trainer, (dict, type(None))) or bool((trainer or {}).get("callbacks"))
        if not out_dir and not callbacks and not from_env:
            raise UsageError("predict has no --out_dir: give the folder the audio files and manifest.jsonl go to")
        if isinstance(out_dir, str) and out_dir:
            check_out_dir(out_dir)
            if Path(out_dir).is_dir() and _first_process():
                lock_output_folder(out_dir)  # before anything tidies it; the writer finds it held
            if data is not None:
                check_not_output_manifest(data.get("predict"), out_dir)
        check_format(str(values.get("format") or "wav"), str(values.get("subtype") or "PCM_16"))
    if model is not None and not from_env:  # (lightning_cli applies the guard again to the parsed values)
        check_weights(sub, model.get("checkpoint"), ckpt_path, model.get("random_weights"))
    return command


def _list_requests(command: CommandLine, data: dict[str, Any]) -> None:
    """Lists the subcommand's requests (repeated ids refused as the dataset would); for predict,
    keeps every id for :func:`finished_job` and refuses ids two sources share."""
    keys = LISTED_DATA[command.sub]
    mode = str(data.get("duplicate_ids") or "error")
    ids: list[str] | None = []
    where: dict[str, list[str]] = {}  # predict: id -> the sources that list it
    for key in keys:
        sources = data.get(key)
        for source in sources if isinstance(sources, list) else [sources]:
            if not isinstance(source, str):
                ids = None  # held in memory or given another way: the data module lists it
                continue
            entries, unread = list_source(source, mode, name=f"--data.{key}")
            if key != "predict" and all(e.audio is None for e in entries):  # a folder is refused before
                raise UsageError(f"--data.{key} {source} names no audio: {command.sub} needs {PAIRED}")
            if key == "predict" and ids is not None:
                ids.extend(e.id for e in entries)
                command.unread.extend(unread)
                for e in entries:
                    where.setdefault(e.id, []).append(source)
    if command.sub == "predict" and ids is not None:
        shared = [f"{i!r} ({', '.join(s)})" for i, s in where.items() if len(s) > 1]
        if shared:
            more = f" ... ({len(shared) - 10} more)" if len(shared) > 10 else ""
            raise UsageError(
                f"{len(shared)} request id(s) occur in more than one --data.predict source, and each id "
                f"names one output file; nothing was decoded (duplicate_ids rename numbers repeats within "
                f"a source only). Make them unique: {'; '.join(shared[:10])}{more}"
            )
        check_names(ids)
        command.predict_ids = ids


def _first_process() -> bool:
    """Whether this is a job's first process (rank 0): the other DDP ranks, started by Lightning, torchrun
    or Slurm with the same arguments, run these checks too, while rank 0 holds the output folder."""
    names = ("RANK", "SLURM_PROCID", "NODE_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    ranks = [os.environ.get(name, "") for name in names]
    return all(rank in ("", "0") for rank in ranks)


BOOLEANS = ("true", "yes", "on", "false", "no", "off")  # what the argument parser takes for a bool


def check_weights(sub: str, checkpoint: Any, ckpt_path: Any, random_weights: Any) -> None:
    """The weights guard: UsageError when ``sub`` needs weights and none are given (see the module docstring)."""
    text = str(random_weights).strip().lower()
    if random_weights is not None and not isinstance(random_weights, bool) and text not in BOOLEANS:
        raise UsageError(f"--model.random_weights must be true or false, got {random_weights!r}")
    random = random_weights is True or text in ("true", "yes", "on")
    if sub in NEEDS_WEIGHTS and not checkpoint and not ckpt_path and not random:
        raise UsageError(
            f"{sub} has no weights: give --model.checkpoint <folder> (a Qwen3-Omni or Code2Wav checkpoint) or "
            "--ckpt_path <Lightning .ckpt>; --model.random_weights true runs on random weights (benchmarks, demos)"
        )


def finished_job(command: CommandLine | None) -> str | None:
    """The summary line of a predict job with nothing left to do (every request finished in
    ``--out_dir``), or None. The folder is tidied as a run's start would tidy it. Sets the command's
    ``finished`` (the folder as read) and ``other_format`` and ``other_weights`` (warning lines, or None)."""
    if command is None or command.sub != "predict" or command.predict_ids is None:
        return None
    out_dir = command.values.get("out_dir")
    if not isinstance(out_dir, str) or not Path(out_dir).is_dir():
        return None
    finished = command.finished = Finished.read(out_dir)
    audio_format, subtype = str(command.values.get("format") or "wav"), str(command.values.get("subtype") or "PCM_16")
    command.other_format = other_format_line(finished, command.predict_ids, audio_format, subtype)
    model, ckpt_path = _group(command.values, "model") or {}, command.values.get("ckpt_path")
    random = "random weights" if str(model.get("random_weights")).lower() == "true" else None
    weights = weights_source(ckpt_path if isinstance(ckpt_path, str) else None, model.get("checkpoint"), random)
    command.other_weights = other_weights_line(finished, command.predict_ids, weights)
    if command.unchecked or any(req_id not in finished for req_id in command.predict_ids):
        return None  # the run reuses this reading (lightning_cli hands it to the data module)
    if _first_process():  # it tidies the folder, holding its lock where it could take it (not a DDP rank)
        remove_temp_files(finished.out_dir)
        finished.compact()
        unlock_output_folder(finished.out_dir)  # taken by the checks: this job ends here
    stats = {"skipped": len(command.predict_ids)}
    return summary_line(stats, finished.out_dir, command.unread) + "; nothing left to do (no model was loaded)"


def check_preset(value: str, flag: str = "--model.config") -> None:
    from omni_lightning.models.config import PRESETS

    if value not in PRESETS:
        weights = ", or load weights with --model.checkpoint <folder>" if flag == "--model.config" else ""
        raise UsageError(f"{flag} {value!r} is not a preset: use one of {', '.join(sorted(PRESETS))}{weights}")


# settings these checks read (a no-op rerun decides without the parser): (group, key) -> (least, null taken)
COUNTS = {
    ("data", "batch_size"): (1, False),
    ("data", "num_workers"): (0, True),
    ("model", "frames_per_forward"): (1, True),
}


def _check_settings(values: dict[str, Any]) -> None:
    """The numbers and the precision that :data:`READ_HERE` names, as their classes would check them:
    UsageError naming the option and the value (not the parser's many lines, nor a rerun's silence)."""
    check_serve_values(values)  # serve's own options (top-level keys)
    for (group, key), (least, null) in COUNTS.items():
        value = section.get(key) if isinstance(section := _group(values, group), dict) else None
        number = _as_number(int, value)
        if value is not None and (isinstance(number, bool) or not isinstance(number, int) or number < least):
            raise UsageError(
                f"--{group}.{key} must be an integer >= {least}{' (or null)' if null else ''}, got {value}"
            )
    trainer = values.get("trainer") if isinstance(values.get("trainer"), dict) else {}
    share = trainer.get("gpu_memory_utilization")
    fraction = None if isinstance(share, bool) else _as_number(float, share)
    if share is not None and not (isinstance(fraction, float) and 0 < fraction <= 1):
        raise UsageError(
            f"--trainer.gpu_memory_utilization must be a fraction in (0, 1] of the GPU's memory (or null: no cap), "
            f"got {share}"
        )
    precision, known = trainer.get("precision"), lightning_precisions()
    if precision is not None and known is not None and str(precision) not in known:
        shown = ", ".join(p for p in sorted(known) if "-" in p)
        raise UsageError(f"--trainer.precision {precision} is not a precision Lightning takes: use one of {shown}")


def _as_number(kind: type, value: Any) -> Any:
    """An option's text as ``kind`` (int or float; a config file's int as a float too); else unchanged."""
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            return value
    return float(value) if kind is float and isinstance(value, int) and not isinstance(value, bool) else value
