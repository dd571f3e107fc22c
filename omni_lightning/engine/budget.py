"""The engine's memory budget: how many frames one forward may decode (batch rows x chunk frames).

The budget is ``gpu_memory_utilization`` x the device's memory minus what the process holds when a
cap is set, else :data:`DEFAULT_BUDGET`. It pays first for the CUDA graphs of short forwards (their
shared pool, :data:`POOL_FACTOR` x their largest forward's peak; ``graph_frames`` is halved until the
pool fits its share), then for the long forwards, which run eagerly at one size:
``rest / (activation bytes per frame * 1.15)`` rounded down to a power of two (15 % for the
allocator's rounding). The per-frame cost is derived by walking the decoder's layers, times
:data:`MEASURED`, the ratio of the peak a forward was measured to add to the walk's figure (copies
and workspaces the walk does not see). The pool factor is an estimate: the engine's out-of-memory
fallback (half the frames, then half again) covers its error, and counts each use (``shrinks``).
"""

from __future__ import annotations

import math

import torch

from omni_lightning.engine.plan import MAX_CHUNK
from omni_lightning.models.code2wav import Code2Wav

DEFAULT_BUDGET = 6 * 2**30  # bytes for activations and graphs with no cap (the estimate below undercounts)
MIN_FRAMES, MAX_FRAMES = 16, 8192
LIVE = 3  # decoder tensors alive at once at a stage: the residual stream, the snake buffer, a conv output
# measured peak / walked peak per frame: 1,330-1,408 KiB against 1,163.5 (qwen3-omni, bf16, H200, eager
# stateful forwards of 64-4,096 frames; scripts/profiling/profile_memory.py --jobs frames, docs/performance.md)
MEASURED = 1.22


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
    return int(MEASURED * (peak * size + out + attention))


MARGIN = 0.95  # of a cap: the rest for the allocator's rounding and fragmentation


def _cap_and_held(device: torch.device, fraction: float) -> tuple[float, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return fraction * torch.cuda.get_device_properties(index).total_memory, torch.cuda.memory_reserved(index)


def budget_bytes(device: torch.device, fraction: float | None) -> int:
    """Bytes the engine may add on ``device``: the cap's share left after what the process holds now,
    or :data:`DEFAULT_BUDGET` with no cap (CPU: no cap)."""
    if device.type != "cuda" or fraction is None:
        return DEFAULT_BUDGET
    cap, held = _cap_and_held(device, fraction)
    return max(0, int(cap * MARGIN) - held)


def no_room(device: torch.device, fraction: float | None, err: BaseException) -> torch.OutOfMemoryError:
    """The error when even one frame per forward runs out of memory: what the cap allows, what the
    process holds, what to change (the allocator's own message, first line, after it)."""
    where = f"decoding one frame per forward ran out of memory on {device}"
    if device.type == "cuda":
        total, reserved = _cap_and_held(device, 1.0)
        where += room(fraction, total, reserved)
    return torch.OutOfMemoryError(f"{where} ({str(err).splitlines()[0][:300]})")


def room(fraction: float | None, total: float, reserved: int, needed: int | None = None) -> str:
    """What a cap allows and what the process holds, in GiB, and what to change: the figures of the
    out-of-memory errors (``needed``: bytes one forward of one frame needs beyond what is held)."""
    held = f"this process holds {reserved / 2**30:.2f} GiB"
    more = f"; one frame per forward needs {needed / 2**20:.1f} MiB more" if needed is not None else ""
    if fraction is None:
        return f": {held} of the GPU's {total / 2**30:.1f} GiB{more}; other processes hold the rest"
    return (
        f": gpu_memory_utilization={fraction!r} allows {fraction * total / 2**30:.2f} GiB of the GPU's "
        f"{total / 2**30:.1f} GiB and {held} (weights included){more}; give it a larger share"
    )


def check_room(device: torch.device, fraction: float | None, budget: int, per_frame: int) -> None:
    """Raises ``torch.OutOfMemoryError`` at once, with the figures, when a cap leaves ``budget`` bytes,
    too few for a forward of one frame (``per_frame`` bytes, with the allocator's margin): no decode
    could run, and trying would only fail after every fallback."""
    needed = int(per_frame * 1.15)
    if device.type != "cuda" or fraction is None or budget >= needed:
        return
    total, reserved = _cap_and_held(device, 1.0)
    where = f"gpu_memory_utilization={fraction!r} leaves no room to decode on {device}"
    raise torch.OutOfMemoryError(where + room(fraction, total, reserved, needed - budget))


POOL_FACTOR = 3  # the graphs' shared pool, in short forwards' peaks (docs/performance.md)


def graph_pool_bytes(graph_frames: int, per_frame: int) -> int:
    """What the CUDA graphs of forwards of at most ``graph_frames`` frames hold in their pool."""
    return POOL_FACTOR * graph_frames * per_frame


def graph_frames_for_budget(budget: int, per_frame: int, largest: int, share: float = 0.25) -> int:
    """The longest forward captured as a CUDA graph: ``largest``, halved until its pool takes at most
    ``share`` of the budget (batch decode: a quarter, so a small budget keeps its room for the long,
    eager forwards; a streaming decoder, whose steps are all short, gives its graphs more)."""
    frames = largest
    while frames > 16 and graph_pool_bytes(frames, per_frame) > budget * share:
        frames //= 2
    return frames


def frames_for_budget(budget: int, per_frame: int) -> int:
    """The frame budget of one forward (see module docstring): a power of two in ``[MIN_FRAMES,
    MAX_FRAMES]``, so the planner's full-budget shapes (``rows x chunk``) are whole buckets."""
    frames = max(MIN_FRAMES, min(MAX_FRAMES, int(budget / (per_frame * 1.15))))
    return 2 ** (frames.bit_length() - 1)
