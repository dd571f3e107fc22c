"""Fused CUDA kernels for inference (Triton). Training and CPU use the plain torch ops.

SnakeBeta, ``x + sin^2(x * alpha) / beta``, is five elementwise passes over the largest tensors of
the decoder in eager torch; at 24 kHz and 96 channels that traffic costs about as much as the
convolutions around it. One Triton pass reads x once and writes y once, computing in fp32.

Two layouts: :func:`snake_beta` for ``[B, C, T]`` tensors (the layers' own layout), and
:func:`snake_beta_tc` for time-major ``[B, T, C]`` tensors (the channels-last inference decoder,
``models/fast_decoder.py``, and the streaming decoder), which also adds the preceding convolution's
bias on the way in, so no convolution needs a separate bias pass. The kernels live in
``models/triton_kernels.py`` (imported on first CUDA use); their sine is the GPU's fast one after an
exact range reduction (that file says why and what it costs in accuracy); ``precise=True`` keeps
libdevice's.
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


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor, precise: bool = False) -> torch.Tensor:
    """``x + inv_beta * sin(x * alpha)^2`` for ``x [B, C, T]`` (any strides) on CUDA; contiguous out."""
    import triton

    from omni_lightning.models.triton_kernels import snake_beta_kernel

    batch, channels, length = x.shape
    y = torch.empty((batch, channels, length), dtype=x.dtype, device=x.device)
    block = 1024 if length >= 1024 else triton.next_power_of_2(max(length, 16))
    grid = (batch * channels, triton.cdiv(length, block))
    snake_beta_kernel[grid](
        x, y, alpha.float().contiguous(), inv_beta.float().contiguous(), channels, length,
        x.stride(0), x.stride(1), x.stride(2), PRECISE=precise, BLOCK=block,
    )  # fmt: skip
    return y


def snake_beta_tc(
    x: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    bias: torch.Tensor | None = None,
    precise: bool = False,
    block_c: int | None = None,
) -> torch.Tensor:
    """SnakeBeta of ``x [B, T, C] (+ bias[C])`` with the layer's log-scale parameters; contiguous out.

    Any strides (channels contiguous is the fast case). CUDA tensors take one Triton pass; others
    (CPU, no Triton) the same math in eager torch, fp32 inside, as the kernel.
    """
    if not (x.is_cuda and triton_available()):
        xf = x.float() if bias is None else x.float() + bias.float()
        s = torch.sin(xf * log_alpha.float().exp())
        return (xf + s * s / (log_beta.float().exp() + 1e-9)).to(x.dtype).contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    snake_beta_tc_into(x, y, log_alpha, log_beta, bias, log_params=True, precise=precise, block_c=block_c)
    return y


def snake_beta_tc_into(
    x: torch.Tensor,
    out: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    bias: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    junk: int = 0,
    log_params: bool = False,
    precise: bool = False,
    block_c: int | None = None,
) -> None:
    """The time-major kernel into ``out [B, T, C]`` (channels contiguous), CUDA only.

    ``alpha``/``beta``: ``alpha`` and ``1 / beta``, or their logs with ``log_params``. Rows ``b``
    with ``fresh[b] != 0`` get zeros for ``t < junk`` (the streaming decoder's new streams).
    ``block_c``: channels per tile (a power of two; default: 128 or else 64 where it divides ``C``
    (the 128-channel tiles ran 7-10 % faster at 384-1536 channels on an H200), else whole rows, e.g.
    128 lanes for 96 channels, so each tile reads whole contiguous rows).
    """
    import triton

    from omni_lightning.models.triton_kernels import snake_beta_tc_kernel

    batch, length, channels = x.shape
    if block_c is None:
        block_c = next((b for b in (128, 64) if channels % b == 0), min(256, triton.next_power_of_2(channels)))
    block_t = max(1, 4096 // block_c)
    grid = (triton.cdiv(length, block_t), triton.cdiv(channels, block_c), batch)
    snake_beta_tc_kernel[grid](
        x, out, alpha, beta, bias if bias is not None else alpha, fresh if fresh is not None else alpha,
        length, channels, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), junk,
        LOG_PARAMS=log_params, HAS_BIAS=bias is not None, HAS_JUNK=fresh is not None and junk > 0,
        PRECISE=precise, BLOCK_T=block_t, BLOCK_C=block_c,
    )  # fmt: skip


def pointwise_tiles(channels: int) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_N, BLOCK_K, num_warps)`` of :func:`snake_pointwise_residual_` for ``C`` channels."""
    block_k = 64 if channels % 64 == 0 else 32
    if channels <= 128:
        return 128, 128, block_k, 4  # one tile of output channels: each row of h is read once
    return 128, (64 if channels % 128 else 128), block_k, 8


def snake_pointwise_residual_(
    x: torch.Tensor,
    h: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    precise: bool = False,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x += conv1x1(snake_beta(h + bias))`` without the 1x1 convolution's bias, in place, for
    time-major ``x, h [B, T, C]`` (channels contiguous; ``x`` contiguous) and ``weight [C, C, 1]``:
    one Triton pass on CUDA (SnakeBeta in the GEMM's prologue, the residual in its epilogue; the
    SnakeBeta output never goes to memory); elsewhere the two steps in torch. ``tiles``: overrides
    :func:`pointwise_tiles` (benchmarks sweep it). Returns ``x``."""
    if not (x.is_cuda and triton_available()):
        hs = snake_beta_tc(h, log_alpha, log_beta, bias)
        x.view(-1, x.shape[-1]).addmm_(hs.reshape(-1, hs.shape[-1]), weight.view(weight.shape[0], -1).t())
        return x
    import triton

    from omni_lightning.models.triton_kernels import snake_pointwise_residual_kernel

    batch, length, channels = x.shape
    if h.stride(2) != 1 or not x.is_contiguous() or not weight.is_contiguous():
        raise ValueError("snake_pointwise_residual_ needs channels-contiguous h, contiguous x and weight")
    block_t, block_n, block_k, warps = tiles or pointwise_tiles(channels)
    # fp32 products as torch's matmul would make them: TF32 only where torch allows it
    dot_precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    grid = (triton.cdiv(channels, block_n), triton.cdiv(length, block_t), batch)
    snake_pointwise_residual_kernel[grid](
        h, x, weight, log_alpha, log_beta, bias, length, channels, h.stride(0), h.stride(1),
        x.stride(0), x.stride(1), PRECISE=precise, DOT_PRECISION=dot_precision, BLOCK_T=block_t,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3,
    )  # fmt: skip
    return x
