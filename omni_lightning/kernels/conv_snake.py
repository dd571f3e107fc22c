"""A decoder residual unit's dilated convolution with the SnakeBeta after it as its epilogue: the op, in one file.

    h[b, t, n] = snake(sum_{j, k} a[b, t + j * dilation, k] * weight[n, k, j] + bias[n])

``a [B, rows, C_in]`` is the buffer the first SnakeBeta wrote (time-major, ``(taps - 1) * dilation``
rows of history first, ``models/layers.py``); ``h [B, length, C_out]`` is what the unit's 1x1
convolution reads next. The layers run this as a cuDNN convolution, a write and a read of its
output, and a SnakeBeta pass; here the convolution's accumulator goes through SnakeBeta in registers
and only ``h`` reaches memory (two passes over the largest activations fewer per unit).

The Triton kernel (:func:`conv_snake_triton`) is an implicit GEMM: ``M`` = rows of one batch row,
``K`` = taps x ``C_in`` (one K step reads ``BLOCK_K`` channels of one tap, ``C_in % BLOCK_K == 0``),
``N`` = ``C_out``, split into at most two power-of-two parts that share each A tile (192 = 128 + 64,
96 = 64 + 32), so every output channel of a row tile comes from one program and ``a`` is read from
L2 once per tap, with no masked columns. The weight is read as the engine holds it, input channels
innermost (``engine/graphs.conv_layout``: strides ``(taps * C_in, 1, C_in)``), so a K step's B tile
is K-major, as wgmma takes it; another layout is copied into that one first (a plain ``model(codes)``
on the GPU: 0.5 MB at 192 channels per call). The SnakeBeta epilogue computes in fp32 from the
fp32 accumulator (the layers round the convolution's output to bf16 first: this is the more exact of
the two). Tile settings are data (:func:`launch_tiles`, :func:`backward_tiles`), each compiled clean for sm_90a
(wgmma, no spills, within shared memory: ``scripts/kernels/kernel_report.py``).

The backward (:func:`conv_snake_triton_autograd`, one autograd function; training) saves what the
forward read (``a`` and the parameters), not the convolution's output: its kernel recomputes the
convolution, as FlashAttention recomputes attention, and applies SnakeBeta's backward as the epilogue
(``kernels/snake_beta.py``'s arithmetic), writing the pre-activation's gradient ``dy`` and the
per-channel sums for ``log_alpha``, ``log_beta`` and ``bias``. One ``convolution_backward`` call
(cuDNN on CUDA, the layers' layout: dilated convolutions folded to dilation 1) then takes ``a``'s and
the weight's gradients from ``dy``. Against the layers' training step that is one activation per unit
less held for the backward and two passes over it fewer (the forward's write and read of ``y``, the
backward's read), for one more pass over ``a`` and the convolution's FLOPs once more. Not here: fp32
inputs (a tensor-core dot in fp32 is TF32, coarser than cuDNN's fp32 convolution: fp32 stays on the
layers), ``a``'s and the weight's gradients in Triton (cuDNN's dgrad and wgrad are GEMMs at their
best already; a Triton pair is the next step), double backward, and channels that do not split into
two powers of two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omni_lightning.kernels.snake_beta import snake_beta_reference, triton

if triton is not None:
    import triton.language as tl

    from omni_lightning.kernels.snake_beta import _sin, _sin_cos

TAPS = 7  # the decoder residual units' dilated convolutions


@dataclass(frozen=True)
class Tiles:
    """A launch setting: rows per program, the two output-channel parts, channels per K step, warps, stages."""

    block_m: int
    block_n: int
    block_n2: int
    block_k: int
    num_warps: int
    num_stages: int


def split_channels(channels: int) -> tuple[int, int] | None:
    """``channels`` as a power of two plus a smaller power of two (or 0); None when it is not."""
    first = 1 << (channels.bit_length() - 1)
    rest = channels - first
    return (first, rest) if rest == 0 or rest & (rest - 1) == 0 and rest >= 16 else None


def widths_supported(c_in: int, c_out: int) -> bool:
    """Whether :func:`conv_snake_triton` takes these widths: 32-256 channels, ``c_out`` two powers of two."""
    return 32 <= c_out <= 256 and split_channels(c_out) is not None and c_in % 32 == 0 and c_in <= 256


def launch_tiles(c_in: int, c_out: int) -> Tiles:
    """The tile setting :func:`conv_snake_triton` uses for ``c_in`` -> ``c_out`` channels (one table for
    the launcher and the kernel report)."""
    first, rest = split_channels(c_out)
    # the fastest of seven settings at 96 and 192 channels on an H200 (docs/performance.md, bench_units.py):
    # one warpgroup, 32 channels a K step, three stages; 8 warps or 64-channel K steps were 5-20 % slower
    return Tiles(128, first, rest, 32, 4, 3)


def backward_tiles(c_in: int, c_out: int) -> Tiles:
    """The tile setting :func:`conv_snake_triton_backward` uses: the forward's K steps and stages, 64 rows
    and two warpgroups, as the epilogue holds SnakeBeta's backward besides the accumulator. Compiled for
    sm_90a at 192 channels, 128 rows spill with four or eight warps, as do 64 rows with four; this one
    does not (``scripts/kernels/kernel_report.py``); its speed against them is not measured yet."""
    first, rest = split_channels(c_out)
    return Tiles(64, first, rest, 32, 8, 3)


def channels_innermost(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A ``[C_out, C_in, taps]`` convolution weight with its input channels innermost (strides
    ``(taps * C_in, 1, C_in)``) in ``dtype`` (default its own): itself when it is so already, else one
    copy (the cast and the transpose in one pass: under bf16-mixed the weights are fp32)."""
    w = weight.reshape(weight.shape[0], weight.shape[1], -1) if weight.dim() != 3 else weight
    dtype = dtype or w.dtype
    if w.dtype == dtype and w.stride(1) == 1 and w.stride(2) == w.shape[1]:
        return w
    out = torch.empty((w.shape[0], w.shape[2], w.shape[1]), dtype=dtype, device=w.device)
    return out.copy_(w.transpose(1, 2)).transpose(1, 2)


