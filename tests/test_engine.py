"""The decode engine on the CPU: exact at any length and chunk schedule, bounded shapes, memory fallbacks.

Only ``torch.cuda.graph`` is replaced: ``RecordingCapture`` records the forward and "replays" it into
the same static output, as a graph would, so bucket choice, static buffers, the scratch slot, state
carried across forwards, trimming and refresh are the real code. Out-of-memory is a stand-in too: a
forward pre-hook on the real model that raises ``torch.OutOfMemoryError`` above a frame count, and a
capture that fails; the engine's fallbacks then run as they would on a GPU.
"""

import dataclasses
import random

import pytest
import torch
from conftest import micro_config, random_codes, random_model
from helpers import RecordingCapture, ReplayCapture, loader, requests, trainer_kwargs

from omni_lightning import Code2WavModule, DecodeEngine, Trainer
from omni_lightning.engine.bucket_graphs import CaptureError
from omni_lightning.engine.budget import (
    activation_bytes_per_frame,
    frames_for_budget,
    graph_frames_for_budget,
    graph_pool_bytes,
)
from omni_lightning.engine.plan import Planner


class FailingCapture(RecordingCapture):
    """Fails every capture of more than ``limit`` frames (rows x chunk), as an out-of-memory would
    (after the warm-up forward, which ran)."""

    def __init__(self, limit):
        super().__init__()
        self.limit, self.failed = limit, 0

    def __call__(self, fn):
        out = fn()
        if out.shape[0] * out.shape[-1] // 1920 > self.limit:
            self.failed += 1
            raise CaptureError("OutOfMemoryError: stand-in: no memory for this graph")
        self.recorded += 1
        return (lambda: out.copy_(fn())), out


@pytest.fixture(scope="module")
def model():
    return random_model(micro_config(sliding_window=6), seed=9)


def solo(model, codes, n):
    with torch.inference_mode():
        return model(codes[None, :, :n])[0]


def assert_exact(model, codes, lengths, wavs, tol=1e-5):
    for i, n in enumerate(lengths):
        want = solo(model, codes[i], n)
        assert wavs[i].shape == want.shape == (1, model.output_length(n)), (i, n)
        assert (wavs[i] - want).abs().max() <= tol, (i, n)


# lengths around every boundary: the attention window (6), the chunks the planner picks, the budget
LENGTHS = [1, 2, 5, 6, 7, 11, 12, 13, 23, 24, 25, 47, 48, 49, 97]


@pytest.mark.parametrize("frames", [8, 24, 64])
def test_every_request_equals_its_whole_decode_at_any_length(model, frames):
    engine = DecodeEngine(model, frames_per_forward=frames, max_rows=4, capture=RecordingCapture())
    codes = random_codes(len(LENGTHS), max(LENGTHS), model.config, seed=frames)
    for i, n in enumerate(LENGTHS):
        codes[i, :, n:] = -1  # pad frames may hold anything: they are never looked up
    with torch.inference_mode():
        wavs = engine.decode(codes.clamp(0), LENGTHS)
    assert_exact(model, codes.clamp(0), LENGTHS, wavs)
    shapes = engine.graphs.graphs.keys()
    assert all(r * c <= frames for r, c in shapes) and engine.graphs.stats.replays > 0
    assert len(engine._free) == 4  # every slot back, fresh


