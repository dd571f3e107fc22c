"""The fine-tuning recipe's evidence: distils a teacher into a student, tiny preset, CPU, and logs mel
distance, PESQ and STOI on the validation pairs against steps, per recipe variant.

The teacher is ``make_teacher("tiny", seed=21)``; ``make_demo_data`` makes 24 training pairs of 1-2 s
(seed 0) and 6 validation pairs of 1.5-3 s (seed 1) from it. Benchmarks (a variant's ``target``):

- ``decoder`` (the default benchmark): the student is the teacher with every weight tensor of more than
  one element, except the code embedding, perturbed by 0.25 of its std. The training pairs use a fifth
  of the embedding's rows, so only a benchmark that leaves the embedding alone can be won;
- ``covered``: every weight perturbed by 0.25 of its std, and training pairs whose codes cover every
  embedding row the validation codes use: each codebook's validation codes, shuffled in time
  (independently per codebook, so the frames are new), repeated ``COVER`` times and cut into pairs of
  1-2 s; the teacher's audio of them;
- ``shifted``: the ``decoder`` student, its training audio each made late by a random 0-1 ms (``SHIFT``
  samples): the same sound with a phase the codes do not fix, as recorded audio has (what a waveform term
  costs there);
- ``perturbed``: the old benchmark, every weight perturbed by 0.3 of its std, random training pairs:
  the embedding floor's evidence (``docs/results/recipe_sweep_floor.json``);
- ``perturbed-net``, ``other-seed``, ``only:<part>``: the old benchmark's diagnostics (the embedding
  left as the teacher's; another teacher, ``make_teacher("tiny", seed=7)``; one part perturbed).

A recipe's ``train_pairs`` (``768-pairs*``) makes the training set larger: the 24 pairs, then more of the
same kind (made once per ``--work`` folder); ``768-pairs-config*`` also take ``configs/finetune.yaml``'s
recipe (``CONFIG``: warm-up, EMA; ``CONFIG_DATA``: batch 8, 4 s crops, the config's until 2026-12-07, kept so
that the results named ``768-pairs-config`` keep their meaning; the config's batch is now 16:
``768-pairs-config-batch-16``). Each variant is a
``Code2WavModule`` recipe (the module's defaults overridden by its settings) and the data's batch and crop;
``--set`` overrides settings for every variant named, ``--tag`` names such a run; ``--seed`` (0 by default) is
the training run's (batch order, crops; the pairs and the student stay), a result per seed. Results are written to
the JSON after each variant (a killed sweep keeps what it finished); ``--plot`` and ``--table`` make the
figure and markdown table from that JSON.

    OMP_NUM_THREADS=1 python scripts/quality/recipe_sweep.py --variants default --steps 600 --eval-every 100
    OMP_NUM_THREADS=1 python scripts/quality/recipe_sweep.py --variants 768-pairs-config 768-pairs-config/shifted \
        --out docs/results/recipe_sweep_768.json --work runs/recipe/data
    python scripts/quality/recipe_sweep.py --plot docs/results/recipe_curves.png --table

The validation during fit is of the EMA weights where the variant has EMA, as Lightning's is; the
``train_pairs`` figures are of the module after fit (the same weights) on the training pairs. Not
done: a GPU run (the recipe is measured on the tiny preset only).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch

# a recipe: module settings over Code2WavModule's defaults, and data settings; each variant changes one thing
OLD = dict(learning_rate=1e-4, warmup_steps=0, ema_decay=None)  # the module's defaults before the first sweep
CONFIG = dict(warmup_steps=100, ema_decay=0.999)  # configs/finetune.yaml's settings over the module's defaults
CONFIG_DATA = dict(batch_size=8, crop_frames=50)  # and its data's before batch 16 (the module docstring)
RECIPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "default": ({}, {}),
    "old-default": (OLD, {}),
    "lr-1e-3": ({"learning_rate": 1e-3}, {}),
    "lr-3e-4": ({"learning_rate": 3e-4}, {}),
    "lr-3e-3": ({"learning_rate": 3e-3}, {}),
    "lr-1e-2": ({"learning_rate": 1e-2}, {}),
    "constant": ({"min_lr_ratio": 1.0}, {}),
    "lr-3e-3-constant": ({"learning_rate": 3e-3, "min_lr_ratio": 1.0}, {}),
    "warmup-20": ({"warmup_steps": 20}, {}),
    "ema-0.999": ({"ema_decay": 0.999}, {}),
    "betas-0.9-0.999": ({"betas": (0.9, 0.999)}, {}),
    "no-clip": ({"grad_clip": None}, {}),
    "clip-0.1": ({"grad_clip": 0.1}, {}),
    "mel-only": ({"stft_weight": 0.0}, {}),
    "stft-only": ({"mel_weight": 0.0}, {}),
    "mel-45": ({"mel_weight": 45.0}, {}),
    "waveform-10": ({"waveform_weight": 10.0}, {}),
    "crop-12": ({}, {"crop_frames": 12}),
    "batch-8": ({}, {"batch_size": 8}),
    "gan": ({"adversarial": True}, {}),
    "96-pairs": ({}, {"train_pairs": 96}),
    "768-pairs": ({}, {"train_pairs": 768}),
    "768-pairs-lr-2e-3": ({"learning_rate": 2e-3}, {"train_pairs": 768}),
    "768-pairs-batch-8": ({}, {"train_pairs": 768, "batch_size": 8}),
    "768-pairs-waveform-10": ({"waveform_weight": 10.0}, {"train_pairs": 768}),
    "768-pairs-batch-8-waveform-10": ({"waveform_weight": 10.0}, {"train_pairs": 768, "batch_size": 8}),
    "768-pairs-batch-16": ({}, {"train_pairs": 768, "batch_size": 16}),
    "768-pairs-config": (CONFIG, {"train_pairs": 768, **CONFIG_DATA}),
    "768-pairs-config-waveform-10": ({**CONFIG, "waveform_weight": 10.0}, {"train_pairs": 768, **CONFIG_DATA}),
    "768-pairs-config-lr-2e-3": ({**CONFIG, "learning_rate": 2e-3}, {"train_pairs": 768, **CONFIG_DATA}),
    "768-pairs-config-constant": ({**CONFIG, "min_lr_ratio": 1.0}, {"train_pairs": 768, **CONFIG_DATA}),
    "768-pairs-config-decay-0.3": ({**CONFIG, "decay_fraction": 0.3}, {"train_pairs": 768, **CONFIG_DATA}),
    "768-pairs-config-batch-16": (CONFIG, {"train_pairs": 768, **CONFIG_DATA, "batch_size": 16}),
    "768-pairs-config-no-ema": ({**CONFIG, "ema_decay": None}, {"train_pairs": 768, **CONFIG_DATA}),
    "768-pairs-config-gan": ({**CONFIG, "adversarial": True}, {"train_pairs": 768, **CONFIG_DATA}),
    "frozen-embedding": ({"freeze": ["code_embedding"]}, {}),
    "frozen-pre-transformer": ({"freeze": ["code_embedding", "pre_transformer"]}, {}),
}
# a variant is "<recipe>" (the decoder benchmark) or "<recipe>/<target>"; the old sweep's names ("lr-1e-3/net",
# "default" on "perturbed") are in recipe_sweep_floor.json
TARGETS = ("decoder", "covered", "shifted", "perturbed", "perturbed-net", "other-seed",
           *(f"only:{part}" for part in ("code_embedding", "pre_transformer", "upsample", "decoder")))  # fmt: skip
RECIPE = ("learning_rate", "betas", "warmup_steps", "min_lr_ratio", "decay_fraction", "grad_clip", "mel_weight",
          "stft_weight", "waveform_weight", "ema_decay", "adversarial", "freeze")  # fmt: skip
METRICS = (("mel_distance", ".3f"), ("pesq", ".2f"), ("stoi", ".3f"))
DATA = {"batch_size": 4, "crop_frames": 25}  # the sweep's data settings unless a variant says otherwise
SHIFT = 24  # the shifted benchmark: its training audio up to this many samples late (1 ms)
COVER = 4  # the covered benchmark: how often each validation code's row appears in its training pairs


def variant(name: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(target, module settings, data settings)`` of a variant name (a ``+tag`` ignored)."""
    recipe, _, target = name.split("+")[0].partition("/")
    target = target or "decoder"
    if recipe not in RECIPES or target not in TARGETS:
        raise SystemExit(f"error: unknown variant {name!r}: recipes {', '.join(RECIPES)}; targets {', '.join(TARGETS)}")
    return (target, *RECIPES[recipe])


