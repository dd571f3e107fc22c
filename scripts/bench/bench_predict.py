"""End-to-end batch inference into CPU tensors: Lightning's stock loop vs OmniPredictionLoop (with and
without AsyncD2HCallback) vs a plain decode loop vs the compute-only floor.

    python scripts/bench/bench_predict.py --preset tiny --device cpu --batch 1 8 32
    python scripts/bench/bench_predict.py --preset qwen3-omni --device cuda --dtype bf16 fp32 --batch 1 8 32

Variants (same module, same batches of ``--seconds`` clips of random codes):
  stock   lightning.Trainer's own loop; predict_step returns the batch waveform, Lightning moves it
          to the CPU (synchronous, pageable)
  omni    omni_lightning.Trainer(async_d2h=False) (OmniPredictionLoop): OmniModelRunnerOutput,
          per-request payloads, synchronous copies
  async   omni + AsyncD2HCallback (copy stream, pinned pool): the Trainer's default
  plain   for batch in loader: model.decode(...), each waveform .cpu()
  floor   the same predict steps through Lightning with the outputs left on the device
Time runs from the first batch to the last output on the host (setup excluded), median of
``--repeats`` runs, variants interleaved. Prints a table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from omni_lightning import (
    AsyncD2HCallback,
    Code2Wav,
    Code2WavModule,
    CodesDataset,
    Trainer,
    collate_codes,
    randomize_weights,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ("stock", "omni", "async", "plain", "floor")


class StockModule(Code2WavModule):
    """What a Lightning user writes without omni_lightning: return the batch waveform."""

    def predict_step(self, batch, batch_idx=0, dataloader_idx=0):
        return self.model(batch["codes"]).float()


class Clock(pl.Callback):
    """From the first batch's start to the end of predict (after the device is idle)."""

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0:
            self.start = time.perf_counter()

    def on_predict_end(self, trainer, pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self.seconds = time.perf_counter() - self.start


def trainer_for(variant: str, device: torch.device, clock: Clock) -> pl.Trainer:
    kw = dict(
        accelerator=device.type,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    callbacks = [clock] + ([AsyncD2HCallback()] if variant == "async" else [])
    if variant in ("omni", "async"):
        return Trainer(callbacks=callbacks, async_d2h=variant == "async", **kw)
    return pl.Trainer(callbacks=callbacks, **kw)


def run_variant(variant: str, model: Code2Wav, loader: DataLoader, device: torch.device) -> float:
    if variant == "plain":
        model.to(device)
        start = time.perf_counter()
        with torch.inference_mode():
            for batch in loader:
                codes = batch["codes"].to(device, non_blocking=True)
                wavs = model.decode(codes, batch["lengths"].tolist(), validate=False)
                _ = [w.float().cpu() for w in wavs]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start
    clock = Clock()
    module = (StockModule if variant in ("stock", "floor") else Code2WavModule)(model=model)
    trainer = trainer_for(variant, device, clock)
    preds = trainer.predict(module, loader, return_predictions=variant != "floor")
    if variant in ("omni", "async"):
        assert all(not o.in_flight for o in preds)
    return clock.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", nargs="+", default=["fp32"], choices=sorted(DTYPES))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--audio-per-run", type=float, default=320.0, help="seconds of audio per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default="bench_predict.json")
    args = parser.parse_args()

    device = torch.device(args.device)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.backends.cudnn.benchmark = True
    base = randomize_weights(Code2Wav(args.preset)).eval()
    frames = round(args.seconds * base.config.frame_rate)
    rows = []
    for dtype_name in args.dtype:
        model = Code2Wav(base.config).to(device=device, dtype=DTYPES[dtype_name]).eval()
        model.load_state_dict(base.state_dict())
        for batch in args.batch:
            n_batches = max(2, round(args.audio_per_run / (batch * args.seconds)))
            gen = torch.Generator().manual_seed(batch)
            reqs = {f"r{i:05d}": torch.randint(0, 2048, (16, frames), generator=gen) for i in range(batch * n_batches)}
            loader = DataLoader(CodesDataset(reqs, base.config), batch_size=batch, collate_fn=collate_codes)
            for variant in args.variants:  # warm-up: autotune, allocator, pinned pool
                run_variant(variant, model, loader, device)
            times = {v: [] for v in args.variants}
            for _ in range(args.repeats):
                for variant in args.variants:
                    times[variant].append(run_variant(variant, model, loader, device))
            audio_s = len(reqs) * base.config.output_length(frames) / base.sample_rate
            row = {
                "preset": args.preset,
                "device": str(device),
                "dtype": dtype_name,
                "batch": batch,
                "batches": n_batches,
                "audio_s": audio_s,
            }
            for v, ts in times.items():
                row[f"{v}_s"] = statistics.median(ts)
                row[f"{v}_spread"] = (max(ts) - min(ts)) / statistics.median(ts)
                row[f"{v}_x_realtime"] = audio_s / statistics.median(ts)
            rows.append(row)
            print(f"  done {dtype_name} batch {batch}", file=sys.stderr, flush=True)
        del model
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "args": vars(args),
        "machine": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    print(f"\n{args.preset} on {meta['machine']}, {args.seconds:g} s clips, x real time (median of {args.repeats})")
    head = [v for v in VARIANTS if v in args.variants]
    print("| dtype | batch | " + " | ".join(head) + " | omni/plain | async/floor | async/stock | copy hidden |")
    print("|---" * (len(head) + 6) + "|")
    for r in rows:
        cells = [f"{r[f'{v}_x_realtime']:,.0f}" for v in head]
        ratio = lambda a, b, r=r: f"{r[f'{b}_s'] / r[f'{a}_s']:.3f}" if f"{a}_s" in r and f"{b}_s" in r else "-"
        hidden = "-"
        if device.type == "cuda" and all(f"{v}_s" in r for v in ("omni", "async", "floor")):
            hidden = f"{(r['omni_s'] - r['async_s']) / (r['omni_s'] - r['floor_s']):.0%}"
        ratios = [ratio("omni", "plain"), ratio("async", "floor"), ratio("async", "stock"), hidden]
        print(f"| {r['dtype']} | {r['batch']} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