def test_random_chunk_schedules_through_the_model_state_equal_the_whole_decode(model):
    """Rows of one state advance by different, random frame counts per forward (the rest padding)."""
    rng = random.Random(0)
    for trial in range(3):
        lengths = [rng.randint(1, 30) for _ in range(3)]
        codes = random_codes(3, max(lengths), model.config, seed=trial)
        state = model.new_state(3)
        done, pieces = [0, 0, 0], [[], [], []]
        with torch.inference_mode():
            while any(d < n for d, n in zip(done, lengths)):
                chunk = rng.choice([1, 2, 3, 5, 8])
                take = [min(chunk, n - d) for d, n in zip(done, lengths)]
                batch = torch.zeros((3, model.config.num_quantizers, chunk), dtype=torch.long)
                for i in range(3):
                    batch[i, :, : take[i]] = codes[i, :, done[i] : done[i] + take[i]]
                out = model(batch, state.select(torch.arange(3), torch.tensor(take)))
                for i in range(3):
                    start = 555 if done[i] == 0 and take[i] else 0
                    pieces[i].append(out[i, :, start : take[i] * 1920])
                    done[i] += take[i]
        assert state.pos.tolist() == lengths
        assert_exact(model, codes, lengths, [torch.cat(p, dim=-1) for p in pieces])


def test_out_of_memory_in_a_forward_shrinks_the_budget_and_changes_no_state(model):
    limit = {"frames": 12}

    def stand_in_allocator(module, args):
        codes = args[0]
        if codes.shape[0] * codes.shape[-1] > limit["frames"]:
            raise torch.OutOfMemoryError("stand-in allocator: out of memory")

    handle = model.register_forward_pre_hook(stand_in_allocator)
    try:
        engine = DecodeEngine(model, frames_per_forward=64, max_rows=4, cuda_graphs=False)
        codes = random_codes(5, 40, model.config, seed=3)
        lengths = [40, 3, 17, 29, 9]
        with torch.inference_mode():
            wavs = engine.decode(codes, lengths)
        assert engine.frames_per_forward <= 12  # halved until the forwards fit
        limit["frames"] = 10**9
        assert_exact(model, codes, lengths, wavs)
        limit["frames"] = 0  # nothing fits at all: the error reaches the caller, no slot is lost
        nothing_fits = r"one frame per forward ran out of memory on cpu \(stand-in allocator: out of memory\)"
        with pytest.raises(torch.OutOfMemoryError, match=nothing_fits), torch.inference_mode():
            engine.decode(codes, lengths)
        assert engine.frames_per_forward == 1 and len(engine._free) == 4
    finally:
        handle.remove()


def test_a_failed_capture_leaves_its_bucket_eager_and_the_run_exact(model):
    capture = FailingCapture(limit=8)
    engine = DecodeEngine(model, frames_per_forward=32, max_rows=4, capture=capture)
    # costs scaled to this 32-frame budget (at 128 frames a forward, every forward would reuse the first shape)
    engine.planner = dataclasses.replace(engine.planner, step_cost=2, new_shape_cost=0)
    codes = random_codes(4, 45, model.config, seed=4)
    lengths = [45, 30, 8, 2]
    with torch.inference_mode():
        first = engine.decode(codes, lengths)
        again = engine.decode(codes, lengths)
    assert capture.failed >= 1 and capture.recorded >= 1  # some buckets captured, the others eager
    stats = engine.graphs.stats
    assert stats.eager >= 1 and stats.replays >= 1 and stats.failures == capture.failed
    assert all(r * c > 8 for r, c in engine.graphs.eager)
    assert_exact(model, codes, lengths, first)
    assert_exact(model, codes, lengths, again)


class NoMemoryForGraphs:
    """Every capture's warm-up forward runs out of memory (the graphs' pool never fits), as a CUDA
    cap of a few hundred MiB does; eager forwards fit."""

    def __init__(self):
        self.tried = 0

    def __call__(self, fn):
        self.tried += 1
        raise torch.OutOfMemoryError("stand-in allocator: out of memory in a graph's warm-up")


def test_no_memory_for_any_graph_ends_eager_and_exact(model):
    capture = NoMemoryForGraphs()
    engine = DecodeEngine(model, frames_per_forward=16, max_rows=4, capture=capture, graph_frames=16)
    codes = random_codes(3, 30, model.config, seed=6)
    lengths = [30, 11, 2]
    with torch.inference_mode():
        wavs = engine.decode(codes, lengths)
    # halved down to one frame per forward, then CUDA graphs dropped: eager from there on
    assert engine.graph_frames == 0 and engine.frames_per_forward == 1 and capture.tried >= 5
    assert_exact(model, codes, lengths, wavs)
    assert len(engine._free) == 4  # every slot back


