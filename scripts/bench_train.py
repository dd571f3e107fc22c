"""Fine-tuning throughput (audio seconds per second) and peak memory with a real Lightning fit.

    python scripts/bench_train.py --preset tiny --device cpu --precision 32-true
    python scripts/bench_train.py --preset qwen3-omni --device cuda --precision bf16-mixed

Synthetic pairs (random codes; noise targets: throughput does not depend on what the audio is),
``--batch`` crops of ``--crop-seconds`` each; the first ``--warmup`` steps are not timed. Prints a
table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, Trainer, randomize_weights  # noqa: E402


class StepClock(pl.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.steps, self.seconds, self.seen = warmup, None, 0, 0.0, 0

    def _sync(self, module) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1  # batch_idx restarts every epoch
        if self.seen == self.warmup:
            self._sync(pl_module)
            self.start = time.perf_counter()
        elif self.seen > self.warmup:
            self.steps += 1

    def on_train_end(self, trainer, pl_module):
        self._sync(pl_module)
        self.seconds = time.perf_counter() - self.start


def write_pairs(folder: Path, n: int, frames: int, sample_rate: int, samples: int) -> Path:
    import soundfile as sf

    (folder / "codes").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        np.save(folder / "codes" / f"{i}.npy", rng.integers(0, 2048, (16, frames)))
        sf.write(folder / f"{i}.wav", (0.1 * rng.standard_normal(samples)).astype(np.float32), sample_rate)
        rows.append(json.dumps({"id": str(i), "codes": f"codes/{i}.npy", "audio": f"{i}.wav"}))
    (folder / "train.jsonl").write_text("\n".join(rows) + "\n")
    return folder / "train.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", nargs="+", default=["32-true"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--crop-seconds", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--adversarial", action="store_true")
    parser.add_argument("--out", default="bench_train.json")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.backends.cudnn.benchmark = True

    base = randomize_weights(Code2Wav(args.preset)).eval()
    config = base.config
    frames = round(args.crop_seconds * config.frame_rate)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        manifest = write_pairs(Path(tmp), args.batch * 4, frames, config.sample_rate, config.output_length(frames))
        for precision in args.precision:
            model = Code2Wav(config)
            model.load_state_dict(base.state_dict())
            module = Code2WavModule(model=model, adversarial=args.adversarial)
            clock = StepClock(args.warmup)
            trainer = Trainer(accelerator=args.device, devices=1, precision=precision, max_steps=args.steps,
                              logger=False, enable_checkpointing=False, enable_progress_bar=False,
                              enable_model_summary=False, limit_val_batches=0, callbacks=[clock])  # fmt: skip
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            dm = CodesDataModule(train=str(manifest), batch_size=args.batch, crop_frames=frames)
            trainer.fit(module, datamodule=dm)
            audio_s = clock.steps * args.batch * config.output_length(frames) / config.sample_rate
            peak = (torch.cuda.max_memory_allocated() if args.device == "cuda"
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # fmt: skip
            rows.append({"preset": args.preset, "device": args.device, "precision": precision, "batch": args.batch,
                         "crop_s": args.crop_seconds, "steps": clock.steps, "seconds": clock.seconds,
                         "step_s": clock.seconds / max(clock.steps, 1), "audio_s_per_s": audio_s / clock.seconds,
                         "peak_memory_gib": peak / 2**30, "adversarial": args.adversarial})  # fmt: skip
            print(f"  done {precision}", file=sys.stderr, flush=True)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
            "torch": torch.__version__, "args": vars(args)}  # fmt: skip
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    memory = "peak GPU memory allocated" if args.device == "cuda" else "peak process RSS"
    print(f"\n{args.preset} fine-tuning on {machine}, batch {args.batch} x {args.crop_seconds:g} s crops")
    print(f"| precision | step (ms) | audio s/s | {memory} (GiB) |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['precision']} | {1000 * r['step_s']:.0f} | {r['audio_s_per_s']:.1f} | {r['peak_memory_gib']:.2f} |"
        )


if __name__ == "__main__":
    main()
