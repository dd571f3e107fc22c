"""A server's threads sharing one model: a thread per request or per stream, and a fit on another
thread. Each result equals the same call made alone, or the call is refused, saying why."""

import sys
import threading
from contextlib import contextmanager

import lightning.pytorch as pl
import pytest
import torch
from conftest import random_codes, random_model
from helpers import trainer_kwargs

from omni_lightning import Code2WavModule, CodesDataModule, DecodeEngine, StreamingDecoder, Trainer
from omni_lightning.data.synthetic import make_demo_data, make_teacher

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=DEVICES)
def tiny(request):
    """On CUDA the engine replays CUDA graphs, whose input buffers two threads' calls would share. Tests
    comparing with fp32 eager decodes take ``no_tf32``: graphed and eager forwards then round alike."""
    return random_model("tiny", seed=2).to(request.param)


@contextmanager
def switching_often():
    """Threads switch every microsecond: races show within a few steps (5 ms by default hides them)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def run_threads(target, n):
    results, errors = {}, {}

    def run(i):
        try:
            results[i] = target(i)
        except Exception as err:  # noqa: BLE001 - reported by the test
            errors[i] = f"{type(err).__name__}: {err}"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results, errors


def test_a_thread_per_stream_stepping_a_shared_decoder_gets_its_own_samples(tiny, no_tf32):
    """step({stream: chunk}) from many threads: one thread's step decoded and returned another's pushed
    chunk (that thread's audio lost: 7 of 9 runs of a 16-thread repro), before the decoder ran one call at a time."""
    requests = [random_codes(1, 24, seed=100 + i)[0] for i in range(8)]
    decoder = StreamingDecoder(tiny, max_streams=8)
    barrier = threading.Barrier(8)

    def one_stream(i):
        barrier.wait()
        sid = decoder.open()
        pieces = [decoder.step({sid: requests[i][:, t : t + 1]})[sid] for t in range(24)]
        return torch.cat([*pieces, decoder.close(sid)], dim=1)

    with switching_often():
        results, errors = run_threads(one_stream, 8)
    assert not errors, errors
    with torch.no_grad():
        for i, codes in enumerate(requests):
            assert (results[i] - tiny.decode(codes[None].to(next(tiny.parameters()).device))[0]).abs().max() <= 1e-5
    assert decoder.streams == [] and len(set(decoder.engine._free)) == 8  # every slot back, once


def test_threads_decoding_on_one_engine_past_its_slots_each_get_exact_audio(tiny, no_tf32):
    """Three threads x 3 requests on a 4-slot engine: a thread found every slot taken by the others'
    requests and was told the slots were in use "by open streams"."""
    engine = DecodeEngine(tiny, max_rows=4)
    batches = [random_codes(3, 9 + i, seed=i) for i in range(3)]
    with switching_often():
        results, errors = run_threads(lambda i: engine.decode(batches[i], [9 + i, 4, 7]), 3)
    assert not errors, errors
    with torch.no_grad():
        for i, codes in enumerate(batches):
            for j, n in enumerate([9 + i, 4, 7]):
                want = tiny.decode(codes[j : j + 1, :, :n].to(next(tiny.parameters()).device))[0]
                assert (results[i][j] - want).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("data"), 4, 1.0, 1.5, teacher=make_teacher("tiny"), seed=0,
                          name="train.jsonl")  # fmt: skip


def test_a_stream_stepped_on_another_thread_during_fit_is_told_it_was_retired(train):
    """fit's set-up retired the decoder while a step was in flight: the stepping thread got KeyError 0."""
    module = Code2WavModule(model=random_model("tiny", seed=3))
    decoder = module.streaming_decoder(max_streams=4)
    sids = [decoder.open() for _ in range(3)]
    codes = random_codes(1, 600, seed=3)[0]
    stop, seen = threading.Event(), []

    def stepping():
        t = 0
        while not stop.is_set():
            try:
                decoder.step({s: codes[:, t % 590 : t % 590 + 3] for s in sids})
            except Exception as err:  # noqa: BLE001 - what the stepping thread is told
                seen.append(err)
                return
            t += 3

    thread = threading.Thread(target=stepping)
    with switching_often():
        thread.start()
        Trainer(**trainer_kwargs(max_steps=1, num_sanity_val_steps=0, limit_val_batches=0)).fit(
            module, datamodule=CodesDataModule(train=str(train), batch_size=2, num_workers=0)
        )
        stop.set()
        thread.join(60)
    assert len(seen) == 1 and isinstance(seen[0], ValueError), seen
    assert "decoder was retired: its module started trainer.fit" in str(seen[0])
    assert sorted(decoder.engine._free) == [0, 1, 2, 3]  # every slot freed once


class DecodeFromAnotherThread(pl.Callback):
    """At a training step, a server thread decodes with the module being fine-tuned: a batch, a stream,
    a streaming decoder. ``fail_at``: the step whose end raises (a fit that fails)."""

    def __init__(self, codes, fail_at=None):
        self.codes, self.said, self.fail_at = codes, [], fail_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        batch = {"codes": self.codes, "n_frames": [self.codes.shape[-1]]}
        tries = [lambda: pl_module.decode_batch(batch), lambda: next(pl_module.stream([self.codes[0]])),
                 lambda: pl_module.streaming_decoder(),
                 lambda: Trainer(**trainer_kwargs()).predict(pl_module, [batch])]  # fmt: skip

        def decode():
            for attempt in tries:
                try:
                    attempt()
                except ValueError as err:
                    self.said.append(str(err))

        thread = threading.Thread(target=decode)
        thread.start()
        thread.join(60)
        if batch_idx == self.fail_at:
            raise RuntimeError("the fit fails here")


def test_a_decode_on_another_thread_during_fit_is_refused_not_mixed(train):
    """It decoded with weights that changed under it: outputs equal to neither the old nor the new weights.
    A trainer.predict on another thread took the module over (its trainer, eval mode): the fit then failed."""
    module = Code2WavModule(model=random_model("tiny", seed=3))
    codes = random_codes(1, 8, seed=1)
    probe = DecodeFromAnotherThread(codes)
    Trainer(**trainer_kwargs(max_steps=2, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[probe])).fit(
        module, datamodule=CodesDataModule(train=str(train), batch_size=2, num_workers=0)
    )
    assert len(probe.said) == 8 and all("being fine-tuned (trainer.fit, on another thread)" in s for s in probe.said)
    assert module.trainer.global_step == 2  # the fit ran its steps: the refused predict changed nothing under it
    with torch.no_grad():  # once fit returns, decodes run on the tuned weights
        out = module.decode_batch({"codes": codes, "n_frames": [8]})[0]
        assert (out - module.model.decode(codes)[0]).abs().max() <= 1e-5


def test_after_a_fit_that_failed_other_threads_decode_again(train):
    """Lightning runs no teardown hook after an error: the refusal outlived the fit."""
    module = Code2WavModule(model=random_model("tiny", seed=3))
    codes = random_codes(1, 8, seed=1)
    probe = DecodeFromAnotherThread(codes, fail_at=0)
    with pytest.raises(RuntimeError, match="the fit fails here"):
        Trainer(**trainer_kwargs(max_steps=2, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[probe])).fit(
            module, datamodule=CodesDataModule(train=str(train), batch_size=2, num_workers=0)
        )
    assert len(probe.said) == 4  # refused while it ran
    results, errors = run_threads(lambda i: module.decode_batch({"codes": codes, "n_frames": [8]})[0], 1)
    assert not errors, errors
    with torch.no_grad():
        assert (results[0] - module.model.decode(codes)[0]).abs().max() <= 1e-5