def test_planner_keeps_every_forward_in_budget_and_always_progresses():
    rng = random.Random(1)
    for frames in (1, 7, 64, 1536, 4096):
        planner = Planner(frames, max_rows=64)
        assert all(r * c <= frames for r, c in planner.shapes())
        for _ in range(20):
            remaining = [rng.randint(1, 400) for _ in range(rng.randint(1, 70))]
            seen = set()
            while any(remaining):
                live = [i for i, n in enumerate(remaining) if n]
                plan = planner.next([remaining[i] for i in live], seen)
                seen.add(plan.shape)
                assert plan.rows * plan.chunk <= frames and len(plan.requests) <= plan.rows <= 64
                assert all(0 < t <= plan.chunk for t in plan.take)
                for j, t in zip(plan.requests, plan.take):
                    remaining[live[j]] -= t
                    assert remaining[live[j]] >= 0


def test_planner_pads_little_on_the_mixed_job_with_few_shapes():
    """The 2-30 s job in length-sorted batches of 32 (docs/performance.md), at a 0.03 GPU budget."""
    rng = random.Random(0)
    lengths = sorted(rng.randint(25, 375) for _ in range(384))
    planner, seen, padded, forwards = Planner(2048, graph_frames=512), set(), 0, 0
    for b in range(0, len(lengths), 32):
        remaining = lengths[b : b + 32]
        while any(remaining):
            live = [i for i, n in enumerate(remaining) if n]
            plan = planner.next([remaining[i] for i in live], seen)
            seen.add(plan.shape)
            padded, forwards = padded + plan.rows * plan.chunk, forwards + 1
            for j, t in zip(plan.requests, plan.take):
                remaining[live[j]] -= t
    captured = {(r, c) for r, c in seen if r * c <= 512}  # the shapes that are CUDA graphs
    assert padded / sum(lengths) - 1 < 0.06 and len(captured) <= 12 and forwards <= 8 * 12


def _padding(planner: Planner, batches: list[list[int]]) -> tuple[float, set]:
    """A job's padding (computed over real frames, minus one) run twice, as a kept engine does: the
    second run's, and every shape run."""
    seen: set = set()
    for _ in range(2):
        real = padded = 0
        for lengths in batches:
            remaining = list(lengths)
            while any(remaining):
                live = [i for i, n in enumerate(remaining) if n]
                plan = planner.next([remaining[i] for i in live], seen, pad_in_time=True)
                seen.add(plan.shape)
                real, padded = real + sum(plan.take), padded + plan.rows * plan.chunk
                for j, t in zip(plan.requests, plan.take):
                    remaining[live[j]] -= t
    return padded / real - 1, seen


def test_planner_pads_at_most_5_percent_at_a_small_share():
    """At a 0.03 share of an H100 (512 frames a forward, graphs up to 64), the 2-30 s job and a
    long-tailed job (most requests under 5 s, a few over a minute), each in length-sorted batches of
    32, pad at most 5 %, where a new shape priced near a whole forward padded 12-14 %."""
    rng = random.Random(0)
    mixed = sorted(rng.randint(25, 375) for _ in range(384))
    tiers = [(326, 6, 62), (46, 62, 375), (12, 750, 1500)]  # (requests, frames from, to)
    tailed = sorted(rng.randint(lo, hi) for n, lo, hi in tiers for _ in range(n))
    planner = Planner(512, graph_frames=64, exact_eager=True)
    for lengths in (mixed, tailed):
        batches = [lengths[b : b + 32] for b in range(0, len(lengths), 32)]
        padding, seen = _padding(planner, batches)
        assert padding <= 0.05 and len(seen) <= 12, (padding, sorted(seen))
        old, _ = _padding(dataclasses.replace(planner, new_shape_cost=1024), batches)
        assert old > 0.1  # what the low price buys


