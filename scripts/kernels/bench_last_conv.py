"""The decoder's output layer alone (SnakeBeta, the C -> 1 convolution, the clamp): the layers against the one kernel.

    python scripts/kernels/bench_last_conv.py                        # a GPU: qwen3-omni, bf16, batch 32 x 10 s
    python scripts/kernels/bench_last_conv.py --device cpu --preset tiny --seconds 0.1 --batch 1 --repeats 1   # smoke

On the last decoder block's stream (random, ``[batch, seconds x 24 kHz, C]``, the model's dtype) and the model's
own last two layers (random weights, the convolution's weight as the engine holds it, channels innermost):

- ``layers``: what the forward runs today (``models/layers.output_waveform`` with ``Kernels.for_inference``):
  a SnakeBeta pass writing the convolution's input, cuDNN's convolution, the clamp; and its two parts alone;
- ``kernel BxW``: ``kernels/last_conv.py`` at each setting of its ``CANDIDATES`` (B rows per program, W warps),
  a plain call, and the launcher's setting as the engine calls it (history, fresh rows, each row's window);

all timed in turns (``--rounds`` of ``--repeats``, in one process), each with its effective bandwidth
(the bytes a single pass must move: the stream read once, the waveform written once, over its time) and
its share of the bandwidth floor at ``--bandwidth``; each kernel's largest difference from the layers.
The kernel needs CUDA (or ``TRITON_INTERPRET=1``): elsewhere its rows are skipped with the reason.
Prints a table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import device_model, interleaved_times, save

from omni_lightning.kernels import Kernels
from omni_lightning.kernels.last_conv import CANDIDATES, last_conv_tiles, last_conv_triton
from omni_lightning.models.layers import output_waveform
from omni_lightning.models.state import DecodeState, Step


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-omni")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="rounds of --repeats, every measure in turn")
    p.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s measured (H100 3.0e12, H200 4.3e12)")
    p.add_argument("--out", default="bench_last_conv.json")
    return p


def waveform(out, tail: int) -> torch.Tensor:
    """What a path returns (the kernel: the waveform and a window) as ``[B, T - tail]`` in fp32: the forward
    cuts the first ``tail`` samples (the layers leave them as they come, the kernel zeroes them)."""
    wav = out[0] if isinstance(out, tuple) else out
    return wav.float().reshape(wav.shape[0], -1)[:, tail:]


def main() -> None:
    args = parser().parse_args()
    device = torch.device(args.device)
    model = device_model(args.preset, device)
    act, conv = model.decoder[-2], model.decoder[-1]
    with torch.no_grad():  # the engine's layout: channels innermost (engine/bucket_graphs.conv_layout)
        conv.conv.weight.data = conv.conv.weight.data.transpose(1, 2).contiguous().transpose(1, 2)
    dtype, channels = conv.conv.weight.dtype, conv.conv.in_channels
    length = round(args.seconds * model.config.sample_rate / model.config.total_upsample) * model.config.total_upsample
    gen = torch.Generator(device=device).manual_seed(0)
    x = (0.3 * torch.randn(args.batch, length, channels, device=device, generator=gen)).to(dtype)
    pending = 0.1 * torch.randn(channels, device=device, generator=gen)
    layers = Kernels.for_inference(device)
    tail = model.config.tail
    step = Step(None, layers, args.batch, length // model.config.total_upsample, device)
    params = (act.alpha, act.beta, pending, conv.conv.weight, conv.conv.bias)
    candidates = {
        "layers": lambda: output_waveform(act, conv, x, pending, step, tail),
        "layers: SnakeBeta pass": lambda: act(x, step, pending, before=conv, junk=tail),
    }
    a = act(x, step, pending, before=conv, junk=tail)
    candidates["layers: convolution + clamp"] = lambda: conv(a, length).clamp(-1.0, 1.0).transpose(1, 2)
    runs = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
              "batch": args.batch, "length": length, "channels": channels,
              "kernel": "ran" if runs else "skipped: needs CUDA (or TRITON_INTERPRET=1)"}  # fmt: skip
    if runs:
        kw = dict(fresh=True, junk=tail, precise=device.type != "cuda")
        for block_t, warps in CANDIDATES:
            tiles = last_conv_tiles(channels, block_t, warps)
            candidates[f"kernel {block_t}x{warps}"] = lambda t=tiles: last_conv_triton(x, *params, tiles=t, **kw)
        state = DecodeState(model, args.batch).select(torch.arange(args.batch, device=device))
        launcher = functools.partial(last_conv_triton, precise=kw["precise"])
        stateful = Step(state, dataclasses.replace(layers, last_conv=launcher), args.batch, step.frames, device)
        candidates["kernel, as the engine calls it"] = lambda: output_waveform(act, conv, x, pending, stateful, tail)
    with torch.inference_mode():
        want = waveform(candidates["layers"](), tail)
        diffs = {name: float((waveform(fn(), tail) - want).abs().max()) for name, fn in candidates.items()
                 if name.startswith("kernel")}  # fmt: skip
        seconds = interleaved_times(candidates, device, warmup=3, repeats=args.repeats, rounds=args.rounds)
    one_pass = args.batch * length * (channels + 1) * x.element_size()
    floor = one_pass / args.bandwidth
    result.update(one_pass_bytes=one_pass, bandwidth=args.bandwidth, floor_ms=1e3 * floor, rows=[])
    print(f"{args.preset} {dtype}, batch {args.batch} x {length} samples x {channels} channels on "
          f"{result['device']}: one pass {one_pass / 1e9:.3f} GB, floor {1e3 * floor:.3f} ms at "
          f"{args.bandwidth / 1e12:.2f} TB/s")  # fmt: skip
    print("| path | ms | GB/s (one pass) | floor / time | max diff from the layers |\n|---|---|---|---|---|")
    for name, s in seconds.items():
        row = {"path": name, "ms": 1e3 * s, "gb_per_s": one_pass / s / 1e9, "of_floor": floor / s,
               "max_diff": diffs.get(name)}  # fmt: skip
        result["rows"].append(row)
        diff = "" if row["max_diff"] is None else f"{row['max_diff']:.1e}"
        print(f"| {name} | {row['ms']:.3f} | {row['gb_per_s']:,.0f} | {row['of_floor']:.2f} | {diff} |")
    if not runs:
        print(result["kernel"])
    kernels = [r for r in result["rows"] if r["path"].startswith("kernel ") and "x" in r["path"].split()[-1]]
    if kernels:
        best = min(kernels, key=lambda r: r["ms"])
        result.update(best=best["path"], best_ms=best["ms"], layers_ms=result["rows"][0]["ms"],
                      speedup=result["rows"][0]["ms"] / best["ms"])  # fmt: skip
        print(f"best: {best['path']}, {result['speedup']:.2f}x the layers")
    save(args.out, result, args)


if __name__ == "__main__":
    main()
