"""PinnedPool and the async transfer logic on the CPU, through real Lightning trainers.

Only the CUDA primitives are replaced (``host_copies.HostCopies``: deferred copies, poisoned
buffers); the pool, the transfers, the callback and the loop are the real ones.
"""

import random
import signal

import pytest
import torch
from conftest import micro_config, random_model
from helpers import Collector, FailingModule, loader, requests, trainer_kwargs, waveforms
from host_copies import HostCopies

from omni_lightning import Code2WavModule, Trainer
from omni_lightning.callbacks import AsyncD2HCallback, PinnedPool
from omni_lightning.runner.output import runner_output


@pytest.fixture(scope="module")
def model():
    return random_model(micro_config(), seed=7)


def host_pool() -> PinnedPool:
    return PinnedPool(min_bytes=16, allocate=lambda n: torch.zeros(n, dtype=torch.uint8))


def test_pool_reuses_buffers_of_many_sizes_by_identity():
    pool = host_pool()
    small, big = pool.acquire(16), pool.acquire(100)
    assert (small.numel(), big.numel()) == (16, 128)  # powers of two
    pool.release(small)
    pool.release(big)
    # the only fitting buffer is not the first idle one: `list.remove` compared tensors by value
    # here (16 vs 128 elements) and raised
    again = pool.acquire(50)
    assert again is big and pool.allocations == 2
    assert pool.acquire(8) is small and pool.in_use == 2 and pool.pinned_bytes == 0
    pool.release(again)
    # best fit: the smallest idle buffer that holds the request
    pool.release(pool.acquire(300))
    assert pool.acquire(100) is big
    # identical contents, distinct buffers: each comes back exactly once
    twins = [pool.acquire(1000) for _ in range(3)]
    for t in twins:
        pool.release(t)
    back = [pool.acquire(1000) for _ in range(3)]
    assert sorted(map(id, back)) == sorted(map(id, twins))


def test_pool_random_sizes_never_hands_out_a_buffer_twice():
    pool, rng, held = host_pool(), random.Random(0), []
    for _ in range(300):
        if held and rng.random() < 0.5:
            pool.release(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 5000)
            buf = pool.acquire(n)
            assert buf.numel() >= n and all(buf is not h for h in held)
            held.append(buf)
    assert pool.in_use == len(held)
    assert pool.allocations <= 30  # reuse, not one allocation per acquire
    pool.close()
    assert pool.pinned_bytes == 0


def test_a_runner_output_starts_waits_for_and_releases_its_own_copy():
    copies, pool = HostCopies(), host_pool()
    stream = copies.new_stream(torch.device("cpu"))
    wavs = [torch.randn(1, 50), torch.randn(1, 30)]
    out = runner_output({"req_ids": ["a", "b"]}, {"model_outputs": wavs, "sr": 24000})
    assert out.start_host_copy(stream, pool, copies) and out.in_flight and pool.in_use == 1
    assert not out.start_host_copy(stream, pool, copies)  # one copy per output
    assert not copies.events[0].synchronized  # nothing waited for yet
    payloads = out.finalize().pooler_output
    assert copies.events[0].synchronized and not out.in_flight and out.multimodal_outputs is None
    assert pool.in_use == 0  # the buffer is back: poison it as the next copy would
    pool.acquire(1).fill_(0xFF)
    assert all(torch.equal(p["model_outputs"], w) for p, w in zip(payloads, wavs))  # payloads own their storage
    assert [p["sr"] for p in payloads] == [24000, 24000]
    built = runner_output({"req_ids": ["c"]}, {"model_outputs": [torch.ones(1, 4)]}).finalize()
    assert not built.start_host_copy(stream, pool, copies)  # already built: nothing to copy
    assert not runner_output({"req_ids": ["d"]}, {"sr": 24000}).start_host_copy(stream, pool, copies)  # no tensor


def run(model, d2h, reqs, batch_size=3, **kw):
    trainer = Trainer(**trainer_kwargs(callbacks=[d2h]))
    return trainer.predict(Code2WavModule(model=model), loader(reqs, batch_size), **kw)


def synchronous(model, reqs, batch_size=3):
    trainer = Trainer(**trainer_kwargs(), async_d2h=False)
    return waveforms(trainer.predict(Code2WavModule(model=model), loader(reqs, batch_size)))


def test_mixed_lengths_through_the_trainer_match_the_synchronous_path(model):
    lengths = [random.Random(2).randint(1, 12) for _ in range(10)]
    reqs = requests(lengths, seed=11)
    sync = synchronous(model, reqs)
    copies = HostCopies()
    d2h = AsyncD2HCallback(copies, min_bytes=1024)
    got = waveforms(run(model, d2h, reqs))
    assert got.keys() == sync.keys()
    assert all(torch.equal(got[k], sync[k]) for k in got)  # no NaN: nothing read before its copy landed
    assert d2h.transfers == 4 and len(copies.events) == 4 and all(e.synchronized for e in copies.events)
    assert d2h.pool.in_use == 0 and d2h.pool.allocations <= 4  # batch outputs of 4 sizes, few buffers
    # a second predict, other batch sizes: the pool is reused
    allocations = d2h.pool.allocations
    again, sync = waveforms(run(model, d2h, reqs, batch_size=2)), synchronous(model, reqs, 2)
    assert all(torch.equal(again[k], sync[k]) for k in sync)
    assert d2h.pool.allocations <= allocations + 1 and d2h.pool.in_use == 0


@pytest.mark.parametrize("interval", ["batch", "epoch"])
def test_writer_payloads_own_their_storage_while_buffers_are_reused(model, interval):
    # small, then large batches: the best-fitting idle buffer is not the first idle one
    reqs = requests([2, 1, 12, 10, 11, 12, 12, 9], seed=21)
    sync = synchronous(model, reqs, 2)
    writer, d2h = Collector(interval), AsyncD2HCallback(HostCopies(), min_bytes=1024)
    trainer = Trainer(**trainer_kwargs(callbacks=[d2h, writer]))
    assert trainer.predict(Code2WavModule(model=model), loader(reqs, 2), return_predictions=False) is None
    if interval == "batch":
        got = {r: p["model_outputs"] for _, ids, payloads in writer.batches for r, p in zip(ids, payloads)}
    else:
        got = waveforms(writer.epoch[0])
    # every buffer was reused (and poisoned by the next copies) after its payloads were delivered
    assert d2h.pool.allocations < 4 and all(torch.equal(got[k], sync[k]) for k in sync)


def test_exception_mid_run_frees_the_pool_and_the_next_predict_works(model):
    reqs = requests([12, 3, 10, 7, 2, 5, 9], seed=31)
    copies = HostCopies()
    writer, d2h = Collector("batch"), AsyncD2HCallback(copies, min_bytes=1024)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(RuntimeError):
            Trainer(**trainer_kwargs(callbacks=[d2h, writer])).predict(
                FailingModule(2, model=model), loader(reqs), return_predictions=False
            )
    finally:
        signal.signal(signal.SIGINT, handler)
    assert len(writer.batches) == 2 and all(e.synchronized for e in copies.events)
    assert d2h.pool.in_use == 0 and d2h.pool.pinned_bytes == 0
    # the same callback serves the next run with a fresh pool
    sync = synchronous(model, reqs)
    got = waveforms(run(model, d2h, reqs))
    assert all(torch.equal(got[k], sync[k]) for k in sync) and d2h.pool.open