def test_planner_runs_a_lone_request_as_its_own_shape_not_as_padding_rows():
    """With CUDA graphs on, eager forwards take the whole budget, but a lone 10 s request under a
    2048-frame budget is not run as 32 rows of 64 frames: no forward may be more padding rows than
    request rows, and the lone request is one forward once captured."""
    for frames, graph_frames in ((2048, 512), (1024, 256), (4096, 512)):
        planner, seen = Planner(frames, graph_frames=graph_frames, exact_eager=True), set()
        for run in range(2):
            plans, remaining = [], [125]
            while remaining[0]:
                plans.append(planner.next(remaining, seen))
                seen.add(plans[-1].shape)
                remaining[0] -= plans[-1].take[0]
            assert all(p.rows <= 2 * len(p.requests) for p in plans), (frames, plans)
            assert len(plans) == 1, (frames, run, plans)
        for n in (1, 3, 9, 17, 40):  # a few requests, long and short: rows at most twice the requests
            plan = planner.next([300] * n, seen)
            assert plan.rows <= max(2 * len(plan.requests), 1) or plan.rows * plan.chunk <= graph_frames, (n, plan)


def test_planner_ends_a_long_lone_request_in_one_forward_of_its_remainder():
    """A 600 s request (7,500 frames) under 2048 frames per forward: whole-budget forwards, then one
    forward of what is left, one row each, 4 % padding at most. Without CUDA graphs (CPU), the same."""
    for exact_eager in (True, False):
        planner = Planner(2048, graph_frames=512 if exact_eager else 0, exact_eager=exact_eager)
        remaining, plans = [7500], []
        while remaining[0]:
            plans.append(planner.next(remaining, set()))
            remaining[0] -= plans[-1].take[0]
        assert all(p.rows == 1 for p in plans), plans
        assert len(plans) == 4 and sum(p.chunk for p in plans) / 7500 - 1 < 0.04, plans


def test_planner_prefers_a_shape_it_has_run_rows_padded_never_chunks():
    """A new shape costs a capture or new cuDNN plans on CUDA: three rows' last
    frames replay a 32-row bucket already run rather than start a 4-row one; a bucket of a longer
    chunk is never taken (a stream's step computes only its own frames)."""
    planner = Planner(2048, graph_frames=512, exact_eager=True, new_shape_cost=1024)
    assert planner.next([5, 3, 2]).shape == (4, 5)  # nothing run yet: the least padding
    plan = planner.next([5, 3, 2], seen={(32, 5)})
    assert plan.shape == (32, 5) and plan.take == (5, 3, 2)
    assert planner.next([5, 3, 2], seen={(32, 8)}).shape == (4, 5)  # 8 > 5: padding in time, not taken
    assert planner.next([5, 3, 2], seen={(64, 64)}).shape == (4, 5)  # past the budget's shapes: not taken
    # batch decode pads a finishing forward in time to a shape it has run (streaming does not)
    plan = planner.next([5, 3, 2], seen={(32, 8)}, pad_in_time=True)
    assert plan.shape == (32, 8) and plan.take == (5, 3, 2)
    assert planner.next([5, 3, 2], seen={(64, 64)}, pad_in_time=True).shape == (4, 5)
    free = dataclasses.replace(planner, new_shape_cost=0)  # the CPU: a new shape costs nothing
    assert free.next([5, 3, 2], seen={(32, 5)}).shape == (4, 5)


def test_engine_counts_forwards_and_padding(model):
    engine = DecodeEngine(model, frames_per_forward=64, max_rows=4, cuda_graphs=False)
    lengths = [40, 3, 17, 29, 9]
    with torch.inference_mode():
        engine.decode(random_codes(5, 40, model.config, seed=3), lengths)
    stats = engine.stats()
    assert stats["frames"] == sum(lengths) and stats["computed"] >= stats["frames"] and stats["forwards"] >= 2
    assert f"{stats['forwards']} forwards (" in engine.report() and "% padding)" in engine.report()


