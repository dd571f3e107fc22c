"""``randomize_weights``: random weights under which every layer works, for tests, demos and benchmarks."""

from __future__ import annotations

import torch
from torch import nn

from omni_lightning.models.code2wav import Code2Wav
from omni_lightning.models.layers import ConvNeXtBlock, DecoderResidualUnit, SnakeBeta
from omni_lightning.models.transformer import LayerScale, RMSNorm


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
    handle = model.decoder[-1].register_forward_hook(lambda mod, inp, out: captured.append(out.float().std()))
    try:
        probe = torch.randint(0, model.config.codebook_size, (2, model.config.num_quantizers, 8), generator=gen)
        probe = probe.to(last.weight.device)
        model(probe)
    finally:
        handle.remove()
    scale = output_std / max(float(captured[0]), 1e-12)
    last.weight.mul_(scale)
    last.bias.mul_(scale)
    return model
