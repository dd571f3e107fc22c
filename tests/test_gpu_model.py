"""CUDA-only checks of the kernels and the engine's forward (``pytest -m gpu``; skipped without CUDA)."""

import dataclasses

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conv_snake_matches_the_reference_at_qwen3_omni_widths(dtype, no_tf32):
    """The fused convolution + SnakeBeta (tensor-core dots, fast sine) against the torch reference in
    fp64, beside the layers' own error in ``dtype`` (cuDNN, then SnakeBeta): no larger than theirs."""
    from omni_lightning.kernels.conv_snake import conv_snake_reference, conv_snake_triton

    gen = torch.Generator(device="cuda").manual_seed(4)
    rand = lambda *s, scale=1.0: torch.randn(*s, device="cuda", generator=gen) * scale  # noqa: E731
    for channels, dilation, length in ((96, 9, 3001), (192, 3, 3001), (192, 1, 77), (64, 1, 5)):
        a = rand(2, 6 * dilation + length + 4, channels)
        w = rand(channels, channels, 7, scale=(7 * channels) ** -0.5)
        b, la, lb = rand(channels, scale=0.1), rand(channels, scale=0.3), rand(channels, scale=0.3)
        want = conv_snake_reference(a.double(), w.double(), b.double(), la.double(), lb.double(), dilation, length)
        low = a.to(dtype), w.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ours = conv_snake_triton(*low, b, la, lb, dilation, length)
        theirs = conv_snake_reference(*low, b, la, lb, dilation, length)
        errors = [float((y.double() - want).norm() / want.norm()) for y in (ours, theirs)]
        assert errors[0] <= 1.1 * errors[1] + 1e-4, (channels, dilation, errors)


def _gradients(op, inputs, args, grad, dtype):
    """``op(*inputs, *args)``'s gradients of every input (all cast to ``dtype``) for the output gradient ``grad``."""
    leaves = [x.to(dtype).requires_grad_() for x in inputs]
    out = op(*leaves, *args)
    return torch.autograd.grad(out, leaves, grad.to(out.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conv_snake_backward_matches_the_reference_at_qwen3_omni_widths(dtype, no_tf32):
    """The fused convolution's gradients (the convolution recomputed, SnakeBeta's backward as its epilogue,
    cuDNN's dgrad and wgrad) against the reference's autograd in fp64, beside the layers' own error in
    ``dtype`` (the reference's autograd in ``dtype``): no larger than theirs, for every input."""
    from omni_lightning.kernels.conv_snake import conv_snake_reference, conv_snake_triton_autograd

    gen = torch.Generator(device="cuda").manual_seed(6)
    rand = lambda *s, scale=1.0: torch.randn(*s, device="cuda", generator=gen) * scale  # noqa: E731
    for channels, dilation, length in ((96, 9, 3001), (192, 3, 3003), (192, 1, 77)):
        a = rand(2, 6 * dilation + length, channels)
        w = rand(channels, channels, 7, scale=(7 * channels) ** -0.5)
        params = rand(channels, scale=0.1), rand(channels, scale=0.3), rand(channels, scale=0.3)
        g = rand(2, length, channels)
        inputs, args = (a, w, *params), (dilation, length)
        want = _gradients(conv_snake_reference, inputs, args, g, torch.float64)
        ours = _gradients(conv_snake_triton_autograd, inputs, args, g, dtype)
        for i, (x, y) in enumerate(zip(ours, _gradients(conv_snake_reference, inputs, args, g, dtype))):
            errors = [float((z.double() - want[i]).norm() / want[i].norm()) for z in (x, y)]
            assert errors[0] <= 1.1 * errors[1] + 1e-3, (channels, dilation, i, errors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_leaky_relu_matches_the_reference_on_cuda(dtype):
    """The discriminators' fused bias + leaky ReLU, forward and backward, against torch's in fp32 (bias in
    fp32, as the mixed precisions hold it; an output gradient in another layout)."""
    from omni_lightning.kernels.bias_leaky_relu import bias_leaky_relu_reference, bias_leaky_relu_triton

    gen = torch.Generator(device="cuda").manual_seed(7)
    for shape in ((4, 32, 3001, 5), (2, 128, 375, 129), (3, 8, 999, 1)):
        x = torch.randn(*shape, device="cuda", generator=gen).to(dtype, memory_format=torch.channels_last)
        bias, grad = torch.randn(shape[1], device="cuda", generator=gen), torch.randn(*shape, device="cuda").to(dtype)
        results = []  # the reference in fp32: in bf16 its own sum x + bias flips the sign of values near 0
        for op, cast in ((bias_leaky_relu_reference, torch.float32), (bias_leaky_relu_triton, dtype)):
            leaves = [x.to(cast).requires_grad_(), bias.clone().requires_grad_()]
            y = op(*leaves, 0.1)
            results.append((y.float(), *(g.float() for g in torch.autograd.grad(y, leaves, grad.to(cast)))))
        for i, (want, got) in enumerate(zip(*results)):
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert float((want - got).norm() / want.norm()) <= tol, (shape, i)


def test_cuda_forward_matches_transformers_with_either_kernels(no_tf32):
    model = random_model("tiny").cuda()
    ref = reference_model(model).cuda()
    codes = random_codes(3, 37, seed=1).cuda()
    with torch.inference_mode():
        want = ref(codes)
        layers = dataclasses.replace(Kernels.for_inference("cuda"), conv_snake=None)
        for kernels in (Kernels(), Kernels.for_inference("cuda"), layers, None):  # None: a plain call's default
            assert (model(codes, kernels=kernels) - want).abs().max() <= 1e-4, kernels


@pytest.mark.parametrize("conv_snake", [False, True])
def test_engine_on_cuda_equals_whole_decodes_at_any_length(no_tf32, conv_snake):
    model = random_model("tiny", seed=3).cuda()
    lengths = [1, 7, 71, 72, 73, 200, 5]
    codes = random_codes(len(lengths), max(lengths), seed=2).cuda()
    kernels = Kernels.for_inference("cuda")
    kernels = kernels if conv_snake else dataclasses.replace(kernels, conv_snake=None)
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


def test_bf16_engine_with_fused_convolutions_is_as_faithful_as_the_layers():
    """bf16 decodes (the engine: chunks, state, graphs) against the fp32 reference, on a model wide
    enough that the fused convolution + SnakeBeta runs (128-32 channels): its error is no larger than
    the layers' (cuDNN, then SnakeBeta) on the same engine path."""
    from omni_lightning import Code2WavConfig
    from omni_lightning.models.code2wav import REFERENCE

    config = Code2WavConfig.from_name("tiny", name="wide", decoder_dim=256)
    model = random_model(config, seed=5).cuda()
    lengths = [3, 60, 151, 97]
    codes = random_codes(len(lengths), max(lengths), config, seed=6).cuda()
    with torch.inference_mode():
        want = [model(codes[i : i + 1, :, :n], kernels=REFERENCE)[0].double() for i, n in enumerate(lengths)]
        low = random_model(config, seed=5).cuda().to(torch.bfloat16)
        fused = Kernels.for_inference("cuda")
        errors = {}
        for name, kernels in (("fused", fused), ("layers", dataclasses.replace(fused, conv_snake=None))):
            engine = DecodeEngine(low, frames_per_forward=128, max_rows=4, kernels=kernels)
            wavs = engine.decode(codes, lengths)
            errors[name] = max(float((w.double() - r).norm() / r.norm()) for w, r in zip(wavs, want))
            engine.close()
    assert errors["fused"] <= 1.1 * errors["layers"] + 1e-3, errors