def test_frame_budget_follows_the_memory_budget():
    from omni_lightning import Code2Wav

    with torch.device("meta"):
        big = Code2Wav("qwen3-omni").to(torch.bfloat16)
    per_frame = activation_bytes_per_frame(big)
    # the last decoder stage: 1920 samples x 96 channels, three tensors alive, bf16
    assert 1920 * 96 * 3 * 2 <= per_frame <= 1920 * 96 * 4 * 2
    assert activation_bytes_per_frame(big, torch.float32) == pytest.approx(2 * per_frame, rel=0.05)
    budget = int(0.03 * 140 * 2**30) - 2**30  # a 0.03 share of a 140 GiB GPU, less weights and state
    graph_frames = graph_frames_for_budget(budget, per_frame, 512)
    assert graph_frames <= 512 and graph_pool_bytes(graph_frames, per_frame) <= budget / 4
    frames = frames_for_budget(budget - graph_pool_bytes(graph_frames, per_frame), per_frame)
    assert frames & (frames - 1) == 0 and 1024 <= frames <= 2048  # a power of two: whole buckets
    assert frames * per_frame * 1.15 + graph_pool_bytes(graph_frames, per_frame) <= budget
    assert frames_for_budget(0, per_frame) == 16  # never below one small forward


def test_a_share_that_cannot_hold_one_frame_is_named_with_its_figures():
    from omni_lightning.engine.budget import check_room, room

    message = room(0.001, 80 * 2**30, int(0.43 * 2**30), needed=3 * 2**20)
    assert "gpu_memory_utilization=0.001 allows 0.08 GiB of the GPU's 80.0 GiB" in message, message
    assert "this process holds 0.43 GiB (weights included); one frame per forward needs 3.0 MiB more" in message
    assert message.endswith("give it a larger share")
    assert "other processes hold the rest" in room(None, 80 * 2**30, 2**30)
    check_room(torch.device("cpu"), 0.001, 0, 10**9)  # no cap on the CPU: nothing to refuse


def test_batch_decode_pads_last_frames_to_shapes_it_has_run_and_stays_exact(model):
    """With CUDA's shape costs (a capture or new cuDNN plans per shape), a batch's last frames replay a
    bucket run before, padded in time; every request still equals its whole decode."""
    engine = DecodeEngine(model, frames_per_forward=64, max_rows=4, capture=RecordingCapture())
    engine.planner = dataclasses.replace(engine.planner, new_shape_cost=Planner.new_shape_cost)
    batches = [([40, 33, 20, 9], 5), ([37, 21, 6, 2], 6), ([30, 30, 29, 3], 7)]
    with torch.inference_mode():
        for lengths, seed in batches:
            codes = random_codes(4, max(lengths), model.config, seed=seed)
            assert_exact(model, codes, lengths, engine.decode(codes, lengths))
    stats = engine.stats()
    assert stats["computed"] > stats["frames"]  # padded
    assert stats["new_shapes"] == len(engine.ever) <= 2 and stats["new_shape_s"] > 0  # 4 without padding in time


@pytest.mark.parametrize(
    "bad",
    [
        {"graph_frames": -1},
        {"graph_share": 0},
        {"graph_share": 1.5},
        {"gpu_memory_utilization": 0},
        {"gpu_memory_utilization": 1.5},
    ],
)
def test_bad_engine_settings_are_refused_naming_the_value(model, bad):
    ((name, value),) = bad.items()
    with pytest.raises(ValueError, match=f"{name} must be .*got {value}"):
        DecodeEngine(model, **bad)


