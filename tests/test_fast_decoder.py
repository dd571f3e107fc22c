"""The channels-last inference decoder (models/fast_decoder.py) computes the layers' function.

It runs by default on CUDA only; here it is called directly on the CPU (the fused SnakeBeta's
eager twin does the same fp32 math as the Triton kernel), so the bias folding, the in-place
residual GEMMs and the transposed convolutions' padding crop are checked on every machine.
"""

import pytest
import torch
from conftest import micro_config, random_codes, random_model

from omni_lightning.models import fast_decoder
from omni_lightning.models.fast_decoder import decoder_forward
from omni_lightning.models.fused import snake_beta_tc, triton_available


def layer_by_layer(model, h):
    for layer in model.decoder:
        h = layer(h)
    return h


@pytest.mark.parametrize("fuse_pointwise", [False, True])
def test_fast_decoder_equals_the_layers(monkeypatch, fuse_pointwise):
    monkeypatch.setattr(fast_decoder, "FUSE_POINTWISE", fuse_pointwise)
    model = random_model(micro_config(decoder_dim=32), seed=4)
    gen = torch.Generator().manual_seed(0)
    for batch, frames in ((1, 3), (3, 7)):
        h = torch.randn(batch, model.config.hidden_size, frames * 4, generator=gen)
        with torch.inference_mode():
            want = layer_by_layer(model, h)
            got = decoder_forward(model.decoder, h)
        assert got.shape == want.shape == (batch, 1, model.output_length(frames))
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_dilated_convolutions_as_dilation_one_over_a_folded_view():
    from omni_lightning.models.fast_decoder import _dilated_conv, _snake_rows
    from omni_lightning.models.layers import DecoderResidualUnit

    torch.manual_seed(5)
    gen = torch.Generator().manual_seed(1)
    channels = 24
    for dilation in (3, 9):
        unit = DecoderResidualUnit(channels, dilation).eval()
        for length in (1, dilation, 4 * dilation, 4 * dilation + 1, 50):  # multiples of d and not
            x = torch.randn(2, length, channels, generator=gen)
            with torch.inference_mode():
                want = unit.conv1(unit.act1(x.transpose(1, 2))) - unit.conv1.conv.bias[:, None]
                rows = _snake_rows(unit.act1, x, None, dilation)
                got = _dilated_conv(unit.conv1, rows, length)
            assert rows.shape[1] % dilation == 0 and not rows[:, length:].any()
            assert got.shape == (2, length, channels)
            assert (got.transpose(1, 2) - want).abs().max() <= 1e-5 * want.abs().max()


def test_forward_with_the_fast_decoder_matches_decode_of_each_request():
    model = random_model("tiny", seed=2)
    codes = random_codes(2, 6, model.config, seed=3)
    with torch.inference_mode():
        want = model(codes)
        h = model.code_embedding(codes + model.code_offset).mean(1)
        h = model.pre_transformer(h).transpose(1, 2)
        for stage in model.upsample:
            for layer in stage:
                h = layer(h)
        got = decoder_forward(model.decoder, h).clamp(-1, 1)
    assert (got - want).abs().max() <= 1e-5


def test_snake_beta_tc_adds_the_bias_and_reads_any_strides():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 40, 12, generator=gen) * 3
    x = base[:, 5:35]  # a strided view, as a causal convolution hands it over
    log_alpha, log_beta, bias = (torch.randn(12, generator=gen) * 0.3 for _ in range(3))
    y = snake_beta_tc(x, log_alpha, log_beta, bias)
    xb = x + bias
    want = xb + torch.sin(xb * log_alpha.exp()) ** 2 / (log_beta.exp() + 1e-9)
    assert y.is_contiguous() and (y - want).abs().max() <= 1e-5


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_residual_gemm_equals_the_unfused_decoder(monkeypatch, dtype):
    # the Triton GEMM (SnakeBeta prologue, residual epilogue) against the SnakeBeta + addmm_ path
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = random_model("tiny", seed=6).cuda().to(dtype)
    gen = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(3, model.config.hidden_size, 4 * 37, device="cuda", generator=gen).to(dtype)
    with torch.inference_mode():
        monkeypatch.setattr(fast_decoder, "FUSE_POINTWISE", False)
        want = decoder_forward(model.decoder, h).float()
        monkeypatch.setattr(fast_decoder, "FUSE_POINTWISE", True)
        got = decoder_forward(model.decoder, h).float()
    err = (got - want).norm() / want.norm()
    assert err <= (1e-5 if dtype == torch.float32 else 2e-2), err
