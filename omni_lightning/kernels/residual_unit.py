"""A decoder residual unit in one kernel: the dilated convolution, its SnakeBeta, the 1x1 convolution and the
residual add (optionally the first SnakeBeta too, as the convolution's prologue): the op, in one file.

``models/layers.DecoderResidualUnit`` computes, on the time-major residual stream ``x [B, T, C]``:

    a = snake1(x + pending)            after the dilated convolution's history (kernels/snake_beta.py)
    h = snake2(conv7(a, dilation) + b1)                              (kernels/conv_snake.py)
    x = x + h @ W2^T                   the 1x1 convolution; its bias is carried as the next ``pending``

:func:`residual_unit_triton` runs the last two lines as one kernel, in place on ``x``: per tile of rows
the seven taps' implicit GEMM as ``conv_snake`` runs it (output channels in two power-of-two parts
sharing each A tile), SnakeBeta on the fp32 accumulators, ``h`` rounded to ``x``'s dtype (as the layers
store it), then a second GEMM of that ``h`` by ``W2`` with the stream's own rows as its accumulator.
``h`` never reaches memory: against conv_snake and the in-place GEMM, a write and a read of ``h``
fewer per unit (4 of the unit's 14 bytes per row and channel in 16 bits) and one launch.
:func:`residual_unit_prologue_triton` also computes ``a`` on the fly, for each A tile from ``x``,
``pending``, the history and the junk rows (``snake_beta``'s rules): ``a`` never reaches memory either
(4 more bytes), at the price of SnakeBeta recomputed once per tap (7 sines per element, not 1), and an
output of its own (programs read rows of ``x`` that others write). The layers do not call it: the
next chunk's history is ``a``'s last rows, which this op does not write (the unit's first SnakeBeta
saves them today); the kernel report and the interpreter judge it first.

Tile settings are data (:func:`unit_tiles`, :data:`CANDIDATES`), each judged by the kernel report
(``scripts/kernels/kernel_report.py --opt-in``: wgmma, registers, spills, shared memory) before any GPU
time. Which units run it is ``Kernels.units``' table (``kernels/unit_paths.py``): opt-in, everywhere
(``Kernels.for_inference(fused_units=True)``) or up to 96 channels (``fused_units="per-width"``), until
a GPU measures whole forwards of each against conv_snake and the in-place GEMM
(``scripts/bench/bench_forward.py --units``). Not here: fp32 on the GPU (a tensor-core dot in fp32 is
TF32: fp32 stays on the layers), a backward (inference only), widths ``conv_snake`` does not take.
"""

from __future__ import annotations

import torch

from omni_lightning.kernels.conv_snake import TAPS, Tiles, channels_innermost, split_channels, widths_supported
from omni_lightning.kernels.launches import MockTensor
from omni_lightning.kernels.snake_beta import snake_beta_reference, triton

if triton is not None:
    import triton.language as tl

    from omni_lightning.kernels.snake_beta import _sin

# (rows per program, warps): one warpgroup over 128 rows holds 128 x C fp32 accumulators twice over at
# 192 channels (the convolution's, then the 1x1's beside h): more than 255 registers; 8 warps or 64 rows
# halve that (the report says which spill)
CANDIDATES = ((128, 4), (128, 8), (64, 4))


def unit_tiles(channels: int, block_m: int = 128, num_warps: int = 8) -> Tiles:
    """The setting :func:`residual_unit_triton` uses for ``channels`` (default: 128 rows, 8 warps: the
    report's clean setting at 96 and 192 channels), 32 channels a K step, three stages."""
    first, rest = split_channels(channels)
    return Tiles(block_m, first, rest, 32, num_warps, 3)


def residual_unit_reference(x, a, w1, b1, log_alpha2, log_beta2, w2, dilation: int) -> torch.Tensor:
    """The layers' arithmetic (``x``, ``a`` as the module docstring says; ``w1 [C, C, taps]``, ``w2 [C, C, 1]``):
    a new ``x + snake2(conv7(a) + b1) @ w2^T`` (``h`` in ``x``'s dtype, one rounding after the GEMM)."""
    length, channels = x.shape[1], x.shape[2]
    rows = a[:, : (w1.shape[-1] - 1) * dilation + length].transpose(1, 2)
    y = torch.nn.functional.conv1d(rows, w1.to(a.dtype), dilation=dilation).transpose(1, 2)
    h = snake_beta_reference(y, log_alpha2, log_beta2, b1).to(x.dtype)
    weight = w2.reshape(channels, channels).t().to(x.dtype)
    return torch.addmm(x.reshape(-1, channels), h.reshape(-1, channels), weight).view(x.shape)