def test_a_forwards_inputs_are_one_buffer_that_a_graph_takes_in_one_copy():
    """A streaming step's chunks stay on the host: a forward's codes (rows of any length, zeros after them
    and in the padding rows), slots and valid frames are built there as one int64 buffer (pinned for a
    CUDA engine), which a graph's static inputs take in one copy; its replay reads them all."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from omni_lightning.engine.bucket_graphs import GraphCache
    from omni_lightning.engine.work import Work, gather

    works = [Work(slot, torch.randint(0, 100, (4, n)), True, 0) for slot, n in ((5, 3), (2, 1))]
    works[0].done = 1  # frames from where the work stands
    inputs = gather(works, [2, 1], 4, 2, [5, 2, 9, 9], torch.device("cpu"))
    codes, slots, valid = inputs.views()
    assert inputs.packed.dim() == 1 and inputs.packed.dtype == torch.long
    assert torch.equal(codes[0], works[0].codes[:, 1:3]) and torch.equal(codes[1, :, :1], works[1].codes)
    assert not codes[1, :, 1:].any() and not codes[2:].any()
    assert slots.tolist() == [5, 2, 9, 9] and valid.tolist() == [2, 1, 0, 0]

    def forward(codes, rows, valid):  # what the replay reads: every static input
        return torch.cat((codes.reshape(-1), rows, valid)).float()

    cache = GraphCache(forward, RecordingCapture(), torch.device("cpu"))
    graph = cache.get(inputs, scratch=9)
    assert graph.rows.tolist() == [9] * 4 and not graph.valid.any()  # captured on the scratch slot
    replay, ops = graph.replay, []
    graph.replay = lambda: None

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        cache.run(graph, inputs)
    assert ops == ["copy_.default"]
    replay()
    assert torch.equal(graph.out, inputs.packed.float())


@pytest.mark.parametrize("new_shape_cost", [0, 1024])
def test_streaming_steps_pad_in_time_only_where_it_costs_less_than_a_new_shape(model, new_shape_cost):
    """A stream's step (every row decoded whole) runs at its own chunk where a new shape costs nothing (the
    CPU), and pads in time to a shape it has run where a new one costs a capture (CUDA's price: a capture
    in the clients' way costs far more than a few padded frames); the streams stay exact either way."""
    engine = DecodeEngine(model, frames_per_forward=64, max_rows=4, capture=RecordingCapture())
    engine.planner = dataclasses.replace(engine.planner, new_shape_cost=new_shape_cost)
    codes = random_codes(2, 30, model.config, seed=8)
    slots = [engine.acquire(), engine.acquire()]
    got = {0: [], 1: []}
    with torch.inference_mode():
        for start, stop in ((0, 12), (12, 15), (15, 16), (16, 30)):  # 12 frames, then 3, then 1, then 14
            out = engine.advance({i: (slots[i], codes[i, :, start:stop], start == 0) for i in range(2)})
            for i in range(2):
                got[i].append(out[i])
    chunks = {c for _, c in engine.ever}
    assert chunks >= {3, 1} if new_shape_cost == 0 else chunks == {12, 16}, chunks
    for i in range(2):
        want = solo(model, codes[i], 30)
        assert (torch.cat(got[i], dim=-1) - want).abs().max() <= 1e-5


def test_a_streaming_decoders_graphs_take_most_of_the_default_budget():
    """64 streams x 10 frames (640) replay a CUDA graph with no cap: the streaming decoder asks for
    forwards of up to 64 x 16 frames as graphs, with three quarters of the budget for their pool, and
    the eager forwards keep the rest; batch decode keeps a quarter (its long forwards need the room)."""
    from omni_lightning import Code2Wav
    from omni_lightning.engine.budget import DEFAULT_BUDGET
    from omni_lightning.engine.streaming import STEP_FRAMES

    with torch.device("meta"):
        big = Code2Wav("qwen3-omni").to(torch.bfloat16)
    per_frame = activation_bytes_per_frame(big)
    streaming = graph_frames_for_budget(DEFAULT_BUDGET, per_frame, 64 * STEP_FRAMES, share=0.75)
    assert streaming >= 64 * 10 and graph_pool_bytes(streaming, per_frame) <= 0.75 * DEFAULT_BUDGET
    eager = frames_for_budget(DEFAULT_BUDGET - graph_pool_bytes(streaming, per_frame), per_frame)
    assert eager >= streaming and eager * per_frame * 1.15 + graph_pool_bytes(streaming, per_frame) <= DEFAULT_BUDGET
    assert graph_frames_for_budget(DEFAULT_BUDGET, per_frame, 1024) == 256  # batch decode: as before


def test_trainer_predict_through_the_engine_keeps_graphs_across_calls():
    model = random_model(micro_config(), seed=9)  # its own: this test changes a weight
    rng = random.Random(3)
    lengths = [rng.randint(1, 24) for _ in range(9)] + [70]
    reqs = requests(lengths, seed=60)
    module = Code2WavModule(model=model)
    module.engine = DecodeEngine(model, frames_per_forward=24, max_rows=4, capture=RecordingCapture())
    preds = Trainer(**trainer_kwargs()).predict(module, loader(reqs, 4))
    got = {r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)}
    stats = module.engine.graphs.stats
    assert stats.captures >= 1 and stats.replays >= 3 and stats.eager == 0
    for (req_id, codes), n in zip(reqs.items(), lengths):
        want = solo(model, codes, n)
        assert got[req_id].shape == want.shape and (got[req_id] - want).abs().max() <= 1e-5
    # between predict calls Lightning moves the module away and back (new tensors; on a GPU it is
    # .cpu() then .to("cuda")); here that is a clone, with a weight changed as fine-tuning would
    captures, engine = stats.captures, module.engine
    model._apply(lambda t: t.clone())
    model.decoder[-1].conv.bias.data.add_(0.1)
    preds = Trainer(**trainer_kwargs()).predict(module, loader(reqs, 4))
    got = {r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)}
    # the graphs were kept and read the new weights (on CUDA they are captured again after Lightning's
    # teardown clears the cuBLAS workspaces they recorded: tests/test_capture.py)
    assert module.engine is engine and stats.captures == captures
    for (req_id, codes), n in zip(reqs.items(), lengths):
        assert (got[req_id] - solo(model, codes, n)).abs().max() <= 1e-5


