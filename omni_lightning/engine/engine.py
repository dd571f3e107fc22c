"""``DecodeEngine``: every decode of a ``Code2Wav`` on a device, exact at any length, in a memory budget.

Batch decode, long requests and streaming are one path. Each request (or stream) holds a slot of a
``DecodeState`` pool; a forward advances some slots by a chunk of their frames, carrying their state,
so every request equals its whole decode whatever its length, and no context is ever decoded twice.
The engine owns what makes that fast and safe on a device:
- **kernels**, chosen once (``Kernels.for_inference``: Triton SnakeBeta, in-place residual GEMMs);
- **shapes**: forwards run at ``(rows, chunk)`` buckets chosen by :class:`~omni_lightning.engine.plan.Planner`
  within a frame budget derived from the memory budget (``engine/budget.py``);
- **CUDA graphs**, one per bucket, captured lazily into one pool (``engine/bucket_graphs.py``): short forwards
  (at most ``graph_frames`` padded frames: streaming steps, a batch's last chunks) and, with no memory
  cap, whole-budget ones (~10 ms of host launches each on qwen3-omni). Under a cap they run eagerly
  unless ``whole_graphs``, which halves the frame budget (their pool beside the eager forwards' blocks);
- **memory**: a forward that runs out of memory changes no state (the model commits state last); the
  engine halves its frame budget and plans again, down to one frame, then gives up with the error;
  a capture that fails leaves its bucket eager. The run finishes with every request exact.

Outputs are float32 (``out_dtype``) in storage of their own on the device; a request's first ``tail``
samples (time before its start, ``models/layers.py``) are never emitted.

Threads may share an engine: its public calls run one at a time (``engine/serial.py``). Not done: a
long request's chunks in parallel (each depends on the one before); graphs shared across processes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Hashable, Sequence

import torch

from omni_lightning.engine import budget as budgets
from omni_lightning.engine.bucket_graphs import BoundWeights, GraphCache, GraphCapture
from omni_lightning.engine.cuda_capture import TorchGraphCapture
from omni_lightning.engine.plan import Planner
from omni_lightning.engine.serial import serialized
from omni_lightning.engine.stats import EngineStats
from omni_lightning.engine.work import ForwardInputs, Work, checked_lengths, gather, scatter
from omni_lightning.kernels import Kernels
from omni_lightning.models.code2wav import Code2Wav
from omni_lightning.models.state import DecodeState

log = logging.getLogger(__name__)


class DecodeEngine(EngineStats):
    """Decodes requests and streams of one ``Code2Wav`` on its device (see the module docstring).

    ``frames_per_forward``: the frame budget (rows x chunk) of a forward; default from ``budget``
    (bytes; default :func:`~omni_lightning.engine.budget.budget_bytes` of ``gpu_memory_utilization``).
    ``max_rows``: slots, so requests (or open streams) at once. ``cuda_graphs``: capture buckets on
    CUDA, forwards of up to ``graph_frames`` padded frames, whose pool takes at most ``graph_share`` of
    the budget (``budget.py``; ``graph_frames`` is halved until it does). ``capture`` replaces
    ``torch.cuda.graph`` (tests). ``kernels``: default for the device. ``new_shape_cost``: the
    planner's price of a shape not run yet on CUDA (``plan.py``; a streaming decoder's is higher).
    ``whole_graphs``: whole-budget forwards as CUDA graphs (None: with no cap only, see above).
    Call :meth:`refresh` when the model's weights may have changed place (each predict start).
    """

    def __init__(
        self,
        model: Code2Wav,
        frames_per_forward: int | None = None,
        budget: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_rows: int = 64,
        cuda_graphs: bool = True,
        capture: GraphCapture | None = None,
        kernels: Kernels | None = None,
        out_dtype: torch.dtype = torch.float32,
        graph_frames: int = 512,
        graph_share: float = 0.25,
        new_shape_cost: int = Planner.new_shape_cost,
        whole_graphs: bool | None = None,
    ) -> None:
        if graph_frames < 0:
            raise ValueError(f"graph_frames must be >= 0 (0: no CUDA graphs), got {graph_frames}")
        if not 0 < graph_share <= 1:
            raise ValueError(f"graph_share must be in (0, 1], got {graph_share}")
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.model, self.gpu_memory_utilization = model, gpu_memory_utilization
        self._lock = threading.RLock()  # one call at a time (serialized)
        ref = next(model.parameters())
        self.device, self.dtype = ref.device, ref.dtype
        self.out_dtype = out_dtype
        self.kernels = kernels or Kernels.for_inference(self.device)
        self.max_rows, self.new_shape_cost = max_rows, new_shape_cost
        self.state = DecodeState(model, max_rows + 1)  # the last slot is scratch: padding rows
        self.scratch = max_rows
        self._free = deque(range(max_rows))
        use_graphs = cuda_graphs and (capture is not None or self.device.type == "cuda")
        capture = capture or TorchGraphCapture()
        self.graphs = GraphCache(self._forward, capture, self.device) if use_graphs else None
        self.weights = BoundWeights(model, conv_weights_channels_last=True) if use_graphs else None
        self.graph_frames = graph_frames if use_graphs else 0
        self.whole_graphs = use_graphs and (gpu_memory_utilization is None if whole_graphs is None else whole_graphs)
        if frames_per_forward is None:
            budget = budgets.budget_bytes(self.device, gpu_memory_utilization) if budget is None else budget
            per_frame = budgets.activation_bytes_per_frame(model)
            budgets.check_room(self.device, gpu_memory_utilization, budget, per_frame)  # not one frame: fail now
            if use_graphs:  # the graphs' pool comes out of the budget first (budget.py)
                self.graph_frames = budgets.graph_frames_for_budget(budget, per_frame, graph_frames, graph_share)
                budget -= budgets.graph_pool_bytes(self.graph_frames, per_frame)
                if self.whole_graphs and gpu_memory_utilization is not None:  # the pool's forward beside an eager one
                    budget //= 2
            frames_per_forward = budgets.frames_for_budget(budget, per_frame)
        self.planner = self._planner(frames_per_forward)
        self._up, self._tail = model.config.total_upsample, model.config.tail
        # real frames, padded rows x chunk; shapes first run, and the host time their first forward took
        self.work = {"forwards": 0, "frames": 0, "computed": 0, "new_shapes": 0, "new_shape_s": 0.0, "shrinks": 0}
        self.shapes: set[tuple[int, int]] = set()  # run at the current budget (the planner prefers them)
        self.ever: set[tuple[int, int]] = set()  # run since the engine was built

    def _planner(self, frames: int) -> Planner:
        # with graphs, eager forwards take the whole budget (plan.py: one set of blocks for all)
        # a new shape is slow only on CUDA (a capture, or cuDNN building plans)
        return Planner(
            frames,
            max_rows=self.max_rows,
            graph_frames=min(self.graph_frames, frames),
            exact_eager=self.graph_frames > 0,
            new_shape_cost=0 if self.device.type != "cuda" else self.new_shape_cost,
        )

    @property
    def frames_per_forward(self) -> int:
        return self.planner.frames

    @serialized
    def refresh(self) -> bool:
        """Copies the model's current weights into the tensors the engine reads where they are other
        tensors. If the model changed dtype, device or shape, the engine cannot serve it: returns
        False (build a new one)."""
        ref = next(self.model.parameters())
        if (ref.device, ref.dtype) != (self.device, self.dtype):
            return False
        if self.weights is None and self.graphs is not None:  # closed: graphs captured from now on
            self.weights = BoundWeights(self.model, conv_weights_channels_last=True)
        return self.weights.refresh() if self.weights is not None else True

    @serialized
    def close(self) -> None:
        """Frees the graphs and the weights they hold (their memory goes back to PyTorch's cache)."""
        if self.graphs is not None:
            self.graphs.clear()
        self.weights = None

    # --- slots -----------------------------------------------------------------------------------

    @serialized
    def acquire(self) -> int:
        """A free slot, fresh; ValueError when all ``max_rows`` are in use."""
        if not self._free:
            raise ValueError(
                f"all {self.max_rows} decode slots are in use (by open streams): close some first, "
                "or give the engine more (max_rows)"
            )
        return self._free.popleft()

    @serialized
    def release(self, *slots: int) -> None:
        """Frees ``slots`` (their state zeroed in one pass, so the next user starts fresh)."""
        if slots:
            self.state.reset(slots)
            self._free.extend(slots)

    # --- decoding --------------------------------------------------------------------------------

    @serialized
    def decode(
        self, codes: torch.Tensor, lengths: Sequence[int] | None = None, validate: bool | None = None
    ) -> list[torch.Tensor]:
        """Request ``i``'s waveform ``[1, output_length(lengths[i])]`` of a right-padded batch ``codes [B, Q, T]``
        (``lengths`` None: all ``T``), each equal to its whole decode. Layout and lengths are always checked, code
        values with ``validate`` (None: on the CPU only, where it costs no wait; predict checks its batch there)."""
        queue = deque(enumerate(checked_lengths(codes, lengths, self.model.config, validate)))
        codes = codes.to(self.device, non_blocking=True)
        active: list[tuple[int, Work]] = []
        outs: list[torch.Tensor | None] = [None] * len(queue)
        try:
            while queue or active:
                while queue and (self._free or not active):  # take slots as they free up; none at all: acquire() raises
                    i, n = queue.popleft()
                    active.append((i, self._work(self.acquire(), codes[i, :, :n], fresh=True)))
                self._advance([w for _, w in active], until_one_done=bool(queue), pad_in_time=True)
                done = [a for a in active if a[1].left == 0]
                for i, w in done:
                    outs[i] = w.out
                    active.remove((i, w))
                self.release(*(w.slot for _, w in done))
        finally:
            self.release(*(w.slot for _, w in active))
        return outs

    @serialized
    def advance(self, chunks: dict[Hashable, tuple[int, torch.Tensor, bool]]) -> dict[Hashable, torch.Tensor]:
        """Streaming: ``{key: (slot, codes [Q, n], fresh)}`` advanced by all their frames; returns each
        key's new samples ``[1, m]`` (``m = n * total_upsample``, ``tail`` fewer when ``fresh``). Chunks all
        on the CPU stay there: each forward's inputs reach the device in one copy (``work.gather``)."""
        host = all(codes.device.type == "cpu" for _, codes, _ in chunks.values())
        work = {
            key: self._work(slot, codes if host else codes.to(self.device), fresh)
            for key, (slot, codes, fresh) in chunks.items()
        }
        self._advance(list(work.values()), until_one_done=False, together=True)
        return {key: w.out for key, w in work.items()}

    def _work(self, slot: int, codes: torch.Tensor, fresh: bool) -> Work:
        samples = codes.shape[1] * self._up - (self._tail if fresh else 0)
        w = Work(slot, codes.long() if codes.dtype != torch.long else codes, fresh, max(samples, 0))
        if codes.shape[1] == 0:
            w.out = torch.empty((1, 0), dtype=self.out_dtype, device=self.device)
        return w

    def _advance(
        self, work: list[Work], until_one_done: bool, pad_in_time: bool = False, together: bool = False
    ) -> None:
        """Forwards until every ``work`` is done (or, with ``until_one_done``, one is: a slot frees);
        ``pad_in_time``: see ``Planner.next`` (batch decode; streaming steps are not padded);
        ``together``: see ``work.scatter`` (a streaming step's outputs, copied out in one go)."""
        # graph streams and pools, Triton launches and synchronize() act on the current device: make it
        # the engine's (a DDP rank's GPU is current already; a module moved to cuda:1 by hand may not be)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            while any(w.left for w in work):
                pending = [w for w in work if w.left]
                try:
                    self._forward_planned(pending, pad_in_time, together)
                except torch.OutOfMemoryError as err:
                    if self.planner.frames == 1 and not self.graph_frames:
                        raise budgets.no_room(self.device, self.gpu_memory_utilization, err) from err
                    self._shrink()
                if until_one_done and any(w.left == 0 for w in work):
                    return

    def _shrink(self) -> None:
        """Halves the frame budget; drops the graphs (their pool holds memory the smaller forwards need).
        At one frame per forward, it drops CUDA graphs for good: every forward runs eagerly from then on."""
        frames = self.planner.frames
        self.work["shrinks"] += 1
        if frames == 1:
            self.graph_frames = 0
        self.planner = self._planner(max(1, frames // 2))
        self.shapes.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing in flight reads what is freed next
        if self.graphs is not None:
            self.graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        eager = "" if self.graph_frames else ", eager (no CUDA graphs)"
        log.warning("decode: out of memory at %d frames per forward; now %d%s", frames, self.planner.frames, eager)

    def _forward_planned(self, pending: list[Work], pad_in_time: bool, together: bool = False) -> None:
        plan = self.planner.next([w.left for w in pending], self.shapes, pad_in_time, whole=together)
        rows, chunk = plan.shape
        new = plan.shape not in self.ever
        self.shapes.add(plan.shape)
        self.ever.add(plan.shape)
        picked = [pending[i] for i in plan.requests]
        self.work["forwards"] += 1
        self.work["frames"] += sum(plan.take)
        self.work["computed"] += rows * chunk
        slot_ids = [w.slot for w in picked] + [self.scratch] * (rows - len(picked))  # padding: the scratch slot
        inputs = gather(picked, plan.take, rows, chunk, slot_ids, self.device)
        start = time.perf_counter() if new else 0.0
        out = self._run(inputs)
        if new:  # host time: a new shape's cost is the host's (cuDNN plans, a capture), not the device's
            self.work["new_shapes"] += 1
            self.work["new_shape_s"] += time.perf_counter() - start
        scatter(out, picked, plan.take, self._up, self._tail, self.out_dtype, together)

    def _run(self, inputs: ForwardInputs) -> torch.Tensor:
        with torch.no_grad():
            frames = inputs.rows * inputs.chunk
            short = frames <= self.graph_frames
            graphed = short or (self.whole_graphs and self.graph_frames > 0 and frames == self.planner.frames)
            if graphed:
                self.graphs.follow_autocast(self.device)
            if short and not self.graphs.graphs and not self.graphs.eager:  # largest first: see GraphCache
                rows, limit = inputs.rows, min(self.planner.frames, self.graph_frames)
                self.graphs.capture_largest_first(
                    inputs, self.scratch, max(c for c in self.planner.chunks if c * rows <= limit)
                )
            graph = self.graphs.get(inputs, self.scratch) if graphed else None
            if graph is None:
                if self.graphs is not None:
                    self.graphs.stats.eager += 1
                return self._forward(*inputs.to(self.device).views())
            return self.graphs.run(graph, inputs)

    def _forward(self, codes: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        if self.weights is not None:  # the tensors the graphs read, wherever the parameters are
            return self.weights.call(codes, self.state.select(slots, valid), self.kernels)
        return self.model(codes, self.state.select(slots, valid), self.kernels)
