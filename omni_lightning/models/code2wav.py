"""Code2Wav: the codec decoder of Qwen3-Omni, in plain torch.

Multi-codebook codec codes ``[B, Q, T]`` at 12.5 frames/s go in, a 24 kHz waveform ``[B, 1, T']`` in
[-1, 1] comes out. The layer names (and so the ``state_dict`` keys) are those of transformers'
``Qwen3OmniMoeCode2Wav``, so a Qwen3-Omni checkpoint's ``code2wav.*`` tensors load with no mapping.

The model is causal except for one frame of look-ahead in each transposed convolution, which the
stages trim away: output sample ``s`` never depends on a frame after ``s // total_upsample``. That is
why a right-padded batch gives each request exactly what it gives alone, and why
``output_length(T) = total_upsample * T - tail`` (``tail`` = 555 samples on Qwen3-Omni).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omni_lightning.models import fused

# Presets are plain data. "qwen3-omni" is transformers' `Qwen3OmniMoeCode2WavConfig` defaults
# (transformers/models/qwen3_omni_moe/configuration_qwen3_omni_moe.py), which is also the
# `code2wav_config` of Qwen/Qwen3-Omni-30B-A3B-Instruct; 24 kHz from the Qwen3-Omni report.
# "tiny" keeps the real codebook geometry and the 1920x upsampling (so lengths and rates are the
# real ones) with narrow layers, so a 10 s clip decodes in well under a second on a laptop CPU.
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

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}

# transformers' generic config keys that say nothing about the architecture.
_HF_BOOKKEEPING = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
    "initializer_range", "attention_dropout", "output_hidden_states", "output_attentions",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "use_cache", "tie_word_embeddings", "layer_types", "_attn_implementation",
}  # fmt: skip


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A folder's (or a file's) ``config.json``; ValueError when it is missing or not JSON."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


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
        self.upsampling_ratios = tuple(int(r) for r in self.upsampling_ratios)
        self.upsample_rates = tuple(int(r) for r in self.upsample_rates)
        problems = []
        for f in ("codebook_size", "num_quantizers", "hidden_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "intermediate_size",
                  "sliding_window", "decoder_dim", "sample_rate"):  # fmt: skip
            if int(getattr(self, f)) < 1:
                problems.append(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
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

    @classmethod
    def from_name(cls, name: str, /, **overrides: Any) -> Code2WavConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown Code2Wav preset {name!r}; known presets: {sorted(PRESETS)}")
        return cls(**{"name": name, **PRESETS[name], **overrides})

    @classmethod
    def from_hf(cls, source: dict | str | Path) -> Code2WavConfig:
        """Reads a standalone Code2Wav ``config.json`` or a full Qwen3-Omni one (``code2wav_config``)."""
        if isinstance(source, (str, Path)):
            source = read_config_json(source)
        hf = dict(source.get("code2wav_config", source))
        rope = hf.pop("rope_parameters", None) or hf.pop("rope_scaling", None) or {}
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


def validate_codes(
    codes: Any,
    config: Code2WavConfig,
    lengths: Any = None,
    req_ids: Sequence[str] | None = None,
) -> torch.Tensor:
    """Checks a batch ``[B, Q, T]`` (and its ``lengths``) before any lookup; returns ``lengths``.

    Raises ``ValueError`` naming the request (id or index), codebook and frame of the first problem.
    Only frames inside each request's length are checked, so any pad value is accepted.
    """
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"codes must be a torch.Tensor [B, Q, T], got {type(codes).__name__}")
    if codes.dtype == torch.bool or codes.is_floating_point() or codes.is_complex():
        raise ValueError(f"codes must be an integer tensor, got dtype {codes.dtype}")
    if codes.dim() != 3:
        raise ValueError(f"codes must have shape [batch, codebooks, frames], got {tuple(codes.shape)}")
    batch, n_q, n_frames = codes.shape

    def name(i: int) -> str:
        return f"request {req_ids[i]!r}" if req_ids is not None and i < len(req_ids) else f"request {i}"

    if batch == 0:
        raise ValueError("codes hold no request (batch size 0)")
    if n_q != config.num_quantizers:
        raise ValueError(f"codes have {n_q} codebooks, this model expects {config.num_quantizers}")
    if n_frames == 0:
        raise ValueError(f"{name(0)} is empty (0 frames)")
    if lengths is None:
        lengths = torch.full((batch,), n_frames, dtype=torch.long)
    else:
        lengths = torch.as_tensor(lengths)
        if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.shape != (batch,):
            raise ValueError(f"lengths must be integers of shape [{batch}], got {lengths.dtype} "
                             f"{tuple(lengths.shape)}")  # fmt: skip
        lengths = lengths.to(device="cpu", dtype=torch.long)
        for i, n in enumerate(lengths.tolist()):
            if n < 1:
                raise ValueError(f"{name(i)} is empty (length {n})")
            if n > n_frames:
                raise ValueError(f"{name(i)} has length {n}, longer than the {n_frames} padded frames")
    frame = torch.arange(n_frames, device=codes.device)
    in_request = (frame[None, :] < lengths.to(codes.device)[:, None])[:, None, :]
    bad = ((codes < 0) | (codes >= config.codebook_size)) & in_request
    if bool(bad.any()):
        b, q, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name(b)}: code {int(codes[b, q, t])} at codebook {q}, frame {t} is outside "
            f"[0, {config.codebook_size}) ({int(bad.sum())} bad values in the batch)"
        )
    return lengths


class CausalConv1d(nn.Module):
    """Stride-1 convolution padded on the left only, so frame t sees no frame after t."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1) -> None:  # fmt: skip
        super().__init__()
        self.left_pad = (kernel_size - 1) * dilation
        # padding both sides and dropping the right overhang saves the copy an F.pad would make
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups,
                              padding=self.left_pad)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., : x.shape[-1]] if self.left_pad else y


