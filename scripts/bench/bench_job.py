"""The predict job as users run it: the default ``omni_lightning.Trainer`` over a seeded mixed-length
job, under a GPU memory cap, cold then warm, each request checked against its whole decode.

    python scripts/bench/bench_job.py --share 0.03                       # the mixed job at a 0.03 cap (a GPU)
    python scripts/bench/bench_job.py --share 0.02 --precision 32-true --check 384   # fp32: every request exact
    python scripts/bench/bench_job.py --requests 1 --min-s 600 --max-s 600 --check 1  # one 600 s request
    python scripts/bench/bench_job.py --job long-tailed --share 0.03     # most requests under 5 s, a few over a minute
    python scripts/bench/bench_job.py --default-budget-gib 8             # no cap, the default budget at 8 GiB
    python scripts/bench/bench_job.py --peer                             # + a plain transformers loop
    python scripts/bench/bench_job.py --device cpu --preset tiny --requests 8 --max-s 4   # smoke test

Run each setting in a fresh process (a cap applies to the process). x real time = audio seconds /
wall seconds of ``trainer.predict`` (``batches_x``: from the first batch to the end, set-up left out);
``outside_batches_s``: a warm predict's set-up plus teardown, the time outside its batches.
``--job``: ``mixed`` (``--requests`` of ``--min-s``..``--max-s``) or ``long-tailed`` (``--requests``
drawn from ``workload.LONG_TAILED``); ``padding`` is the share of computed frames that were padding.
Peak reserved memory is ``torch.cuda.max_memory_reserved`` (it sees CUDA-graph pools). ``--check N``:
the first N requests decoded alone, whole, in one eager forward with the cap lifted (fp32: max abs
difference; bf16: relative L2). ``--peer``: transformers' ``Qwen3OmniMoeCode2Wav`` on the same
weights, the batches in file order padded to their longest, ``.cpu()`` per request, warm.
``--default-budget-gib``: the engine's budget with no cap as if ``budget.DEFAULT_BUDGET`` were that
(for choosing the default; a cap's budget does not read it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import audio_seconds, long_tailed_job, memory, mixed_job, peer, random_model, rel_l2, save, timed

from omni_lightning import Code2Wav, Code2WavConfig, Code2WavModule, CodesDataModule, Trainer
from omni_lightning.engine import budget as budgets


class Clock(pl.Callback):
    """From the first predict batch's start to the end of predict (set-up and teardown left out)."""

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and dataloader_idx == 0:
            self.start = time.perf_counter()

    def on_predict_end(self, trainer, pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self.end = time.perf_counter()
        self.seconds = self.end - self.start


def predict(module: Code2WavModule, reqs: dict, args: argparse.Namespace) -> dict:
    clock = Clock()
    trainer = Trainer(
        accelerator=args.device,
        devices=1,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
        gpu_memory_utilization=args.share,
    )
    start = time.perf_counter()
    preds = trainer.predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=args.batch))
    end = time.perf_counter()
    wavs = {r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)}
    return {
        "seconds": end - start,
        "batches_s": clock.seconds,
        "wavs": wavs,
        "before_batches_s": clock.start - start,
        "after_batches_s": end - clock.end,
    }


def check(base: Code2Wav, reqs: dict, wavs: dict, args: argparse.Namespace, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0)  # the solo decodes are the reference, not the job
    dtype = torch.float32 if args.precision == "32-true" else torch.bfloat16
    model = Code2Wav(base.config).to(device, dtype).eval()
    model.load_state_dict(base.state_dict())
    diffs, errors = [], []
    with torch.inference_mode():
        for req_id in list(reqs)[: args.check]:
            alone = model(reqs[req_id][None].to(device))[0].float().cpu()
            got = wavs[req_id]
            assert got.shape == alone.shape, (req_id, got.shape, alone.shape)
            diffs.append(float((got - alone).abs().max()))
            errors.append(rel_l2(got, alone))
    return {
        "checked": len(diffs),
        "max_abs_diff": max(diffs),
        "max_rel_l2": max(errors),
        "median_rel_l2": statistics.median(errors),
    }


