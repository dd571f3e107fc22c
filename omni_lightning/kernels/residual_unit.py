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

from omni_lightning.kernels.launches import DTYPES, KernelLaunch, MockTensor, launch
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
    settings = unit_settings(channels, block_t, block_k, num_warps, num_stages)
    args, kwargs = _unit_args(a, x, w1, b1, log_alpha, log_beta, w2, dilation, precise, settings)
    _residual_unit_kernel[(triton.cdiv(length, settings["BLOCK_T"]), batch)](*args, **kwargs)
    return x


def unit_settings(channels, block_t=None, block_k=None, num_warps=None, num_stages=None) -> dict:
    """The launcher's tile (all channels in one, padded to a power of two), warps and stages (4 and 3 by default)."""
    block_c = max(16, 1 << (channels - 1).bit_length())
    return dict(BLOCK_T=block_t or (64 if block_c <= 128 else 32), BLOCK_C=block_c, BLOCK_K=block_k or min(block_c, 64),
                num_warps=num_warps or 4, num_stages=num_stages or 3)  # fmt: skip


def _unit_args(a, x, w1, b1, log_alpha, log_beta, w2, dilation, precise, settings) -> tuple[tuple, dict]:
    args = (a, x, w1, b1, log_alpha, log_beta, w2, x.shape[1], x.shape[2], a.stride(0), a.stride(1), x.stride(0),
            x.stride(1), *w1.stride(), w2.stride(0), w2.stride(1))  # fmt: skip
    fp32 = x.dtype == torch.float32
    return args, dict(DILATION=dilation, TAPS=w1.shape[-1], FP32=fp32, PRECISE=precise, **settings)


def hopper_launches(layers) -> list[KernelLaunch]:
    """Opt-in (``default_path=False``): the launches ``Kernels.for_inference(fused_units=True)`` makes,
    one per unit width up to :data:`MAX_CHANNELS` and dilation, bf16 and fp32, at the launcher's
    default tile. Listed for the record (issue 50: they spill); the report compiles them with ``--opt-in``."""
    units = [layer for layer in layers if layer.kind == "conv" and layer.kernel > 1 and layer.groups == 1
             and layer.channels_in == layer.channels_out <= MAX_CHANNELS]  # fmt: skip
    launches = []
    for c, dilation, taps in dict.fromkeys((u.channels_in, u.dilation, u.kernel) for u in units):
        stages = ", ".join(dict.fromkeys(u.stage for u in units if u.channels_in == c))
        label, length = f"{c} ch, dilation {dilation} ({stages})", 1000
        for name, dtype in DTYPES.items():
            a = MockTensor(dtype, (1, length + (taps - 1) * dilation, c))
            x, w1, w2 = MockTensor(dtype, (1, length, c)), MockTensor(dtype, (c, c, taps)), MockTensor(dtype, (c, c, 1))
            vec = MockTensor(dtype, (c,))
            args, kwargs = _unit_args(a, x, w1, vec, vec, vec, w2, dilation, False, unit_settings(c))
            launches.append(launch("residual_unit", _residual_unit_kernel, args, kwargs, label, name,
                                   default_path=False))  # fmt: skip
    return launches


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
