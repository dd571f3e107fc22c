"""The model's layers as shapes, and what one audio second costs in each: derived by walking the model.

:func:`layer_shapes` builds ``Code2Wav(config)`` on the meta device (no memory, no weights) and walks
its modules in registration order, which is the forward's order, tracking the rows per audio second
each layer sees (a transposed convolution multiplies them by its stride). The kernels' launch
settings (``kernels/launches.py``) and the report's per-stage costs both read this list, so a
change to the model's layers reaches both.

:func:`layer_cost` is coarse on purpose, the floors' arithmetic: FLOPs are the tensor-core ones
(convolutions, GEMMs, attention's two products; SnakeBeta, norms and the softmax count none), bytes
are the activations a layer-by-layer forward reads and writes once each (a residual 1x1 reads the
stream and writes it back; attention reads q, k, v and writes its output once, keys reused from
cache). Not counted: weights (read once per forward, shared by the whole batch: see
:func:`weight_bytes`), the embedding lookup, the final clamp, and L2 reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omni_lightning.kernels.launches import LayerShape
from omni_lightning.models.code2wav import Code2Wav
from omni_lightning.models.config import resolve_config
from omni_lightning.models.layers import CausalConv1d, CausalConvTranspose1d, SnakeBeta
from omni_lightning.models.transformer import Attention, RMSNorm

GROUPS = ("dilated conv", "1x1 conv", "SnakeBeta", "transposed conv", "pre-transformer", "ConvNeXt upsampler")


def build_meta(config) -> Code2Wav:
    """``Code2Wav(config)`` on the meta device: shapes only."""
    with torch.device("meta"):
        return Code2Wav(resolve_config(config))


def layer_shapes(config=None) -> list[LayerShape]:
    """Every layer of ``Code2Wav(config)`` that moves data, in forward order (module docstring)."""
    model = build_meta(config)
    rate = model.config.frame_rate
    layers = []
    for name, module in model.named_modules():
        parts = name.split(".")
        stage = parts[0] if parts[0] == "pre_transformer" else ".".join(parts[:2])
        if isinstance(module, SnakeBeta):
            c = module.alpha.numel()
            layers.append(LayerShape(name, "snake", stage, c, c, rate))
        elif isinstance(module, CausalConv1d):
            conv = module.conv
            shape = dict(kernel=conv.kernel_size[0], dilation=conv.dilation[0], groups=conv.groups)
            layers.append(LayerShape(name, "conv", stage, conv.in_channels, conv.out_channels, rate, **shape))
        elif isinstance(module, CausalConvTranspose1d):
            conv = module.conv
            layers.append(LayerShape(name, "conv_transpose", stage, conv.in_channels, conv.out_channels, rate,
                                     kernel=conv.kernel_size[0], stride=conv.stride[0]))  # fmt: skip
            rate *= conv.stride[0]
        elif isinstance(module, nn.Linear):
            layers.append(LayerShape(name, "linear", stage, module.in_features, module.out_features, rate))
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            c = module.weight.numel()
            layers.append(LayerShape(name, "norm", stage, c, c, rate))
        elif isinstance(module, Attention):
            c = module.n_heads * module.head_dim
            layers.append(LayerShape(name, "attention", stage, c, c, rate, window=model.config.sliding_window))
    return layers


def group(layer: LayerShape) -> str:
    """The layer type the report sums by (:data:`GROUPS`)."""
    if layer.stage == "pre_transformer":
        return "pre-transformer"
    if layer.stage.startswith("upsample"):
        return "ConvNeXt upsampler"
    if layer.kind == "snake":
        return "SnakeBeta"
    if layer.kind == "conv_transpose":
        return "transposed conv"
    return "1x1 conv" if layer.kernel == 1 else "dilated conv"


@dataclass(frozen=True)
class Cost:
    flops: float  # tensor-core FLOPs per audio second
    bytes: float  # activation bytes per audio second

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


def layer_cost(layer: LayerShape, element_bytes: int = 2) -> Cost:
    """One audio second of ``layer`` (module docstring): tensor-core FLOPs and activation bytes."""
    rows, c_in, c_out = layer.rows_per_second, layer.channels_in, layer.channels_out
    if layer.kind == "conv":
        flops = 2 * c_in // layer.groups * c_out * layer.kernel * rows
        residual = layer.kernel == 1 and c_in == c_out  # accumulates into the stream: reads and writes it
        return Cost(flops, (c_in + c_out * (2 if residual else 1)) * rows * element_bytes)
    if layer.kind == "conv_transpose":
        return Cost(2 * c_in * c_out * layer.kernel * rows, (c_in + c_out * layer.stride) * rows * element_bytes)
    if layer.kind == "linear":
        return Cost(2 * c_in * c_out * rows, (c_in + c_out) * rows * element_bytes)
    if layer.kind == "attention":
        return Cost(4 * layer.window * c_in * rows, 4 * c_in * rows * element_bytes)
    return Cost(0.0, 2 * c_in * rows * element_bytes)  # snake, norm: read, write


def stage_costs(layers: list[LayerShape], element_bytes: int = 2) -> dict[str, dict[str, Cost]]:
    """``{stage: {group: Cost}}`` over ``layers``, stages in forward order."""
    costs: dict[str, dict[str, Cost]] = {}
    for layer in layers:
        by_group = costs.setdefault(layer.stage, {})
        key = group(layer)
        by_group[key] = by_group.get(key, Cost(0.0, 0.0)) + layer_cost(layer, element_bytes)
    return costs


def weight_bytes(config=None, element_bytes: int = 2) -> int:
    """The model's parameters in bytes: what one forward reads once, whatever its batch."""
    return sum(p.numel() for p in build_meta(config).parameters()) * element_bytes