def _write_pairs(folder: Path, name: str, codes: list[torch.Tensor], teacher: torch.nn.Module) -> Path:
    """A manifest of ``codes`` (``[16, T]`` each) and the teacher's audio of them."""
    import numpy as np
    import soundfile as sf

    (folder / "codes").mkdir(parents=True, exist_ok=True)
    (folder / "audio").mkdir(exist_ok=True)
    rows = []
    for i, c in enumerate(codes):
        req_id = f"{Path(name).stem}-{i:03d}"
        np.save(folder / "codes" / f"{req_id}.npy", c.numpy().astype(np.int64))
        with torch.inference_mode():
            wav = teacher(c[None])[0, 0].float()
        sf.write(folder / "audio" / f"{req_id}.wav", wav.numpy(), 24000, subtype="FLOAT")
        rows.append({"id": req_id, "codes": f"codes/{req_id}.npy", "audio": f"audio/{req_id}.wav"})
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / name


def covering_codes(val_codes: list[torch.Tensor], repeat: int = COVER, seed: int = 2) -> list[torch.Tensor]:
    """Training codes holding every (codebook, code) of ``val_codes`` ``repeat`` times: per codebook its
    validation codes, shuffled in time independently of the other codebooks, cut into pairs of 13-25 frames."""
    gen = torch.Generator().manual_seed(seed)
    stream = torch.cat(val_codes, dim=1).repeat(1, repeat)  # [16, F]
    stream = torch.stack([row[torch.randperm(row.numel(), generator=gen)] for row in stream])
    pieces, at = [], 0
    while at < stream.shape[1]:
        length = int(torch.randint(13, 26, (), generator=gen))
        pieces.append(stream[:, at : at + length])
        at += length
    return [p for p in pieces if p.shape[1] >= 13] or pieces  # a stub of the end would be shorter than a crop


