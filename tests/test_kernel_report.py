"""The kernel report's rules, on the CPU: every Triton launch on the default path compiles for Hopper
(sm_90a) within the shared-memory limit and without spilling, and what the report compiles is what
the launchers launch.

Skipped, with the reason, where Triton's NVIDIA backend or its ptxas is missing. Each distinct
compile runs once (``kernels/hopper.py`` caches within the process); Triton's disk cache points at a
fresh folder, so nothing is reused across runs. Opt-in launches (``default_path=False``) are not
compiled here (``scripts/kernels/kernel_report.py --opt-in`` reports them).
"""

import json
import sys

import pytest
import torch
from helpers import ROOT

from omni_lightning.kernels import hopper, launches

WHY = hopper.missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@pytest.fixture(scope="module")
def layers():
    from omni_lightning.models.shapes import layer_shapes

    return layer_shapes("qwen3-omni")


@pytest.fixture(scope="module")
def default_path(layers):
    return [one for one in launches.all_launches(layers) if one.default_path]


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
    yield
    mp.undo()


def test_every_default_path_launch_compiles_for_sm90a_clean(default_path, fresh_cache):
    kernels = {one.kernel for one in default_path}
    assert {"snake_beta.forward", "snake_beta.backward"} <= kernels
    assert {one.dtype for one in default_path} == {"bf16", "fp32"}
    problems = []
    for one in {one.key: one for one in default_path}.values():  # each distinct compile once
        compiled = hopper.compile_launch(one)
        problems += [f"{one.kernel} {one.label} {one.dtype} {one.tiles}: {p}" for p in hopper.clean(one, compiled)]
        assert compiled.registers > 0 and compiled.occupancy_warps > 0, (one.kernel, compiled)
    assert not problems, "\n".join(problems)


