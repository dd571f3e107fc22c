"""Launch settings as data: what each Triton launcher compiles on a model's shapes, for the kernel report.

**The convention** (``scripts/kernels/kernel_report.py`` and ``tests/test_kernel_report.py`` find every kernel
module that follows it; nothing else needs to change when a module joins):

- A module ``omni_lightning/kernels/<op>.py`` may define ``hopper_launches(layers) -> list[KernelLaunch]``,
  ``layers`` a sequence of :class:`LayerShape` (the model's layers in forward order, from
  ``omni_lightning.models.shapes.layer_shapes(config)``, which walks the model built on the meta
  device; a kernel module may not import ``models``, so the walk comes to it). It returns one
  :class:`KernelLaunch` per launch its launcher makes on those layers, in bf16 and fp32.
- The launcher and ``hopper_launches`` derive the tiles, warps and stages from one function (for
  SnakeBeta ``snake_beta.forward_tiles`` / ``backward_tiles``) and the kernel's arguments from one
  function too; ``hopper_launches`` passes those arguments, with :class:`MockTensor` for tensors,
  to :func:`bind`, which specializes them as Triton's JIT does at a launch (16-byte alignment,
  integers divisible by 16, unit strides as constants). So the report compiles what a launch compiles.
- ``default_path=False`` marks a launch only an opt-in path makes (``last_conv.py``): reported
  (``kernel_report.py --opt-in``), not held to the rule that the default path neither spills nor
  exceeds shared memory.

A :class:`KernelLaunch` holds ``kernel`` (a name, e.g. ``"snake_beta.forward"``), ``fn`` (the
``@triton.jit`` function), ``signature``, ``constexprs`` and ``attrs`` (as ``triton.compiler.ASTSource``
takes them), ``num_warps``, ``num_stages``, ``label`` (the layers or stage it serves), ``dtype``
(``"bf16"`` or ``"fp32"``), ``default_path`` and ``notes`` (free text, kept in the report's JSON).
Not here: the compiling (``kernels/hopper.py``), and launch flags that vary call by call within one
tile setting (each module's ``hopper_launches`` says which values it lists): they compile variants
of the same tile, which are not compiled here, so their registers and spills go unchecked.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class LayerShape:
    """One layer of the model as the kernels see it. ``kind``: ``"snake"``, ``"conv"`` (a causal
    convolution, dilated or 1x1; ``groups`` for depthwise), ``"conv_transpose"``, ``"linear"``,
    ``"norm"`` or ``"attention"`` (one pre-transformer layer's attention, coarse). ``rows_per_second``:
    the input rows one audio second gives it; ``stage``: the block it belongs to (``"decoder.2"``)."""

    name: str
    kind: str
    stage: str
    channels_in: int
    channels_out: int
    rows_per_second: float
    kernel: int = 1
    dilation: int = 1
    stride: int = 1
    groups: int = 1
    window: int = 0  # attention: keys per query


@dataclass(frozen=True)
class KernelLaunch:
    """One compile a launcher makes (module docstring)."""

    kernel: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    num_warps: int
    num_stages: int
    label: str
    dtype: str
    default_path: bool = True
    notes: str = field(default="", compare=False)

    @property
    def tiles(self) -> str:
        """The ``BLOCK_*`` constexprs, ``"32x128"`` (in the kernel's argument order)."""
        names = self.fn.arg_names
        blocks = [(names[k[0]], v) for k, v in self.constexprs.items() if names[k[0]].startswith("BLOCK_")]
        return "x".join(str(v) for _, v in sorted(blocks, key=lambda nv: names.index(nv[0])))

    @property
    def key(self) -> tuple:
        """What makes two launches one compile."""
        sig = tuple(self.signature.items())
        return (self.fn.cache_key, sig, tuple(sorted(self.constexprs.items())), repr(sorted(self.attrs.items())),
                self.num_warps, self.num_stages)  # fmt: skip


class MockTensor:
    """A tensor argument for :func:`bind`: a dtype and a shape (contiguous strides), 16-byte aligned."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...] = (1,)) -> None:
        self.dtype, self.shape = dtype, tuple(shape)

    @staticmethod
    def data_ptr() -> int:
        return 0

    def stride(self, dim: int | None = None):
        strides = [1]
        for size in reversed(self.shape[1:]):
            strides.insert(0, strides[0] * size)
        return tuple(strides) if dim is None else strides[dim]


def hopper_target():
    """Triton's sm_90 CUDA target (``GPUTarget("cuda", 90, 32)``; Triton compiles wgmma as sm_90a)."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def bind(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, int, int]:
    """``fn[grid](*args, **kwargs)`` as Triton's JIT would specialize it for sm_90: ``(signature,
    constexprs, attrs, num_warps, num_stages)``. Uses the JIT's own binder (``triton.runtime.jit``)."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(hopper_target())
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, options, bound, specialization, options)
    return signature, constexprs, attrs, options.num_warps, options.num_stages


def launch(kernel: str, fn, args: tuple, kwargs: dict, label: str, dtype: str, **extra) -> KernelLaunch:
    """A :class:`KernelLaunch` of ``fn[grid](*args, **kwargs)`` (:func:`bind`)."""
    signature, constexprs, attrs, warps, stages = bind(fn, args, kwargs)
    return KernelLaunch(kernel, fn, signature, constexprs, attrs, warps, stages, label, dtype, **extra)


def kernel_modules() -> list:
    """Every ``omni_lightning.kernels.*`` module that defines ``hopper_launches``, by name."""
    found = []  # the folder, not the package: its __init__ imports the kernels, which import this file
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda i: i.name):
        module = importlib.import_module(f"{__package__}.{info.name}")
        if callable(getattr(module, "hopper_launches", None)):
            found.append(module)
    return found


def all_launches(layers) -> list[KernelLaunch]:
    """Every module's ``hopper_launches(layers)``, in module order."""
    return [one for module in kernel_modules() for one in module.hopper_launches(layers)]


def stages_label(layers, channels: int) -> str:
    """``"768 ch (decoder.1, decoder.2)"``: a channel count and the stages whose layers have it."""
    stages = list(dict.fromkeys(layer.stage for layer in layers))
    return f"{channels} ch ({', '.join(stages)})"
