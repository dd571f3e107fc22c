"""``StreamingDecoder``: many streams of codec frames decoded chunk by chunk, each exactly as ``decode``.

A stream holds one slot of a :class:`~omni_lightning.engine.engine.DecodeEngine` (its per-layer
state); a step hands every stream's pending frames to the engine at once (``DecodeEngine.advance``:
the planner, CUDA graphs and memory budget of batch decode). After ``n`` frames a stream has emitted
``output_length(n)`` samples: the one-frame look-ahead is carried as state, so nothing is held back
or decoded twice. A step whose forward raises marks its streams failed (their state is unknown);
``retire`` ends every stream when the weights are about to change. Calls from several threads run
one at a time (``engine/serial.py``).

Not done: re-reading parameters replaced rather than updated in place (``model.to(...)``: build a new
decoder; ``reads`` tells), or seeing weights written in place while a stream is open outside ``fit``.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from omni_lightning.engine.bucket_graphs import GraphCapture
from omni_lightning.engine.engine import DecodeEngine
from omni_lightning.engine.serial import serialized
from omni_lightning.errors import check_count, check_sizes
from omni_lightning.models.code2wav import Code2Wav
from omni_lightning.models.codes import all_codes, check_request_codes

STEP_FRAMES = 16  # frames per stream a full step may push and still replay a CUDA graph (default budget)
NEW_SHAPE_COST = 1024  # a step that captures a new shape waits for it: streams keep to the shapes they have


@dataclass
class _Stream:
    slot: int
    frames: int = 0  # frames decoded so far
    pending: list[torch.Tensor] = field(default_factory=list)
    failed: str | None = None  # why a step left this stream's state unusable


class StreamingDecoder:
    """Decodes many streams at once (see the module docstring).

    ``open()`` a stream, ``push(stream, codes[Q, n])`` its frames as they arrive (any ``n``, one frame
    too), ``step()`` advances every stream with pushed frames, returning each one's new samples ``[1, m]``
    (float32, on the model's device); ``close(stream)`` frees its slot. ``step({stream: codes})`` pushes
    and steps. Bad input (codes out of range, the wrong number of codebooks, a non-integer dtype, a
    chunk for a closed or unknown stream) raises ``ValueError`` naming the stream, before anything of
    any stream changes. Codes on a GPU are range-checked there (one sync a call: bad codes must never
    reach an embedding lookup). ``engine``: the engine to run on (default: a new one over ``model``
    with ``max_streams`` slots; ``cuda_graphs``, ``frames_per_forward``, ``gpu_memory_utilization``
    (its budget's share of the GPU) and ``capture`` go to it). A stream holds ``state_bytes_per_stream``.
    """

    def __init__(
        self,
        model: Code2Wav,
        max_streams: int = 64,
        cuda_graphs: bool = True,
        frames_per_forward: int | None = None,
        engine: DecodeEngine | None = None,
        gpu_memory_utilization: float | None = None,
        capture: GraphCapture | None = None,
        step_frames: int = STEP_FRAMES,
    ) -> None:
        check_count("max_streams", max_streams)
        check_count("step_frames", step_frames)
        check_count("frames_per_forward", frames_per_forward, none_ok=True)  # None: from the memory budget
        self.model, self.config = model, model.config
        # a step of up to step_frames frames per stream replays a CUDA graph; graphs take most of the budget
        self.engine = engine or DecodeEngine(
            model,
            frames_per_forward=frames_per_forward,
            max_rows=max_streams,
            cuda_graphs=cuda_graphs,
            graph_frames=max(512, max_streams * step_frames),
            graph_share=0.75,
            gpu_memory_utilization=gpu_memory_utilization,
            capture=capture,
            new_shape_cost=NEW_SHAPE_COST,
        )
        self.max_streams, self.cuda_graphs = self.engine.max_rows, cuda_graphs
        ref = next(model.parameters())
        self._param = (ref.data_ptr(), ref.dtype)
        self._streams: dict[Hashable, _Stream] = {}
        self._closed: OrderedDict[Hashable, None] = OrderedDict()  # recent ids, for clear messages
        self._next_id = 0
        self.retired: str | None = None  # why this decoder serves no more streams (see ``retire``)
        self._lock = threading.RLock()  # one call at a time (serialized)

    @property
    def streams(self) -> list[Hashable]:
        """Ids of the open streams."""
        return list(self._streams)

    @property
    def state_bytes_per_stream(self) -> int:
        """Bytes of state one stream holds, whatever its length."""
        return self.engine.state.bytes_per_slot

    def reads(self, model: Code2Wav) -> bool:
        """Whether this decoder runs ``model``'s current parameters (not moved or cast since)."""
        ref = next(model.parameters())
        return model is self.model and (ref.data_ptr(), ref.dtype) == self._param

    def frames(self, stream_id: Hashable) -> int:
        """Frames of ``stream_id`` decoded so far (pushed but not stepped frames not counted)."""
        return self._get(stream_id).frames

    @serialized
    def retire(self, reason: str) -> None:
        """Closes every stream and refuses any later use, giving ``reason``."""
        for sid in list(self._streams):
            self._release(sid)
        self.retired = reason

    @serialized
    def open(self, stream_id: Hashable | None = None) -> Hashable:
        """Starts a stream in a free slot; returns its id (``stream_id``, or a new integer)."""
        self._check_serving()
        if stream_id is None:
            while self._next_id in self._streams:
                self._next_id += 1
            stream_id, self._next_id = self._next_id, self._next_id + 1
        else:
            _check_hashable(stream_id)
            if stream_id in self._streams:
                raise ValueError(f"stream {stream_id!r} is already open")
        try:
            slot = self.engine.acquire()
        except ValueError:
            raise ValueError(
                f"cannot open a stream: all {self.max_streams} stream slots of this decoder are in use; "
                "close a stream (or finish an iterator) first, or use a decoder with a larger "
                "max_streams (module.streaming_decoder(max_streams=...))"
            ) from None
        self._closed.pop(stream_id, None)
        self._streams[stream_id] = _Stream(slot)
        return stream_id

    @serialized
    def push(self, stream_id: Hashable, codes: torch.Tensor) -> None:
        """Queues ``codes [Q, n]`` (any integer dtype, any device; ``n`` may be 0) for the next step."""
        stream = self._get(stream_id)
        stream.pending.append(self._checked_all({stream_id: (stream, codes)})[stream_id])

    @serialized
    def step(self, chunks: Mapping[Hashable, torch.Tensor] | None = None) -> dict[Hashable, torch.Tensor]:
        """Pushes ``chunks`` (all checked before any is queued), then advances every stream with
        pushed frames; returns ``{stream: samples [1, m]}`` for those streams."""
        if chunks is not None and not isinstance(chunks, Mapping):
            raise ValueError(
                f"step() takes a mapping {{stream id: codes [codebooks, frames]}} (or nothing), got "
                f"{type(chunks).__name__}; push(stream, codes) queues one stream's chunk"
            )
        self._check_serving()
        if chunks:
            checked = self._checked_all({sid: (self._get(sid), codes) for sid, codes in chunks.items()})
            for sid, codes in checked.items():
                self._streams[sid].pending.append(codes)
        return self._decode([sid for sid, s in self._streams.items() if s.pending])

    @serialized
    def close(self, stream_id: Hashable) -> torch.Tensor:
        """Ends a stream: decodes its pushed frames, frees its slot, returns their samples ``[1, m]``
        (``[1, 0]`` with nothing pushed since the last step: nothing is held back)."""
        stream = self._get(stream_id, usable=False)
        try:
            usable = stream.failed is None and self.retired is None
            rest = self._decode([stream_id])[stream_id] if stream.pending and usable else self._empty()
        finally:
            self._release(stream_id)
        return rest

    def stream(self, code_chunks: Iterable[torch.Tensor], stream_id: Hashable | None = None) -> Iterator[torch.Tensor]:
        """Decodes one stream: yields ``[1, m]`` per chunk of ``code_chunks``; closes it at the end
        (also when the iteration stops early or a chunk is bad). Other streams are not advanced."""
        if isinstance(code_chunks, torch.Tensor) and code_chunks.dim() < 3:  # its rows are no chunks
            shape = tuple(code_chunks.shape)
            raise ValueError(f"code_chunks must be chunks [codebooks, frames], got one tensor {shape}: pass [codes]")
        with self._lock:  # no retire on another thread between the two
            sid = self.open(stream_id)
            own = self._streams[sid]  # an id closed and opened again belongs to another stream
        try:
            for codes in code_chunks:
                yield self._own_step(sid, own, codes)
        finally:
            with self._lock:
                if self._streams.get(sid) is own:
                    self._release(sid)

    @serialized
    def _own_step(self, sid: Hashable, own: _Stream, codes: torch.Tensor) -> torch.Tensor:
        """``stream``'s chunk: pushed and decoded in one call (no other thread's step takes it)."""
        if self._streams.get(sid) is not own:
            self._get(sid)  # raises: closed, or retired
            raise ValueError(f"stream {sid!r} was closed and its id taken by another stream")
        self.push(sid, codes)
        return self._decode([sid])[sid]

    @serialized
    def warmup(self, chunk_sizes: Iterable[int] = (1,), batch_sizes: Iterable[int] = (1,)) -> float:
        """Runs (and on CUDA captures) now, on scratch streams, the forwards of a step of ``b`` streams of ``c``
        frames, for each pair, as a warm engine plans them (not around the shapes run so far); returns seconds."""
        chunk_sizes, batch_sizes = check_sizes("chunk_sizes", chunk_sizes), check_sizes("batch_sizes", batch_sizes)
        start, engine, planner, sids = time.perf_counter(), self.engine, self.engine.planner, []
        engine.planner = replace(planner, new_shape_cost=0)
        try:
            for b, c in itertools.product(batch_sizes, chunk_sizes):
                list(map(self._release, sids))
                sids = [self.open() for _ in range(min(b, self.max_streams - len(self._streams)))]
                codes = torch.zeros((self.config.num_quantizers, c), dtype=torch.long)
                for sid in sids:  # its own streams only: other streams' pushed frames stay queued
                    self._streams[sid].pending.append(codes)
                self._decode(sids)
        finally:  # (an out-of-memory shrink replaced the planner: its budget is kept)
            list(map(self._release, sids))
            engine.planner = replace(engine.planner, new_shape_cost=planner.new_shape_cost)
        return time.perf_counter() - start

    def _decode(self, sids: list[Hashable]) -> dict[Hashable, torch.Tensor]:
        chunks = {}
        for sid in sids:
            s = self._streams[sid]
            codes = s.pending[0] if len(s.pending) == 1 else torch.cat(s.pending, dim=1)
            s.pending = []
            if codes.shape[1]:
                chunks[sid] = (s.slot, codes, s.frames == 0)
        try:
            out = self.engine.advance(chunks) if chunks else {}
        except BaseException as err:  # some forwards of the step may have committed: the states are unknown
            for sid in chunks:
                self._streams[sid].failed = f"{type(err).__name__}: {err}"
            raise
        for sid, (_, codes, _) in chunks.items():
            self._streams[sid].frames += codes.shape[1]
        return {sid: out[sid] if sid in out else self._empty() for sid in sids}

    def _empty(self) -> torch.Tensor:
        return torch.empty((1, 0), dtype=self.engine.out_dtype, device=self.engine.device)

    def _get(self, stream_id: Hashable, usable: bool = True) -> _Stream:
        _check_hashable(stream_id)
        stream = self._streams.get(stream_id)
        if stream is None:
            self._check_serving()
            if stream_id in self._closed:
                why = "a chunk after close() needs a new stream" if usable else "close() it once"
                raise ValueError(f"stream {stream_id!r} is closed already: {why}")
            raise ValueError(f"unknown stream {stream_id!r}: open() it first")
        if usable and stream.failed is not None:
            raise ValueError(
                f"stream {stream_id!r} failed in an earlier step ({stream.failed}), which may have "
                "advanced part of its state: close() it and decode the request again in a new stream"
            )
        return stream

    def _check_serving(self) -> None:
        if self.retired is not None:
            raise ValueError(
                f"this streaming decoder was retired: {self.retired}; its streams were closed. "
                "Build a new decoder (module.streaming_decoder()) for the current weights"
            )

    def _release(self, stream_id: Hashable) -> None:
        if (stream := self._streams.pop(stream_id, None)) is None:
            return
        self.engine.release(stream.slot)
        self._closed[stream_id] = None
        while len(self._closed) > 4096:
            self._closed.popitem(last=False)

    def _checked_all(self, chunks: dict[Hashable, tuple[_Stream, torch.Tensor]]) -> dict[Hashable, torch.Tensor]:
        """Each stream's ``codes`` as int64 ``[Q, n]`` after ``decode``'s checks, all values in one pass (one
        sync on a GPU); where any fails, chunk by chunk: the first bad one raises, named at its frame."""
        out: dict[Hashable, torch.Tensor] = {}
        with contextlib.suppress(ValueError):  # a bad layout: named below
            out = {sid: check_request_codes(c, self.config, "", False, 0) for sid, (_, c) in chunks.items()}
            if all_codes(list(out.values()), self.config):
                return out
        for sid, (stream, codes) in chunks.items():
            first, who = stream.frames + sum(p.shape[1] for p in stream.pending), f"stream {sid!r}"
            out[sid] = check_request_codes(codes, self.config, who, chunk_from=first)
        return out


def _check_hashable(stream_id: Hashable) -> None:
    try:
        hash(stream_id)
    except TypeError:
        raise ValueError(f"stream ids must be hashable, got {type(stream_id).__name__}") from None
