"""``Code2WavModule``: the LightningModule around a :class:`Code2Wav`."""

from __future__ import annotations

import warnings
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch

from omni_lightning.engine import DecodeEngine, StreamingDecoder
from omni_lightning.errors import check_count
from omni_lightning.evaluation.media import EvaluationMedia
from omni_lightning.evaluation.metrics import AudioMetrics
from omni_lightning.kernels import Kernels
from omni_lightning.models import Code2Wav, Code2WavConfig
from omni_lightning.models.codes import validate_batch
from omni_lightning.runner.engine_hooks import EngineOnPredict
from omni_lightning.runner.host_weights import HostWeightsOnPredict
from omni_lightning.runner.output import MultimodalOutputs
from omni_lightning.runner.stream_hooks import StreamsOnModule
from omni_lightning.training.adversarial import AdversarialStep, find_unused_parameters_under_ddp
from omni_lightning.training.discriminators import Discriminators
from omni_lightning.training.ema import EMAWeights
from omni_lightning.training.freeze import freeze_parameters
from omni_lightning.training.graphs import TrainingGraph
from omni_lightning.training.kernels import TrainingKernels
from omni_lightning.training.losses import ReconstructionLoss
from omni_lightning.training.schedule import check_fine_tuning_settings, fine_tuning_optimizers, fused_adamw
from omni_lightning.training.skipped import SkippedRequests
from omni_lightning.training.unregistered import Unregistered

# The module validates codes in `on_before_batch_transfer` by design, datamodule or not.
warnings.filterwarnings(
    "ignore", message=r"You have overridden `on_before_batch_transfer` in `LightningModule` but have passed in a"
)


