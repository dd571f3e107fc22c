"""The stream lane (``serving/stream_lane.py``, ``serve --stream_lane``): the WebSocket streams on a decoder of
their own, launched as their chunks come, also while a bulk slice computes; whole requests not capped to a
slice. Driven step by step on real tiny decoders (every client exactly ``decode`` of its codes), with a bulk
copy held back to see a chunk decoded while it waits, and end to end through the command (engine and front
processes, real HTTP and WebSocket clients). On CUDA (``-m gpu``) the lane is a high-priority CUDA stream
beside the bulk's, each decoder with its own graphs: fp32 with TF32 off, within 1e-4 of ``decode``."""

from __future__ import annotations

import logging
import random
import signal

import pytest
import torch
from serve_helpers import (
    DEVICES,
    RecordingDecoder,
    audio_of,
    check_decode,
    clients_exact,
    serve_command,
    sink_into,
    tiny_on,
)

from omni_lightning.serving.decode_loop import DecodeLoop


def _lane_loop(module, device: str, **settings) -> tuple[DecodeLoop, RecordingDecoder]:
    """A loop whose bulk decoder and stream lane's decoder both record what each step advanced."""

    def decoder() -> RecordingDecoder:
        return RecordingDecoder(module.model, max_streams=8, cuda_graphs=device == "cuda")

    loop = DecodeLoop(decoder(), stream_lane=decoder, **settings)
    assert loop.warm()  # builds the lane's decoder (after the bulk's warm-up)
    return loop, loop.lane.decoder


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("lane_sms", [0, 16])
def test_streams_decode_on_their_lane_whole_requests_uncapped_on_cuda_and_every_client_equals_decode(
    lane_sms, seed, pipeline, device, no_tf32
):
    """``lane_sms``: on CUDA the bulk decodes launched while a stream is open run on a green context's stream of
    the SMs left (every client still exact); with none open, on the loop's; on a CPU the option does nothing."""
    rng = random.Random(seed)
    module = tiny_on(seed, device)
    # a slice of a nanosecond: without a lane, the bulk would send its least (8 frames, oldest first) a step
    loop, lane = _lane_loop(module, device, request_frames=rng.choice([4, 8]), warmup=(), bulk_slice_s=1e-9,
                            pipeline=pipeline, lane_sms=lane_sms)  # fmt: skip
    green = loop.lane.bulk_stream
    assert (green is not None) == (device == "cuda" and lane_sms > 0), green
    q, size = module.config.num_quantizers, module.config.codebook_size
    wholes = [torch.randint(0, size, (q, rng.randint(9, 60))) for _ in range(3)]
    streams = [[torch.randint(0, size, (q, rng.randint(1, 12))) for _ in range(rng.randint(2, 5))] for _ in range(2)]
    answers = [[] for _ in range(len(wholes) + len(streams))]
    with torch.no_grad():
        opened = [loop.open_stream(f"s{i}", sink_into(answers[len(wholes) + i])) for i in range(len(streams))]
        jobs = [loop.submit(f"w{i}", codes, sink_into(answers[i])) for i, codes in enumerate(wholes)]
        for at in range(max(map(len, streams))):
            for job, chunks in zip(opened, streams):
                if at < len(chunks):
                    loop.push(job, chunks[at])
            loop.run_step()
        for job in opened:
            loop.finish(job)
        while loop.has_work():
            loop.run_step()
    for got, codes in zip(answers, [*wholes, *(torch.cat(c, dim=1) for c in streams)]):
        check_decode(audio_of(got), module, codes)
    bulk = loop.decoder
    assert {j.sid for j in jobs} <= set().union(*bulk.steps) and len(bulk.streams) == 0
    assert lane.steps and all(s <= {j.sid for j in opened} for s in lane.steps)  # the lane decodes streams only
    assert sum(len(c) for c in streams) >= len(lane.steps) >= max(map(len, streams))
    # on CUDA every whole request in the first step (no slice cap: the lane runs beside); on a CPU the lane's
    # decodes run in turn with the bulk's, which stay capped (the least: 8 frames, oldest first, of 12-24)
    assert len(bulk.steps[0]) == len(wholes) if device == "cuda" else len(bulk.steps[0]) < len(wholes)
    if green is not None:  # the first bulk step ran beside open streams; one after they all ended does not
        assert bulk.launched_on[0] == green, bulk.launched_on
        late, codes = [], torch.randint(0, size, (q, 9))
        with torch.no_grad():
            loop.submit("late", codes, sink_into(late))
            while loop.has_work():
                loop.run_step()
        check_decode(audio_of(late), module, codes)
        assert bulk.launched_on[-1] != green, bulk.launched_on


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("required", [False, True])
def test_a_lane_its_memory_does_not_hold_is_dropped_with_a_warning_by_default_and_an_error_when_asked_for(
    required, device, no_tf32, caplog
):
    """The lane's decoder is made, then runs out of memory in its warm-up (a stand-in for a capped GPU's
    ``budget.no_room``, which a CPU has not): by default the server goes on without a lane, the streams on the
    bulk decoder (each still ``decode`` of its codes); asked for (``--stream_lane true``), the warm-up fails,
    naming the shortfall."""
    module = tiny_on(0, device)
    made = []

    def short_of_memory() -> RecordingDecoder:
        made.append(RecordingDecoder(module.model, max_streams=4, cuda_graphs=device == "cuda"))
        raise torch.OutOfMemoryError("the stream lane's decoder needs 2.0 GiB; 0.5 GiB left under the cap")

    bulk = RecordingDecoder(module.model, max_streams=4, cuda_graphs=device == "cuda")
    loop = DecodeLoop(bulk, warmup=(1,), stream_lane=short_of_memory, lane_required=required)
    caplog.set_level(logging.WARNING, "omni_lightning.serving")
    assert loop.warm() is not required and made
    if required:
        assert "OutOfMemoryError" in loop.warmup_error and "0.5 GiB left" in loop.warmup_error, loop.warmup_error
        return
    assert loop.lane is None and loop.ready.is_set()
    assert "no stream lane" in caplog.text and "0.5 GiB left" in caplog.text and "--stream_lane" in caplog.text
    codes = torch.randint(0, module.config.codebook_size, (module.config.num_quantizers, 11))
    got = []
    with torch.no_grad():
        job = loop.open_stream("s", sink_into(got))
        for at in range(0, 11, 4):
            loop.push(job, codes[:, at : at + 4])
            loop.run_step()
        loop.finish(job)
        while loop.has_work():
            loop.run_step()
    check_decode(audio_of(got), module, codes)
    assert len(bulk.steps) == 3 and len(set().union(*bulk.steps)) == 1  # the bulk decoder decoded its 3 chunks


