"""What one predict step returns: vLLM-Omni's ``OmniModelRunnerOutput`` and its ``pooler_output``.

A non-autoregressive stage samples nothing, so ``sampled_token_ids`` holds one empty list per
request and ``logprobs`` is None; the product is ``pooler_output``, one dict per request built from
the model's multimodal outputs by :func:`build_pooler_output`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch


def owned_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, contiguous, in storage of its own (never a view into a batch buffer)."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu")  # a fresh tensor of exactly t's elements
    owns = t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
    return t if owns else t.clone(memory_format=torch.contiguous_format)


def to_host(value: Any) -> Any:
    """Device tensors in a nest of dicts/lists/tuples moved to the CPU (synchronously)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, Mapping):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    return value


class MultimodalOutputs(dict):
    """The mark of a multimodal output: a dict that ``predict_step`` returns to get runner semantics.

    ``OmniPredictionLoop`` turns a ``MultimodalOutputs``, and nothing else, into an
    :class:`OmniModelRunnerOutput` (split per request by :func:`build_pooler_output`). A plain dict is
    never taken for one, whatever its keys: a stock module's dict stays a dict, as in Lightning.
    """


def build_pooler_output(
    multimodal_outputs: Mapping[str, Any], num_reqs: int, copy_tensors: bool = False
) -> list[dict[str, Any]]:
    """Splits a step's multimodal outputs into one payload per request.

    - a tensor whose first dim is ``num_reqs``: row i goes to request i;
    - a list/tuple of length ``num_reqs`` holding tensors or None: element i to request i;
    - a dict: split value by value with these same rules;
    - anything else (a scalar, a shared tensor, metadata): a copy to every request.
    Every tensor in a payload owns contiguous CPU storage; ``copy_tensors`` copies even tensors that
    look self-owned (for host tensors that live in a reused buffer).
    """
    if not isinstance(multimodal_outputs, Mapping):
        raise TypeError(f"multimodal outputs must be a dict, got {type(multimodal_outputs).__name__}")
    host = to_host(multimodal_outputs)

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone(memory_format=torch.contiguous_format) if copy_tensors else owned_cpu(t)

    def per_request(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor):
            if value.dim() > 0 and value.shape[0] == num_reqs:
                return own(value[i])
            return value.clone(memory_format=torch.contiguous_format)
        if (
            isinstance(value, (list, tuple))
            and len(value) == num_reqs
            and all(v is None or isinstance(v, torch.Tensor) for v in value)
        ):
            return None if value[i] is None else own(value[i])
        if isinstance(value, Mapping):
            return {k: per_request(v, i) for k, v in value.items()}
        return copy.deepcopy(value)

    return [{k: per_request(v, i) for k, v in host.items()} for i in range(num_reqs)]


class HostTransfer(Protocol):
    """A device-to-host copy in flight (see ``AsyncD2HCallback``)."""

    def wait(self) -> Mapping[str, Any]:
        """Blocks until the copy is done; the outputs with host tensors (in a reused buffer)."""

    def release(self) -> None:
        """Gives the host buffer back once its contents were copied out."""


class OmniModelRunnerOutput:
    """One predict step's output, per request: ids, no sampled tokens, no logprobs, ``pooler_output``.

    ``pooler_output`` is built when first read. Until then the step's multimodal outputs may still
    be in flight to the host (``AsyncD2HCallback``); reading it waits for that copy. ``errors`` maps
    the ids of requests of this batch that were not run to the reason (bad input).
    """

    __slots__ = ("req_ids", "req_id_to_index", "sampled_token_ids", "logprobs", "errors", "_pooler_output",
                 "_transfer", "_multimodal_outputs")  # fmt: skip

    def __init__(
        self,
        req_ids: Sequence[str],
        pooler_output: list[dict[str, Any]] | None = None,
        *,
        multimodal_outputs: Mapping[str, Any] | None = None,
        errors: Mapping[str, str] | None = None,
    ) -> None:
        self.req_ids = list(req_ids)
        if len(set(self.req_ids)) != len(self.req_ids):
            raise ValueError(f"request ids in a batch must be unique, got {self.req_ids}")
        self.req_id_to_index = {r: i for i, r in enumerate(self.req_ids)}
        self.sampled_token_ids: list[list[int]] = [[] for _ in self.req_ids]
        self.logprobs = None
        self.errors = dict(errors or {})
        self._pooler_output = pooler_output
        self._multimodal_outputs = multimodal_outputs
        self._transfer: HostTransfer | None = None
        if pooler_output is None and multimodal_outputs is None:
            raise ValueError("give pooler_output or multimodal_outputs")

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def multimodal_outputs(self) -> Mapping[str, Any] | None:
        """The step's raw outputs (on the device) until ``pooler_output`` is built, then None."""
        return self._multimodal_outputs

    def set_host_transfer(self, transfer: HostTransfer) -> None:
        """Hands the device-to-host copy of the multimodal outputs to ``transfer`` (already started)."""
        if self._pooler_output is not None:
            raise RuntimeError("pooler_output is already built")
        self._transfer = transfer

    @property
    def in_flight(self) -> bool:
        """True while an asynchronous host copy of this output has not been waited for."""
        return self._pooler_output is None and self._transfer is not None

    @property
    def pooler_output(self) -> list[dict[str, Any]]:
        if self._pooler_output is None:
            transfer, self._transfer = self._transfer, None
            if transfer is None:
                self._pooler_output = build_pooler_output(self._multimodal_outputs, self.num_reqs)
            else:
                try:  # payloads are copied out of the reused host buffer before it goes back
                    self._pooler_output = build_pooler_output(transfer.wait(), self.num_reqs, copy_tensors=True)
                finally:
                    transfer.release()
            self._multimodal_outputs = None  # release the device tensors
        return self._pooler_output

    def finalize(self) -> OmniModelRunnerOutput:
        """Builds ``pooler_output`` now (waiting for any copy in flight); returns self."""
        self.pooler_output  # noqa: B018
        return self

    def __repr__(self) -> str:
        state = "in flight" if self.in_flight else ("pending" if self._pooler_output is None else "ready")
        return f"OmniModelRunnerOutput(req_ids={self.req_ids}, errors={self.errors}, pooler_output={state})"
