"""Fine-tuning throughput (audio seconds per second), step time and peak memory with a real Lightning fit.

    PYTHONPATH=. python scripts/bench/bench_train.py --preset tiny --device cpu --precision 32-true --batch 2
    PYTHONPATH=. python scripts/bench/bench_train.py --preset qwen3-omni --device cuda \\
        --precision 32-true bf16-mixed bf16-true --batch 8 32 [--adversarial]

Run from the repository root with the package importable (``pip install -e .`` or ``PYTHONPATH=.``);
it needs torch, torchaudio and Lightning only. Synthetic pairs in memory (random codes, noise
targets: the step's cost does not depend on what the audio is), every item a ``--crop-seconds``
crop, so what is timed is the training step, not file reading. One fit per (precision, batch): the
first ``--warmup`` batches are not timed, nor is the last, whose optimizer step is measured instead:
``updated`` is the share of the generator's weights that step changed (the code embedding excepted:
only the rows a batch looks up get a gradient). In bf16-true, an AdamW update smaller than half a
bf16 step of its weight is rounded away. Peak memory: GPU memory allocated
(``torch.cuda.max_memory_allocated``) on CUDA, process RSS on the CPU. Prints a table; writes JSON.

``--fit-cli`` also runs the user's command at the same settings, after each benchmark fit:
``omni-lightning fit --config configs/finetune.yaml`` (its EMA, progress bar, CSV logging, learning-rate
monitor, checkpoints and data loader workers) on the same pairs written to disk (codes ``.npy``, float
WAV), with the same preset, precision, batch, crop and batches, timed over the same batches by a
callback the command line adds (:class:`FitClock`). Its row follows the benchmark's, with
``fit / bench``; a subprocess, so the CUDA memory figure is the benchmark's only. ``--fit-args`` runs the
command once per string given, with those arguments added (``'' '--model.ema_decay null'``: what the EMA costs).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from omni_lightning import Code2Wav, Code2WavConfig, Code2WavModule, Trainer, collate_codes, randomize_weights
from omni_lightning.kernels import Kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: child.py, shared by every group
from child import cli, package_env  # noqa: E402


def paired_loader(config: Code2WavConfig, batch: int, frames: int, batches: int, seed: int = 0) -> DataLoader:
    """``batches`` batches of ``batch`` pairs: codes ``[Q, frames]`` and noise audio of their length."""
    gen = torch.Generator().manual_seed(seed)
    samples = config.output_length(frames)
    items = [
        {
            "id": str(i),
            "codes": torch.randint(0, config.codebook_size, (config.num_quantizers, frames), generator=gen),
            "audio": 0.1 * torch.randn(samples, generator=gen),
            "audio_length": samples,
        }
        for i in range(batch * batches)
    ]
    return DataLoader(items, batch_size=batch, collate_fn=collate_codes)


def fit_trainer(device: str, precision: str, batches: int, callbacks: list) -> pl.Trainer:
    """A Trainer for ``batches`` training batches (one step a batch, with the GAN too)."""
    return Trainer(
        accelerator=device,
        devices=1,
        precision=precision,
        max_steps=batches,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )


class EagerGenerator(Code2WavModule):
    """The module with fit's CUDA graphs off (``--graphs off``): the generator runs eagerly."""

    def configure_training_graph(self, trainer):
        return None


class FusedConvInTraining(Code2WavModule):
    """The module with the residual units' convolution and SnakeBeta fused in fit, backward too (``--conv-snake``:
    not the default, see ``Kernels.for_training``)."""

    def configure_training_kernels(self, device):
        return Kernels.for_training(device, fused_conv=True)


class EagerFusedConv(EagerGenerator, FusedConvInTraining):
    """Both: ``--graphs off --conv-snake``."""


def fresh_module(
    base: Code2Wav, adversarial: bool, learning_rate: float, graphs: bool = True, conv_snake: bool = False
) -> Code2WavModule:
    model = Code2Wav(base.config)
    model.load_state_dict(base.state_dict())
    # a schedule far longer than the run: the measured update is at the nominal rate, not the cosine's tail
    cls = {(True, False): Code2WavModule, (False, False): EagerGenerator, (True, True): FusedConvInTraining}.get(
        (graphs, conv_snake), EagerFusedConv
    )
    return cls(model=model, adversarial=adversarial, learning_rate=learning_rate, total_steps=10**6)


def synchronize(module: pl.LightningModule) -> None:
    if module.device.type == "cuda":
        torch.cuda.synchronize(module.device)


