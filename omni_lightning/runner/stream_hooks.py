"""Streaming decode from a LightningModule (``StreamsOnModule``): ``module.stream`` and
``module.streaming_decoder``, whose decoders are retired when the module starts ``fit``.

A stream's state (attention keys and values, convolution tails) was computed with the weights of its
first steps. ``fit`` changes the weights in place, so a stream that went on after it would decode
with neither the old weights nor the new ones. The decoders this module made are therefore retired
at fit's set-up: their streams are closed and any further use raises, saying why, so a server builds
a new decoder (on the tuned weights) instead of emitting wrong audio. Not covered: weights written in
place outside ``fit`` (``load_state_dict`` mid-stream, say) while a stream is open; a decoder built
directly (``StreamingDecoder(model)``) is the caller's to retire.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import torch

from omni_lightning.engine import StreamingDecoder


class StreamsOnModule:
    """The streaming entry points of ``Code2WavModule`` (see the module docstring). The module provides
    ``_refuse_during_fit`` (``EngineOnPredict``)."""

    def _refuse_during_fit(self) -> None: ...

    def streaming_decoder(self, max_streams: int = 64, cuda_graphs: bool = True,
                          gpu_memory_utilization: float | None = None) -> StreamingDecoder:  # fmt: skip
        """A :class:`StreamingDecoder` over this module's model: many streams, one step at a time
        (``gpu_memory_utilization``: its memory budget's share of the GPU, as the Trainer's). Refused
        on another thread while ``trainer.fit`` runs on this module (its weights change at every step)."""
        self._refuse_during_fit()
        decoder = StreamingDecoder(self.model, max_streams=max_streams, cuda_graphs=cuda_graphs and self.fast_path,
                                   gpu_memory_utilization=gpu_memory_utilization)  # fmt: skip
        self._decoders().add(decoder)
        return decoder

    def stream(self, code_chunks: Iterable[torch.Tensor], cuda_graphs: bool = True) -> Iterator[torch.Tensor]:
        """Decodes one request as its code chunks ``[Q, n]`` arrive: yields float32 ``[1, m]`` per chunk.

        The pieces concatenate to ``decode`` of all the frames (a chunk's last samples come with the
        next chunk: the decoder looks one frame ahead); each chunk costs its own frames only. Up to 8
        iterators may interleave. The model's current weights are used (no EMA swap, unlike predict).
        """
        self._refuse_during_fit()
        decoder = getattr(self, "_stream_decoder", None)
        if decoder is None or decoder.retired or decoder.cuda_graphs != cuda_graphs or not decoder.reads(self.model):
            decoder = self._stream_decoder = self.streaming_decoder(max_streams=8, cuda_graphs=cuda_graphs)
        yield from decoder.stream(code_chunks)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            for decoder in list(self._decoders()):
                decoder.retire("its module started trainer.fit, which changes the weights its streams were "
                               "decoded with")  # fmt: skip

    def __getstate__(self) -> dict:
        # a copy or pickle of the module (deepcopy, torch.save, spawn) takes no decoder: weak references
        # cannot be pickled, and a copy's streams are its own (module.stream makes its decoder anew)
        state = dict(super().__getstate__())
        state.pop("_streaming_decoders", None)
        state["_stream_decoder"] = None
        return state

    def _decoders(self) -> weakref.WeakSet:
        if "_streaming_decoders" not in self.__dict__:  # a WeakSet: a decoder the caller dropped is not kept
            self.__dict__["_streaming_decoders"] = weakref.WeakSet()
        return self.__dict__["_streaming_decoders"]
