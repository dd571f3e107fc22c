"""The peers' streaming, the baseline ``bench_stream.py`` compares with: each chunk decoded again with
left context (vLLM-Omni: 25 frames; sglang-omni: 10-frame chunks, 25 of context), eagerly or replayed
from a CUDA graph per shape (vLLM-Omni's wrapper). Not exact: a too-short context changes the audio.
"""

from __future__ import annotations

import torch

from omni_lightning import Code2Wav
from omni_lightning.kernels import Kernels


class Redecode:
    """The peers' streaming: each chunk decoded again with up to ``context`` frames before it.

    Stitched without gaps (as ``Code2Wav.chunked_decode``: a chunk also re-emits the previous chunk's
    look-ahead tail), so its output has the streaming decoder's length. With ``graphs``, each
    ``(batch, frames)`` shape is captured once as a CUDA graph and replayed (vLLM-Omni's wrapper).
    """

    def __init__(self, model: Code2Wav, context: int, graphs: bool) -> None:
        self.model, self.context, self.graphs = model, context, graphs
        self.kernels = Kernels.for_inference(next(model.parameters()).device)  # the engine's kernels
        self._graphs: dict[tuple, tuple] = {}

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if not (self.graphs and codes.is_cuda):
            return self.model(codes, kernels=self.kernels)
        key = tuple(codes.shape)
        if key not in self._graphs:
            static = codes.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model(static, kernels=self.kernels)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.model(static, kernels=self.kernels)
            self._graphs[key] = (graph, static, out)
        graph, static, out = self._graphs[key]
        static.copy_(codes)
        graph.replay()
        return out

    def chunk(self, codes: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Samples for frames ``[start, end)`` of ``codes [B, Q, T]`` (from the last emitted sample)."""
        up, tail = self.model.config.total_upsample, self.model.config.tail
        context = min(self.context, start)
        wav = self.forward(codes[..., start - context : end])
        return wav[..., context * up - (tail if start else 0) :].clone()
