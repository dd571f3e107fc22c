"""The residual unit kernel (``kernels/residual_unit.py``) against its torch reference and the layers, run by
Triton's interpreter on the CPU (fp32: the interpreter gets bf16 dots wrong; the CUDA tests check bf16).

Both launchers: the in-place one (``a`` given: padding rows past the length, a row tile cut by the length,
one and two parts of the output channels, the weights as given and as the engine holds them) and the
prologue one (history given or zeros, fresh rows all, some or none, junk rows). Then the table that picks
each unit's path (``kernels/unit_paths.py``): the model's forward with ``fused_units="per-width"``, whole and
as a stateful chunked decode, against the layers', each unit on the path the table names; every choice's
path at each width, the fallbacks, and bad values. Not checked here: the fast sine (inline PTX has no
interpreter; ``precise=True`` runs libdevice's) and speed.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import torch
    from omni_lightning.kernels.conv_snake import Tiles
    from omni_lightning.kernels.residual_unit import (residual_unit_prologue_reference, residual_unit_prologue_triton,
                                                      residual_unit_reference, residual_unit_triton, unit_tiles)

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
    print("residual unit ok", cases)
    """
)


def test_residual_unit_in_the_triton_interpreter_equals_its_reference_and_the_layers():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "residual unit ok 15" in done.stdout, done.stderr[-3000:]


MODEL_SCRIPT = textwrap.dedent(
    """
    import dataclasses
    from collections import Counter
    import torch
    from omni_lightning import Code2Wav, Code2WavConfig, randomize_weights
    from omni_lightning.kernels import Kernels
    from omni_lightning.kernels.conv_snake import Tiles, conv_snake_triton, launch_tiles
    from omni_lightning.kernels.residual_unit import residual_unit_triton, unit_tiles
    from omni_lightning.kernels.snake_beta import snake_beta_reference
    from omni_lightning.models.code2wav import REFERENCE

    ran = Counter()  # (path, channels): the calls each kernel took
    def small(t):  # the launchers' own parts and K step, fewer rows and one stage: a faster interpreter
        return Tiles(64, t.block_n, t.block_n2, t.block_k, 4, 1)
    def conv_snake(a, weight, *args):
        ran["conv_snake", weight.shape[0]] += 1
        return conv_snake_triton(a, weight, *args, tiles=small(launch_tiles(a.shape[2], weight.shape[0])), precise=True)
    def unit(x, *args):
        ran["residual_unit", x.shape[2]] += 1
        return residual_unit_triton(x, *args, tiles=small(unit_tiles(x.shape[2])), precise=True)
    # the table for_inference picks on CUDA, with the kernels run by the interpreter, in fp32
    per_width = dataclasses.replace(Kernels.for_inference("cuda", fused_units="per-width"),
                                    snake_beta=snake_beta_reference, conv_snake=conv_snake, residual_unit=unit,
                                    conv_snake_dtypes=(torch.float32,))
    assert per_width.name == "triton-units-per-width", per_width.name
    both = Code2WavConfig.from_name("tiny", name="96-and-192", hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                                    decoder_dim=384)  # stages of 192, 96, 48 and 24 channels
    gen = torch.Generator().manual_seed(3)
    expect = {"tiny": {("residual_unit", 32): 3}, "96-and-192": {("conv_snake", 192): 3, ("residual_unit", 96): 3}}
    for config in (Code2WavConfig.from_name("tiny"), both):
        model = randomize_weights(Code2Wav(config), seed=4).eval()
        codes = torch.randint(0, config.codebook_size, (2, config.num_quantizers, 3), generator=gen)
        with torch.no_grad():
            want = model(codes, kernels=REFERENCE)
            ran.clear()
            got = model(codes, kernels=per_width)
            assert dict(ran) == expect[config.name], (config.name, dict(ran))  # each unit on its table's path
            err = float((got - want).norm() / want.norm())
            assert err < 1e-5, (config.name, err)
            state = model.new_state(2)
            pieces = [model(codes[..., s : s + 2], state, kernels=per_width) for s in (0, 2)]
            chunked = torch.cat(pieces, -1)[..., config.tail :]
            err = float((chunked - want).norm() / want.norm())
            assert err < 1e-5, (config.name, "chunked", err)
        print("per-width ok", config.name)
    """
)


