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
the two). Tile settings are data (:func:`launch_tiles`), each compiled clean for sm_90a (wgmma, no spills,
within shared memory: ``scripts/kernels/kernel_report.py``). Not here: fp32 inputs (a tensor-core dot in fp32
is TF32, coarser than cuDNN's fp32 convolution: fp32 stays on the layers), the autograd backward
(training keeps the layers), and channels that do not split into two powers of two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omni_lightning.kernels.snake_beta import snake_beta_reference, triton

if triton is not None:
    import triton.language as tl

    from omni_lightning.kernels.snake_beta import _sin

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


def channels_innermost(weight: torch.Tensor) -> torch.Tensor:
    """A ``[C_out, C_in, taps]`` convolution weight with its input channels innermost (strides
    ``(taps * C_in, 1, C_in)``): itself when it is so already, else a copy."""
    w = weight.reshape(weight.shape[0], weight.shape[1], -1) if weight.dim() != 3 else weight
    return w if w.stride(1) == 1 and w.stride(2) == w.shape[1] else w.transpose(1, 2).contiguous().transpose(1, 2)


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
    w = channels_innermost(weight.to(a.dtype))  # under autocast the weight is fp32: the dot takes a's dtype
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


def hopper_launches(layers) -> list:
    """The launches the decoder's residual units make (``kernels/launches.py``'s convention): one per
    width :func:`widths_supported` takes, bf16 (fp16 is a variant of the same tiles; fp32 runs the
    layers). The dilation is a runtime argument: one compile serves 1, 3 and 9."""
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
        out.append(launch("conv_snake", _conv_snake_kernel, args, kwargs, stages_label(same, c_out), "bf16"))
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
