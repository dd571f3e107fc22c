"""The decode engine on fixed batches of 10 s clips against transformers, and its bf16 fidelity.

    python scripts/bench/bench_forward.py                                     # a GPU: batch 1 and 32, bf16
    python scripts/bench/bench_forward.py --compile                           # + transformers with torch.compile
    python scripts/bench/bench_forward.py --budget-gib 8 --no-fidelity        # the engine at another default budget
    python scripts/bench/bench_forward.py --last-conv off on --rounds 3        # the output layer's kernel off and on
    python scripts/bench/bench_forward.py --device cpu --preset tiny --batches 1 2 --repeats 2   # smoke test

- **forward**: ``DecodeEngine.decode`` of ``--batches`` 10 s clips (codes on the device, waveforms on
  the device; CUDA graphs replayed, warm), against transformers' ``Qwen3OmniMoeCode2Wav`` eager (and
  ``torch.compile``'d, ``dynamic=False``, with ``--compile``) on the same weights; x real time =
  audio seconds / median wall seconds. Batch 1 is also the latency of one clip. ``eager``: the same
  model's plain forward with the engine's kernels, one call for the batch (the engine's ceiling);
  ``engine_vs_eager`` the ratio. ``--budget-gib``: the engine's memory budget with no cap (default:
  ``budget.DEFAULT_BUDGET``), for choosing that default.
- **--last-conv**: the output layer's kernel (``Kernels.for_inference(last_conv=...)``, ``kernels/last_conv.py``)
  ``off`` (the default), ``on`` or both, one engine each on the same model. Every measure of a batch (each
  choice's engine and eager forward, transformers) is timed in turns, ``--rounds`` rounds of ``--repeats``,
  in one process on one GPU; each choice's figures go under ``last_conv``, and the first choice's are also
  the row's ``ours`` and ``eager``. Each timing holds the median of every repeat (``ms``) and of each round
  (``rounds_ms``: the spread a choice must win beyond).
- **fidelity**: four 10 s clips, relative L2 and multi-resolution mel distance against the fp32
  reference (transformers, TF32 off): the engine in bf16 (each ``--last-conv`` choice) and transformers in
  bf16. The guard: ours no worse than theirs, for every choice (``guard_holds``; each choice's under
  ``last_conv``).
``cudnn.benchmark`` stays off (the default). Prints a table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import interleaved_samples, memory, peer, random_model, rel_l2, save

from omni_lightning import Code2Wav, DecodeEngine
from omni_lightning.kernels import Kernels


def choices(last_conv: list[str]) -> dict[str, bool]:
    """Each measured choice's name (a ``--last-conv`` value, in order, once) -> the output layer's kernel on."""
    return {lc: lc == "on" for lc in dict.fromkeys(last_conv)}


def engines_for(base: Code2Wav, device: torch.device, dtype: torch.dtype, budget_gib: float | None,
                names: dict[str, bool]) -> dict[str, DecodeEngine]:  # fmt: skip
    """One engine per choice of :func:`choices`, all on one copy of ``base`` in ``dtype`` on ``device``."""
    model = Code2Wav(base.config).to(device, dtype).eval()
    model.load_state_dict(base.state_dict())
    budget = None if budget_gib is None else int(budget_gib * 2**30)
    return {name: DecodeEngine(model, budget=budget, kernels=Kernels.for_inference(device, last_conv=on))
            for name, on in names.items()}  # fmt: skip


def fidelity(base: Code2Wav, device: torch.device, names: dict[str, bool]) -> dict:
    from omni_lightning.training.losses import MultiResolutionMelLoss

    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, base.config.codebook_size, (4, base.config.num_quantizers, 125), generator=gen).to(device)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    with torch.inference_mode():
        want = peer(base, torch.float32, device)(codes).float()
        theirs = peer(base, torch.bfloat16, device)(codes).float()
        engines = engines_for(base, device, torch.bfloat16, None, names)
        ours = {u: torch.stack(engine.decode(codes, [125] * 4)).float() for u, engine in engines.items()}
        for engine in engines.values():
            engine.close()
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    mel = MultiResolutionMelLoss(base.config.sample_rate).to(device)
    theirs_l2, theirs_mel = rel_l2(theirs, want), float(mel(theirs[:, 0], want[:, 0]))
    per_choice = {}
    for u, got in ours.items():
        one = {"ours_rel_l2": rel_l2(got, want), "ours_mel": float(mel(got[:, 0], want[:, 0]))}
        one["guard_holds"] = one["ours_rel_l2"] <= theirs_l2 and one["ours_mel"] <= theirs_mel
        per_choice[u] = one
    first = per_choice[next(iter(names))]
    return {"ours_rel_l2": first["ours_rel_l2"], "transformers_rel_l2": theirs_l2, "ours_mel": first["ours_mel"],
            "transformers_mel": theirs_mel, "guard_holds": all(c["guard_holds"] for c in per_choice.values()),
            "last_conv": per_choice}  # fmt: skip


def forward_rows(base: Code2Wav, args: argparse.Namespace, device: torch.device) -> list[dict]:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    engines = engines_for(base, device, dtype, args.budget_gib, args.choices)
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
            candidates = {}
            for u, engine in engines.items():
                candidates[f"ours {u}"] = lambda c=codes, n=[frames] * batch, e=engine: e.decode(c, n)
                candidates[f"eager {u}"] = lambda c=codes, e=engine: e.model(c, None, e.kernels)
            candidates["transformers"] = lambda c=codes: ref(c)
            if compiled is not None:
                candidates["transformers_compile"] = lambda c=codes: compiled(c)
            samples = interleaved_samples(candidates, device, warmup=3, repeats=args.repeats, rounds=args.rounds)
        timing = {}
        for name, runs in samples.items():  # the median of every repeat, and of each round (the spread)
            s = statistics.median(t for one in runs for t in one)
            timing[name] = {"ms": 1e3 * s, "x_realtime": audio / s,
                            "rounds_ms": [1e3 * statistics.median(one) for one in runs]}  # fmt: skip
        row["last_conv"] = {}
        for u, engine in engines.items():
            ours, eager = timing[f"ours {u}"], timing[f"eager {u}"]
            row["last_conv"][u] = {"kernels": engine.kernels.name, "ours": ours, "eager": eager,
                                   "engine_vs_eager": ours["x_realtime"] / eager["x_realtime"]}  # fmt: skip
        first = row["last_conv"][next(iter(args.choices))]
        row.update(ours=first["ours"], eager=first["eager"], transformers=timing["transformers"])
        row["frames_per_forward"] = engines[next(iter(args.choices))].frames_per_forward
        row["engine_vs_eager"] = first["engine_vs_eager"]
        row["ours_vs_transformers"] = row["ours"]["x_realtime"] / row["transformers"]["x_realtime"]
        if compiled is not None:
            row["transformers_compile"] = timing["transformers_compile"]
            row["ours_vs_compile"] = row["ours"]["x_realtime"] / row["transformers_compile"]["x_realtime"]
        rows.append(row)
        print(row, flush=True)
    for engine in engines.values():
        engine.close()
    return rows


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of --repeats, every measure in turn")
    parser.add_argument(
        "--last-conv",
        nargs="+",
        default=["off"],
        choices=("off", "on"),
        help="the output layer's kernel, Kernels.for_inference(last_conv=...): off, on or both; the first is 'ours'",
    )
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--budget-gib", type=float, default=None, help="the engine's memory budget (default: its own)")
    parser.add_argument("--no-fidelity", action="store_true")
    parser.add_argument("--out", default="bench_forward.json")
    return parser


def main() -> None:
    args = parser().parse_args()
    args.choices = choices(args.last_conv)
    device = torch.device(args.device)
    base = random_model(args.preset)
    res = {"forward": forward_rows(base, args, device), **memory(device)}
    if not args.no_fidelity:
        res["fidelity"] = fidelity(base, device, args.choices)
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
    if len(args.choices) > 1:
        choices_table(res)


def choices_table(res: dict) -> None:
    """Each ``--last-conv`` choice's engine and eager forward, timed in turns, and its fidelity guard."""
    print("\n| batch | last conv | kernels | engine ms | engine x | eager ms | eager x | engine/eager | guard holds |")
    print("|---|---|---|---|---|---|---|---|---|")
    guards = res.get("fidelity", {}).get("last_conv", {})
    for r in res["forward"]:
        for u, c in r["last_conv"].items():
            guard = guards.get(u, {}).get("guard_holds", "")
            print(f"| {r['batch']} | {u} | {c['kernels']} | {c['ours']['ms']:.2f} | {c['ours']['x_realtime']:,.0f} | "
                  f"{c['eager']['ms']:.2f} | {c['eager']['x_realtime']:,.0f} | {c['engine_vs_eager']:.2f} | "
                  f"{guard} |")  # fmt: skip


if __name__ == "__main__":
    main()
