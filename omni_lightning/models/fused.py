"""Fused CUDA kernels for inference (Triton). Training and CPU use the plain torch ops.

SnakeBeta, ``x + sin^2(x * alpha) / beta``, is five elementwise passes over the largest tensors of
the decoder in eager torch; at 24 kHz and 96 channels that traffic costs about as much as the
convolutions around it. One Triton pass reads x once and writes y once, computing in fp32.

Two layouts: :func:`snake_beta` for ``[B, C, T]`` tensors (the layers' own layout), and
:func:`snake_beta_tc` for time-major ``[B, T, C]`` tensors (the channels-last inference decoder,
``models/fast_decoder.py``), which also adds the preceding convolution's bias on the way in, so no
convolution needs a separate bias pass. Offsets are 64-bit: a batch of 32 thirty-second clips at
96 channels is 2.2e9 elements, past int32.
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
        row = tl.program_id(0).to(tl.int64)  # b * channels + c
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


@functools.cache
def _snake_tc_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def snake_beta_tc_kernel(x_ptr, y_ptr, log_alpha_ptr, log_beta_ptr, bias_ptr, length, channels,
                             stride_b, stride_t, stride_c, HAS_BIAS: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
        b = tl.program_id(2).to(tl.int64)
        t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_c = c < channels
        alpha = tl.exp(tl.load(log_alpha_ptr + c, mask=in_c, other=0.0).to(tl.float32))
        inv_beta = 1.0 / (tl.exp(tl.load(log_beta_ptr + c, mask=in_c, other=0.0).to(tl.float32)) + 1e-9)
        mask = (t[:, None] < length) & in_c[None, :]
        x = tl.load(x_ptr + b * stride_b + t[:, None] * stride_t + c[None, :] * stride_c, mask=mask, other=0.0)
        x = x.to(tl.float32)
        if HAS_BIAS:
            x += tl.load(bias_ptr + c, mask=in_c, other=0.0).to(tl.float32)[None, :]
        s = tl.sin(x * alpha[None, :])
        y = x + inv_beta[None, :] * s * s
        out = y_ptr + (b * length + t[:, None]) * channels + c[None, :]
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask)

    return snake_beta_tc_kernel


def snake_beta_tc(
    x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """SnakeBeta of ``x [B, T, C] (+ bias[C])`` with the layer's log-scale parameters; contiguous out.

    Any strides (channels contiguous is the fast case). CUDA tensors take one Triton pass; others
    (CPU, no Triton) the same math in eager torch, fp32 inside, as the kernel.
    """
    batch, length, channels = x.shape
    if not (x.is_cuda and triton_available()):
        xf = x.float() if bias is None else x.float() + bias.float()
        s = torch.sin(xf * log_alpha.float().exp())
        return (xf + s * s / (log_beta.float().exp() + 1e-9)).to(x.dtype).contiguous()
    import triton

    y = torch.empty((batch, length, channels), dtype=x.dtype, device=x.device)
    block_c = 64 if channels % 64 == 0 else (32 if channels % 32 == 0 else min(64, triton.next_power_of_2(channels)))
    block_t = 4096 // block_c
    grid = (triton.cdiv(length, block_t), triton.cdiv(channels, block_c), batch)
    _snake_tc_kernel()[grid](
        x, y, log_alpha, log_beta, bias if bias is not None else log_alpha, length, channels,
        x.stride(0), x.stride(1), x.stride(2), HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_C=block_c,
    )  # fmt: skip
    return y