def conv_snake_reference(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    dilation: int,
    length: int,
) -> torch.Tensor:
    """The op in torch: ``a [B, rows, C_in]``, ``weight [C_out, C_in, taps]`` to ``h [B, length, C_out]``
    (the convolution in ``a``'s dtype, then :func:`snake_beta_reference` of it plus ``bias``)."""
    w = weight.reshape(weight.shape[0], weight.shape[1], -1)
    y = F.conv1d(a.transpose(1, 2), w, dilation=dilation)[..., :length].transpose(1, 2)
    return snake_beta_reference(y, log_alpha, log_beta, bias)


def conv_snake_triton(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    dilation: int,
    length: int,
    *,
    tiles: Tiles | None = None,
    precise: bool = False,
) -> torch.Tensor:
    """:func:`conv_snake_reference` as one Triton kernel on CUDA (no autograd). ``a``'s channels must be
    contiguous; ``weight`` is read in place when its input channels are innermost (:func:`channels_innermost`).
    ``tiles``: default :func:`launch_tiles`. ``precise``: libdevice's sine (the interpreter's)."""
    batch, rows, c_in = a.shape
    w = channels_innermost(weight, a.dtype)  # under autocast the weight is fp32: the dot takes a's dtype
    c_out, taps = w.shape[0], w.shape[2]
    if a.stride(2) != 1:
        raise ValueError(f"conv_snake_triton needs a's channels contiguous, got strides {a.stride()}")
    if rows < length + (taps - 1) * dilation:
        raise ValueError(f"a holds {rows} rows, fewer than {length} + {(taps - 1) * dilation} of history")
    tiles = tiles or launch_tiles(c_in, c_out)
    if tiles.block_n + tiles.block_n2 != c_out or c_in % tiles.block_k:
        raise ValueError(f"tiles {tiles} do not fit {c_in} -> {c_out} channels")
    h = torch.empty((batch, length, c_out), dtype=a.dtype, device=a.device)
    args, kwargs = _launch_args(a, w, bias, log_alpha, log_beta, h, length, dilation, taps, tiles, precise)
    _conv_snake_kernel[(triton.cdiv(length, tiles.block_m), batch)](*args, **kwargs)
    return h


