"""Where one warm ``trainer.predict`` of the mixed-length job spends its wall time.

Phases (host clock, device synchronized at each mark) from the Trainer's own hooks, then the top
functions of a cProfile of the same warm run. The job is ``bench_gpu.py``'s e2e workload (``mixed_workload``).

    python scripts/profile_predict.py                      # an H200
    python scripts/profile_predict.py --device cpu --preset tiny --requests 24 --batch 8 --max-s 4
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu import mixed_workload  # noqa: E402

from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, Trainer, randomize_weights  # noqa: E402


class Marks(pl.Callback):
    """Host time at each predict hook, the device synchronized first."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []

    def _mark(self, name: str, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self.marks.append((name, time.perf_counter()))

    def setup(self, trainer, pl_module, stage):
        self._mark("setup hook", pl_module)

    def on_predict_start(self, trainer, pl_module):
        self._mark("on_predict_start", pl_module)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0:
            self._mark("first batch start", pl_module)

    def on_predict_end(self, trainer, pl_module):
        self._mark("on_predict_end", pl_module)

    def teardown(self, trainer, pl_module, stage):
        self._mark("teardown hook", pl_module)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-s", type=float, default=2.0)
    parser.add_argument("--max-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=3, help="warm runs timed by phase (after one cold run)")
    parser.add_argument("--rows", type=int, default=35)
    parser.add_argument("--out", default=None, help="also write the cProfile table here")
    args = parser.parse_args()
    model = randomize_weights(Code2Wav(args.preset), seed=0).eval()
    reqs = mixed_workload(model.config, args)
    audio = sum(model.config.output_length(c.shape[-1]) for c in reqs.values()) / model.config.sample_rate
    module = Code2WavModule(model=model)

    def predict(profiler: cProfile.Profile | None = None) -> list[tuple[str, float]]:
        marks = Marks()
        trainer = Trainer(accelerator=args.device, devices=1, precision="bf16-true", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[marks])  # fmt: skip
        dm = CodesDataModule(predict=reqs, batch_size=args.batch)
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        trainer.predict(module, datamodule=dm)
        if profiler is not None:
            profiler.disable()
        return [("predict called", start), *marks.marks, ("predict returned", time.perf_counter())]

    cold = predict()
    print(f"{audio:.0f} s of audio, {len(reqs)} requests; cold run {cold[-1][1] - cold[0][1]:.2f} s")
    for run in range(args.runs):
        marks = predict()
        total = marks[-1][1] - marks[0][1]
        phases = ", ".join(f"{b[0]} +{(b[1] - a[1]) * 1e3:.0f}" for a, b in zip(marks, marks[1:]))
        print(f"warm {run}: {total:.3f} s ({audio / total:,.0f}x); ms: {phases}")
    prof = cProfile.Profile()
    predict(prof)
    stream = io.StringIO()
    pstats.Stats(prof, stream=stream).sort_stats("cumulative").print_stats(args.rows)
    stream.write("\n--- by own time ---\n")
    pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(args.rows)
    text = stream.getvalue()
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
