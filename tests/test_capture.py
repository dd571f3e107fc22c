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
