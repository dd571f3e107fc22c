"""``omni-lightning``: LightningCLI (fit / validate / test / predict) over Code2WavModule and
CodesDataModule with omni_lightning's Trainer, plus ``demo``.

    omni-lightning predict --config configs/predict.yaml --data.predict codes/ --out_dir wavs/
    omni-lightning fit --config configs/finetune.yaml --data.train train.jsonl --data.val val.jsonl
    omni-lightning validate --config configs/eval_wandb.yaml --data.val val.jsonl --model.checkpoint ckpt/
    omni-lightning demo

Exit status: 0 done (predict: every request has its WAV); 1 an unexpected error (a bug or a broken
environment: the traceback is printed); 2 a usage error (a bad argument, path, preset or config: one
``error:`` line); 3 predict finished but some requests failed (each is in <out_dir>/manifest.jsonl
with its reason); 130 interrupted. ``--debug`` (or OMNI_LIGHTNING_DEBUG=1) prints the traceback of
usage errors too.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from omni_lightning.console import compact_warnings, quiet_known_noise

EXIT_OK, EXIT_BUG, EXIT_USAGE, EXIT_FAILED_REQUESTS, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
DEBUG_ENV = "OMNI_LIGHTNING_DEBUG"


def _is_usage_error(err: BaseException) -> bool:
    from omni_lightning.preflight import UsageError

    if isinstance(err, (UsageError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return True
    exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")
    return exceptions is not None and isinstance(err, exceptions.MisconfigurationException)


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if debug:
        os.environ[DEBUG_ENV] = "1"  # DDP ranks, started from sys.argv, inherit it
    quiet_known_noise()
    compact_warnings()
    try:
        if argv and argv[0] == "demo":
            from omni_lightning.demo import main as demo_main

            demo_main(argv[1:])
            return EXIT_OK
        from omni_lightning.preflight import check_command_line

        check_command_line(argv)  # before torch and Lightning load: a mistake costs a second, not ten
        return _run(argv)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:
        if debug or not _is_usage_error(err):
            raise
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _run(argv: list[str]) -> int:
    # LightningCLI reads sys.argv (passing args as well makes it warn), and DDP starts the other
    # ranks from sys.argv: both see exactly these arguments
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]
    try:
        cli = run_cli(None)
    finally:
        sys.argv = saved
    writer = getattr(cli, "writer", None)
    if cli.subcommand == "predict" and writer is not None and not writer.all_written:
        return EXIT_FAILED_REQUESTS
    return EXIT_OK


def run_cli(argv: list[str] | None) -> Any:
    """Builds and runs the LightningCLI (this imports torch and Lightning)."""
    from omni_lightning.lightning_cli import run_lightning_cli

    compact_warnings()  # again: importing Lightning replaced the format
    return run_lightning_cli(argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
