"""The decode engine's planner on the benchmark jobs, priced by a cost model fitted to a GPU profile:
a CPU-only look at how many forwards a job takes, how much padding, and what that should cost.

    python scripts/profiling/simulate_plan.py                      # the default frame budgets, bf16 qwen3-omni
    python scripts/profiling/simulate_plan.py --frames 2048 --graph-frames 512

Jobs (each as the engine sees it in its own process: run once cold, where new shapes are captured,
then priced warm): ``job`` (the mixed 2-30 s job of ``bench_job.py`` in the data module's batches of
32), ``b1x125`` and ``b32x125`` (``bench_forward.py``'s 10 s clips), ``lone7500`` (one 600 s request).

Cost model (ms, fitted to ``profile_engine.py``'s output, ``docs/results/profile_engine_h200.json``):
an eager forward of ``f`` padded frames ``max(11.5, 1.0 + 0.0186 f)`` (the host's launches bound it
below ~600 frames), a CUDA graph replay through the engine ``2.4 + 0.0186 f``. It leaves out the
device idling while the host catches up after a synchronization, the state copies between forwards
and the Trainer's per-call cost, so it is a guide to the planner, not a measurement.
What it does not do: time anything, or choose the frame budget (``budget.py``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import mixed_job

from omni_lightning import CodesDataModule
from omni_lightning.engine.plan import Planner
from omni_lightning.models import resolve_config


def eager_ms(frames: int) -> float:
    return max(11.5, 1.0 + 0.0186 * frames)


def graph_ms(frames: int) -> float:
    return 2.4 + 0.0186 * frames


def price(planner: Planner, batches: list[list[int]], seen: set) -> dict[str, float]:
    """Plans every batch to its end, as ``DecodeEngine.decode`` does; shapes within ``graph_frames``
    join ``seen`` (captured) when first run."""
    forwards, ms, padded, real = 0, 0.0, 0, 0
    for lengths in batches:
        remaining = list(lengths)
        while any(remaining):
            live = [i for i, n in enumerate(remaining) if n]
            plan = planner.next([remaining[i] for i in live], seen, pad_in_time=True)  # as DecodeEngine.decode
            frames = plan.rows * plan.chunk
            graph = frames <= planner.graph_frames
            seen.add(plan.shape)
            ms += graph_ms(frames) if graph else eager_ms(frames)
            forwards, padded, real = forwards + 1, padded + frames, real + sum(plan.take)
            for j, take in zip(plan.requests, plan.take):
                remaining[live[j]] -= take
    return {"forwards": forwards, "ms": ms, "padding": padded / real - 1, "shapes": len(seen)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--graph-frames", type=int, default=None, help="default: 512, 256 at 1024 frames or less")
    parser.add_argument("--new-shape-cost", type=int, nargs="+", default=[Planner.new_shape_cost])
    parser.add_argument(
        "--step-cost",
        type=int,
        nargs="+",
        default=[Planner.step_cost],
        help="the planner's fixed cost of a forward, in frames",
    )
    args = parser.parse_args()
    config = resolve_config("qwen3-omni")
    data = CodesDataModule(predict=mixed_job(config, 384, 2.0, 30.0, 0), batch_size=32)
    data.setup("predict")
    loader = data.predict_dataloader()
    loader = loader[0] if isinstance(loader, list) else loader
    jobs = {
        "job": [b["lengths"].tolist() for b in loader],
        "b1x125": [[125]],
        "b32x125": [[125] * 32],
        "lone7500": [[7500]],
    }
    print(
        "| frames | graph frames | step cost | new shape cost | job | forwards, padding, shapes | x real time (model) |"
    )
    print("|---|---|---|---|---|---|---|")
    for frames, step_cost, new_cost in itertools.product(args.frames, args.step_cost, args.new_shape_cost):
        graph_frames = args.graph_frames or (512 if frames > 1024 else 256)
        planner = Planner(
            frames,
            graph_frames=min(graph_frames, frames),
            exact_eager=True,
            step_cost=step_cost,
            new_shape_cost=new_cost,
        )
        for name, batches in jobs.items():
            seen: set = set()
            price(planner, batches, seen)  # cold: captures
            warm = price(planner, batches, seen)
            audio = sum(config.output_length(n) for b in batches for n in b) / config.sample_rate
            print(
                f"| {frames} | {graph_frames} | {step_cost} | {new_cost} | {name} | {warm['forwards']}, "
                f"{100 * warm['padding']:.0f} %, {warm['shapes']} shapes | {audio / warm['ms'] * 1e3:,.0f}x |"
            )


if __name__ == "__main__":
    main()
