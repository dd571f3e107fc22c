"""The kernel report, on any machine (no GPU needed): every Triton launch the code makes on a preset's
shapes, compiled for Hopper (sm_90a), and what one audio second costs per decoder stage.

    python scripts/kernels/kernel_report.py                          # qwen3-omni, the default path
    python scripts/kernels/kernel_report.py --opt-in --json k.json   # the opt-in kernels too; JSON as well

Part one: each ``omni_lightning.kernels`` module that defines ``hopper_launches`` (the convention in
``kernels/launches.py``) lists its launches on the preset's layers (``models/shapes.layer_shapes``),
bf16 and fp32; each distinct compile runs once (``kernels/hopper.py``) and the table gives its tiles,
warps, stages, matrix instructions (wgmma, mma.sync or none), registers, spill bytes (stores / loads),
shared memory against the 227 KB limit and the warps per SM they allow. The exit status is 1 when a
default-path launch spills or exceeds shared memory; opt-in launches (``--opt-in``) are reported only.
Where Triton's NVIDIA backend or its ptxas is missing, part one is skipped with the reason (status 0).

Part two: per stage, for each layer type, the tensor-core FLOPs and activation bytes one audio second
costs in bf16 (``models/shapes.layer_cost``: derived from the model's layers, coarse where it says
so) and the floor each sets: bytes over bandwidth, FLOPs over the dense bf16 rate, at an H100's
datasheet rates and at the rates measured on this workplace's H100. Not here: timings (a device
call measures those), weights' bytes (once per forward, printed apart), any kernel's achieved rate.
Run it before a GPU run of the battery (``scripts/device/device_battery.py``'s docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime

RATES = {  # bytes/s, FLOP/s (dense bf16)
    "datasheet": (3.35e12, 990e12),  # H100 SXM 80 GB
    "measured": (3.0e12, 800e12),  # this workplace's H100 (docs/performance.md)
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="qwen3-omni", help="the model config (a preset name)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON here")
    p.add_argument("--opt-in", action="store_true", help="also compile the opt-in kernels' launches (slow)")
    return p


def header() -> list[str]:
    import torch

    try:
        import triton

        version = triton.__version__
    except ImportError:
        version = "not installed"
    return [
        f"kernel report, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, on {platform.node() or 'this machine'}: "
        f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU needed",
        f"triton {version} (the device has triton 3.6: its code may differ), torch {torch.__version__}, "
        f"target sm_90a (GPUTarget('cuda', 90, 32))",
    ]


def compile_all(layers, opt_in: bool) -> tuple[list[dict], list[str]]:
    """Every launch compiled: one row each, and the default path's problems."""
    from omni_lightning.kernels import hopper, launches

    rows, problems = [], []
    for launch in launches.all_launches(layers):
        if not launch.default_path and not opt_in:
            continue
        began = time.perf_counter()
        compiled = hopper.compile_launch(launch)
        trouble = hopper.clean(launch, compiled)
        if trouble and launch.default_path:
            problems.append(f"{launch.kernel} {launch.label} {launch.dtype}: {'; '.join(trouble)}")
        rows.append(dict(kernel=launch.kernel, label=launch.label, dtype=launch.dtype, tiles=launch.tiles,
                         num_warps=launch.num_warps, num_stages=launch.num_stages, default_path=launch.default_path,
                         notes=launch.notes, compile_s=round(time.perf_counter() - began, 2),
                         **compiled.as_dict()))  # fmt: skip
    return rows, problems