class CausalConvTranspose1d(nn.Module):
    """Transposed convolution trimmed by ``kernel - stride`` on both sides (one frame look-ahead)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.trim = kernel_size - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return x[..., self.trim : x.shape[-1] - self.trim] if self.trim else x


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel (alpha and beta kept in log scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.fused = True  # one Triton pass on CUDA without autograd (models/fused.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[:, None]
        inv_beta = 1.0 / (self.beta.exp()[:, None] + 1e-9)
        if torch.is_grad_enabled():
            return x + inv_beta * torch.sin(x * alpha).pow(2)
        if self.fused and x.is_cuda and fused.triton_available():
            return fused.snake_beta(x, alpha[:, 0], inv_beta[:, 0])
        s = torch.mul(x, alpha).sin_()  # without autograd: two temporaries fewer per call
        return torch.addcmul(x, s.mul_(s), inv_beta)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in fp32 (as the reference does), scale in the input dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.resolved_head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """Causal transformer over frames, each frame attending to itself and the previous window - 1."""

    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        dim = self.config.resolved_head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
        return 1.0 / (self.config.rope_theta**exponent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        offset = pos[:, None] - pos[None, :]  # query minus key
        mask = (offset >= 0) & (offset < self.config.sliding_window)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class DecoderResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    """SnakeBeta, x``rate`` causal transposed conv halving the channels, three dilated residual units."""

    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
            + [DecoderResidualUnit(out_dim, dilation) for dilation in (1, 3, 9)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


class Code2Wav(nn.Module):
    """Codec codes ``[B, Q, T]`` to waveform ``[B, 1, output_length(T)]`` in [-1, 1]."""

    def __init__(self, config: Code2WavConfig | str = "tiny") -> None:
        super().__init__()
        if isinstance(config, str):
            config = Code2WavConfig.from_name(config)
        self.config = config
        self.pre_transformer = PreTransformer(config)
        self.code_embedding = nn.Embedding(config.codebook_size * config.num_quantizers, config.hidden_size)
        self.register_buffer("code_offset", self._code_offset(), persistent=False)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [
                    CausalConvTranspose1d(config.hidden_size, config.hidden_size, r, r),
                    ConvNeXtBlock(config.hidden_size),
                ]
            )  # fmt: skip
            for r in config.upsampling_ratios
        )
        dims = [config.decoder_dim // 2**i for i in range(len(config.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(config.hidden_size, config.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(config.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)]
        )

    def _code_offset(self, device: torch.device | None = None) -> torch.Tensor:
        q = self.config.num_quantizers
        return (torch.arange(q, device=device) * self.config.codebook_size).view(1, q, 1)

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recomputes the non-persistent buffers (after building on the meta device)."""
        self.code_offset = self._code_offset(device)
        self.pre_transformer.inv_freq = self.pre_transformer._inv_freq(device)

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    def set_fused_kernels(self, enabled: bool) -> Code2Wav:
        """Turns the fused CUDA inference kernels on or off (they are on by default)."""
        for module in self.modules():
            if isinstance(module, SnakeBeta):
                module.fused = enabled
        return self

    def output_length(self, n_frames: int) -> int:
        return self.config.output_length(n_frames)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        h = self.code_embedding(codes + self.code_offset).mean(1)
        h = self.pre_transformer(h).transpose(1, 2)
        for stage in self.upsample:
            for layer in stage:
                h = layer(h)
        for layer in self.decoder:
            h = layer(h)
        return h.clamp(-1.0, 1.0)

    def decode(
        self,
        codes: torch.Tensor,
        lengths: torch.Tensor | Sequence[int] | None = None,
        req_ids: Sequence[str] | None = None,
        validate: bool = True,
    ) -> list[torch.Tensor]:
        """Decodes a right-padded batch; request i's waveform ``[1, output_length(lengths[i])]``.

        Each waveform is what that request gives decoded alone (the model never looks past a
        frame's own look-ahead). ``validate=False`` skips the range check, for callers that
        validated on the CPU already (the check on a GPU tensor synchronizes the device).
        """
        if validate:
            lengths = validate_codes(codes, self.config, lengths, req_ids)
        elif lengths is None:
            lengths = torch.full((codes.shape[0],), codes.shape[-1], dtype=torch.long)
        n = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
        codes = codes[..., : max(n)]
        if min(n) < codes.shape[-1]:
            # pad frames may hold anything (-1, say) and are cut from the output anyway: clamp them
            # into the codebook on the device (building a pad mask would wait for a host copy)
            codes = codes.clamp(0, self.config.codebook_size - 1)
        wav = self(codes)
        return [wav[i, :, : self.output_length(n_i)] for i, n_i in enumerate(n)]

    def chunked_decode(
        self,
        codes: torch.Tensor,
        chunk_size: int = 300,
        left_context: int = 25,
        validate: bool = True,
    ) -> torch.Tensor:
        """Decodes ``[B, Q, T]`` in chunks of ``chunk_size`` frames with bounded peak memory.

        Each chunk is decoded with up to ``left_context`` frames before it. Unlike transformers'
        ``chunked_decode``, which drops each chunk's last ``tail`` samples, the chunk after it
        re-decodes them from its left context, so the result has ``output_length(T)`` samples with
        no gaps, and equals a full decode when ``left_context >= T``.
        """
        if validate:
            validate_codes(codes, self.config)
        up, tail = self.config.total_upsample, self.config.tail
        min_context = -(-tail // up)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 frame, got {chunk_size}")
        if left_context < min_context:
            raise ValueError(
                f"left_context must be >= {min_context} frame(s) to refill the {tail}-sample chunk "
                f"tail, got {left_context}"
            )
        n_frames = codes.shape[-1]
        pieces = []
        for start in range(0, n_frames, chunk_size):
            end = min(start + chunk_size, n_frames)
            context = min(left_context, start)
            wav = self(codes[..., start - context : end])
            # from absolute sample start*up - tail: the previous chunk's missing tail comes first
            pieces.append(wav[..., context * up - (tail if start else 0) :])
        return torch.cat(pieces, dim=-1)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Code2Wav:
        """Loads a standalone folder or the ``code2wav.*`` tensors of a full Qwen3-Omni checkpoint."""
        from omni_lightning.models.checkpoint import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | Path) -> Path:
        """Writes ``config.json`` + ``model.safetensors`` (transformers' standalone layout)."""
        from omni_lightning.models.checkpoint import save_pretrained

        return save_pretrained(self, path)


