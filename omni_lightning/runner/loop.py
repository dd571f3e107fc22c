"""``OmniPredictionLoop``: Lightning's prediction loop with vLLM-Omni's generation-runner step.

What changes against Lightning's loop is the step alone: ``predict_step``'s multimodal outputs
become an :class:`OmniModelRunnerOutput` (the same hooks run, in the same order, with it as
``outputs``). What the loop deliberately does not do, as vLLM-Omni's ``OmniGenerationModelRunner``:
- no logits and no sampling: the model's outputs are the product;
- no memory profiling: a Code2Wav stage has no KV cache to size, so ``profile_run`` runs no dummy
  forward; the footprint is set by ``gpu_memory_utilization`` and by chunked decoding;
- no forward that did not come from the dataloader.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.loops.prediction_loop import _PredictionLoop
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from omni_lightning.runner.host_memory import release_free_host_memory
from omni_lightning.runner.output import OmniModelRunnerOutput


class OmniPredictionLoop(_PredictionLoop):
    """Install on any trainer with ``trainer.predict_loop = OmniPredictionLoop(trainer)``."""

    def __init__(
        self, trainer: pl.Trainer, inference_mode: bool = True, gpu_memory_utilization: float | None = None
    ) -> None:
        super().__init__(trainer, inference_mode=inference_mode)
        if gpu_memory_utilization is not None and not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.gpu_memory_utilization = gpu_memory_utilization
        self._in_flight: list[OmniModelRunnerOutput] = []  # outputs whose host copy is not waited yet

    def on_run_start(self) -> None:
        self._verify_dataloader_idx_requirement()
        if isinstance(self._data_fetcher, _DataLoaderIterDataFetcher):
            raise MisconfigurationException(
                "OmniPredictionLoop needs `predict_step(batch, ...)`; a `dataloader_iter` step is not supported"
            )
        self._on_predict_model_eval()
        self._prepare_device()
        self._on_predict_start()
        self._on_predict_epoch_start()

    def _prepare_device(self) -> None:
        """Caps this process's share of the GPU, then lets the module 'profile' (sync, no forward)."""
        device = self.trainer.strategy.root_device
        if self.gpu_memory_utilization is not None and device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(self.gpu_memory_utilization, device)
        profile_run = getattr(self.trainer.lightning_module, "profile_run", None)
        if callable(profile_run):
            profile_run()

    def on_run_end(self) -> Any:
        self._settle(keep=None)  # every output is on the host before epoch-end writers read them
        release_free_host_memory()  # what stays resident is the returned predictions (host_memory.py)
        return super().on_run_end()

    def teardown(self) -> None:
        # after an exception too: wait for copies in flight (outputs already handed out stay valid)
        # and drop the device tensors they hold
        try:
            self._settle(keep=None)
        finally:
            self._in_flight = []
            super().teardown()

    def _settle(self, keep: OmniModelRunnerOutput | None) -> None:
        """Finalizes every output in flight except ``keep`` (the step just launched), in order."""
        pending, self._in_flight = self._in_flight, []
        try:
            for output in pending:
                if output is keep:
                    self._in_flight.append(output)
                else:
                    output.finalize()
        except BaseException:
            self._in_flight = []
            raise

    def _runner_output(self, multimodal_outputs: Any, batch: Any, batch_idx: int) -> OmniModelRunnerOutput:
        if not isinstance(multimodal_outputs, Mapping):
            raise TypeError(
                "predict_step must return a dict of multimodal outputs such as "
                f"{{'model_outputs': [wav, ...], 'sr': 24000}}, got {type(multimodal_outputs).__name__}"
            )
        if isinstance(batch, Mapping) and "req_ids" in batch:
            req_ids = list(batch["req_ids"])
        else:  # a plain batch: ids from the position in the run
            num_reqs = _count_requests(multimodal_outputs)
            req_ids = [f"{self.batch_progress.current.completed}-{i}" for i in range(num_reqs)]
        errors = batch.get("errors", {}) if isinstance(batch, Mapping) else {}
        return OmniModelRunnerOutput(req_ids, multimodal_outputs=multimodal_outputs, errors=errors)

    def _predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int, dataloader_iter: Iterator | None) -> None:
        trainer = self.trainer
        batch = trainer.precision_plugin.convert_input(batch)
        batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)
        batch = call._call_strategy_hook(trainer, "batch_to_device", batch, dataloader_idx=dataloader_idx)

        self.batch_progress.increment_ready()
        any_on_epoch = self._store_data_for_prediction_writer(batch_idx, dataloader_idx)
        hook_kwargs = self._build_kwargs(batch, batch_idx, dataloader_idx if self.num_dataloaders > 1 else None)
        call._call_callback_hooks(trainer, "on_predict_batch_start", *hook_kwargs.values())
        call._call_lightning_module_hook(trainer, "on_predict_batch_start", *hook_kwargs.values())
        self.batch_progress.increment_started()

        step_args = self._build_step_args_from_hook_kwargs(hook_kwargs, "predict_step")
        multimodal_outputs = call._call_strategy_hook(trainer, "predict_step", *step_args)
        output = self._runner_output(multimodal_outputs, batch, batch_idx)
        self.batch_progress.increment_processed()

        # AsyncD2HCallback, if installed, starts the host copy here and the output goes in flight
        call._call_callback_hooks(trainer, "on_predict_batch_end", output, *hook_kwargs.values())
        call._call_lightning_module_hook(trainer, "on_predict_batch_end", output, *hook_kwargs.values())
        self.batch_progress.increment_completed()

        # the previous step's copy ran under this step's compute: consume it now; a synchronous
        # output (no copy in flight) is built at once, as Lightning's loop moves predictions at once
        self._in_flight.append(output)
        self._settle(keep=output if output.in_flight else None)
        if self._return_predictions or any_on_epoch:
            self._predictions[dataloader_idx].append(output)


def _count_requests(multimodal_outputs: Mapping[str, Any]) -> int:
    for value in multimodal_outputs.values():
        if isinstance(value, (list, tuple)):
            return len(value)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError("cannot tell the number of requests: the batch has no 'req_ids' and no output is per request")
