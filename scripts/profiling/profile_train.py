"""Where one fine-tuning step spends its device time: kernels grouped by kind, and the top kernels.

    PYTHONPATH=. python scripts/profiling/profile_train.py --preset tiny --device cpu --batch 2 --crop-seconds 0.5
    PYTHONPATH=. python scripts/profiling/profile_train.py --preset qwen3-omni --device cuda --batch 32

Run from the repository root with the package importable (``pip install -e .`` or ``PYTHONPATH=.``).
A real Lightning fit (``bench_train.py``'s data, module and Trainer) for the generator alone and
with the GAN; after ``--warmup`` batches, one batch is profiled with ``torch.profiler``, from its
start hook to its end hook with the device synchronized at both: forward, losses, backward,
clipping and optimizer step(s). On CUDA the table is kernels by self device time; on the CPU (a
smoke run) it is operators by self CPU time. Groups come from kernel names (:data:`GROUPS`, first
match wins); ``step_ms`` is wall time, so ``kernel_ms`` well below it means the device waited on the
host. The batch before the profiled one has its operators counted (``operators``: what the host
launches, on the CPU as on a GPU where the same kernels are chosen). Prints markdown; writes JSON
(``--out``) and markdown (``--markdown``) for docs/performance.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: bench/bench_train.py
from bench.bench_train import fit_trainer, fresh_module, machine, paired_loader, synchronize, write_json
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from omni_lightning import Code2Wav, randomize_weights

ELEMENTWISE = "SnakeBeta / elementwise / casts"
# (group, lowercase name fragments), first match wins: PyTorch's elementwise kernels before the
# convolutions (a cast kernel's name may say "convert"), cuDNN's own FFT convolutions before the FFTs
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("memory copies", ("memcpy", "memset")),
    ("optimizer + clipping", ("multi_tensor_apply", "_foreach", "adam")),
    (ELEMENTWISE, ("elementwise", "vectorized", "unrolled", "snake", "pointwise", "triton_poi")),
    (
        "convolution",
        ("conv", "cudnn", "implicit_gemm", "fprop", "dgrad", "wgrad", "winograd", "flip_filter", "im2col", "col2im"),
    ),  # fmt: skip
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("STFT / FFT", ("fft", "radix", "stft")),
    ("GEMM", ("gemm", "nvjet", "cublas", "cutlass", "aten::mm", "aten::addmm", "aten::bmm", "matmul")),
    ("reduction / norm", ("reduce", "norm", "softmax", "aten::sum", "aten::mean", "aten::max", "aten::min")),
    (
        ELEMENTWISE,
        (
            "sin",
            "cos",
            "exp",
            "pow",
            "mul",
            "add",
            "sub",
            "div",
            "copy",
            "cat",
            "leaky",
            "abs",
            "log",
            "clamp",
            "where",
            "gather",
            "scatter",
            "index",
            "fill",
            "pad",
            "reflection",
            "aten::",
        ),
    ),  # fmt: skip
]


def group_of(name: str) -> str:
    lower = name.lower()
    return next((group for group, fragments in GROUPS if any(f in lower for f in fragments)), "other")


# operators that take memory or make a view without running a kernel
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
              "_local_scalar_dense", "is_same_size", "set_", "resize_", "alias", "_record_function_enter_new",
              "_record_function_exit", "promote_types"}  # fmt: skip


class CountOperators(TorchDispatchMode):
    """Counts the operators that run a kernel, after autograd (backward's included): on CUDA about one
    launch each (a cuDNN or fused call may launch a few), the same count on any device except where
    the kernels chosen differ (the CPU runs SnakeBeta as torch operators, CUDA as one Triton kernel
    each way). The count is read on the CPU: on CUDA autograd runs the backward in its own device
    thread, which may not see the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class ProfileOneBatch(pl.Callback):
    """Profiles the batch after ``warmup`` batches, synchronizing the device before and after it;
    counts the operators of the batch before it (:class:`CountOperators`)."""

    def __init__(self, warmup: int, activities: list[ProfilerActivity]) -> None:
        self.warmup, self.activities, self.seen = warmup, activities, 0
        self.profiler: profile | None = None
        self.counter: CountOperators | None = None
        self.step_s = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.seen == self.warmup - 1:
            self.counter = CountOperators()
            self.counter.__enter__()
        if self.seen == self.warmup:
            synchronize(pl_module)
            self.profiler = profile(activities=self.activities)
            self.profiler.__enter__()
            self.step_s = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.seen == self.warmup - 1:
            self.counter.__exit__(None, None, None)
        if self.seen == self.warmup:
            synchronize(pl_module)
            self.step_s = time.perf_counter() - self.step_s
            self.profiler.__exit__(None, None, None)
        self.seen += 1


def _annotation(event: Any) -> bool:
    """A range the profiler draws on the device timeline around other kernels (``Optimizer.step#...``),
    not a kernel: counting it would count the kernels inside it twice."""
    return bool(getattr(event, "is_user_annotation", False)) or event.key.startswith(("Optimizer.", "ProfilerStep#"))


def kernel_table(prof: profile, device: str, rows: int) -> dict[str, Any]:
    """Self time per kernel (CUDA) or operator (CPU), grouped, and the top ``rows`` of them."""
    on_device = device == "cuda"
    events = [
        e
        for e in prof.key_averages()
        if e.device_type.name == ("CUDA" if on_device else "CPU") and not (on_device and _annotation(e))
    ]
    timed = [(e.key, (e.self_device_time_total if on_device else e.self_cpu_time_total) / 1e3, e.count) for e in events]
    timed = sorted((t for t in timed if t[1] > 0), key=lambda t: -t[1])
    total = sum(ms for _, ms, _ in timed)
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, ms, count in timed:
        groups[group_of(name)][0] += ms
        groups[group_of(name)][1] += count
    return {
        "kernel_ms": total,
        "kernels": sum(count for _, _, count in timed),
        "groups": [
            {"group": g, "ms": ms, "share": ms / max(total, 1e-9), "calls": int(calls)}
            for g, (ms, calls) in sorted(groups.items(), key=lambda kv: -kv[1][0])
        ],
        "top": [
            {"name": name[:200], "group": group_of(name), "ms": ms, "calls": count} for name, ms, count in timed[:rows]
        ],
    }


def profile_one(base: Code2Wav, args: argparse.Namespace, adversarial: bool) -> dict[str, Any]:
    config = base.config
    frames = round(args.crop_seconds * config.frame_rate)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    callback = ProfileOneBatch(args.warmup, activities)
    module = fresh_module(base, adversarial, 1e-4, args.graphs == "on")
    trainer = fit_trainer(args.device, args.precision, args.warmup + 1, [callback])
    trainer.fit(module, train_dataloaders=paired_loader(config, args.batch, frames, args.warmup + 1))
    table = kernel_table(callback.profiler, args.device, args.rows)
    counts = callback.counter.counts if callback.counter is not None else {}
    table["operators"] = sum(counts.values())
    table["top_operators"] = dict(sorted(counts.items(), key=lambda kv: -kv[1])[: args.rows])
    return {
        "mode": "generator + GAN" if adversarial else "generator",
        "preset": args.preset,
        "precision": args.precision,
        "batch": args.batch,
        "crop_s": args.crop_seconds,
        "step_ms": 1000 * callback.step_s,
        **table,
    }


def markdown(run: dict[str, Any], unit: str) -> str:
    lines = [
        f"**{run['mode']}**, {run['preset']} {run['precision']}, batch {run['batch']} x {run['crop_s']:g} s: "
        f"step {run['step_ms']:.1f} ms wall, {run['kernel_ms']:.1f} ms of {unit} ({run['kernels']} calls); "
        f"{run['operators']} operators dispatched in the batch before",
        "",
        "| group | ms | share | calls |",
        "|---|---|---|---|",
    ]
    lines += [f"| {g['group']} | {g['ms']:.2f} | {g['share']:.1%} | {g['calls']} |" for g in run["groups"]]
    lines += ["", f"| top {unit} | group | ms | calls |", "|---|---|---|---|"]
    lines += [f"| `{t['name'][:90]}` | {t['group']} | {t['ms']:.2f} | {t['calls']} |" for t in run["top"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--crop-seconds", type=float, default=2.0)
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="batches before the profiled one (>= 2: the last one's operators are counted)",
    )
    parser.add_argument("--graphs", choices=["on", "off"], default="on", help="fit's CUDA graphs of the generator")
    parser.add_argument("--rows", type=int, default=15, help="top kernels listed")
    parser.add_argument("--modes", nargs="+", choices=["generator", "gan"], default=["generator", "gan"])
    parser.add_argument("--out", default="profile_train.json")
    parser.add_argument("--markdown", default="profile_train.md")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.backends.cudnn.benchmark = True

    base = randomize_weights(Code2Wav(args.preset)).eval()
    runs = [profile_one(base, args, mode == "gan") for mode in args.modes]
    write_json(args.out, args, runs)
    unit = "CUDA kernels" if args.device == "cuda" else "CPU operators"
    text = f"{args.preset} fine-tuning step on {machine(args.device)}\n\n" + "\n".join(markdown(r, unit) for r in runs)
    with open(args.markdown, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
