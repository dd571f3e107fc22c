"""``Code2WavModule``: the LightningModule around a :class:`Code2Wav`."""

from __future__ import annotations

import warnings
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch

from omni_lightning.models.code2wav import Code2Wav, Code2WavConfig, validate_codes

# The module validates codes in `on_before_batch_transfer` by design, datamodule or not.
warnings.filterwarnings(
    "ignore", message=r"You have overridden `on_before_batch_transfer` in `LightningModule` but have passed in a"
)


def _resolve_config(config: str | dict | Code2WavConfig) -> Code2WavConfig:
    if isinstance(config, Code2WavConfig):
        return config
    if isinstance(config, dict):
        return Code2WavConfig(**config)
    return Code2WavConfig.from_name(config)


class Code2WavModule(pl.LightningModule):
    """Code2Wav in Lightning: predict (vLLM-Omni runner semantics), fine-tune, evaluate.

    The model comes from, in this order: ``model`` (an in-memory ``Code2Wav``), ``checkpoint`` (an
    HF-layout folder, see ``Code2Wav.from_pretrained``) or ``config`` (a preset name, a
    ``Code2WavConfig`` or its dict; random weights). Requests longer than
    ``max_frames_per_request`` frames are decoded with gap-free ``chunked_decode`` (``chunk_size``,
    ``left_context``), so one long request cannot exhaust memory.
    """

    def __init__(
        self,
        model: Code2Wav | None = None,
        config: str | dict | Code2WavConfig = "tiny",
        checkpoint: str | None = None,
        max_frames_per_request: int = 1500,
        chunk_size: int = 300,
        left_context: int = 25,
    ) -> None:
        super().__init__()
        if model is None:
            model = Code2Wav.from_pretrained(checkpoint) if checkpoint else Code2Wav(_resolve_config(config))
        if max_frames_per_request < 1 or chunk_size < 1:
            raise ValueError("max_frames_per_request and chunk_size must be >= 1")
        self.model = model
        self.save_hyperparameters(ignore=["model"])
        # hparams hold the architecture itself, so a Lightning checkpoint restores with no HF folder
        self.hparams["config"] = asdict(model.config)
        self.max_frames_per_request = max_frames_per_request
        self.chunk_size = chunk_size
        self.left_context = left_context

    @property
    def config(self) -> Code2WavConfig:
        return self.model.config

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        hparams = checkpoint.get("hyper_parameters", {})
        if hparams.get("checkpoint"):  # the weights are in the state dict: don't reread the folder
            hparams["source_checkpoint"] = hparams.pop("checkpoint")

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.model(codes)

    # --- predict ---------------------------------------------------------------------------------

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Validates codes on the CPU, before they reach the GPU; records lengths as Python ints."""
        if isinstance(batch, torch.Tensor):
            batch = {"codes": batch}
        if isinstance(batch, dict) and "codes" in batch:
            codes = batch["codes"]
            if codes.numel() == 0 and codes.shape[0] == 0:  # only bad requests in this batch
                batch["n_frames"] = []
            else:
                lengths = validate_codes(codes, self.config, batch.get("lengths"), batch.get("req_ids"))
                batch["lengths"] = lengths
                batch["n_frames"] = lengths.tolist()
        return batch

    def profile_run(self) -> None:
        """Synchronizes the device and runs no forward.

        vLLM profiles a dummy batch to size its KV cache; Code2Wav has none, so there is nothing to
        size (and random codes could index past the codebooks). Memory is bounded by
        ``gpu_memory_utilization`` and by chunked decoding of long requests instead.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def predict_step(self, batch: dict[str, Any], batch_idx: int = 0, dataloader_idx: int = 0) -> dict[str, Any]:
        """``{"model_outputs": [wav_i Float[1, output_length(n_i)] on the device], "sr": sample_rate}``."""
        return {"model_outputs": self.decode_batch(batch), "sr": self.config.sample_rate}

    def decode_batch(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """Float32 waveforms of a (validated) batch, in request order."""
        n_frames = batch.get("n_frames")
        if n_frames is None:
            n_frames = self.on_before_batch_transfer(batch, 0)["n_frames"]
        codes = batch["codes"]
        wavs: list[torch.Tensor | None] = [None] * len(n_frames)
        short = [i for i, n in enumerate(n_frames) if n <= self.max_frames_per_request]
        if short:
            # row slices and cat, not an index tensor: nothing here waits for the device
            sub = codes if len(short) == len(n_frames) else torch.cat([codes[i : i + 1] for i in short])
            sub = sub[..., : max(n_frames[i] for i in short)]
            for i, wav in zip(short, self.model.decode(sub, [n_frames[i] for i in short], validate=False)):
                wavs[i] = wav
        for i, n in enumerate(n_frames):
            if wavs[i] is None:
                wavs[i] = self.model.chunked_decode(
                    codes[i : i + 1, :, :n], self.chunk_size, self.left_context, validate=False
                )[0]
        return [w.float() for w in wavs]
