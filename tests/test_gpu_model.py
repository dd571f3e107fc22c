"""CUDA-only checks of the kernels and the engine's forward (``pytest -m gpu``; skipped without CUDA)."""

import pytest
import torch
from conftest import random_codes, random_model, reference_model

from omni_lightning import DecodeEngine
from omni_lightning.kernels import Kernels
from omni_lightning.kernels.snake_beta import snake_beta_reference, snake_beta_triton

pytestmark = pytest.mark.gpu  # every test here needs CUDA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snake_beta_kernel_matches_the_reference_on_any_strides(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    for channels in (96, 40, 768):
        base = torch.randn(3, 5000, channels, device="cuda", generator=gen).to(dtype) * 4
        fresh = torch.tensor([True, False, True], device="cuda")
        history = torch.randn(3, 54, channels, device="cuda", generator=gen).to(dtype)
        for x in (base[:, 7:4007], base.transpose(1, 2).contiguous().transpose(1, 2)[:, :4000]):
            la, lb, bias = (torch.randn(channels, device="cuda", generator=gen) * 0.3 for _ in range(3))
            kw = dict(context=history, context_len=54, fresh=fresh, junk=555, multiple=9)
            y, want = snake_beta_triton(x, la, lb, bias, **kw), snake_beta_reference(x, la, lb, bias, **kw)
            assert y.is_contiguous() and y.dtype == dtype and y.shape == want.shape
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert (y.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def test_fast_sine_is_as_accurate_as_libdevice_for_any_argument():
    # the default kernel reduces the argument to [-pi, pi] and uses the GPU's sin.approx
    gen = torch.Generator(device="cuda").manual_seed(2)
    for scale in (1.0, 30.0, 3000.0):
        x = (torch.rand(2, 4096, 64, device="cuda", generator=gen) * 2 - 1) * scale
        la, lb = (torch.randn(64, device="cuda", generator=gen) * 0.5 for _ in range(2))
        xd = x.double()
        want = xd + torch.sin(xd * la.double().exp()) ** 2 / (lb.double().exp() + 1e-9)
        errors = {}
        for precise in (False, True):
            y = snake_beta_triton(x, la, lb, precise=precise).double()
            errors[precise] = float(((y - want).abs() / (1 + want.abs())).max())
        # the argument's own fp32 rounding dominates both at large scales
        assert errors[False] <= 2 * errors[True] + 2e-6, (scale, errors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_unit_matches_the_reference_at_qwen3_omni_widths(dtype, no_tf32):
    """The fused unit (fast sine, tensor-core dots) against the torch reference in fp64, beside the
    layers' own error in ``dtype``: no larger than theirs, plus bf16's rounding of ``h``."""
    from omni_lightning.kernels.residual_unit import residual_unit_reference, residual_unit_triton

    gen = torch.Generator(device="cuda").manual_seed(4)
    for channels, dilation in ((96, 9), (192, 3), (4, 1), (136, 1)):
        rand = lambda *s, scale=1.0: torch.randn(*s, device="cuda", generator=gen) * scale  # noqa: E731
        a, x = rand(2, 6 * dilation + 3001, channels), rand(2, 3001, channels)
        w1 = rand(channels, channels, 7, scale=(7 * channels) ** -0.5).transpose(1, 2).contiguous().transpose(1, 2)
        b1, la, lb = rand(channels, scale=0.1), rand(channels, scale=0.3), rand(channels, scale=0.3)
        w2 = rand(channels, channels, 1, scale=channels**-0.5)
        args = (w1, b1, la, lb, w2)
        want = residual_unit_reference(a.double(), x.double(), *(t.double() for t in args))
        low = [t.to(dtype) for t in (a, x, w1)]
        ours = residual_unit_triton(low[0], low[1].clone(), low[2], b1, la, lb, w2.to(dtype), dilation)
        theirs = residual_unit_reference(low[0], low[1].clone(), low[2], b1, la, lb, w2.to(dtype))
        errors = [float((y.double() - want).norm() / want.norm()) for y in (ours, theirs)]
        assert errors[0] <= 1.5 * errors[1] + (1e-6 if dtype == torch.float32 else 4e-3), (channels, errors)


def test_cuda_forward_matches_transformers_with_either_kernels(no_tf32):
    model = random_model("tiny").cuda()
    ref = reference_model(model).cuda()
    codes = random_codes(3, 37, seed=1).cuda()
    with torch.inference_mode():
        want = ref(codes)
        fused_units = Kernels.for_inference("cuda", fused_units=True)
        for kernels in (Kernels(), Kernels.for_inference("cuda"), fused_units, None):  # None: a plain call's default
            assert (model(codes, kernels=kernels) - want).abs().max() <= 1e-4, kernels


@pytest.mark.parametrize("fused_units", [False, True])
def test_engine_on_cuda_equals_whole_decodes_at_any_length(no_tf32, fused_units):
    model = random_model("tiny", seed=3).cuda()
    lengths = [1, 7, 71, 72, 73, 200, 5]
    codes = random_codes(len(lengths), max(lengths), seed=2).cuda()
    kernels = Kernels.for_inference("cuda", fused_units=fused_units)
    engine = DecodeEngine(model, frames_per_forward=96, max_rows=4, kernels=kernels)
    with torch.inference_mode():
        wavs = engine.decode(codes, lengths)
        for i, n in enumerate(lengths):
            assert (wavs[i] - model(codes[i : i + 1, :, :n])[0]).abs().max() <= 1e-4, n
    assert engine.graphs.stats.captures >= 1 and engine.graphs.stats.replays >= 1


def test_graphs_captured_under_a_hand_written_autocast_read_no_freed_cast():
    """``torch.autocast`` caches casts of the weights by default; a capture must not read one (freed
    when autocast exits), so a replay after other allocations gives the same audio."""
    model = random_model("tiny", seed=4).cuda()
    lengths = [40, 33]
    codes = random_codes(len(lengths), max(lengths), seed=3).cuda()
    engine = DecodeEngine(model, frames_per_forward=96, max_rows=2)
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        first = [w.clone() for w in engine.decode(codes, lengths)]
    junk = [torch.full((1 << 22,), float("nan"), device="cuda") for _ in range(8)]  # reuses freed blocks
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        again = engine.decode(codes, lengths)
    del junk
    assert engine.graphs.stats.replays >= 2
    assert all(torch.equal(a, b) for a, b in zip(first, again))