def _launch_args(a, w, bias, log_alpha, log_beta, h, length: int, dilation: int, taps: int, tiles: Tiles,
                 precise: bool) -> tuple[tuple, dict]:  # fmt: skip
    """The kernel's arguments (the launcher's and :func:`hopper_launches`' one source): ``w`` is
    ``[C_out, C_in, taps]`` with its input channels innermost."""
    c_in, c_out = a.shape[2], w.shape[0]  # w's strides are (taps * c_in, 1, c_in): the kernel knows them
    args = (a, w, bias, log_alpha, log_beta, h, length, dilation, a.stride(0), a.stride(1), h.stride(0),
            h.stride(1))  # fmt: skip
    kwargs = dict(C_IN=c_in, C_OUT=c_out, TAPS=taps, PRECISE=precise, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                  BLOCK_N2=tiles.block_n2, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages)  # fmt: skip
    return args, kwargs


def conv_snake_triton_autograd(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    dilation: int,
    length: int,
    *,
    precise: bool = False,
) -> torch.Tensor:
    """:func:`conv_snake_triton` with its backward (:func:`conv_snake_triton_backward`): one autograd
    function, differentiable in ``a``, ``weight``, ``bias``, ``log_alpha`` and ``log_beta``."""
    return _ConvSnakeFunction.apply(a, weight, bias, log_alpha, log_beta, dilation, length, precise)