def make_pairs(folder: Path, train_pairs: int = 24, target: str = "decoder") -> tuple[Path, Path]:
    """The training and validation manifests (made once in ``folder``); ``train_pairs`` other than 24: a
    larger training set (the same 24 first, then more); ``covered``: the training pairs of
    :func:`covering_codes`."""
    import numpy as np

    from omni_lightning.data.synthetic import make_demo_data, make_teacher

    name = "train.jsonl" if train_pairs == 24 else f"train-{train_pairs}.jsonl"
    name = "train-covered.jsonl" if target == "covered" else name
    train, val = folder / name, folder / "val.jsonl"
    teacher = make_teacher("tiny", seed=21)
    if not val.exists():
        make_demo_data(folder, 6, 1.5, 3.0, teacher=teacher, seed=1, name="val.jsonl")
    if not train.exists() and target == "covered":
        rows = [json.loads(line) for line in val.read_text().splitlines()]
        codes = covering_codes([torch.from_numpy(np.load(folder / r["codes"])) for r in rows])
        _write_pairs(folder, name, codes, teacher)
    elif not train.exists():
        make_demo_data(folder, train_pairs, 1.0, 2.0, teacher=teacher, seed=0, name=name)
    if target == "shifted":
        return shifted_pairs(train), val
    return train, val


def shifted_pairs(train: Path, most: int = SHIFT, seed: int = 3) -> Path:
    """``train``'s pairs with each audio made late by a random 0 to ``most`` samples (made once): the same
    sound (1 ms late scores PESQ 4.6, STOI 0.98 against the reference: docs/finetuning.md), a phase the codes
    do not fix, as in recorded audio."""
    import numpy as np
    import soundfile as sf

    out = train.with_name(f"{train.stem}-shifted.jsonl")
    if out.exists():
        return out
    gen = torch.Generator().manual_seed(seed)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    for row in rows:
        wav, rate = sf.read(train.parent / row["audio"], dtype="float32")
        late = int(torch.randint(0, most + 1, (), generator=gen))
        row["audio"] = row["audio"].replace(".wav", "-shifted.wav")
        late_wav = np.concatenate([np.zeros(late, np.float32), wav[: len(wav) - late]])
        sf.write(train.parent / row["audio"], late_wav, rate, subtype="FLOAT")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def perturbed(model: torch.nn.Module, scale: float = 0.3, seed: int = 0, keep: tuple[str, ...] = ()) -> Any:
    """A copy of ``model`` with every weight tensor of more than one element (except those named in
    ``keep``) plus ``scale`` times its std of Gaussian noise."""
    student = copy.deepcopy(model).train()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if p.numel() > 1 and not name.startswith(keep):
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    return student


