"""``OmniPredictionLoop``: Lightning's prediction loop with vLLM-Omni's generation-runner semantics.

The rule: a :class:`MultimodalOutputs` returned by ``predict_step`` becomes an
:class:`OmniModelRunnerOutput` (:func:`runner_output` over the step's own batch) before any
``on_predict_batch_end`` hook sees it; a step may also return a runner output itself, as
``Code2WavModule`` does. Anything else takes Lightning's path untouched: the same object reaches the
hooks and writers, and ``trainer.predict`` returns it moved to the CPU. A ``predict_step(dataloader_iter)``
gets the ids of the batch it pulled last (the batch its batch-end hooks receive).

What the loop adds: a runner output is finalized once the next step has run, at epoch end, or at
teardown after an error; the GPU share is capped during predict (``gpu_memory_utilization``); the
module's ``profile_run()`` runs before the first batch; a SIGTERM ends the run after the batch in
progress (``SIGTERMException``, as Lightning's fit loop); under DDP a rank with no batch still runs
predict's start and end hooks, so collectives there meet the other ranks'.

What it does not do: sample (no logits: the model's outputs are the product), profile memory with a
dummy forward (no KV cache to size), or overlap the host copy of plain outputs.

The step is Lightning's ``_PredictionLoop._predict_step`` rewritten with the same hooks in the same
order: Lightning has no public point between ``predict_step`` and the batch-end hooks.
``tests/test_contract.py`` runs Lightning's predict contracts through it and pins the private points it
uses (``lightning>=2.6,<2.7``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch.loops.prediction_loop import _PredictionLoop
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from omni_lightning.errors import UsageError
from omni_lightning.runner.host_memory import release_free_host_memory
from omni_lightning.runner.output import MultimodalOutputs, OmniModelRunnerOutput, runner_output

# what stock Lightning names the time spent fetching a batch (it uses the loop's class name)
FETCH_ACTION = f"[{_PredictionLoop.__name__}].predict_next"


class OmniPredictionLoop(_PredictionLoop):
    """Install on any trainer with ``trainer.predict_loop = OmniPredictionLoop(trainer)``.

    ``inference_mode``: None (default) keeps the trainer's own setting, so installing the loop never
    changes whether ``predict_step`` runs under ``torch.inference_mode``.
    ``gpu_memory_utilization``: the fraction of the GPU this process may allocate (None: no cap).
    """

    def __init__(
        self, trainer: pl.Trainer, inference_mode: bool | None = None, gpu_memory_utilization: float | None = None
    ) -> None:
        if inference_mode is None:
            inference_mode = getattr(getattr(trainer, "predict_loop", None), "inference_mode", True)
        super().__init__(trainer, inference_mode=inference_mode)
        fraction = gpu_memory_utilization
        is_number = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
        if fraction is not None and not (is_number and 0.0 < fraction <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1] or None, got {fraction!r}")
        self.gpu_memory_utilization = gpu_memory_utilization
        self._in_flight: list[OmniModelRunnerOutput] = []  # runner outputs not finalized yet, in order
        self._uncap: Callable[[], None] | None = None

    @property
    def skip(self) -> bool:
        # under DDP a rank with no batch still runs predict's start and end hooks (collectives there meet
        # every rank's); a limit of 0 batches skips on every rank alike, as stock
        return super().skip and (self.trainer.world_size == 1 or self.trainer.limit_predict_batches == 0)

    def setup_data(self) -> None:
        """Stock's, except that under DDP a fractional ``limit_predict_batches`` that leaves some rank no
        batch is refused on every rank (stock refuses on that rank alone and the others hang in their next
        collective). With several predict dataloaders a rank may still refuse alone: not covered."""
        limit, world = self.trainer.limit_predict_batches, self.trainer.world_size
        if world == 1 or not isinstance(limit, float) or limit in (0.0, 1.0):
            return super().setup_data()
        refused = None
        try:
            super().setup_data()
        except MisconfigurationException as err:
            refused = err
        if self.trainer.strategy.reduce_boolean_decision(refused is not None, all=False):
            if refused is not None and f"{limit} * " not in str(refused):
                raise refused  # another misconfiguration (an IterableDataset takes no fraction): Lightning's words
            raise UsageError(
                f"limit_predict_batches={limit} leaves a process of this {world}-process job no batch: each process "
                "predicts that fraction of its own share of the batches, rounded down. Give a whole number of "
                "batches per process, or a larger fraction"
            ) from refused

    def on_run_start(self) -> None:
        device = self.trainer.strategy.root_device
        if self.gpu_memory_utilization is not None and device.type == "cuda":
            self._uncap = cap_memory(device, self.gpu_memory_utilization)  # teardown puts the old share back
        profile_run = getattr(self.trainer.lightning_module, "profile_run", None)
        if callable(profile_run):
            profile_run()
        super().on_run_start()

    def on_run_end(self) -> Any:
        self._settle(keep=None)  # every runner output is on the host before epoch-end writers read it
        release_free_host_memory()  # what stays resident is the returned predictions (host_memory.py)
        return super().on_run_end()

    def teardown(self) -> None:
        # after an exception too: wait for copies in flight (outputs already handed out stay valid)
        try:
            self._settle(keep=None)
        finally:
            self._in_flight = []
            uncap, self._uncap = self._uncap, None
            if uncap is not None:  # a later fit or uncapped predict is not held to this cap
                uncap()
            super().teardown()

    def _on_before_fetch(self) -> None:
        self.trainer.profiler.start(FETCH_ACTION)

    def _on_after_fetch(self) -> None:
        self.trainer.profiler.stop(FETCH_ACTION)

    def _predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int, dataloader_iter: Iterator | None) -> None:
        """Lightning's step (its hooks, order and bookkeeping), where a ``MultimodalOutputs`` becomes a
        runner output before the batch-end hooks; then the previous step's runner output is finalized."""
        trainer, module = self.trainer, self.trainer.lightning_module
        if dataloader_iter is None:
            batch = trainer.precision_plugin.convert_input(batch)
            batch = module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)
            batch = call._call_strategy_hook(trainer, "batch_to_device", batch, dataloader_idx=dataloader_idx)
        self.batch_progress.increment_ready()
        any_on_epoch = dataloader_iter is None and self._store_data_for_prediction_writer(batch_idx, dataloader_idx)
        several = self.num_dataloaders > 1
        hook_kwargs = self._build_kwargs(batch, batch_idx, dataloader_idx if several else None)
        call._call_callback_hooks(trainer, "on_predict_batch_start", *hook_kwargs.values())
        call._call_lightning_module_hook(trainer, "on_predict_batch_start", *hook_kwargs.values())
        self.batch_progress.increment_started()
        if dataloader_iter is None:
            step_args = self._build_step_args_from_hook_kwargs(hook_kwargs, "predict_step")
        else:
            pulled = _Pulled(dataloader_iter, (batch, batch_idx, dataloader_idx))
            step_args = (pulled,)
        output = call._call_strategy_hook(trainer, "predict_step", *step_args)
        if output is None:
            self._warning_cache.warn("predict returned None if it was on purpose, ignore this warning...")
        self.batch_progress.increment_processed()
        if dataloader_iter is not None:  # the hooks get the batch the step pulled last
            batch, batch_idx, dataloader_idx = pulled.last
            hook_kwargs = self._build_kwargs(batch, batch_idx, dataloader_idx if several else None)
        if isinstance(output, MultimodalOutputs):
            output = runner_output(batch, output, batch_idx, dataloader_idx)
        if isinstance(output, OmniModelRunnerOutput):
            self._in_flight.append(output)  # finalized below, next step, or at teardown if a hook raises
        call._call_callback_hooks(trainer, "on_predict_batch_end", output, *hook_kwargs.values())
        call._call_lightning_module_hook(trainer, "on_predict_batch_end", output, *hook_kwargs.values())
        self.batch_progress.increment_completed()
        if self._return_predictions or any_on_epoch:
            self._predictions[dataloader_idx].append(move_data_to_device(output, torch.device("cpu")))
        # the previous step's copy ran under this step's compute: consume it now; an output with no
        # copy in flight is built at once, as Lightning moves predictions at once
        current = output if isinstance(output, OmniModelRunnerOutput) and output.in_flight else None
        self._settle(keep=current)
        if trainer.received_sigterm and not self.batch_progress.is_last_batch:
            raise SIGTERMException  # as stock's fit and evaluation loops do; stock's predict loop never stops

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


class _Pulled(Iterator):
    """A ``dataloader_iter`` step's iterator that remembers the last ``(batch, batch_idx, dataloader_idx)``
    it gave (``last`` starts as the one before the step); other attributes are the wrapped iterator's."""

    def __init__(self, inner: Iterator, last: tuple[Any, int, int]) -> None:
        self.inner, self.last = inner, last

    def __next__(self) -> tuple[Any, int, int]:
        self.last = next(self.inner)
        return self.last

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def cap_memory(device: torch.device, fraction: float, cuda: Any = torch.cuda) -> Callable[[], None]:
    """Caps this process's allocations on ``device`` at ``fraction`` of it; returns what puts back the
    share it had (1.0 where torch cannot read it). ``cuda``: ``torch.cuda`` (a stand-in in tests)."""
    read = getattr(cuda, "get_per_process_memory_fraction", None)
    before = read(device) if read is not None else 1.0
    cuda.set_per_process_memory_fraction(fraction, device)
    return lambda: cuda.set_per_process_memory_fraction(before, device)