def residual_unit_prologue_reference(x, pending, history, fresh, junk: int, log_alpha1, log_beta1, w1, b1, log_alpha2,
                                     log_beta2, w2, dilation: int) -> torch.Tensor:  # fmt: skip
    """:func:`residual_unit_reference` of ``a = snake_beta_reference(x, log_alpha1, log_beta1, pending,
    context=history, ...)`` (``history [B, 6 * dilation, C]`` or None: zeros; ``fresh`` as there)."""
    context = (w1.shape[-1] - 1) * dilation
    a = snake_beta_reference(x, log_alpha1, log_beta1, pending, context=history, context_len=context, fresh=fresh,
                             junk=junk)  # fmt: skip
    return residual_unit_reference(x, a, w1, b1, log_alpha2, log_beta2, w2, dilation)


def _checked(x: torch.Tensor, w1: torch.Tensor, tiles: Tiles | None) -> Tiles:
    channels = x.shape[2]
    if not widths_supported(channels, channels) or w1.shape[:2] != (channels, channels):
        raise ValueError(f"a residual unit kernel takes C -> C with 32-256 channels (two powers of two), got "
                         f"{x.shape[2]} channels and a weight of {tuple(w1.shape)}")  # fmt: skip
    if x.stride(2) != 1:
        raise ValueError(f"x's channels must be contiguous, got strides {x.stride()}")
    tiles = tiles or unit_tiles(channels)
    if tiles.block_n + tiles.block_n2 != channels or channels % tiles.block_k:
        raise ValueError(f"tiles {tiles} do not fit {channels} channels")
    return tiles


def residual_unit_triton(x, a, w1, b1, log_alpha2, log_beta2, w2, dilation: int, *, tiles: Tiles | None = None,
                         precise: bool = False) -> torch.Tensor:  # fmt: skip
    """:func:`residual_unit_reference` as one Triton kernel on CUDA, in place on ``x`` (returned; no
    autograd). ``a [B, >= 6 * dilation + T, C]`` with contiguous channels. ``precise``: libdevice's sine."""
    tiles = _checked(x, w1, tiles)
    batch, length, _ = x.shape
    if a.shape[1] < length + (TAPS - 1) * dilation or a.stride(2) != 1:
        raise ValueError(f"a {tuple(a.shape)} (strides {a.stride()}) does not hold {length} rows after its history")
    args, kwargs = _launch_args(x, a, None, None, False, 0, None, None, w1, b1, log_alpha2, log_beta2, w2, x, dilation,
                                tiles, precise, prologue=False)  # fmt: skip
    _residual_unit_kernel[(triton.cdiv(length, tiles.block_m), batch)](*args, **kwargs)
    return x


def residual_unit_prologue_triton(x, pending, history, fresh, junk: int, log_alpha1, log_beta1, w1, b1, log_alpha2,
                                  log_beta2, w2, dilation: int, *, tiles: Tiles | None = None,
                                  precise: bool = False) -> torch.Tensor:  # fmt: skip
    """:func:`residual_unit_prologue_reference` as one Triton kernel on CUDA, into a new tensor (no autograd)."""
    tiles = _checked(x, w1, tiles)
    batch, length, _ = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    args, kwargs = _launch_args(x, x, pending, history, fresh, junk, log_alpha1, log_beta1, w1, b1, log_alpha2,
                                log_beta2, w2, out, dilation, tiles, precise, prologue=True)  # fmt: skip
    _residual_unit_kernel[(triton.cdiv(length, tiles.block_m), batch)](*args, **kwargs)
    return out


