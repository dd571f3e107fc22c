"""``omni-lightning demo``: the whole tool on the built-in ``tiny`` preset, on the CPU, no downloads.

1. makes a small synthetic dataset (random codes; target audio from a fixed "teacher" Code2Wav),
2. predicts it to WAV files through OmniPredictionLoop and WaveformWriter,
3. fine-tunes a student a few steps toward the teacher, then predicts again from the same in-memory
   module (no reload), and shows the student moved toward the teacher,
4. evaluates the student with the eval metrics into a CSV log (and a W&B offline run when wandb is
   installed),
and prints where everything is.

A rerun in the same ``--work-dir`` recomputes everything: the folders a previous demo made there
(``data``, ``wavs_before``, ``wavs_after``, ``runs``) are removed first, and the demo says so. A folder
that was not made by the demo (no ``.omni_lightning_demo`` marker in it) and is not empty is refused,
so nothing of yours is ever deleted.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omni_lightning.cli.console import DEFAULT_WORK_DIR

MARKER = ".omni_lightning_demo"
OUTPUTS = ("data", "wavs_before", "wavs_after", "runs")


@contextmanager
def quiet() -> Iterator[None]:
    """While the demo runs (levels and ``WANDB_SILENT`` put back after): it prints its own four lines,
    which Lightning's per-trainer banners (accelerator, seed) and wandb's run summary would bury.
    Warnings still show."""
    names = ("lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero")
    loggers = [logging.getLogger(name) for name in (*names, "lightning.fabric.utilities.rank_zero")]
    levels, silent = [lg.level for lg in loggers], os.environ.get("WANDB_SILENT")
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if silent is None:
            os.environ.pop("WANDB_SILENT", None)


def prepare_work_dir(work: Path) -> bool:
    """Makes ``work`` ready for a fresh run; True when a previous demo's outputs were removed.

    UsageError when ``work`` is a file, or a non-empty folder the demo did not make.
    """
    from omni_lightning.errors import UsageError

    if work.exists() and not work.is_dir():
        raise UsageError(f"--work-dir {work} is a file: give a folder (it is created when missing)")
    if work.is_dir() and any(work.iterdir()) and not (work / MARKER).is_file():
        raise UsageError(f"--work-dir {work} is not empty and was not made by the demo: give a new or empty folder")
    previous = [work / name for name in OUTPUTS if (work / name).exists()]
    for path in previous:
        shutil.rmtree(path)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("made by `omni-lightning demo`; its outputs here are replaced on every run\n")
    return bool(previous)


def run_demo(
    work_dir: str | Path = DEFAULT_WORK_DIR, n_requests: int = 12, fit_steps: int = 40, threads: int = 1
) -> dict:
    """Runs the four steps; ``threads``: torch's intra-op threads while it runs (restored after).

    One thread by default: the tiny preset's tensors are too small for intra-op parallelism to pay,
    and on a busy 2-core machine two threads made the demo ~5x slower (docs/performance.md).
    """
    start = time.perf_counter()
    work = Path(work_dir)
    if prepare_work_dir(work):
        print(f"[0/4] {work.resolve()} holds a previous demo run: removed its outputs, everything is recomputed")
    import torch

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with quiet():
            return _run(work, n_requests, fit_steps, start)
    finally:
        torch.set_num_threads(saved_threads)


def demo_data(folder: Path, n_requests: int = 12) -> tuple[Path, Path]:
    """The demo's data in ``folder``: ``codes/``, ``audio/`` and the manifests ``train.jsonl`` (``n_requests``
    pairs) and ``val.jsonl`` (a third as many, at least 4), audio from a fixed teacher. Returns the manifests."""
    import torch

    from omni_lightning.data.synthetic import make_demo_data, make_teacher

    torch.manual_seed(0)
    teacher = make_teacher("tiny")
    train = make_demo_data(folder, n_requests, 1.0, 3.0, teacher=teacher, seed=0, name="train.jsonl")
    val = make_demo_data(folder, max(4, n_requests // 3), 1.0, 3.0, teacher=teacher, seed=1, name="val.jsonl")
    return train, val


def _run(work: Path, n_requests: int, fit_steps: int, start: float) -> dict:
    from lightning.pytorch.loggers import CSVLogger

    from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, Trainer, WaveformWriter, randomize_weights

    train, val = demo_data(work / "data", n_requests)
    print(f"[1/4] synthetic data (random codes, audio from a fixed teacher Code2Wav): {train.parent.resolve()}")

    module = Code2WavModule(model=randomize_weights(Code2Wav("tiny"), seed=7), learning_rate=3e-3, warmup_steps=4)
    common = dict(accelerator="cpu", devices=1, enable_model_summary=False, enable_progress_bar=False)
    before = WaveformWriter(work / "wavs_before")
    Trainer(callbacks=[before], logger=False, **common).predict(
        module, datamodule=CodesDataModule(predict=str(val), batch_size=4), return_predictions=False
    )
    print(f"[2/4] predict (OmniPredictionLoop + WaveformWriter): {before.summary()}")

    logger = CSVLogger(str(work / "runs"), name="demo")
    data = CodesDataModule(train=str(train), val=str(val), batch_size=4, crop_frames=12)
    trainer = Trainer(
        max_steps=fit_steps,
        logger=logger,
        enable_checkpointing=False,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **common,
    )
    mel_before = Trainer(logger=False, **common).validate(module, datamodule=data, verbose=False)[0]
    trainer.fit(module, datamodule=data)
    after = WaveformWriter(work / "wavs_after")
    Trainer(callbacks=[after], logger=False, **common).predict(  # the same in-memory module: no reload
        module, datamodule=CodesDataModule(predict=str(val), batch_size=4), return_predictions=False
    )
    print(f"[3/4] fine-tuned {fit_steps} steps, then predicted in place: {after.summary()}")

    eval_logger = [CSVLogger(str(work / "runs"), name="eval")]
    wandb_run = None
    try:  # W&B offline when wandb is installed: no account, no network
        from lightning.pytorch.loggers import WandbLogger

        eval_logger.append(WandbLogger(project="omni-lightning-demo", save_dir=str(work / "runs"), offline=True))
    except (ImportError, ModuleNotFoundError):
        pass
    metrics = Trainer(logger=eval_logger, **common).validate(module, datamodule=data, verbose=False)[0]
    if len(eval_logger) > 1:
        import wandb

        wandb_run = Path(wandb.run.dir).resolve().parent  # the offline run's folder (its files/ is run.dir)
        wandb.finish()
    print(
        f"[4/4] evaluation: mel distance to the teacher {mel_before['val/mel_distance']:.3f} before fine-tuning, "
        f"{metrics['val/mel_distance']:.3f} after, STFT distance {mel_before['val/stft_distance']:.3f} -> "
        f"{metrics['val/stft_distance']:.3f}; logs in {(work / 'runs').resolve()}"
        + (f"; W&B offline run: `wandb sync {wandb_run}` uploads it" if wandb_run else "")
    )
    return {"seconds": time.perf_counter() - start, "wavs": work / "wavs_after", "before": mel_before, "after": metrics}


def _positive(text: str) -> int:
    """An integer >= 1 (argparse reports anything else as a usage error naming the value)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def main(argv: list[str] | None = None) -> None:
    """``omni-lightning demo [options]``: runs :func:`run_demo`. UsageError for an option it does not
    take, naming the closest one (argparse's own message names none)."""
    parser = argparse.ArgumentParser(
        prog="omni-lightning demo",
        description=__doc__.replace("``", ""),  # reST literals read as plain text in a terminal
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--work-dir",
        default=DEFAULT_WORK_DIR,
        help="the folder the demo writes to, made if missing (default: ./%(default)s)",
    )
    default = ">= 1; default: %(default)s"
    parser.add_argument("--requests", type=_positive, default=12, help=f"training requests ({default})")
    parser.add_argument("--steps", type=_positive, default=40, help=f"fine-tuning steps ({default})")
    parser.add_argument("--threads", type=_positive, default=1, help=f"torch intra-op threads ({default})")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        import difflib

        from omni_lightning.errors import UsageError

        option = unknown[0].split("=", 1)[0]
        known = [name for action in parser._actions for name in action.option_strings if name.startswith("--")]
        close = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
        hint = f": did you mean {close[0]}?" if close else ""
        raise UsageError(
            f"{option} is not an option of omni-lightning demo{hint} (omni-lightning demo --help lists them)"
        )
    result = run_demo(args.work_dir, args.requests, args.steps, args.threads)
    print(f"demo done in {result['seconds']:.1f} s; WAV files in {Path(result['wavs']).resolve()}")