def test_the_engine_is_kept_across_predicts_rebuilt_for_another_cap_and_released_by_fit():
    """A predict's engine is kept for the next predict (capped or not); a predict under another
    ``gpu_memory_utilization`` gets an engine sized for it; fit, which needs the memory and changes the
    weights, releases it, and the next predict builds a fresh one that reads the new weights."""
    module = Code2WavModule(model=random_model(micro_config(), seed=4))
    reqs = requests([5, 9, 3], seed=70)
    Trainer(**trainer_kwargs()).predict(module, loader(reqs, 3))
    first = module.engine
    assert first is not None and first.gpu_memory_utilization is None
    Trainer(**trainer_kwargs()).predict(module, loader(reqs, 3))
    assert module.engine is first
    Trainer(**trainer_kwargs(), gpu_memory_utilization=0.5).predict(module, loader(reqs, 3))
    capped = module.engine
    assert capped is not first and capped.gpu_memory_utilization == 0.5
    Trainer(**trainer_kwargs(), gpu_memory_utilization=0.5).predict(module, loader(reqs, 3))
    assert module.engine is capped
    module.frames_per_forward = 8  # a setting changed between predicts takes effect
    Trainer(**trainer_kwargs(), gpu_memory_utilization=0.5).predict(module, loader(reqs, 3))
    assert module.engine is not capped and module.engine.frames_per_forward == 8
    cfg = module.config
    codes = random_codes(2, 6, cfg, seed=71)
    audio = torch.randn(2, 1, cfg.output_length(6), generator=torch.Generator().manual_seed(0))
    batch = {"codes": codes, "audio": audio, "audio_lengths": torch.tensor([cfg.output_length(6)] * 2)}
    fit = Trainer(**trainer_kwargs(), max_steps=1)
    fit.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    assert module.engine is None
    preds = Trainer(**trainer_kwargs()).predict(module, loader(reqs, 3))
    got = {r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)}
    for (req_id, codes_i), n in zip(reqs.items(), [5, 9, 3]):
        assert (got[req_id] - solo(module.model, codes_i, n)).abs().max() <= 1e-5  # the fitted weights
    fp32 = module.engine
    Trainer(**trainer_kwargs(precision="bf16-true")).predict(module, loader(reqs, 3))  # another dtype
    assert module.engine is not fp32 and module.engine.dtype == torch.bfloat16


