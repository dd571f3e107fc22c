"""What the command line prints besides its jobs' output: warnings as one line, the top-level help and
the subcommands' one-line descriptions, help group headers, a predict's failed requests, where the
loggers wrote, the ``--timings`` line. Shared by ``cli``, ``cli_help``, ``lightning_cli`` and ``demo``;
standard library only (it runs before torch loads).
Third-party noise is silenced where it starts: ``omni_lightning.Trainer`` and ``lightning_cli``."""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any


def compact_warnings() -> None:
    """Warnings as one ``warning: ...`` line, not Python's file:line plus source line."""
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"warning: {message}\n"


# one line each, for `omni-lightning --help` and each subcommand's own help
SUBCOMMAND_HELP = {
    "fit": "Fine-tunes Code2Wav on (codes, audio) pairs: --data.train, and --data.val to validate.",
    "validate": (
        "Evaluates a model on --data.val (mel distance, SI-SDR, SNR; PESQ and STOI with "
        "--model.quality_metrics), logged to the configured logger."
    ),
    "test": "Evaluates a model on --data.test, as validate does.",
    "predict": "Decodes code files to audio files in --out_dir; the same command again resumes an unfinished job.",
    "serve": "Serves a model over HTTP and WebSocket: code chunks in, exact audio out as it is decoded.",
    "demo": "Predicts, fine-tunes and evaluates on the tiny preset on the CPU (no downloads).",
}
# the header of each subcommand's own options (the Trainer method's arguments)
METHOD_GROUP = {
    "fit": "Resuming: the Lightning checkpoint a fit continues from",
    "validate": "The Lightning checkpoint to evaluate, and whether the metrics are printed",
    "test": "The Lightning checkpoint to evaluate, and whether the metrics are printed",
    "predict": "The Lightning checkpoint to predict with, and whether predictions are returned",
}


def heading(doc: str | None) -> str | None:
    """The first sentence of a docstring, markup and final period removed: a help group's header
    (argparse ends it with a colon; jsonargparse takes the first line, which may stop mid-sentence)."""
    if not doc:
        return None
    import inspect
    import re

    paragraph = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    paragraph = re.sub(r":\w+:`~?([^`]+)`", r"\1", paragraph).replace("``", "")
    return re.split(r"(?<=[.!?])\s+(?=[A-Z])", paragraph)[0].rstrip(":;,. ")


DEFAULT_WORK_DIR = "omni_lightning_demo"  # the demo's
HELP = """usage: omni-lightning [-h] [--version] [--debug] [--timings FILE] [-c CONFIG] <subcommand> [options]

The Code2Wav stage of omni speech models (Qwen3-Omni) in PyTorch Lightning: batch inference to audio
files, fine-tuning and evaluation.

subcommands (omni-lightning <subcommand> --help lists the options it uses, --help-all every option):
{subcommands}

options:
  -h, --help          show this help and exit
  --version           print the version and exit
  --debug             print the traceback of usage errors too (also: OMNI_LIGHTNING_DEBUG=1)
  --timings FILE      write the job's phase times (process start, Lightning loaded, model and data built,
                      first batch, last batch, end) to FILE as JSON, and print them in one line
  -c, --config CONFIG a YAML file with a section per subcommand (after the subcommand: that job's options;
                      configs/ has one for each job)

examples:
  omni-lightning predict --data.predict codes/ --out_dir wavs/ --model.checkpoint <HF folder>
  omni-lightning predict --data.predict codes/ --out_dir wavs/ --model.config tiny --model.random_weights true
  omni-lightning fit --config configs/finetune.yaml --data.train train.jsonl --data.val val.jsonl
  omni-lightning validate --config configs/eval_wandb.yaml --data.val val.jsonl --model.checkpoint ckpt/
  omni-lightning demo

exit status: 0 done; 1 a bug or a broken environment (traceback printed); 2 a usage error (one error: line);
3 predict finished but some requests failed (listed in <out_dir>/manifest.jsonl); 130 interrupted (Ctrl-C);
143 terminated (SIGTERM). Interrupted or terminated, predict first writes what it decoded, and the same
command resumes it; serve exits 0 once it answered everything in flight, 130/143 when a stop cut that short.
"""


