"""The output layer as one kernel (``kernels/last_conv.py``) against its torch reference and the layers, run by
Triton's interpreter on the CPU (fp32, and fp16 as the 16-bit case: the interpreter rounds bf16 wrongly, so
the CUDA tests check bf16).

The kernel alone, over random cases: channels split in two parts (96), one masked part (4, 24, 40), taps 2 to
8, lengths shorter than the halo and longer than several tiles, batches of 1 to 3, history given or zeros,
fresh rows all, some or none, junk past the length, windows ending anywhere (per row or at the length),
no pending bias, the weight as given and as the engine holds it. Then the model: whole forwards, stateful
forwards with rows of different valid lengths (the audio and the state they leave), an engine's batch
decode and streams of random chunk sizes, each equal to the layers'. Then the flag, the fallbacks and the
kernel report's compile of what the launcher launches. Not checked here: the fast sine (inline PTX has no
interpreter; ``precise=True`` runs libdevice's) and speed (``scripts/kernels/bench_last_conv.py``).
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from omni_lightning.kernels import hopper

SCRIPT = textwrap.dedent(
    """
    import random
    import torch
    from omni_lightning.kernels.last_conv import Tiles, last_conv_reference, last_conv_tiles, last_conv_triton

    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    def rand(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)
    def rel(got, want):
        return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    cases = 0
    for case in range(28):
        dtype = torch.float16 if case % 4 == 3 else torch.float32
        channels = (96, 4, 24, 40)[case % 4] if case < 24 else 96
        taps = 7 if case % 3 else rng.randint(2, 8)
        batch, length = rng.randint(1, 3), rng.choice((1, 3, 5, 30, 61, 150))
        x = rand(batch, length, channels, dtype=dtype)
        la, lb, pend = rand(channels, scale=0.3), rand(channels, scale=0.3), rand(channels, scale=0.1)
        weight, bias = rand(1, channels, taps, scale=0.5 * (taps * channels) ** -0.5, dtype=dtype), rand(1, scale=0.1)
        if case % 2:
            weight = weight.transpose(1, 2).contiguous().transpose(1, 2)  # channels innermost, as the engine holds it
        kw = dict(history=rand(batch, taps - 1, channels, dtype=dtype) if rng.random() < 0.6 else None,
                  fresh=rng.choice((True, False, torch.rand(batch, generator=gen) < 0.5)),
                  junk=rng.choice((0, 2, 7, length + 3)),
                  window_end=rng.choice((None, length, torch.randint(0, length + 1, (batch,), generator=gen))))
        pending = pend if case % 5 else None
        tiles = Tiles(rng.choice((16, 32)), *last_conv_tiles(channels)[1:3], 4, 1)  # small tiles: many programs
        want = last_conv_reference(x, la, lb, pending, weight, bias, **kw)
        got = last_conv_triton(x, la, lb, pending, weight, bias, tiles=tiles, precise=True, **kw)
        assert got[0].shape == (batch, length) and got[0].dtype == dtype
        if dtype == torch.float32:
            assert rel(got[0], want[0]) < 1e-5, (case, rel(got[0], want[0]))
        else:  # 16 bits: against fp64, no further off than the reference in fp16
            high = last_conv_reference(x.double(), la.double(), lb.double(), None if pending is None else
                                       pending.double(), weight.double(), bias.double(),
                                       **{**kw, "history": None if kw["history"] is None else kw["history"].double()})
            assert rel(got[0], high[0]) <= 1.1 * rel(want[0], high[0]) + 1e-4, case
        assert (got[1] is None) == (want[1] is None), case
        if want[1] is not None:
            assert got[1].shape == (batch, taps - 1, channels), case
            assert rel(got[1], want[1]) < 1e-3, (case, rel(got[1], want[1]))
        cases += 1
    print("last conv ok", cases)
    """
)


def run_interpreted(script: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)


def test_last_conv_in_the_triton_interpreter_equals_its_reference():
    pytest.importorskip("triton")
    done = run_interpreted(SCRIPT)
    assert done.returncode == 0 and "last conv ok 28" in done.stdout, done.stderr[-3000:]


MODEL_SCRIPT = textwrap.dedent(
    """
    import dataclasses, random
    import torch
    from omni_lightning import Code2Wav, Code2WavConfig, DecodeEngine, StreamingDecoder, randomize_weights
    from omni_lightning.kernels import Kernels
    from omni_lightning.kernels.last_conv import Tiles, last_conv_tiles, last_conv_triton
    from omni_lightning.kernels.snake_beta import snake_beta_reference
    from omni_lightning.models.code2wav import REFERENCE

    calls = []
    def last_conv(x, *args, **kw):  # the launcher with long tiles (fewer programs) and libdevice's sine
        calls.append(x.shape[0])
        return last_conv_triton(x, *args, tiles=Tiles(512, *last_conv_tiles(x.shape[2])[1:3], 4, 1), precise=True, **kw)
    kernels = dataclasses.replace(Kernels.for_inference("cuda", last_conv=True), snake_beta=snake_beta_reference,
                                  conv_snake=None, last_conv=last_conv)
    assert kernels.name == "triton+last-conv", kernels.name
    odd = dict(name="odd", hidden_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
               intermediate_size=32, decoder_dim=16, sliding_window=5, upsample_rates=(3, 2), upsampling_ratios=(2,))
    configs = [Code2WavConfig.from_name("tiny"), Code2WavConfig.from_name("tiny", **odd),
               Code2WavConfig.from_name("tiny", name="96 channels", decoder_dim=1536)]  # the last layer's: 4, 4, 96
    gen, rng = torch.Generator().manual_seed(3), random.Random(3)
    def close(a, b, what):
        err = float((a - b).abs().max())
        assert a.shape == b.shape and err <= 1e-5, (config.name, what, a.shape, b.shape, err)
    for config in configs:
        model = randomize_weights(Code2Wav(config), seed=4).eval()
        codes = torch.randint(0, config.codebook_size, (3, config.num_quantizers, 7), generator=gen)
        with torch.no_grad():
            calls.clear()
            close(model(codes, kernels=kernels), model(codes, kernels=REFERENCE), "whole")
            assert calls == [3], calls
            states = {k: model.new_state(4) for k in ("ours", "layers")}
            for start, n in ((0, 3), (3, 1), (4, 3)):  # rows of different valid lengths, slots out of order
                rows, valid = torch.tensor([2, 0, 3]), torch.tensor([n, max(1, n - 1), max(1, n - 2)])
                out = {k: model(codes[..., start : start + n], s.select(rows, valid),
                                kernels=kernels if k == "ours" else REFERENCE) for k, s in states.items()}
                close(out["ours"], out["layers"], f"stateful from {start}")
                close(states["ours"].flat, states["layers"].flat, f"state after {start}")
                assert torch.equal(states["ours"].pos, states["layers"].pos)
            if config.decoder_dim > 64:  # the engine and streams on the small models only (time)
                print("model ok", config.name)
                continue
            lengths = [7, 4, 6]
            want = model.decode(codes, lengths)
            engine = DecodeEngine(model, kernels=kernels, max_rows=2, frames_per_forward=5, cuda_graphs=False)
            for got, ref in zip(engine.decode(codes, lengths), want):
                close(got, ref, "engine")
            streams = StreamingDecoder(model, max_streams=2, engine=DecodeEngine(model, kernels=kernels, max_rows=2,
                                                                                 cuda_graphs=False))
            calls.clear()
            sids, done, pieces = [streams.open(), streams.open()], [0, 0], [[], []]
            while min(done) < 7:
                chunks = {}
                for i, sid in enumerate(sids):
                    if done[i] < 7:
                        n = min(rng.randint(1, 4), 7 - done[i])
                        chunks[sid] = codes[i, :, done[i] : done[i] + n]
                        done[i] += n
                for sid, wav in streams.step(chunks).items():
                    pieces[sids.index(sid)].append(wav)
            for i in range(2):
                close(torch.cat(pieces[i], dim=-1), want[0] if i == 0 else model.decode(codes[1:2])[0], "streamed")
            assert calls, "the streams' forwards ran the kernel"
        print("model ok", config.name)
    """
)


def test_the_output_layer_kernel_in_the_interpreter_equals_the_layers_whole_stateful_and_streamed():
    """Three models (the last layer of 4, 4 and 96 channels; the odd one with 12 samples a frame and a tail of
    8, so windows reach into the junk rows): whole and stateful forwards (the audio and the state), and on
    the two small ones the engine's batch decode and two streams of random chunk sizes, with
    ``Kernels.for_inference("cuda", last_conv=True)``'s kernel run by the interpreter, against the layers (fp32)."""
    pytest.importorskip("triton")
    done = run_interpreted(MODEL_SCRIPT)
    assert done.returncode == 0 and "model ok 96 channels" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, "True"])