class Code2WavModule(HostWeightsOnPredict, EngineOnPredict, StreamsOnModule, TrainingKernels, pl.LightningModule):
    """Code2Wav in Lightning: predict (vLLM-Omni runner semantics), fine-tune, evaluate.

    The model comes from, in this order: ``model`` (an in-memory ``Code2Wav``), ``checkpoint`` (an
    HF-layout folder, see ``Code2Wav.from_pretrained``) or ``config`` (a preset name, a
    ``Code2WavConfig`` or its dict; random weights).
    ``random_weights``: read only by the command line's weights guard (no checkpoint: predict refused).

    Predict and streaming run through a :class:`~omni_lightning.engine.DecodeEngine`: every request is
    exact at any length (long ones are decoded chunk by chunk, carrying state) and a forward decodes
    at most ``frames_per_forward`` frames (default: derived from the trainer's
    ``gpu_memory_utilization``, or the engine's default budget with no cap). ``fast_path``: on CUDA,
    Triton kernels and CUDA graphs per shape bucket (False: eager torch, the same exact chunking).
    ``graph_frames``: the longest forward (rows x frames) run as a CUDA graph (longer ones run eagerly).
    After predict, the weights return to the host tensors they left (``runner/host_weights.py``).

    Fine-tuning: the Lightning hooks here, composing ``training/``: the reconstruction loss
    (``losses.py``), with ``adversarial`` the discriminators and the GAN step under manual
    optimization (``adversarial.py``), freezing, optimizers and schedule, EMA. ``ema_decay`` adds
    ``training.ema.EMAWeights`` (Lightning's ``WeightAveraging``) to fit: after fit the model holds
    the EMA weights, ``use_ema(False)`` the raw ones. Any Lightning precision works: 32-true,
    bf16-mixed, bf16-true, 16-mixed (with the GAN too; bf16 weights step through fp32 master weights).
    ``fast_training``: on CUDA, Triton SnakeBeta forward and backward (``training/kernels.py``) and the
    generator's forward and backward replayed as CUDA graphs where the fit allows (``training/graphs.py``).
    Evaluation: metrics are logged here (``evaluation/metrics.py``); the W&B run config and media by
    ``evaluation.media.EvaluationMedia``, which fit, validate and test get from ``configure_callbacks``.
    The losses and metrics stay fp32 and out of the state dict (``training/unregistered.py``).
    """

    def __init__(
        self,
        model: Code2Wav | None = None,
        config: str | dict | Code2WavConfig = "qwen3-omni",
        checkpoint: str | None = None,
        random_weights: bool = False,
        frames_per_forward: int | None = None,
        fast_path: bool = True,
        graph_frames: int = 512,
        # fine-tuning
        fast_training: bool = True,
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
        model = Code2Wav.resolve(model, checkpoint, config)
        check_count("frames_per_forward", frames_per_forward, none_ok=True)  # None: from the memory budget
        check_count("graph_frames", graph_frames, minimum=0)  # 0: no CUDA graphs
        check_count("log_samples", log_samples, minimum=0)
        self.model = model
        self.save_hyperparameters(ignore=["model"])
        check_fine_tuning_settings(self.hparams)
        # hparams hold the architecture itself, so a Lightning checkpoint restores with no HF folder
        self.hparams["config"] = asdict(model.config)
        self.frames_per_forward, self.fast_path, self.fast_training = frames_per_forward, fast_path, fast_training
        self.training_kernels = Kernels()  # fit's, validate's and test's, chosen in `setup` (training/kernels.py)
        self.training_graph: TrainingGraph | None = None  # fit's CUDA graphs of the generator, set in `setup`
        self.engine: DecodeEngine | None = None  # built at the first predict on a device, kept across calls
        self.engine_stats: dict[str, float] = {}  # the engine's stats() at the end of the last predict
        self._stream_decoder: StreamingDecoder | None = None  # module.stream's (runner/stream_hooks.py)
        self.skipped_requests = SkippedRequests()  # bad requests fit and evaluation left out, each warned once
        freeze_parameters(self.model, freeze or [], train_only)
        self.reconstruction_loss = Unregistered(ReconstructionLoss(model.config.sample_rate, mel_weight, stft_weight))
        self.discriminators = Discriminators() if adversarial else None
        self.adversarial_step = AdversarialStep(self.discriminators, adversarial_weight, feature_matching_weight,
                                                grad_clip) if adversarial else None  # fmt: skip
        self.automatic_optimization = not adversarial  # GAN: two optimizers, stepped in the training step
        self.ema = EMAWeights(ema_decay) if ema_decay is not None else None
        self.eval_metrics = Unregistered(AudioMetrics(model.config.sample_rate))

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.skipped_requests.clear()  # each run warns about its own
        if stage == "fit" and self.adversarial_step is not None and self._trainer is not None:
            find_unused_parameters_under_ddp(self._trainer)

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
        """Validates codes on the CPU, before the GPU (in predict a bad request leaves the batch for its
        ``errors``); records lengths as Python ints (``n_frames``; a paired batch's shortest audio,
        ``shortest``, which the GAN step cuts at: read here, it costs the step no wait for the device)."""
        if isinstance(batch, torch.Tensor):
            batch = {"codes": batch}
        if isinstance(batch, dict) and isinstance(batch.get("audio_lengths"), torch.Tensor):
            lengths = batch["audio_lengths"]
            batch["shortest"] = int(lengths.min()) if lengths.numel() and lengths.device.type == "cpu" else None
        if isinstance(batch, dict) and "codes" in batch:
            codes = batch["codes"]
            if isinstance(codes, torch.Tensor) and codes.numel() == 0 and codes.shape[0] == 0:  # only bad requests
                batch["n_frames"] = []
            else:
                predicting = self._trainer is not None and self.trainer.predicting  # a bad request fails alone
                lengths = validate_batch(batch, self.config, drop_bad=predicting)
                batch["lengths"] = lengths
                batch["n_frames"] = lengths.tolist()
        return batch

    def profile_run(self) -> None:
        """Synchronizes the device and runs no forward.

        vLLM profiles a dummy batch to size its KV cache; Code2Wav has none, so there is nothing to
        size (and random codes could index past the codebooks). Memory is bounded by the engine's
        frame budget, derived from ``gpu_memory_utilization``, instead.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def predict_step(self, batch: dict[str, Any], batch_idx: int = 0, dataloader_idx: int = 0) -> dict[str, Any]:
        """``{"model_outputs": [wav_i Float[1, output_length(n_i)] on the device], "sr": sample_rate}``."""
        return MultimodalOutputs(model_outputs=self.decode_batch(batch), sr=self.config.sample_rate)

    def decode_batch(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """Float32 waveforms of a (validated) batch, in request order."""
        n_frames = batch.get("n_frames") or self.on_before_batch_transfer(batch, 0)["n_frames"]
        return self.decode_engine().decode(batch["codes"], n_frames)

    # --- fine-tuning -------------------------------------------------------------------------------

    def _paired(self, batch: dict[str, Any], stage: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if "audio" not in batch:
            raise ValueError(f"{stage} needs paired data: a manifest whose lines have an 'audio' path")
        return batch["codes"], batch["audio"], batch["audio_lengths"]

    def reconstruction(self, wav: torch.Tensor, audio: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        """Weighted multi-resolution mel L1 + STFT loss on the real samples only (``training/losses.py``)."""
        return self.reconstruction_loss.on(wav.device)(wav, audio, lengths)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor | None:
        if not self.skipped_requests.report(batch, "training"):
            return None  # every request of the batch was bad input: no step
        codes, audio, lengths = self._paired(batch, "training")
        shortest = self.adversarial_step.segment(batch, lengths) if self.adversarial_step is not None else 0
        wav = self.generate(codes)
        rec = self.reconstruction(wav, audio, lengths)
        if self.adversarial_step is not None:
            rec = {**rec, **self.adversarial_step(self, wav, audio, shortest, rec["loss"])}
        self.log_dict({f"train/{k}": v for k, v in rec.items()}, prog_bar=True, batch_size=codes.shape[0])
        return rec["loss"] if self.automatic_optimization else None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.adversarial_step is not None:  # manual optimization: clipped here, where 16-mixed has unscaled
            self.adversarial_step.clip(optimizer)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # automatic optimization: the module's grad_clip unless the Trainer sets its own
        value = gradient_clip_val if gradient_clip_val is not None else self.hparams.grad_clip
        if value:
            self.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm=gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        return fine_tuning_optimizers(
            self.model.parameters(), self.discriminators, learning_rate=hp.learning_rate, betas=hp.betas,
            weight_decay=hp.weight_decay, discriminator_lr=hp.discriminator_lr, warmup_steps=hp.warmup_steps,
            min_lr_ratio=hp.min_lr_ratio, total_steps=hp.total_steps,
            estimated_stepping_batches=self.trainer.estimated_stepping_batches,
            fused=fused_adamw(self.device, self.trainer.precision_plugin),
        )  # fmt: skip

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

    def on_validation_epoch_start(self) -> None:
        self.eval_metrics.on(self.device).reset()

    on_test_epoch_start = on_validation_epoch_start

    def _evaluate(self, batch: dict[str, Any], stage: str) -> dict[str, torch.Tensor] | None:
        if not self.skipped_requests.report(batch, stage):
            return None
        codes, audio, lengths = self._paired(batch, stage)
        wav = self.generate(codes)
        rec = self.reconstruction(wav, audio, lengths)
        # reduced with the metrics at epoch end (evaluation/metrics.py): a rank with no batch joins that too
        self.eval_metrics.on(self.device).update(wav.detach(), audio, lengths, losses=rec)
        return {"wav": wav.detach()}  # EvaluationMedia logs samples from it

    def on_validation_epoch_end(self) -> None:
        self._eval_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_end("test")

    def _eval_end(self, stage: str) -> None:
        if not self.trainer.sanity_checking:  # values already reduced over ranks
            self.log_dict({f"{stage}/{k}": float(v) for k, v in self.eval_metrics.on(self.device).compute().items()})
