"""A residual unit's second SnakeBeta + 1x1 convolution + residual add: one fused Triton GEMM vs
the separate SnakeBeta kernel and cuBLAS ``addmm_``, at the decoder's shapes (a CUDA benchmark).

For each residual-unit stage of a batch of 10 s clips (``x [B, T, C]`` bf16 contiguous, ``h`` a
strided view as a convolution's output is), times both (median, CUDA events, rotating over several
inputs so L2 does not serve them) next to the fused version's memory floor (``h`` and ``x`` read
once, ``x`` written once, at the measured copy bandwidth), sweeps the fused kernel's tiles, and
checks both against an fp64 computation from the same bf16 inputs (relative L2).

    python scripts/bench_pointwise.py --batch 32 --out pointwise.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_snake import reference, run_stages, time_ms  # noqa: E402

from omni_lightning.models import fused  # noqa: E402

# (channels, samples per audio second) at each residual unit of qwen3-omni's decoder
STAGES = [(768, 400), (384, 2000), (192, 8000), (96, 24000)]
SWEEP = [(128, 128, 4), (128, 128, 8), (64, 128, 4), (128, 64, 4), (256, 64, 8), (64, 256, 8)]


def measure(channels: int, length: int, batch: int, repeats: int, gen: torch.Generator) -> dict:
    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    sets = [(rand(batch, length, channels), rand(batch, length + 6, channels)[:, :length]) for _ in range(3)]
    log_alpha, log_beta, bias = rand(channels, scale=0.3), rand(channels, scale=0.3), rand(channels, scale=0.1)
    weight = rand(channels, channels, 1, scale=channels**-0.5)

    def separate(pair: tuple) -> None:
        x, h = pair
        hs = fused.snake_beta_tc(h, log_alpha, log_beta, bias)
        x.view(-1, channels).addmm_(hs.view(-1, channels), weight.view(channels, channels).t())

    def fused_(pair: tuple, tiles: tuple | None = None) -> None:
        fused.snake_pointwise_residual_(pair[0], pair[1], log_alpha, log_beta, bias, weight, tiles=tiles)

    nbytes = 3 * batch * length * channels * 2
    copy_src, copy_dst = sets[0][0], torch.empty_like(sets[0][0])
    row = {"channels": channels, "length": length, "batch": batch,
           "copy_ms": time_ms(lambda _: copy_dst.copy_(copy_src), [None], repeats),
           "separate_ms": time_ms(separate, sets, repeats), "fused_ms": time_ms(fused_, sets, repeats),
           "default_tiles": fused.pointwise_tiles(channels)}  # fmt: skip
    row["fused_floor_ms"] = row["copy_ms"] * nbytes / (2 * batch * length * channels * 2)
    block_k = fused.pointwise_tiles(channels)[2]
    for block_t, block_n, warps in SWEEP:
        tiles = (block_t, block_n, block_k, warps)
        name = f"tiles_{block_t}x{block_n}x{block_k}_w{warps}"
        try:
            row[f"{name}_ms"] = time_ms(lambda p, t=tiles: fused_(p, t), sets, repeats)
        except Exception as error:  # a tile the compiler cannot fit (shared memory, registers)
            row[f"{name}_error"] = str(error)[:200]
    # accuracy: both against fp64 math on the same bf16 inputs (the SnakeBeta output rounded to bf16)
    x, h = sets[0][0][:2, : min(length, 20000)].clone(), sets[0][1][:2, : min(length, 20000)]
    snake = reference(h, log_alpha, log_beta, bias).to(torch.bfloat16).double()
    want = x.double() + snake @ weight.view(channels, channels).double().t()
    for name, fn in (("separate", separate), ("fused", fused_)):
        got = x.clone()
        fn((got, h))
        assert torch.isfinite(got).all()
        row[f"{name}_rel_l2"] = float((got.double() - want).norm() / want.norm())
    return row


def report(rows: list[dict]) -> None:
    print("| C | T | separate ms | fused ms | fused floor ms | separate rel L2 | fused rel L2 |\n"
          "|---|---|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        print(f"| {r['channels']} | {r['length']} | {r['separate_ms']:.3f} | {r['fused_ms']:.3f} | "
              f"{r['fused_floor_ms']:.3f} | {r['separate_rel_l2']:.2e} | {r['fused_rel_l2']:.2e} |")  # fmt: skip
    for r in rows:
        tiles = ", ".join(f"{k[6:-3]} {v:.3f}" for k, v in r.items() if k.startswith("tiles_") and k.endswith("_ms"))
        print(f"C={r['channels']} (default {r['default_tiles']}): {tiles}")


if __name__ == "__main__":
    run_stages(measure, STAGES, report)
