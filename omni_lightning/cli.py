"""``omni-lightning``: LightningCLI (fit / validate / test / predict) over Code2WavModule and
CodesDataModule with omni_lightning's Trainer, plus ``demo``.

    omni-lightning predict --config configs/predict.yaml --data.predict codes/ --out_dir wavs/
    omni-lightning fit --config configs/finetune.yaml --data.train train.jsonl --data.val val.jsonl
    omni-lightning validate --config configs/eval_wandb.yaml --data.val val.jsonl --model.checkpoint ckpt/
    omni-lightning demo
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from omni_lightning.callbacks.writer import SUBTYPES, WaveformWriter
from omni_lightning.data.datamodule import CodesDataModule
from omni_lightning.module import Code2WavModule
from omni_lightning.trainer import Trainer


class SaveConfigWithLogger(SaveConfigCallback):
    """Saves the run's config.yaml into the logger's folder; with no logger (predict), nowhere."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.logger is not None:
            super().setup(trainer, pl_module, stage)


class OmniCLI(LightningCLI):
    """LightningCLI plus ``--out_dir`` for predict (WaveformWriter) and an end-of-run summary."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--out_dir", type=str | None, default=None, help="predict: WAV files + manifest.jsonl")
        parser.add_argument("--subtype", type=str, default="PCM_16", help=f"predict: WAV sample format {SUBTYPES}")

    def before_predict(self) -> None:
        config = self.config[self.subcommand]
        self.writer = None
        if config.get("out_dir"):
            self.writer = WaveformWriter(config["out_dir"], subtype=config.get("subtype", "PCM_16"))
            self.trainer.callbacks.append(self.writer)
            self.config_init[self.subcommand]["return_predictions"] = False  # the files are the output

    def after_predict(self) -> None:
        if self.writer is not None and self.trainer.is_global_zero:
            print(f"predict: {self.writer.summary()}")
            errors = [r for r in _manifest_rows(self.writer) if r.get("status") == "error"]
            for row in errors[:20]:
                print(f"  error {row['id']}: {row['reason']}")

    def after_validate(self) -> None:
        self._print_metrics("validate")

    def after_test(self) -> None:
        self._print_metrics("test")

    def after_fit(self) -> None:
        ckpt = self.trainer.checkpoint_callback
        if self.trainer.is_global_zero and ckpt is not None and ckpt.best_model_path:
            print(f"fit: best checkpoint {ckpt.best_model_path}; last {ckpt.last_model_path or '-'}")

    def _print_metrics(self, stage: str) -> None:
        if self.trainer.is_global_zero:
            metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
            print(f"{stage}: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))


def _manifest_rows(writer: WaveformWriter) -> list[dict[str, Any]]:
    from omni_lightning.callbacks.writer import MANIFEST, read_manifest

    return read_manifest(writer.out_dir / MANIFEST)


def run_cli(argv: list[str]) -> OmniCLI:
    return OmniCLI(
        Code2WavModule,
        CodesDataModule,
        trainer_class=Trainer,
        args=argv,
        save_config_callback=SaveConfigWithLogger,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": __doc__, "formatter_class": argparse.RawDescriptionHelpFormatter},
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "demo":
        from omni_lightning.demo import main as demo_main

        demo_main(argv[1:])
        return
    run_cli(argv)


if __name__ == "__main__":
    main()