def student_for(target: str) -> Any:
    from omni_lightning.data.synthetic import make_teacher

    teacher = make_teacher("tiny", seed=21)
    if target in ("decoder", "shifted"):
        return perturbed(teacher, 0.25, keep=("code_embedding",))
    if target == "covered":
        return perturbed(teacher, 0.25)
    if target == "other-seed":
        return make_teacher("tiny", seed=7).train()
    if target.startswith("only:"):  # one part perturbed (the parts: code_embedding, pre_transformer, upsample, decoder)
        parts = tuple({n.split(".")[0] for n, _ in teacher.named_parameters()} - {target[5:]})
        return perturbed(teacher, keep=parts)
    return perturbed(teacher, keep=("code_embedding",) if target == "perturbed-net" else ())


def _scores(metrics: dict[str, Any], stage: str) -> dict[str, float]:
    names = ("mel_distance", "pesq", "stoi", "si_sdr")
    return {n: round(float(metrics[f"{stage}/{n}"]), 4) for n in names if f"{stage}/{n}" in metrics}


def _trainer(**kw: Any) -> Any:
    from omni_lightning import Trainer

    common = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    return Trainer(**common, enable_model_summary=False, **kw)


def _curve_logger() -> Any:
    from lightning.pytorch.loggers import Logger

    class CurveLogger(Logger):
        """Every value logged, by step, in memory."""

        name, version = "curve", 0

        def __init__(self) -> None:
            super().__init__()
            self.steps: dict[int, dict[str, float]] = {}

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.steps.setdefault(int(step or 0), {}).update(metrics)

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    return CurveLogger()


def run_variant(name: str, work: Path, steps: int, eval_every: int, extra: dict, seed: int = 0) -> dict[str, Any]:
    from omni_lightning import Code2WavModule, CodesDataModule

    target, settings, data_settings = variant(name)
    data = {**DATA, **data_settings, **{k: v for k, v in extra.items() if k in DATA}}
    settings = {**settings, **{k: v for k, v in extra.items() if k not in DATA}}
    torch.manual_seed(seed)  # the training run's: the pairs, teacher and student stay the same
    module = Code2WavModule(
        model=student_for(target), quality_metrics=["pesq", "stoi"], quality_workers=1, log_samples=0, **settings
    )
    train, val = make_pairs(work, data.get("train_pairs", 24), target)
    loader = {k: v for k, v in data.items() if k != "train_pairs"}
    datamodule = CodesDataModule(train=str(train), val=str(val), num_workers=0, seed=seed, **loader)
    curve = [{"step": 0, **_scores(_trainer().validate(module, datamodule=datamodule, verbose=False)[0], "val")}]
    start = time.perf_counter()
    log = _curve_logger()  # fit's quality scores reach only its loggers (evaluation/quality.py)
    trainer = _trainer(max_steps=steps, val_check_interval=eval_every, check_val_every_n_epoch=None,
                       num_sanity_val_steps=0)  # fmt: skip
    trainer.loggers = [log]
    trainer.fit(module, datamodule=datamodule)
    curve += [
        {"step": step + 1, **_scores(values, "val")}
        for step, values in sorted(log.steps.items())
        if "val/mel_distance" in values
    ]  # fmt: skip (logged at the step's 0-based index)
    seconds = time.perf_counter() - start
    # the module after fit (EMA weights when it keeps them) on the training pairs: codes it has seen
    seen = CodesDataModule(val=str(train), batch_size=8, num_workers=0)
    on_train = _scores(_trainer().validate(module, datamodule=seen, verbose=False)[0], "val")
    recipe = {k: module.hparams[k] for k in RECIPE}
    return {"name": name, "target": target, "recipe": recipe, "data": data, "steps": steps, "seed": seed,
            "seconds": round(seconds, 1), "curve": curve, "final": curve[-1], "train_pairs": on_train}  # fmt: skip


