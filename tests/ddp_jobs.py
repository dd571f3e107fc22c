"""Jobs that tests/test_ddp.py runs as real processes: Lightning's DDP launcher starts the other ranks by
running this file again (a pytest process cannot be re-run that way). Each rank records what it saw
in ``<record>.rank<r>.pt``.

    python tests/ddp_jobs.py predict RECORD OUT_DIR --devices 2 --lengths 3 40 7 ... [--limit 0.5] [--decode-all]
    python tests/ddp_jobs.py fit RECORD --devices 2 --batch-size 2 --steps 4 [--gan] [--ema] [--resume CKPT]
    python tests/ddp_jobs.py validate RECORD --devices 2 --good 3 [--bad] [--quality]
"""

import argparse
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import random_codes, random_model  # noqa: E402

from omni_lightning import Code2WavModule, CodesDataModule, Trainer, WaveformWriter  # noqa: E402
from omni_lightning.data.synthetic import make_demo_data, make_teacher  # noqa: E402

QUIET = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)


class DecodedHere(pl.Callback):
    """The requests this rank decoded, in order, and whether predict's start and end hooks ran."""

    def __init__(self) -> None:
        self.req_ids: list[str] = []
        self.hooks: list[str] = []

    def on_predict_start(self, trainer, pl_module):
        self.hooks.append("start")

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.req_ids += outputs.req_ids

    def on_predict_end(self, trainer, pl_module):
        self.hooks.append("end")


class StepLog(pl.Callback):
    """This rank's logged training values after every step (its own batch: they are not reduced)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
        self.steps.append({**values, "req_ids": list(batch["req_ids"]), "global_step": trainer.global_step})


def predict(args: argparse.Namespace) -> None:
    requests = {f"r{i:02d}": random_codes(1, n, seed=i)[0] for i, n in enumerate(args.lengths)}
    writer, seen = WaveformWriter(args.out_dir), DecodedHere()
    limit = float(args.limit) if "." in args.limit else int(args.limit)
    trainer = Trainer(**QUIET, devices=args.devices, strategy="ddp", use_distributed_sampler=False,
                      callbacks=[writer, seen], limit_predict_batches=limit)  # fmt: skip
    data = CodesDataModule(predict=requests, batch_size=2, skip_done=None if args.decode_all else args.out_dir)
    trainer.predict(Code2WavModule(model=random_model("tiny")), datamodule=data, return_predictions=False)
    record = {"req_ids": seen.req_ids, "hooks": seen.hooks, "stats": writer.stats, "summary": writer.summary()}
    torch.save(record, f"{args.record}.rank{trainer.global_rank}.pt")


def fit(args: argparse.Namespace) -> None:
    data = Path(args.record).parent / "pairs"
    if not (data / "train.jsonl").exists():  # rank 0 makes it before it starts the other ranks
        make_demo_data(data, 8, 1.0, 1.0, teacher=make_teacher("tiny"), seed=0, name="train.jsonl")
    torch.manual_seed(0)  # the discriminators' initialisation (DDP then broadcasts rank 0's)
    # total_steps fixed: a run cut short and resumed keeps the uninterrupted run's schedule
    module = Code2WavModule(model=random_model("tiny", seed=7), learning_rate=1e-3, adversarial=args.gan,
                            ema_decay=0.9 if args.ema else None, total_steps=100)  # fmt: skip
    callbacks: list[pl.Callback] = [log := StepLog()]
    if args.save:  # at the epoch's end, inside fit: the EMA weights and the raw ones (ema.py)
        save = Path(args.save)
        callbacks.append(pl.callbacks.ModelCheckpoint(save.parent, save.stem, enable_version_counter=False))
    strategy = "ddp" if args.devices > 1 else "auto"  # the GAN: the module asks DDP to find unused parameters
    trainer = Trainer(**QUIET, devices=args.devices, strategy=strategy, max_steps=args.steps, callbacks=callbacks,
                      num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=bool(args.save))  # fmt: skip
    datamodule = CodesDataModule(train=str(data / "train.jsonl"), batch_size=args.batch_size, num_workers=0)
    trainer.fit(module, datamodule=datamodule, ckpt_path=args.resume)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    torch.save({"steps": log.steps, "state": state}, f"{args.record}.rank{trainer.global_rank}.pt")


def validate(args: argparse.Namespace) -> None:
    """``--good`` requests, batches of one; ``--bad``: one more, the longest (so rank 0's first), whose
    audio holds a NaN: skipped as it is read, so with one good request rank 0 has nothing to score;
    ``--quality``: PESQ and STOI too."""
    import json

    import numpy as np
    import soundfile as sf

    data = Path(args.record).parent / "pairs"
    if not (data / "val.jsonl").exists():  # rank 0 makes it before it starts the other ranks
        manifest = make_demo_data(data, args.good, 1.0, 1.5, teacher=make_teacher("tiny"), seed=4, name="val.jsonl")
        if args.bad:
            np.save(data / "bad.npy", random_codes(1, 40, seed=9)[0].numpy())
            audio = np.zeros(40 * 1920, dtype=np.float32)
            audio[100] = np.nan
            sf.write(data / "bad.wav", audio, 24000, subtype="FLOAT")
            with open(manifest, "a") as f:
                f.write(json.dumps({"id": "bad", "codes": "bad.npy", "audio": "bad.wav"}) + "\n")
    trainer = Trainer(**QUIET, devices=args.devices, strategy="ddp" if args.devices > 1 else "auto")
    datamodule = CodesDataModule(val=str(data / "val.jsonl"), batch_size=1, num_workers=0, on_bad_input="skip")
    quality = ["pesq", "stoi"] if args.quality else None
    trainer.validate(Code2WavModule(model=random_model("tiny", seed=7), quality_metrics=quality), datamodule=datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    torch.save({"metrics": metrics}, f"{args.record}.rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="job", required=True)
    p = sub.add_parser("predict")
    p.add_argument("record")
    p.add_argument("out_dir")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--lengths", type=int, nargs="+", required=True)
    p.add_argument("--limit", default="1.0")  # limit_predict_batches: "2" batches, "0.5" of them
    p.add_argument("--decode-all", action="store_true")  # the data is not told what is finished
    f = sub.add_parser("fit")
    f.add_argument("record")
    f.add_argument("--devices", type=int, default=2)
    f.add_argument("--batch-size", type=int, default=2)
    f.add_argument("--steps", type=int, default=4)
    f.add_argument("--gan", action="store_true")
    f.add_argument("--ema", action="store_true")
    f.add_argument("--resume", default=None)
    f.add_argument("--save", default=None)
    v = sub.add_parser("validate")
    v.add_argument("record")
    v.add_argument("--devices", type=int, default=2)
    v.add_argument("--good", type=int, default=3)
    v.add_argument("--bad", action="store_true")
    v.add_argument("--quality", action="store_true")  # PESQ and STOI too
    args = parser.parse_args()
    {"predict": predict, "fit": fit, "validate": validate}[args.job](args)


if __name__ == "__main__":
    main()
