"""The serving decode loop's steps (``serving/decode_loop.py``), driven step by step on a real tiny decoder:
a stream's chunk is decoded apart from the bulk slice (never in a forward with whole requests' rows), and
every client still gets exactly ``decode`` of its codes. On CUDA (``-m gpu``) the same, with CUDA graphs and the
decodes pipelined (the default there): fp32 with TF32 off, within 1e-4 of ``decode``."""

from __future__ import annotations

import random

import pytest
import torch
from serve_helpers import DEVICES, RecordingDecoder, audio_of, check_decode, count_sum, sink_into, tiny_on

from omni_lightning.engine.streaming import StreamingDecoder
from omni_lightning.serving.decode_loop import DecodeLoop


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_streams_chunk_never_shares_a_forward_with_bulk_rows_and_every_client_equals_decode(
    seed, pipeline, device, no_tf32
):
    rng = random.Random(seed)
    module = tiny_on(seed, device)
    decoder = RecordingDecoder(module.model, max_streams=8, cuda_graphs=device == "cuda")
    loop = DecodeLoop(decoder, request_frames=rng.choice([4, 8, 32]), warmup=(), bulk_slice_s=0.005, pipeline=pipeline)
    q = module.config.num_quantizers
    wholes = [torch.randint(0, module.config.codebook_size, (q, rng.randint(1, 60))) for _ in range(3)]
    chunks = [torch.randint(0, module.config.codebook_size, (q, rng.randint(1, 12))) for _ in range(6)]
    answers = {i: [] for i in range(len(wholes) + 1)}
    with torch.no_grad():
        jobs = [loop.submit(f"w{i}", codes, sink_into(answers[i])) for i, codes in enumerate(wholes)]
        stream = loop.open_stream("s", sink_into(answers[len(wholes)]))
        for chunk in chunks:
            loop.push(stream, chunk)
            loop.run_step()
        loop.finish(stream)
        while loop.has_work():
            loop.run_step()
        whole_sids = {job.sid for job in jobs}
        stream_steps = [s for s in decoder.steps if stream.sid in s]
        assert len(stream_steps) == len(chunks)  # one decode per chunk pushed before a step
        assert all(s == {stream.sid} for s in stream_steps)  # never with a whole request's rows
        assert any(s & whole_sids for s in decoder.steps)  # the bulk work ran in steps of its own
        for i, codes in enumerate([*wholes, torch.cat(chunks, dim=1)]):
            check_decode(audio_of(answers[i]), module, codes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_pipelined_whole_requests_each_equal_decode_and_an_abort_in_flight_frees_its_slot(seed, device, no_tf32):
    """With ``pipeline`` (the default on CUDA) a step launches its bulk decode before handing out the last
    one's audio; on this CPU the same bookkeeping runs: every request whole and exact, in order, an aborted
    one told nothing more, every slot free at the end."""
    rng = random.Random(seed)
    module = tiny_on(seed, device)
    decoder = StreamingDecoder(module.model, max_streams=3, cuda_graphs=device == "cuda")
    loop = DecodeLoop(decoder, max_queue=16, request_frames=rng.choice([3, 8]), warmup=(), pipeline=True)
    q = module.config.num_quantizers
    wholes = [torch.randint(0, module.config.codebook_size, (q, rng.randint(1, 40))) for _ in range(7)]
    answers = {i: [] for i in range(len(wholes))}
    with torch.no_grad():
        jobs = [loop.submit(f"w{i}", codes, sink_into(answers[i])) for i, codes in enumerate(wholes)]
        loop.run_step()
        loop.run_step()
        assert loop._in_flight is not None  # a decode launched and not yet handed out
        gone = next(j for j in jobs if j.in_flight and not j.done)
        loop.abort(gone)
        steps = 0
        while loop.has_work():
            loop.run_step()
            steps += 1
            assert steps < 500
    assert decoder.streams == [] and loop.open_jobs == 0
    for i, codes in enumerate(wholes):
        if jobs[i] is gone:
            assert all(kind == "audio" for kind, _ in answers[i])  # no end, no error: the client left
            continue
        with torch.no_grad():
            check_decode(audio_of(answers[i]), module, codes)


def test_pipelined_steps_behind_the_engines_socket_answer_every_client_exactly(tmp_path):
    """The engine process's server (``EngineServer``, here on a thread) over a pipelined loop, its clients a
    front's ``RemoteLoop`` over a real ZeroMQ socket: whole requests and streams at once, one client gone
    mid-way; every other client gets ``decode`` of its codes, the loop ends with nothing open. Each stream
    chunk's hand-off to the engine and its audio's back are timed by their receivers."""
    import asyncio
    import threading

    from omni_lightning.serving.engine_client import RemoteLoop
    from omni_lightning.serving.engine_process import EngineServer
    from omni_lightning.serving.jobs import queue_sink
    from omni_lightning.serving.metrics import ServeMetrics

    rng = random.Random(7)
    module = tiny_on(7, "cpu")
    decoder = StreamingDecoder(module.model, max_streams=4, cuda_graphs=False)
    engine_metrics, front_metrics = ServeMetrics(), ServeMetrics()
    loop = DecodeLoop(decoder, max_queue=32, request_frames=8, warmup=(), pipeline=True, metrics=engine_metrics)
    server = EngineServer(loop, f"ipc://{tmp_path}/engine")
    with torch.no_grad():
        thread = threading.Thread(target=lambda: (torch.set_grad_enabled(False), server.serve()), daemon=True)
        thread.start()
        q, size = module.config.num_quantizers, module.config.codebook_size
        wholes = [torch.randint(0, size, (q, rng.randint(1, 50))) for _ in range(9)]
        streamed = [[torch.randint(0, size, (q, rng.randint(1, 9))) for _ in range(4)] for _ in range(2)]

        async def drive() -> list[list]:
            remote = RemoteLoop([server.address], module.config, max_streams=4, metrics=front_metrics)
            remote.start()
            queues = [asyncio.Queue() for _ in range(len(wholes) + len(streamed))]
            streams = [remote.open_stream(f"s{k}", queue_sink(queues[len(wholes) + k])) for k in range(len(streamed))]
            await asyncio.sleep(0.2)  # open before the whole requests fill the slots (else: 503, as documented)
            jobs = [remote.submit(f"w{i}", codes, queue_sink(queues[i])) for i, codes in enumerate(wholes)]
            for job, chunks in zip(streams, streamed):
                for chunk in chunks:
                    remote.push(job, chunk)
                remote.finish(job)
            first = await queues[0].get()  # the first client leaves after its first audio
            remote.abort(jobs[0])
            answers: list[list] = [[first]]
            for queue in queues[1:]:
                got = []
                while not got or got[-1][0] == "audio":
                    got.append(await asyncio.wait_for(queue.get(), 60))
                answers.append(got)
            remote.stop()
            await asyncio.sleep(0.05)
            return answers

        answers = asyncio.run(drive())
        server.stop()
        thread.join(30)
    assert not thread.is_alive() and loop.open_jobs == 0 and decoder.streams == []
    for messages, codes in zip(answers[1:], [*wholes[1:], *(torch.cat(c, dim=1) for c in streamed)]):
        check_decode(audio_of(messages), module, codes)
    # every chunk pushed timed once on its way in; each stream audio message on its way out (a message may
    # carry several chunks' audio), the whole requests' not; each within the test's time
    chunks_in, seconds_in = count_sum(engine_metrics.stream_chunk_to_engine_seconds)
    audio_out, seconds_out = count_sum(front_metrics.stream_audio_to_front_seconds)
    streamed_audio = sum(kind == "audio" for messages in answers[len(wholes) :] for kind, _ in messages)
    assert chunks_in == sum(len(c) for c in streamed) and audio_out == streamed_audio, (chunks_in, audio_out)
    assert 0 < seconds_in < 60 * chunks_in and 0 < seconds_out < 60 * audio_out
    assert count_sum(engine_metrics.stream_audio_to_front_seconds)[0] == 0  # timed where it is received only


def test_a_queue_sink_keeps_what_its_own_loop_hands_it_and_copies_what_another_thread_does():
    """On its event loop's thread (a front's reader: audio made from the message's bytes) the message is on the
    queue when the call returns, the very tensors; from a decode thread (views of a buffer the next step
    reuses) it arrives a turn later, copied, so overwriting the buffer after the call changes nothing."""
    import asyncio
    import threading

    from omni_lightning.serving.jobs import queue_sink

    async def drive() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        sink = queue_sink(queue)
        own = [torch.arange(6.0).reshape(1, 6)]
        sink("audio", own)
        assert queue.qsize() == 1 and queue.get_nowait()[1][0] is own[0]
        buffer = torch.arange(8.0).reshape(1, 8)
        thread = threading.Thread(target=lambda: (sink("audio", [buffer[:, :4]]), buffer.fill_(-1)))
        thread.start()
        thread.join()
        kind, pieces = await asyncio.wait_for(queue.get(), 5)
        assert kind == "audio" and pieces[0].tolist() == [[0.0, 1.0, 2.0, 3.0]]
        sink("end", None)
        assert queue.get_nowait() == ("end", None)

    asyncio.run(drive())
