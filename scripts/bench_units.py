"""The decoder's residual units, stage by stage: layer by layer against the fused kernel, then whole forwards.

    python scripts/bench_units.py                      # a GPU: qwen3-omni, bf16, batch 32 x 10 s
    python scripts/bench_units.py --device cpu --preset tiny --seconds 0.5 --batch 1 --repeats 1   # smoke test

Per decoder stage (its channels, at each dilation): one residual unit after its first SnakeBeta, as
the layers run it (cuDNN convolution, SnakeBeta pass, in-place GEMM) and as
``kernels/residual_unit.py`` runs it at each ``--configs`` tile setting; milliseconds, the bytes the
fused kernel must move over the card's bandwidth (``--bandwidth``), TFLOP/s, and its relative error
against the layers. Then the whole eager forward (batch ``--batch`` and 1) with the layers, with
the fused units and with the reference kernels. Prints tables; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import math

import torch
from workload import median_time, random_model, save

from omni_lightning import Code2Wav
from omni_lightning.kernels import Kernels
from omni_lightning.kernels.residual_unit import MAX_CHANNELS, residual_unit_triton
from omni_lightning.models.code2wav import REFERENCE
from omni_lightning.models.state import Step

CONFIGS = ("64:64:4:3", "64:32:4:3", "128:32:8:3", "128:64:8:2", "32:32:4:3", "64:64:8:3")  # t:k:warps:stages


def unit_rows(model: Code2Wav, batch: int, seconds: float) -> list[tuple[int, int, int]]:
    """(stage, channels, rows per batch row) of each decoder block whose units the fused kernel takes."""
    cfg, out = model.config, []
    rate = cfg.frame_rate * math.prod(cfg.upsampling_ratios)
    for i, r in enumerate(cfg.upsample_rates):
        rate *= r
        channels = cfg.decoder_dim // 2 ** (i + 1)
        out.append((i + 1, channels, int(seconds * rate)))
    return out


def layers_unit(unit, x: torch.Tensor, a: torch.Tensor, layers: Kernels) -> torch.Tensor:
    """The unit after its first SnakeBeta as the layers run it, into ``x`` in place."""
    rows, channels = x.shape[1], x.shape[2]
    step = Step(None, layers, x.shape[0], rows, x.device)
    h = unit.act2(unit.conv1(a, rows, bias=False), step, unit.conv1.conv.bias)
    w2 = unit.conv2.conv.weight
    return x.view(-1, channels).addmm_(h.reshape(-1, channels), w2.view(channels, -1).t())


def fused_unit(unit, x: torch.Tensor, a: torch.Tensor, **kw) -> torch.Tensor:
    c1, act2 = unit.conv1.conv, unit.act2
    return residual_unit_triton(a, x, c1.weight, c1.bias, act2.alpha, act2.beta, unit.conv2.conv.weight,
                                c1.dilation[0], **kw)  # fmt: skip


def bench_unit(unit, stage, channels, rows, layers, args, device, dtype, result) -> dict | None:
    """Times one unit both ways at every tile setting; the best fused row (also added to ``result``)."""
    d = unit.conv1.conv.dilation[0]
    x = torch.randn(args.batch, rows, channels, device=device, dtype=dtype)
    a = unit.act1(x, Step(None, layers, args.batch, rows, device), None, before=unit.conv1, junk=0)
    want = layers_unit(unit, x.clone(), a, layers).float()
    scratch = x.clone()
    t_layers = median_time(functools.partial(layers_unit, unit, scratch, a, layers), device, repeats=args.repeats)
    flops = 2 * args.batch * rows * channels * channels * 8
    floor = args.batch * rows * channels * x.element_size() * 3 / args.bandwidth  # a in, x in, x out
    best = None
    for spec in args.configs if device.type == "cuda" else ["64:16:4:1"]:
        bt, bk, warps, stages = (int(v) for v in spec.split(":"))
        kw = dict(block_t=bt, block_k=bk, num_warps=warps, num_stages=stages, precise=device.type != "cuda")
        try:
            got = fused_unit(unit, x.clone(), a, **kw).float()
        except Exception as err:  # a tile setting the compiler refuses (shared memory, say)
            result["units"].append({"stage": stage, "dilation": d, "config": spec, "error": str(err)[:200]})
            continue
        t = median_time(functools.partial(fused_unit, unit, scratch, a, **kw), device, repeats=args.repeats)
        row = {"stage": stage, "channels": channels, "dilation": d, "config": spec, "fused_ms": t * 1e3,
               "layers_ms": t_layers * 1e3, "floor_ms": floor * 1e3, "tflops": flops / t / 1e12,
               "rel_err": float((got - want).norm() / want.norm())}  # fmt: skip
        result["units"].append(row)
        if best is None or row["fused_ms"] < best["fused_ms"]:
            best = row
    return best


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 3.35e12, H200 4.8e12)")
    parser.add_argument("--out", default="bench_units.json")
    return parser


def main() -> None:
    args = parser().parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = random_model(args.preset)
    model = Code2Wav(base.config).to(device, dtype).eval()
    model.load_state_dict(base.state_dict())
    fused = Kernels.for_inference(device, fused_units=True)
    layers = Kernels(fused.snake_beta, inplace=True, name=f"{fused.name}-layers")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "units": [], "forward": []}
    print(f"{'stage':>5} {'C':>4} {'d':>2} {'layers ms':>9} {'best fused ms':>13} {'config':>11} {'floor ms':>8} "
          f"{'TFLOP/s':>7} {'rel err':>8}")  # fmt: skip
    with torch.inference_mode():
        for stage, channels, rows in unit_rows(model, args.batch, args.seconds):
            if channels > MAX_CHANNELS:
                continue
            block = model.decoder[stage]
            for unit in block.block[2:]:
                best = bench_unit(unit, stage, channels, rows, layers, args, device, dtype, result)
                if best:
                    print(f"{stage:>5} {channels:>4} {best['dilation']:>2} {best['layers_ms']:>9.3f} "
                          f"{best['fused_ms']:>13.3f} {best['config']:>11} {best['floor_ms']:>8.3f} "
                          f"{best['tflops']:>7.0f} {best['rel_err']:>8.1e}")  # fmt: skip
        frames = int(args.seconds * model.config.frame_rate)
        audio = model.output_length(frames) / model.config.sample_rate
        print(f"\n{'forward':>28} {'batch':>5} {'ms':>8} {'x real time':>11}")
        for batch in dict.fromkeys((args.batch, 1)):
            codes = torch.randint(0, model.config.codebook_size, (batch, 16, frames), device=device)
            for name, kernels in (("fused units", fused), ("layers", layers), ("reference", REFERENCE)):
                t = median_time(
                    lambda codes=codes, kernels=kernels: model(codes, kernels=kernels), device, repeats=args.repeats
                )
                row = {"kernels": name, "batch": batch, "ms": t * 1e3, "x_realtime": batch * audio / t}
                result["forward"].append(row)
                print(f"{name:>28} {batch:>5} {t * 1e3:>8.2f} {row['x_realtime']:>11,.0f}")
    save(args.out, result, args)


if __name__ == "__main__":
    main()