def sweep(
    names: list[str], out: Path, work: Path, steps: int, eval_every: int, extra: dict, tag: str, seed: int = 0
) -> None:
    for name in names:
        variant(name)  # an unknown name fails before any run
    results = json.loads(out.read_text()) if out.exists() else {}
    for name in names:
        result = run_variant(name + tag, work, steps, eval_every, extra, seed)
        results[name + tag] = result
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        f = result["final"]
        print(f"{name:24s} {steps} steps {result['seconds']:6.1f} s  mel {f['mel_distance']:.3f}  "
              f"PESQ {f.get('pesq', float('nan')):.2f}  STOI {f.get('stoi', float('nan')):.3f}  "
              f"train-pairs mel {result['train_pairs']['mel_distance']:.3f}", flush=True)  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """Markdown: per variant, the validation pairs' values before and after, and the training pairs' after."""
    rows = [
        "| variant | target | steps | mel distance | PESQ | STOI | training pairs: mel, PESQ, STOI |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        first, last, seen = r["curve"][0], r["final"], r["train_pairs"]
        cells = [f"{first.get(k, math.nan):{f}} -> {last.get(k, math.nan):{f}}" for k, f in METRICS]
        trained = f"{seen['mel_distance']:.3f}, {seen.get('pesq', math.nan):.2f}, {seen.get('stoi', math.nan):.3f}"
        rows.append(f"| {r['name']} | {r['target']} | {r['steps']} | {' | '.join(cells)} | {trained} |")
    return "\n".join(rows).replace("nan -> nan", "-").replace("-> nan", "-> -")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(results) / 4)  # the legend's, four names a row (long names: seven overflowed the figure)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.0 + 0.22 * rows))
    for ax in axes:  # more variants than the default cycle's 10 colours
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for r in results.values():
        steps = [p["step"] for p in r["curve"]]
        style = {"decoder": "-", "covered": "--"}.get(r["target"], ":")
        for ax, key in zip(axes, ("mel_distance", "pesq", "stoi")):
            ax.plot(steps, [p.get(key, float("nan")) for p in r["curve"]], style, label=r["name"], linewidth=1.2)
    for ax, title, target in zip(axes, ("mel distance (val)", "PESQ (val)", "STOI (val)"), (None, 3.5, 0.8)):
        if target:  # the recipe's target on this benchmark
            ax.axhline(target, color="gray", linestyle="-.", linewidth=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.22 * rows / (4.0 + 0.22 * rows) + 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = f"<recipe>[/<target>]; recipes: {', '.join(RECIPES)}; targets: {', '.join(TARGETS)}"
    parser.add_argument("--variants", nargs="*", default=["default"], help=names)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument(
        "--set", type=json.loads, default={}, help='settings over every variant\'s, e.g. {"learning_rate": 1e-3}'
    )
    parser.add_argument("--tag", default="", help="appended to the variants' names in the results (+tag)")
    parser.add_argument("--seed", type=int, default=0, help="the training run's seed (batch order, crops); data alike")
    parser.add_argument("--out", type=Path, default=Path("docs/results/recipe_sweep.json"))
    parser.add_argument("--work", type=Path, default=Path("runs/recipe/data"))
    parser.add_argument("--plot", type=Path, help="write the curves of --out's results here (no runs)")
    parser.add_argument("--table", action="store_true", help="print --out's results as a markdown table (no runs)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.plot or args.table:
        results = json.loads(args.out.read_text())
        if args.plot:
            plot(results, args.plot)
        if args.table:
            print(table(results))
        return
    torch.set_num_threads(1)
    tag = (f"+{args.tag}" if args.tag else "") + (f"+seed{args.seed}" if args.seed else "")  # a result per seed
    sweep(args.variants, args.out, args.work, args.steps, args.eval_every, args.set, tag, args.seed)


if __name__ == "__main__":
    main()