def conv_snake_triton_backward(
    grad_h: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    dilation: int,
    length: int,
    *,
    tiles: Tiles | None = None,
    precise: bool = False,
    grad_input: tuple[bool, bool] = (True, True),
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``a``, ``weight``, ``bias``, ``log_alpha`` and ``log_beta`` (each in its tensor's
    dtype; ``a``'s and ``weight``'s None where ``grad_input`` says so), given ``grad_h [B, length, C_out]``
    (any strides): one Triton pass (the convolution recomputed, SnakeBeta's backward as its epilogue:
    ``dy`` and fp32 per-channel sums), then one ``convolution_backward`` of ``dy`` (module docstring)."""
    batch, rows, c_in = a.shape
    w = channels_innermost(weight, a.dtype)
    c_out, taps = w.shape[0], w.shape[2]
    out_rows = rows - (taps - 1) * dilation  # the valid convolution's rows: the layers' layout for cuDNN
    if a.stride(2) != 1 or out_rows < length:
        raise ValueError(f"conv_snake_triton_backward needs a's channels contiguous and {length} + "
                         f"{(taps - 1) * dilation} rows, got strides {a.stride()}, {rows} rows")  # fmt: skip
    tiles = tiles or backward_tiles(c_in, c_out)
    if tiles.block_n + tiles.block_n2 != c_out or c_in % tiles.block_k:
        raise ValueError(f"tiles {tiles} do not fit {c_in} -> {c_out} channels")
    dy = torch.empty((batch, out_rows, c_out), dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(out_rows, tiles.block_m), batch)
    partial = torch.empty((3, grid[0] * batch, c_out), dtype=torch.float32, device=a.device)
    args, kwargs = _backward_args(a, w, bias, log_alpha, log_beta, grad_h, dy, partial, length, dilation, taps, tiles,
                                  precise)  # fmt: skip
    _conv_snake_backward_kernel[grid](*args, **kwargs)
    d_alpha, d_beta, d_bias = partial.sum(1)
    da, dw = _convolution_backward(dy, a, w, dilation, grad_input)
    return (da, dw.to(weight.dtype).view(weight.shape) if dw is not None else None, d_bias.to(bias.dtype),
            d_alpha.to(log_alpha.dtype), d_beta.to(log_beta.dtype))  # fmt: skip


def _convolution_backward(dy, a, w, dilation: int, grad_input: tuple[bool, bool]):
    """``a``'s and ``w``'s gradients of the valid dilated convolution whose output's gradient is ``dy``
    (``[B, out_rows, C_out]``), as ``models/layers.CausalConv1d`` runs it: NHWC views, a dilation folded
    into a ``[B, C, rows / d, d]`` grid where the rows divide."""
    batch, rows, c_in = a.shape
    c_out, taps = w.shape[0], w.shape[2]
    fold = dilation > 1 and rows % dilation == 0
    if fold:
        x = a.reshape(batch, rows // dilation, dilation, c_in).permute(0, 3, 1, 2)
        g = dy.view(batch, dy.shape[1] // dilation, dilation, c_out).permute(0, 3, 1, 2)
        w4, dilations = w.unsqueeze(3), (1, 1)
    else:
        x, g, w4, dilations = (
            a.permute(0, 2, 1).unsqueeze(2),
            dy.permute(0, 2, 1).unsqueeze(2),
            w.unsqueeze(2),
            (1, dilation),
        )
    da, dw, _ = torch.ops.aten.convolution_backward(
        g, x, w4, None, (1, 1), (0, 0), dilations, False, (0, 0), 1, (grad_input[0], grad_input[1], False)
    )
    if da is not None:
        da = da.permute(0, 2, 3, 1).reshape(batch, rows, c_in) if fold else da.squeeze(2).permute(0, 2, 1)
    return da, dw.reshape(c_out, c_in, taps) if dw is not None else None


def _backward_args(a, w, bias, log_alpha, log_beta, grad_h, dy, partial, length: int, dilation: int, taps: int,
                   tiles: Tiles, precise: bool) -> tuple[tuple, dict]:  # fmt: skip
    """The backward kernel's arguments (the launcher's and :func:`hopper_launches`' one source)."""
    c_in, c_out = a.shape[2], w.shape[0]
    args = (a, w, bias, log_alpha, log_beta, grad_h, dy, partial, length, dy.shape[1], dilation, a.stride(0),
            a.stride(1), *grad_h.stride(), dy.stride(0), dy.stride(1))  # fmt: skip
    kwargs = dict(C_IN=c_in, C_OUT=c_out, TAPS=taps, PRECISE=precise, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                  BLOCK_N2=tiles.block_n2, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages)  # fmt: skip
    return args, kwargs


class _ConvSnakeFunction(torch.autograd.Function):
    """The Triton forward and backward as one autograd node; it saves ``a`` and the parameters only."""

    @staticmethod
    def forward(ctx, a, weight, bias, log_alpha, log_beta, dilation, length, precise):
        h = conv_snake_triton(a, weight, bias, log_alpha, log_beta, dilation, length, precise=precise)
        ctx.save_for_backward(a, weight, bias, log_alpha, log_beta)
        ctx.dilation, ctx.length, ctx.precise = dilation, length, precise
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_h):
        need = ctx.needs_input_grad
        da, dw, d_bias, d_alpha, d_beta = conv_snake_triton_backward(
            grad_h, *ctx.saved_tensors, ctx.dilation, ctx.length, precise=ctx.precise, grad_input=(need[0], need[1])
        )
        return (da, dw, d_bias if need[2] else None, d_alpha if need[3] else None, d_beta if need[4] else None,
                None, None, None)  # fmt: skip


def hopper_launches(layers) -> list:
    """The launches the decoder's residual units make (``kernels/launches.py``'s convention): per width
    :func:`widths_supported` takes, the forward and the backward (training), bf16 (fp16 is a variant of
    the same tiles; fp32 runs the layers), the output's gradient contiguous (other strides are variants).
    The dilation is a runtime argument: one compile serves 1, 3 and 9."""
    from omni_lightning.kernels.launches import MockTensor, launch, stages_label

    convs = [
        x for x in layers if x.kind == "conv" and x.kernel == TAPS and widths_supported(x.channels_in, x.channels_out)
    ]
    out = []
    for c_in, c_out in dict.fromkeys((x.channels_in, x.channels_out) for x in convs):
        same = [x for x in convs if (x.channels_in, x.channels_out) == (c_in, c_out)]
        rows = int(max(x.rows_per_second for x in same))
        a, h = MockTensor(torch.bfloat16, (1, rows + 6 * 9, c_in)), MockTensor(torch.bfloat16, (1, rows, c_out))
        w, p = MockTensor(torch.bfloat16, (c_out, TAPS, c_in)), MockTensor(torch.bfloat16, (c_out,))
        args, kwargs = _launch_args(a, w, p, p, p, h, rows, 3, TAPS, launch_tiles(c_in, c_out), False)
        label = stages_label(same, c_out)
        out.append(launch("conv_snake", _conv_snake_kernel, args, kwargs, label, "bf16"))
        partial = MockTensor(torch.float32, (3, 1, c_out))
        args, kwargs = _backward_args(a, w, p, p, p, h, h, partial, rows, 3, TAPS, backward_tiles(c_in, c_out), False)
        out.append(launch("conv_snake.backward", _conv_snake_backward_kernel, args, kwargs, label, "bf16"))
    return out


