"""The Triton kernels' index and mask logic, run by Triton's interpreter on the CPU.

``TRITON_INTERPRET=1`` (set in a subprocess, before Triton is imported) runs ``@triton.jit``
kernels on CPU tensors with NumPy, so every machine checks the tiling, strides and masks against
the eager torch math: shapes that are not multiples of the tiles, strided inputs (a convolution's
output is a view), batch rows. Not checked here: the fast sine (inline PTX has no interpreter; the
CUDA tests and ``scripts/bench_snake.py`` check it on a GPU) and the speed.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch, triton
    from omni_lightning.models.fused import pointwise_tiles, snake_beta_tc
    from omni_lightning.models.triton_kernels import snake_beta_tc_kernel, snake_pointwise_residual_kernel

    gen = torch.Generator().manual_seed(0)
    for channels, length, batch in ((96, 70, 2), (192, 33, 1), (384, 20, 2), (40, 9, 3)):
        def rand(*shape, scale=1.0):
            return torch.randn(*shape, generator=gen) * scale
        h = rand(batch, length + 5, channels)[:, :length]  # strided, as a convolution's output view
        x = rand(batch, length, channels)
        log_alpha, log_beta, bias = rand(channels, scale=0.3), rand(channels, scale=0.3), rand(channels, scale=0.1)
        weight = rand(channels, channels, 1) / channels**0.5
        want = x + snake_beta_tc(h, log_alpha, log_beta, bias) @ weight[:, :, 0].t()
        block_t, block_n, block_k, _ = pointwise_tiles(channels)
        block_t = 16  # several time tiles, the last one partial
        grid = (triton.cdiv(channels, block_n), triton.cdiv(length, block_t), batch)
        snake_pointwise_residual_kernel[grid](h, x, weight, log_alpha, log_beta, bias, length, channels,
                                              h.stride(0), h.stride(1), x.stride(0), x.stride(1), PRECISE=True,
                                              DOT_PRECISION="ieee", BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k)
        err = float((x - want).abs().max() / want.abs().max())
        assert err < 1e-5, (channels, length, err)
        y = torch.full((batch, length, channels), float("nan"))
        grid = (triton.cdiv(length, 8), triton.cdiv(channels, 32), batch)
        snake_beta_tc_kernel[grid](h, y, log_alpha, log_beta, bias, bias, length, channels, h.stride(0),
                                   h.stride(1), h.stride(2), y.stride(0), y.stride(1), 0, LOG_PARAMS=True,
                                   HAS_BIAS=True, HAS_JUNK=False, PRECISE=True, BLOCK_T=8, BLOCK_C=32)
        assert float((y - snake_beta_tc(h, log_alpha, log_beta, bias)).abs().max()) < 1e-5, channels
    print("kernels ok")
    """
)


def test_kernels_in_the_triton_interpreter_equal_the_torch_math():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "kernels ok" in done.stdout, done.stderr[-3000:]
