"""Code2Wav architecture: ``Code2WavConfig``, its named presets (plain data), transformers' config.json
mapping, and :func:`resolve_config`, the one place a preset name, a dict or a config becomes a config.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

# Presets are plain data. "qwen3-omni" is transformers' `Qwen3OmniMoeCode2WavConfig` defaults
# (transformers/models/qwen3_omni_moe/configuration_qwen3_omni_moe.py), which is also the
# `code2wav_config` of Qwen/Qwen3-Omni-30B-A3B-Instruct; 24 kHz from the Qwen3-Omni report.
# "tiny" keeps the real codebook geometry and the 1920x upsampling (so lengths and rates are the
# real ones) with narrow layers, small enough for tests on a CPU.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-omni": dict(
        codebook_size=2048,
        num_quantizers=16,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=3072,
        sliding_window=72,
        max_position_embeddings=8000,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        layer_scale_initial_scale=0.01,
        upsampling_ratios=(2, 2),
        upsample_rates=(8, 5, 4, 3),
        decoder_dim=1536,
        sample_rate=24000,
    ),
}
PRESETS["tiny"] = {
    **PRESETS["qwen3-omni"],
    **dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=128, decoder_dim=64),
}  # fmt: skip

ACTIVATIONS = ("silu", "gelu", "relu")  # names; models/layers.py maps them to functions
# the fields that count something, each at least 1
_COUNTS = ("codebook_size", "num_quantizers", "hidden_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "intermediate_size", "sliding_window", "decoder_dim", "sample_rate")  # fmt: skip

# transformers' generic config keys that say nothing about the architecture.
_HF_BOOKKEEPING = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
    "initializer_range", "attention_dropout", "output_hidden_states", "output_attentions",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "use_cache", "tie_word_embeddings", "layer_types", "_attn_implementation",
}  # fmt: skip


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A folder's (or a file's) ``config.json``; ValueError when it is missing or not a JSON object."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {path}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds {json.dumps(raw)[:40]}, not the JSON object of a model config")
    return raw


@dataclass
class Code2WavConfig:
    """Architecture of a Code2Wav decoder; field names follow transformers' config."""

    name: str = "qwen3-omni"
    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    attention_bias: bool = False
    sliding_window: int = 72
    max_position_embeddings: int = 8000
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    upsampling_ratios: tuple[int, ...] = field(default=(2, 2))
    upsample_rates: tuple[int, ...] = field(default=(8, 5, 4, 3))
    decoder_dim: int = 1536
    sample_rate: int = 24000

    def __post_init__(self) -> None:
        wrong = self._coerce_types()  # a string or null from a config.json is named here, not met deep inside
        if wrong:
            raise ValueError("invalid Code2WavConfig: " + "; ".join(wrong))
        problems = []
        for f in _COUNTS:
            if int(getattr(self, f)) < 1:
                problems.append(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None and self.num_attention_heads >= 1 and self.hidden_size % self.num_attention_heads:
            problems.append(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); set head_dim"
            )
        if not self.upsample_rates or any(r < 1 for r in self.upsample_rates + self.upsampling_ratios):
            problems.append("upsample_rates must be non-empty and every rate >= 1")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            problems.append(
                f"decoder_dim ({self.decoder_dim}) must be divisible by 2**len(upsample_rates) "
                f"({2 ** len(self.upsample_rates)})"
            )
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"hidden_act {self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
        if problems:
            raise ValueError("invalid Code2WavConfig: " + "; ".join(problems))

    def _coerce_types(self) -> list[str]:
        """Makes each field its type (an integral float to int, a list of rates to a tuple); returns
        one line per field that cannot be, naming it and its value."""
        wrong = []

        def integer(value: Any) -> int | None:  # numpy numbers too
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                return None
            return int(value) if value == int(value) else None

        for f in (*_COUNTS, "max_position_embeddings", *(["head_dim"] if self.head_dim is not None else [])):
            value = integer(getattr(self, f))
            if value is None:
                wrong.append(f"{f} must be an integer, got {getattr(self, f)!r}")
            else:
                setattr(self, f, value)
        for f in ("rope_theta", "rms_norm_eps", "layer_scale_initial_scale"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                wrong.append(f"{f} must be a finite number, got {value!r}")
            else:
                setattr(self, f, float(value))
        for f in ("upsampling_ratios", "upsample_rates"):
            value = getattr(self, f)
            listed = hasattr(value, "__iter__") and not isinstance(value, (str, bytes, dict))  # a list, an array
            rates = [integer(r) for r in value] if listed else [None]
            if None in rates:
                wrong.append(f"{f} must be a list of integers, got {value!r}")
            else:
                setattr(self, f, tuple(rates))
        for f, kind in (("name", str), ("hidden_act", str), ("attention_bias", bool)):
            if not isinstance(getattr(self, f), kind):
                wrong.append(f"{f} must be a {kind.__name__}, got {getattr(self, f)!r}")
        return wrong

    @classmethod
    def from_name(cls, name: str, /, **overrides: Any) -> Code2WavConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown Code2Wav preset {name!r}; known presets: {sorted(PRESETS)}")
        return cls(**{"name": name, **PRESETS[name], **overrides})

    @classmethod
    def from_hf(cls, source: dict | str | Path, where: str | Path = "config") -> Code2WavConfig:
        """Reads a standalone Code2Wav ``config.json`` or a full Qwen3-Omni one (``code2wav_config``).
        ValueError naming ``where`` (the file a dict came from) and the key of any problem."""
        if isinstance(source, (str, Path)):
            source, where = read_config_json(source), source
        try:
            return cls._from_hf(source)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err

    @classmethod
    def _from_hf(cls, source: Any) -> Code2WavConfig:
        hf = source.get("code2wav_config", source) if isinstance(source, dict) else source
        if not isinstance(hf, dict):
            raise ValueError(f"a Code2Wav config is a JSON object, got {type(hf).__name__} {hf!r:.60}")
        hf = dict(hf)
        rope = hf.pop("rope_parameters", None) or hf.pop("rope_scaling", None) or {}
        if not isinstance(rope, dict):
            raise ValueError(f"rope_parameters must be a JSON object, got {rope!r:.60}")
        if "rope_theta" not in hf and "rope_theta" in rope:
            hf["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported (only 'default')")
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in hf if k not in known and k not in _HF_BOOKKEEPING)
        if unknown:
            raise ValueError(f"unknown Code2Wav config keys: {unknown}")
        return cls(**{"name": hf.pop("name", "custom"), **{k: v for k, v in hf.items() if k in known}})

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` that transformers' ``Qwen3OmniMoeCode2WavConfig`` reads."""
        hf = asdict(self)
        hf["upsampling_ratios"] = list(self.upsampling_ratios)
        hf["upsample_rates"] = list(self.upsample_rates)
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": hf.pop("rope_theta")}
        if hf["head_dim"] is None:
            del hf["head_dim"]
        return hf

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def total_upsample(self) -> int:
        """Waveform samples per codec frame (1920 on Qwen3-Omni)."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.total_upsample

    def output_length(self, n_frames: int) -> int:
        """Waveform samples that ``n_frames`` codec frames decode to."""
        length = n_frames * math.prod(self.upsampling_ratios)
        for rate in self.upsample_rates:  # each decoder block trims its transposed conv's look-ahead
            length = (length - 1) * rate
        return max(length, 0)

    @property
    def tail(self) -> int:
        """Samples a decode of T frames lacks against ``T * total_upsample`` (555 on Qwen3-Omni)."""
        return self.total_upsample - self.output_length(1)


DEFAULT_PRESET = "qwen3-omni"


def resolve_config(config: str | dict | Code2WavConfig | None = None) -> Code2WavConfig:
    """A preset name, a config dict (``asdict`` of a config, as Lightning hparams hold it) or a
    ``Code2WavConfig``; None means :data:`DEFAULT_PRESET`."""
    if config is None:
        config = DEFAULT_PRESET
    if isinstance(config, Code2WavConfig):
        return config
    if isinstance(config, dict):
        return Code2WavConfig(**config)
    if isinstance(config, str):
        return Code2WavConfig.from_name(config)
    raise ValueError(f"config must be a preset name, a dict or a Code2WavConfig, got {type(config).__name__}")
