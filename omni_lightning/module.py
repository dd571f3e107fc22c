"""``Code2WavModule``: the LightningModule around a :class:`Code2Wav`."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch

from omni_lightning.engine import DecodeEngine, StreamingDecoder
from omni_lightning.errors import check_count
from omni_lightning.evaluation.media import EvaluationMedia
from omni_lightning.evaluation.metrics import AudioMetrics
from omni_lightning.evaluation.quality import QualityScorer, check_quality_metrics
from omni_lightning.kernels import Kernels
from omni_lightning.models import Code2Wav, Code2WavConfig
from omni_lightning.models.codes import validate_batch
from omni_lightning.runner.output import OmniModelRunnerOutput, runner_output
from omni_lightning.runner.session import InferenceSession, ReleaseOnException
from omni_lightning.training.adversarial import AdversarialStep, find_unused_parameters_under_ddp
from omni_lightning.training.discriminators import Discriminators
from omni_lightning.training.ema import EMAWeights
from omni_lightning.training.freeze import freeze_parameters
from omni_lightning.training.kernel_choice import TrainingKernels, default_training_graph
from omni_lightning.training.losses import ReconstructionLoss
from omni_lightning.training.schedule import (
    check_fine_tuning_settings,
    clip_gradients,
    fine_tuning_optimizers,
    fused_adamw,
)
from omni_lightning.training.skipped import SkippedRequests
from omni_lightning.training.step_graph import TrainingGraph
from omni_lightning.training.unregistered import Unregistered

# The module validates codes in `on_before_batch_transfer` by design, datamodule or not.
warnings.filterwarnings(
    "ignore", message=r"You have overridden `on_before_batch_transfer` in `LightningModule` but have passed in a"
)

RANDOM_WEIGHTS = ("predicting with random weights: this module was built from a preset or config without weights. "
                  "Pass checkpoint=<HF folder> for real audio, or random_weights=True to run on random weights on "
                  "purpose")  # fmt: skip


class Code2WavModule(pl.LightningModule):
    """Code2Wav in Lightning: predict (vLLM-Omni runner semantics), fine-tune, evaluate.

    Predict and streaming run through an :class:`~omni_lightning.runner.session.InferenceSession`
    (the engine, kept across predicts, and the one owner of the device weights); fine-tuning through
    ``training/`` (losses, GAN step, optimizers, EMA, :class:`~omni_lightning.training.kernel_choice.TrainingKernels`);
    evaluation logs ``evaluation/metrics.py`` (W&B media: ``EvaluationMedia`` from ``configure_callbacks``).
    The model comes from ``model``, else ``checkpoint``, else ``config`` (random weights: predict warns
    unless ``random_weights=True``).

    Args:
        model: an in-memory ``Code2Wav`` (its weights are the caller's); overrides checkpoint and config.
        config: a preset name, a ``Code2WavConfig`` or its dict; the architecture when no model or checkpoint.
        checkpoint: an HF-layout folder (a Qwen3-Omni checkpoint or a saved Code2Wav) to load weights from.
        random_weights: run on random weights on purpose (the command line refuses predict without weights).
        frames_per_forward: frames (rows x chunk) one forward decodes; None: from the memory budget.
        fast_path: on CUDA, Triton kernels and CUDA graphs (False: eager torch, the same exact chunking).
        graph_frames: the longest forward (rows x frames) replayed as a CUDA graph; 0: no graphs.
        fast_training: on CUDA, Triton SnakeBeta forward and backward and the generator as CUDA graphs in fit.
        learning_rate: the generator's AdamW learning rate.
        betas: AdamW's betas.
        weight_decay: AdamW's weight decay.
        warmup_steps: linear warm-up steps before the cosine decay (at most a tenth of the run's steps).
        min_lr_ratio: the cosine decay's floor, as a fraction of the learning rate.
        decay_fraction: the last fraction of the steps after warm-up the decay spans (1.0: all of them;
            0.3: the peak rate for the first seven tenths, then the cosine).
        total_steps: steps of the schedule; None: the trainer's estimated stepping batches.
        grad_clip: gradient norm clip (None or 0: none); the Trainer's gradient_clip_val wins.
        mel_weight: weight of the multi-resolution mel L1 loss.
        stft_weight: weight of the multi-resolution STFT loss.
        waveform_weight: weight of the waveform L1 loss (the spectral losses compare magnitudes only).
        freeze: parameter-name prefixes kept frozen.
        train_only: parameter-name prefixes trained, every other parameter frozen.
        ema_decay: EMA of the weights in fit, warmed up so a short fit's average follows its recent steps (after
            fit the model holds it; ``use_ema(False)``: the raw weights).
        adversarial: add the MPD and STFT discriminators (GAN step under manual optimization).
        adversarial_weight: weight of the generator's adversarial loss.
        feature_matching_weight: weight of the feature-matching loss.
        discriminator_lr: the discriminators' learning rate.
        log_samples: audio samples validation and test log (W&B).
        quality_metrics: perceptual metrics validation and test score besides the spectral ones, from
            ``pesq`` (wide-band), ``stoi``, ``estoi``, in worker processes (the ``quality`` extra).
        quality_workers: processes that score them (None: half the CPUs, shared by the host's ranks).
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
        learning_rate: float = 1e-3,
        betas: tuple[float, float] = (0.8, 0.99),
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        decay_fraction: float = 1.0,
        total_steps: int | None = None,
        grad_clip: float | None = 1.0,
        mel_weight: float = 1.0,
        stft_weight: float = 1.0,
        waveform_weight: float = 0.0,
        freeze: list[str] | None = None,
        train_only: list[str] | None = None,
        ema_decay: float | None = None,
        adversarial: bool = False,
        adversarial_weight: float = 1.0,
        feature_matching_weight: float = 2.0,
        discriminator_lr: float = 1e-4,
        # evaluation
        log_samples: int = 4,
        quality_metrics: list[str] | None = None,
        quality_workers: int | None = None,
    ) -> None:
        super().__init__()
        resolved = Code2Wav.resolve(model, checkpoint, config)
        check_count("frames_per_forward", frames_per_forward, none_ok=True)  # None: from the memory budget
        check_count("graph_frames", graph_frames, minimum=0)  # 0: no CUDA graphs
        check_count("log_samples", log_samples, minimum=0)
        check_count("quality_workers", quality_workers, none_ok=True)
        quality = check_quality_metrics(quality_metrics)  # before the run: a missing extra, an unknown name
        self.model = resolved
        self.save_hyperparameters(ignore=["model"])
        check_fine_tuning_settings(self.hparams)
        # hparams hold the architecture itself, so a Lightning checkpoint restores with no HF folder
        self.hparams["config"] = asdict(resolved.config)
        self.frames_per_forward, self.fast_path, self.fast_training = frames_per_forward, fast_path, fast_training
        self.session = InferenceSession()  # the decode engine and the device weights (runner/session.py)
        self.training_run = (
            TrainingKernels()
        )  # fit's, validate's and test's kernels and graph (training/kernel_choice.py)
        self.skipped_requests = SkippedRequests()  # bad requests fit and evaluation left out, each warned once
        # random weights nobody asked for: predict warns once (a fit, a load or random_weights=True says otherwise)
        self.unasked_random_weights = model is None and checkpoint is None and not random_weights
        # what predict's start-up line says of the weights; a fit or a loaded checkpoint replaces it
        self.weights_origin = (
            "the given model's weights"
            if model is not None
            else f"weights from {checkpoint}"
            if checkpoint
            else "random weights"
        )
        self.register_load_state_dict_post_hook(_weights_loaded)
        freeze_parameters(self.model, freeze or [], train_only)
        rate = resolved.config.sample_rate
        self.reconstruction_loss = Unregistered(ReconstructionLoss(rate, mel_weight, stft_weight, waveform_weight))
        self.discriminators = Discriminators() if adversarial else None
        self.adversarial_step = AdversarialStep(self.discriminators, adversarial_weight, feature_matching_weight,
                                                grad_clip) if adversarial else None  # fmt: skip
        self.automatic_optimization = not adversarial  # GAN: two optimizers, stepped in the training step
        self.ema = EMAWeights(ema_decay) if ema_decay is not None else None
        self.eval_metrics = Unregistered(AudioMetrics(rate))
        self.quality_scorer = QualityScorer(quality, rate, quality_workers) if quality else None

    def setup(self, stage: str) -> None:
        self.session.setup(self, stage)  # refuses a call on another thread during fit; holds or lends weights
        self.skipped_requests.clear()  # each run warns about its own
        trainer = self._trainer  # None when a user calls setup by hand: the weights' device then
        device = trainer.strategy.root_device if trainer is not None else next(self.parameters()).device
        plain = Kernels.for_training(device, fused=False)  # torch, and on the CPU oneDNN's bf16 bug worked around
        self.training_run.kernels = self.configure_training_kernels(device) if self.fast_training else plain
        if stage == "fit":  # a new graph each fit: one fit's shapes, weights and trainable set
            self.training_run.graph = self.configure_training_graph(trainer) if self.fast_training else None
            self.unasked_random_weights = False
            if self.adversarial_step is not None and trainer is not None:
                find_unused_parameters_under_ddp(trainer)

    def teardown(self, stage: str) -> None:
        if stage == "fit":  # its graph's pool holds a step's activations, which predict must not pay for
            self.training_run.graph = None

    def on_train_start(self) -> None:
        self.weights_origin = "weights fine-tuned in this process"  # from the first step on (an interrupted fit too)

    def on_train_end(self) -> None:
        self.weights_origin = f"weights fine-tuned in this process ({self.trainer.global_step} steps)"

    # --- the inference session's entry points (runner/session.py) ---------------------------------

    @property
    def engine(self) -> DecodeEngine | None:
        """The decode engine kept from the last predict (None before one, or once released)."""
        return self.session.engine

    @engine.setter
    def engine(self, engine: DecodeEngine | None) -> None:
        self.session.engine = engine

    @property
    def engine_stats(self) -> dict[str, float]:
        """The engine's ``stats()`` at the end of the last predict."""
        return self.session.stats

    def decode_engine(self) -> DecodeEngine:
        """The engine predict runs on: the kept one while it serves the model where it is, else a new one."""
        return self.session.decode_engine(self)

    def release_engine(self) -> None:
        """Frees the engine (weights, graphs, state) and gives the cached memory back."""
        self.session.release_engine()

    def streaming_decoder(self, max_streams: int = 64, cuda_graphs: bool = True,
                          gpu_memory_utilization: float | None = None,
                          step_frames: int = 16) -> StreamingDecoder:  # fmt: skip
        """A :class:`StreamingDecoder` over the model (``gpu_memory_utilization``: its budget's share of the
        GPU; a step of up to ``step_frames`` a stream replays a CUDA graph), retired when the module starts
        fit; refused on another thread while fit runs."""
        return self.session.streaming_decoder(self, max_streams, cuda_graphs, gpu_memory_utilization, step_frames)

    def stream(self, code_chunks: Iterable[torch.Tensor], cuda_graphs: bool = True) -> Iterator[torch.Tensor]:
        """Decodes one request as its code chunks ``[Q, n]`` arrive: float32 ``[1, m]`` per chunk, which
        concatenate to ``decode`` of all its frames; up to 8 may interleave. Current weights (no EMA swap)."""
        return self.session.stream(self, code_chunks, cuda_graphs)

    # --- training kernels and graph (training/kernel_choice.py) --------------------------------------------

    @property
    def training_kernels(self) -> Kernels:
        """The kernels fit, validate and test run the model with (chosen in ``setup``)."""
        return self.training_run.kernels

    @property
    def training_graph(self) -> TrainingGraph | None:
        """Fit's CUDA graph of the generator (set in ``setup`` of fit, None after it)."""
        return self.training_run.graph

    def generate(self, codes: torch.Tensor) -> torch.Tensor:
        """The model's waveform for a training or evaluation batch (``training_kernels``, ``training_graph``)."""
        return self.training_run.generate(self.model, codes)

    def configure_training_graph(self, trainer: pl.Trainer | None) -> TrainingGraph | None:
        """How fit replays the generator (default: a ``TrainingGraph`` where CUDA, a plain precision, one
        process and no accumulation allow it, else None: eager); called in ``setup`` of each fit, not
        with ``fast_training = False``.

        Args:
            trainer: the fit's trainer (None when ``setup`` is called by hand).
        """
        return default_training_graph(trainer, self.automatic_optimization)

    def configure_training_kernels(self, device: torch.device) -> Kernels:
        """The kernels fit, validate and test run the model with (default ``Kernels.for_training``),
        called once per run in ``setup``; not called with ``fast_training = False``.

        Args:
            device: where the trainer runs the module.

        Example::

            class Interpreted(Code2WavModule):  # Triton's kernels on the CPU, in its interpreter
                def configure_training_kernels(self, device):  # (TRITON_INTERPRET=1 before the import)
                    return Kernels(partial(snake_beta_triton_autograd, precise=True), name="interpreted")
        """
        return Kernels.for_training(device)

    def on_predict_start(self) -> None:
        if self.unasked_random_weights:  # here, not in setup: a --ckpt_path is loaded between the two
            self.unasked_random_weights = False
            warnings.warn(RANDOM_WEIGHTS, UserWarning, stacklevel=2)
        self.session.decode_engine(self)

    def on_predict_end(self) -> None:
        self.session.on_predict_end(self)

    @property
    def config(self) -> Code2WavConfig:
        return self.model.config

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.weights_origin = f"weights from a Lightning checkpoint (step {checkpoint.get('global_step', '?')})"

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "hyper_parameters" in checkpoint:  # weights and architecture are in it: no HF folder reread
            checkpoint["hyper_parameters"]["checkpoint"] = None
            for key in ("quality_metrics", "quality_workers"):  # how a later run scores: loads without the extra
                checkpoint["hyper_parameters"].pop(key, None)

    def configure_callbacks(self) -> list[pl.Callback]:
        """EMA weights (``ema_decay``) in fit; W&B run config and media, and the quality metrics' scorer, in
        fit, validate and test; in predict, the weights back into their host tensors after an error. One
        the trainer holds already (a second run on it) is not given again: Lightning would announce that
        it overrides itself."""
        stage = self.trainer.state.fn
        callbacks: list[pl.Callback] = [self.ema] if self.ema is not None and stage == "fit" else []
        if stage in ("fit", "validate", "test"):
            callbacks.append(EvaluationMedia(self.hparams.log_samples))
            callbacks += [self.quality_scorer] if self.quality_scorer is not None else []
        if stage == "predict":
            callbacks.append(ReleaseOnException())  # a failed predict's weights back into their host tensors
        return [cb for cb in callbacks if not any(_does(have, cb) for have in self.trainer.callbacks)]

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

    def predict_step(self, batch: dict[str, Any], batch_idx: int = 0, dataloader_idx: int = 0) -> OmniModelRunnerOutput:
        """The batch's runner output: its ``req_ids`` and ``errors``, per request
        ``{"model_outputs": wav Float[1, output_length(n)], "sr": sample_rate}`` (on the host once finalized)."""
        outputs = {"model_outputs": self.decode_batch(batch), "sr": self.config.sample_rate}
        return runner_output(batch, outputs, batch_idx, dataloader_idx)

    def decode_batch(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """Float32 waveforms of a (validated) batch, in request order."""
        n_frames = batch.get("n_frames") or self.on_before_batch_transfer(batch, 0)["n_frames"]
        return self.decode_engine().decode(batch["codes"], n_frames, validate=False)  # checked before transfer

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
        if value:  # (under bf16-mixed with a fused AdamW, past Lightning's refusal: schedule.clip_gradients)
            clip_gradients(self, optimizer, value, gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        return fine_tuning_optimizers(
            self.model.parameters(), self.discriminators, learning_rate=hp.learning_rate, betas=hp.betas,
            weight_decay=hp.weight_decay, discriminator_lr=hp.discriminator_lr, warmup_steps=hp.warmup_steps,
            min_lr_ratio=hp.min_lr_ratio, total_steps=hp.total_steps, decay_fraction=hp.decay_fraction,
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
        out = {"wav": wav.detach()}  # EvaluationMedia logs samples from it
        if self.quality_scorer is not None and not self.trainer.sanity_checking:  # scored in its workers
            out["quality"] = self.quality_scorer.submit(wav.detach(), audio, lengths)
        return out

    def on_validation_epoch_end(self) -> None:
        self._eval_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_end("test")

    def _eval_end(self, stage: str) -> None:
        if not self.trainer.sanity_checking:  # values already reduced over ranks
            self.log_dict({f"{stage}/{k}": float(v) for k, v in self.eval_metrics.on(self.device).compute().items()})


def _weights_loaded(module: Code2WavModule, incompatible_keys: Any) -> None:
    """A state dict loaded into the module (a Lightning checkpoint too): its weights are no longer random."""
    module.unasked_random_weights = False
    if module.weights_origin == "random weights":  # load_from_checkpoint builds from the config, then loads
        module.weights_origin = "weights loaded from a state dict"


def _does(have: pl.Callback, want: pl.Callback) -> bool:
    """Whether ``have`` does ``want``'s job: the same, or one of its class and settings (reset per run)."""
    same_kind = type(have) is type(want) and isinstance(want, (ReleaseOnException, EvaluationMedia))
    return have is want or (same_kind and vars(have).get("log_samples") == vars(want).get("log_samples"))
