"""SnakeBeta, ``y = x + sin(x * alpha)^2 / beta`` per channel: the op, in one file.

The decoder runs time-major (``[B, T, C]``, channels contiguous) and every causal convolution reads
a buffer that holds its history first (``models/layers.py``). So the op produces that buffer whole:

    out[:, :context]                    the convolution's history (``context`` rows, or zeros)
    out[:, context:context + T]         snake(x + bias) in fp32, rounded to x's dtype
    out[:, context + T:]                zeros, up to a multiple of ``multiple`` rows (the folded
                                        dilated convolutions need whole rows of ``dilation``)

and rows ``t < junk`` of the snake part are zero for rows marked ``fresh`` (a stream's first chunk:
those samples stand for time before the request's start, where ``decode`` has zero padding).
``bias`` is the preceding convolution's bias, added here instead of in its own pass.

Here are the torch reference (:func:`snake_beta_reference`, any device, autograd) and the Triton
kernel with its launcher (:func:`snake_beta_triton`, CUDA, inference: no autograd). Their sine: the
reference uses torch's; the kernel reduces the argument to ``[-pi, pi]`` exactly (a two-constant
2*pi) and evaluates the GPU's ``sin.approx.f32`` (absolute error ~1e-6, far below bf16's rounding
of the output; libdevice's precise sine made the late, narrow decoder stages arithmetic-bound on an
H200). ``precise=True`` keeps libdevice's sine. Offsets are 64-bit: a batch of long chunks at 96
channels passes 2**31 elements.

Not here: the backward in Triton (training runs the reference's autograd); the parameters are the
layer's log-scale ``alpha`` and ``beta`` and are exponentiated in fp32 on every call (a few hundred
values: nothing to cache, and nothing goes stale when fine-tuning changes them).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves
    triton = None


def snake_beta_reference(
    x: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    context: torch.Tensor | None = None,
    context_len: int = 0,
    fresh: torch.Tensor | bool = False,
    junk: int = 0,
    multiple: int = 1,
) -> torch.Tensor:
    """The op in torch (see the module docstring); ``x [B, T, C]``, ``context [B, context_len, C]``
    or None (zeros), ``fresh`` a bool per row or one for all rows. Returns ``[B, rows, C]``."""
    batch, length, channels = x.shape
    xf = x.float() if bias is None else x.float() + bias.float()
    s = torch.sin(xf * log_alpha.float().exp())
    y = torch.addcmul(xf, s, s * (1.0 / (log_beta.float().exp() + 1e-9)))
    if junk and fresh is not False:  # rows before time 0 (in place: addcmul keeps no output for backward)
        head = y[:, :junk]
        head.mul_(0.0 if fresh is True else (~fresh.bool()).to(y.dtype)[:, None, None])
    parts = [y.to(x.dtype)]
    if context_len:
        parts.insert(0, context.to(x.dtype) if context is not None else x.new_zeros(batch, context_len, channels))
    pad = -(context_len + length) % multiple
    if pad:
        parts.append(x.new_zeros(batch, pad, channels))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()


def snake_beta_triton(
    x: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    context: torch.Tensor | None = None,
    context_len: int = 0,
    fresh: torch.Tensor | bool = False,
    junk: int = 0,
    multiple: int = 1,
    precise: bool = False,
    block_c: int | None = None,
) -> torch.Tensor:
    """:func:`snake_beta_reference` as one Triton pass on CUDA (no autograd). ``block_c``: channels
    per tile, a power of two (default: 128, else 64 where it divides ``C``, else whole rows)."""
    batch, length, channels = x.shape
    rows = -(-(context_len + length) // multiple) * multiple
    out = torch.empty((batch, rows, channels), dtype=x.dtype, device=x.device)
    if block_c is None:
        block_c = next((b for b in (128, 64) if channels % b == 0), min(256, triton.next_power_of_2(channels)))
    block_t = max(1, 4096 // block_c)
    ctx = context if context is not None else x  # never read without HAS_CONTEXT
    per_row = isinstance(fresh, torch.Tensor)
    grid = (triton.cdiv(rows, block_t), triton.cdiv(channels, block_c), batch)
    _snake_beta_kernel[grid](
        x, out, ctx, log_alpha, log_beta, bias if bias is not None else log_alpha,
        fresh if per_row else log_alpha, length, rows, channels, context_len, junk,
        x.stride(0), x.stride(1), x.stride(2), ctx.stride(0), ctx.stride(1), ctx.stride(2),
        HAS_CONTEXT=context is not None and context_len > 0, HAS_BIAS=bias is not None,
        JUNK_MODE=0 if not junk or fresh is False else (2 if per_row else 1),
        PRECISE=precise, BLOCK_T=block_t, BLOCK_C=block_c,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _sin(v, PRECISE: tl.constexpr):
        if PRECISE:
            return tl.sin(v)
        k = tl.floor(v * 0.15915494309189535 + 0.5)  # nearest multiple of 2 pi
        r = tl.fma(k, -6.2831854820251465, v)  # float32(2 pi)
        r = tl.fma(k, 1.7484555314695172e-07, r)  # float32(2 pi) - 2 pi
        return tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True,
                                         pack=1)  # fmt: skip

    # lengths and batch strides vary with every chunk size: one compile serves them all
    @triton.jit(do_not_specialize=["length", "rows", "context_len", "junk", "x_sb", "x_st", "c_sb", "c_st"])
    def _snake_beta_kernel(x_ptr, y_ptr, ctx_ptr, la_ptr, lb_ptr, bias_ptr, fresh_ptr, length, rows, channels,
                           context_len, junk, x_sb, x_st, x_sc, c_sb, c_st, c_sc, HAS_CONTEXT: tl.constexpr,
                           HAS_BIAS: tl.constexpr, JUNK_MODE: tl.constexpr, PRECISE: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
        """Output rows ``o`` of batch row ``b``: history, snake(x + bias), zero padding (module docstring).
        ``JUNK_MODE``: 0 no junk, 1 every row fresh, 2 ``fresh_ptr[b] != 0`` per row."""
        b = tl.program_id(2).to(tl.int64)
        o = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_c = c < channels
        t = o - context_len
        is_x = (t >= 0) & (t < length)
        x_mask = is_x[:, None] & in_c[None, :]
        x = tl.load(x_ptr + b * x_sb + t[:, None] * x_st + c[None, :] * x_sc, mask=x_mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(bias_ptr + c, mask=in_c, other=0.0).to(tl.float32)[None, :]
        alpha = tl.exp(tl.load(la_ptr + c, mask=in_c, other=0.0).to(tl.float32))
        inv_beta = 1.0 / (tl.exp(tl.load(lb_ptr + c, mask=in_c, other=0.0).to(tl.float32)) + 1e-9)
        s = _sin(x * alpha[None, :], PRECISE)
        y = x + inv_beta[None, :] * s * s
        if JUNK_MODE == 1:
            y = tl.where((t < junk)[:, None], 0.0, y)
        if JUNK_MODE == 2:
            fresh = tl.load(fresh_ptr + b) != 0
            y = tl.where((t < junk)[:, None] & fresh, 0.0, y)
        y = tl.where(x_mask, y, 0.0)  # padding rows past the snake part
        if HAS_CONTEXT:
            is_ctx = (o < context_len)[:, None] & in_c[None, :]
            h = tl.load(ctx_ptr + b * c_sb + o[:, None] * c_st + c[None, :] * c_sc, mask=is_ctx, other=0.0)
            y = tl.where(is_ctx, h.to(tl.float32), y)
        out_mask = (o < rows)[:, None] & in_c[None, :]
        tl.store(y_ptr + (b * rows + o[:, None]) * channels + c[None, :], y.to(y_ptr.dtype.element_ty), mask=out_mask)