def _launch_args(x, a, pending, history, fresh, junk, la1, lb1, w1, b1, la2, lb2, w2, out, dilation, tiles, precise,
                 prologue: bool) -> tuple[tuple, dict]:  # fmt: skip
    """The kernel's arguments (the launchers' and :func:`hopper_launches`' one source). Unused pointers
    take ``x``'s; flags that vary call by call (history, per-row fresh) are runtime arguments."""
    channels = x.shape[2]
    w1 = channels_innermost(w1.to(x.dtype)) if isinstance(w1, torch.Tensor) else w1
    w2 = w2.reshape(channels, channels).to(x.dtype).contiguous() if isinstance(w2, torch.Tensor) else w2
    per_row = isinstance(fresh, torch.Tensor)
    if per_row:
        fresh_ptr = (fresh if fresh.dtype in (torch.bool, torch.uint8) else fresh != 0).view(torch.uint8)
    else:  # never read: a byte pointer all the same (the kernel compares the byte it would load)
        fresh_ptr = x.view(torch.uint8) if isinstance(x, torch.Tensor) else MockTensor(torch.uint8)
    junk = junk if junk and fresh is not False else 0
    hist = history if history is not None else x
    args = (a, x, pending if pending is not None else x, hist, fresh_ptr, la1 if la1 is not None else x,
            lb1 if lb1 is not None else x, w1, b1, la2, lb2, w2, out, x.shape[1], dilation, (TAPS - 1) * dilation,
            junk, int(history is not None), int(per_row), a.stride(0), a.stride(1), x.stride(0), x.stride(1),
            hist.stride(0), hist.stride(1), out.stride(0), out.stride(1))  # fmt: skip
    kwargs = dict(C=channels, TAPS=TAPS, PROLOGUE=prologue, PRECISE=precise, BLOCK_M=tiles.block_m,
                  BLOCK_N=tiles.block_n, BLOCK_N2=tiles.block_n2, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages)  # fmt: skip
    return args, kwargs


