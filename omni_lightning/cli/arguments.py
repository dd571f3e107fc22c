"""What an ``omni-lightning`` command line sets, read as jsonargparse reads it, without importing it
(or torch, or Lightning): the subcommand, config files (``--config``, also inline YAML) and
``--key value`` options, applied in the order given, the later one winning. ``preflight.py`` checks
what this reads.

:func:`unknown_option` names an option no class takes (with the closest one) from the classes' source,
read with ``ast``, not imported. What it does not do: validate types or values (the parser does, once
Lightning loads), judge keys below ``group.name`` (``--trainer.logger.init_args.save_dir``), read
environment variables, or apply ``+=`` appends (the parser's to apply).
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_lightning.errors import UsageError


def subcommand_at(argv: list[str], subcommands: tuple[str, ...]) -> int:
    """Where the subcommand is: the first argument that is not an option or a ``--config`` value.
    UsageError when there is none or it is not one (said here, not after Lightning loads)."""
    choices = ", ".join((*subcommands, "demo"))
    for i, arg in enumerate(argv):
        if arg.startswith("-") or (i > 0 and argv[i - 1] in ("-c", "--config")):
            continue
        if arg in subcommands:
            return i
        close = difflib.get_close_matches(arg, [*subcommands, "demo"], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"{arg!r} is not a subcommand{hint}: use one of {choices}")
    raise UsageError(f"no subcommand given: use one of {choices} (omni-lightning <subcommand> --help lists options)")


def config_paths(args: list[str]) -> list[str]:
    paths = []
    for i, arg in enumerate(args):
        if arg in ("-c", "--config") and i + 1 < len(args):
            paths.append(args[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def read_config(text: str) -> dict[str, Any]:
    import yaml

    path = Path(text)
    inline = not path.is_file() and (":" in text or "{" in text)  # jsonargparse also takes YAML inline
    if not path.is_file() and not inline:
        what = "is a folder, not a YAML file" if path.is_dir() else "does not exist"
        raise UsageError(f"config file {text} {what}: check the path (the examples are in configs/)")
    try:
        data = yaml.safe_load(text if inline else path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        problem = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UsageError(f"config file {text} is not valid YAML ({problem}): fix it or pass another --config") from err
    return data if isinstance(data, dict) else {}


def apply_arguments(
    args: list[str], values: dict[str, Any], files: dict[str, Any], valueless: list[str] | None = None
) -> list[str]:
    """Applies ``args`` to ``values`` in order, as jsonargparse does: a ``--config`` file's values where
    it stands, ``--a.b value`` / ``--a.b=value`` (parsed as YAML) where they stand, so the later one
    wins. Returns the option keys given (dotted; ``+`` kept on an append), config files aside."""
    import yaml

    keys: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in ("-c", "--config") or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else (args[i] if i < len(args) else None)
            i += 0 if "=" in arg else 1
            if path is not None:
                config = read_config(path)
                merge(values, copy.deepcopy(config))
                merge(files, config)
            continue
        if not arg.startswith("--"):
            continue
        key, eq, value = arg[2:].partition("=")
        keys.append(key)
        if not eq:
            if i >= len(args) or args[i].startswith("--"):
                if valueless is not None:
                    valueless.append(key)  # no value: left to the parser (it wants one for every key)
                continue
            value, i = args[i], i + 1
        if key.endswith("+"):
            continue  # an append: the parser's to apply
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        merge(values, nest(key.split("."), value if isinstance(parsed, (int, float, bool)) else parsed))
    return keys


def is_set(files: dict[str, Any], dotted: str) -> bool:
    """Whether a config file set ``dotted`` (``trainer.precision``)."""
    node: Any = files
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def nest(keys: list[str], value: Any) -> dict[str, Any]:
    return {keys[0]: value} if len(keys) == 1 else {keys[0]: nest(keys[1:], value)}


def merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


@dataclass
class Arguments:
    """A command line read: its subcommand, every value set (files and options in order), what config
    files set, the option keys given and those given without a value."""

    sub: str
    values: dict[str, Any] = field(default_factory=dict)
    files: dict[str, Any] = field(default_factory=dict)
    given: list[str] = field(default_factory=list)
    valueless: list[str] = field(default_factory=list)

    def sets(self, dotted: str) -> bool:
        """Whether a config file or an option sets ``dotted`` (``model.frames_per_forward``)."""
        return dotted in self.given or is_set(self.files, dotted)


def read_arguments(argv: list[str], subcommands: tuple[str, ...]) -> Arguments:
    """``argv`` (the arguments after the program) read as the parser reads them: a ``--config`` before
    the subcommand contributes its section for it, then the rest applies in order (UsageError when
    there is no subcommand)."""
    sub_at = subcommand_at(argv, subcommands)
    args = Arguments(argv[sub_at])
    for path in config_paths(argv[:sub_at]):
        section = section_for(path, args.sub)
        merge(args.values, copy.deepcopy(section))  # options then change values' dicts, not files'
        merge(args.files, section)
    args.given = apply_arguments(argv[sub_at + 1 :], args.values, args.files, args.valueless)
    return args


# the subcommands a config file given before the subcommand holds a section for
SUBCOMMANDS = ("fit", "validate", "test", "predict", "serve")


def section_for(path: str, sub: str) -> dict[str, Any]:
    """The ``sub`` section of a config file given before the subcommand, which holds a section per
    subcommand (as LightningCLI reads it); UsageError naming any other key (a flat config there would
    otherwise be ignored without a word) or a section that is not a mapping."""
    config = read_config(path)
    flat = [str(k) for k in config if k not in SUBCOMMANDS]
    if flat:
        close = difflib.get_close_matches(flat[0], SUBCOMMANDS, n=1, cutoff=0.75)
        if close:
            raise UsageError(f"config file {path} has a section {flat[0]!r}: did you mean {close[0]}?")
        shown = ", ".join(flat[:4]) + (f" ... ({len(flat) - 4} more)" if len(flat) > 4 else "")
        raise UsageError(
            f"config file {path}, given before the subcommand, sets {shown} at its top level, where only a "
            f"section per subcommand is read ({', '.join(SUBCOMMANDS)}): put them under '{sub}:', or give the "
            f"file after the subcommand (omni-lightning {sub} -c {path})"
        )
    section = config.get(sub) or {}
    if not isinstance(section, dict):
        raise UsageError(f"config file {path}: its {sub} section must be a mapping of options, got {section!r}")
    return section


# the command line's own options (entry.py, lightning_cli.py) and LightningCLI's
TOP_LEVEL = ("config", "print_config", "seed_everything", "out_dir", "format", "subtype", "timings", "debug", "help")
# serve's own options (serve.py)
SERVE_ARGS = ("ckpt_path", "host", "port", "max_streams", "max_queue", "max_body_bytes", "request_frames",
              "devices", "drain_timeout", "front_processes", "bulk_slice_ms", "stream_lane", "lane_sms")  # fmt: skip
# each subcommand's Trainer method arguments the parser adds (LightningCLI skips model, data and loaders)
METHOD_ARGS = {
    "fit": ("ckpt_path", "weights_only"),
    "validate": ("ckpt_path", "verbose", "weights_only"),
    "test": ("ckpt_path", "verbose", "weights_only"),
    "predict": ("return_predictions", "ckpt_path", "weights_only"),
    "serve": SERVE_ARGS,
}
# what jsonargparse takes under any class group besides its init arguments
GROUP_KEYS = ("help", "class_path", "init_args", "dict_kwargs")
GROUP_SOURCES = {  # group -> (package-relative source file, class) whose __init__ arguments it takes
    "trainer": [("omni_lightning", "trainer.py", "Trainer"), ("lightning", "pytorch/trainer/trainer.py", "Trainer")],
    "model": [("omni_lightning", "module.py", "Code2WavModule")],
    "data": [("omni_lightning", "data/datamodule.py", "CodesDataModule")],
}


def _init_arguments(package: str, relative: str, cls: str) -> set[str] | None:
    """The keyword arguments of ``cls.__init__`` in ``package``'s source file, read without importing
    it; None when any may be given (``**kwargs`` alone) or the source cannot be read."""
    spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(spec.submodule_search_locations[0]) / relative).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]} - {"self"}
                    return None if args.kwarg is not None and not names else names
    return None


@functools.cache
def lightning_precisions() -> frozenset[str] | None:
    """The ``precision`` values Lightning takes (its ``_PRECISION_INPUT*`` literals, as text), read from
    its source with ``ast``; None when that source cannot be read (the parser judges)."""
    spec = importlib.util.find_spec("lightning")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        path = Path(spec.submodule_search_locations[0]) / "fabric/plugins/precision/precision.py"
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    names: set[str] = set()
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id.startswith("_PRECISION_INPUT"):
            literal = node.value.slice if isinstance(node.value, ast.Subscript) else None
            items = literal.elts if isinstance(literal, ast.Tuple) else [literal]
            names |= {str(i.value) for i in items if isinstance(i, ast.Constant)}
    return frozenset(names) or None


@functools.cache
def group_options(group: str) -> frozenset[str] | None:
    """The init arguments a class group takes (``trainer``: ours and ``lightning.Trainer``'s); None:
    unknown here (the parser judges)."""
    found: set[str] = set()
    for source in GROUP_SOURCES[group]:
        names = _init_arguments(*source)
        if names is None:
            return None
        found |= names
    return frozenset(found)


def unknown_option(sub: str, key: str, config: bool = False) -> str | None:
    """The message for an option ``key`` (dotted, no dashes; ``config``: a config file's key) that
    ``omni-lightning sub`` does not take, naming the closest known one; None when it is known, or below
    ``group.name`` (the parser judges those)."""
    key = key.rstrip("+")  # an append (--trainer.callbacks+=...)
    parts = key.split(".")
    top = {*TOP_LEVEL, *METHOD_ARGS.get(sub, ()), *GROUP_SOURCES}
    if parts[0] in GROUP_SOURCES:
        names = group_options(parts[0])
        if len(parts) == 1 or names is None or parts[1] in names or parts[1] in GROUP_KEYS:
            return None
    elif parts[0] in top and len(parts) == 1:
        return None
    known = sorted(top | {f"{g}.{n}" for g in GROUP_SOURCES for n in group_options(g) or ()})
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close and "." in key:  # a misspelled group: the same name under the closest group
        close = difflib.get_close_matches(parts[-1], known, n=1, cutoff=0.8)
    dash = "" if config else "--"
    hint = f": did you mean {dash}{close[0]}?" if close else ""
    what = f"config key {key}" if config else f"--{key}"
    return f"{what} is not an option of omni-lightning {sub}{hint} (omni-lightning {sub} --help lists them)"


def first_unknown(args: Arguments) -> str | None:
    """The message for the first option, then config file key, that :func:`unknown_option` refuses."""
    for key in args.given:
        problem = unknown_option(args.sub, key)
        if problem:
            return problem
    for key, value in args.files.items():
        keys = [f"{key}.{k}" for k in value] if key in GROUP_SOURCES and isinstance(value, dict) else [key]
        for dotted in keys:
            problem = unknown_option(args.sub, dotted, config=True)
            if problem:
                return problem
    return None
