"""The residual unit kernel (``kernels/residual_unit.py``) against its torch reference and the layers, run by
Triton's interpreter on the CPU (fp32: the interpreter gets bf16 dots wrong; the CUDA tests check bf16).

Both launchers: the in-place one (``a`` given: padding rows past the length, a row tile cut by the length,
one and two parts of the output channels, the weights as given and as the engine holds them) and the
prologue one (history given or zeros, fresh rows all, some or none, junk rows). Then the model's forward
with ``Kernels(residual_unit=...)``, whole and as a stateful chunked decode, against the layers'. Not
checked here: the fast sine (inline PTX has no interpreter; ``precise=True`` runs libdevice's) and speed.
"""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import torch
    from omni_lightning import Code2Wav, Code2WavConfig, randomize_weights
    from omni_lightning.kernels import Kernels
    from omni_lightning.kernels.conv_snake import Tiles
    from omni_lightning.kernels.residual_unit import (residual_unit_prologue_reference, residual_unit_prologue_triton,
                                                      residual_unit_reference, residual_unit_triton, unit_tiles)
    from omni_lightning.kernels.snake_beta import snake_beta_reference
    from omni_lightning.models.code2wav import REFERENCE

    gen = torch.Generator().manual_seed(3)
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale
    def rel(got, want):
        return float((got - want).norm() / want.norm())
    cases = 0
    for c, length, batch, d, pad in ((96, 70, 2, 3, 5), (64, 33, 1, 9, 0), (32, 20, 3, 1, 2)):
        ctx = 6 * d
        x, a = rand(batch, length, c), rand(batch, ctx + length + pad, c)
        w1, w2 = rand(c, c, 7, scale=(7 * c) ** -0.5), rand(c, c, 1, scale=c ** -0.5)
        b1, la2, lb2 = rand(c, scale=0.1), rand(c, scale=0.3), rand(c, scale=0.3)
        t = unit_tiles(c)
        tiles = Tiles(64, t.block_n, t.block_n2, t.block_k, t.num_warps, 1)  # fewer rows: a faster interpreter
        for weight in (w1, w1.transpose(1, 2).contiguous().transpose(1, 2)):  # as given, as the engine holds it
            want = residual_unit_reference(x, a, weight, b1, la2, lb2, w2, d)
            stream = x.clone()
            got = residual_unit_triton(stream, a, weight, b1, la2, lb2, w2, d, tiles=tiles, precise=True)
            assert got is stream and rel(got, want) < 1e-5, (c, d, rel(got, want))
            cases += 1
        pending, la1, lb1 = rand(c, scale=0.1), rand(c, scale=0.3), rand(c, scale=0.3)
        fresh_rows = torch.arange(batch) % 2 == 0
        runs = ((rand(batch, ctx, c), fresh_rows, 5), (None, True, 4), (rand(batch, ctx, c), False, 3))
        for history, fresh, junk in runs:
            want = residual_unit_prologue_reference(x, pending, history, fresh, junk, la1, lb1, w1, b1, la2, lb2, w2, d)
            got = residual_unit_prologue_triton(x, pending, history, fresh, junk, la1, lb1, w1, b1, la2, lb2, w2, d,
                                                tiles=tiles, precise=True)
            assert rel(got, want) < 1e-5, (c, d, junk, rel(got, want))
            cases += 1
    # the model: whole requests and a stateful chunked decode, the fused units against the layers
    micro = Code2WavConfig.from_name("tiny", name="micro", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, intermediate_size=32, decoder_dim=128)
    model = randomize_weights(Code2Wav(micro), seed=4).eval()
    def small(x, *args):  # the launcher's own parts and K step, fewer rows
        t = unit_tiles(x.shape[2])
        return residual_unit_triton(x, *args, tiles=Tiles(64, t.block_n, t.block_n2, 32, 4, 1), precise=True)
    fused = Kernels(snake_beta_reference, inplace=True, name="units", residual_unit=small,
                    conv_snake_dtypes=(torch.float32,))
    codes = torch.randint(0, 2048, (2, 16, 3), generator=gen)
    with torch.no_grad():
        want = model(codes, kernels=REFERENCE)
        got = model(codes, kernels=fused)
        assert float((got - want).abs().max()) < 1e-5, float((got - want).abs().max())
        state = model.new_state(2)
        pieces = [model(codes[..., s : s + 2], state, kernels=fused) for s in (0, 2)]
        chunked = torch.cat(pieces, -1)[..., model.config.tail :]
        assert float((chunked - want).abs().max()) < 1e-5, float((chunked - want).abs().max())
    cases += 1
    print("residual unit ok", cases)
    """
)


def test_residual_unit_in_the_triton_interpreter_equals_its_reference_and_the_layers():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "residual unit ok 16" in done.stdout, done.stderr[-3000:]