def test_the_per_width_forward_in_the_interpreter_equals_the_layers_at_both_kinds_of_width():
    """``Kernels.for_inference(fused_units="per-width")``'s table with its kernels run by Triton's interpreter
    (fp32): the tiny preset (its one 32-channel stage: the one kernel) and a decoder of 192, 96, 48 and
    24 channels (192: conv_snake, 96: the one kernel, the rest: the layers), whole and as a stateful
    chunked decode, equal the reference layers; each unit ran the path the table names."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", MODEL_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "per-width ok 96-and-192" in done.stdout, done.stderr[-3000:]


def test_the_report_compiles_what_the_launchers_launch(monkeypatch):
    """At 96 and 192 channels, both launchers' calls (recorded, on CPU tensors), bound as Triton's JIT binds
    them, equal the launches ``hopper_launches`` lists at the launchers' default setting."""
    pytest.importorskip("triton")
    import torch

    from omni_lightning.kernels import launches, residual_unit
    from omni_lightning.models.shapes import layer_shapes

    calls = []

    class Recorder:
        fn = residual_unit._residual_unit_kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((args, kwargs))

    listed = {(one.kernel, one.label.split()[0], one.num_warps, one.tiles): one
              for one in residual_unit.hopper_launches(layer_shapes("qwen3-omni"))}  # fmt: skip
    monkeypatch.setattr(residual_unit, "_residual_unit_kernel", Recorder())
    for channels in (96, 192):
        bf16 = torch.bfloat16
        x, a = torch.zeros(2, 40, channels, dtype=bf16), torch.zeros(2, 40 + 54, channels, dtype=bf16)
        w1, w2 = torch.zeros(channels, channels, 7, dtype=bf16), torch.zeros(channels, channels, 1, dtype=bf16)
        p = torch.zeros(channels, dtype=bf16)
        residual_unit.residual_unit_triton(x, a, w1, p, p, p, w2, 3)
        pending, history = torch.zeros(channels), torch.zeros(2, 18, channels, dtype=bf16)
        residual_unit.residual_unit_prologue_triton(x, pending, history, True, 6, p, p, w1, p, p, p, w2, 3)
        t = residual_unit.unit_tiles(channels)
        tiles = f"{t.block_m}x{t.block_n}x{t.block_n2}x{t.block_k}"
        for kernel in ("residual_unit.prologue", "residual_unit"):
            one = listed[(kernel, str(channels), t.num_warps, tiles)]
            args, kwargs = calls.pop()
            bound = launches.bind(Recorder.fn, args, kwargs)
            assert bound == (one.signature, one.constexprs, one.attrs, one.num_warps, one.num_stages), kernel


@pytest.mark.parametrize("bad", ["per_width", "all", "True", 1, 0, None])
def test_a_bad_fused_units_value_is_an_error_naming_it(bad):
    from omni_lightning.kernels import Kernels

    for device in ("cpu", "cuda"):  # before any device check: a typo fails on the CPU too
        with pytest.raises(ValueError, match=re.escape(f"got {bad!r}")):
            Kernels.for_inference(device, fused_units=bad)


def test_a_unit_table_with_an_unknown_path_is_an_error_naming_it():
    from omni_lightning.kernels.unit_paths import UnitPaths

    with pytest.raises(ValueError, match="'cudnn' in table 'mine'"):
        UnitPaths("mine", "conv_snake", ((192, (1,), "cudnn"),))
    with pytest.raises(ValueError, match=re.escape("row (96, 'residual_unit')")):
        UnitPaths("mine", "conv_snake", ((96, "residual_unit"),))