def test_an_engine_holds_one_copy_of_the_weights_and_frees_it_when_closed():
    model = random_model(micro_config(), seed=5)
    engine = DecodeEngine(model, frames_per_forward=24, capture=RecordingCapture())
    assert engine.weights.nbytes() == sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    engine.close()
    assert engine.weights is None  # closed: nothing held


def graph_engine_and_batch(seed):
    """An engine over its own model whose forwards of up to 16 frames replay a graph stand-in that
    reads what a CUDA graph reads (``ReplayCapture``), and a batch all of whose forwards replay one."""
    model = random_model(micro_config(), seed=seed)
    engine = DecodeEngine(model, frames_per_forward=16, max_rows=2, graph_frames=16, capture=ReplayCapture())
    lengths = [13, 6]
    return model, engine, random_codes(2, 13, model.config, seed=seed), lengths


def test_graphs_read_the_engines_channels_last_copies_through_functional_call(model):
    """A standalone engine with graphs (a stand-in capture on the CPU) holds the convolution weights
    as channels-last copies and runs the model on them (``functional_call``, captures too), never
    repointing a parameter: the audio is the eager model's. Its graphs read those copies, as CUDA
    graphs read the addresses they were captured with: a weight written in place reaches them at
    ``refresh`` (each predict's start), and then exactly."""
    model, engine, codes, lengths = graph_engine_and_batch(seed=12)
    before = [(p.data_ptr(), p.stride()) for p in model.parameters()]
    held = dict(zip(map(id, model.parameters()), engine.weights.held))
    convs = [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1]
    convs = [w for w in convs if w.shape[1] > 1]  # (one input channel: any layout is channels-last)
    assert convs and all(held[id(w)].stride(1) == 1 != w.stride(1) for w in convs)
    with torch.inference_mode():
        assert_exact(model, codes, lengths, engine.decode(codes, lengths))
        assert engine.graphs.stats.replays > 0 and engine.graphs.stats.eager == 0
        with torch.no_grad():
            convs[0].mul_(1.5)  # the model's weight, not the engine's copy
        stale = engine.decode(codes, lengths)
        assert any((stale[i] - solo(model, codes[i], n)).abs().max() > 1e-3 for i, n in enumerate(lengths))
        engine.refresh()
        assert_exact(model, codes, lengths, engine.decode(codes, lengths))
    assert [(p.data_ptr(), p.stride()) for p in model.parameters()] == before


def test_graphs_captured_under_autocast_are_not_replayed_without_it():
    """A CUDA graph replays the kernels autocast chose when it was captured: after a decode under
    bf16 autocast (a bf16-mixed predict), a decode without it captures its graphs again and is exact."""
    model, engine, codes, lengths = graph_engine_and_batch(seed=13)
    with torch.inference_mode():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = engine.decode(codes, lengths)
        captures = engine.graphs.stats.captures
        assert any((mixed[i] - solo(model, codes[i], n)).abs().max() > 1e-3 for i, n in enumerate(lengths))
        assert_exact(model, codes, lengths, engine.decode(codes, lengths))
    assert engine.graphs.stats.captures == 2 * captures and engine.graphs.stats.eager == 0
