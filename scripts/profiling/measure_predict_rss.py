"""Resident memory of ``trainer.predict(..., return_predictions=True)`` against the audio it returns.

Writes a folder of random code files (lengths uniform in [--min-seconds, --max-seconds]) and, in a
fresh process per variant, predicts it with the ``tiny`` preset on the CPU through
``omni_lightning.Trainer`` and a ``CodesDataModule``: first once with ``return_predictions=False``
(so one-off growth, such as oneDNN's kernel caches and thread pools, is not counted), then, after
handing the freed heap back to the OS (``malloc_trim``, so both variants start from the same
footprint), with ``return_predictions=True``, keeping the result. Growth is the resident set size
(VmRSS) after the second run minus before it; the table divides it by the bytes of audio returned.
Variants: ``release`` (as shipped: the loop returns freed heap pages to the OS at the end of a run)
and ``no-release`` (that step switched off). Prints a table, writes JSON.

    python scripts/profiling/measure_predict_rss.py --audio-mb 300 --json docs/results/predict_rss_cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def write_job(folder: Path, audio_mb: float, min_s: float, max_s: float, seed: int) -> int:
    import numpy as np

    rng = np.random.default_rng(seed)
    total, i = 0.0, 0
    while total < audio_mb * 1e6 / 4 / 24000:  # float32 samples at 24 kHz
        seconds = rng.uniform(min_s, max_s)
        frames = max(1, round(seconds * 12.5))
        np.save(folder / f"req{i:05d}.npy", rng.integers(0, 2048, (16, frames), dtype=np.int64))
        total += frames / 12.5
        i += 1
    return i


def run_one(folder: str, batch_size: int, variant: str) -> dict:
    """The warm-up run and the measured run in this process; returns the measurements."""
    import gc

    import torch

    import omni_lightning.runner.loop as loop
    from omni_lightning import Code2WavModule, CodesDataModule, Trainer

    if variant == "no-release":
        loop.release_free_host_memory = lambda: False
    torch.manual_seed(0)
    module = Code2WavModule(config="tiny", random_weights=True)

    def predict(keep: bool):
        data = CodesDataModule(predict=folder, batch_size=batch_size, num_workers=0)
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        return trainer.predict(module, datamodule=data, return_predictions=keep)

    predict(False)
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # the baseline: model, caches and nothing freed kept (glibc only)
    before = rss_bytes()
    start = time.perf_counter()
    outputs = predict(True)
    seconds = time.perf_counter() - start
    gc.collect()
    after = rss_bytes()
    audio = sum(p["model_outputs"].nbytes for out in outputs for p in out.pooler_output)
    requests = sum(out.num_reqs for out in outputs)
    return {
        "variant": variant,
        "requests": requests,
        "audio_mb": audio / 1e6,
        "rss_before_mb": before / 1e6,
        "rss_after_mb": after / 1e6,
        "rss_growth_mb": (after - before) / 1e6,
        "growth_per_audio": (after - before) / audio,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--audio-mb", type=float, default=300.0, help="float32 audio the job returns, in MB")
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=30.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--variants", nargs="+", default=["no-release", "release"], choices=["no-release", "release"])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)  # internal: FOLDER VARIANT
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one[0], args.batch_size, args.one[1])))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        n = write_job(Path(tmp), args.audio_mb, args.min_seconds, args.max_seconds, seed=0)
        print(f"job: {n} code files, about {args.audio_mb:.0f} MB of float32 audio")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        for variant in args.variants:
            cmd = [sys.executable, __file__, "--one", tmp, variant, "--batch-size", str(args.batch_size)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
    print("| variant | requests | audio (MB) | RSS before (MB) | RSS after (MB) | growth (MB) | growth / audio |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['variant']} | {r['requests']} | {r['audio_mb']:.0f} | {r['rss_before_mb']:.0f} | "
            f"{r['rss_after_mb']:.0f} | {r['rss_growth_mb']:.0f} | {r['growth_per_audio']:.2f}x |"
        )
    if args.json is not None:
        meta = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": os.environ.get("OMP_NUM_THREADS"),
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        args.json.write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