def hopper_launches(layers) -> list:
    """The launches of both launchers on the decoder's residual units (``kernels/launches.py``'s convention),
    bf16, at every setting of :data:`CANDIDATES` (opt-in: ``default_path=False``); the in-place one at
    :func:`unit_tiles`' setting names the tables of unit paths that run it at its width (``choices``).
    One compile serves every dilation, length, history and fresh flag (runtime arguments)."""
    from omni_lightning.kernels.launches import launch, stages_label
    from omni_lightning.kernels.unit_paths import CHOICES, NAMES

    convs = [x for x in layers if x.kind == "conv" and x.kernel == TAPS and x.channels_in == x.channels_out
             and widths_supported(x.channels_in, x.channels_out)]  # fmt: skip
    out = []
    for channels in dict.fromkeys(x.channels_in for x in convs):
        same = [x for x in convs if x.channels_in == channels]
        rows = int(max(x.rows_per_second for x in same))
        bf16 = torch.bfloat16
        x, a = MockTensor(bf16, (1, rows, channels)), MockTensor(bf16, (1, rows + 6 * 9, channels))
        w1, w2 = MockTensor(bf16, (channels, TAPS, channels)), MockTensor(bf16, (channels, channels))
        p, f32, hist = MockTensor(bf16, (channels,)), MockTensor(torch.float32, (channels,)), a
        for prologue in (False, True):
            for block_m, warps in CANDIDATES:
                tiles = unit_tiles(channels, block_m, warps)
                args, kwargs = _launch_args(x, a if not prologue else x, f32 if prologue else None,
                                            hist if prologue else None, True, 6 if prologue else 0, p, p, w1, p, p, p,
                                            w2, x, 3, tiles, False, prologue)  # fmt: skip
                name = "residual_unit.prologue" if prologue else "residual_unit"
                runs = not prologue and tiles == unit_tiles(channels)  # what the layers launch (no prologue)
                choices = tuple(n for n, key in NAMES.items() if runs and any(
                    CHOICES[key].path(channels, x.dilation) == "residual_unit" for x in same))  # fmt: skip
                out.append(launch(name, _residual_unit_kernel, args, kwargs, stages_label(same, channels), "bf16",
                                  default_path=False, choices=choices))  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _snake(v, n, bias_ptr, la_ptr, lb_ptr, PRECISE: tl.constexpr):
        """``snake(v + bias)`` over channels ``n`` of ``v [rows, n]``, fp32."""
        v = v + tl.load(bias_ptr + n).to(tl.float32)[None, :]
        alpha = tl.exp(tl.load(la_ptr + n).to(tl.float32))
        inv_beta = 1.0 / (tl.exp(tl.load(lb_ptr + n).to(tl.float32)) + 1e-9)
        s = _sin(v * alpha[None, :], PRECISE)
        return v + inv_beta[None, :] * s * s

    # lengths, dilations and the flags vary from call to call; strides are specialized (multiples of 16
    # elements: 16-byte loads). One compile per width, design and tiles
    @triton.jit(do_not_specialize=["length", "dilation", "context_len", "junk", "has_history", "per_row"])
    def _residual_unit_kernel(a_ptr, x_ptr, pend_ptr, hist_ptr, fresh_ptr, la1_ptr, lb1_ptr, w1_ptr, b1_ptr, la2_ptr,
                              lb2_ptr, w2_ptr, out_ptr, length, dilation, context_len, junk, has_history, per_row,
                              a_sb, a_st, x_sb, x_st, h_sb, h_st, o_sb, o_st, C: tl.constexpr, TAPS: tl.constexpr,
                              PROLOGUE: tl.constexpr, PRECISE: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """Rows ``BLOCK_M * pid .. + BLOCK_M`` of batch row ``b``, every channel (module docstring)."""
        b = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = t < length
        k = tl.arange(0, BLOCK_K)
        n1 = tl.arange(0, BLOCK_N)
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if BLOCK_N2 > 0:
            n2 = BLOCK_N + tl.arange(0, BLOCK_N2)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N2], dtype=tl.float32)
        if PROLOGUE:
            fresh = tl.load(fresh_ptr + b, mask=per_row != 0, other=1) != 0  # not per row: every row is
        a_rows = a_ptr + b * a_sb + t.to(tl.int64)[:, None] * a_st
        for kk in range(0, TAPS * C, BLOCK_K):
            tap = kk // C
            ch = tl.multiple_of(kk - tap * C, BLOCK_K) + k
            if PROLOGUE:  # a's rows from x (snake1 of x + pending), the history or zeros
                r = t + tap * dilation  # rows of the buffer a would be: history first
                s = r - context_len
                in_x = m_mask & (s >= 0)
                v = tl.load(x_ptr + b * x_sb + s.to(tl.int64)[:, None] * x_st + ch[None, :], mask=in_x[:, None],
                            other=0.0).to(tl.float32)  # fmt: skip
                v = _snake(v, ch, pend_ptr, la1_ptr, lb1_ptr, PRECISE)
                v = tl.where((s < junk)[:, None] & fresh, 0.0, v)
                in_h = m_mask & (s < 0) & (has_history != 0)
                hv = tl.load(hist_ptr + b * h_sb + r.to(tl.int64)[:, None] * h_st + ch[None, :], mask=in_h[:, None],
                             other=0.0).to(tl.float32)  # fmt: skip
                x_tile = tl.where((s < 0)[:, None], hv, v).to(w1_ptr.dtype.element_ty)
            else:
                x_tile = tl.load(a_rows + tap * dilation * a_st + ch[None, :], mask=m_mask[:, None], other=0.0)
            w_k = w1_ptr + tap * C + ch[:, None]  # B tiles K-major: [C, taps, C] in memory
            acc1 = tl.dot(x_tile, tl.load(w_k + n1[None, :] * (TAPS * C)), acc1)
            if BLOCK_N2 > 0:
                acc2 = tl.dot(x_tile, tl.load(w_k + n2[None, :] * (TAPS * C)), acc2)
        # snake2 in fp32, h rounded to the stream's dtype as the layers store it; then x + h @ W2^T
        h1 = _snake(acc1, n1, b1_ptr, la2_ptr, lb2_ptr, PRECISE).to(out_ptr.dtype.element_ty)
        if BLOCK_N2 > 0:
            h2 = _snake(acc2, n2, b1_ptr, la2_ptr, lb2_ptr, PRECISE).to(out_ptr.dtype.element_ty)
        x_rows = x_ptr + b * x_sb + t.to(tl.int64)[:, None] * x_st
        o_rows = out_ptr + b * o_sb + t.to(tl.int64)[:, None] * o_st
        o1 = tl.load(x_rows + n1[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        o1 = tl.dot(h1, tl.load(w2_ptr + n1[None, :] * C + n1[:, None]), o1)  # B[k, n] = W2[n, k]
        if BLOCK_N2 > 0:
            o1 = tl.dot(h2, tl.load(w2_ptr + n1[None, :] * C + n2[:, None]), o1)
            o2 = tl.load(x_rows + n2[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
            o2 = tl.dot(h1, tl.load(w2_ptr + n2[None, :] * C + n1[:, None]), o2)
            o2 = tl.dot(h2, tl.load(w2_ptr + n2[None, :] * C + n2[:, None]), o2)
            tl.store(o_rows + n2[None, :], o2.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
        tl.store(o_rows + n1[None, :], o1.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
