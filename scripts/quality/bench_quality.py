"""What the quality metrics (PESQ, STOI, ESTOI) cost on the CPU, per request and in a run.

    PYTHONPATH=. python scripts/quality/bench_quality.py --seconds 5 --repeats 5                    # per request
    PYTHONPATH=. python scripts/quality/bench_quality.py --seconds 5 --requests 500 --fit-steps 4   # and runs

Needs the ``quality`` extra (``pip install -e ".[quality]"``). Signals are speech-like
(``data.synthetic.speech_like``), the generated side a 10 dB noisy copy of the reference:

- **per request**: each metric of one ``--seconds`` request, in this process on one thread, median of
  ``--repeats`` (CPU time and wall time); PESQ's 24 to 16 kHz resampling (torchaudio, both signals)
  apart, as the step's thread pays it, not the workers;
- **a test run** (``--requests``): ``trainer.test`` of the ``tiny`` preset (random weights) on that many
  pairs of ``--seconds``, without and with ``pesq`` and ``stoi`` (``--rounds`` times each, alternating):
  wall time, the logged ``quality_s`` (the workers' CPU seconds) and ``quality_wait_s`` (how long the
  run waited after its last batch);
- **a fit** (``--fit-steps``): validation (``--val-requests``) after every training step, without and
  with them: each validation's wall time, and the gap from a validation's end to the next training
  batch's start (what the training step waits for).

``--threads`` sets torch's threads for the runs (on a shared CPU, fewer threads than cores keeps a
scorer from stalling them). Prints tables; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import save

from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, Trainer, randomize_weights
from omni_lightning.data.synthetic import speech_like
from omni_lightning.evaluation.quality import check_quality_metrics
from omni_lightning.evaluation.scoring import PESQ_RATE, default_workers, score_request

RATE = 24000
QUIET = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False)  # fmt: skip


def noisy(clean: torch.Tensor, snr_db: float = 10.0) -> torch.Tensor:
    noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(1))
    return clean + noise * (clean.pow(2).mean() / noise.pow(2).mean()).sqrt() * 10 ** (-snr_db / 20)


def per_request(seconds: float, repeats: int) -> list[dict[str, Any]]:
    from torchaudio.functional import resample

    clean = speech_like(seconds, RATE)
    degraded = noisy(clean)
    ref16, deg16 = (resample(s, RATE, PESQ_RATE).numpy() for s in (clean, degraded))
    rows = []

    def measure(name: str, fn) -> None:
        cpu, wall = [], []
        for _ in range(repeats):
            c, w = time.process_time(), time.perf_counter()
            fn()
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - w)
        rows.append({"what": name, "cpu_ms": 1000 * statistics.median(cpu), "wall_ms": 1000 * statistics.median(wall)})

    measure("resample 24 -> 16 kHz (both signals)", lambda: [resample(s, RATE, PESQ_RATE) for s in (clean, degraded)])
    for name in ("pesq", "stoi", "estoi"):
        measure(name, lambda name=name: score_request((name,), RATE, clean.numpy(), degraded.numpy(), ref16, deg16))
    return rows


def pairs(module: Code2WavModule, requests: int, seconds: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    frames = round(seconds * 12.5)
    n = module.model.output_length(frames)
    references = [speech_like(n / RATE, RATE, seed=i)[:n] for i in range(min(requests, 8))]  # reused: costly
    gen = torch.Generator().manual_seed(0)
    return {f"r{i:04d}": (torch.randint(0, 2048, (16, frames), generator=gen), references[i % len(references)])
            for i in range(requests)}  # fmt: skip


def test_run(model: Code2Wav, args: argparse.Namespace, quality: list[str] | None) -> dict[str, Any]:
    module = Code2WavModule(model=model, quality_metrics=quality, log_samples=0)
    data = CodesDataModule(test=pairs(module, args.requests, args.seconds), batch_size=args.batch)
    start = time.perf_counter()
    metrics = Trainer(**QUIET).test(module, datamodule=data, verbose=False)[0]
    row = {"quality": ",".join(quality or []) or "none", "wall_s": time.perf_counter() - start}
    return {**row, **{k.removeprefix("test/"): v for k, v in metrics.items() if "quality" in k or "pesq" in k}}


class Gaps(pl.Callback):
    """Each validation's wall time and the wait from its end to the next training batch."""

    def __init__(self) -> None:
        self.validations: list[float] = []
        self.gaps: list[float] = []
        self._start = self._end = None

    def on_validation_start(self, trainer, pl_module):
        self._start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        self._end = time.perf_counter()
        self.validations.append(self._end - self._start)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._end is not None:
            self.gaps.append(time.perf_counter() - self._end)
            self._end = None


