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


# The overlap test's job: 24 requests of 10 s in batches of 8, a frame budget of one batch (8 x 128 frames), so
# each step is one whole-budget forward, replayed as a CUDA graph once the first predict captured it. A forward
# launched eagerly takes the host about as long as the GPU takes to run it (qwen3-omni, 8 rows, under the
# profiler); a host that falls behind launches the next step only after the copies ran on an idle GPU (0 of 24
# overlapped on an H100 in the suite's order, with the default budget's 2,048 frames: 8 x 128 is then neither a
# whole-budget nor a short forward, so it ran eagerly).
OVERLAP_JOB = {"lengths": [125] * 24, "batch_size": 8, "frames_per_forward": 1024}


def overlap_job(module, accelerator):
    from omni_lightning.data import CodesDataModule

    reqs = requests(OVERLAP_JOB["lengths"])
    data = CodesDataModule(predict=reqs, batch_size=OVERLAP_JOB["batch_size"])  # a job's own loader: pinned on CUDA
    kw = trainer_kwargs(accelerator=accelerator, callbacks=[AsyncD2HCallback()])
    Trainer(**kw).predict(module, datamodule=data, return_predictions=False)


def test_the_overlap_tests_steps_are_graph_replays_once_captured():
    """The GPU overlap test's premise, on the CPU (the engine plans in frames, whatever the model; a
    stand-in capture): each batch of its job is one forward of the whole budget, replayed as a graph
    after the first, never run eagerly."""
    from helpers import RecordingCapture

    from omni_lightning import Code2Wav, Code2WavConfig, DecodeEngine

    narrow = dict(upsampling_ratios=(1,), upsample_rates=(2,), decoder_dim=16, hidden_size=32, num_hidden_layers=1)
    model = Code2Wav(Code2WavConfig.from_name("tiny", intermediate_size=32, **narrow)).eval()
    batch = list(requests(OVERLAP_JOB["lengths"][: OVERLAP_JOB["batch_size"]]).values())
    engine = DecodeEngine(model, frames_per_forward=OVERLAP_JOB["frames_per_forward"], capture=RecordingCapture())
    with torch.inference_mode():
        for _ in range(2):
            engine.decode(torch.stack(batch), [c.shape[-1] for c in batch])
    stats = engine.stats()
    assert (stats["forwards"], stats["captures"], stats["replays"], stats["eager"]) == (2, 1, 2, 0), stats


@cuda
def test_copies_run_on_the_copy_stream_overlapping_compute():
    from torch.profiler import ProfilerActivity, profile

    from omni_lightning import Code2Wav

    # enough GPU work per step (the real architecture, bf16) that compute is what the copies hide under
    big = Code2Wav("qwen3-omni").to("cuda", torch.bfloat16).eval()
    module = Code2WavModule(model=big, frames_per_forward=OVERLAP_JOB["frames_per_forward"])
    overlap_job(module, "cuda")  # one module: this first predict captures its CUDA graph
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        overlap_job(module, "cuda")
    assert module.engine_stats["eager"] == 0, module.engine_stats  # each step one replay: the host runs ahead
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