class StepClock(pl.Callback):
    """Times the batches after ``warmup`` up to the one before the last; snapshots the generator's
    weights before the last batch, whose update it measures."""

    def __init__(self, warmup: int, batches: int) -> None:
        self.warmup, self.batches = warmup, batches
        self.seen, self.start, self.seconds, self.timed = 0, 0.0, 0.0, 0
        self.before: dict[str, torch.Tensor] = {}
        self.updated = float("nan")
        self.graph: dict[str, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen += 1  # batch_idx restarts every epoch
        if self.seen == self.warmup:
            synchronize(pl_module)
            self.start = time.perf_counter()
        elif self.seen == self.batches - 1:
            synchronize(pl_module)
            self.seconds, self.timed = time.perf_counter() - self.start, self.seen - self.warmup
            self.before = {
                n: p.detach().to("cpu", copy=True)
                for n, p in pl_module.model.named_parameters()
                if p.requires_grad and not n.startswith("code_embedding")
            }

    def on_train_end(self, trainer, pl_module) -> None:
        graph = pl_module.training_graph
        self.graph = {**graph.stats, "failed": graph.failed} if graph is not None else {}
        after = dict(pl_module.model.named_parameters())
        changed = sum(int((after[n].detach().cpu() != p).sum()) for n, p in self.before.items())
        self.updated = changed / max(sum(p.numel() for p in self.before.values()), 1)


def bench_one(base: Code2Wav, args: argparse.Namespace, precision: str, batch: int, graphs: bool) -> dict[str, Any]:
    config = base.config
    frames = round(args.crop_seconds * config.frame_rate)
    batches = args.warmup + args.steps + 1
    clock = StepClock(args.warmup, batches)
    module = fresh_module(base, args.adversarial, args.learning_rate, graphs, args.conv_snake)
    trainer = fit_trainer(args.device, precision, batches, [clock])
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, train_dataloaders=paired_loader(config, batch, frames, batches))
    audio_s = clock.timed * batch * config.output_length(frames) / config.sample_rate
    peak = (
        torch.cuda.max_memory_allocated()
        if args.device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    del module, trainer
    gc.collect()
    return {
        "preset": args.preset,
        "device": args.device,
        "precision": precision,
        "batch": batch,
        "crop_s": args.crop_seconds,
        "adversarial": args.adversarial,
        "learning_rate": args.learning_rate,
        "steps": clock.timed,
        "seconds": clock.seconds,
        "step_s": clock.seconds / max(clock.timed, 1),
        "audio_s_per_s": audio_s / max(clock.seconds, 1e-9),
        "peak_memory_gib": peak / 2**30,
        "updated": clock.updated,
        "graphs": graphs,
        "conv_snake": args.conv_snake,
        "graph": clock.graph,
    }


class FitClock(StepClock):
    """:class:`StepClock` for ``omni-lightning fit`` (``--trainer.callbacks+=bench_train.FitClock``): its
    settings and the JSON file it writes at the end of the fit come in ``BENCH_TRAIN_CLOCK`` as
    ``warmup,batches,path`` (the command line gives a callback no arguments here)."""

    def __init__(self) -> None:
        warmup, batches, self.out = os.environ["BENCH_TRAIN_CLOCK"].split(",", 2)
        super().__init__(int(warmup), int(batches))

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        Path(self.out).write_text(json.dumps({"seconds": self.seconds, "timed": self.timed, "graph": self.graph}))


def write_pairs(folder: Path, loader: DataLoader, sample_rate: int) -> Path:
    """The loader's pairs as a manifest in ``folder``: ``codes/<id>.npy`` and ``audio/<id>.wav`` (float)."""
    import numpy as np
    import soundfile as sf

    (folder / "codes").mkdir(parents=True, exist_ok=True)
    (folder / "audio").mkdir(exist_ok=True)
    lines = []
    for item in loader.dataset:
        np.save(folder / "codes" / f"{item['id']}.npy", item["codes"].numpy())
        sf.write(folder / "audio" / f"{item['id']}.wav", item["audio"].numpy(), sample_rate, subtype="FLOAT")
        lines.append(
            json.dumps({"id": item["id"], "codes": f"codes/{item['id']}.npy", "audio": f"audio/{item['id']}.wav"})
        )
    manifest = folder / "train.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def fit_cli_one(
    base: Code2Wav, args: argparse.Namespace, precision: str, batch: int, extra: str = ""
) -> dict[str, Any]:
    """``omni-lightning fit`` with ``configs/finetune.yaml`` at the benchmark's settings (module docstring),
    plus ``extra`` (its arguments, split as a shell would)."""
    config = base.config
    frames = round(args.crop_seconds * config.frame_rate)
    batches = args.warmup + args.steps + 1
    here = Path(__file__).resolve().parent  # scripts/bench: FitClock's module, for the command's callback
    root = here.parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        manifest = write_pairs(Path(tmp), paired_loader(config, batch, frames, batches), config.sample_rate)
        clock = Path(tmp) / "clock.json"
        command = cli("fit", "--config", str(root / "configs/finetune.yaml"),
                      "--data.train", str(manifest), "--data.val", str(manifest), "--data.batch_size", str(batch),
                      "--data.crop_frames", str(frames), "--model.config", args.preset,
                      "--model.random_weights", "true",
                      "--model.learning_rate", str(args.learning_rate), "--model.total_steps", str(10**6),
                      "--model.adversarial", str(args.adversarial).lower(), "--trainer.precision", precision,
                      "--trainer.accelerator", "gpu" if args.device == "cuda" else args.device,
                      "--trainer.max_steps", str(batches),
                      "--trainer.logger.init_args.save_dir", str(Path(tmp) / "runs"),
                      "--trainer.callbacks+=bench_train.FitClock", *shlex.split(extra))  # fmt: skip
        # this script's folder (FitClock), then the tree given (an A/B's), then this checkout's
        env = package_env(str(here), BENCH_TRAIN_CLOCK=f"{args.warmup},{batches},{clock}")
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode or not clock.exists():
            raise RuntimeError(f"omni-lightning fit failed ({done.returncode}): {done.stderr[-3000:]}")
        timed = json.loads(clock.read_text())
    audio_s = timed["timed"] * batch * config.output_length(frames) / config.sample_rate
    seconds, steps = timed["seconds"], timed["timed"]
    return {
        **{"preset": args.preset, "device": args.device, "precision": precision, "batch": batch},
        **{"crop_s": args.crop_seconds, "adversarial": args.adversarial, "run": f"omni-lightning fit {extra}".strip()},
        **{"steps": steps, "seconds": seconds, "step_s": seconds / max(steps, 1)},
        **{"audio_s_per_s": audio_s / max(seconds, 1e-9), "peak_memory_gib": float("nan")},
        **{"updated": float("nan"), "graphs": True, "graph": timed["graph"]},
    }