class HeldCopies:
    """The bulk decodes' copies land only after ``polls`` checks of ``ready`` (a device still computing)."""

    def __init__(self, host, polls: int) -> None:
        self.host, self.polls, self.start_real = host, polls, host.start
        host.start = self.start

    def start(self, outs):
        copy, left = self.start_real(outs), [self.polls]

        class Held:
            def ready(self) -> bool:
                left[0] -= 1
                return left[0] < 0

            def wait(self):
                return copy.wait()

        return Held()


@pytest.mark.parametrize("lane", [True, False])
def test_a_chunk_that_comes_while_a_bulk_slice_computes_is_decoded_before_it_lands(lane):
    """The lane's point: the loop launches a chunk while it waits for the bulk slice, and hands out its audio
    first. Without a lane (the control) the same chunk waits for the slice and the step after it."""
    module = tiny_on(0, "cpu")
    settings = {"request_frames": 8, "warmup": (), "pipeline": False}
    if lane:
        loop, _ = _lane_loop(module, "cpu", **settings)
    else:
        loop = DecodeLoop(RecordingDecoder(module.model, max_streams=8, cuda_graphs=False), **settings)
    HeldCopies(loop.decodes.host, polls=50)
    q, size = module.config.num_quantizers, module.config.codebook_size
    whole, chunk = torch.randint(0, size, (q, 40)), torch.randint(0, size, (q, 6))
    order, answers = [], {"w": [], "s": []}

    def sink(who):
        into = sink_into(answers[who])
        return lambda kind, value: (order.append((who, kind)), into(kind, value))

    came = []

    def between():  # the socket read while the device computes: the talker's chunk arrives now
        if not came:
            came.append(loop.push(stream, chunk))

    with torch.no_grad():
        stream = loop.open_stream("s", sink("s"))
        loop.submit("w", whole, sink("w"))
        loop.run_step(between)
        if not lane:  # without a lane the loop waits for the copy at once: the first poll read the socket
            assert order[0] == ("w", "audio") and not answers["s"]
            loop.run_step()
        assert ("s", "audio") in order
        if lane:
            assert order.index(("s", "audio")) < order.index(("w", "audio"))
        loop.finish(stream)
        while loop.has_work():
            loop.run_step()
    check_decode(audio_of(answers["w"]), module, whole)
    check_decode(audio_of(answers["s"]), module, chunk)