def profiled(module: Code2WavModule, reqs: dict, args: argparse.Namespace) -> dict:
    """One warm predict under torch.profiler: wall seconds against the seconds the GPU ran kernels
    (their self time summed; overlapping streams counted twice), and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run = predict(module, reqs, args)
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(events.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60), file=sys.stderr)
    waits = [e for e in events if e.key.startswith("cuda") and "Launch" not in e.key]  # the host's waits on the device
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60), file=sys.stderr)
    return {
        "wall_s": run["seconds"],
        "batches_s": run["batches_s"],
        "gpu_kernel_s": busy,
        "host_cuda_calls": {e.key: {"count": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6} for e in waits},
    }


def peer_loop(base: Code2Wav, reqs: dict, args: argparse.Namespace, device: torch.device) -> dict:
    ref = peer(base, torch.bfloat16 if args.precision.startswith("bf16") else torch.float32, device)
    items = list(reqs.values())

    def run() -> None:
        with torch.inference_mode():
            for b in range(0, len(items), args.batch):
                batch = items[b : b + args.batch]
                n = max(c.shape[-1] for c in batch)
                codes = torch.stack([torch.nn.functional.pad(c, (0, n - c.shape[-1])) for c in batch]).to(device)
                wav = ref(codes)
                for i, c in enumerate(batch):
                    wav[i, :, : base.config.output_length(c.shape[-1])].float().cpu()

    run()  # warm-up
    return {"warm_s": timed(run, device)}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--share", type=float, default=None, help="gpu_memory_utilization (default: no cap)")
    parser.add_argument("--job", choices=("mixed", "long-tailed"), default="mixed")
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--min-s", type=float, default=None, help="mixed job: shortest request (default 2)")
    parser.add_argument("--max-s", type=float, default=None, help="mixed job: longest request (default 30)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="warm runs (median)")
    parser.add_argument("--graph-frames", type=int, default=512, help="longest forward run as a CUDA graph (0: none)")
    parser.add_argument("--frames", type=int, default=None, help="frames per forward (default: the memory budget's)")
    parser.add_argument("--check", type=int, default=16, help="requests compared with their whole decode")
    parser.add_argument("--default-budget-gib", type=float, default=None, help="see the module docstring")
    parser.add_argument("--peer", action="store_true")
    parser.add_argument("--profile", action="store_true", help="one more warm run under torch.profiler: GPU busy time")
    parser.add_argument("--out", default="bench_job.json")
    return parser


def job(config: Code2WavConfig, args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    if args.job == "long-tailed":
        if args.min_s is not None or args.max_s is not None:
            parser.error("--min-s/--max-s set the mixed job's range; --job long-tailed has its own tiers")
        return long_tailed_job(config, args.requests, args.seed)
    min_s, max_s = 2.0 if args.min_s is None else args.min_s, 30.0 if args.max_s is None else args.max_s
    return mixed_job(config, args.requests, min_s, max_s, args.seed)


def main() -> None:
    cli = parser()
    args = cli.parse_args()
    device = torch.device(args.device)
    if args.default_budget_gib is not None:  # a candidate default, measured before it is made one
        budgets.DEFAULT_BUDGET = int(args.default_budget_gib * 2**30)
    base = random_model(args.preset)
    reqs = job(base.config, args, cli)
    audio = audio_seconds(base.config, [c.shape[-1] for c in reqs.values()])
    module = Code2WavModule(
        model=random_model(args.preset), graph_frames=args.graph_frames, frames_per_forward=args.frames
    )  # fp32 on the CPU: the Trainer moves and casts it
    cold = predict(module, reqs, args)
    stats = dict(module.engine_stats)  # the cold run's (the engine's counts go on across predicts)
    res = {
        "job": args.job,
        "requests": len(reqs),
        "audio_s": audio,
        "share": args.share,
        "default_budget_gib": budgets.DEFAULT_BUDGET / 2**30,
        "precision": args.precision,
        "cold_s": cold["seconds"],
        "cold_engine": stats,
        "cold": memory(device),
    }
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the warm runs' own peak
    runs = [predict(module, reqs, args) for _ in range(args.repeats)]
    warm = statistics.median(r["seconds"] for r in runs)
    res["warm_phases_s"] = {
        k: statistics.median(r[k] for r in runs) for k in ("before_batches_s", "batches_s", "after_batches_s")
    }
    res["outside_batches_s"] = statistics.median(r["before_batches_s"] + r["after_batches_s"] for r in runs)
    res.update(
        warm_s=warm,
        x_realtime=audio / warm,
        batches_x=audio / statistics.median(r["batches_s"] for r in runs),
        cold_x=audio / cold["seconds"],
        warm=memory(device),
        warm_engine=module.engine_stats,
        frames_per_forward=module.engine_stats["frames_per_forward"],
        padding=1 - stats["frames"] / stats["computed"] if stats.get("computed") else 0.0,
        captures=stats.get("captures", 0),
        capture_s=stats.get("capture_s", 0.0),
    )
    if args.profile and device.type == "cuda":
        res["profile"] = profiled(module, reqs, args)
    res["report"] = f"cold: {stats}; warm: {module.engine_stats}"
    print(f"  {res['report']}", file=sys.stderr, flush=True)
    if module.engine is not None:
        module.engine.close()
    if args.check:
        res["check"] = check(base, reqs, runs[-1]["wavs"], args, device)
    if args.peer:
        res["peer"] = peer_loop(base, reqs, args, device)
        res["peer"]["x_realtime"] = audio / res["peer"]["warm_s"]
        res["ratio_to_peer"] = res["x_realtime"] / res["peer"]["x_realtime"]
    save(args.out, res, args)
    mem = res["warm"].get("peak_reserved_gib")
    line = (
        f"{args.preset} {args.job} {args.precision} share={args.share} graph_frames={args.graph_frames}: "
        f"{len(reqs)} requests, {audio:,.0f} s audio; "
        f"warm {res['x_realtime']:,.0f}x ({res['batches_x']:,.0f}x batches), cold {res['cold_s']:.2f} s, "
        f"{res['captures']} captures in {res['capture_s']:.2f} s, F={res['frames_per_forward']}, "
        f"{res['padding']:.0%} padding, outside batches {res['outside_batches_s']:.3f} s"
    )
    if mem is not None:
        line += f", peak reserved {mem:.2f} GiB"
    line += " (warm phases: " + ", ".join(f"{k[:-2]} {v:.3f} s" for k, v in res["warm_phases_s"].items()) + ")"
    if "check" in res:
        c = res["check"]
        line += f"; {c['checked']} checked: max abs {c['max_abs_diff']:.1e}, max rel L2 {c['max_rel_l2']:.1e}"
    if "peer" in res:
        line += f"; transformers {res['peer']['x_realtime']:,.0f}x -> {res['ratio_to_peer']:.2f}x"
    print(line)


if __name__ == "__main__":
    main()
