"""What holds GPU memory in a predict: reserved bytes after a job, and the largest segments with the
Python lines that allocated them (``torch.cuda.memory._snapshot``).

    python scripts/profiling/profile_memory.py                       # a GPU: the tiny job uncapped, then capped jobs
    python scripts/profiling/profile_memory.py --jobs tiny --top 5

Jobs: ``tiny`` (7 requests, bf16-true, no cap), ``tiny-0.02`` (the GPU test's 41 requests of
2-160 s, 32-true, share 0.02), ``qwen-0.03`` (24 requests of 2-30 s, bf16-true, share 0.03), and
``repeat-fp32`` (two fp32 predicts of one module, TF32 on and off: their largest difference), and
``frames`` (``qwen3-omni`` bf16: the peak bytes one eager stateful forward adds at each (rows, chunk)
shape, what ``engine/budget.py`` estimates for it, and what one CUDA graph's capture adds). A job
that fails prints its error and the segments held at that moment. Writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import codes_job, random_model, save

from omni_lightning import Code2WavModule, CodesDataModule, Trainer

GIB = 2**30


def segments(top: int) -> list[dict]:
    """The ``top`` largest segments: size, pool, what is active in them, and where they were allocated."""
    snap = torch.cuda.memory._snapshot()
    rows = []
    for seg in sorted(snap["segments"], key=lambda s: -s["total_size"])[:top]:
        frames = seg.get("frames") or next((b.get("frames") for b in seg["blocks"] if b.get("frames")), [])
        keep = ("omni_lightning", "torch/nn", "cuda/graphs")
        ours = [
            f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
            for f in frames
            if any(k in f["filename"] for k in keep)
        ]
        rows.append(
            {
                "mib": seg["total_size"] / 2**20,
                "active_mib": seg["active_size"] / 2**20,
                "pool": str(seg.get("segment_pool_id")),
                "stream": seg.get("stream"),
                "where": ours[:6],
            }
        )
    return rows


def predict(reqs: dict, precision: str, share: float | None, preset: str = "tiny", batch_size: int = 8):
    module = Code2WavModule(model=random_model(preset, seed=11))
    trainer = Trainer(accelerator="gpu", devices=1, precision=precision, gpu_memory_utilization=share, logger=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    preds = trainer.predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=batch_size))
    return module, {r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)}


def job(name: str, cfg) -> tuple[dict, str, float | None, str]:
    rng = random.Random(0)
    if name == "tiny":
        return codes_job(cfg, [12] * 7), "bf16-true", None, "tiny"
    if name == "tiny-0.02":
        return codes_job(cfg, [rng.randint(25, 375) for _ in range(40)] + [2000]), "32-true", 0.02, "tiny"
    return codes_job(cfg, [rng.randint(25, 375) for _ in range(24)]), "bf16-true", 0.03, "qwen3-omni"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda; cpu: nothing to profile (a dry run)")
    parser.add_argument("--jobs", nargs="*", default=["frames", "tiny", "tiny-0.02", "qwen-0.03", "repeat-fp32"])
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--out", default="profile_memory.json")
    return parser


def main() -> None:
    args = parser().parse_args()
    if args.device != "cuda" or not torch.cuda.is_available():  # the battery's dry run: nothing to profile
        save(args.out, {"skipped": "needs CUDA"}, argparse.Namespace(device="cpu", jobs=args.jobs))
        print("profile_memory: needs CUDA; nothing profiled")
        return
    cfg = random_model("tiny").config
    result = {}
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    for name in args.jobs:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row: dict = {"reserved_before_gib": torch.cuda.memory_reserved() / GIB}
        try:
            if name == "repeat-fp32":
                row.update(repeat_fp32(cfg))
            elif name == "frames":
                row.update(frame_costs())
            else:
                reqs, precision, share, preset = job(name, cfg)
                module, _ = predict(reqs, precision, share, preset)
                row["stats"] = {k: v for k, v in module.engine_stats.items() if isinstance(v, (int, float))}
                row["frames_per_forward"] = module.engine.frames_per_forward if module.engine else None
        except Exception as err:
            row["error"] = "".join(traceback.format_exception_only(err))[-2000:]
        row["reserved_gib"] = torch.cuda.memory_reserved() / GIB
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        row["segments"] = segments(args.top)
        result[name] = row
        print(f"\n== {name}: reserved {row['reserved_gib']:.2f} GiB (peak {row['peak_reserved_gib']:.2f}), "
              f"{row.get('error', 'ok')[:600]}")  # fmt: skip
        for k in ("stats", "frames_per_forward", "max_abs"):
            if k in row:
                print(f"   {k}: {row[k]}")
        for seg in row["segments"]:
            print(f"   {seg['mib']:9.1f} MiB (active {seg['active_mib']:.1f}) pool {seg['pool']}: {seg['where'][:3]}")
        import gc

        gc.collect()
    save(args.out, result, args)


SHAPES = ((1, 16), (1, 64), (1, 256), (1, 1024), (4, 256), (8, 128), (16, 64), (32, 32), (32, 128), (8, 512),
          (16, 256), (64, 64))  # fmt: skip


def frame_costs(preset: str = "qwen3-omni") -> dict:
    """Per (rows, chunk): peak bytes an eager stateful forward adds over what is held before it (the
    engine's forward, its kernels, bf16), against ``activation_bytes_per_frame``; then the reserved
    bytes one capture of each small shape adds (graphs in one pool, captured in order)."""
    from omni_lightning import Code2Wav, DecodeEngine
    from omni_lightning.engine import budget

    model = Code2Wav(random_model(preset).config)
    model.load_state_dict(random_model(preset).state_dict())
    model = model.to("cuda", torch.bfloat16).eval()
    estimate = budget.activation_bytes_per_frame(model)
    engine = DecodeEngine(model, frames_per_forward=8192, max_rows=64, cuda_graphs=False)
    rows, q = [], model.config.num_quantizers
    with torch.inference_mode():
        for b, c in SHAPES:
            codes = torch.randint(0, 2048, (b, q, c), device="cuda")
            state = engine.state.select(torch.arange(b, device="cuda"), torch.full((b,), c, device="cuda"))
            model(codes, state, engine.kernels)  # cuDNN plans and workspaces first
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
            model(codes, state, engine.kernels)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - held
            rows.append({"rows": b, "chunk": c, "frames": b * c, "peak_mib": peak / 2**20,
                         "per_frame_kib": peak / (b * c) / 1024, "estimate_kib": estimate / 1024})  # fmt: skip
            print(f"   eager {b:>3} x {c:<5} {peak / 2**20:9.1f} MiB  {peak / (b * c) / 1024:8.1f} KiB/frame "
                  f"(estimate {estimate / 1024:.1f})", flush=True)  # fmt: skip
        engine.close()
        graphs = DecodeEngine(model, frames_per_forward=512, max_rows=64, graph_frames=512)
        captured = []
        for b, c in ((1, 16), (4, 16), (16, 16), (64, 8), (8, 64), (32, 16), (1, 512), (8, 32)):
            before = torch.cuda.memory_reserved()
            codes = torch.randint(0, 2048, (b, q, c), device="cuda")
            graphs.decode(codes, [c] * b)
            torch.cuda.synchronize()
            added = torch.cuda.memory_reserved() - before
            captured.append({"rows": b, "chunk": c, "reserved_added_mib": added / 2**20,
                             "captures": graphs.graphs.stats.captures})  # fmt: skip
            print(f"   graph {b:>3} x {c:<5} +{added / 2**20:8.1f} MiB reserved "
                  f"({graphs.graphs.stats.captures} captures)", flush=True)  # fmt: skip
        graphs.close()
    return {"eager": rows, "graphs": captured, "estimate_bytes_per_frame": estimate}


def repeat_fp32(cfg) -> dict:
    """Two predicts of one fp32 module on one GPU, with TF32 as torch leaves it and with it off."""
    reqs = codes_job(cfg, [5, 23, 40, 7, 61, 12, 33])
    out = {}
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
        module = Code2WavModule(model=random_model("tiny", seed=2))
        runs = []
        for _ in range(2):
            trainer = Trainer(accelerator="gpu", devices=1, logger=False, enable_progress_bar=False)
            preds = trainer.predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=3))
            runs.append({r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)})
        out[f"tf32_{tf32}"] = max(float((runs[0][r] - runs[1][r]).abs().max()) for r in reqs)
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    return {"max_abs": out}


if __name__ == "__main__":
    main()
