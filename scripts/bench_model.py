"""Throughput of omni_lightning's Code2Wav against transformers' Qwen3OmniMoeCode2Wav, same weights.

    python scripts/bench_model.py --preset tiny --device cpu                 # this machine
    python scripts/bench_model.py --preset qwen3-omni --device cuda          # an H200

Each row decodes a batch of ``--seconds`` clips of random codes with both implementations,
alternating them, and reports audio seconds per second (median of ``--repeats`` timed runs after
warm-up) and the max abs difference of their outputs. Prints a table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_lightning import Code2Wav, randomize_weights  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def reference(model: Code2Wav, dtype: torch.dtype, device: torch.device):
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    ref = Qwen3OmniMoeCode2Wav._from_config(Qwen3OmniMoeCode2WavConfig(**model.config.to_hf()))
    ref.load_state_dict(model.state_dict(), strict=True)
    return ref.to(device=device, dtype=dtype).eval()


def timed(fn, codes: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn(codes)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    base = randomize_weights(Code2Wav(args.preset), seed=0).eval()
    frames = round(args.seconds * base.config.frame_rate)
    rows = []
    for dtype_name in args.dtype:
        dtype = DTYPES[dtype_name]
        ours = Code2Wav(base.config).to(device=device, dtype=dtype).eval()
        ours.load_state_dict(base.state_dict())
        ours.set_fused_kernels(not args.no_fused)
        ref = reference(base, dtype, device)
        for batch in args.batch:
            gen = torch.Generator().manual_seed(batch)
            codes = torch.randint(0, base.config.codebook_size, (batch, base.config.num_quantizers, frames),
                                  generator=gen).to(device)  # fmt: skip
            with torch.inference_mode():
                diff = (ours(codes).float() - ref(codes).float()).abs().max().item()
                times: dict[str, list[float]] = {"ours": [], "transformers": []}
                for _ in range(args.warmup):
                    ours(codes), ref(codes)
                for _ in range(args.repeats):
                    times["ours"].append(timed(ours, codes, device))
                    times["transformers"].append(timed(ref, codes, device))
            audio_s = batch * base.config.output_length(frames) / base.sample_rate
            row = {"preset": args.preset, "device": str(device), "dtype": dtype_name, "batch": batch,
                   "clip_s": args.seconds, "max_abs_diff": diff}  # fmt: skip
            for impl, ts in times.items():
                row[f"{impl}_s"] = statistics.median(ts)
                row[f"{impl}_spread"] = (max(ts) - min(ts)) / statistics.median(ts)
                row[f"{impl}_x_realtime"] = audio_s / statistics.median(ts)
            row["speedup"] = row["transformers_s"] / row["ours_s"]
            rows.append(row)
            print(f"  done {dtype_name} batch {batch}: {row['speedup']:.2f}x", file=sys.stderr, flush=True)
        del ours, ref
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cudnn-benchmark", action="store_true", help="for both implementations")
    parser.add_argument("--no-fused", action="store_true", help="ours without the fused CUDA kernels")
    parser.add_argument("--out", default="bench_model.json")
    args = parser.parse_args()
    rows = run(args)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "machine": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
            or platform.machine(), "threads": torch.get_num_threads(), "args": vars(args)}  # fmt: skip
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\n{args.preset} on {meta['machine']} ({args.device}), {args.seconds:g} s clips, torch {torch.__version__}")
    print("| dtype | batch | ours (x real time) | transformers (x real time) | speedup | max abs diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch']} | {r['ours_x_realtime']:,.0f} | {r['transformers_x_realtime']:,.0f} "
              f"| {r['speedup']:.2f}x | {r['max_abs_diff']:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
