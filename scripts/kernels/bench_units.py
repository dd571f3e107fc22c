"""The decoder's residual units, stage by stage: the layers against the fused convolution + SnakeBeta; whole forwards.

    python scripts/kernels/bench_units.py                      # a GPU: qwen3-omni, bf16, batch 32 x 10 s
    python scripts/kernels/bench_units.py --device cpu --preset tiny --seconds 0.5 --batch 1 --repeats 1   # smoke test

Per residual unit after its first SnakeBeta (each stage ``kernels/conv_snake.py`` takes, each dilation):
the layers (cuDNN convolution, SnakeBeta pass, in-place 1x1 GEMM; cuDNN's heuristic choice, then
with ``cudnn.benchmark``), the fused convolution + SnakeBeta with the same GEMM at each
``--configs`` tile setting; the convolution alone both ways; a cuBLAS GEMM of the convolution's
shape (``[rows, taps * C] x [taps * C, C]``, a ceiling for any implicit GEMM); the bandwidth and
compute floors; each path's relative error against the layers. Then whole eager forwards (batch
``--batch`` and 1) with the fused kernels, the layers and the reference, and the engine's graphed
decode of the batch (all but the reference). Prints tables; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import device_model, median_time, save

from omni_lightning import Code2Wav, DecodeEngine
from omni_lightning.kernels import Kernels
from omni_lightning.kernels.conv_snake import Tiles, conv_snake_triton, launch_tiles, split_channels, widths_supported
from omni_lightning.models.code2wav import REFERENCE
from omni_lightning.models.state import Step

CONFIGS = ("default", "128:64:8:3", "128:32:8:4", "64:64:4:3", "128:32:4:4", "128:32:4:3", "256:32:8:3")  # m:k:w:s


def unit_rows(model: Code2Wav, batch: int, seconds: float) -> list[tuple[int, int, int]]:
    """(stage, channels, rows per batch row) of each decoder block."""
    cfg, out = model.config, []
    rate = cfg.frame_rate * math.prod(cfg.upsampling_ratios)
    for i, r in enumerate(cfg.upsample_rates):
        rate *= r
        out.append((i + 1, cfg.decoder_dim // 2 ** (i + 1), int(seconds * rate)))
    return out


def tiles_for(spec: str, channels: int) -> Tiles | None:
    if spec == "default":
        return launch_tiles(channels, channels)
    m, k, w, s = (int(v) for v in spec.split(":"))
    if channels % k:
        return None
    return Tiles(m, *split_channels(channels), k, w, s)


def layers_unit(unit, x: torch.Tensor, a: torch.Tensor, layers: Kernels) -> torch.Tensor:
    rows, channels = x.shape[1], x.shape[2]
    h = unit.act2(unit.conv1(a, rows, bias=False), Step(None, layers, x.shape[0], rows, x.device), unit.conv1.conv.bias)
    return x.view(-1, channels).addmm_(h.reshape(-1, channels), unit.conv2.conv.weight.view(channels, -1).t())


def fused_unit(unit, x: torch.Tensor, a: torch.Tensor, **kw) -> torch.Tensor:
    c1, act2, channels = unit.conv1.conv, unit.act2, x.shape[2]
    h = conv_snake_triton(a, c1.weight, c1.bias, act2.alpha, act2.beta, c1.dilation[0], x.shape[1], **kw)
    return x.view(-1, channels).addmm_(h.reshape(-1, channels), unit.conv2.conv.weight.view(channels, -1).t())


def with_benchmark(fn):
    def run(*args, **kw):
        saved = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True
        try:
            return fn(*args, **kw)
        finally:
            torch.backends.cudnn.benchmark = saved

    return run


def bench_unit(unit, stage, channels, rows, layers, args, device, dtype, result) -> dict:
    d, t = unit.conv1.conv.dilation[0], functools.partial(median_time, device=device, repeats=args.repeats)
    x = torch.randn(args.batch, rows, channels, device=device, dtype=dtype)
    a = unit.act1(x, Step(None, layers, args.batch, rows, device), None, before=unit.conv1, junk=0)
    want = layers_unit(unit, x.clone(), a, layers).float()
    scratch = x.clone()
    c1 = unit.conv1.conv
    row = {"stage": stage, "channels": channels, "dilation": d, "rows": args.batch * rows,
           "layers_ms": 1e3 * t(functools.partial(layers_unit, unit, scratch, a, layers)),
           "layers_benchmark_ms": 1e3 * t(with_benchmark(functools.partial(layers_unit, unit, scratch, a, layers))),
           "conv_cudnn_ms": 1e3 * t(lambda: unit.conv1(a, rows, bias=False)),
           "conv_cudnn_benchmark_ms": 1e3 * t(with_benchmark(lambda: unit.conv1(a, rows, bias=False)))}  # fmt: skip
    row["cublas_gemm_ms"] = 1e3 * gemm_time(args.batch * rows, 7 * channels, channels, dtype, t)
    flops = 2 * args.batch * rows * channels * channels * 8  # 7 taps + the 1x1
    row["compute_floor_ms"] = 1e3 * flops / args.tflops / 1e12
    row["bandwidth_floor_ms"] = 1e3 * args.batch * rows * channels * x.element_size() * 5 / args.bandwidth
    row["fused"] = []
    for spec in args.configs if device.type == "cuda" else ["default"]:
        tiles = tiles_for(spec, channels)
        if tiles is None:
            continue
        kw = dict(tiles=tiles, precise=device.type != "cuda")
        try:
            got = fused_unit(unit, x.clone(), a, **kw).float()
            ms = 1e3 * t(functools.partial(fused_unit, unit, scratch, a, **kw))
            conv_ms = 1e3 * t(lambda kw=kw: conv_snake_triton(a, c1.weight, c1.bias, unit.act2.alpha, unit.act2.beta,
                                                              d, rows, **kw))  # fmt: skip
        except Exception as err:  # a setting the GPU refuses: say so, go on
            row["fused"].append({"config": spec, "error": str(err)[:300]})
            continue
        err = float((got - want).norm() / want.norm())
        row["fused"].append({"config": spec, "tiles": dataclasses.asdict(tiles), "unit_ms": ms,
                             "conv_snake_ms": conv_ms, "tflops": flops / ms / 1e9, "rel_err": err})  # fmt: skip
    result["units"].append(row)
    return row


def gemm_time(m: int, k: int, n: int, dtype: torch.dtype, timer) -> float:
    """Seconds of a cuBLAS ``[m, k] x [k, n]`` product (the convolution's GEMM, as a ceiling)."""
    a = torch.randn(m, k, device="cuda" if torch.cuda.is_available() else "cpu", dtype=dtype)
    b = torch.randn(k, n, device=a.device, dtype=dtype)
    return timer(lambda: a @ b)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s measured (H100 3.0e12, H200 4.3e12)")
    parser.add_argument("--tflops", type=float, default=798, help="dense bf16 TFLOP/s measured (H100 798, H200 788)")
    parser.add_argument("--out", default="bench_units.json")
    return parser


def main() -> None:
    args = parser().parse_args()
    device = torch.device(args.device)
    model = device_model(args.preset, device)
    dtype = next(model.parameters()).dtype
    fused = Kernels.for_inference(device)
    layers = dataclasses.replace(fused, conv_snake=None, name=f"{fused.name}-layers")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "units": [], "forward": []}
    print(f"{'stage':>5} {'C':>4} {'d':>2} {'layers':>7} {'+bench':>7} {'fused':>7} {'config':>11} {'conv':>6} "
          f"{'conv+sn':>7} {'cuBLAS':>6} {'floors c/b':>11} {'rel err':>8}")  # fmt: skip
    with torch.inference_mode():
        for stage, channels, rows in unit_rows(model, args.batch, args.seconds):
            if not widths_supported(channels, channels):
                continue
            for unit in model.decoder[stage].block[2:]:
                r = bench_unit(unit, stage, channels, rows, layers, args, device, dtype, result)
                ok = [f for f in r["fused"] if "unit_ms" in f]
                none = {"unit_ms": math.nan, "config": "-", "conv_snake_ms": math.nan, "rel_err": math.nan}
                best = min(ok, key=lambda f: f["unit_ms"]) if ok else none
                print(f"{stage:>5} {channels:>4} {r['dilation']:>2} {r['layers_ms']:>7.3f} "
                      f"{r['layers_benchmark_ms']:>7.3f} {best['unit_ms']:>7.3f} {best['config']:>11} "
                      f"{r['conv_cudnn_ms']:>6.3f} {best['conv_snake_ms']:>7.3f} {r['cublas_gemm_ms']:>6.3f} "
                      f"{r['compute_floor_ms']:>5.2f}/{r['bandwidth_floor_ms']:<5.2f} {best['rel_err']:>8.1e}",
                      flush=True)  # fmt: skip
        frames = int(args.seconds * model.config.frame_rate)
        audio = model.output_length(frames) / model.config.sample_rate
        print(f"\n{'forward':>28} {'batch':>5} {'ms':>8} {'x real time':>11}")
        for batch in dict.fromkeys((args.batch, 1)):
            codes = torch.randint(0, model.config.codebook_size, (batch, 16, frames), device=device)
            runs = [("fused", fused), ("layers", layers), ("reference", REFERENCE)]
            for name, kernels in runs:
                fn = functools.partial(model, codes, kernels=kernels)
                forward(result, name, batch, audio, median_time(fn, device, repeats=args.repeats))
            if device.type == "cuda":
                for name, kernels in runs[:2]:
                    engine = DecodeEngine(model, max_rows=batch, kernels=kernels)
                    fn = functools.partial(engine.decode, codes, [frames] * batch)
                    forward(result, f"engine {name}", batch, audio, median_time(fn, device, repeats=args.repeats))
                    engine.close()
    save(args.out, result, args)


def forward(result: dict, name: str, batch: int, audio: float, seconds: float) -> None:
    row = {"kernels": name, "batch": batch, "ms": seconds * 1e3, "x_realtime": batch * audio / seconds}
    result["forward"].append(row)
    print(f"{name:>28} {batch:>5} {seconds * 1e3:>8.2f} {row['x_realtime']:>11,.0f}", flush=True)


if __name__ == "__main__":
    main()
