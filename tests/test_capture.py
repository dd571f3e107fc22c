"""Whole-budget CUDA graphs under a memory cap, and what a failed capture leaves behind.

On the CPU, ``RecordingCapture`` stands in for ``torch.cuda.graph`` (the engine's bucket choice and
budget are the real code); on CUDA (``-m gpu``) the real capture fails on purpose mid-capture.
"""

import pytest
import torch
from conftest import micro_config, random_codes, random_model
from helpers import RecordingCapture

from omni_lightning import DecodeEngine
from omni_lightning.engine.bucket_graphs import CaptureError
from omni_lightning.engine.cuda_capture import TorchGraphCapture, count_workspace_clears, workspace_clears


@pytest.fixture(scope="module")
def model():
    return random_model(micro_config(sliding_window=6), seed=9)


def test_whole_budget_graphs_under_a_cap_take_half_the_frames_and_stay_exact(model):
    """Under a cap, whole-budget forwards run eagerly by default; ``whole_graphs=True`` captures them
    too, at half the frames (their pool sits beside the eager forwards' blocks), and every request
    still equals its whole decode."""
    lengths = [90, 70, 33, 5]
    codes = random_codes(4, 90, model.config, seed=4)
    budget = 2**24  # the micro model: 128 frames a forward, graphs of up to 16
    got = {}
    for whole in (False, True):
        engine = DecodeEngine(
            model, budget=budget, gpu_memory_utilization=0.5, max_rows=4, capture=RecordingCapture(), whole_graphs=whole
        )
        with torch.inference_mode():
            got[whole] = (engine.decode(codes, lengths), engine)
    eager, graphed = got[False][1], got[True][1]
    assert graphed.frames_per_forward * 2 == eager.frames_per_forward
    whole_shapes = {s for s in graphed.graphs.graphs if s[0] * s[1] == graphed.frames_per_forward}
    assert whole_shapes and not any(s[0] * s[1] > eager.graph_frames for s in eager.graphs.graphs)
    for wavs, _ in got.values():
        for i, n in enumerate(lengths):
            with torch.inference_mode():
                want = model(codes[i : i + 1, :, :n])[0]
            assert (wavs[i] - want).abs().max() <= 1e-5


@pytest.mark.gpu
def test_a_capture_that_fails_mid_capture_leaves_the_stream_and_pool_as_they_were():
    """A forward that breaks its own capture (a synchronize inside it) makes ``capture_end`` raise;
    the caller's stream is current again, nothing routes to the failed pool, and the next capture
    replays what eager computes."""
    from omni_lightning.engine.cuda_capture import TorchGraphCapture

    capture, x = TorchGraphCapture(), torch.randn(64, 64, device="cuda")
    calls = []

    def breaks_its_capture():
        calls.append(1)
        if len(calls) == 2:  # the capture, after its warm-up
            torch.cuda.synchronize()
        return x @ x

    caller = torch.cuda.current_stream()
    with pytest.raises(CaptureError):
        capture(breaks_its_capture)
    assert torch.cuda.current_stream() == caller and len(capture.failed) == 1 and capture.pool is None
    replay, out = capture(lambda: torch.relu(x @ x) + 1)
    x.mul_(0.5)
    replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, torch.relu(x @ x) + 1, rtol=1e-3, atol=1e-3)
    capture.reset()  # workspaces cleared after the device is idle; eager GEMMs go on
    assert torch.allclose((x @ x).sum(), (x.cpu() @ x.cpu()).sum().cuda(), rtol=1e-2)


class PrimedCapture(RecordingCapture):
    """The CPU stand-in, with the real capture's idea of stale graphs: primed when it captures."""

    primed_at = None
    stale = TorchGraphCapture.stale

    def __init__(self):
        super().__init__()
        count_workspace_clears()  # as the real capture does when it is made

    def __call__(self, fn):
        self.primed_at = workspace_clears()
        return super().__call__(fn)


def test_clearing_the_cublas_workspaces_is_counted_however_often_the_wrapper_is_installed():
    count_workspace_clears()
    count_workspace_clears()  # idempotent: one wrapper, one count per call
    before = workspace_clears()
    for _ in range(3):
        torch._C._cuda_clearCublasWorkspaces()
    assert workspace_clears() == before + 3
    capture = TorchGraphCapture()
    assert not capture.stale()  # nothing captured yet
    capture.primed_at = workspace_clears()
    assert not capture.stale()
    torch._C._cuda_clearCublasWorkspaces()
    assert capture.stale()


def test_graphs_recorded_before_a_workspace_clear_are_captured_again_and_stay_exact(model):
    """Lightning's CUDA teardown clears every cuBLAS workspace at the end of each run; a kept engine's
    graphs recorded them, so its next decode drops them and captures again (here the engine with the
    stand-in capture, the clear called as Lightning calls it). Every request still equals its decode."""
    lengths = [40, 17, 3]
    codes = random_codes(3, 40, model.config, seed=5)
    engine = DecodeEngine(model, frames_per_forward=64, max_rows=3, capture=PrimedCapture())
    with torch.inference_mode():
        first = engine.decode(codes, lengths)
        captured = engine.stats()["captures"]
        again = engine.decode(codes, lengths)
        assert engine.stats()["captures"] == captured  # nothing cleared: the graphs replay
        torch._C._cuda_clearCublasWorkspaces()
        third = engine.decode(codes, lengths)
    assert engine.stats()["captures"] == 2 * captured
    for i, (a, b, c, n) in enumerate(zip(first, again, third, lengths)):
        torch.testing.assert_close(a, model.decode(codes[i : i + 1, :, :n])[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.gpu
def test_a_kept_engine_survives_lightnings_end_of_run_cleanup():
    """Two predicts with one module on CUDA (the real architecture, bf16): the engine is kept, Lightning's
    teardown frees the cuBLAS workspaces its graphs recorded, and the second predict captures again
    instead of replaying into freed memory (it died with "unspecified launch failure" on an H200)."""
    from helpers import trainer_kwargs

    from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, Trainer

    big = Code2Wav("qwen3-omni").eval()
    module = Code2WavModule(model=big, frames_per_forward=1024)
    reqs = {f"r{i}": random_codes(1, 25 + 13 * i, big.config, seed=i)[0] for i in range(8)}  # 2-9 s, mixed
    outs = []
    for _ in range(2):
        trainer = Trainer(**trainer_kwargs(accelerator="cuda", precision="bf16-true"))
        preds = trainer.predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=8))
        outs.append({r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)})
        assert module.engine_stats["captures"] >= 1 and module.engine_stats["eager"] == 0, module.engine_stats
    assert sorted(outs[0]) == sorted(outs[1]) == sorted(reqs)
    for r in reqs:  # the second plan may pick other shapes (bf16: other kernels, other roundings); a request
        # misplaced or decoded from freed memory would be off by ~100 %, as in tests/test_gpu_predict.py
        a, b = outs[0][r].float(), outs[1][r].float()
        assert a.shape == b.shape and float((a - b).norm() / b.norm()) <= 1e-1, r
