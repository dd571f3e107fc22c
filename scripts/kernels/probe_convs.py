"""Which cuDNN kernels the decoder's convolutions get, and at what speed, on the layouts they could take.

    python scripts/kernels/probe_convs.py                 # a GPU: qwen3-omni, bf16, batch 32 x 10 s

For every convolution of the decoder (its first one, each stage's transposed convolution and three
dilated ones, the last one), at that stage's rows: milliseconds and the cuDNN kernel picked
(``torch.profiler``, the longest kernel of one call) for the layer as it runs (channels-last ``[B, C,
1, T]``, a dilated one folded to ``[B, C, T/d, d]``), with ``cudnn.benchmark`` on, and for a dilated
one as a native dilation ``(1, d)``; TFLOP/s of each. Writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import device_model, median_time, save

from omni_lightning.engine.bucket_graphs import conv_layout
from omni_lightning.kernels import Kernels
from omni_lightning.models.layers import CausalConv1d, CausalConvTranspose1d, _nhwc
from omni_lightning.models.state import Step


def top_kernel(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return "-"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    best = max(events, key=lambda e: e.self_device_time_total, default=None)
    return best.key[:110] if best else "-"


def variants(layer, buf: torch.Tensor, length: int, step: Step) -> dict:
    engine = copy.deepcopy(layer)  # the weight as the engine holds it (engine/graphs.conv_layout)
    engine.conv.weight.data = conv_layout(engine.conv.weight.data)
    if isinstance(layer, CausalConvTranspose1d):
        return {"as run": lambda: layer(buf, step, bias=False), "engine weights": lambda: engine(buf, step, bias=False)}
    out = {"as run": lambda: layer(buf, length, bias=False), "engine weights": lambda: engine(buf, length, bias=False)}
    d = layer.conv.dilation[0]
    if d > 1:
        w = layer.conv.weight.unsqueeze(2)
        out["native dilation"] = lambda: F.conv2d(_nhwc(buf), w, dilation=(1, d))
    return out


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="probe_convs.json")
    return parser


def main() -> None:
    args = parser().parse_args()
    device = torch.device(args.device)
    model = device_model(args.preset, device)  # cpu: the smoke test (no kernel names)
    dtype = next(model.parameters()).dtype
    cfg, kernels = model.config, Kernels.for_inference(device)
    frames = int(args.seconds * cfg.frame_rate)
    rows = frames * math.prod(cfg.upsampling_ratios)
    layers = [(0, model.decoder[0], rows)]
    for i, block in enumerate(model.decoder[1:-2]):
        layers.append((i + 1, block.block[1], rows))
        rows *= cfg.upsample_rates[i]
        layers += [(i + 1, unit.conv1, rows) for unit in block.block[2:]]
    layers.append((len(cfg.upsample_rates), model.decoder[-1], rows))
    result = {"rows": []}
    print(f"{'stage':>5} {'layer':>22} {'rows':>8} {'variant':>16} {'ms':>7} {'+bench ms':>9} {'TFLOP/s':>7}  kernel")
    with torch.inference_mode():
        for stage, layer, n in layers:
            c_in, c_out, k = layer.conv.in_channels, layer.conv.out_channels, layer.conv.kernel_size[0]
            d = layer.conv.dilation[0] if isinstance(layer, CausalConv1d) else 1
            rows_in = -(-(n + layer.context) // d) * d  # history first, whole rows of d (layers.py)
            buf = torch.randn(args.batch, rows_in, c_in, device=device, dtype=dtype)
            step = Step(None, kernels, args.batch, n, device)
            out_rows = n * (layer.conv.stride[0] if isinstance(layer, CausalConvTranspose1d) else 1)
            flops = 2 * args.batch * out_rows * c_out * c_in * k / (layer.conv.stride[0] if d == 1 else 1)
            for name, fn in variants(layer, buf, n, step).items():
                t = median_time(fn, device, repeats=args.repeats)
                torch.backends.cudnn.benchmark = True
                tb = median_time(fn, device, repeats=args.repeats)
                kernel_b = top_kernel(fn)
                torch.backends.cudnn.benchmark = False
                kernel = top_kernel(fn)
                row = {"stage": stage, "layer": type(layer).__name__, "c_in": c_in, "c_out": c_out, "kernel_size": k,
                       "dilation": d, "rows": args.batch * n, "variant": name, "ms": 1e3 * t, "benchmark_ms": 1e3 * tb,
                       "tflops": flops / t / 1e12, "kernel": kernel, "benchmark_kernel": kernel_b}  # fmt: skip
                result["rows"].append(row)
                print(f"{stage:>5} {f'{type(layer).__name__[:12]} {c_in}>{c_out} d{d}':>22} {args.batch * n:>8} "
                      f"{name:>16} {1e3 * t:>7.3f} {1e3 * tb:>9.3f} {row['tflops']:>7.0f}  {kernel[:70]}"
                      f"{'' if kernel_b == kernel else ' | bench: ' + kernel_b[:60]}", flush=True)  # fmt: skip
            del buf
    save(args.out, result, args)


if __name__ == "__main__":
    main()
