"""``Code2WavModule``: the LightningModule around a :class:`Code2Wav`."""

from __future__ import annotations

import warnings
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch

from omni_lightning.models import Code2Wav, Code2WavConfig, resolve_config, validate_codes

# The module validates codes in `on_before_batch_transfer` by design, datamodule or not.
warnings.filterwarnings(
    "ignore", message=r"You have overridden `on_before_batch_transfer` in `LightningModule` but have passed in a"
)


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
        config: str | dict | Code2WavConfig = "qwen3-omni",
        checkpoint: str | None = None,
        max_frames_per_request: int = 1500,
        chunk_size: int = 300,
        left_context: int = 25,
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
        if ema_decay is not None and not 0.0 < ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {ema_decay}")
        self.model = model
        self.save_hyperparameters(ignore=["model"])
        # hparams hold the architecture itself, so a Lightning checkpoint restores with no HF folder
        self.hparams["config"] = asdict(model.config)
        self.max_frames_per_request = max_frames_per_request
        self.chunk_size = chunk_size
        self.left_context = left_context
        self.frozen = self._freeze(freeze or [], train_only)
        self._losses: list[torch.nn.Module] = []  # built on first use; kept out of the state dict
        self.discriminators = None
        if adversarial:
            from omni_lightning.training.discriminators import Discriminators

            self.discriminators = Discriminators()
            self.automatic_optimization = False
        self.ema: dict[str, torch.Tensor] | None = None
        self._ema_swapped = False

    def _freeze(self, freeze: list[str], train_only: list[str] | None) -> list[str]:
        """Freezes parameters by name prefix (``freeze``) or all but some (``train_only``)."""
        names = [n for n, _ in self.model.named_parameters()]
        for prefix in [*freeze, *(train_only or [])]:
            if not any(n.startswith(prefix) for n in names):
                raise ValueError(f"no model parameter starts with {prefix!r} (e.g. 'decoder.', 'pre_transformer.')")
        frozen = []
        for name, p in self.model.named_parameters():
            keep = any(name.startswith(t) for t in train_only) if train_only is not None else True
            if not keep or any(name.startswith(f) for f in freeze):
                p.requires_grad_(False)
                frozen.append(name)
        return frozen

    @property
    def config(self) -> Code2WavConfig:
        return self.model.config

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        hparams = checkpoint.get("hyper_parameters", {})
        if hparams.get("checkpoint"):  # the weights are in the state dict: don't reread the folder
            hparams["source_checkpoint"] = hparams.pop("checkpoint")
        if self.ema is not None:
            ema = {n: t.detach().cpu().clone() for n, t in self.ema.items()}
            if self._ema_swapped:  # saved mid-validation: the model holds the EMA, self.ema the raw weights
                params = dict(self.model.named_parameters())
                for n in ema:
                    checkpoint["state_dict"][f"model.{n}"] = ema[n].to(params[n].dtype)
                ema = {n: params[n].detach().float().cpu().clone() for n in ema}
            checkpoint["ema"] = ema

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "ema" in checkpoint:
            self.ema = {n: t.to(self.device) for n, t in checkpoint["ema"].items()}

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
                )
        return [w.float() for w in wavs]

    # --- fine-tuning -------------------------------------------------------------------------------

    def _loss_modules(self) -> Any:
        # never built or moved under inference mode (validate, predict): training reuses them
        with torch.inference_mode(False):
            if not self._losses:
                from omni_lightning.training.losses import MultiResolutionMelLoss, MultiResolutionSTFTLoss

                mel, stft = MultiResolutionMelLoss(self.config.sample_rate), MultiResolutionSTFTLoss()
                self._losses.append(torch.nn.ModuleDict({"mel": mel, "stft": stft}))
            return self._losses[0].to(self.device)

    def _paired(self, batch: dict[str, Any], stage: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if "audio" not in batch:
            raise ValueError(f"{stage} needs paired data: a manifest whose lines have an 'audio' path")
        return batch["codes"], batch["audio"], batch["audio_lengths"]

    def reconstruction(self, wav: torch.Tensor, audio: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        """Weighted multi-resolution mel L1 + STFT loss on the real samples only."""
        losses = self._loss_modules()
        mel = losses["mel"](wav, audio, lengths)
        stft = losses["stft"](wav, audio, lengths)
        return {"loss": self.hparams.mel_weight * mel + self.hparams.stft_weight * stft, "mel": mel, "stft": stft}

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
        from omni_lightning.training.discriminators import (
            discriminator_loss,
            feature_matching_loss,
            generator_adversarial_loss,
        )

        opt_g, opt_d = self.optimizers()
        n = int(lengths.min())  # a segment every item really has: padding never reaches a discriminator
        real, fake = audio[:, None, :n], wav[..., :n]
        d_loss = discriminator_loss(self.discriminators(real), self.discriminators(fake.detach()))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=self.hparams.grad_clip)
        opt_d.step()
        real_out, fake_out = self.discriminators(real), self.discriminators(fake)
        adv, fm = generator_adversarial_loss(fake_out), feature_matching_loss(real_out, fake_out)
        g_loss = rec["loss"] + self.hparams.adversarial_weight * adv + self.hparams.feature_matching_weight * fm
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self.clip_gradients(opt_g, gradient_clip_val=self.hparams.grad_clip)
        opt_g.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        logs = {**rec, "loss": g_loss, "adv": adv, "feature_matching": fm, "disc": d_loss}
        self.log_dict({f"train/{k}": v for k, v in logs.items()}, prog_bar=True, batch_size=bs)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # the module's grad_clip unless the Trainer sets its own
        value = gradient_clip_val if gradient_clip_val is not None else self.hparams.grad_clip
        if value:
            self.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm=gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        from omni_lightning.training.schedule import WarmupCosine

        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("every model parameter is frozen: nothing to fine-tune")
        hp = self.hparams
        total = hp.total_steps or int(self.trainer.estimated_stepping_batches)
        if self.discriminators is not None and not hp.total_steps:
            total //= 2  # Lightning counts both optimizers' steps; the schedules step once per batch
        total = max(total, 1)

        lr_lambda = WarmupCosine(hp.warmup_steps, total, hp.min_lr_ratio)
        opt = torch.optim.AdamW(params, lr=hp.learning_rate, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        schedule = {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), "interval": "step"}
        if self.discriminators is None:
            return {"optimizer": opt, "lr_scheduler": schedule}
        opt_d = torch.optim.AdamW(self.discriminators.parameters(), lr=hp.discriminator_lr, betas=tuple(hp.betas))
        schedule_d = {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt_d, lr_lambda), "interval": "step"}
        return [opt, opt_d], [schedule, schedule_d]

    # --- EMA weights -------------------------------------------------------------------------------

    def on_fit_start(self) -> None:
        if self.hparams.ema_decay is not None and self.ema is None:
            self.ema = {n: p.detach().float().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.ema is not None:
            for name, p in self.model.named_parameters():
                if name in self.ema:
                    self.ema[name].lerp_(p.detach().float(), 1.0 - self.hparams.ema_decay)

    @torch.no_grad()
    def _swap_ema(self) -> None:
        params = dict(self.model.named_parameters())
        for name, avg in self.ema.items():
            raw = params[name].detach().float().clone()
            params[name].copy_(avg)
            avg.copy_(raw)
        self._ema_swapped = not self._ema_swapped

    def use_ema(self, on: bool) -> None:
        """Puts the EMA weights into the model (``on``) or the raw weights back."""
        if self.ema is not None and on != self._ema_swapped:
            self._swap_ema()

    def on_validation_start(self) -> None:
        self.use_ema(True)

    def on_validation_end(self) -> None:
        self.use_ema(False)

    def on_test_start(self) -> None:
        self.use_ema(True)

    def on_test_end(self) -> None:
        self.use_ema(False)

    def on_predict_start(self) -> None:
        self.use_ema(True)

    def on_predict_end(self) -> None:
        self.use_ema(False)

    def export_pretrained(self, path: str, ema: bool = True) -> Any:
        """``save_pretrained`` of the tuned model (its EMA weights when it keeps them and ``ema``)."""
        swapped = self._ema_swapped
        self.use_ema(ema)
        try:
            return self.model.save_pretrained(path)
        finally:
            self.use_ema(swapped)

    # --- validation / test: metrics, media, run config ------------------------------------------------

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(batch, "test")

    def _eval_metrics(self) -> Any:
        if not hasattr(self, "_metrics"):
            from omni_lightning.evaluation.metrics import AudioMetrics

            self._metrics = [AudioMetrics(self.config.sample_rate)]  # a list: kept out of the state dict
        return self._metrics[0].to(self.device)

    def on_validation_epoch_start(self) -> None:
        self._eval_start()

    def on_test_epoch_start(self) -> None:
        self._eval_start()

    def _eval_start(self) -> None:
        import time

        self._eval_metrics().reset()
        self._samples: list[dict[str, Any]] = []
        self._eval_t0 = time.perf_counter()
        if not getattr(self, "_run_config_logged", False) and self.trainer.is_global_zero:
            from omni_lightning.evaluation.media import log_run_config

            self._run_config_logged = log_run_config(self)

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        codes, audio, lengths = self._paired(batch, stage)
        wav = self.model(codes)
        rec = self.reconstruction(wav, audio, lengths)
        self.log_dict({f"{stage}/{k}": v for k, v in rec.items()}, batch_size=codes.shape[0], sync_dist=True)
        self._eval_metrics().update(wav.detach(), audio, lengths)
        if self.trainer.is_global_zero and len(self._samples) < self.hparams.log_samples:
            for i, req_id in enumerate(batch.get("req_ids") or range(codes.shape[0])):
                if len(self._samples) >= self.hparams.log_samples:
                    break
                n = int(lengths[i])
                self._samples.append({"id": str(req_id), "generated": wav[i, 0, :n].float().cpu(),
                                      "reference": audio[i, :n].float().cpu()})  # fmt: skip

    def on_validation_epoch_end(self) -> None:
        self._eval_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_end("test")

    def _eval_end(self, stage: str) -> None:
        import time

        if self.trainer.sanity_checking:
            return
        values = self._eval_metrics().compute()  # summed over ranks
        seconds = max(time.perf_counter() - self._eval_t0, 1e-9)
        values["audio_s_per_s"] = values["audio_s"] / seconds
        self.log_dict({f"{stage}/{k}": float(v) for k, v in values.items()})  # already summed over ranks
        if self.trainer.is_global_zero and self._samples:
            from omni_lightning.evaluation.media import log_media

            log_media(self, stage, self._samples)