def test_a_bad_last_conv_value_is_an_error_naming_it(bad):
    from omni_lightning.kernels import Kernels

    for device in ("cpu", "cuda"):  # before any device check: a typo fails on the CPU too
        with pytest.raises(ValueError, match=re.escape(f"last_conv must be True or False, got {bad!r}")):
            Kernels.for_inference(device, last_conv=bad)


def test_the_kernel_runs_only_where_it_takes_the_layer():
    """Off by default; with it on: not under autograd, not for fp64, a stream whose channels are not contiguous,
    a convolution of more than one output channel or more than 8 taps; on the CPU, the layers."""
    pytest.importorskip("triton")
    import torch

    from omni_lightning.kernels import Kernels

    x, conv = torch.zeros(2, 10, 96, dtype=torch.bfloat16), torch.nn.Conv1d(96, 1, 7)
    assert Kernels.for_inference("cuda").last_conv is None
    assert Kernels.for_inference("cpu", last_conv=True).last_conv is None
    kernels = Kernels.for_inference("cuda", last_conv=True)
    assert not kernels.takes_last_conv(x, conv)  # gradients recorded
    with torch.no_grad():
        assert kernels.takes_last_conv(x, conv) and kernels.takes_last_conv(x.float(), conv)
        assert not kernels.takes_last_conv(x.double(), conv)
        assert not kernels.takes_last_conv(torch.zeros(2, 96, 10, dtype=torch.bfloat16).transpose(1, 2), conv)
        assert not kernels.takes_last_conv(x, torch.nn.Conv1d(96, 2, 7))
        assert not kernels.takes_last_conv(x, torch.nn.Conv1d(96, 1, 9))


