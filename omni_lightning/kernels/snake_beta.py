"""SnakeBeta, ``y = x + sin(x * alpha)^2 / beta`` per channel: the op, in one file.

The decoder runs time-major (``[B, T, C]``) and every causal convolution reads a buffer that holds
its history first (``models/layers.py``), so the op produces that buffer whole:

    out[:, :context]                    the convolution's history (``context`` rows, or zeros)
    out[:, context:context + T]         snake(x + bias) in fp32 (fp64 for fp64 x), rounded to x's dtype
    out[:, context + T:]                zeros, up to a multiple of ``multiple`` rows (the folded
                                        dilated convolutions need whole rows of ``dilation``)

Rows ``t < junk`` of the snake part are zero for rows marked ``fresh`` (time before a request's
start). ``bias`` is the preceding convolution's bias, added here instead of in its own pass.

Here are the torch reference (:func:`snake_beta_reference`, any device, autograd), the Triton
kernel (:func:`snake_beta_triton`, CUDA, forward only) and the kernel with a Triton backward as one
autograd function (:func:`snake_beta_triton_autograd`, CUDA, training). The kernels reduce the sine's
argument to ``[-pi, pi]`` exactly and evaluate ``sin.approx.f32`` (absolute error ~1e-6, far below
bf16's rounding); ``precise=True`` keeps libdevice's sine. Offsets are 64-bit. The backward
recomputes the sine from the saved ``x`` and sums the per-channel gradients in fp32. Not here:
double backward, and caching the exponentiated ``alpha`` and ``beta`` (a few hundred values).

Launch settings: :func:`forward_tiles` and :func:`backward_tiles` (tiles, warps, stages) and
``_forward_args`` / ``_backward_args`` (the kernels' arguments) serve the launchers and
:func:`hopper_launches` alike (``kernels/launches.py``), so the kernel report compiles what runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from omni_lightning.kernels.launches import DTYPES, KernelLaunch, MockTensor, launch, stages_label

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
    dtype = torch.promote_types(x.dtype, torch.float32)  # fp64 stays fp64: gradcheck runs on it
    xf = x.to(dtype) if bias is None else x.to(dtype) + bias.to(dtype)
    s = torch.sin(xf * log_alpha.to(dtype).exp())
    y = torch.addcmul(xf, s, s * (1.0 / (log_beta.to(dtype).exp() + 1e-9)))
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
    per tile, a power of two (default: 128, else 64 where it divides ``C``, else whole rows, up to 256)."""
    batch, length, channels = x.shape
    rows = -(-(context_len + length) // multiple) * multiple
    out = torch.empty((batch, rows, channels), dtype=x.dtype, device=x.device)
    tiles = forward_tiles(channels, block_c)
    per_row = isinstance(fresh, torch.Tensor)
    junk = junk if junk and fresh is not False else 0  # no fresh row: nothing to zero
    grid = (triton.cdiv(rows, tiles.block_t), triton.cdiv(channels, tiles.block_c), batch)
    fresh = _bytes(fresh) if per_row else out.view(torch.uint8)
    args, kwargs = _forward_args(x, out, context, log_alpha, log_beta, bias, fresh, rows, context_len, junk,
                                 per_row, precise, tiles)  # fmt: skip
    _snake_beta_kernel[grid](*args, **kwargs)
    return out


def snake_beta_triton_autograd(
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
    """:func:`snake_beta_triton` with its Triton backward (:func:`snake_beta_triton_backward`): one
    autograd function, differentiable in ``x``, ``log_alpha``, ``log_beta``, ``bias`` and ``context``."""
    return _SnakeBetaFunction.apply(
        x, log_alpha, log_beta, bias, context, context_len, fresh, junk, multiple, precise, block_c
    )


def snake_beta_triton_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    context_len: int = 0,
    fresh: torch.Tensor | bool = False,
    junk: int = 0,
    precise: bool = False,
    block_c: int | None = None,
    grad_x: bool = True,
    programs: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradients, given the output's gradient ``grad_out [B, rows, C]`` (any strides), of ``x``
    (None unless ``grad_x``), ``log_alpha``, ``log_beta`` and ``bias`` (None without one), each in
    its tensor's dtype. One Triton pass over ``x``; the per-channel sums are fp32. ``programs``: at
    most this many programs per batch row and channel tile, each summing a run of row tiles
    (default: about 1,024 programs in all, a few per SM, so the partial sums stay small)."""
    batch, length, channels = x.shape
    tiles = backward_tiles(channels, block_c)
    c_tiles, tiles_t = triton.cdiv(channels, tiles.block_c), triton.cdiv(length, tiles.block_t)
    programs = min(tiles_t, programs or max(1, triton.cdiv(1024, batch * c_tiles)))
    per_program = triton.cdiv(tiles_t, programs)
    programs = triton.cdiv(tiles_t, per_program)
    dx = torch.empty((batch, length, channels), dtype=x.dtype, device=x.device) if grad_x else x  # x: never written
    partial = torch.empty((3, batch * programs, channels), dtype=torch.float32, device=x.device)
    args, kwargs = _backward_args(x, grad_out, dx, partial, log_alpha, log_beta, bias, fresh, context_len, junk,
                                  per_program, grad_x, precise, tiles)  # fmt: skip
    _snake_beta_backward_kernel[(programs, c_tiles, batch)](*args, **kwargs)
    d_alpha, d_beta, d_bias = partial.sum(1)
    return (dx if grad_x else None, d_alpha.to(log_alpha.dtype), d_beta.to(log_beta.dtype),
            d_bias.to(bias.dtype) if bias is not None else None)  # fmt: skip


def _bytes(flags: torch.Tensor) -> torch.Tensor:
    """A per-row flag tensor as one byte per row (bool and uint8 as they are: no copy)."""
    return (flags if flags.dtype in (torch.bool, torch.uint8) else flags != 0).view(torch.uint8)


class Tiles(NamedTuple):
    """A launch's tile (rows by channels per program), warps and pipelining stages."""

    block_t: int
    block_c: int
    num_warps: int = 4
    num_stages: int = 3


def forward_tiles(channels: int, block_c: int | None = None) -> Tiles:
    """The forward's tile for ``channels`` (default ``block_c``: 128, else 64 where it divides ``C``,
    else whole rows, up to 256) and about 4,096 elements per program."""
    block_c = block_c or _default_block_c(channels)
    return Tiles(max(1, 4096 // block_c), block_c)


def backward_tiles(channels: int, block_c: int | None = None) -> Tiles:
    """The backward's: the forward's channels and half its rows (three fp32 sums per element stay in registers)."""
    block_c = block_c or _default_block_c(channels)
    return Tiles(max(1, 2048 // block_c), block_c)


def _default_block_c(channels: int) -> int:
    return next((b for b in (128, 64) if channels % b == 0), min(256, 1 << (channels - 1).bit_length()))


def _forward_args(x, out, context, log_alpha, log_beta, bias, fresh, rows, context_len, junk, per_row, precise, tiles):
    """The forward kernel's arguments (``fresh``: one byte per row, any tensor without ``per_row``)."""
    ctx = context if context is not None else x  # never read without has_context
    args = (x, out, ctx, log_alpha, log_beta, bias if bias is not None else log_alpha, fresh, x.shape[1], rows,
            x.shape[2], context_len, junk, *x.stride(), *ctx.stride(), int(context is not None and context_len > 0),
            int(bias is not None), int(per_row))  # fmt: skip
    # the flags are runtime arguments, not constexprs: one compiled kernel per channel tile and bias dtype
    return args, dict(PRECISE=precise, BLOCK_T=tiles.block_t, BLOCK_C=tiles.block_c, num_warps=tiles.num_warps,
                      num_stages=tiles.num_stages)  # fmt: skip


def _backward_args(x, grad_out, dx, partial, log_alpha, log_beta, bias, fresh, context_len, junk, per_program,
                   grad_x, precise, tiles):  # fmt: skip
    per_row = isinstance(fresh, (torch.Tensor, MockTensor))
    args = (x, grad_out, dx, partial, log_alpha, log_beta, bias if bias is not None else log_alpha,
            fresh if per_row else log_alpha, x.shape[1], x.shape[2], context_len, junk, per_program,
            *x.stride(), *grad_out.stride())  # fmt: skip
    junk_mode = 0 if not junk or fresh is False else (2 if per_row else 1)
    return args, dict(HAS_BIAS=bias is not None, JUNK_MODE=junk_mode, GRAD_X=grad_x, PRECISE=precise,
                      BLOCK_T=tiles.block_t, BLOCK_C=tiles.block_c, num_warps=tiles.num_warps,
                      num_stages=tiles.num_stages)  # fmt: skip


def hopper_launches(layers) -> list[KernelLaunch]:
    """The launches the model's SnakeBeta layers make (``kernels/launches.py``'s convention), per
    channel count and dtype (of ``x`` and the parameters): the forward as inference runs it and the
    backward as training does, each with an fp32 bias (the carried one; a unit's second SnakeBeta
    gets its convolution's bias, in the model's dtype: a variant of the same tiles, not listed),
    junk rows zeroed in every row (the backward's ``JUNK_MODE=1``; 0 and 2, per-row ``fresh``, are
    variants too) and ``dx``. The forward's flags are runtime arguments: one compile serves them.
    Rows: one second of the layer's input (lengths are not specialized)."""
    launches = []
    for channels in dict.fromkeys(layer.channels_in for layer in layers if layer.kind == "snake"):
        label = stages_label([layer for layer in layers if layer.kind == "snake" and layer.channels_in == channels],
                             channels)  # fmt: skip
        length = int(max(layer.rows_per_second for layer in layers if layer.kind == "snake"))
        for name, dtype in DTYPES.items():
            x, params, f32 = MockTensor(dtype, (1, length, channels)), MockTensor(dtype), MockTensor(torch.float32)
            out = MockTensor(dtype, (1, length + 6, channels))
            args, kwargs = _forward_args(x, out, out, params, params, f32, MockTensor(torch.uint8), length + 6, 6, 6,
                                         False, False, forward_tiles(channels))  # fmt: skip
            launches.append(launch("snake_beta.forward", _snake_beta_kernel, args, kwargs, label, name))
            partial = MockTensor(torch.float32, (3, 1, channels))
            args, kwargs = _backward_args(x, out, x, partial, params, params, f32, True, 6, 6, 1, True, False,
                                          backward_tiles(channels))  # fmt: skip
            launches.append(launch("snake_beta.backward", _snake_beta_backward_kernel, args, kwargs, label, name))
    return launches


class _SnakeBetaFunction(torch.autograd.Function):
    """The Triton forward and backward as one autograd node; it saves ``x`` and the parameters only."""

    @staticmethod
    def forward(ctx, x, log_alpha, log_beta, bias, context, context_len, fresh, junk, multiple, precise, block_c):
        out = snake_beta_triton(x, log_alpha, log_beta, bias, context=context, context_len=context_len, fresh=fresh,
                                junk=junk, multiple=multiple, precise=precise, block_c=block_c)  # fmt: skip
        per_row = isinstance(fresh, torch.Tensor)
        ctx.save_for_backward(x, log_alpha, log_beta, bias, fresh if per_row else None)
        ctx.fresh, ctx.junk, ctx.context_len, ctx.precise, ctx.block_c = fresh, junk, context_len, precise, block_c
        ctx.context_dtype = context.dtype if context is not None else None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, log_alpha, log_beta, bias, fresh_rows = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, d_alpha, d_beta, d_bias = snake_beta_triton_backward(
            grad_out, x, log_alpha, log_beta, bias, context_len=ctx.context_len,
            fresh=fresh_rows if fresh_rows is not None else ctx.fresh, junk=ctx.junk, precise=ctx.precise,
            block_c=ctx.block_c, grad_x=need[0],
        )  # fmt: skip
        d_context = grad_out[:, : ctx.context_len].to(ctx.context_dtype) if need[4] else None
        return (dx, d_alpha if need[1] else None, d_beta if need[2] else None, d_bias if need[3] else None,
                d_context, None, None, None, None, None, None)  # fmt: skip


if triton is not None:

    @triton.jit
    def _reduced(v):
        """``v`` minus its nearest multiple of 2 pi (two constants: exact to fp32 for large ``v``)."""
        k = tl.floor(v * 0.15915494309189535 + 0.5)
        r = tl.fma(k, -6.2831854820251465, v)  # float32(2 pi)
        return tl.fma(k, 1.7484555314695172e-07, r)  # float32(2 pi) - 2 pi

    @triton.jit
    def _sin(v, PRECISE: tl.constexpr):
        if PRECISE:
            return tl.sin(v)
        return tl.inline_asm_elementwise(
            "sin.approx.f32 $0, $1;", "=r,r", [_reduced(v)], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def _sin_cos(v, PRECISE: tl.constexpr):
        if PRECISE:
            s = tl.sin(v)
            c = tl.cos(v)
        else:
            r = _reduced(v)
            s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1)
            c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1)
        return s, c

    # lengths, batch strides and the flags vary from call to call: one compile serves them all
    @triton.jit(do_not_specialize=["length", "rows", "context_len", "junk", "x_sb", "x_st", "c_sb", "c_st",
                                   "has_context", "has_bias", "per_row"])  # fmt: skip
    def _snake_beta_kernel(x_ptr, y_ptr, ctx_ptr, la_ptr, lb_ptr, bias_ptr, fresh_ptr, length, rows, channels,
                           context_len, junk, x_sb, x_st, x_sc, c_sb, c_st, c_sc, has_context, has_bias, per_row,
                           PRECISE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
        """Output rows ``o`` of batch row ``b``: history, snake(x + bias), zero padding (module docstring).
        Rows ``t < junk`` are zeroed in every row, or with ``per_row`` where ``fresh_ptr[b]`` is nonzero."""
        b = tl.program_id(2).to(tl.int64)
        o = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_c = c < channels
        t = o - context_len
        is_x = (t >= 0) & (t < length)
        x_mask = is_x[:, None] & in_c[None, :]
        x = tl.load(x_ptr + b * x_sb + t[:, None] * x_st + c[None, :] * x_sc, mask=x_mask, other=0.0).to(tl.float32)
        x += tl.load(bias_ptr + c, mask=in_c & (has_bias != 0), other=0.0).to(tl.float32)[None, :]
        alpha = tl.exp(tl.load(la_ptr + c, mask=in_c, other=0.0).to(tl.float32))
        inv_beta = 1.0 / (tl.exp(tl.load(lb_ptr + c, mask=in_c, other=0.0).to(tl.float32)) + 1e-9)
        s = _sin(x * alpha[None, :], PRECISE)
        y = x + inv_beta[None, :] * s * s
        fresh = tl.load(fresh_ptr + b, mask=per_row != 0, other=1) != 0  # not per row: every row is
        y = tl.where((t < junk)[:, None] & fresh, 0.0, y)
        y = tl.where(x_mask, y, 0.0)  # padding rows past the snake part
        is_ctx = (o < context_len)[:, None] & in_c[None, :] & (has_context != 0)
        h = tl.load(ctx_ptr + b * c_sb + o[:, None] * c_st + c[None, :] * c_sc, mask=is_ctx, other=0.0)
        y = tl.where(is_ctx, h.to(tl.float32), y)
        out_mask = (o < rows)[:, None] & in_c[None, :]
        tl.store(y_ptr + (b * rows + o[:, None]) * channels + c[None, :], y.to(y_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit(do_not_specialize=["length", "context_len", "junk", "per_program", "x_sb", "x_st", "g_sb", "g_st"])
    def _snake_beta_backward_kernel(x_ptr, g_ptr, dx_ptr, partial_ptr, la_ptr, lb_ptr, bias_ptr, fresh_ptr, length,
                                    channels, context_len, junk, per_program, x_sb, x_st, x_sc, g_sb, g_st, g_sc,
                                    HAS_BIAS: tl.constexpr, JUNK_MODE: tl.constexpr, GRAD_X: tl.constexpr,
                                    PRECISE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
        """Program ``p`` of batch row ``b``: ``per_program`` tiles of ``BLOCK_T`` rows of ``x`` from row
        ``p * per_program * BLOCK_T``; writes their ``dx`` and its channels' sums to ``partial[:, b * P + p]``.
        With ``u = x + bias``, ``y = u + sin(alpha u)^2 / beta`` (``beta`` = ``e^log_beta + 1e-9``):
        ``dy/du = 1 + alpha sin(2 alpha u) / beta``, ``dy/dlog_alpha = alpha u sin(2 alpha u) / beta``,
        ``dy/dlog_beta = -e^log_beta sin(alpha u)^2 / beta^2``."""
        p = tl.program_id(0)
        b = tl.program_id(2).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_c = c < channels
        alpha_c = tl.exp(tl.load(la_ptr + c, mask=in_c, other=0.0).to(tl.float32))
        e_beta = tl.exp(tl.load(lb_ptr + c, mask=in_c, other=0.0).to(tl.float32))
        inv_beta_c = 1.0 / (e_beta + 1e-9)
        alpha, inv_beta = alpha_c[None, :], inv_beta_c[None, :]
        if HAS_BIAS:
            shift = tl.load(bias_ptr + c, mask=in_c, other=0.0).to(tl.float32)[None, :]
        if JUNK_MODE == 2:
            fresh = tl.load(fresh_ptr + b) != 0
        sum_dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        sum_alpha = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        sum_beta = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        first = p.to(tl.int64) * per_program * BLOCK_T
        for i in range(per_program):
            t = first + i * BLOCK_T + tl.arange(0, BLOCK_T)
            mask = (t < length)[:, None] & in_c[None, :]
            u = tl.load(x_ptr + b * x_sb + t[:, None] * x_st + c[None, :] * x_sc, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                u += shift
            g = tl.load(
                g_ptr + b * g_sb + (t + context_len)[:, None] * g_st + c[None, :] * g_sc, mask=mask, other=0.0
            ).to(tl.float32)
            if JUNK_MODE == 1:
                g = tl.where((t < junk)[:, None], 0.0, g)
            if JUNK_MODE == 2:
                g = tl.where((t < junk)[:, None] & fresh, 0.0, g)
            s, co = _sin_cos(u * alpha, PRECISE)
            g_sin2 = g * inv_beta * (2.0 * s * co)  # g sin(2 alpha u) / beta; zero where g is (masked rows)
            dx = g + g_sin2 * alpha
            if GRAD_X:
                tl.store(
                    dx_ptr + (b * length + t[:, None]) * channels + c[None, :],
                    dx.to(dx_ptr.dtype.element_ty),
                    mask=mask,
                )
            sum_dx += dx
            sum_alpha += g_sin2 * u
            sum_beta += g * s * s
        programs = tl.num_programs(0) * tl.num_programs(2)
        row = b * tl.num_programs(0) + p
        tl.store(partial_ptr + row * channels + c, tl.sum(sum_alpha, axis=0) * alpha_c, mask=in_c)
        d_beta = -tl.sum(sum_beta, axis=0) * e_beta * inv_beta_c * inv_beta_c
        tl.store(partial_ptr + (programs + row) * channels + c, d_beta, mask=in_c)
        tl.store(partial_ptr + (2 * programs + row) * channels + c, tl.sum(sum_dx, axis=0), mask=in_c)
