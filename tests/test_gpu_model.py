"""CUDA-only checks of the model (skipped without a GPU; run on an H200 through the device tool)."""

import pytest
import torch
from conftest import random_codes, random_model, reference_model

from omni_lightning.models import fused

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_snake_beta_matches_the_formula(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 40, 5000, device="cuda", generator=gen).to(dtype) * 4
    x = x[..., 7:4007]  # a strided view, as the causal conv hands it over
    alpha = torch.rand(40, device="cuda", generator=gen) + 0.5
    inv_beta = torch.rand(40, device="cuda", generator=gen) + 0.5
    y = fused.snake_beta(x, alpha, inv_beta)
    xf = x.float()
    want = xf + inv_beta[:, None] * torch.sin(xf * alpha[:, None]) ** 2
    assert y.is_contiguous() and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (y.float() - want).abs().max() <= tol * want.abs().max()


@cuda
def test_cuda_model_matches_transformers_and_unfused(monkeypatch):
    # fp32 means fp32 here: cuDNN and cuBLAS would otherwise round inputs to TF32
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = random_model("tiny").cuda()
    ref = reference_model(model).cuda()
    lengths = [37, 5, 1]
    codes = random_codes(3, 37, seed=1).cuda()
    with torch.inference_mode():
        ours = model(codes)
        assert (ours - ref(codes)).abs().max() <= 1e-4
        assert (ours - model.set_fused_kernels(False)(codes)).abs().max() <= 1e-4
        model.set_fused_kernels(True)
        batched = model.decode(codes, torch.tensor(lengths))
        for i, n in enumerate(lengths):
            assert (batched[i] - model(codes[i : i + 1, :, :n])[0]).abs().max() <= 1e-4


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_time_major_snake_beta_adds_the_bias_on_any_strides(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    for channels in (96, 40):
        base = torch.randn(3, 5000, channels, device="cuda", generator=gen).to(dtype) * 4
        for x in (base[:, 7:4007], base.transpose(1, 2).contiguous().transpose(1, 2)[:, :4000]):
            log_alpha, log_beta, bias = (torch.randn(channels, device="cuda", generator=gen) * 0.3 for _ in range(3))
            y = fused.snake_beta_tc(x, log_alpha, log_beta, bias)
            xf = x.float() + bias
            want = xf + torch.sin(xf * log_alpha.exp()) ** 2 / (log_beta.exp() + 1e-9)
            assert y.is_contiguous() and y.dtype == dtype and y.shape == x.shape
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert (y.float() - want).abs().max() <= tol * want.abs().max()


@cuda
def test_fast_sine_is_as_accurate_as_libdevice_for_any_argument():
    # the default kernels reduce the argument to [-pi, pi] and use the GPU's sin.approx
    gen = torch.Generator(device="cuda").manual_seed(2)
    for scale in (1.0, 30.0, 3000.0):
        x = (torch.rand(2, 4096, 64, device="cuda", generator=gen) * 2 - 1) * scale
        log_alpha, log_beta = (torch.randn(64, device="cuda", generator=gen) * 0.5 for _ in range(2))
        xd = x.double()
        want = xd + torch.sin(xd * log_alpha.double().exp()) ** 2 / (log_beta.double().exp() + 1e-9)
        errors = {}
        for precise in (False, True):
            y = fused.snake_beta_tc(x, log_alpha, log_beta, precise=precise).double()
            errors[precise] = float(((y - want).abs() / (1 + want.abs())).max())
        # the argument's own fp32 rounding dominates both at large scales
        assert errors[False] <= 2 * errors[True] + 2e-6, (scale, errors)


@cuda
def test_fast_decoder_matches_the_layers_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = random_model("tiny", seed=3).cuda()
    codes = random_codes(3, 40, seed=2).cuda()
    with torch.inference_mode():
        fast = model(codes)
        model.fast_decoder = False
        layers = model(codes)
        model.fast_decoder = True
    assert (fast - layers).abs().max() <= 1e-4