def test_a_weight_or_tiles_the_kernel_cannot_take_are_errors_naming_them():
    pytest.importorskip("triton")
    import torch

    from omni_lightning.kernels.last_conv import Tiles, last_conv_triton

    x, p = torch.zeros(1, 10, 96), torch.zeros(96)
    with pytest.raises(ValueError, match=re.escape("got a weight of (2, 96, 7)")):
        last_conv_triton(x, p, p, p, torch.zeros(2, 96, 7), torch.zeros(1))
    with pytest.raises(ValueError, match=re.escape("strides (960, 1, 10)")):
        last_conv_triton(torch.zeros(1, 96, 10).transpose(1, 2), p, p, p, torch.zeros(1, 96, 7), torch.zeros(1))
    with pytest.raises(ValueError, match="do not fit 96 channels"):
        last_conv_triton(x, p, p, p, torch.zeros(1, 96, 7), torch.zeros(1), tiles=Tiles(64, 64, 0))


@pytest.mark.skipif(hopper.missing() is not None, reason=hopper.missing() or "")
def test_the_report_compiles_what_the_launcher_launches_and_it_compiles_clean(monkeypatch):
    """The engine's stateful call and a plain forward's at qwen3-omni's width (recorded, on CPU tensors), bound as
    Triton's JIT binds them, equal the launch ``hopper_launches`` lists at the launcher's setting, in bf16 and
    fp32; that launch
    compiles for sm_90a without spilling, within shared memory (tensor cores in bf16)."""
    import torch

    from omni_lightning.kernels import last_conv, launches
    from omni_lightning.models.shapes import layer_shapes

    calls = []

    class Recorder:
        fn = last_conv._last_conv_kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((args, kwargs))

    tiles = last_conv.last_conv_tiles(96)
    at = f"{tiles.block_t}x{tiles.block_c}x{tiles.block_c2}"
    listed = {one.dtype: one for one in last_conv.hopper_launches(layer_shapes("qwen3-omni"))
              if one.tiles == at and one.num_warps == tiles.num_warps}  # fmt: skip
    monkeypatch.setattr(last_conv, "_last_conv_kernel", Recorder())
    for name, dtype in launches.DTYPES.items():
        x, p = torch.zeros(2, 240, 96, dtype=dtype), torch.zeros(96, dtype=dtype)
        weight = torch.zeros(1, 7, 96, dtype=dtype).transpose(1, 2)  # as the engine holds it
        history, fresh, ends = torch.zeros(2, 6, 96, dtype=dtype), torch.tensor([True, False]), torch.tensor([240, 9])
        last_conv.last_conv_triton(x, p, p, torch.zeros(96), weight, p[:1], history=history, fresh=fresh, junk=555,
                                   window_end=ends)  # fmt: skip
        last_conv.last_conv_triton(x, p, p, torch.zeros(96), weight, p[:1], fresh=True, junk=555)  # a plain forward's
        one = listed[name]
        for args, kwargs in (calls.pop(), calls.pop()):  # the flags are runtime arguments: one compile for both
            bound = launches.bind(Recorder.fn, args, kwargs)
            assert bound == (one.signature, one.constexprs, one.attrs, one.num_warps, one.num_stages), name
        compiled = hopper.compile_launch(one)
        assert not hopper.clean(one, compiled), (name, compiled)
        # tensor cores in bf16 (an older Triton may run an N = 8 dot as mma.sync), an exact FMA dot in fp32
        assert (compiled.mma != "none") == (name == "bf16"), (name, compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_last_conv_on_the_gpu_is_as_faithful_as_the_layers(dtype, no_tf32):
    """qwen3-omni's width, the fast sine and every setting the report compiles: the waveform and the window
    against the torch reference in fp64, no further off than the reference in ``dtype`` (cuDNN's convolution)."""
    import torch

    from omni_lightning.kernels.last_conv import CANDIDATES, last_conv_reference, last_conv_tiles, last_conv_triton

    dtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(5)
    rand = lambda *s, scale=1.0: torch.randn(*s, device="cuda", generator=gen) * scale  # noqa: E731
    for length in (24_000, 3001, 77, 5):
        x, history = rand(2, length, 96), rand(2, 6, 96)
        la, lb, pending = rand(96, scale=0.3), rand(96, scale=0.3), rand(96, scale=0.1)
        weight, bias = rand(1, 96, 7, scale=0.5 / 26), rand(1, scale=0.1)
        kw = dict(fresh=torch.tensor([True, False], device="cuda"), junk=555,
                  window_end=torch.tensor([length, length // 2], device="cuda"))  # fmt: skip
        high = last_conv_reference(x.double(), la.double(), lb.double(), pending.double(), weight.double(),
                                   bias.double(), history=history.double(), **kw)  # fmt: skip
        low = (x.to(dtype), la, lb, pending, weight.to(dtype).transpose(1, 2).contiguous().transpose(1, 2), bias)
        theirs = last_conv_reference(*low, history=history.to(dtype), **kw)
        for block_t, warps in CANDIDATES:
            ours = last_conv_triton(*low, history=history.to(dtype), tiles=last_conv_tiles(96, block_t, warps), **kw)
            for i, what in enumerate(("waveform", "window")):
                errors = [float((y[i].double() - high[i]).norm() / high[i].norm()) for y in (ours, theirs)]
                # + an eighth of one rounding of the output: at 5 samples a row the norms are of 10 values, and
                # one fp16 rounding more or less moved ours to 1.18x cuDNN's (5.9e-4 against 5.0e-4, H100)
                slack = max(1e-5, torch.finfo(dtype).eps / 8)
                assert errors[0] <= 1.1 * errors[1] + slack, (what, length, block_t, warps, errors)


@pytest.mark.gpu
def test_a_forward_and_streams_with_the_last_conv_kernel_are_as_faithful_as_the_layers(no_tf32):
    """qwen3-omni in bf16, ``Kernels.for_inference("cuda", last_conv=True)`` against the fp32 forward, no further
    off than without it; the tiny model's streams (fp32) through CUDA graphs with it equal the whole decode."""
    import dataclasses

    import torch
    from conftest import random_model
    from helpers import bf16_errors, random_codes

    from omni_lightning import DecodeEngine, StreamingDecoder
    from omni_lightning.kernels import Kernels

    ours = Kernels.for_inference("cuda", last_conv=True)
    errors = bf16_errors({"ours": ours, "layers": dataclasses.replace(ours, last_conv=None)})
    assert errors["ours"] <= 1.1 * errors["layers"] + 1e-4, errors
    tiny = random_model("tiny", seed=4).cuda()  # fp32: streams through CUDA graphs equal the whole decode
    codes = random_codes(2, 40, tiny.config, seed=8).cuda()
    kernels = Kernels.for_inference("cuda", last_conv=True)
    with torch.no_grad():
        whole = tiny.decode(codes)
    engine = DecodeEngine(tiny, kernels=kernels, max_rows=2, graph_frames=64, graph_share=0.75)
    streams = StreamingDecoder(tiny, max_streams=2, engine=engine)
    sids, pieces = [streams.open(), streams.open()], [[], []]
    for start, n in ((0, 1), (1, 7), (8, 16), (24, 16)):
        for sid, wav in streams.step({sid: codes[i, :, start : start + n] for i, sid in enumerate(sids)}).items():
            pieces[sids.index(sid)].append(wav)
    assert engine.graphs and engine.graphs.graphs  # the steps replayed graphs
    for i in range(2):
        assert (torch.cat(pieces[i], dim=-1) - whole[i]).abs().max() <= 1e-4, i
