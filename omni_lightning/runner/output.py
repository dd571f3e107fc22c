"""What one predict step returns: vLLM-Omni's ``OmniModelRunnerOutput``, built, copied to the host and
finalized here.

A non-autoregressive stage samples nothing, so ``sampled_token_ids`` holds one empty list per request
and ``logprobs`` is None; the product is ``pooler_output``, one dict per request split from the step's
multimodal outputs by :func:`build_pooler_output`.

Lifecycle: :func:`runner_output` builds one from a batch; :meth:`OmniModelRunnerOutput.start_host_copy`
may start an asynchronous copy of its device tensors into a pooled host buffer; ``finalize()`` (or the
first read of ``pooler_output``) waits for that copy, splits the payloads out of the buffer and gives
the buffer back. ``AsyncD2HCallback`` starts the copy (CUDA only); ``OmniPredictionLoop`` finalizes
the output one step later.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

_ALIGN = 256  # bytes: every tensor in a host buffer starts aligned for any dtype and for fast DMA


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
    """The mark of a multimodal output: a dict a ``predict_step`` returns to get runner semantics.

    ``OmniPredictionLoop`` turns a ``MultimodalOutputs``, and nothing else, into an
    :class:`OmniModelRunnerOutput`. A plain dict is never taken for one, whatever its keys.
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
    look self-owned (host tensors in a reused buffer).
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


def runner_output(
    batch: Any, multimodal_outputs: Mapping[str, Any], batch_idx: int = 0, dataloader_idx: int = 0
) -> OmniModelRunnerOutput:
    """The runner output of one step over ``batch``: request ids from the batch's ``"req_ids"`` and the
    requests it could not run from its ``"errors"``; a batch without ids (a bare tensor) gets
    ``"<batch_idx>-<i>"`` (``"<dataloader_idx>-<batch_idx>-<i>"`` past the first dataloader)."""
    if isinstance(batch, Mapping) and "req_ids" in batch:
        req_ids = list(batch["req_ids"])
    else:
        name = f"{batch_idx}" if dataloader_idx == 0 else f"{dataloader_idx}-{batch_idx}"
        req_ids = [f"{name}-{i}" for i in range(_count_requests(multimodal_outputs))]
    errors = batch.get("errors", {}) if isinstance(batch, Mapping) else {}
    return OmniModelRunnerOutput(req_ids, multimodal_outputs=multimodal_outputs, errors=errors)


def _count_requests(multimodal_outputs: Mapping[str, Any]) -> int:
    for value in multimodal_outputs.values():
        if isinstance(value, (list, tuple)):
            return len(value)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError("cannot tell the number of requests: the batch has no 'req_ids' and no output is per request")


class Event(Protocol):
    """What a host copy needs of an event; ``torch.cuda.Event`` is one."""

    def synchronize(self) -> None: ...


class Stream(Protocol):
    """What a host copy needs of a stream; ``torch.cuda.Stream`` is one."""

    def wait_stream(self, stream: Any) -> None: ...

    def record_event(self) -> Event: ...


class Copies(Protocol):
    """The device primitives behind an asynchronous host copy (``async_d2h.CudaCopies`` on CUDA)."""

    def new_stream(self, device: torch.device) -> Stream: ...

    def current_stream(self, device: torch.device) -> Stream: ...

    def is_device_tensor(self, t: torch.Tensor) -> bool: ...

    def copy(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], stream: Stream) -> None:
        """Enqueues ``dst.copy_(src)`` for each (dst, src) on ``stream`` and returns at once."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer ``uint8[nbytes]`` the copies can target asynchronously."""


class BufferPool(Protocol):
    """Where a host copy takes its buffer and gives it back (``async_d2h.PinnedPool``)."""

    def acquire(self, nbytes: int) -> torch.Tensor: ...

    def release(self, buffer: torch.Tensor) -> None: ...


