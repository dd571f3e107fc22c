"""``OmniPredictionLoop``: Lightning's prediction loop, plus vLLM-Omni's generation-runner semantics
for multimodal outputs.

The rule: a **multimodal output** is a :class:`MultimodalOutputs` (a dict subclass) returned by
``predict_step``. The loop turns it, and nothing else, into an :class:`OmniModelRunnerOutput` before
any ``on_predict_batch_end`` hook sees it. Everything else ``predict_step`` returns (None, a tensor,
a list, a tuple, a plain dict, any object) takes Lightning's own path untouched: the same object
reaches the hooks and writers, and ``trainer.predict`` returns it moved to the CPU as stock does.

What the loop adds for runner outputs, as vLLM-Omni's ``OmniGenerationModelRunner``: each output is
finalized (per-request owned CPU payloads; an async host copy waited for) once the next step has run,
or at epoch end, or at teardown after an error. Before the first batch it caps the process's GPU share
(``gpu_memory_utilization``, when given; the share it had is put back at teardown) and calls the
module's ``profile_run()`` if it has one.

A SIGTERM (a scheduler's stop, ``kill``) ends the run after the batch in progress, raising Lightning's
``SIGTERMException`` as its fit and evaluation loops do: the batches already decoded reach the
callbacks' ``on_exception`` (a writer writes them). Stock's predict loop only records the signal and
decodes everything.

Under DDP (any number of processes and nodes) a rank that has no batch runs predict's hooks all the
same (start, epoch start and end, end), with no step: stock skips them, and a callback whose end
hook meets the other ranks (``WaveformWriter``'s merge) would wait forever.

What it does not do, and why:
- no logits and no sampling: the model's outputs are the product (``sampled_token_ids`` empty);
- no memory profiling: a Code2Wav stage has no KV cache to size, so ``profile_run`` runs no dummy
  forward (random codes could index past the codebooks); the footprint is set by
  ``gpu_memory_utilization`` and by chunked decoding; no forward that did not come from the data;
- no re-implemented step: Lightning 2.6 has no public point between ``predict_step`` and the
  batch-end hooks, so the loop wraps ``trainer.strategy.predict_step`` for the duration of the stock
  ``_predict_step`` instead of copying it (a copy would drift from the stock step silently);
- no overlapped host copy for plain outputs: stock moves them to the CPU inside its private step.

What it relies on in Lightning (pinned ``lightning>=2.6,<2.7``; ``tests/test_contract.py`` checks the
shape of each): ``_PredictionLoop.__init__(trainer, inference_mode)``;
``_PredictionLoop._predict_step(batch, batch_idx, dataloader_idx, dataloader_iter)`` calls
``trainer.strategy.predict_step`` once per step, looked up at call time, and hands its result to
the batch-end hooks; the fetch-profiling methods ``_on_before_fetch`` / ``_on_after_fetch``
(overridden only to keep stock's action name ``[_PredictionLoop].predict_next``);
``_DataLoaderIterDataFetcher._batch`` (the batch a ``dataloader_iter`` step pulled last, as stock's
hooks receive it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.prediction_loop import _PredictionLoop
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from omni_lightning.errors import UsageError
from omni_lightning.runner.host_memory import release_free_host_memory
from omni_lightning.runner.output import MultimodalOutputs, OmniModelRunnerOutput

# what stock Lightning names the time spent fetching a batch (it uses the loop's class name)
FETCH_ACTION = f"[{_PredictionLoop.__name__}].predict_next"
_NOTHING = object()


class OmniPredictionLoop(_PredictionLoop):
    """Install on any trainer with ``trainer.predict_loop = OmniPredictionLoop(trainer)``.

    ``inference_mode``: None (default) keeps the trainer's own setting (``Trainer(inference_mode=...)``),
    so installing the loop never changes whether ``predict_step`` runs under ``torch.inference_mode``.
    ``gpu_memory_utilization``: the fraction of the GPU this process may allocate (None: no cap).
    """

    def __init__(
        self, trainer: pl.Trainer, inference_mode: bool | None = None, gpu_memory_utilization: float | None = None
    ) -> None:
        if inference_mode is None:
            inference_mode = getattr(getattr(trainer, "predict_loop", None), "inference_mode", True)
        super().__init__(trainer, inference_mode=inference_mode)
        fraction = gpu_memory_utilization
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0.0 < fraction <= 1.0):  # fmt: skip
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1] or None, got {fraction!r}")
        self.gpu_memory_utilization = gpu_memory_utilization
        self._in_flight: list[OmniModelRunnerOutput] = []  # runner outputs not finalized yet, in order

    @property
    def skip(self) -> bool:
        # under DDP a rank with no batch (its data split gave it none) still runs predict's start and end
        # hooks, so collectives there (a writer's merge and counts) meet every rank's; stock skips them all.
        # A limit of 0 batches skips on every rank alike: stock then builds no loader to run hooks over
        return super().skip and (self.trainer.world_size == 1 or self.trainer.limit_predict_batches == 0)

    def setup_data(self) -> None:
        """Stock's, except that under DDP a fractional ``limit_predict_batches`` that leaves some rank's
        share no batch is refused on every rank (stock refuses on that rank alone, and the others failed
        in their next collective: exit 1, a gloo traceback). With several predict dataloaders a rank
        may still refuse while the others check the next one's length: not covered."""
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
        self._prepare_device()
        super().on_run_start()

    def _prepare_device(self) -> None:
        """Caps this process's share of the GPU for this predict (``teardown`` puts back the share it
        had), then lets the module 'profile' (sync, no forward)."""
        device = self.trainer.strategy.root_device
        if self.gpu_memory_utilization is not None and device.type == "cuda":
            self._uncap = cap_memory(device, self.gpu_memory_utilization)
        profile_run = getattr(self.trainer.lightning_module, "profile_run", None)
        if callable(profile_run):
            profile_run()

    def on_run_end(self) -> Any:
        self._settle(keep=None)  # every runner output is on the host before epoch-end writers read it
        release_free_host_memory()  # what stays resident is the returned predictions (host_memory.py)
        return super().on_run_end()

    def teardown(self) -> None:
        # after an exception too: wait for copies in flight (outputs already handed out stay valid)
        # and drop the device tensors they hold
        try:
            self._settle(keep=None)
        finally:
            self._in_flight = []
            uncap, self._uncap = getattr(self, "_uncap", None), None
            if uncap is not None:  # a fit or an uncapped predict after this one is not held to its cap
                uncap()
            super().teardown()

    def _on_before_fetch(self) -> None:
        self.trainer.profiler.start(FETCH_ACTION)

    def _on_after_fetch(self) -> None:
        self.trainer.profiler.stop(FETCH_ACTION)

    def _predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int, dataloader_iter: Iterator | None) -> None:
        """Lightning's own step, with ``strategy.predict_step`` wrapped to turn a
        :class:`MultimodalOutputs` into an :class:`OmniModelRunnerOutput` (everything else unchanged)."""
        strategy = self.trainer.strategy
        stock_step = strategy.predict_step
        produced: list[OmniModelRunnerOutput] = []

        def predict_step(*args: Any, **kwargs: Any) -> Any:
            output = stock_step(*args, **kwargs)
            if isinstance(output, MultimodalOutputs):
                output = self._runner_output(output, self._step_batch(args, kwargs, dataloader_iter))
            if isinstance(output, OmniModelRunnerOutput):
                produced.append(output)
            return output

        shadowed = strategy.__dict__.get("predict_step", _NOTHING)
        strategy.predict_step = predict_step  # an instance attribute: only this step sees it
        try:
            super()._predict_step(batch, batch_idx, dataloader_idx, dataloader_iter)
        finally:
            if shadowed is _NOTHING:
                del strategy.predict_step
            else:
                strategy.predict_step = shadowed
            self._in_flight.extend(produced)  # teardown finalizes it if a hook raised
        # the previous step's copy ran under this step's compute: consume it now; a synchronous
        # output (no copy in flight) is built at once, as Lightning's loop moves predictions at once
        current = produced[-1] if produced else None
        self._settle(keep=current if current is not None and current.in_flight else None)
        if self.trainer.received_sigterm and not self.batch_progress.is_last_batch:
            raise SIGTERMException  # as stock's fit and evaluation loops do; stock's predict loop never stops

    def _step_batch(self, args: tuple, kwargs: dict, dataloader_iter: Iterator | None) -> Any:
        """The batch whose requests the step's outputs are: the step's own batch argument, or for a
        ``dataloader_iter`` step the batch it pulled last (what Lightning's batch-end hooks get)."""
        if dataloader_iter is not None:
            return self._data_fetcher._batch
        return kwargs["batch"] if "batch" in kwargs else args[0]

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

    def _runner_output(self, multimodal_outputs: MultimodalOutputs, batch: Any) -> OmniModelRunnerOutput:
        """Request ids from the batch's ``req_ids``, else ``"<batch number in the run>-<i>"``."""
        if isinstance(batch, Mapping) and "req_ids" in batch:
            req_ids = list(batch["req_ids"])
        else:
            num_reqs = _count_requests(multimodal_outputs)
            req_ids = [f"{self.batch_progress.current.completed}-{i}" for i in range(num_reqs)]
        errors = batch.get("errors", {}) if isinstance(batch, Mapping) else {}
        return OmniModelRunnerOutput(req_ids, multimodal_outputs=multimodal_outputs, errors=errors)


def _count_requests(multimodal_outputs: Mapping[str, Any]) -> int:
    for value in multimodal_outputs.values():
        if isinstance(value, (list, tuple)):
            return len(value)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError("cannot tell the number of requests: the batch has no 'req_ids' and no output is per request")


def cap_memory(device: torch.device, fraction: float, cuda: Any = torch.cuda) -> Callable[[], None]:
    """Caps this process's allocations on ``device`` at ``fraction`` of it; returns what puts back the
    share it had (1.0 where torch cannot read it). ``cuda``: ``torch.cuda`` (a stand-in in tests)."""
    read = getattr(cuda, "get_per_process_memory_fraction", None)
    before = read(device) if read is not None else 1.0
    cuda.set_per_process_memory_fraction(fraction, device)
    return lambda: cuda.set_per_process_memory_fraction(before, device)
