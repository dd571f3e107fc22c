"""Scaling over GPUs through Lightning DDP: the predict job and fine-tuning on 1, 2, 4, 8 devices.

    python scripts/bench/bench_scale.py                                    # N = 1 2 4 8, those this host has GPUs for
    python scripts/bench/bench_scale.py --devices 1 2 --out scale.json
    python scripts/bench/bench_scale.py --preset tiny --device cpu --devices 1 2 --requests 8 --fit-steps 3 # gloo smoke

For each N a fresh process (this script again, with ``--world N``) runs everything on the N ranks of
``omni_lightning.Trainer(devices=N, strategy="ddp")``:

- **predict**: the mixed 2-30 s job (``workload.mixed_job``, seed 0) scaled to N x ``--requests``
  requests, batch ``--batch``, through ``CodesDataModule``, whose ``LengthBucketBatchSampler`` deals the
  requests to the ranks by length (``use_distributed_sampler=False``, as the command line sets it).
  Once cold (ranks launched, kernels compiled, CUDA graphs captured), then warm: the ranks meet at a
  barrier, each times its whole ``trainer.predict`` (as bench_job.py times the job) and the job's wall
  time is the slowest rank's. Speed = audio seconds / that wall time. Each rank's request ids (of both
  runs) are gathered to rank 0, which checks that every request was decoded exactly once.
- **fine-tuning**: ``--fit-steps`` timed steps after 3 untimed ones, ``--batch`` crops of 2 s per rank
  (the global batch grows with N), reconstruction losses only, on bench_train.py's synthetic pairs and
  with its step clock; Lightning's DistributedSampler gives each rank its share. The clock runs on
  every rank; the slowest rank's time counts. Speed = audio seconds trained on all ranks / that time.

Efficiency = speed(N) / (N x speed(1)) (needs 1 in ``--devices``). Memory: peak reserved GPU memory of
each rank (``torch.cuda.max_memory_reserved``, CUDA-graph pools included), of the warm predict and of fit.

How the ranks start: Lightning's DDP launcher starts ranks 1..N-1 by running the process's command line
again with ``LOCAL_RANK`` set, so every rank parses the same arguments and runs the same code; Trainers
made after the first find ``LOCAL_RANK`` set and launch nothing (the process group stays up). No torchrun:
the fresh process per N is what keeps one N's ranks, memory and port from the next's.

Not measured: writing files (no ``WaveformWriter``: the decode, not the disk), the GAN, several nodes.
With ``--device cpu`` the ranks are gloo processes sharing the host's cores: a test that the job runs
and its counts add up, not a speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from bench_train import StepClock, fresh_module, paired_loader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import audio_seconds, memory, mixed_job, random_model, save

from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, Trainer

WARMUP, CROP_S, LEARNING_RATE = 3, 2.0, 1e-4


class Seen(pl.Callback):
    """The request ids this rank decoded."""

    def __init__(self) -> None:
        self.req_ids: list[str] = []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.req_ids += outputs.req_ids


def ddp_trainer(args: argparse.Namespace, world: int, **kw: Any) -> Trainer:
    return Trainer(
        accelerator=args.device,
        devices=world,
        strategy="ddp",
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def gather(record: dict) -> list[dict]:
    """Every rank's ``record``, in rank order (the process group Lightning set up stays up after a run)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, record)
    return out


def peak_reserved(device: torch.device) -> float | None:
    return memory(device).get("peak_reserved_gib")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def predict_once(args: argparse.Namespace, world: int, module: Code2WavModule, reqs: dict) -> tuple[Any, float, list]:
    """One ``trainer.predict`` of the job on this rank: the trainer, its seconds, the ids this rank decoded."""
    seen = Seen()
    trainer = ddp_trainer(args, world, use_distributed_sampler=False, callbacks=[seen])
    start = time.perf_counter()
    trainer.predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=args.batch), return_predictions=False)
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.synchronize(trainer.strategy.root_device)
    return trainer, time.perf_counter() - start, seen.req_ids


def bench_predict(args: argparse.Namespace, world: int, config: Any) -> dict[str, Any]:
    reqs = mixed_job(config, world * args.requests)
    module = Code2WavModule(model=random_model(args.preset))  # fp32 on the CPU: the Trainer moves and casts it
    trainer, cold_s, cold_ids = predict_once(args, world, module, reqs)  # launches the ranks, compiles, captures
    device = trainer.strategy.root_device
    trainer.strategy.barrier("warm")  # the process group the cold run made
    reset_peak(device)
    _, warm_s, warm_ids = predict_once(args, world, module, reqs)
    ranks = gather(
        {
            "cold_s": cold_s,
            "warm_s": warm_s,
            "cold_ids": cold_ids,
            "warm_ids": warm_ids,
            "peak_reserved_gib": peak_reserved(device),
        }
    )
    if module.engine is not None:
        module.engine.close()  # its graphs and state: not fit's memory
    lengths = {r: c.shape[-1] for r, c in reqs.items()}
    audio = audio_seconds(config, list(lengths.values()))
    wall = max(r["warm_s"] for r in ranks)
    return {
        "requests": len(reqs),
        "audio_s": audio,
        "wall_s": wall,
        "audio_s_per_s": audio / wall,
        "cold_wall_s": max(r["cold_s"] for r in ranks),
        "counts": {run: count(ranks, f"{run}_ids", reqs) for run in ("cold", "warm")},
        "rank_requests": [len(r["warm_ids"]) for r in ranks],
        "rank_audio_s": [audio_seconds(config, [lengths[i] for i in r["warm_ids"]]) for r in ranks],
        "rank_wall_s": [r["warm_s"] for r in ranks],
        "peak_reserved_gib": [r["peak_reserved_gib"] for r in ranks],
    }


