"""AsyncD2HCallback: same outputs with and without it, on the CPU (no-op) and on CUDA (copy stream)."""

import logging
import signal

import pytest
import torch
from conftest import random_model
from helpers import Collector, FailingModule, loader, requests, trainer_kwargs, waveforms

from omni_lightning import Code2WavModule, OmniModelRunnerOutput, Trainer
from omni_lightning.callbacks import AsyncD2HCallback

cuda = pytest.mark.gpu
ACCELERATORS = ["cpu", pytest.param("cuda", marks=cuda)]


@pytest.fixture(scope="module")
def model():
    return random_model("tiny", seed=5)


def run(model, accelerator, callbacks=(), dataloaders=None, module=None, **predict_kw):
    kw = trainer_kwargs(callbacks=list(callbacks))
    kw["accelerator"] = accelerator
    trainer = Trainer(**kw, async_d2h=False)  # the callback only where a test passes one
    module = module or Code2WavModule(model=model)
    return trainer.predict(module, dataloaders or loader(requests()), **predict_kw)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_identical_outputs_with_and_without_the_callback(model, accelerator):
    plain = waveforms(run(model, accelerator))
    d2h = AsyncD2HCallback()
    d2h.close()  # a pool of its own for this test (the process's shared pool may hold earlier tests' buffers)
    d2h = AsyncD2HCallback()
    with_cb = waveforms(run(model, accelerator, [d2h]))
    assert plain.keys() == with_cb.keys()
    assert all(torch.equal(plain[k], with_cb[k]) for k in plain)
    assert d2h.transfers == (3 if accelerator == "cuda" else 0)
    # every buffer is back in the pool, which stays small and allocates nothing on a second run
    assert d2h.pool.in_use == 0 and d2h.pool.allocations <= 3
    allocations = d2h.pool.allocations
    again = waveforms(run(model, accelerator, [d2h]))
    assert all(torch.equal(plain[k], again[k]) for k in plain)
    assert d2h.pool.allocations == allocations
    # a new callback (a Trainer made per call) uses the same buffers: no pinned allocation either
    other = AsyncD2HCallback()
    assert other.pool is d2h.pool
    again = waveforms(run(model, accelerator, [other]))
    assert all(torch.equal(plain[k], again[k]) for k in plain)
    assert other.pool.allocations == allocations
    d2h.close()
    assert d2h.pool.pinned_bytes == 0
    assert AsyncD2HCallback().pool is not d2h.pool and AsyncD2HCallback().pool.open  # closed: a new one


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("interval", ["batch", "epoch"])
def test_writer_and_no_return_predictions(model, accelerator, interval):
    reference = waveforms(run(model, accelerator))  # the synchronous path on the same device
    writer = Collector(interval)
    assert run(model, accelerator, [AsyncD2HCallback(), writer], return_predictions=False) is None
    if interval == "batch":
        got = {r: p["model_outputs"] for _, ids, payloads in writer.batches for r, p in zip(ids, payloads)}
    else:
        got = waveforms(writer.epoch[0])
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k]) for k in got)
    assert all(w.device.type == "cpu" for w in got.values())


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_multiple_dataloaders(model, accelerator):
    dls = [loader(requests([3, 8, 2]), 2), loader(requests([11, 4], seed=50), 2)]
    plain = run(model, accelerator, dataloaders=dls)
    dls = [loader(requests([3, 8, 2]), 2), loader(requests([11, 4], seed=50), 2)]
    with_cb = run(model, accelerator, [AsyncD2HCallback()], dataloaders=dls)
    assert [len(p) for p in with_cb] == [2, 1]
    a, b = waveforms(plain), waveforms(with_cb)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_exception_in_a_later_step_keeps_delivered_outputs(model, accelerator, exc, caplog):
    caplog.set_level(logging.INFO)  # Lightning's info lines (under pytest they go to the root logger's handlers)
    reference = waveforms(run(model, accelerator))
    writer, d2h = Collector("batch"), AsyncD2HCallback()
    kw = trainer_kwargs(callbacks=[d2h, writer])
    kw["accelerator"] = accelerator
    handler = signal.getsignal(signal.SIGINT)
    try:
        # Lightning turns a KeyboardInterrupt into a graceful shutdown and sys.exit(1)
        with pytest.raises(SystemExit if exc is KeyboardInterrupt else RuntimeError):
            Trainer(**kw).predict(FailingModule(2, exc, model=model), loader(requests()), return_predictions=False)
    finally:
        signal.signal(signal.SIGINT, handler)
    assert "Detected KeyboardInterrupt" not in caplog.text  # Lightning's line, in Python too: the user knows
    delivered = {r: p["model_outputs"] for _, ids, payloads in writer.batches for r, p in zip(ids, payloads)}
    assert sorted(delivered) == sorted(list(reference)[:6])  # batches 0 and 1, nothing lost
    assert all(torch.equal(delivered[k], reference[k]) for k in delivered)
    assert d2h.pool.pinned_bytes == 0 and d2h.pool.in_use == 0  # closed on the exception


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_empty_dataloader(model, accelerator):
    kw = trainer_kwargs(callbacks=[AsyncD2HCallback()])
    kw["accelerator"] = accelerator
    assert Trainer(**kw).predict(Code2WavModule(model=model), loader({})) is None


@cuda
def test_cuda_outputs_bit_identical_to_synchronous_path(model):
    plain = waveforms(run(model, "cuda"))
    d2h = AsyncD2HCallback()
    preds = run(model, "cuda", [d2h])
    assert all(isinstance(o, OmniModelRunnerOutput) and not o.in_flight for o in preds)
    got = waveforms(preds)
    assert all(torch.equal(plain[k], got[k]) for k in plain)
    assert d2h.pool.allocations <= 3  # reused, not one pinned allocation per step


@cuda
def test_copies_run_on_the_copy_stream_overlapping_compute():
    from torch.profiler import ProfilerActivity, profile

    from omni_lightning import Code2Wav

    # enough GPU work per step (the real architecture, bf16) that compute is what the copies hide under
    big = Code2Wav("qwen3-omni").to("cuda", torch.bfloat16).eval()
    module = Code2WavModule(model=big)  # one module: the warm-up captures its CUDA graphs
    reqs = requests([125] * 24)
    run(big, "cuda", [AsyncD2HCallback()], dataloaders=loader(reqs, 8), module=module, return_predictions=False)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run(big, "cuda", [AsyncD2HCallback()], dataloaders=loader(reqs, 8), module=module,
            return_predictions=False)  # fmt: skip
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # the waveforms' copies into the pinned pool (Lightning makes a few small pageable ones of its own)
    copies = [e for e in events if "DtoH" in e.name and "Pinned" in e.name]
    kernels = [e for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    assert len(copies) >= 24 and kernels, sorted({e.name for e in events if "Memcpy" in e.name})
    compute_streams = {e.device_resource_id for e in kernels}
    # the waveforms' copies run on their own stream (a few stray pinned copies may be Lightning's or
    # the profiler's own; 24 are ours, one per request)
    ours = [c for c in copies if c.device_resource_id not in compute_streams]
    by_stream = {s: sum(c.device_resource_id == s for c in copies) for s in {c.device_resource_id for c in copies}}
    assert len(ours) >= 24, (by_stream, compute_streams)
    # and the copies run while the next step's kernels run
    overlapping = [
        c for c in ours
        if any(k.time_range.start < c.time_range.end and c.time_range.start < k.time_range.end for k in kernels)
    ]  # fmt: skip
    assert len(overlapping) >= 8, f"{len(overlapping)} of {len(ours)} copies overlap compute"
