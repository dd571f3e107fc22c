"""Where a forward's time goes: the engine's forward at a few (rows, chunk) shapes, replayed and eager,
and the top CUDA kernels of one stateful eager forward.

    python scripts/profiling/profile_engine.py                     # a GPU, qwen3-omni bf16
    python scripts/profiling/profile_engine.py --device cpu --preset tiny --shapes 2x8   # smoke test

Per shape: milliseconds and x real time of a CUDA-graph replay (``DecodeEngine``), of the eager
stateful forward (what the engine captures) and of the eager whole-request forward (no state), with
the engine's kernels. Then a kernel table (torch.profiler, self CUDA time) of ``--profile-shape``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import median_time, random_model, save

from omni_lightning import Code2Wav, DecodeEngine
from omni_lightning.kernels import Kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="+", default=["32x128", "32x48", "8x128", "1x1024", "1x1"])
    parser.add_argument("--profile-shape", default="32x128")
    parser.add_argument("--out", default="profile_engine.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    base = random_model(args.preset)
    model = Code2Wav(base.config).to(device, torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    model.load_state_dict(base.state_dict())
    kernels = Kernels.for_inference(device)
    rows = []
    with torch.inference_mode():
        for shape in args.shapes:
            b, c = (int(v) for v in shape.split("x"))
            codes = torch.randint(0, base.config.codebook_size, (b, base.config.num_quantizers, c), device=device)
            audio = b * c * base.config.total_upsample / base.config.sample_rate
            engine = DecodeEngine(model, frames_per_forward=b * c, max_rows=b)
            state = engine.state.select(torch.arange(b, device=device), torch.full((b,), c, device=device))
            times = {
                "replay": median_time(lambda e=engine, x=codes, n=[c] * b: e.decode(x, n), device),
                "eager_state": median_time(lambda x=codes, s=state: model(x, s, kernels), device),
                "eager_whole": median_time(lambda x=codes: model(x, kernels=kernels), device),
            }
            row = {"shape": shape, **{k: {"ms": 1e3 * v, "x": audio / v} for k, v in times.items()}}
            rows.append(row)
            print(row, flush=True)
            engine.close()
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            b, c = (int(v) for v in args.profile_shape.split("x"))
            codes = torch.randint(0, base.config.codebook_size, (b, base.config.num_quantizers, c), device=device)
            state = DecodeState_for(model, b, c, device)
            model(codes, state, kernels)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model(codes, state, kernels)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
            print(table)
    save(args.out, {"rows": rows}, args)


def DecodeState_for(model: Code2Wav, b: int, c: int, device: torch.device):  # noqa: N802
    state = model.new_state(b)
    return state.select(torch.arange(b, device=device), torch.full((b,), c, device=device))


if __name__ == "__main__":
    main()
