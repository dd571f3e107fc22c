"""A decoder residual unit after its first SnakeBeta, in one pass: the op, in one file.

``models/layers.DecoderResidualUnit`` computes, on the time-major residual stream ``x [B, T, C]``:

    a = snake1(x + pending)             with the dilated convolution's history first (kernels/snake_beta.py)
    h = snake2(conv7(a, dilation) + b1)
    x = x + h @ W2^T                    (the 1x1 convolution, its bias carried as ``pending``)

This op is the last two lines: it reads ``a`` (the history rows, then ``T`` rows; rows past them
unread), the weights and ``x``, and adds the unit's output to ``x`` in place. The convolution's
output and ``h`` never go to memory: per tile of rows the kernel accumulates the seven taps' GEMMs,
applies SnakeBeta with the bias in fp32, rounds ``h`` to ``x``'s dtype (as the layer-by-layer forward
stores it) and multiplies it by ``W2`` into the stream. The separate passes it replaces read and
wrote the convolution output and ``h`` once each.

Here are the torch reference (:func:`residual_unit_reference`, any device, the layers' arithmetic)
and the Triton kernel (:func:`residual_unit_triton`, CUDA or Triton's interpreter, forward only, in
place: inference). fp32 inputs use full-precision dots (``ieee``), not TF32. Channels up to
:data:`MAX_CHANNELS` (the whole channel dim is one tile; wider units are compute-bound and stay on
cuDNN). Not here: a backward (training keeps the layers), the first SnakeBeta (its output is the
history the state saves).
"""

from __future__ import annotations

import torch

from omni_lightning.kernels.snake_beta import snake_beta_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves
    triton = None

MAX_CHANNELS = 256


def residual_unit_reference(
    a: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """``x += snake(conv(a) + b1) @ w2^T`` (module docstring), in place; returns ``x``.

    ``a [B, context + T (+ padding), C]`` with ``context = (kernel - 1) * dilation`` history rows,
    ``x [B, T, C]``, ``w1`` a ``Conv1d`` weight ``[C, C, kernel]`` whose dilation is ``context //
    (kernel - 1)``, ``w2`` ``[C, C, 1]``."""
    length, kernel = x.shape[1], w1.shape[-1]
    dilation = (a.shape[1] - length) // (kernel - 1) if kernel > 1 else 1
    rows = a[:, : (kernel - 1) * dilation + length].transpose(1, 2)
    y = torch.nn.functional.conv1d(rows, w1.to(a.dtype), dilation=dilation).transpose(1, 2)
    h = snake_beta_reference(y, log_alpha, log_beta, b1)
    return (
        x.view(-1, x.shape[-1])
        .addmm_(h.reshape(-1, h.shape[-1]), w2.view(w2.shape[0], -1).t().to(x.dtype))
        .view(x.shape)
    )


def residual_unit_triton(
    a: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    w2: torch.Tensor,
    dilation: int,
    *,
    precise: bool = False,
    block_t: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """:func:`residual_unit_reference` as one Triton kernel (``dilation`` given: ``a`` may hold padding
    rows past ``context + T``). ``x`` must have unit channel stride; ``a``'s rows any stride. Returns ``x``."""
    batch, length, channels = x.shape
    if channels > MAX_CHANNELS:
        raise ValueError(f"residual_unit_triton takes at most {MAX_CHANNELS} channels, got {channels}")
    kernel = w1.shape[-1]
    if a.shape[1] < (kernel - 1) * dilation + length or x.stride(2) != 1 or a.stride(2) != 1:
        raise ValueError(f"a {tuple(a.shape)} / x {tuple(x.shape)}: rows or strides do not fit dilation {dilation}")
    block_c = max(16, triton.next_power_of_2(channels))
    block_k = block_k or min(block_c, 64)
    block_t = block_t or (64 if block_c <= 128 else 32)
    fp32 = x.dtype == torch.float32
    grid = (triton.cdiv(length, block_t), batch)
    extra = {}
    if num_warps is not None:
        extra["num_warps"] = num_warps
    if num_stages is not None:
        extra["num_stages"] = num_stages
    _residual_unit_kernel[grid](
        a, x, w1, b1, log_alpha, log_beta, w2, length, channels,
        a.stride(0), a.stride(1), x.stride(0), x.stride(1),
        w1.stride(0), w1.stride(1), w1.stride(2), w2.stride(0), w2.stride(1),
        DILATION=dilation, TAPS=kernel, FP32=fp32, PRECISE=precise,
        BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_K=block_k, **extra,
    )  # fmt: skip
    return x


if triton is not None:
    from omni_lightning.kernels.snake_beta import _sin

    @triton.jit(do_not_specialize=["length", "a_sb", "a_st", "x_sb", "x_st"])
    def _residual_unit_kernel(a_ptr, x_ptr, w1_ptr, b1_ptr, la_ptr, lb_ptr, w2_ptr, length, channels,
                              a_sb, a_st, x_sb, x_st, w1_so, w1_si, w1_sk, w2_so, w2_si,
                              DILATION: tl.constexpr, TAPS: tl.constexpr, FP32: tl.constexpr, PRECISE: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """Rows ``[t0, t0 + BLOCK_T)`` of batch row ``b``, every channel (``BLOCK_C`` >= ``channels``)."""
        b = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        co = tl.arange(0, BLOCK_C)
        in_t, in_co = t < length, co < channels
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        a_rows = a_ptr + b * a_sb
        for k in tl.static_range(TAPS):
            rows = (t + k * DILATION) * a_st
            for c0 in range(0, channels, BLOCK_K):
                ci = c0 + tl.arange(0, BLOCK_K)
                in_ci = ci < channels
                tile = tl.load(a_rows + rows[:, None] + ci[None, :], mask=in_t[:, None] & in_ci[None, :], other=0.0)
                w = tl.load(w1_ptr + co[None, :] * w1_so + ci[:, None] * w1_si + k * w1_sk,
                            mask=in_ci[:, None] & in_co[None, :], other=0.0)  # fmt: skip
                if FP32:
                    acc = tl.dot(tile, w.to(tile.dtype), acc, input_precision="ieee")
                else:
                    acc = tl.dot(tile, w.to(tile.dtype), acc)
        u = acc + tl.load(b1_ptr + co, mask=in_co, other=0.0).to(tl.float32)[None, :]
        alpha = tl.exp(tl.load(la_ptr + co, mask=in_co, other=0.0).to(tl.float32))
        inv_beta = 1.0 / (tl.exp(tl.load(lb_ptr + co, mask=in_co, other=0.0).to(tl.float32)) + 1e-9)
        s = _sin(u * alpha[None, :], PRECISE)
        h = (u + inv_beta[None, :] * s * s).to(x_ptr.dtype.element_ty)  # as the layers store it
        ci2 = tl.arange(0, BLOCK_C)
        w2 = tl.load(
            w2_ptr + co[None, :] * w2_so + ci2[:, None] * w2_si, mask=in_co[None, :] & in_co[:, None], other=0.0
        )
        if FP32:  # noqa: SIM108  (a constexpr branch: Triton compiles one side)
            out = tl.dot(h, w2.to(h.dtype), input_precision="ieee")
        else:
            out = tl.dot(h, w2.to(h.dtype))
        mask = in_t[:, None] & in_co[None, :]
        x_tile = x_ptr + b * x_sb + t[:, None] * x_st + co[None, :]
        stream = tl.load(x_tile, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_tile, (stream + out).to(x_ptr.dtype.element_ty), mask=mask)