def machine(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def write_json(path: str, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(args.device),
        "torch": torch.__version__,
        "args": vars(args),
    }
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", nargs="+", default=["32-true"], help="any of Lightning's, e.g. bf16-true")
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--crop-seconds", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=12, help="timed batches")
    parser.add_argument("--warmup", type=int, default=4, help="untimed batches before them")
    parser.add_argument("--adversarial", action="store_true", help="with the discriminators (GAN)")
    parser.add_argument(
        "--graphs",
        choices=["on", "off", "both"],
        default="on",
        help="fit's CUDA graphs of the generator (training/step_graph.py): as by default, off, or both",
    )
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument(
        "--conv-snake", action="store_true", help="the residual units' convolution and SnakeBeta fused in fit (opt-in)"
    )
    parser.add_argument("--fit-cli", action="store_true", help="also time `omni-lightning fit` at the same settings")
    parser.add_argument(
        "--fit-args",
        nargs="+",
        default=[""],
        help="--fit-cli: rows of the command's extra arguments, each one string, e.g. '' '--model.ema_decay null' "
        "(what each of its callbacks and settings costs)",
    )
    parser.add_argument("--out", default="bench_train.json")
    return parser


def main() -> None:
    args = parser().parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.backends.cudnn.benchmark = True

    base = randomize_weights(Code2Wav(args.preset)).eval()
    rows = []
    for batch in args.batch:
        for precision in args.precision:
            for graphs in {"on": [True], "off": [False], "both": [False, True]}[args.graphs]:
                rows.append(bench_one(base, args, precision, batch, graphs))
                print(
                    f"  done batch {batch} {precision} graphs {graphs}: {rows[-1]['graph']}",
                    file=sys.stderr,
                    flush=True,
                )
            bench = rows[-1]
            for extra in args.fit_args if args.fit_cli else []:
                rows.append(fit_cli_one(base, args, precision, batch, extra))
                rows[-1]["fit_over_bench"] = rows[-1]["audio_s_per_s"] / bench["audio_s_per_s"]
                print(f"  done {rows[-1]['run']}: {rows[-1]['fit_over_bench']:.2f} of the benchmark", file=sys.stderr)
            write_json(args.out, args, rows)  # after every row: a later crash keeps the earlier ones
    memory = "peak GPU memory allocated" if args.device == "cuda" else "peak process RSS"
    gan = ", GAN" if args.adversarial else ""
    print(f"\n{args.preset} fine-tuning on {machine(args.device)}, {args.crop_seconds:g} s crops{gan}")
    print(f"| run | batch | precision | generator graphs | step (ms) | audio s/s | {memory} (GiB) | updated |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        used = "replayed" if r["graph"].get("replays") else ("off" if not r["graphs"] else "not used")
        run = f"{r['run']} ({r['fit_over_bench']:.2f} of the benchmark)" if "fit_over_bench" in r else "bench"
        print(
            f"| {run} | {r['batch']} | {r['precision']} | {used} | {1000 * r['step_s']:.0f} | "
            f"{r['audio_s_per_s']:.1f} | {r['peak_memory_gib']:.2f} | {r['updated']:.1%} |".replace(
                "nan%", "-"
            ).replace("nan", "-")
        )


if __name__ == "__main__":
    main()
