"""What an evaluation run records in W&B besides scalars: the run config (preset, checkpoint, weights'
content hash, data sources, hyperparameters) and media (generated and reference audio with their
spectrograms, in a table keyed by request id). Only rank 0 logs; nothing happens without a
``WandbLogger``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


def content_hash(model: torch.nn.Module) -> str:
    """sha256 over the state dict (names, shapes, dtypes, bytes): which weights were evaluated."""
    import hashlib

    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _wandb_loggers(module: pl.LightningModule) -> list:
    from lightning.pytorch.loggers import WandbLogger

    return [lg for lg in module.trainer.loggers if isinstance(lg, WandbLogger)]


def log_run_config(module: pl.LightningModule) -> bool:
    """Records model preset, checkpoint, content hash, data sources and hyperparameters in W&B."""
    loggers = _wandb_loggers(module)
    if not loggers:
        return True
    hp = dict(module.hparams)
    datamodule = module.trainer.datamodule
    sources = {k: str(v) for k, v in getattr(datamodule, "sources", {}).items() if v is not None}
    run_config = {
        "model/preset": module.config.name,
        "model/checkpoint": hp.get("checkpoint") or hp.get("source_checkpoint") or module.trainer.ckpt_path,
        "model/content_hash": content_hash(module.model),
        "model/parameters": sum(p.numel() for p in module.model.parameters()),
        **{f"data/{k}": v for k, v in sources.items()},
        "hparams": {k: v for k, v in hp.items() if k != "config"},
        "architecture": hp.get("config"),
    }
    for lg in loggers:
        lg.experiment.config.update(run_config, allow_val_change=True)
    return True


def spectrogram_figure(wav: torch.Tensor, sample_rate: int, title: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torchaudio

    mel = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=1024, hop_length=256, n_mels=80)(wav.float())
    fig, ax = plt.subplots(figsize=(6, 2.5), dpi=80)
    ax.imshow(torch.log(mel + 1e-5).numpy(), origin="lower", aspect="auto", cmap="magma")
    ax.set_title(title)
    ax.set_xlabel("frame")
    ax.set_ylabel("mel bin")
    fig.tight_layout()
    return fig


def log_media(module: pl.LightningModule, stage: str, samples: list[dict[str, Any]]) -> None:
    """Generated and reference audio side by side, with spectrograms, in a table keyed by request id."""
    loggers = _wandb_loggers(module)
    if not loggers:
        return
    import matplotlib.pyplot as plt
    import wandb

    from omni_lightning.evaluation.metrics import request_metrics

    sr = module.config.sample_rate
    metrics = module._eval_metrics()
    columns = ["id", "generated", "reference", "generated_spectrogram", "reference_spectrogram", "mel_distance",
               "si_sdr"]  # fmt: skip
    table = wandb.Table(columns=columns)
    media: dict[str, list] = {k: [] for k in columns[1:5]}
    for s in samples:
        gen_fig = spectrogram_figure(s["generated"], sr, f"{s['id']} generated")
        ref_fig = spectrogram_figure(s["reference"], sr, f"{s['id']} reference")
        values = request_metrics(s["generated"].to(module.device), s["reference"].to(module.device),
                                 metrics.mel, metrics.stft)  # fmt: skip
        row = [wandb.Audio(s["generated"].numpy(), sample_rate=sr, caption=s["id"]),
               wandb.Audio(s["reference"].numpy(), sample_rate=sr, caption=s["id"]),
               wandb.Image(gen_fig, caption=s["id"]), wandb.Image(ref_fig, caption=s["id"])]  # fmt: skip
        for key, item in zip(media, row):
            media[key].append(item)
        table.add_data(s["id"], *row, float(values["mel_distance"]), float(values["si_sdr"]))
        plt.close(gen_fig)
        plt.close(ref_fig)
    # the table is the side-by-side view; the media lists (captioned by request id) are also logged
    # on their own, since an offline run stores table cells' media only through artifacts
    record = {f"{stage}/samples": table, **{f"{stage}/{k}": v for k, v in media.items()}}
    for lg in loggers:
        lg.experiment.log({**record, "trainer/global_step": module.trainer.global_step})
