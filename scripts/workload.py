"""What the benchmarks share: the seeded jobs, the peer (transformers) on the same weights, clocks.

Imported by scripts in the groups below it (``bench/``, ``profiling/``, ...: each that does puts
``scripts/`` on ``sys.path`` first); the package is imported as installed (``pip install -e .``, or
``PYTHONPATH=.`` on a machine where it is not installed).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from omni_lightning import Code2Wav, Code2WavConfig, randomize_weights


def codes_job(config: Code2WavConfig, lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random codes of the given lengths in frames (seeded), as ``{"req-0000": [Q, T], ...}``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        f"req-{i:04d}": torch.randint(0, config.codebook_size, (config.num_quantizers, n), generator=gen)
        for i, n in enumerate(lengths)
    }


def mixed_job(
    config: Code2WavConfig, requests: int = 384, min_s: float = 2.0, max_s: float = 30.0, seed: int = 0
) -> dict[str, torch.Tensor]:
    """``requests`` requests of uniform random ``min_s``..``max_s`` seconds of random codes (seeded):
    the benchmarks' mixed job (384 of 2-30 s, seed 0)."""
    rng = random.Random(seed)
    lo, hi = round(min_s * config.frame_rate), round(max_s * config.frame_rate)
    return codes_job(config, [rng.randint(lo, hi) for _ in range(requests)], seed)


# (share of the requests, min s, max s): most requests under 5 s, a few over a minute
LONG_TAILED = ((0.85, 0.5, 5.0), (0.12, 5.0, 30.0), (0.03, 60.0, 120.0))


def long_tailed_job(config: Code2WavConfig, requests: int = 384, seed: int = 0) -> dict[str, torch.Tensor]:
    """The long-tailed job: ``requests`` requests drawn from the tiers of :data:`LONG_TAILED` (every
    tier but the first gets at least one request), in seeded random order."""
    if requests < len(LONG_TAILED):
        raise ValueError(f"--requests {requests}: the long-tailed job needs at least {len(LONG_TAILED)}")
    rng = random.Random(seed)
    counts = [max(1, round(share * requests)) for share, _, _ in LONG_TAILED[1:]]
    counts.insert(0, requests - sum(counts))
    lengths = [
        rng.randint(round(lo * config.frame_rate), round(hi * config.frame_rate))
        for count, (_, lo, hi) in zip(counts, LONG_TAILED)
        for _ in range(count)
    ]
    rng.shuffle(lengths)
    return codes_job(config, lengths, seed)


def audio_seconds(config: Code2WavConfig, lengths: list[int]) -> float:
    return sum(config.output_length(n) for n in lengths) / config.sample_rate


def random_model(preset: str, seed: int = 0) -> Code2Wav:
    """Weights under which every layer acts (``randomize_weights``), fp32 on the CPU."""
    return randomize_weights(Code2Wav(preset), seed=seed).eval()


def device_model(preset: str, device: torch.device) -> Code2Wav:
    """:func:`random_model` on ``device``, in bf16 on CUDA and fp32 elsewhere (the benchmarks' smoke runs)."""
    base = random_model(preset)
    model = Code2Wav(base.config).to(device, torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    model.load_state_dict(base.state_dict())
    return model


def peer(model: Code2Wav, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """transformers' ``Qwen3OmniMoeCode2Wav`` holding ``model``'s weights (the numerical reference)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    ref = Qwen3OmniMoeCode2Wav._from_config(Qwen3OmniMoeCode2WavConfig(**model.config.to_hf()))
    ref.load_state_dict(model.state_dict(), strict=True)
    return ref.to(device=device, dtype=dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn()`` takes, the device synchronized before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median_time(fn: Callable[[], Any], device: torch.device, warmup: int = 2, repeats: int = 5) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device) for _ in range(repeats))


def interleaved_samples(fns: dict[str, Callable[[], Any]], device: torch.device, warmup: int = 2, repeats: int = 5,
                        rounds: int = 1) -> dict[str, list[list[float]]]:  # fmt: skip
    """Seconds of each of ``fns`` per round, timed in turns: each warmed ``warmup`` times, then ``rounds``
    rounds that time each ``repeats`` times in order, so a drift of the machine (clocks, heat, a
    neighbour) falls on all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[list[float]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append([timed(fn, device) for _ in range(repeats)])
    return samples


def interleaved_times(fns: dict[str, Callable[[], Any]], device: torch.device, warmup: int = 2, repeats: int = 5,
                      rounds: int = 1) -> dict[str, float]:  # fmt: skip
    """Median seconds of each of ``fns`` over every round of :func:`interleaved_samples`."""
    samples = interleaved_samples(fns, device, warmup, repeats, rounds)
    return {name: statistics.median(t for one in runs for t in one) for name, runs in samples.items()}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def memory(device: torch.device) -> dict[str, float]:
    """Peak and current allocator figures, GiB (reserved includes CUDA-graph pools)."""
    if device.type != "cuda":
        return {}
    gib = 2**30
    return {
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
        "reserved_gib": torch.cuda.memory_reserved(device) / gib,
    }


def save(path: str | Path, result: dict[str, Any], args: Any) -> None:
    """Writes ``result`` with the date, machine, versions and arguments."""
    import lightning

    device = torch.device(getattr(args, "device", "cpu"))
    result["meta"] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "args": vars(args),
    }
    Path(path).write_text(json.dumps(result, indent=2, default=str))
