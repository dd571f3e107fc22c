"""Where a Code2Wav forward spends its GPU time: top CUDA kernels, ours vs transformers.

python scripts/profile_model.py --preset qwen3-omni --dtype bf16 --batch 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_model import DTYPES, reference  # noqa: E402

from omni_lightning import Code2Wav, randomize_weights  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--ops", action="store_true", help="aten ops with input shapes instead of kernels")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    base = randomize_weights(Code2Wav(args.preset)).eval()
    ours = Code2Wav(base.config).cuda().to(dtype).eval()
    ours.load_state_dict(base.state_dict())
    ref = reference(base, dtype, torch.device("cuda"))
    frames = round(args.seconds * base.config.frame_rate)
    codes = torch.randint(0, base.config.codebook_size, (args.batch, base.config.num_quantizers, frames)).cuda()
    for name, fn in (("ours", ours), ("transformers", ref)):
        with torch.inference_mode():
            fn(codes), fn(codes)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=args.ops) as prof:
                fn(codes)
                torch.cuda.synchronize()
        total = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / 1e3
        print(f"\n=== {name}: {args.preset} {args.dtype} batch {args.batch}: {total:.1f} ms of kernels")
        if args.ops:
            table = prof.key_averages(group_by_input_shape=True).table(
                sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=40, max_shapes_column_width=60
            )
        else:
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows,
                                              max_name_column_width=90)  # fmt: skip
        print(table)


if __name__ == "__main__":
    main()
