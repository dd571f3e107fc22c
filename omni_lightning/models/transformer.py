"""The pre-transformer of Code2Wav (names as in transformers' ``Qwen3OmniMoeCode2Wav``): a causal
transformer over codec frames with a sliding attention window and RoPE at absolute positions.

A stateful forward (``models/state.py``) prefixes each attention layer's keys and values with those
of the window's earlier frames, saved by the previous chunk, and starts the rows' positions at their
``pos``: a request decoded chunk by chunk attends to exactly what its whole decode attends to.
Activations are ``[B, T, hidden]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_lightning.models.config import Code2WavConfig
from omni_lightning.models.state import Step

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused op: normalizes in fp32 as the reference does, but scales before its one rounding
        # (the reference rounds, then scales: bf16 differs by that rounding, fp32 does not)
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the reference's half-split layout: ``x * cos + rotate_half(x) * sin``, where
    ``rotate_half(x) = cat(-x2, x1)`` is ``roll(x, half) * (-1 | +1)``: the sign rides on ``signed_sin``
    (:func:`signed`), so one roll and one fused multiply-add replace a negation, a concatenation and
    two more ops."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def signed(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated (see :func:`rotate`)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class Attention(nn.Module):
    """Attention over a sliding window; a stateful forward prefixes the keys and values of the
    window's earlier frames (``past`` of them, at their absolute positions)."""

    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.resolved_head_dim
        self.past = config.sliding_window - 1
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=bias)
        self.state_name = ""

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        shape = (self.n_kv_heads, self.past, self.head_dim)
        return {f"{self.state_name}.k": shape, f"{self.state_name}.v": shape} if self.past else {}

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, step: Step
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # sin: signed (PreTransformer.forward)
        if step.state is not None and self.past:
            k = torch.cat((step.history(f"{self.state_name}.k").to(k.dtype), k), dim=2)
            v = torch.cat((step.history(f"{self.state_name}.v").to(v.dtype), v), dim=2)
            step.save(f"{self.state_name}.k", k, t, dim=2)
            step.save(f"{self.state_name}.v", v, t, dim=2)
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

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, step: Step
    ) -> torch.Tensor:
        # x + scale * y as one fused op (LayerScale's product and the residual add)
        x = torch.addcmul(
            x, self.self_attn_layer_scale.scale, self.self_attn(self.input_layernorm(x), cos, sin, mask, step)
        )
        return torch.addcmul(x, self.mlp_layer_scale.scale, self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """Causal transformer over frames, each frame attending to itself and the previous window - 1,
    at absolute positions (a stateful forward continues from the rows' ``pos``)."""

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

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        t, window = x.shape[1], self.config.sliding_window
        q_pos = torch.arange(t, device=x.device)  # [T]; per row [B, T] with a state
        k_pos = q_pos
        if step.pos is not None:
            q_pos = step.pos[:, None] + q_pos
            past = window - 1
            k_pos = torch.cat((step.pos[:, None] - past + torch.arange(past, device=x.device), q_pos), dim=1)
        freqs = q_pos[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-3)  # [1 or B, 1, T, head_dim]
        cos, sin = emb.cos().to(x.dtype), signed(emb.sin().to(x.dtype))
        offset = q_pos[..., :, None] - k_pos[..., None, :]  # query minus key; keys before frame 0 are empty
        mask = ((offset >= 0) & (offset < window) & (k_pos[..., None, :] >= 0)).unsqueeze(-3)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, step)
        return self.norm(x)