def count(ranks: list[dict], key: str, reqs: dict) -> dict[str, Any]:
    """Requests seen over all ranks against the job: nothing lost, nothing decoded twice."""
    ids = [i for r in ranks for i in r[key]]
    res = {
        "seen": len(ids),
        "unique": len(set(ids)),
        "missing": len(set(reqs) - set(ids)),
        "unknown": len(set(ids) - set(reqs)),
    }
    res["ok"] = res["seen"] == res["unique"] == len(reqs) and res["missing"] == res["unknown"] == 0
    return res


def bench_fit(args: argparse.Namespace, world: int, base: Code2Wav) -> dict[str, Any]:
    config = base.config
    frames, batches = round(CROP_S * config.frame_rate), WARMUP + args.fit_steps + 1
    clock = StepClock(WARMUP, batches)
    trainer = ddp_trainer(args, world, max_steps=batches, limit_val_batches=0, callbacks=[clock])
    module = fresh_module(base, False, LEARNING_RATE)
    torch.backends.cudnn.benchmark = True  # as bench_train.py
    gc.collect()  # predict's trainers and module
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    # every rank takes `batches` batches of the dataset's world x batches (Lightning's DistributedSampler)
    trainer.fit(module, train_dataloaders=paired_loader(config, args.batch, frames, batches * world))
    ranks = gather(
        {
            "seconds": clock.seconds,
            "steps": clock.timed,
            "updated": clock.updated,
            "peak_reserved_gib": peak_reserved(trainer.strategy.root_device),
        }
    )
    seconds = max(r["seconds"] for r in ranks)
    audio = world * args.batch * clock.timed * config.output_length(frames) / config.sample_rate
    return {
        "batch_per_rank": args.batch,
        "crop_s": CROP_S,
        "steps": clock.timed,
        "seconds": seconds,
        "step_s": seconds / max(clock.timed, 1),
        "audio_s_per_s": audio / max(seconds, 1e-9),
        "rank_seconds": [r["seconds"] for r in ranks],
        "updated": ranks[0]["updated"],
        "peak_reserved_gib": [r["peak_reserved_gib"] for r in ranks],
    }


def run_world(args: argparse.Namespace) -> None:
    """One N, on every rank; rank 0 writes the result to ``--result``."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    base = random_model(args.preset)
    row: dict[str, Any] = {"devices": args.world, "predict": bench_predict(args, args.world, base.config)}
    print(f"  N={args.world}: predict done", file=sys.stderr, flush=True)
    if args.fit_steps > 0:
        row["fit"] = bench_fit(args, args.world, base)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def add_efficiency(rows: list[dict]) -> None:
    one = next((r for r in rows if r["devices"] == 1), None)
    for r in rows:
        for phase in ("predict", "fit"):
            if phase in r:
                base = one[phase]["audio_s_per_s"] if one is not None and phase in one else None
                r[phase]["efficiency"] = r[phase]["audio_s_per_s"] / (r["devices"] * base) if base else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8], help="the Ns to run")
    parser.add_argument("--requests", type=int, default=384, help="requests per rank (the job has N x this)")
    parser.add_argument("--batch", type=int, default=32, help="predict batch; fit batch per rank")
    parser.add_argument("--precision", default=None, help="default: bf16-true on CUDA, 32-true on the CPU")
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fit-steps", type=int, default=20, help="timed fit steps per N (0: no fit)")
    parser.add_argument("--out", default="bench_scale.json")
    parser.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)  # the per-N process
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.precision = args.precision or ("bf16-true" if args.device == "cuda" else "32-true")
    if args.world is not None:
        return run_world(args)
    have = torch.cuda.device_count() if args.device == "cuda" else max(args.devices)
    worlds = [n for n in args.devices if n <= have]
    if not worlds:
        raise SystemExit(f"none of --devices {args.devices} fits the {have} GPU(s) here")
    rows: list[dict] = []
    for n in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--world", str(n), "--result", str(result)]
            start = time.perf_counter()
            if subprocess.run(cmd).returncode != 0 or not result.is_file():
                raise SystemExit(f"N={n} failed (results so far in {args.out})")
            rows.append({**json.loads(result.read_text()), "process_s": time.perf_counter() - start})
        add_efficiency(rows)
        save(args.out, {"rows": rows}, args)  # after every N: a later failure keeps the earlier ones
    report(rows, args)


def seen_once(row: dict) -> bool:
    return all(c["ok"] for c in row["predict"]["counts"].values())


def report(rows: list[dict], args: argparse.Namespace) -> None:
    def cells(phase: dict | None, speed: str) -> str:
        if phase is None:
            return "- | - | -"
        peak = phase["peak_reserved_gib"]
        eff = "-" if phase["efficiency"] is None else f"{phase['efficiency']:.0%}"
        return f"{phase['audio_s_per_s']:{speed}} | {eff} | " + ("-" if peak[0] is None else f"{max(peak):.2f}")

    print(
        f"\n{args.preset} {args.precision} on {args.device}: predict {args.requests} requests per rank "
        f"(batch {args.batch}), fit {args.batch} x {CROP_S:g} s per rank"
    )
    print(
        "| N | requests | each seen once | predict s | audio s/s | eff. | peak reserved GiB (max rank) "
        "| fit audio s/s | eff. | peak reserved GiB (max rank) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["predict"]
        print(
            f"| {r['devices']} | {p['requests']} | {'yes' if seen_once(r) else 'NO'} | {p['wall_s']:.2f} "
            f"| {cells(p, ',.0f')} | {cells(r.get('fit'), ',.1f')} |"
        )
    if not all(seen_once(r) for r in rows):
        raise SystemExit("requests were lost or decoded twice: see the counts in " + args.out)


if __name__ == "__main__":
    main()
