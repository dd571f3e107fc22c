"""``Code2WavModule``: the LightningModule around a :class:`Code2Wav`."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch

from omni_lightning.evaluation.media import EvaluationMedia
from omni_lightning.evaluation.metrics import AudioMetrics
from omni_lightning.models import Code2Wav, Code2WavConfig, StreamingDecoder, resolve_config, validate_codes
from omni_lightning.models.cuda_graphs import CUDAGraphDecoder
from omni_lightning.runner.host_weights import HostWeightsOnPredict
from omni_lightning.runner.output import MultimodalOutputs
from omni_lightning.training.discriminators import Discriminators
from omni_lightning.training.ema import EMAWeights
from omni_lightning.training.freeze import freeze_parameters
from omni_lightning.training.losses import ReconstructionLoss
from omni_lightning.training.schedule import WarmupCosine, adamw_with_schedule

# The module validates codes in `on_before_batch_transfer` by design, datamodule or not.
warnings.filterwarnings(
    "ignore", message=r"You have overridden `on_before_batch_transfer` in `LightningModule` but have passed in a"
)


class Code2WavModule(HostWeightsOnPredict, pl.LightningModule):
    """Code2Wav in Lightning: predict (vLLM-Omni runner semantics), fine-tune, evaluate.

    The model comes from, in this order: ``model`` (an in-memory ``Code2Wav``), ``checkpoint`` (an
    HF-layout folder, see ``Code2Wav.from_pretrained``) or ``config`` (a preset name, a
    ``Code2WavConfig`` or its dict; random weights). Requests longer than
    ``max_frames_per_request`` frames are decoded with gap-free ``chunked_decode`` (``chunk_size``,
    ``left_context``), so one long request cannot exhaust memory.
    ``random_weights``: read only by the command line's weights guard (no checkpoint: predict refused).

    Fine-tuning: the steps here; losses, discriminators, freezing, schedule and EMA in ``training/``.
    ``ema_decay`` adds ``training.ema.EMAWeights`` (Lightning's ``WeightAveraging``) to fit: after
    fit the model holds the EMA weights, ``use_ema(False)`` the raw ones. Evaluation: metrics are
    logged here (``evaluation/metrics.py``); the W&B run config and media by
    ``evaluation.media.EvaluationMedia``, which fit, validate and test get from ``configure_callbacks``.

    ``fast_path``: CUDA predict in shape buckets through CUDA graphs (``models/cuda_graphs.py``).
    After predict, the weights return to the host tensors they left (``runner/host_weights.py``).
    """

    def __init__(
        self,
        model: Code2Wav | None = None,
        config: str | dict | Code2WavConfig = "qwen3-omni",
        checkpoint: str | None = None,
        random_weights: bool = False,
        max_frames_per_request: int = 1500,
        chunk_size: int = 300,
        left_context: int = 25,
        fast_path: bool = True,
        # fine-tuning
        learning_rate: float = 1e-4,
        betas: tuple[float, float] = (0.8, 0.99),
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        total_steps: int | None = None,
        grad_clip: float | None = 1.0,
        mel_weight: float = 1.0,
        stft_weight: float = 1.0,
        freeze: list[str] | None = None,
        train_only: list[str] | None = None,
        ema_decay: float | None = None,
        adversarial: bool = False,
        adversarial_weight: float = 1.0,
        feature_matching_weight: float = 2.0,
        discriminator_lr: float = 1e-4,
        # evaluation
        log_samples: int = 4,
    ) -> None:
        super().__init__()
        if model is None:
            model = Code2Wav.from_pretrained(checkpoint) if checkpoint else Code2Wav(resolve_config(config))
        if max_frames_per_request < 1 or chunk_size < 1:
            raise ValueError("max_frames_per_request and chunk_size must be >= 1")
        self.model = model
        self.save_hyperparameters(ignore=["model"])
        # hparams hold the architecture itself, so a Lightning checkpoint restores with no HF folder
        self.hparams["config"] = asdict(model.config)
        self.max_frames_per_request = max_frames_per_request
        self.chunk_size = chunk_size
        self.left_context = left_context
        self.fast_path, self.graph_decoder = fast_path, None  # a CUDAGraphDecoder from the first CUDA predict
        freeze_parameters(self.model, freeze or [], train_only)
        self._losses: list[torch.nn.Module] = []  # built on first use; kept out of the state dict
        self.discriminators = Discriminators() if adversarial else None
        self.automatic_optimization = not adversarial  # GAN: two optimizers, stepped in the training step
        self.ema = EMAWeights(ema_decay) if ema_decay is not None else None

    @property
    def config(self) -> Code2WavConfig:
        return self.model.config

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "hyper_parameters" in checkpoint:  # weights and architecture are in it: no HF folder reread
            checkpoint["hyper_parameters"]["checkpoint"] = None

    def configure_callbacks(self) -> list[pl.Callback]:
        """EMA weights (``ema_decay``) in fit; W&B run config and media in fit, validate and test."""
        stage = self.trainer.state.fn
        callbacks: list[pl.Callback] = [self.ema] if self.ema is not None and stage == "fit" else []
        if stage in ("fit", "validate", "test"):
            callbacks.append(EvaluationMedia(self.hparams.log_samples))
        return callbacks

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

    def on_predict_start(self) -> None:
        if self.fast_path:  # the CUDA graph decoder (models/cuda_graphs.py), its weights refreshed
            self.graph_decoder = CUDAGraphDecoder.for_predict(self.graph_decoder, self.model, self.device)

    def on_predict_end(self) -> None:
        if self.fast_path and self.graph_decoder is not None and (line := self.graph_decoder.report()):
            pl.utilities.rank_zero_info(line)

    def predict_step(self, batch: dict[str, Any], batch_idx: int = 0, dataloader_idx: int = 0) -> dict[str, Any]:
        """``{"model_outputs": [wav_i Float[1, output_length(n_i)] on the device], "sr": sample_rate}``."""
        return MultimodalOutputs(model_outputs=self.decode_batch(batch), sr=self.config.sample_rate)

    def decode_batch(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """Float32 waveforms of a (validated) batch, in request order."""
        n_frames = batch.get("n_frames") or self.on_before_batch_transfer(batch, 0)["n_frames"]
        wavs = self.model.decode_requests(batch["codes"], n_frames, self.max_frames_per_request, self.chunk_size,
                                          self.left_context, self.graph_decoder if self.fast_path else None)
        return [w.float() for w in wavs]

    # --- streaming ---------------------------------------------------------------------------------

    def streaming_decoder(self, max_streams: int = 64, cuda_graphs: bool = True) -> StreamingDecoder:
        """A :class:`StreamingDecoder` over this module's model: many streams, one step at a time."""
        return StreamingDecoder(self.model, max_streams=max_streams, cuda_graphs=cuda_graphs)

    def stream(self, code_chunks: Iterable[torch.Tensor], cuda_graphs: bool = True) -> Iterator[torch.Tensor]:
        """Decodes one request as its code chunks ``[Q, n]`` arrive: yields float32 ``[1, m]`` per chunk.

        The pieces concatenate to ``decode`` of all the frames (a chunk's last samples come with the
        next chunk: the decoder looks one frame ahead); each chunk costs its own frames only. Up to 8
        iterators may interleave. The model's current weights are used (no EMA swap, unlike predict).
        """
        decoder = getattr(self, "_stream_decoder", None)
        if decoder is None or decoder.cuda_graphs != cuda_graphs or not decoder.reads(self.model):
            decoder = self._stream_decoder = self.streaming_decoder(max_streams=8, cuda_graphs=cuda_graphs)
        for wav in decoder.stream(code_chunks):
            yield wav.float()

    # --- fine-tuning -------------------------------------------------------------------------------

    def _paired(self, batch: dict[str, Any], stage: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if "audio" not in batch:
            raise ValueError(f"{stage} needs paired data: a manifest whose lines have an 'audio' path")
        return batch["codes"], batch["audio"], batch["audio_lengths"]

    def reconstruction(self, wav: torch.Tensor, audio: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        """Weighted multi-resolution mel L1 + STFT loss on the real samples only."""
        # built on first use, never under inference mode (training reuses it); a list: out of the state dict
        with torch.inference_mode(False):
            if not self._losses:
                hp = self.hparams
                self._losses.append(ReconstructionLoss(self.config.sample_rate, hp.mel_weight, hp.stft_weight))
            loss = self._losses[0].to(self.device)
        return loss(wav, audio, lengths)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor | None:
        codes, audio, lengths = self._paired(batch, "training")
        wav = self.model(codes)
        rec = self.reconstruction(wav, audio, lengths)
        bs = codes.shape[0]
        if self.discriminators is None:
            self.log_dict({f"train/{k}": v for k, v in rec.items()}, prog_bar=True, batch_size=bs)
            return rec["loss"]
        return self._adversarial_step(wav, audio, lengths, rec, bs)

    def _adversarial_step(self, wav, audio, lengths, rec, bs) -> None:
        opt_g, opt_d = self.optimizers()
        n = int(lengths.min())  # a segment every item really has: padding never reaches a discriminator
        real, fake = audio[:, None, :n], wav[..., :n]
        d_loss = self.discriminators.discriminator_loss(real, fake)
        self._manual_step(opt_d, d_loss)
        adv, fm = self.discriminators.generator_losses(real, fake)
        g_loss = rec["loss"] + self.hparams.adversarial_weight * adv + self.hparams.feature_matching_weight * fm
        self._manual_step(opt_g, g_loss)
        for scheduler in self.lr_schedulers():
            scheduler.step()
        logs = {**rec, "loss": g_loss, "adv": adv, "feature_matching": fm, "disc": d_loss}
        self.log_dict({f"train/{k}": v for k, v in logs.items()}, prog_bar=True, batch_size=bs)

    def _manual_step(self, optimizer: Any, loss: torch.Tensor) -> None:
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=self.hparams.grad_clip)
        optimizer.step()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # the module's grad_clip unless the Trainer sets its own
        value = gradient_clip_val if gradient_clip_val is not None else self.hparams.grad_clip
        if value:
            self.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm=gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("every model parameter is frozen: nothing to fine-tune")
        hp = self.hparams
        total = hp.total_steps or int(self.trainer.estimated_stepping_batches)
        if self.discriminators is not None and not hp.total_steps:
            total //= 2  # Lightning counts both optimizers' steps; the schedules step once per batch
        schedule = WarmupCosine(hp.warmup_steps, max(total, 1), hp.min_lr_ratio)
        opt, sched = adamw_with_schedule(params, schedule, lr=hp.learning_rate, betas=tuple(hp.betas),
                                         weight_decay=hp.weight_decay)  # fmt: skip
        if self.discriminators is None:
            return {"optimizer": opt, "lr_scheduler": sched}
        opt_d, sched_d = adamw_with_schedule(self.discriminators.parameters(), schedule, lr=hp.discriminator_lr,
                                             betas=tuple(hp.betas))  # fmt: skip
        return [opt, opt_d], [sched, sched_d]

    # --- EMA weights (training/ema.py) ------------------------------------------------------------

    def use_ema(self, on: bool) -> bool:
        """After fit with ``ema_decay``: the EMA weights (``on``, as fit leaves them) or the raw ones
        into the model. Returns whether the EMA weights were in before."""
        return self.ema.use_average(self, on) if self.ema is not None else False

    def export_pretrained(self, path: str, ema: bool = True) -> Any:
        """``save_pretrained`` of the tuned model: its EMA weights when it keeps them and ``ema``."""
        previous = self.use_ema(ema)
        try:
            return self.model.save_pretrained(path)
        finally:
            self.use_ema(previous)

    # --- validation / test: metrics (evaluation/metrics.py); media and run config: EvaluationMedia ---

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        return self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        return self._evaluate(batch, "test")

    def _eval_metrics(self) -> Any:
        if not hasattr(self, "_metrics"):
            self._metrics = [AudioMetrics(self.config.sample_rate)]  # a list: kept out of the state dict
        return self._metrics[0].to(self.device)

    def on_validation_epoch_start(self) -> None:
        self._eval_metrics().reset()

    on_test_epoch_start = on_validation_epoch_start

    def _evaluate(self, batch: dict[str, Any], stage: str) -> dict[str, torch.Tensor]:
        codes, audio, lengths = self._paired(batch, stage)
        wav = self.model(codes)
        rec = self.reconstruction(wav, audio, lengths)
        self.log_dict({f"{stage}/{k}": v for k, v in rec.items()}, batch_size=codes.shape[0], sync_dist=True)
        self._eval_metrics().update(wav.detach(), audio, lengths)
        return {"wav": wav.detach()}  # EvaluationMedia logs samples from it

    def on_validation_epoch_end(self) -> None:
        self._eval_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_end("test")

    def _eval_end(self, stage: str) -> None:
        if not self.trainer.sanity_checking:  # values already reduced over ranks
            self.log_dict({f"{stage}/{k}": float(v) for k, v in self._eval_metrics().compute().items()})
