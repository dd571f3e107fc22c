"""The time-major SnakeBeta kernel at the decoder's shapes: fast sine vs libdevice's, vs a plain copy.

For each decoder stage of a batch of 10 s clips (``[B, T, C]`` bf16, channels contiguous, a conv bias
added on the way in), times ``fused.snake_beta_tc`` with the fast sine (default) and with
``precise=True`` (median, CUDA events, rotating over several inputs so L2 does not serve them),
next to a device-to-device copy of the same bytes; checks each against an fp64 reference of the
same bf16 input (relative L2 and max abs error, fresh random inputs).

    python scripts/bench_snake.py --batch 32 --out snake.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_lightning.models import fused  # noqa: E402

# (channels, samples per audio second) at each SnakeBeta site of qwen3-omni's decoder
STAGES = [(1536, 50), (768, 400), (384, 2000), (192, 8000), (96, 24000)]


def reference(x, log_alpha, log_beta, bias) -> torch.Tensor:
    xd = x.double() + bias.double()
    s = torch.sin(xd * log_alpha.double().exp())
    return xd + s * s / (log_beta.double().exp() + 1e-9)


def time_ms(fn, inputs: list, repeats: int) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(3):
        fn(inputs[i % len(inputs)])
    for i in range(repeats):
        starts[i].record()
        fn(inputs[i % len(inputs)])
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def measure(channels: int, length: int, batch: int, repeats: int, gen: torch.Generator) -> dict:
    shape = (batch, length, channels)
    inputs = [torch.randn(shape, device="cuda", generator=gen).mul_(3).to(torch.bfloat16) for _ in range(3)]
    log_alpha, log_beta = (torch.randn(channels, device="cuda", generator=gen) * 0.5 for _ in range(2))
    bias = torch.randn(channels, device="cuda", generator=gen) * 0.1
    nbytes = 2 * inputs[0].nbytes  # one read, one write
    row = {"channels": channels, "length": length, "batch": batch, "gbytes": nbytes / 1e9}
    out = torch.empty_like(inputs[0])
    row["copy_ms"] = time_ms(out.copy_, inputs, repeats)
    for block_c in (32, 64, 128, 256):
        if block_c < channels and channels % block_c == 0 or block_c >= channels > block_c // 2:
            row[f"fast_block{block_c}_ms"] = time_ms(
                lambda x, b=block_c: fused.snake_beta_tc(x, log_alpha, log_beta, bias, block_c=b), inputs, repeats
            )
    for name, precise in (("fast", False), ("precise", True)):

        def snake(x: torch.Tensor, precise: bool = precise) -> torch.Tensor:
            return fused.snake_beta_tc(x, log_alpha, log_beta, bias, precise)

        row[f"{name}_ms"] = time_ms(snake, inputs, repeats)
        x = inputs[0][:2, : min(length, 20000)].clone()
        got, want = snake(x).double(), reference(x, log_alpha, log_beta, bias)
        assert torch.isfinite(got).all()
        row[f"{name}_rel_l2"] = float((got - want).norm() / want.norm())
        row[f"{name}_max_abs"] = float((got - want).abs().max())
    row["fast_gbs"] = nbytes / row["fast_ms"] / 1e6
    row["copy_gbs"] = nbytes / row["copy_ms"] / 1e6
    return row


def run_stages(measure, stages: list[tuple[int, int]], report) -> None:
    """The driver both kernel benchmarks share: arguments, one ``measure`` row per (channels,
    samples per audio second) stage, a header line, ``report(rows)`` (the tables), ``--out`` JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [measure(c, round(rate * args.seconds), args.batch, args.repeats, gen) for c, rate in stages]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch} of {args.seconds:g} s, bf16")
    report(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def report(rows: list[dict]) -> None:
    print("| C | T | GB moved | copy ms | fast ms (GB/s) | precise ms | fast rel L2 / max abs "
          "| precise rel L2 / max abs |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        print(f"| {r['channels']} | {r['length']} | {r['gbytes']:.2f} | {r['copy_ms']:.3f} | {r['fast_ms']:.3f} "
              f"({r['fast_gbs']:,.0f}) | {r['precise_ms']:.3f} | {r['fast_rel_l2']:.2e} / {r['fast_max_abs']:.1e} | "
              f"{r['precise_rel_l2']:.2e} / {r['precise_max_abs']:.1e} |")  # fmt: skip
    for r in rows:
        tiles = [f"{k[len('fast_block') : -3]} ch {v:.3f} ms" for k, v in r.items() if k.startswith("fast_block")]
        tiles = ", ".join(tiles)
        print(f"C={r['channels']}: tiles {tiles}")


if __name__ == "__main__":
    run_stages(measure, STAGES, report)
