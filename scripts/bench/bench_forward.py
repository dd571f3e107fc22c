"""The decode engine on fixed batches of 10 s clips against transformers, and its bf16 fidelity.

    python scripts/bench/bench_forward.py                                     # a GPU: batch 1 and 32, bf16
    python scripts/bench/bench_forward.py --compile                           # + transformers with torch.compile
    python scripts/bench/bench_forward.py --budget-gib 8 --no-fidelity        # the engine at another default budget
    python scripts/bench/bench_forward.py --device cpu --preset tiny --batches 1 2 --repeats 2   # smoke test

- **forward**: ``DecodeEngine.decode`` of ``--batches`` 10 s clips (codes on the device, waveforms on
  the device; CUDA graphs replayed, warm), against transformers' ``Qwen3OmniMoeCode2Wav`` eager (and
  ``torch.compile``'d, ``dynamic=False``, with ``--compile``) on the same weights; x real time =
  audio seconds / median wall seconds. Batch 1 is also the latency of one clip. ``eager``: the same
  model's plain forward with the engine's kernels, one call for the batch (the engine's ceiling);
  ``engine_vs_eager`` the ratio. ``--budget-gib``: the engine's memory budget with no cap (default:
  ``budget.DEFAULT_BUDGET``), for choosing that default.
- **fidelity**: four 10 s clips, relative L2 and multi-resolution mel distance against the fp32
  reference (transformers, TF32 off): the engine in bf16 and transformers in bf16. The guard: ours
  no worse than theirs.
``cudnn.benchmark`` stays off (the default). Prints a table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import median_time, memory, peer, random_model, rel_l2, save

from omni_lightning import Code2Wav, DecodeEngine


def engine_for(base: Code2Wav, device: torch.device, dtype: torch.dtype, budget_gib: float | None) -> DecodeEngine:
    model = Code2Wav(base.config).to(device, dtype).eval()
    model.load_state_dict(base.state_dict())
    return DecodeEngine(model, budget=None if budget_gib is None else int(budget_gib * 2**30))


def fidelity(base: Code2Wav, device: torch.device) -> dict:
    from omni_lightning.training.losses import MultiResolutionMelLoss

    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, base.config.codebook_size, (4, base.config.num_quantizers, 125), generator=gen).to(device)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    with torch.inference_mode():
        want = peer(base, torch.float32, device)(codes).float()
        theirs = peer(base, torch.bfloat16, device)(codes).float()
        ours = torch.stack(engine_for(base, device, torch.bfloat16).decode(codes, [125] * 4)).float()
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    mel = MultiResolutionMelLoss(base.config.sample_rate).to(device)
    res = {
        "ours_rel_l2": rel_l2(ours, want),
        "transformers_rel_l2": rel_l2(theirs, want),
        "ours_mel": float(mel(ours[:, 0], want[:, 0])),
        "transformers_mel": float(mel(theirs[:, 0], want[:, 0])),
    }
    res["guard_holds"] = res["ours_rel_l2"] <= res["transformers_rel_l2"] and res["ours_mel"] <= res["transformers_mel"]
    return res


def forward_rows(base: Code2Wav, args: argparse.Namespace, device: torch.device) -> list[dict]:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    engine = engine_for(base, device, dtype, args.budget_gib)
    ref = peer(base, dtype, device)
    compiled = torch.compile(ref, dynamic=False) if args.compile else None
    frames = round(args.seconds * base.config.frame_rate)
    rows = []
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        codes = torch.randint(0, base.config.codebook_size, (batch, base.config.num_quantizers, frames), generator=gen)
        codes = codes.to(device)
        audio = batch * base.config.output_length(frames) / base.config.sample_rate
        row = {"batch": batch, "audio_s": audio}
        with torch.inference_mode():
            candidates = {
                "ours": lambda c=codes, n=[frames] * batch: engine.decode(c, n),
                "eager": lambda c=codes: engine.model(c, None, engine.kernels),
                "transformers": lambda c=codes: ref(c),
            }
            if compiled is not None:
                candidates["transformers_compile"] = lambda c=codes: compiled(c)
            for name, fn in candidates.items():
                seconds = median_time(fn, device, warmup=3, repeats=args.repeats)
                row[name] = {"ms": 1e3 * seconds, "x_realtime": audio / seconds}
        row["frames_per_forward"] = engine.frames_per_forward
        row["engine_vs_eager"] = row["ours"]["x_realtime"] / row["eager"]["x_realtime"]
        row["ours_vs_transformers"] = row["ours"]["x_realtime"] / row["transformers"]["x_realtime"]
        if compiled is not None:
            row["ours_vs_compile"] = row["ours"]["x_realtime"] / row["transformers_compile"]["x_realtime"]
        rows.append(row)
        print(row, flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--budget-gib", type=float, default=None, help="the engine's memory budget (default: its own)")
    parser.add_argument("--no-fidelity", action="store_true")
    parser.add_argument("--out", default="bench_forward.json")
    return parser


def main() -> None:
    args = parser().parse_args()
    device = torch.device(args.device)
    base = random_model(args.preset)
    res = {"forward": forward_rows(base, args, device), **memory(device)}
    if not args.no_fidelity:
        res["fidelity"] = fidelity(base, device)
    save(args.out, res, args)
    print(f"\n{args.preset} {args.dtype}, {args.seconds:g} s clips")
    print("| batch | ours ms | ours x | engine/eager | transformers x | ours/transformers | transformers+compile x |")
    print("|---|---|---|---|---|---|---|")
    for r in res["forward"]:
        comp = r.get("transformers_compile", {}).get("x_realtime")
        print(
            f"| {r['batch']} | {r['ours']['ms']:.2f} | {r['ours']['x_realtime']:,.0f} | {r['engine_vs_eager']:.2f} | "
            f"{r['transformers']['x_realtime']:,.0f} | {r['ours_vs_transformers']:.2f} | "
            f"{'' if comp is None else f'{comp:,.0f}'} |"
        )
    if "fidelity" in res:
        f = res["fidelity"]
        print(
            f"fidelity vs fp32: ours bf16 rel L2 {f['ours_rel_l2']:.3e} mel {f['ours_mel']:.4f}; "
            f"transformers bf16 {f['transformers_rel_l2']:.3e} mel {f['transformers_mel']:.4f}; "
            f"guard holds: {f['guard_holds']}"
        )


if __name__ == "__main__":
    main()