def test_the_report_runs_and_writes_its_json(tmp_path, fresh_cache, capsys):
    """After the test above, in the same process: its compiles are cached, so this costs the walk and the table."""
    sys.path.insert(0, str(ROOT / "scripts" / "kernels"))
    import kernel_report

    assert kernel_report.main(["--json", str(tmp_path / "report.json")]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["launches"] and not report["problems"] and report["skipped"] is None
    snake = [row for row in report["launches"] if row["kernel"].startswith("snake_beta.")]
    assert snake and {row["mma"] for row in snake} == {"none"}  # SnakeBeta: elementwise, no matrix
    total = report["costs"][-1]
    assert total["stage"] == "total" and 60 < total["gflop"] < 70  # ~64 GFLOP per audio second (issue 50)
    assert "| snake_beta.forward | 1536 ch (decoder.1) | bf16 | 32x128 | 4 | 3 | none |" in capsys.readouterr().out


def test_a_spill_or_too_much_shared_memory_is_a_problem():
    one = hopper.Compiled("wgmma", 255, 864, 1088, 0, 40 * 1024, 8)
    assert hopper.clean(None, one) == ["spills 864 / 1088 B, stack 0 B"]
    over = hopper.Compiled("mma.sync", 128, 0, 0, 0, 294_912, 0)
    assert hopper.clean(None, over) == ["shared memory 294912 B over the 232448 B limit"]


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: records ``kernel[grid](*args, **kwargs)``, runs nothing."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_report_compiles_what_the_snake_beta_launchers_launch(layers, default_path, dtype, monkeypatch):
    """Each SnakeBeta channel count of the model: the launcher's call (recorded, on CPU tensors), bound
    as Triton's JIT binds it, equals the launch ``hopper_launches`` lists (signature, constexprs,
    specializations, warps, stages)."""
    from omni_lightning.kernels import snake_beta

    forward = Recorder(snake_beta._snake_beta_kernel)
    monkeypatch.setattr(snake_beta, "_snake_beta_kernel", forward)
    backward = Recorder(snake_beta._snake_beta_backward_kernel)
    monkeypatch.setattr(snake_beta, "_snake_beta_backward_kernel", backward)
    listed = {(one.kernel, one.label.split(" ")[0]): one for one in default_path if one.dtype == dtype}
    channel_counts = sorted({layer.channels_in for layer in layers if layer.kind == "snake"})
    assert channel_counts == [96, 192, 384, 768, 1536]
    for channels in channel_counts:
        t = torch.float32 if dtype == "fp32" else torch.bfloat16
        x, params = torch.zeros(2, 40, channels, dtype=t), torch.zeros(channels, dtype=t)
        bias, context = torch.zeros(channels), torch.zeros(2, 6, channels, dtype=t)
        out = snake_beta.snake_beta_triton(x, params, params, bias, context=context, context_len=6, fresh=True,
                                           junk=6, multiple=3)  # fmt: skip
        snake_beta.snake_beta_triton_backward(out, x, params, params, bias, context_len=6, fresh=True, junk=6)
        for kernel, recorder in (("snake_beta.forward", forward), ("snake_beta.backward", backward)):
            one = listed[(kernel, str(channels))]
            args, kwargs = recorder.calls.pop()
            bound = launches.bind(recorder.fn, args, kwargs)
            listed_as = (one.signature, one.constexprs, one.attrs, one.num_warps, one.num_stages)
            assert bound == listed_as, (kernel, channels)
            tiles = (snake_beta.forward_tiles if kernel.endswith("forward") else snake_beta.backward_tiles)(channels)
            assert one.tiles == f"{tiles.block_t}x{tiles.block_c}"


def test_the_report_compiles_what_the_conv_snake_launchers_launch(layers, default_path, monkeypatch):
    """The fused convolution's forward and backward at each width the model gives it: the launchers' calls
    (recorded, on CPU tensors, as the model makes them: ``a`` with history rows, the weight as a parameter
    holds it), bound as Triton's JIT binds them, equal the launches ``hopper_launches`` lists."""
    from omni_lightning.kernels import conv_snake

    forward = Recorder(conv_snake._conv_snake_kernel)
    monkeypatch.setattr(conv_snake, "_conv_snake_kernel", forward)
    backward = Recorder(conv_snake._conv_snake_backward_kernel)
    monkeypatch.setattr(conv_snake, "_conv_snake_backward_kernel", backward)
    listed = {(one.kernel, one.label.split(" ")[0]): one for one in default_path if one.kernel.startswith("conv_snake")}
    assert sorted({int(label) for _, label in listed}) == [96, 192]
    for channels in (96, 192):
        length, dilation = 45, 3
        a = torch.zeros(2, 6 * dilation + length, channels, dtype=torch.bfloat16)
        w, params = (
            torch.zeros(channels, channels, 7, dtype=torch.bfloat16),
            torch.zeros(channels, dtype=torch.bfloat16),
        )
        conv_snake.conv_snake_triton(a, w, params, params, params, dilation, length)
        grad = torch.zeros(2, length, channels, dtype=torch.bfloat16)
        conv_snake.conv_snake_triton_backward(grad, a, w, params, params, params, dilation, length)
        for kernel, recorder in (("conv_snake", forward), ("conv_snake.backward", backward)):
            one = listed[(kernel, str(channels))]
            args, kwargs = recorder.calls.pop()
            listed_as = (one.signature, one.constexprs, one.attrs, one.num_warps, one.num_stages)
            assert launches.bind(recorder.fn, args, kwargs) == listed_as, (kernel, channels)


def test_occupancy_follows_the_sm90_limits():
    assert hopper.occupancy(4, 64, 512) == 32  # registers: 65,536 / (64 x 32) = 32 warps
    assert hopper.occupancy(4, 32, 0) == 64  # threads: 2,048 per SM
    assert hopper.occupancy(8, 255, 176 * 1024) == 8  # one block by both registers and shared memory
    assert hopper.occupancy(4, 40, 294_912) == 0  # over the per-block limit: does not launch