@torch.no_grad()
def randomize_weights(model: Code2Wav, seed: int = 0, output_std: float = 0.2) -> Code2Wav:
    """Random weights under which every layer does something (for tests, demos and benchmarks).

    Fan-in scaled weights (residual branches damped so the net stays well conditioned), SnakeBeta
    alpha/beta, layer scales and norm gains drawn away from their near-identity defaults, and the
    last convolution calibrated on a probe batch so the waveform has about ``output_std`` before
    the clamp (so the clamp hides nothing).
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.ConvTranspose1d)):
            w = module.weight
            if isinstance(module, nn.ConvTranspose1d):  # [in, out, k]: each output sees k/stride taps
                fan_in = w.shape[0] * max(1, w.shape[2] // module.stride[0])
            else:
                fan_in = w[0].numel()
            w.copy_(normal(w.shape, std=fan_in**-0.5))
            if module.bias is not None:
                module.bias.copy_(normal(module.bias.shape, std=0.02))
        elif isinstance(module, SnakeBeta):
            module.alpha.copy_(normal(module.alpha.shape, std=0.3))
            module.beta.copy_(normal(module.beta.shape, std=0.3))
        elif isinstance(module, (LayerScale, ConvNeXtBlock)):
            p = module.scale if isinstance(module, LayerScale) else module.gamma
            p.copy_(torch.rand(p.shape, generator=gen) * 0.5 + 0.25)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            module.weight.copy_(normal(module.weight.shape, mean=1.0, std=0.1))
        elif isinstance(module, nn.Embedding):
            module.weight.copy_(normal(module.weight.shape))
    for module in model.modules():
        if isinstance(module, DecoderResidualUnit):  # keep activations O(10), not chaotic O(500)
            module.conv2.conv.weight.mul_(0.2)
    last = model.decoder[-1].conv
    captured = []
    handle = last.register_forward_hook(lambda mod, inp, out: captured.append(out.float().std()))
    try:
        probe = torch.randint(0, model.config.codebook_size, (2, model.config.num_quantizers, 8),
                              generator=gen).to(last.weight.device)  # fmt: skip
        model(probe)
    finally:
        handle.remove()
    scale = output_std / max(float(captured[0]), 1e-12)
    last.weight.mul_(scale)
    last.bias.mul_(scale)
    return model