if triton is not None:

    @triton.jit
    def _snake_store(acc, n, h_ptr, m, m_mask, bias_ptr, la_ptr, lb_ptr, PRECISE: tl.constexpr):
        """``snake(acc + bias)`` of output channels ``n`` into rows ``m`` of ``h`` (fp32 until the store)."""
        v = acc + tl.load(bias_ptr + n).to(tl.float32)[None, :]
        alpha = tl.exp(tl.load(la_ptr + n).to(tl.float32))
        inv_beta = 1.0 / (tl.exp(tl.load(lb_ptr + n).to(tl.float32)) + 1e-9)
        s = _sin(v * alpha[None, :], PRECISE)
        v = v + inv_beta[None, :] * s * s
        tl.store(h_ptr + m[:, None] + n[None, :], v.to(h_ptr.dtype.element_ty), mask=m_mask[:, None])

    # lengths and dilations vary from call to call; strides are specialized (multiples of 16 elements:
    # 16-byte loads that the pipeliner turns into asynchronous copies). One compile per width and tiles
    @triton.jit(do_not_specialize=["length", "dilation"])
    def _conv_snake_kernel(a_ptr, w_ptr, bias_ptr, la_ptr, lb_ptr, h_ptr, length, dilation, a_sb, a_st, h_sb, h_st,
                           C_IN: tl.constexpr, C_OUT: tl.constexpr, TAPS: tl.constexpr,
                           PRECISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """Rows ``BLOCK_M * pid .. + BLOCK_M`` of batch row ``b``, every output channel (module docstring)."""
        b = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = t < length
        k = tl.arange(0, BLOCK_K)
        n1 = tl.arange(0, BLOCK_N)
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if BLOCK_N2 > 0:
            n2 = BLOCK_N + tl.arange(0, BLOCK_N2)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N2], dtype=tl.float32)
        a_rows = a_ptr + b * a_sb + t.to(tl.int64)[:, None] * a_st
        for kk in range(0, TAPS * C_IN, BLOCK_K):
            tap = kk // C_IN
            k0 = tl.multiple_of(kk - tap * C_IN, BLOCK_K)
            x = tl.load(a_rows + tap * dilation * a_st + (k0 + k)[None, :], mask=m_mask[:, None], other=0.0)
            w_k = w_ptr + tap * C_IN + (k0 + k)[:, None]  # B tiles K-major: [C_out, taps, C_in] in memory
            acc1 = tl.dot(x, tl.load(w_k + n1[None, :] * (TAPS * C_IN)), acc1)
            if BLOCK_N2 > 0:
                acc2 = tl.dot(x, tl.load(w_k + n2[None, :] * (TAPS * C_IN)), acc2)
        h_rows = b * h_sb + t.to(tl.int64) * h_st
        _snake_store(acc1, n1, h_ptr, h_rows, m_mask, bias_ptr, la_ptr, lb_ptr, PRECISE)
        if BLOCK_N2 > 0:
            _snake_store(acc2, n2, h_ptr, h_rows, m_mask, bias_ptr, la_ptr, lb_ptr, PRECISE)

    @triton.jit
    def _snake_grad_store(acc, n, t, len_mask, out_mask, g_rows, g_sc, g_ptr, dy_ptr, dy_rows, partial_ptr, row,
                          programs, bias_ptr, la_ptr, lb_ptr, C_OUT: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
        """SnakeBeta's backward at ``u = acc + bias`` for output channels ``n`` (``kernels/snake_beta.py``'s
        backward): ``dy`` into rows ``dy_rows``, the channels' sums into ``partial[:, row]``."""
        u = acc + tl.load(bias_ptr + n).to(tl.float32)[None, :]
        alpha = tl.exp(tl.load(la_ptr + n).to(tl.float32))
        e_beta = tl.exp(tl.load(lb_ptr + n).to(tl.float32))
        inv_beta = 1.0 / (e_beta + 1e-9)
        g = tl.load(g_ptr + g_rows[:, None] + n[None, :] * g_sc, mask=len_mask[:, None], other=0.0).to(tl.float32)
        s, c = _sin_cos(u * alpha[None, :], PRECISE)
        g_sin2 = g * inv_beta[None, :] * (2.0 * s * c)  # zero where g is: rows past the length
        dy = g + g_sin2 * alpha[None, :]
        tl.store(dy_ptr + dy_rows[:, None] + n[None, :], dy.to(dy_ptr.dtype.element_ty), mask=out_mask[:, None])
        tl.store(partial_ptr + row * C_OUT + n, tl.sum(g_sin2 * u, axis=0) * alpha)
        tl.store(partial_ptr + (programs + row) * C_OUT + n, -tl.sum(g * s * s, axis=0) * e_beta * inv_beta * inv_beta)
        tl.store(partial_ptr + (2 * programs + row) * C_OUT + n, tl.sum(dy, axis=0))

    @triton.jit(do_not_specialize=["length", "out_rows", "dilation"])
    def _conv_snake_backward_kernel(a_ptr, w_ptr, bias_ptr, la_ptr, lb_ptr, g_ptr, dy_ptr, partial_ptr, length,
                                    out_rows, dilation, a_sb, a_st, g_sb, g_st, g_sc, dy_sb, dy_st,
                                    C_IN: tl.constexpr, C_OUT: tl.constexpr, TAPS: tl.constexpr,
                                    PRECISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """Rows ``BLOCK_M * pid .. + BLOCK_M`` of batch row ``b``: the forward's convolution again, then
        ``dy`` for every output channel (rows past ``length`` up to ``out_rows``: zeros) and the sums."""
        b = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        out_mask = t < out_rows
        k = tl.arange(0, BLOCK_K)
        n1 = tl.arange(0, BLOCK_N)
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if BLOCK_N2 > 0:
            n2 = BLOCK_N + tl.arange(0, BLOCK_N2)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N2], dtype=tl.float32)
        len_mask = t < length
        a_rows = a_ptr + b * a_sb + t.to(tl.int64)[:, None] * a_st
        for kk in range(0, TAPS * C_IN, BLOCK_K):
            tap = kk // C_IN
            k0 = tl.multiple_of(kk - tap * C_IN, BLOCK_K)
            x = tl.load(a_rows + tap * dilation * a_st + (k0 + k)[None, :], mask=len_mask[:, None], other=0.0)
            w_k = w_ptr + tap * C_IN + (k0 + k)[:, None]
            acc1 = tl.dot(x, tl.load(w_k + n1[None, :] * (TAPS * C_IN)), acc1)
            if BLOCK_N2 > 0:
                acc2 = tl.dot(x, tl.load(w_k + n2[None, :] * (TAPS * C_IN)), acc2)
        row = b * tl.num_programs(0) + tl.program_id(0)
        programs = tl.num_programs(0) * tl.num_programs(1)
        g_rows = b * g_sb + t.to(tl.int64) * g_st
        dy_rows = b * dy_sb + t.to(tl.int64) * dy_st
        _snake_grad_store(acc1, n1, t, len_mask, out_mask, g_rows, g_sc, g_ptr, dy_ptr, dy_rows, partial_ptr, row,
                          programs, bias_ptr, la_ptr, lb_ptr, C_OUT, PRECISE)  # fmt: skip
        if BLOCK_N2 > 0:
            _snake_grad_store(acc2, n2, t, len_mask, out_mask, g_rows, g_sc, g_ptr, dy_ptr, dy_rows, partial_ptr,
                              row, programs, bias_ptr, la_ptr, lb_ptr, C_OUT, PRECISE)  # fmt: skip
