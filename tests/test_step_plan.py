"""A streaming step's plan (``Planner.whole_step``): every row decoded whole, in the cheapest forwards the
planner's prices allow; and a server's warm-up runs the forwards its steps will take."""

import dataclasses
import random

import torch
from conftest import micro_config, random_codes, random_model
from helpers import RecordingCapture

from omni_lightning.engine.plan import Planner
from omni_lightning.engine.streaming import StreamingDecoder


def _run(planner: Planner, left: list[int], seen: set, whole: bool) -> tuple[float, list[tuple[int, int]]]:
    """Plans ``left`` forward by forward until every row is done (each forward's shape joins ``seen``);
    returns the planner's price of the forwards run and their shapes. Checks each forward on the way."""
    remaining, cost, shapes = list(left), 0.0, []
    while any(remaining):
        live = [i for i, n in enumerate(remaining) if n]
        plan = planner.next([remaining[i] for i in live], seen, whole=whole)
        assert plan.rows * plan.chunk <= planner.frames and len(plan.requests) <= plan.rows
        assert all(0 < t <= plan.chunk for t in plan.take)
        new = plan.shape not in seen
        cost += plan.rows * plan.chunk + planner.step_cost + planner.new_shape_cost * new
        seen.add(plan.shape)
        shapes.append(plan.shape)
        for j, t in zip(plan.requests, plan.take):
            remaining[live[j]] -= t
            assert remaining[live[j]] >= 0
    return cost, shapes


def test_a_steps_plan_never_costs_more_than_the_greedy_plan_and_much_less_on_a_servers_steps():
    """Random steps (1-128 rows of 1-32 frames; budgets of a GPU's graphs and a CPU's; no shape run
    before, all of them, or a server's warm-up grid; new shapes free or a capture's price): a step planned
    whole never costs more (at the planner's prices) than planning forward by forward, and every row is
    decoded within the budget. On a server's steps (its warm-up's shapes, CUDA's prices) it costs clearly
    less: greedy planning keeps to the shapes it has and cuts rows into many small forwards."""
    rng = random.Random(0)
    grid = {(r, c) for r in (1, 2, 4, 8, 16, 32, 64, 128) for c in (1, 8, 10, 16, 32)}
    ours = greedy = 0.0
    for trial in range(300):
        frames, server = rng.choice([256, 1024, 4096]), trial % 3 == 2
        planner = Planner(frames, max_rows=128, graph_frames=min(frames, 1024), exact_eager=True,
                          new_shape_cost=1024 if server or trial % 5 == 0 else 0)  # fmt: skip
        left = [rng.randint(1, 32) for _ in range(rng.randint(1, 128))]
        seen = grid if server else set(planner.shapes()) if trial % 3 else set()
        a, _ = _run(planner, left, set(seen), whole=True)
        b, _ = _run(planner, left, set(seen), whole=False)
        assert a <= b + 1e-9, (left, frames)
        if server:
            ours, greedy = ours + a, greedy + b
    assert ours < 0.95 * greedy, (ours, greedy)


def test_a_steps_last_rows_ride_in_a_captured_bucket_rather_than_forwards_of_their_own():
    """50 rows of up to 16 frames, every bucket of 16 frames captured: one forward of 64 rows (14 padding
    rows) costs less than 32 + 16 + 2 rows in three; a step's short rows are padded in time to a captured
    chunk rather than run at a new one (a capture in a client's way); a row longer than any graph leaves
    the step to the greedy planner."""
    planner = Planner(1024, graph_frames=1024, exact_eager=True, new_shape_cost=1024)
    seen = {(r, 16) for r in (1, 2, 4, 8, 16, 32, 64)}
    left = [16] * 40 + [9, 3, 1, 16, 12, 5, 7, 2, 16, 11]
    assert _run(planner, left, set(seen), whole=True)[1] == [(64, 16)]
    assert _run(planner, [3, 2], set(seen), whole=True)[1] == [(2, 16)]
    assert planner.whole_step([2000], set()) == (0.0, [])


def test_a_warm_servers_step_runs_the_forwards_its_warm_up_captured():
    """With CUDA's prices (a new shape costs a capture), a warm-up of 64 streams x 32 frames captures the
    forwards such a step takes at its best, not the smaller shapes run before it; a step of 64 streams of
    up to 32 frames then runs in the fewest graphed forwards the budget allows, captures nothing, and each
    stream equals its decode alone."""
    model = random_model(micro_config(sliding_window=6), seed=3)
    decoder = StreamingDecoder(model, max_streams=64, frames_per_forward=1024, capture=RecordingCapture())
    engine = decoder.engine
    engine.graph_frames = 1024
    engine.planner = dataclasses.replace(engine._planner(1024), new_shape_cost=1024)  # CUDA's price, on a CPU
    decoder.warmup(chunk_sizes=(1, 8, 32), batch_sizes=(1, 64))
    assert (32, 32) in engine.ever or (64, 16) in engine.ever, sorted(engine.ever)
    rng = random.Random(1)
    codes = [random_codes(1, rng.randint(1, 32), model.config, seed=s)[0] for s in range(64)]
    sids = [decoder.open() for _ in codes]
    before = dict(engine.work)
    with torch.inference_mode():
        out = decoder.step(dict(zip(sids, codes)))
        assert engine.work["new_shapes"] == before["new_shapes"]
        assert engine.work["forwards"] - before["forwards"] <= 2
        for sid, c in zip(sids, codes):
            assert (out[sid] - model(c[None])[0]).abs().max() <= 1e-5