def fit_run(model: Code2Wav, args: argparse.Namespace, quality: list[str] | None) -> dict[str, Any]:
    module = Code2WavModule(model=model, quality_metrics=quality, log_samples=0, fast_training=False)
    val = pairs(module, args.val_requests, args.seconds)
    train = {k: v for k, v in list(val.items())[:4]}
    data = CodesDataModule(train=train, val=val, batch_size=args.batch, crop_frames=12)
    gaps = Gaps()
    trainer = Trainer(**QUIET, max_steps=args.fit_steps, val_check_interval=1, check_val_every_n_epoch=None,
                      num_sanity_val_steps=0, callbacks=[gaps])  # fmt: skip
    trainer.fit(module, datamodule=data)
    return {"quality": ",".join(quality or []) or "none", "validation_s": statistics.median(gaps.validations),
            "gap_ms": 1000 * statistics.median(gaps.gaps), "validations_s": gaps.validations,
            "gaps_ms": [1000 * g for g in gaps.gaps]}  # fmt: skip


def rounds(run, count: int) -> list[dict[str, Any]]:
    """Without and with ``pesq`` and ``stoi``, alternating ``count`` times: per kind, the medians (and every run)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(count):
        for quality in (None, ["pesq", "stoi"]):
            row = run(quality)
            runs.setdefault(row["quality"], []).append(row)
    rows = []
    for kind, rows_of_kind in runs.items():
        numbers = {k for k, v in rows_of_kind[0].items() if isinstance(v, (int, float))}
        rows.append({"quality": kind, **{k: statistics.median(r[k] for r in rows_of_kind) for k in numbers},
                     "runs": rows_of_kind})  # fmt: skip
    return rows


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="each request's length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=0, help="a test run of this many requests (0: none)")
    parser.add_argument("--fit-steps", type=int, default=0, help="a fit of this many steps, validating after each")
    parser.add_argument("--val-requests", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads in the runs (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each kind, alternating (the table: medians)")
    parser.add_argument("--out", default="bench_quality.json")
    return parser


def main() -> None:
    args = parser().parse_args()
    check_quality_metrics(["pesq", "stoi", "estoi"])  # the extra, or its install command
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as a worker has
    result: dict[str, Any] = {"per_request": per_request(args.seconds, args.repeats), "workers": default_workers()}
    torch.set_num_threads(args.threads or threads)
    print(f"\nper {args.seconds:g} s request, one thread (median of {args.repeats})")
    print("| metric | CPU (ms) | wall (ms) |\n|---|---|---|")
    for r in result["per_request"]:
        print(f"| {r['what']} | {r['cpu_ms']:.0f} | {r['wall_ms']:.0f} |")
    model = randomize_weights(Code2Wav("tiny")).eval()
    if args.requests:
        test_run(model, argparse.Namespace(**{**vars(args), "requests": 2}), None)  # warm-up, not timed
        result["test"] = rounds(lambda q: test_run(model, args, q), args.rounds)
        print(f"\ntest run: {args.requests} requests of {args.seconds:g} s, tiny preset, {result['workers']} workers")
        print("| quality metrics | wall (s) | quality_s (workers' CPU s) | quality_wait_s |\n|---|---|---|---|")
        for r in result["test"]:
            quality_s, wait_s = r.get("quality_s", 0), r.get("quality_wait_s", 0)
            print(f"| {r['quality']} | {r['wall_s']:.1f} | {quality_s:.1f} | {wait_s:.2f} |")
    if args.fit_steps:
        result["fit"] = rounds(lambda q: fit_run(model, args, q), args.rounds)
        steps, val = args.fit_steps, args.val_requests
        print(f"\nfit: validation of {val} requests of {args.seconds:g} s after each of {steps} steps (medians)")
        print("| quality metrics | validation (s) | validation end to next step (ms) |\n|---|---|---|")
        for r in result["fit"]:
            print(f"| {r['quality']} | {r['validation_s']:.2f} | {r['gap_ms']:.1f} |")
    save(args.out, result, args)


if __name__ == "__main__":
    main()
