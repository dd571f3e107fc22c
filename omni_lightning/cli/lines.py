"""What the command line says as a run starts, and the lines of Lightning's it says instead.

fit, validate and test start with one line (``fit: tiny preset, 2.4 M parameters (2.4 M trained),
random weights; cpu 32-true, 1 torch thread (2 cores, load 0.3)``) in place of Lightning's model table
and its ``GPU available`` / ``TPU available`` lines; predict's start-up line is ``PredictStartLine``'s.
While a command runs, Lightning's ``Seed set to 0``, ``Restoring states from ...``, ``Loaded model
weights from ...`` and ``Trainer.fit stopped: `max_steps=N` reached`` (or ``max_epochs``) are dropped:
the start-up line names the weights, the fit's last line where its checkpoints are. (Lightning's
``Detected KeyboardInterrupt`` line the Trainer drops, in Python too: the last line says what a stop
saved.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omni_lightning.runner.cpu_threads import choose_threads, threads_said

DROPPED = (
    "Seed set to ",
    "Restoring states from the checkpoint path at ",
    "Restored all states from the checkpoint at ",
    "Loaded model weights from the checkpoint at ",
    "`Trainer.fit` stopped: `max_steps=",
    "`Trainer.fit` stopped: `max_epochs=",
)
LOGGERS = ("lightning.fabric.utilities.seed", "lightning.pytorch.utilities.rank_zero",
           "lightning.pytorch.trainer.connectors.signal_connector")  # fmt: skip


def _drop_said_elsewhere(record: logging.LogRecord) -> bool:
    message = str(record.msg)
    return not message.startswith(DROPPED) and "Received SIGTERM" not in message


@contextmanager
def quiet_cli_run() -> Iterator[None]:
    """While a command runs: the lines the module docstring lists are dropped, and torch's thread count is
    the command's to choose; both put back after (``cli.main`` may run inside another program)."""
    import torch

    from omni_lightning.runner import cpu_threads

    loggers, threads = [logging.getLogger(name) for name in LOGGERS], torch.get_num_threads()
    for lg in loggers:
        lg.addFilter(_drop_said_elsewhere)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_drop_said_elsewhere)
        torch.set_num_threads(threads)
        cpu_threads.forget()


def set_cpu_threads(trainer: Any, datamodule: Any) -> None:
    """torch's threads for a run of one process on the CPU (``cpu_threads.choose_threads``), counting the
    data module's loader workers; several processes (DDP) keep Lightning's own choice."""
    if trainer.strategy.root_device.type != "cpu" or trainer.world_size > 1:
        return
    workers = getattr(datamodule, "num_workers", 0)
    if workers is None:  # CodesDataModule's choice for files (the command line reads files)
        from lightning.fabric.utilities.data import suggested_max_num_workers

        suggested = suggested_max_num_workers(1)
        workers = 0 if suggested <= 1 else min(suggested, 4)
    choose_threads(workers)


def start_line(subcommand: str, trainer: Any, module: Any, ckpt_path: Any) -> str | None:
    """fit's, validate's or test's start-up line (see the module docstring); None for another module."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "output_length"):
        return None
    checkpoint = getattr(module, "hparams", {}).get("checkpoint")
    model = f"checkpoint {checkpoint}" if checkpoint else f"{config.name} preset"
    params = list(getattr(module, "model", module).parameters())
    total, trained = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    size = f"{total / 1e6:.1f} M parameters" + (f" ({trained / 1e6:.1f} M trained)" if subcommand == "fit" else "")
    origin = getattr(module, "weights_origin", None) or "its weights"
    if ckpt_path:
        origin = f"resuming from {ckpt_path}" if subcommand == "fit" else f"weights from {ckpt_path}"
    device = trainer.strategy.root_device
    where = f"{device.type} {trainer.precision}" + (f", {threads_said()}" if device.type == "cpu" else "")
    ranks = f" over {trainer.world_size} processes" if trainer.world_size > 1 else ""
    return f"{subcommand}: {model}, {size}, {origin}; {where}{ranks}"


def say_start(cli: Any) -> None:
    """Prints the start-up line of ``cli``'s subcommand (rank 0)."""
    ckpt_path = cli.config[cli.subcommand].get("ckpt_path")
    line = start_line(cli.subcommand, cli.trainer, cli.model, ckpt_path)
    if line and cli.trainer.is_global_zero:
        print(line)
