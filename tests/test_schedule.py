"""Which frames a serving step takes (``serving/schedule.py``): streams first, whole requests capped to a
slice of engine time while a stream is open, every request advancing."""

from __future__ import annotations

import random

from omni_lightning.serving.schedule import FrameCost, bulk_frames


def test_with_no_stream_open_every_request_sends_its_request_frames_or_what_is_left():
    assert bulk_frames([100, 5, 32], 32, False, FrameCost(0.01), 0.01) == [32, 5, 32]


def test_with_a_stream_open_the_bulk_frames_fit_the_slice_oldest_first_and_always_advance():
    rng = random.Random(0)
    for _ in range(500):
        remaining = [rng.randint(1, 400) for _ in range(rng.randint(1, 64))]
        cost = FrameCost(rng.uniform(1e-5, 1e-2))
        slice_s = rng.uniform(1e-3, 5e-2)
        takes = bulk_frames(remaining, 32, True, cost, slice_s)
        budget = max(8, int(slice_s / cost.seconds_per_frame))
        assert sum(takes) == min(budget, sum(min(32, n) for n in remaining))  # the slice, or all there is
        assert all(0 <= t <= min(32, n) for t, n in zip(takes, remaining))
        first_short = next((i for i, (t, n) in enumerate(zip(takes, remaining)) if t < min(32, n)), len(takes))
        assert not any(takes[first_short + 1 :])  # the oldest requests are served first


def test_the_cost_per_frame_follows_the_steps_and_ignores_empty_ones():
    cost = FrameCost()
    assert cost.frames_in(0.01, least=8) == 8  # no estimate yet: the least
    cost.update(100, 0.1)
    assert cost.seconds_per_frame == 1e-3 and cost.frames_in(0.01, least=8) == 10
    cost.update(0, 1.0)
    cost.update(100, 0.0)
    assert cost.seconds_per_frame == 1e-3
    for _ in range(50):
        cost.update(100, 0.2)
    assert abs(cost.seconds_per_frame - 2e-3) < 1e-6
