"""The Triton SnakeBeta kernels' index and mask logic and the backward's arithmetic, run by Triton's
interpreter on the CPU (and, at the end, the fused convolution + SnakeBeta forward and backward, and the
discriminators' bias + leaky ReLU, the same way).

``TRITON_INTERPRET=1`` (set in a subprocess, before Triton is imported) runs ``@triton.jit`` kernels
on CPU tensors with NumPy, so every machine checks the launchers and kernels against the torch
reference (``kernels/snake_beta.py``): history rows (given or zero), the snake part with a bias,
junk rows of fresh batch rows (all or per row), zero padding to a multiple, strided inputs (a
convolution's output is a view), channel counts that are not multiples of the tiles. The backward
(the autograd function) against the reference's autograd, itself checked by ``gradcheck`` in fp64:
every gradient (``x``, ``log_alpha``, ``log_beta``, ``bias``, the history), strided inputs and output
gradients, several row tiles per program, fp32 and bf16. Not checked here: the fast sine and cosine
(inline PTX has no interpreter; ``precise=True`` runs libdevice's instead, and the CUDA tests check
the fast ones) and the speed.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from omni_lightning.kernels.snake_beta import snake_beta_reference

SCRIPT = textwrap.dedent(
    """
    import torch
    from omni_lightning.kernels.snake_beta import snake_beta_reference, snake_beta_triton

    gen = torch.Generator().manual_seed(0)
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale
    cases = 0
    for channels, length, batch in ((96, 70, 2), (192, 33, 1), (40, 9, 3)):
        x = rand(batch, length + 5, channels)[:, :length]  # strided, as a convolution's output view
        la, lb, bias = rand(channels, scale=0.3), rand(channels, scale=0.3), rand(channels, scale=0.1)
        for context_len, history, fresh, junk, multiple in (
            (0, False, False, 0, 1), (6, True, torch.tensor([True, False, True][:batch]), 5, 9),
            (6, True, torch.tensor([0, 1, 1][:batch]), 5, 1),  # int64 flags, one byte per row in the kernel
            (1, False, True, 3, 1), (18, True, False, 4, 3),
        ):
            ctx = rand(batch, context_len, channels) if history else None
            kw = dict(context=ctx, context_len=context_len, fresh=fresh, junk=junk, multiple=multiple)
            b = None if context_len == 1 else bias  # with and without a bias (one kernel serves both)
            want = snake_beta_reference(x, la, lb, b, **kw)
            got = snake_beta_triton(x, la, lb, b, precise=True, block_c=32, **kw)
            assert got.shape == want.shape and got.shape[1] % multiple == 0, (got.shape, want.shape)
            assert float((got - want).abs().max()) < 1e-5, (channels, context_len, junk)
            cases += 1
    print("kernels ok", cases)
    """
)


BACKWARD = textwrap.dedent(
    """
    import torch
    from omni_lightning.kernels.snake_beta import (
        snake_beta_reference, snake_beta_triton_autograd, snake_beta_triton_backward,
    )

    gen = torch.Generator().manual_seed(1)
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale
    cases = 0
    # (channels, length, batch, block_c): tiles narrower than the channels, and the default tile
    for channels, length, batch, block_c in ((40, 37, 3, 16), (96, 20, 2, None), (200, 11, 2, None)):
        for bias_on, context_len, history, fresh, junk, multiple, dtype in (
            (False, 0, False, False, 0, 1, torch.float32),
            (True, 6, True, torch.tensor([True, False, True][:batch]), 5, 9, torch.float32),
            (True, 1, False, True, 3, 1, torch.float32),
            (True, 18, True, False, 4, 3, torch.bfloat16),
        ):
            base = rand(batch, length + 5, channels, scale=2.0).to(dtype)
            x = base[:, 3 : 3 + length]  # strided, as a convolution's output view
            params = [rand(channels, scale=0.3) for _ in range(2)] + [rand(channels, scale=0.1)] * bias_on
            ctx = rand(batch, context_len, channels).to(dtype) if history else None
            kw = dict(context_len=context_len, fresh=fresh, junk=junk, multiple=multiple)
            grads = {}
            for name, op in (("ref", snake_beta_reference), ("triton", snake_beta_triton_autograd)):
                leaves = [t.detach().clone().requires_grad_() for t in [x, *params] + ([ctx] if history else [])]
                inputs = [leaves[0], *leaves[1 : 1 + len(params)]] + ([None] if not bias_on else [])
                extra = dict(precise=True, block_c=block_c) if name == "triton" else {}
                out = op(*inputs, context=leaves[-1] if history else None, **kw, **extra)
                g = rand(*out.shape[::-1]).to(dtype).transpose(0, 2) if name == "ref" else g  # strided, as autograd's
                grads[name] = (out.detach(), torch.autograd.grad(out, leaves, g))
            (want_out, want), (got_out, got) = grads["ref"], grads["triton"]
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert float((got_out.float() - want_out.float()).abs().max()) <= tol * 10, (channels, context_len)
            for i, (a, b) in enumerate(zip(want, got)):
                assert a.shape == b.shape and a.dtype == b.dtype, (i, a.shape, b.shape, a.dtype, b.dtype)
                error = float((a.float() - b.float()).abs().max()) / max(float(a.float().abs().max()), 1e-6)
                assert error <= tol, (channels, length, context_len, junk, dtype, i, error)
            if junk and fresh is not False:  # junk rows of fresh batch rows: no gradient reaches x
                rows = fresh if isinstance(fresh, torch.Tensor) else torch.ones(batch, dtype=torch.bool)
                assert float(got[0][rows, :junk].abs().max()) == 0.0 and float(got[0][rows, junk:].abs().max()) > 0
            cases += 1
    # several row tiles per program (9 tiles of 128 rows, 3 programs a row), a non-contiguous output gradient
    x, la, lb, bias = rand(2, 1100, 24), rand(24, scale=0.3), rand(24, scale=0.3), rand(24, scale=0.1)
    leaves = [t.clone().requires_grad_() for t in (x, la, lb, bias)]
    out = snake_beta_reference(*leaves, context_len=3, fresh=True, junk=7, multiple=9)
    g = rand(*out.shape[::-1]).transpose(0, 2)
    want = torch.autograd.grad(out, leaves, g)
    got = snake_beta_triton_backward(g, x, la, lb, bias, context_len=3, fresh=True, junk=7, precise=True,
                                     block_c=16, programs=3)
    for a, b in zip(want, got):
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max()), float((a - b).abs().max())
    # x without a gradient (a frozen layer before it): the parameters' gradients alone
    x, la, lb = rand(2, 9, 24), rand(24).requires_grad_(), rand(24).requires_grad_()
    d_alpha = torch.autograd.grad(snake_beta_triton_autograd(x, la, lb, precise=True).sum(), la)[0]
    assert torch.allclose(d_alpha, torch.autograd.grad(snake_beta_reference(x, la, lb).sum(), la)[0], atol=1e-4)
    print("backward ok", cases)
    """
)


def run_interpreted(script: str) -> subprocess.CompletedProcess:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)


def test_snake_beta_kernel_in_the_triton_interpreter_equals_the_torch_reference():
    done = run_interpreted(SCRIPT)
    assert done.returncode == 0 and "kernels ok 15" in done.stdout, done.stderr[-3000:]


def test_snake_beta_reference_gradients_pass_gradcheck():
    # the reference whose autograd the Triton backward is checked against, in fp64: every input
    # differentiable, junk rows of some batch rows zeroed, history and padding rows
    gen = torch.Generator().manual_seed(2)
    x, la, lb, bias = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((3, 7, 5), (5,), (5,), (5,)))
    ctx = torch.randn(3, 2, 5, generator=gen, dtype=torch.float64)
    fresh = torch.tensor([True, False, True])
    for t in (x, la, lb, bias, ctx):
        t.requires_grad_()
    op = lambda *a: snake_beta_reference(*a[:4], context=a[4], context_len=2, fresh=fresh, junk=3, multiple=4)
    assert torch.autograd.gradcheck(op, (x, la, lb, bias, ctx))


def test_snake_beta_backward_in_the_triton_interpreter_equals_the_references_autograd():
    done = run_interpreted(BACKWARD)
    if done.returncode and "only 0-dimensional arrays can be converted to Python scalars" in done.stderr:
        # Triton 3.6's interpreter holds scalars as 1-element arrays, which numpy >= 2.4 will not turn
        # into an int (the backward loops over a runtime count); Triton 3.8's interpreter runs it
        import numpy
        import triton

        pytest.skip(
            f"Triton {triton.__version__}'s interpreter cannot loop over a runtime bound under "
            f"numpy {numpy.__version__}"
        )
    assert done.returncode == 0 and "backward ok 12" in done.stdout, done.stderr[-3000:]


CONV_SNAKE = textwrap.dedent(
    """
    import functools
    import torch
    from omni_lightning.kernels import Kernels
    from omni_lightning.kernels.conv_snake import Tiles, conv_snake_reference, conv_snake_triton, launch_tiles
    from omni_lightning.kernels.snake_beta import snake_beta_reference
    from omni_lightning.models.code2wav import REFERENCE
    from omni_lightning import Code2Wav, Code2WavConfig, randomize_weights

    gen = torch.Generator().manual_seed(3)
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale
    cases = 0
    # (c_in, c_out, length, batch, dilation, padding rows): the launcher's own tiles at 96 and 192
    # channels (one and two parts of N), rows past the length, a row tile cut by the length
    for c_in, c_out, length, batch, dilation, pad in ((96, 96, 70, 2, 3, 5), (192, 192, 33, 1, 9, 0),
                                                      (32, 48, 20, 3, 1, 2), (64, 64, 130, 1, 1, 0)):
        context = 6 * dilation
        a = rand(batch, context + length + pad, c_in)
        w = rand(c_out, c_in, 7, scale=(7 * c_in) ** -0.5)
        for weight in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):  # as given, as the engine holds it
            b, la, lb = rand(c_out, scale=0.1), rand(c_out, scale=0.3), rand(c_out, scale=0.3)
            want = conv_snake_reference(a, weight, b, la, lb, dilation, length)
            t = launch_tiles(c_in, c_out)
            tiles = Tiles(64, t.block_n, t.block_n2, t.block_k, t.num_warps, 1)  # fewer rows: a faster interpreter
            got = conv_snake_triton(a, weight, b, la, lb, dilation, length, tiles=tiles, precise=True)
            error = float((got - want).norm() / want.norm())
            assert got.shape == want.shape and error < 1e-5, (c_in, c_out, dilation, error)
            cases += 1
    # the model: whole requests and a stateful chunked decode, the fused convolutions against the layers
    micro = Code2WavConfig.from_name("tiny", name="micro", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, intermediate_size=32, decoder_dim=128)
    model = randomize_weights(Code2Wav(micro), seed=4).eval()
    small = functools.partial(conv_snake_triton, precise=True)
    fused = Kernels(snake_beta_reference, inplace=True, name="fused", conv_snake=small,
                    conv_snake_dtypes=(torch.float32,))
    codes = torch.randint(0, 2048, (2, 16, 3), generator=gen)
    with torch.no_grad():
        want = model(codes, kernels=REFERENCE)
        got = model(codes, kernels=fused)
        assert float((got - want).abs().max()) < 1e-5, float((got - want).abs().max())
        state = model.new_state(2)
        pieces = [model(codes[..., s : s + 2], state, kernels=fused) for s in (0, 2)]
        chunked = torch.cat(pieces, -1)[..., model.config.tail :]
        assert float((chunked - want).abs().max()) < 1e-5, float((chunked - want).abs().max())
    cases += 1
    print("conv snake ok", cases)
    """
)


def test_conv_snake_in_the_triton_interpreter_equals_the_layers():
    # fp32 only: Triton 3.8's interpreter gets bf16 dots wrong (the CUDA tests check bf16)
    done = run_interpreted(CONV_SNAKE)
    assert done.returncode == 0 and "conv snake ok 9" in done.stdout, done.stderr[-3000:]


CONV_SNAKE_BACKWARD = textwrap.dedent(
    """
    import torch
    from omni_lightning.kernels.conv_snake import conv_snake_reference, conv_snake_triton_autograd

    gen = torch.Generator().manual_seed(5)
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale
    cases = 0
    # (c_in, c_out, length, batch, dilation, padding rows): a dilation folded for cuDNN (rows a multiple of
    # it) and not (padding rows), two parts of N and one, a row tile cut by the length
    for c_in, c_out, length, batch, dilation, pad in ((96, 96, 40, 2, 3, 3), (32, 48, 20, 2, 1, 2),
                                                      (64, 64, 30, 1, 9, 0)):
        a = rand(batch, 6 * dilation + length + pad, c_in)
        w = rand(c_out, c_in, 7, scale=(7 * c_in) ** -0.5)
        params = rand(c_out, scale=0.1), rand(c_out, scale=0.3), rand(c_out, scale=0.3)
        g = rand(batch, c_out, length).transpose(1, 2)  # strided, as autograd hands it
        grads = {}
        for name, op in (("ref", conv_snake_reference), ("triton", conv_snake_triton_autograd)):
            leaves = [x.clone().requires_grad_() for x in (a, w, *params)]
            extra = dict(precise=True) if name == "triton" else {}
            out = op(*leaves, dilation, length, **extra)
            grads[name] = (out.detach(), torch.autograd.grad(out, leaves, g))
        (want_out, want), (got_out, got) = grads["ref"], grads["triton"]
        assert float((got_out - want_out).norm() / want_out.norm()) < 1e-5
        for i, (x, y) in enumerate(zip(want, got)):  # a, weight, bias, log_alpha, log_beta
            assert x.shape == y.shape and x.dtype == y.dtype, (i, x.shape, y.shape)
            error = float((x - y).norm() / x.norm())
            assert error < 1e-5, (c_in, c_out, dilation, i, error)
        cases += 1
    # the weight frozen (no gradient asked for it), a without one: the parameters' gradients alone
    a, w = rand(1, 6 + 9, 32), rand(32, 32, 7, scale=0.1)
    la = rand(32, scale=0.3).requires_grad_()
    b, lb = rand(32, scale=0.1), rand(32, scale=0.3)
    got = torch.autograd.grad(conv_snake_triton_autograd(a, w, b, la, lb, 1, 9, precise=True).sum(), la)[0]
    want = torch.autograd.grad(conv_snake_reference(a, w, b, la, lb, 1, 9).sum(), la)[0]
    assert float((got - want).norm() / want.norm()) < 1e-5
    print("conv snake backward ok", cases + 1)
    """
)


def test_conv_snake_backward_in_the_triton_interpreter_equals_the_references_autograd():
    # fp32 only, as the forward's test (the CUDA tests check bf16)
    done = run_interpreted(CONV_SNAKE_BACKWARD)
    assert done.returncode == 0 and "conv snake backward ok 4" in done.stdout, done.stderr[-3000:]


BIAS_LEAKY_RELU = textwrap.dedent(
    """
    import torch
    from omni_lightning.kernels.bias_leaky_relu import bias_leaky_relu_reference, bias_leaky_relu_triton

    gen = torch.Generator().manual_seed(0)
    cases = 0
    # channels in one tile, two tiles with a cut one, eight (the padded first layer's output is wider);
    # rows over several backward programs; an output gradient in another layout (copied)
    for shape in ((2, 32, 37, 5), (3, 96, 11, 3), (1, 8, 1300, 1)):
        x = torch.randn(*shape, generator=gen).to(memory_format=torch.channels_last)
        b = torch.randn(shape[1], generator=gen)
        g = torch.randn(*shape, generator=gen)
        results = []
        for op in (bias_leaky_relu_reference, bias_leaky_relu_triton):
            leaves = [x.clone().requires_grad_(), b.clone().requires_grad_()]
            y = op(*leaves, 0.1)
            results.append((y.detach(), *torch.autograd.grad(y, leaves, g)))
        for want, got in zip(*results):
            scale = max(1.0, float(want.abs().max()))
            assert want.shape == got.shape and float((want - got).abs().max()) <= 1e-5 * scale
        assert results[1][0].is_contiguous(memory_format=torch.channels_last)
        cases += 1
    print("bias leaky relu ok", cases)
    """
)


def test_bias_leaky_relu_in_the_triton_interpreter_equals_the_torch_reference():
    done = run_interpreted(BIAS_LEAKY_RELU)
    assert done.returncode == 0 and "bias leaky relu ok 3" in done.stdout, done.stderr[-3000:]
