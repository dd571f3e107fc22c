"""Which implementation runs each decoder residual unit, by its shape: one table, carried by ``Kernels``.

A residual unit after its first SnakeBeta runs one of three paths, the most fused first:

- ``"residual_unit"``: the dilated convolution, its SnakeBeta, the 1x1 convolution and the residual add
  as one kernel (``kernels/residual_unit.py``);
- ``"conv_snake"``: the dilated convolution with its SnakeBeta as one kernel (``kernels/conv_snake.py``),
  then the 1x1 convolution as one GEMM into the stream;
- ``"layers"``: cuDNN's convolution, a SnakeBeta pass, the same GEMM.

A :class:`UnitPaths` table names a path per shape; a unit that cannot take it (widths or dtype the kernel
does not take, autograd recording, the kernel absent from its ``Kernels``) takes the next path down.
:data:`CHOICES` are the tables ``Kernels.for_inference(fused_units=...)`` picks from: conv_snake everywhere
(``False``, the default), the one kernel everywhere (``True``) and ``"per-width"``: the one kernel up
to 96 channels, conv_snake above, where each was the faster on a GPU (``docs/performance.md``); the
scripts' ``--units`` name them ``none``, ``all`` and ``per-width`` (:data:`NAMES`). Not
here: the measuring (``scripts/bench/bench_forward.py --units``), a table per GPU model (one table
serves every card until one measures otherwise). Standard library only: kernel modules and the
kernel report read it.
"""

from __future__ import annotations

from dataclasses import dataclass

PATHS = ("residual_unit", "conv_snake", "layers")  # the most fused first: a unit falls back down this list


@dataclass(frozen=True)
class UnitPaths:
    """``rows`` of ``(channels, dilations, path)``: a unit takes the path of the first row whose
    ``channels`` is at least its own and whose ``dilations`` hold its dilation (empty: any), else
    ``default``. ``name`` says the table in benchmarks' output."""

    name: str
    default: str
    rows: tuple[tuple[int, tuple[int, ...], str], ...] = ()

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != 3 or not isinstance(row[0], int) or row[0] < 1 or not isinstance(row[1], tuple):
                raise ValueError(f"row {row!r} of table {self.name!r} is not (channels >= 1, (dilations...), path)")
        for path in (self.default, *(row[2] for row in self.rows)):
            if path not in PATHS:
                raise ValueError(f"unit path {path!r} in table {self.name!r} is not one of {PATHS}")

    def path(self, channels: int, dilation: int) -> str:
        """The path this table names for a unit of ``channels`` channels and ``dilation``."""
        for most, dilations, path in self.rows:
            if channels <= most and (not dilations or dilation in dilations):
                return path
        return self.default


MOST_FUSED = UnitPaths("most fused", "residual_unit")  # a hand-built Kernels: whatever kernels it is given
CONV_SNAKE = UnitPaths("conv_snake", "conv_snake")
ONE_KERNEL = UnitPaths("one kernel", "residual_unit")
PER_WIDTH = UnitPaths("per-width", "conv_snake", ((96, (), "residual_unit"),))
CHOICES = {False: CONV_SNAKE, True: ONE_KERNEL, "per-width": PER_WIDTH}  # Kernels.for_inference(fused_units=...)
NAMES = {"none": False, "all": True, "per-width": "per-width"}  # the scripts' --units: the fused_units each names


def choice(fused_units: bool | str) -> UnitPaths:
    """The table of :data:`CHOICES` that ``fused_units`` names; a ValueError naming any other value."""
    if not isinstance(fused_units, (bool, str)) or fused_units not in CHOICES:
        raise ValueError(f"fused_units must be False, True or 'per-width', got {fused_units!r}")
    return CHOICES[fused_units]
