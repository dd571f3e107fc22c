"""The LightningCLI behind ``omni-lightning`` (``omni_lightning.cli`` is the entry point, which checks
the command line before this module, torch and Lightning are imported)."""

from __future__ import annotations

import argparse
from typing import Any, Literal

from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from omni_lightning.callbacks.writer import MANIFEST, SUBTYPES, WaveformWriter, read_manifest
from omni_lightning.data.datamodule import CodesDataModule
from omni_lightning.module import Code2WavModule
from omni_lightning.preflight import UsageError
from omni_lightning.trainer import Trainer


class SaveConfigWithLogger(SaveConfigCallback):
    """Saves the run's config.yaml into the logger's folder; with no logger (predict), nowhere."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.logger is not None:
            super().setup(trainer, pl_module, stage)


class OmniCLI(LightningCLI):
    """LightningCLI plus ``--out_dir`` for predict (WaveformWriter) and an end-of-run summary."""

    writer: WaveformWriter | None = None

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--out_dir", type=str | None, default=None, help="predict: WAV files + manifest.jsonl")
        parser.add_argument("--subtype", type=Literal[SUBTYPES], default="PCM_16", help="predict: WAV sample format")

    def before_predict(self) -> None:
        config = self.config[self.subcommand]
        self.writer = None
        if config.get("out_dir"):
            self.writer = WaveformWriter(config["out_dir"], subtype=config.get("subtype", "PCM_16"))
            self.trainer.callbacks.append(self.writer)
            self.config_init[self.subcommand]["return_predictions"] = False  # the files are the output
        elif not any(isinstance(cb, BasePredictionWriter) for cb in self.trainer.callbacks):
            raise UsageError("predict has no --out_dir: give the folder the WAV files and manifest.jsonl go to")

    def after_predict(self) -> None:
        if self.writer is not None and self.trainer.is_global_zero:
            print(f"predict: {self.writer.summary()}")
            errors = [r for r in read_manifest(self.writer.out_dir / MANIFEST) if r.get("status") == "error"]
            for row in errors[:20]:
                print(f"  failed {row['id']}: {row['reason']}")
            if len(errors) > 20:
                print(f"  ... {len(errors) - 20} more in {self.writer.out_dir / MANIFEST}")

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


def run_lightning_cli(argv: list[str] | None = None, description: str | None = None) -> OmniCLI:
    """Parses ``argv`` (None: ``sys.argv``), builds model, data and trainer, runs the subcommand."""
    return OmniCLI(
        Code2WavModule,
        CodesDataModule,
        trainer_class=Trainer,
        args=argv,
        save_config_callback=SaveConfigWithLogger,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={
            "prog": "omni-lightning",
            "description": description,
            "formatter_class": argparse.RawDescriptionHelpFormatter,
        },
    )
