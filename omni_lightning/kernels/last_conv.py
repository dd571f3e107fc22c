"""The decoder's output layer (SnakeBeta, the ``C -> 1`` convolution, the clamp) as one pass: the op, in one file.

``models/layers.output_waveform`` computes, from the last decoder block's time-major stream ``x [B, T, C]``
(its true value ``x + pending``, ``models/layers.py``):

    a   = snake(x + pending)                 after the convolution's ``taps - 1`` rows of history
                                             (kernels/snake_beta.py: junk rows of fresh rows zeroed,
                                             rounded to x's dtype)
    wav = clamp(conv(a, weight) + bias, -1, 1)    [B, T], the first ``junk`` samples of fresh rows zero

and, for a stateful forward, the convolution's next history: ``a``'s ``taps - 1`` rows before each row's
``window_end`` (``Step.save``'s window). The layers run this as a SnakeBeta pass (``x`` read, ``a``
written), a cuDNN convolution with one output channel (``a`` read, after a copy to the layout it takes)
and the clamp; here ``x`` is read once and only the waveform (and the window) reach memory.

:func:`last_conv_triton`: per program ``BLOCK_T`` rows of one batch row (the first ``taps - 1`` of them
the previous program's last, re-read: a halo), ``a`` in registers, then the taps as a small GEMM,
``P = a @ W`` (``[BLOCK_T, C] x [C, 8]``, taps padded to 8 with zeros; fp32 accumulators, in two
power-of-two parts of the channels like ``conv_snake``'s, 96 = 64 + 32), and each output the sum of
a diagonal of ``P``, ``y[u] = sum_j P[u - taps + 1 + j, j]`` (``tl.gather`` along the rows). SnakeBeta is
computed once per element (a sine per element: once per tap would be seven). Not here: autograd
(inference only: the layers train), a dilated convolution, more than 8 taps or one output channel, and
streams much wider than the model's (a tile holds all of a row's channels in registers).
Tile settings are data (:func:`last_conv_tiles`, :data:`CANDIDATES`), each compiled for sm_90a by the
kernel report (``scripts/kernels/kernel_report.py --opt-in``) before any GPU time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from omni_lightning.kernels.conv_snake import split_channels
from omni_lightning.kernels.launches import MockTensor
from omni_lightning.kernels.snake_beta import snake_beta_reference, triton

if triton is not None:
    import triton.language as tl

    from omni_lightning.kernels.snake_beta import _sin

MAX_TAPS = 8  # the small GEMM's N: taps padded to 8 with zero weights


class Tiles(NamedTuple):
    """Rows per program (the first ``taps - 1`` a halo), the two channel parts, warps and stages."""

    block_t: int
    block_c: int
    block_c2: int
    num_warps: int = 4
    num_stages: int = 1


# (rows per program, warps) the kernel report compiles at the model's widths; the first is the launcher's
CANDIDATES = ((128, 4), (128, 8), (64, 4), (256, 8), (256, 4))


def channel_parts(channels: int) -> tuple[int, int]:
    """The two power-of-two parts of ``channels`` each GEMM step takes (96 = 64 + 32), or one part of the
    next power of two (at least 16, a bf16 dot's K) with the channels past ``channels`` masked."""
    parts = split_channels(channels)
    if parts is not None and parts[0] >= 16:
        return parts
    return max(16, 1 << (channels - 1).bit_length()), 0


def last_conv_tiles(channels: int, block_t: int = CANDIDATES[0][0], num_warps: int = CANDIDATES[0][1]) -> Tiles:
    """The launch setting for ``channels`` (default: :data:`CANDIDATES`' first)."""
    return Tiles(block_t, *channel_parts(channels), num_warps)


def _window_ends(window_end, batch: int, device) -> torch.Tensor:
    if isinstance(window_end, torch.Tensor):
        return window_end.to(device=device, dtype=torch.long).expand(batch)
    return torch.full((batch,), int(window_end), dtype=torch.long, device=device)


def last_conv_reference(x, log_alpha, log_beta, pending, weight, bias, *, history=None, fresh=False, junk: int = 0,
                        window_end=None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The op in torch, as the layers compute it: ``x [B, T, C]``, ``weight [1, C, taps]``, ``bias [1]``,
    ``history [B, taps - 1, C]`` or None (zeros), ``fresh`` a bool per row or one for all, ``window_end``
    None (no window), an int or an int64 ``[B]``: rows ``x`` ends each window at (``T``: its last rows).
    Returns ``wav [B, T]`` in ``x``'s dtype and the window ``[B, taps - 1, C]`` (or None)."""
    channels, taps = x.shape[2], weight.shape[-1]
    a = snake_beta_reference(x, log_alpha, log_beta, pending, context=history, context_len=taps - 1, fresh=fresh,
                             junk=junk)  # fmt: skip
    w = weight.reshape(1, channels, taps).to(a.dtype)
    wav = F.conv1d(a.transpose(1, 2), w, bias.to(a.dtype))[:, 0].clamp(-1.0, 1.0)
    if junk and fresh is not False:  # the samples before a request's start
        keep = torch.zeros(()) if fresh is True else (~fresh.bool()).to(wav.dtype)[:, None]
        wav = torch.cat((wav[:, :junk] * keep.to(wav), wav[:, junk:]), dim=1)
    if window_end is None:
        return wav, None
    rows = _window_ends(window_end, x.shape[0], x.device)[:, None] + torch.arange(taps - 1, device=x.device)
    return wav, a.gather(1, rows[..., None].expand(-1, -1, channels))


def last_conv_triton(x, log_alpha, log_beta, pending, weight, bias, *, history=None, fresh=False, junk: int = 0,
                     window_end=None, tiles: Tiles | None = None,
                     precise: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """:func:`last_conv_reference` as one Triton kernel on CUDA (no autograd). ``x``'s channels must be
    contiguous; the weight is read in any layout. ``precise``: libdevice's sine (the interpreter's)."""
    batch, length, channels = x.shape
    taps = weight.shape[-1]
    if weight.shape[:2] != (1, channels) or weight.dim() != 3 or not 2 <= taps <= MAX_TAPS or bias.numel() != 1:
        raise ValueError(f"last_conv takes a {channels} -> 1 convolution of 2 to {MAX_TAPS} taps with a bias, got "
                         f"a weight of {tuple(weight.shape)} and a bias of {tuple(bias.shape)}")  # fmt: skip
    if x.stride(2) != 1:
        raise ValueError(f"last_conv needs x's channels contiguous, got strides {x.stride()}")
    tiles = tiles or last_conv_tiles(channels)
    if tiles.block_c + tiles.block_c2 < channels or tiles.block_t <= taps - 1:
        raise ValueError(f"tiles {tiles} do not fit {channels} channels and {taps} taps")
    out = torch.empty((batch, length), dtype=x.dtype, device=x.device)
    window = None if window_end is None else torch.empty((batch, taps - 1, channels), dtype=x.dtype, device=x.device)
    w_strides = (weight.stride(1), weight.stride(2))  # [1, C, taps], any strides
    args, kwargs = _launch_args(x, log_alpha, log_beta, pending, weight, w_strides, bias, history, fresh, junk,
                                window_end, out, window, tiles, precise)  # fmt: skip
    _last_conv_kernel[(triton.cdiv(length, tiles.block_t - taps + 1), batch)](*args, **kwargs)
    return out, window


def _launch_args(x, log_alpha, log_beta, pending, weight, w_strides, bias, history, fresh, junk, window_end, out,
                 window, tiles, precise) -> tuple[tuple, dict]:  # fmt: skip
    """The kernel's arguments (the launcher's and :func:`hopper_launches`' one source). Unused pointers take
    ``x``'s; flags that vary call by call (pending, history, per-row fresh, the window) are runtime arguments."""
    channels, taps = x.shape[2], weight.shape[-1]  # w_strides: the weight's channels' and taps' (the engine's: 1, C)
    mock = isinstance(x, MockTensor)
    per_row = isinstance(fresh, (torch.Tensor, MockTensor))
    junk = junk if junk and (per_row or fresh is not False) else 0  # no fresh row: nothing to zero
    if per_row and not mock:
        fresh = (fresh if fresh.dtype in (torch.bool, torch.uint8) else fresh != 0).view(torch.uint8)
    elif not per_row:  # never read: a byte pointer all the same
        fresh = MockTensor(torch.uint8) if mock else x.view(torch.uint8)
    per_row_end = isinstance(window_end, (torch.Tensor, MockTensor))  # else the int (or no window): ends never read
    ends = window_end if per_row_end else MockTensor(torch.int64) if mock else x.new_empty(1, dtype=torch.long)
    hist = history if history is not None else x
    args = (x, pending if pending is not None else x, log_alpha, log_beta, weight, bias, hist, fresh, ends, out,
            window if window is not None else out, x.shape[1], junk, 0 if per_row_end or window_end is None
            else int(window_end), int(pending is not None), int(history is not None), int(per_row), int(per_row_end),
            int(window is not None), x.stride(0), x.stride(1), hist.stride(0), hist.stride(1), *w_strides)  # fmt: skip
    dot = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays fp32 (a tf32 dot rounds a to 10 bits)
    kwargs = dict(C=channels, TAPS=taps, PRECISE=precise, DOT_PRECISION=dot, BLOCK_T=tiles.block_t,
                  BLOCK_C=tiles.block_c, BLOCK_C2=tiles.block_c2, num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages)  # fmt: skip
    return args, kwargs


def hopper_launches(layers) -> list:
    """The launches on the model's output layer (``kernels/launches.py``'s convention): bf16 at every
    setting of :data:`CANDIDATES`, fp32 at the launcher's (fp16 is a variant of bf16's), each with the
    pending bias, a history, per-row fresh rows and a per-row window (the engine's stateful forward; the
    flags are runtime arguments: one compile serves the plain forward too) and the weight as the engine
    holds it (channels innermost; a contiguous one is a variant). Opt-in (``default_path=False``) until
    ``Kernels.for_inference(last_conv=True)`` is the default."""
    from omni_lightning.kernels.launches import DTYPES, launch, stages_label

    convs = [x for x in layers if x.kind == "conv" and x.channels_out == 1 and 2 <= x.kernel <= MAX_TAPS]
    out = []
    for layer in convs:
        channels, taps, rows = layer.channels_in, layer.kernel, int(layer.rows_per_second)
        for name, dtype in DTYPES.items():
            x, p = MockTensor(dtype, (1, rows, channels)), MockTensor(dtype, (channels,))
            weight = MockTensor(dtype, (1, channels, taps))
            hist, window = MockTensor(dtype, (1, taps - 1, channels)), MockTensor(dtype, (1, taps - 1, channels))
            wav, ends, fresh = MockTensor(dtype, (1, rows)), MockTensor(torch.int64), MockTensor(torch.uint8)
            for block_t, warps in CANDIDATES if dtype != torch.float32 else CANDIDATES[:1]:
                tiles = last_conv_tiles(channels, block_t, warps)
                args, kwargs = _launch_args(x, p, p, MockTensor(torch.float32), weight, (1, channels), p, hist, fresh,
                                            555, ends, wav, window, tiles, False)  # fmt: skip
                out.append(launch("last_conv", _last_conv_kernel, args, kwargs, stages_label([layer], channels), name,
                                  default_path=False))  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _activation(x_row, h_row, s, c, pend_ptr, la_ptr, lb_ptr, fresh, length, junk, has_pending, has_history,
                    x_st, h_st, C: tl.constexpr, TAPS: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
        """``a`` at rows ``s`` of ``x`` and channels ``c`` (module docstring), in ``x``'s dtype: the history at
        ``-(taps - 1) <= s < 0``, zeros past the length and at junk rows of fresh rows."""
        in_c = (c < C)[None, :]
        in_x = (s >= 0) & (s < length)
        v = tl.load(x_row + s.to(tl.int64)[:, None] * x_st + c[None, :], mask=in_x[:, None] & in_c, other=0.0)
        pending = tl.load(pend_ptr + c, mask=(c < C) & (has_pending != 0), other=0.0)
        v = v.to(tl.float32) + pending.to(tl.float32)[None, :]
        alpha = tl.exp(tl.load(la_ptr + c, mask=c < C, other=0.0).to(tl.float32))
        inv_beta = 1.0 / (tl.exp(tl.load(lb_ptr + c, mask=c < C, other=0.0).to(tl.float32)) + 1e-9)
        sine = _sin(v * alpha[None, :], PRECISE)
        y = v + inv_beta[None, :] * sine * sine
        y = tl.where((in_x & ((s >= junk) | ~fresh))[:, None], y, 0.0)
        in_h = (s < 0) & (s >= 1 - TAPS) & (has_history != 0)
        h = tl.load(h_row + (s + TAPS - 1).to(tl.int64)[:, None] * h_st + c[None, :], mask=in_h[:, None] & in_c,
                    other=0.0)  # fmt: skip
        y = tl.where((s < 0)[:, None], h.to(tl.float32), y)
        return y.to(x_row.dtype.element_ty)

    @triton.jit
    def _taps(a, c, w_ptr, w_sc, w_sj, acc, C: tl.constexpr, TAPS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """``acc + a @ W[c]``: each row's dot with every tap's weights (``[rows, 8]``, taps past ``TAPS`` zero)."""
        j = tl.arange(0, 8)
        w = tl.load(w_ptr + c[:, None] * w_sc + j[None, :] * w_sj, mask=(c < C)[:, None] & (j < TAPS)[None, :],
                    other=0.0)  # fmt: skip
        return tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)

    @triton.jit
    def _keep(win_ptr, a, s, c, b, end, own, C: tl.constexpr, TAPS: tl.constexpr):
        """Rows ``end - taps + 1 .. end`` of ``a`` this program owns into the window."""
        row = s - end + TAPS - 1
        mask = own & (row >= 0) & (row < TAPS - 1)
        tl.store(win_ptr + (b * (TAPS - 1) + row)[:, None] * C + c[None, :], a, mask=mask[:, None] & (c < C)[None, :])

    # lengths and the flags vary from call to call: one compile per width, dtype and tiles
    @triton.jit(do_not_specialize=["length", "junk", "window_end", "has_pending", "has_history", "per_row",
                                   "per_row_end", "keep_window"])  # fmt: skip
    def _last_conv_kernel(x_ptr, pend_ptr, la_ptr, lb_ptr, w_ptr, bias_ptr, hist_ptr, fresh_ptr, end_ptr, out_ptr,
                          win_ptr, length, junk, window_end, has_pending, has_history, per_row, per_row_end,
                          keep_window, x_sb, x_st, h_sb, h_st, w_sc, w_sj, C: tl.constexpr, TAPS: tl.constexpr,
                          PRECISE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_C2: tl.constexpr):  # fmt: skip
        """Outputs ``t0 .. t0 + BLOCK_T - taps + 1`` of batch row ``b`` from rows ``t0 - taps + 1 ..`` of ``x``."""
        b = tl.program_id(1).to(tl.int64)
        t0 = tl.program_id(0) * (BLOCK_T - TAPS + 1)
        u = tl.arange(0, BLOCK_T)
        s = t0 - TAPS + 1 + u  # rows of x (negative: the history) and, from u = taps - 1, of the output
        fresh = tl.load(fresh_ptr + b, mask=per_row != 0, other=1) != 0  # not per row: every row is
        x_row, h_row = x_ptr + b * x_sb, hist_ptr + b * h_sb
        c1 = tl.arange(0, BLOCK_C)
        a1 = _activation(x_row, h_row, s, c1, pend_ptr, la_ptr, lb_ptr, fresh, length, junk, has_pending, has_history,
                         x_st, h_st, C, TAPS, PRECISE)  # fmt: skip
        p = _taps(a1, c1, w_ptr, w_sc, w_sj, tl.zeros([BLOCK_T, 8], dtype=tl.float32), C, TAPS, DOT_PRECISION)
        if BLOCK_C2 > 0:
            c2 = BLOCK_C + tl.arange(0, BLOCK_C2)
            a2 = _activation(x_row, h_row, s, c2, pend_ptr, la_ptr, lb_ptr, fresh, length, junk, has_pending,
                             has_history, x_st, h_st, C, TAPS, PRECISE)  # fmt: skip
            p = _taps(a2, c2, w_ptr, w_sc, w_sj, p, C, TAPS, DOT_PRECISION)
        # y[u] = sum_j p[u - taps + 1 + j, j]: each output's diagonal of p (rows u < taps - 1 are the halo's)
        j = tl.arange(0, 8)
        diagonal = tl.minimum(tl.maximum(u[:, None] + j[None, :] - (TAPS - 1), 0), BLOCK_T - 1)
        y = tl.sum(tl.gather(p, diagonal, axis=0), axis=1) + tl.load(bias_ptr).to(tl.float32)
        y = tl.minimum(tl.maximum(y, -1.0), 1.0)
        y = tl.where((s < junk) & fresh, 0.0, y)
        tl.store(out_ptr + b * length + s, y.to(out_ptr.dtype.element_ty), mask=(u >= TAPS - 1) & (s < length))
        if keep_window != 0:
            end = tl.load(end_ptr + b, mask=per_row_end != 0, other=0)
            end = tl.where(per_row_end != 0, end, window_end)
            if (end > t0 - TAPS + 1) & (end - TAPS + 1 < t0 + BLOCK_T - TAPS + 1):
                own = (u >= TAPS - 1) | (t0 == 0)  # each row of x (and of the history) in one program's
                _keep(win_ptr, a1, s, c1, b, end, own, C, TAPS)
                if BLOCK_C2 > 0:
                    _keep(win_ptr, a2, s, c2, b, end, own, C, TAPS)
