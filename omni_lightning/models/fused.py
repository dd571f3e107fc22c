"""Fused CUDA kernels for inference (Triton). Training and CPU use the plain torch ops.

SnakeBeta, ``x + sin^2(x * alpha) / beta``, is five elementwise passes over the largest tensors of
the decoder in eager torch; at 24 kHz and 96 channels that traffic costs about as much as the
convolutions around it. One Triton pass reads x once and writes y once, computing in fp32.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _snake_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def snake_beta_kernel(x_ptr, y_ptr, alpha_ptr, inv_beta_ptr, channels, length,
                          stride_b, stride_c, stride_t, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)  # b * channels + c
        b = row // channels
        c = row % channels
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < length
        x = tl.load(x_ptr + b * stride_b + c * stride_c + offs * stride_t, mask=mask).to(tl.float32)
        alpha = tl.load(alpha_ptr + c)
        inv_beta = tl.load(inv_beta_ptr + c)
        s = tl.sin(x * alpha)
        y = x + inv_beta * s * s
        tl.store(y_ptr + row * length + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    return snake_beta_kernel


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    """``x + inv_beta * sin(x * alpha)^2`` for ``x [B, C, T]`` (any strides) on CUDA; contiguous out."""
    import triton

    batch, channels, length = x.shape
    y = torch.empty((batch, channels, length), dtype=x.dtype, device=x.device)
    block = 1024 if length >= 1024 else triton.next_power_of_2(max(length, 16))
    grid = (batch * channels, triton.cdiv(length, block))
    _snake_kernel()[grid](
        x, y, alpha.float().contiguous(), inv_beta.float().contiguous(), channels, length,
        x.stride(0), x.stride(1), x.stride(2), BLOCK=block,
    )  # fmt: skip
    return y
