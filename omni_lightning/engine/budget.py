"""The engine's memory budget: how many frames one forward may decode (batch rows x chunk frames).

A forward's memory grows with the frames it decodes: the decoder's last stages hold tensors of
``frames * total_upsample`` samples by up to a few hundred channels. The weights, the state pool and
the waveforms handed out are fixed costs. So a budget in bytes becomes a frame budget:

    frames = (budget - fixed) / (activation bytes per frame * copies * 1.15)

``copies`` is 1, or 2 where CUDA graphs' warm-ups cannot share the graphs' pool (a torch without
``torch.cuda.use_mem_pool``): the pool holds one forward's activations while a new bucket's eager
warm-up needs as much again. 15 % covers the allocator's block rounding. Long forwards run eagerly
(``engine.py``), so their memory is the caching allocator's, reused from forward to forward.
``activation_bytes_per_frame`` derives the per-frame cost by walking the decoder's geometry (DAC's
habit: lengths and sizes from the layers, not constants beside them), counting the tensors alive at
once at each stage.

The budget is ``gpu_memory_utilization`` x the device's memory minus what the process holds already
(weights, other tenants of the process) when a cap is set; with no cap, :data:`DEFAULT_BUDGET`, so
an uncapped engine stays near that size on any job. What is estimated, not measured, is the
per-frame cost; the engine's out-of-memory fallback (smaller buckets, then eager) covers the error.
"""

from __future__ import annotations

import math

import torch

from omni_lightning.engine.plan import MAX_CHUNK
from omni_lightning.models.code2wav import Code2Wav

DEFAULT_BUDGET = 6 * 2**30  # bytes for activations and graphs with no cap: about 8 GiB reserved in all
MIN_FRAMES, MAX_FRAMES = 16, 8192
LIVE = 3  # decoder tensors alive at once at a stage: the residual stream, the snake buffer, a conv output


def activation_bytes_per_frame(model: Code2Wav, dtype: torch.dtype | None = None, chunk: int = MAX_CHUNK) -> int:
    """Peak activation bytes of a forward, per decoded frame (see module docstring); ``chunk``: the
    longest chunk a row decodes in one forward (attention scores grow with it)."""
    cfg = model.config
    size = torch.empty(0, dtype=dtype or next(model.parameters()).dtype).element_size()
    attention = cfg.num_attention_heads * (cfg.sliding_window + chunk) * 4  # fp32 scores where a kernel needs them
    samples = math.prod(cfg.upsampling_ratios)
    peak = samples * cfg.hidden_size * 8  # ConvNeXt: the MLP's 4x hidden layer and its input
    channels = cfg.decoder_dim
    for rate in cfg.upsample_rates:
        before = samples * channels  # the transposed convolution's input, alive beside its output
        samples, channels = samples * rate, channels // 2
        peak = max(peak, LIVE * samples * channels, before + 2 * samples * channels)
    out = samples * 4 * 2  # the fp32 waveform handed out and its copy in the model's dtype
    return peak * size + out + attention


def budget_bytes(device: torch.device, fraction: float | None) -> int:
    """Bytes the engine may add on ``device``: the cap's share left after what the process holds now,
    or :data:`DEFAULT_BUDGET` with no cap (CPU: no cap)."""
    if device.type != "cuda" or fraction is None:
        return DEFAULT_BUDGET
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = fraction * torch.cuda.get_device_properties(index).total_memory
    held = torch.cuda.memory_reserved(index)
    return max(0, int(cap * 0.95) - held)  # 5 %: the allocator's rounding and fragmentation


def frames_for_budget(budget: int, per_frame: int, copies: int = 1) -> int:
    """The frame budget of one forward (see module docstring): a power of two in ``[MIN_FRAMES,
    MAX_FRAMES]``, so the planner's full-budget shapes (``rows x chunk``) are whole buckets."""
    frames = max(MIN_FRAMES, min(MAX_FRAMES, int(budget / (per_frame * copies * 1.15))))
    return 2 ** (frames.bit_length() - 1)