def test_each_choice_names_each_units_path_and_falls_back_where_a_unit_cannot_take_it():
    """``Kernels.for_inference`` on CUDA (built here, nothing run) at qwen3-omni's widths and dilations:
    the table each ``fused_units`` picks, and the fallbacks (gradients recorded, widths the kernels do not
    take, a stream that is not contiguous, fp32); on the CPU, the layers."""
    pytest.importorskip("triton")
    import torch

    from omni_lightning.kernels import Kernels

    def path(kernels, channels, dilation=3, dtype=torch.bfloat16, contiguous=True):
        x = torch.zeros(2, 10, channels, dtype=dtype)
        x = x if contiguous else torch.zeros(2, channels, 10, dtype=dtype).transpose(1, 2)
        a = torch.zeros(2, 10 + 6 * dilation, channels, dtype=dtype)
        return kernels.unit_path(x, a, torch.nn.Conv1d(channels, channels, 7, dilation=dilation))

    want = {
        False: ("conv_snake", "conv_snake"),
        True: ("residual_unit", "residual_unit"),
        "per-width": ("residual_unit", "conv_snake"),
    }  # fmt: skip  (96, 192 channels)
    for choice, paths in want.items():
        kernels = Kernels.for_inference("cuda", fused_units=choice)
        with torch.no_grad():
            assert [path(kernels, c, d) for c in (96, 192) for d in (1, 3, 9)] == [p for p in paths for _ in range(3)]
            assert path(kernels, 48) == path(kernels, 24) == "layers"  # 48 input channels: not a K step of 32
            assert path(kernels, 96, dtype=torch.float32) == "layers"  # fp32 stays on the layers
            assert path(kernels, 96, contiguous=False) == "conv_snake"  # the one kernel writes x in place
        assert path(kernels, 96) == "layers"  # gradients recorded: neither kernel (inference only)
        with torch.no_grad():
            assert path(Kernels.for_inference("cpu", fused_units=choice), 96) == "layers"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_residual_unit_matches_the_reference_at_qwen3_omni_widths(dtype, no_tf32):
    """Both launchers (tensor-core dots, fast sine) against the torch reference in fp64, beside the layers'
    own error in ``dtype`` (cuDNN, SnakeBeta, the GEMM): no larger than theirs."""
    import torch

    from omni_lightning.kernels import residual_unit as ru

    dtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(4)
    rand = lambda *s, scale=1.0: torch.randn(*s, device="cuda", generator=gen) * scale  # noqa: E731
    for c, d, length in ((96, 9, 3001), (192, 3, 3001), (192, 1, 77), (64, 1, 5)):
        x, a, hist = rand(2, length, c), rand(2, 6 * d + length + 4, c), rand(2, 6 * d, c)
        w1, w2 = rand(c, c, 7, scale=(7 * c) ** -0.5), rand(c, c, 1, scale=c**-0.5)
        b1, la2, lb2, pending, la1, lb1 = (rand(c, scale=s) for s in (0.1, 0.3, 0.3, 0.1, 0.3, 0.3))
        fresh = torch.tensor([True, False], device="cuda")
        high = [v.double() for v in (x, a, w1, b1, la2, lb2, w2)]
        low = [x.to(dtype), a.to(dtype), w1.to(dtype).transpose(1, 2).contiguous().transpose(1, 2), b1, la2, lb2,
               w2.to(dtype)]  # fmt: skip
        cases = {
            "in place": (ru.residual_unit_reference(*high, d), ru.residual_unit_triton(low[0].clone(), *low[1:], d),
                         ru.residual_unit_reference(*low, d)),
            "prologue": (ru.residual_unit_prologue_reference(high[0], pending.double(), hist.double(), fresh, 5,
                                                             la1.double(), lb1.double(), *high[2:], d),
                         ru.residual_unit_prologue_triton(low[0], pending, hist.to(dtype), fresh, 5, la1, lb1, *low[2:],
                                                          d),
                         ru.residual_unit_prologue_reference(low[0], pending, hist.to(dtype), fresh, 5, la1, lb1,
                                                             *low[2:], d)),
        }  # fmt: skip
        for name, (want, ours, theirs) in cases.items():
            errors = [float((y.double() - want).norm() / want.norm()) for y in (ours, theirs)]
            assert errors[0] <= 1.1 * errors[1] + 1e-4, (name, c, d, errors)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_units", [True, "per-width"])
def test_a_forward_with_one_kernel_units_is_as_faithful_as_the_layers(fused_units, no_tf32):
    """qwen3-omni widths in bf16: the whole forward with ``Kernels.for_inference(fused_units=...)`` (the one
    kernel everywhere, or per width) against the fp32 forward, no further off than the layers in bf16."""
    import dataclasses

    from helpers import bf16_errors

    from omni_lightning.kernels import Kernels

    units = Kernels.for_inference("cuda", fused_units=fused_units)
    layers = dataclasses.replace(units, conv_snake=None, residual_unit=None)
    errors = bf16_errors({"units": units, "layers": layers})
    assert errors["units"] <= 1.1 * errors["layers"] + 1e-3, errors