def _streams_reusing_a_slot(loop, module, between_close_and_open=lambda: None) -> None:
    """Eight streams fill the lane's eight slots and decode a chunk each; the first ends, then a new stream takes
    its slot (the only one free) and decodes; every stream's audio equals ``decode`` of its codes."""
    q, size = module.config.num_quantizers, module.config.codebook_size
    firsts = [torch.randint(0, size, (q, 7)) for _ in range(8)]
    late = torch.randint(0, size, (q, 5))
    answers = [[] for _ in range(9)]
    with torch.no_grad():
        jobs = [loop.open_stream(f"s{i}", sink_into(answers[i])) for i in range(8)]
        for job, codes in zip(jobs, firsts):
            loop.push(job, codes)
        loop.run_step()
        loop.finish(jobs[0])
        between_close_and_open()
        loop.run_step()  # the first stream ends: its slot's state is zeroed
        new = loop.open_stream("new", sink_into(answers[8]))
        loop.push(new, late)
        loop.run_step()  # its first chunk reads that slot's state
        for job in [*jobs[1:], new]:
            loop.finish(job)
        while loop.has_work():
            loop.run_step()
    for got, codes in zip(answers, [*firsts, late]):
        check_decode(audio_of(got), module, codes)


def test_every_call_of_the_lanes_decoder_runs_with_the_lanes_stream_current():
    """The CPU's stand-in for the race below: a slot's state zeroed, a stream opened, a forward, each with the
    lane current (``StreamLane.inside``); on CUDA one outside would be queued on the bulk's stream."""
    module = tiny_on(0, "cpu")
    loop, lane = _lane_loop(module, "cpu", request_frames=8, warmup=(1,), pipeline=True)
    calls, outside = [], []
    for name in ("acquire", "release", "_run"):
        real = getattr(lane.engine, name)

        def watched(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            if loop.lane.inside == 0:
                outside.append(_name)
            return _real(*args, **kwargs)

        setattr(lane.engine, name, watched)
    _streams_reusing_a_slot(loop, module)
    assert {"acquire", "release", "_run"} <= set(calls) and not outside, outside


@pytest.mark.gpu
def test_a_stream_on_a_closed_streams_slot_starts_fresh_while_the_bulk_stream_is_busy(no_tf32):
    """A slot's state is zeroed on the lane's stream, before the next stream's first forward on it: with the
    bulk's CUDA stream held busy (a sleep kernel) when the first stream ends, a reset queued there would come
    after the new stream's first chunk read the old state (its audio wrong), and zero what that chunk saved.
    The lane's decoder is also built while that stream is busy: its state, made there, is read after."""
    module = tiny_on(0, "cuda")
    busy = lambda: torch.cuda._sleep(200_000_000)  # ~0.1 s of the bulk's stream at the H100's clock  # noqa: E731
    busy()
    loop, _ = _lane_loop(module, "cuda", request_frames=8, warmup=(1, 8), pipeline=True)
    _streams_reusing_a_slot(loop, module, busy)


@pytest.mark.slow
def test_serve_with_a_stream_lane_answers_every_client_exactly_and_says_so():
    proc, line, url = serve_command("--front_processes", "1", "--stream_lane", "true")
    try:
        assert "streams on a lane of their own" in line, line
        clients_exact(url, 8, seed=1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        said = proc.stderr.read()
        assert "serve: the stream lane's decoder built and warmed up in" in said, said[-3000:]
    finally:
        proc.kill()
        proc.wait()