def top_level_help() -> str:
    """``omni-lightning --help``: every subcommand (demo too), the options read here, examples, exit statuses."""
    lines = [f"  {name:<10}{text}" for name, text in SUBCOMMAND_HELP.items()]
    lines[-1] += f" Work folder: ./{DEFAULT_WORK_DIR}/"
    return HELP.format(subcommands="\n".join(lines)).rstrip()


def failed_lines(failed: dict[str, str], out_dir: Path, most: int = 20) -> list[str]:
    """A line per failed request (the first ``most``, the rest counted), control characters escaped:
    an id holding a newline cannot split its line."""
    lines = [f"  failed {printable(i)}: {printable(reason)}" for i, reason in list(failed.items())[:most]]
    return lines + ([f"  ... {len(failed) - most} more in {out_dir / 'manifest.jsonl'}"] if len(failed) > most else [])


def printable(text: Any) -> str:
    """``text`` with its control characters (newlines, escapes) written as Python escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def one_line(message: str) -> str:
    """jsonargparse's type error (key, subtypes, each subtype's error, value: ~8 lines) as one line."""
    key = re.match(r'Parser key "([^"]+)":', message)
    # <class 'x.Name'> as Name, a generic alias (list[str]) as written
    types = [a or b for a, b in re.findall(r"<class '(?:\w+\.)*(\w+)'>|\b(\w+\[[^\]]*\])", message.split("Errors:")[0])]
    value = re.search(r"(?:Given value|Got value): (.*)", message)
    if key and types and value:
        named = dict.fromkeys("null" if t == "NoneType" else t for t in types)  # null last, in every release's order
        wanted = " or ".join(sorted(named, key=lambda t: t == "null"))
        return f"--{key[1]} takes {wanted}, not {value[1].strip()!r}"
    return " ".join(message.split())


def log_places(trainer: Any, wandb_only: bool = False) -> list[str]:
    """Where the trainer's loggers wrote: a CSV or TensorBoard logger's folder (not with ``wandb_only``); a
    W&B run's folder with the command that uploads it (offline) or its page (online). wandb's own closing
    lines are silenced by the command line (``WANDB_SILENT``): this is what of them a user acts on."""
    places = []
    for logger in trainer.loggers:
        run = getattr(logger, "_experiment", None) if type(logger).__name__ == "WandbLogger" else None
        if run is not None and getattr(run, "dir", None):
            folder = _shown(Path(run.dir).parent)  # the run's folder (run.dir is its files/)
            places.append(f"{folder} (`wandb sync {folder}` uploads it)" if run.offline else f"{folder} ({run.url})")
            continue
        log_dir = getattr(logger, "log_dir", None)
        if log_dir and Path(log_dir).is_dir() and not wandb_only:
            places.append(str(log_dir))
    return places


def _shown(path: Path) -> str:
    """``path`` relative to the working folder when it is inside it, else as it is."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def write_timings(path: str, timings: dict[str, Any]) -> None:
    """``--timings FILE``: the phase times as JSON into ``path``, and one line saying them."""
    with open(path, "w") as f:
        json.dump(timings, f, indent=1, default=str)
    start = timings["process_start"]
    steps = [("arguments checked", "checked"), ("Lightning loaded", "imported"), ("built", "built"),
             ("first batch", "first_batch"), ("last batch", "last_batch_end"), ("end", "end")]  # fmt: skip
    line = ", ".join(f"{label} {timings[key] - start:.2f} s" for label, key in steps if timings.get(key))
    extra = []
    if "data_wait_s" in timings:
        extra.append(f"loader waits {timings['data_wait_s']:.2f} s")
    if timings.get("writer"):
        extra.append(
            f"writer queue waits {timings['writer']['queue_wait_s']:.2f} s, "
            f"drained {timings['writer']['drain_s']:.2f} s after the last batch"
        )
    print(
        f"timings (since process start): {line}" + (f"; {'; '.join(extra)}" if extra else "") + f" -> {path}",
        file=sys.stderr,
    )