def launch_table(rows: list[dict]) -> list[str]:
    from omni_lightning.kernels.hopper import SHARED_LIMIT

    lines = ["| kernel | stage / shape | dtype | tiles | warps | stages | MMA | registers | spills (st / ld B) "
             "| shared (KB of 227) | occupancy (warps/SM of 64) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for default in (True, False):
        part = [r for r in rows if r["default_path"] is default]
        if not default and part:
            lines.append("| **opt-in (not on the default path)** | | | | | | | | | | |")
        for r in part:
            kb = f"{r['shared'] / 1024:.1f}" + (" **over**" if r["shared"] > SHARED_LIMIT else "")
            spills = f"{r['spill_stores']} / {r['spill_loads']}"
            lines.append(f"| {r['kernel']} | {r['label']} | {r['dtype']} | {r['tiles']} | {r['num_warps']} | "
                         f"{r['num_stages']} | {r['mma']} | {r['registers']} | {spills} | {kb} | "
                         f"{r['occupancy_warps']} |")  # fmt: skip
    return lines


def floors(cost) -> dict[str, float]:
    """Microseconds per audio second: each rate's bandwidth and compute floor, and the larger."""
    out = {}
    for name, (bandwidth, flops) in RATES.items():
        out[f"{name}_bw_us"] = cost.bytes / bandwidth * 1e6
        out[f"{name}_compute_us"] = cost.flops / flops * 1e6
        out[f"{name}_floor_us"] = max(out[f"{name}_bw_us"], out[f"{name}_compute_us"])
    return out


def cost_rows(layers) -> list[dict]:
    from omni_lightning.models.shapes import Cost, stage_costs

    rows, total = [], Cost(0.0, 0.0)
    for stage, groups in stage_costs(layers).items():
        first, *_, last = [layer for layer in layers if layer.stage == stage] * 2
        rows_out = last.rows_per_second * (last.stride if last.kind == "conv_transpose" else 1)
        shape = f"{first.channels_in}>{last.channels_out} ch, {first.rows_per_second:g}>{rows_out:g} rows/s"
        for name, cost in groups.items():
            rows.append(dict(stage=stage, shape=shape, group=name, gflop=cost.flops / 1e9, mb=cost.bytes / 1e6,
                             **floors(cost)))  # fmt: skip
            total = total + cost
    rows.append(dict(stage="total", shape="", group="all", gflop=total.flops / 1e9, mb=total.bytes / 1e6,
                     **floors(total)))  # fmt: skip
    return rows


def cost_table(rows: list[dict]) -> list[str]:
    lines = ["| stage | channels, rows per audio second | layer type | GFLOP | MB "
             "| datasheet: bytes / FLOPs floor (us) | measured: bytes / FLOPs floor (us) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['stage']} | {r['shape']} | {r['group']} | {r['gflop']:.2f} | {r['mb']:.1f} | "
                     f"{r['datasheet_bw_us']:.1f} / {r['datasheet_compute_us']:.1f} | "
                     f"{r['measured_bw_us']:.1f} / {r['measured_compute_us']:.1f} |")  # fmt: skip
    total = rows[-1]
    for name, (bandwidth, flops) in RATES.items():
        floor = total[f"{name}_floor_us"]
        lines.append(f"\n{name} ({bandwidth / 1e12:.2f} TB/s, {flops / 1e12:.0f} TFLOP/s): "
                     f"{total[f'{name}_bw_us']:.1f} us of bytes, {total[f'{name}_compute_us']:.1f} us of FLOPs "
                     f"per audio second; each row at the larger of its two floors, summed: "
                     f"{sum_floor(rows, name):.1f} us, at most {1e6 / sum_floor(rows, name):,.0f}x real time "
                     f"(bytes and FLOPs overlapped across the whole forward: {1e6 / floor:,.0f}x)")  # fmt: skip
    return lines


def sum_floor(rows: list[dict], name: str) -> float:
    """The forward's floor with each stage's layer type bound by its own limit (bytes or FLOPs)."""
    return sum(r[f"{name}_floor_us"] for r in rows[:-1])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from omni_lightning.kernels import hopper
    from omni_lightning.models.shapes import layer_shapes, weight_bytes

    layers = layer_shapes(args.preset)
    report = dict(header=header(), preset=args.preset, launches=[], problems=[], skipped=None)
    print("\n".join(report["header"]), end="\n\n")
    why = hopper.missing()
    if why:
        report["skipped"] = f"kernel table skipped: {why}"
        print(report["skipped"], end="\n\n")
    else:
        rows, problems = compile_all(layers, args.opt_in)
        report.update(launches=rows, problems=problems)
        print("\n".join(launch_table(rows)), end="\n\n")
        for problem in problems:
            print(f"default path: {problem}")
    report["costs"] = cost_rows(layers)
    report["weight_mb"] = weight_bytes(args.preset) / 1e6
    print(f"One audio second of {args.preset} in bf16, per stage and layer type (activations only; the weights, "
          f"{report['weight_mb']:.0f} MB, are read once per forward):\n")  # fmt: skip
    print("\n".join(cost_table(report["costs"])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
