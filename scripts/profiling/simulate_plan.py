"""The decode engine's planner on the benchmark jobs, priced by a cost model fitted to a GPU profile:
a CPU-only look at how many forwards a job takes, how much padding, and what that should cost.

    python scripts/profiling/simulate_plan.py                      # the H100's budgets (shares 0.03, 0.05; no cap)
    python scripts/profiling/simulate_plan.py --frames 512 --new-shape-cost 1024 64   # at 0.03: the shape price

Jobs (each as the engine sees it in its own process: run once cold, where new shapes are captured,
then priced warm): ``job`` (the mixed 2-30 s job of ``bench_job.py`` in the data module's batches of
32), ``long-tailed`` (``bench_job.py --job long-tailed``, same batches), ``b1x125`` and ``b32x125``
(``bench_forward.py``'s 10 s clips), ``lone7500`` (one 600 s request).

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
from workload import long_tailed_job, mixed_job

from omni_lightning import CodesDataModule
from omni_lightning.engine.plan import Planner
from omni_lightning.models import resolve_config

GRAPH_FRAMES = {256: 64, 512: 64, 1024: 128, 2048: 256, 4096: 256}  # budget.py at shares 0.02-0.1, 6 and 8 GiB


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


def batches(requests: dict) -> list[list[int]]:
    """The lengths of each batch of 32 that ``CodesDataModule`` makes of ``requests``."""
    data = CodesDataModule(predict=requests, batch_size=32)
    data.setup("predict")
    loader = data.predict_dataloader()
    loader = loader[0] if isinstance(loader, list) else loader
    return [b["lengths"].tolist() for b in loader]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--graph-frames", type=int, default=None, help="default: budget.py's on an H100 (GRAPH_FRAMES)")
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
    jobs = {
        "job": batches(mixed_job(config, 384, 2.0, 30.0, 0)),
        "long-tailed": batches(long_tailed_job(config, 384, 0)),
        "b1x125": [[125]],
        "b32x125": [[125] * 32],
        "lone7500": [[7500]],
    }
    print(
        "| frames | graph frames | step cost | new shape cost | job | forwards, padding, shapes | x real time (model) |"
    )
    print("|---|---|---|---|---|---|---|")
    for frames, step_cost, new_cost in itertools.product(args.frames, args.step_cost, args.new_shape_cost):
        graph_frames = args.graph_frames or GRAPH_FRAMES.get(frames, 256)
        planner = Planner(
            frames,
            graph_frames=min(graph_frames, frames),
            exact_eager=True,
            step_cost=step_cost,
            new_shape_cost=new_cost,
        )
        for name, lengths in jobs.items():
            seen: set = set()
            price(planner, lengths, seen)  # cold: captures
            warm = price(planner, lengths, seen)
            audio = sum(config.output_length(n) for b in lengths for n in b) / config.sample_rate
            print(
                f"| {frames} | {graph_frames} | {step_cost} | {new_cost} | {name} | {warm['forwards']}, "
                f"{100 * warm['padding']:.1f} %, {warm['shapes']} shapes | {audio / warm['ms'] * 1e3:,.0f}x |"
            )


if __name__ == "__main__":
    main()
