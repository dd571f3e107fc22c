"""The Triton kernels behind ``models/fused.py`` (imported only on CUDA, when Triton is installed).

Both compute SnakeBeta, ``x + inv_beta * sin(alpha * x)^2``, in fp32, one read of ``x`` and one
write of ``y``:
- :func:`snake_beta_kernel` on ``[B, C, T]`` (the layers' layout);
- :func:`snake_beta_tc_kernel` on time-major ``[B, T, C]`` (the inference decoder and the
  streaming decoder), optionally adding the previous convolution's bias on the way in, and zeroing
  the first ``junk`` steps of marked rows (the streaming decoder's fresh streams).

The sine: with ``PRECISE`` off (the default of the wrappers) the argument is reduced to
``[-pi, pi]`` with a two-constant 2*pi (Cody-Waite) and the GPU's special-function unit evaluates
``sin.approx.f32`` on it: absolute error ~1e-6, far below the bf16 rounding of the output
(``x * 2^-9``). libdevice's precise ``sinf`` costs ~20 instructions more per element, and at the
decoder's late stages (96-192 channels, 24 kHz) that made SnakeBeta arithmetic-bound rather than
memory-bound: a quarter of the decoder's kernel time on an H200 (docs/performance.md). ``PRECISE``
keeps libdevice's sine (benchmarks compare the two). Offsets are 64-bit: a batch of 32
thirty-second clips at 96 channels is 2.2e9 elements, past int32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sin(v, PRECISE: tl.constexpr):
    if PRECISE:
        return tl.sin(v)
    k = tl.floor(v * 0.15915494309189535 + 0.5)  # nearest multiple of 2 pi
    r = tl.fma(k, -6.2831854820251465, v)  # float32(2 pi)
    r = tl.fma(k, 1.7484555314695172e-07, r)  # float32(2 pi) - 2 pi
    return tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def snake_beta_kernel(x_ptr, y_ptr, alpha_ptr, inv_beta_ptr, channels, length, stride_b, stride_c, stride_t,
                      PRECISE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # b * channels + c
    b = row // channels
    c = row % channels
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < length
    x = tl.load(x_ptr + b * stride_b + c * stride_c + offs * stride_t, mask=mask).to(tl.float32)
    alpha = tl.load(alpha_ptr + c)
    inv_beta = tl.load(inv_beta_ptr + c)
    s = _sin(x * alpha, PRECISE)
    y = x + inv_beta * s * s
    tl.store(y_ptr + row * length + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["length", "junk"])  # one compile for every length (streaming chunks)
def snake_beta_tc_kernel(x_ptr, y_ptr, alpha_ptr, beta_ptr, bias_ptr, fresh_ptr, length, channels,
                         x_sb, x_st, x_sc, y_sb, y_st, junk, LOG_PARAMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HAS_JUNK: tl.constexpr, PRECISE: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_C: tl.constexpr):  # fmt: skip
    """``alpha_ptr``/``beta_ptr``: ``log alpha``/``log beta`` if ``LOG_PARAMS``, else ``alpha``/``1 / beta``."""
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < channels
    alpha = tl.load(alpha_ptr + c, mask=in_c, other=0.0).to(tl.float32)
    inv_beta = tl.load(beta_ptr + c, mask=in_c, other=0.0).to(tl.float32)
    if LOG_PARAMS:
        alpha = tl.exp(alpha)
        inv_beta = 1.0 / (tl.exp(inv_beta) + 1e-9)
    inside = (t < length)[:, None] & in_c[None, :]
    x = tl.load(x_ptr + b * x_sb + t[:, None] * x_st + c[None, :] * x_sc, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + c, mask=in_c, other=0.0).to(tl.float32)[None, :]
    s = _sin(x * alpha[None, :], PRECISE)
    y = x + inv_beta[None, :] * s * s
    if HAS_JUNK:
        fresh = tl.load(fresh_ptr + b) != 0
        y = tl.where((t[:, None] < junk) & fresh, 0.0, y)
    tl.store(y_ptr + b * y_sb + t[:, None] * y_st + c[None, :], y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def snake_pointwise_residual_kernel(h_ptr, x_ptr, w_ptr, alpha_ptr, beta_ptr, bias_ptr, length, channels,
                                    h_sb, h_st, x_sb, x_st, PRECISE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_K: tl.constexpr):  # fmt: skip
    """``x[b, t, :] += W @ snake(h[b, t, :] + bias)`` for time-major ``h``, ``x`` (channels contiguous,
    ``x`` in place) and ``W [C, C]`` (a 1x1 convolution's weight): a residual unit's second SnakeBeta
    in the prologue of its 1x1 convolution, whose residual add is the epilogue. ``alpha_ptr`` and
    ``beta_ptr`` hold ``log alpha`` and ``log beta``; SnakeBeta in fp32, rounded to ``x``'s dtype
    before the product (as the separate kernel's output would be), fp32 accumulation;
    ``DOT_PRECISION`` is ``tl.dot``'s ``input_precision`` for fp32 inputs ("ieee" or "tf32")."""
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_t = t < length
    in_n = n < channels
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, channels, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < channels
        a = tl.load(h_ptr + b * h_sb + t[:, None] * h_st + k[None, :], mask=in_t[:, None] & in_k[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        a += tl.load(bias_ptr + k, mask=in_k, other=0.0).to(tl.float32)[None, :]
        alpha = tl.exp(tl.load(alpha_ptr + k, mask=in_k, other=0.0).to(tl.float32))
        inv_beta = 1.0 / (tl.exp(tl.load(beta_ptr + k, mask=in_k, other=0.0).to(tl.float32)) + 1e-9)
        s = _sin(a * alpha[None, :], PRECISE)
        a = (a + inv_beta[None, :] * s * s).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + n[None, :] * channels + k[:, None], mask=in_k[:, None] & in_n[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    inside = in_t[:, None] & in_n[None, :]
    x_at = x_ptr + b * x_sb + t[:, None] * x_st + n[None, :]
    x = tl.load(x_at, mask=inside, other=0.0).to(tl.float32)
    tl.store(x_at, (x + acc).to(x_ptr.dtype.element_ty), mask=inside)
