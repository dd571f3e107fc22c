"""The Triton SnakeBeta kernel's index and mask logic, run by Triton's interpreter on the CPU.

``TRITON_INTERPRET=1`` (set in a subprocess, before Triton is imported) runs ``@triton.jit`` kernels
on CPU tensors with NumPy, so every machine checks the launcher and kernel against the torch
reference (``kernels/snake_beta.py``): history rows (given or zero), the snake part with a bias,
junk rows of fresh batch rows (all or per row), zero padding to a multiple, strided inputs (a
convolution's output is a view), channel counts that are not multiples of the tiles. Not checked
here: the fast sine (inline PTX has no interpreter; ``precise=True`` runs libdevice's instead, and
the CUDA tests check the fast one) and the speed.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

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
            (1, False, True, 3, 1), (18, True, False, 4, 3),
        ):
            ctx = rand(batch, context_len, channels) if history else None
            kw = dict(context=ctx, context_len=context_len, fresh=fresh, junk=junk, multiple=multiple)
            want = snake_beta_reference(x, la, lb, bias, **kw)
            got = snake_beta_triton(x, la, lb, bias, precise=True, block_c=32, **kw)
            assert got.shape == want.shape and got.shape[1] % multiple == 0, (got.shape, want.shape)
            assert float((got - want).abs().max()) < 1e-5, (channels, context_len, junk)
            cases += 1
    print("kernels ok", cases)
    """
)


def test_snake_beta_kernel_in_the_triton_interpreter_equals_the_torch_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "kernels ok 12" in done.stdout, done.stderr[-3000:]
