"""What an evaluation run records in W&B besides scalars, as a callback: the run config (preset,
checkpoint, weights' content hash, data sources, hyperparameters) and media (generated and reference
audio with their spectrograms, in a table keyed by request id).

``Code2WavModule`` adds :class:`EvaluationMedia` to ``fit``, ``validate`` and ``test``
(``configure_callbacks``); a Trainer can take one too (the module's then replaces it). Only rank 0
logs, and only to ``WandbLogger``s: without one it does nothing, not even collect samples.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from omni_lightning.evaluation.quality import QualityScorer


def content_hash(model: torch.nn.Module) -> str:
    """sha256 over the state dict (names, shapes, dtypes, bytes): which weights were evaluated."""
    import hashlib

    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def wandb_loggers(trainer: pl.Trainer) -> list:
    from lightning.pytorch.loggers import WandbLogger

    return [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]


def describe_source(source: Any) -> str:
    """A data source as the run config shows it: a path as given, a dataset by its source, data in
    memory by its count (never the tensors themselves), a list of sources each described."""
    if isinstance(source, (str, Path)):
        return str(source)
    if isinstance(getattr(source, "source", None), (str, Path)):  # a CodesDataset: its folder, manifest or <memory>
        return str(source.source)
    if isinstance(source, (list, tuple)) and source and not all(isinstance(s, (torch.Tensor, tuple)) for s in source):
        return ", ".join(describe_source(s) for s in source)  # several predict sources
    return f"<in memory: {len(source)} requests>" if hasattr(source, "__len__") else f"<{type(source).__name__}>"


def run_config(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """Model preset, checkpoint, content hash, data sources and hyperparameters of a Code2WavModule."""
    hp = dict(module.hparams)
    sources = {k: describe_source(v) for k, v in getattr(trainer.datamodule, "sources", {}).items() if v is not None}
    return {
        "model/preset": module.config.name,
        "model/checkpoint": hp.get("checkpoint") or trainer.ckpt_path,
        "model/content_hash": content_hash(module.model),
        "model/parameters": sum(p.numel() for p in module.model.parameters()),
        **{f"data/{k}": v for k, v in sources.items()},
        "hparams": {k: v for k, v in hp.items() if k != "config"},
        "architecture": hp.get("config"),
    }


def spectrogram_figure(wav: torch.Tensor, sample_rate: int, title: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from omni_lightning.imports.torchaudio import import_torchaudio

    torchaudio = import_torchaudio()
    # zero-padded at the ends: reflect padding refuses a request shorter than half the window
    mel = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=1024, hop_length=256, n_mels=80, pad_mode="constant")
    mel = mel(wav.float())
    fig, ax = plt.subplots(figsize=(6, 2.5), dpi=80)
    ax.imshow(torch.log(mel + 1e-5).numpy(), origin="lower", aspect="auto", cmap="magma")
    ax.set_title(title)
    ax.set_xlabel("frame")
    ax.set_ylabel("mel bin")
    fig.tight_layout()
    return fig


def media_record(stage: str, samples: list[dict[str, Any]], sample_rate: int) -> dict[str, Any]:
    """Generated and reference audio side by side, with spectrograms and per-request metrics (the quality
    metrics' too, where a sample holds their ``quality`` scores, ``{name: value}``), in a ``wandb.Table``
    keyed by request id; the media lists (captioned by id) also on their own, since an offline run stores table cells'
    media only through artifacts."""
    import matplotlib.pyplot as plt
    import wandb

    from omni_lightning.evaluation.metrics import request_metrics
    from omni_lightning.training.losses import MultiResolutionMelLoss, MultiResolutionSTFTLoss

    mel, stft = MultiResolutionMelLoss(sample_rate), MultiResolutionSTFTLoss()
    quality = [s.get("quality") or {} for s in samples]
    names = list(dict.fromkeys(name for scores in quality for name in scores))
    columns = ["id", "generated", "reference", "generated_spectrogram", "reference_spectrogram", "mel_distance",
               "si_sdr", *names]  # fmt: skip
    table = wandb.Table(columns=columns)
    media: dict[str, list] = {k: [] for k in columns[1:5]}
    for s, scores in zip(samples, quality):
        gen_fig = spectrogram_figure(s["generated"], sample_rate, f"{s['id']} generated")
        ref_fig = spectrogram_figure(s["reference"], sample_rate, f"{s['id']} reference")
        values = request_metrics(s["generated"], s["reference"], mel, stft)
        row = [
            wandb.Audio(s["generated"].numpy(), sample_rate=sample_rate, caption=s["id"]),
            wandb.Audio(s["reference"].numpy(), sample_rate=sample_rate, caption=s["id"]),
            wandb.Image(gen_fig, caption=s["id"]),
            wandb.Image(ref_fig, caption=s["id"]),
        ]
        for key, item in zip(media, row):
            media[key].append(item)
        scores = [scores.get(name, math.nan) for name in names]
        table.add_data(s["id"], *row, float(values["mel_distance"]), float(values["si_sdr"]), *scores)
        plt.close(gen_fig)
        plt.close(ref_fig)
    return {f"{stage}/samples": table, **{f"{stage}/{k}": v for k, v in media.items()}}


class EvaluationMedia(pl.Callback):
    """Logs to each ``WandbLogger`` of the trainer, on rank 0:

    - the run config (:func:`run_config`) once per W&B run in each ``fit``, ``validate`` or ``test``
      call, at its start: whatever ran before (a run without W&B, an earlier call), each W&B run gets
      the config of the weights it evaluates;
    - media (:func:`media_record`) of the first ``log_samples`` requests of each validation or test
      epoch, from the waveforms the step returns (``{"wav": Float[B, 1, T]}``) and the batch's
      ``audio``, ``audio_lengths`` and ``req_ids``, with each request's quality scores where the step
      returns them (``{"quality": [Future, ...]}``, see ``evaluation/quality.py``). Not during the sanity check.
    """

    def __init__(self, log_samples: int = 4) -> None:
        self.log_samples = log_samples
        self._configured: set[str] = set()
        self._samples: list[dict[str, Any]] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._configured = set()

    def _log_run_config(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        loggers = [lg for lg in wandb_loggers(trainer) if lg.experiment.id not in self._configured]
        if loggers:
            config = run_config(trainer, pl_module)
            for lg in loggers:
                lg.experiment.config.update(config, allow_val_change=True)
                self._configured.add(lg.experiment.id)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_run_config(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_run_config(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_run_config(trainer, pl_module)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._samples = []

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._samples = []

    def _collect(self, trainer: pl.Trainer, outputs: Any, batch: Any) -> None:
        if len(self._samples) >= self.log_samples or not trainer.is_global_zero or not wandb_loggers(trainer):
            return
        if not isinstance(outputs, dict) or "wav" not in outputs:  # a step that returns no waveforms
            return
        wav, audio, lengths, quality = outputs["wav"], batch["audio"], batch["audio_lengths"], outputs.get("quality")
        for i, req_id in enumerate(batch.get("req_ids") or range(wav.shape[0])):
            if len(self._samples) >= self.log_samples:
                break
            n = int(lengths[i])
            self._samples.append(
                {"id": str(req_id), "generated": wav[i, 0, :n].float().cpu(), "reference": audio[i, :n].float().cpu(),
                 "quality": quality[i] if quality is not None else None}
            )  # fmt: skip

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, outputs, batch)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, outputs, batch)

    def _log_media(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.sanity_checking or not self._samples:
            return
        futures = [s.pop("quality", None) for s in self._samples]
        if any(f is not None for f in futures):  # only a QualityScorer's requests carry scores
            scorer = next(cb for cb in trainer.callbacks if isinstance(cb, QualityScorer))
            for s, scores in zip(self._samples, scorer.wait(futures)):
                s["quality"] = scores
        record = media_record(stage, self._samples, pl_module.config.sample_rate)
        for lg in wandb_loggers(trainer):
            lg.experiment.log({**record, "trainer/global_step": trainer.global_step})
        self._samples = []

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_media(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_media(trainer, pl_module, "test")