def _device_leaves(value: Any, is_device: Callable[[torch.Tensor], bool], out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if is_device(value):
            out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _device_leaves(v, is_device, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _device_leaves(v, is_device, out)


class OmniModelRunnerOutput:
    """One predict step's output, per request: ids, no sampled tokens, no logprobs, ``pooler_output``.

    ``pooler_output`` is built when first read (or by ``finalize()``), from the step's multimodal
    outputs or from their host copy once it landed. ``errors`` maps the ids of requests of this batch
    that were not run to the reason (bad input). Built by :func:`runner_output`.
    """

    _STATE = ("_pooler_output", "_multimodal_outputs", "_copy")  # built payloads, raw outputs, a copy in flight
    __slots__ = ("req_ids", "req_id_to_index", "sampled_token_ids", "logprobs", "errors", *_STATE)

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
        if pooler_output is None and multimodal_outputs is None:
            raise ValueError("give pooler_output or multimodal_outputs")
        self.req_id_to_index = {r: i for i, r in enumerate(self.req_ids)}
        self.sampled_token_ids: list[list[int]] = [[] for _ in self.req_ids]
        self.logprobs = None
        self.errors = dict(errors or {})
        self._pooler_output = pooler_output
        self._multimodal_outputs = multimodal_outputs
        self._copy: _HostCopy | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def multimodal_outputs(self) -> Mapping[str, Any] | None:
        """The step's raw outputs (on the device) until ``pooler_output`` is built, then None."""
        return self._multimodal_outputs

    @property
    def in_flight(self) -> bool:
        """True while a host copy of this output has not been waited for."""
        return self._copy is not None

    def start_host_copy(self, stream: Stream, pool: BufferPool, copies: Copies) -> bool:
        """Enqueues the copy of every device tensor of the multimodal outputs into one buffer from ``pool``
        on ``stream``, after the work already queued on their device; returns at once. Returns False,
        starting nothing, when the output is built or copying already, or holds no device tensor."""
        if self._pooler_output is not None or self._copy is not None:
            return False
        leaves: list[torch.Tensor] = []
        _device_leaves(self._multimodal_outputs, copies.is_device_tensor, leaves)
        if not leaves:
            return False
        self._copy = _HostCopy(leaves, stream, pool, copies)
        return True

    @property
    def pooler_output(self) -> list[dict[str, Any]]:
        if self._pooler_output is None:
            host_copy, self._copy = self._copy, None
            if host_copy is None:
                self._pooler_output = build_pooler_output(self._multimodal_outputs, self.num_reqs)
            else:
                try:  # payloads are copied out of the pooled buffer before it goes back
                    host = host_copy.wait(self._multimodal_outputs)
                    self._pooler_output = build_pooler_output(host, self.num_reqs, copy_tensors=True)
                finally:
                    host_copy.release()
            self._multimodal_outputs = None  # the device tensors may go now
        return self._pooler_output

    def finalize(self) -> OmniModelRunnerOutput:
        """Builds ``pooler_output`` now (waiting for a copy in flight); returns self."""
        self.pooler_output  # noqa: B018
        return self

    def __repr__(self) -> str:
        state = "in flight" if self.in_flight else ("pending" if self._pooler_output is None else "ready")
        return f"OmniModelRunnerOutput(req_ids={self.req_ids}, errors={self.errors}, pooler_output={state})"


class _HostCopy:
    """Device tensors copied into one pooled host buffer on ``stream``, an event recorded after them.
    The output keeps the device tensors alive until ``wait``: the allocator cannot hand their memory to
    the next step while the copy still reads it."""

    def __init__(self, leaves: list[torch.Tensor], stream: Stream, pool: BufferPool, copies: Copies) -> None:
        offsets, total = [], 0
        for t in leaves:
            offsets.append(total)
            total += -(-t.nbytes // _ALIGN) * _ALIGN
        self._pool = pool
        self._buffer: torch.Tensor | None = pool.acquire(total)
        self._host: dict[int, torch.Tensor] = {}
        pairs = []
        for t, offset in zip(leaves, offsets):
            dst = self._buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            pairs.append((dst, t))
            self._host[id(t)] = dst
        stream.wait_stream(copies.current_stream(leaves[0].device))
        copies.copy(pairs, stream)
        self._event = stream.record_event()

    def wait(self, outputs: Mapping[str, Any]) -> Mapping[str, Any]:
        """``outputs`` with each copied tensor replaced by its host copy, once the copy landed."""
        self._event.synchronize()

        def swap(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return self._host.get(id(value), value)
            if isinstance(value, Mapping):
                return {k: swap(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(swap(v) for v in value)
            return value

        return swap(outputs)

    def release(self) -> None:
        """Gives the buffer back to the pool (its contents were copied out, or are dropped)."""
        if self._buffer is not None:
            self._host.clear()
            self._pool.release(self._buffer)
            self._buffer = None
