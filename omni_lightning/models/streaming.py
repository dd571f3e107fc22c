"""Stateful streaming decode: a request's codec frames in chunks of any sizes, exact audio out.

``StreamingDecoder`` runs a ``Code2Wav``'s own weights (no copy) one chunk at a time and keeps,
per stream, the state each layer needs to continue where it stopped:

- each attention layer's keys (after RoPE, at absolute positions) and values of the last
  ``sliding_window - 1`` frames;
- each causal convolution's last ``(kernel - 1) * dilation`` input samples;
- each decoder block's transposed convolution's last input sample (its one-sample look-ahead).

After ``n`` frames have arrived the first ``output_length(n)`` samples of ``decode`` of the whole
request are final (every layer is causal but the transposed convolutions, whose look-ahead the model
trims away), so a call that brings the stream to ``n`` frames emits exactly the samples
``[output_length(n_before), output_length(n))``. The concatenation over a stream equals ``decode``
of all its frames, and closing a stream emits nothing more: the look-ahead tail (555 samples on
Qwen3-Omni) is not part of ``decode``'s output either. A call costs its new frames plus the
state, never a re-decode of context.

How a step is computed (one function, ``_advance``, for CPU, eager CUDA and CUDA graphs):

- **Many streams, one batch.** States live in preallocated slots (``max_streams`` plus one
  scratch slot for batch padding); a step gathers the batch's slots, runs the layers, and writes
  the new states back. Streams never share a row, so no stream affects another's samples.
- **Chunks of different sizes** in one step are grouped by size and each group runs as one batch
  (in turn, in the same call): a group has uniform shapes, so nothing is padded in time and a CUDA
  graph per ``(batch bucket, chunk)`` covers it. On CUDA, chunks longer than ``max_graph_frames``
  are split into pieces (streaming is exact for any split).
- **A stream's first chunk has the same shapes as any other.** A fresh stream's transposed
  convolutions see a zero "previous sample", so the first ``J`` samples after each of them are
  junk (``J = (J_before + 1) * rate``, summing to ``tail`` at the output); they are zeroed where
  they enter a causal convolution, which is exactly the zero padding ``decode`` gives the start
  of a request, and the first ``tail`` output samples are dropped. So new and running streams
  share a batch and a graph.
- **Decoder layout.** The decoder blocks run channels-last (``[batch, time, channels]``): causal
  and transposed convolutions as cuDNN channels-last convolutions with the state prepended in
  the same buffer (no concatenation pass), each conv bias folded into the SnakeBeta that follows
  it (one fused Triton pass on CUDA that also writes the state buffer and zeroes the junk), and
  each residual unit's 1x1 convolution plus its residual add as one in-place GEMM. The biases
  skipped by the GEMMs are carried forward and added by the next SnakeBeta.

Not done, and why: no padding of chunks in time (grouping by size keeps every row exact without
per-stream gathers of every layer's state at a ragged end); no thread safety (one decoder serves
one scheduling loop, as a server's step loop); no re-reading of parameters that were replaced
rather than updated in place (``model.to(...)`` after building the decoder: build a new one).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from omni_lightning.models import fused
from omni_lightning.models.code2wav import Code2Wav
from omni_lightning.models.layers import rotate_half

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    slot: int
    frames: int = 0  # frames decoded so far
    pending: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Snake:
    """One SnakeBeta application: its module and the fp32 vectors the fused pass reads."""

    module: torch.nn.Module
    biases: list[torch.Tensor]  # conv biases not yet added to the input (summed into `bias`)
    alpha: torch.Tensor | None = None
    inv_beta: torch.Tensor | None = None
    bias: torch.Tensor | None = None


class StreamingDecoder:
    """Decodes many streams of codec frames chunk by chunk, each exactly as ``Code2Wav.decode``.

    ``open()`` a stream, ``push(stream, codes[Q, n])`` its frames as they arrive (any ``n``, the
    first chunk may be a single frame), and ``step()`` advances every stream with pushed frames at
    once, returning each one's new samples ``[1, m]`` (model dtype, on the model's device);
    ``close(stream)`` frees its slot. ``step({stream: codes, ...})`` pushes and steps in one call.

    Bad input (codes out of range, the wrong number of codebooks, a non-integer dtype, a chunk for a
    closed or unknown stream) raises ``ValueError`` naming the stream, before anything of any stream
    changes; other streams are untouched and continue with the next call.

    ``cuda_graphs`` (on CUDA): each ``(batch bucket, chunk)`` shape is captured once as a CUDA graph
    (lazily, or up front with ``warmup``) and replayed; batches are padded with the scratch slot to
    a power-of-two bucket. Off, or on the CPU, the same computation runs eagerly.

    The decoder reads the model's parameters in place: fine-tuning steps and EMA swaps (in-place
    updates) are seen by the next step; a model moved or cast after construction is not (build a
    new decoder). Each stream holds ``state_bytes_per_stream`` bytes, whatever its length.

    Not done, and why: chunks of different sizes are not padded into one batch (each size runs as
    its own batch, so no row computes padding and every state is read at its true end); graphs
    are per exact chunk size up to ``max_graph_frames`` (longer chunks are split, which is exact)
    and at most ``max_graphs`` of them (other shapes run eagerly), so capture memory stays bounded;
    codes on the GPU are range-checked there (one synchronization per chunk: bad codes must never
    reach an embedding lookup); no thread safety (one scheduling loop drives a decoder).
    """

    def __init__(
        self,
        model: Code2Wav,
        max_streams: int = 64,
        cuda_graphs: bool = True,
        max_graph_frames: int = 32,
        max_graphs: int = 32,
    ) -> None:
        if max_streams < 1 or max_graph_frames < 1:
            raise ValueError("max_streams and max_graph_frames must be >= 1")
        self.model = model
        self.config = model.config
        ref = next(model.parameters())
        self.device, self.dtype = ref.device, ref.dtype
        self.max_streams = max_streams
        self.cuda_graphs = cuda_graphs
        self.max_graph_frames = max_graph_frames
        self.max_graphs = max_graphs
        self.scratch = max_streams  # slot that padded batch rows read and write
        self._param_ptr = ref.data_ptr()
        self._build_plan()
        self._pool = self._allocate_state()
        self._streams: dict[Hashable, _Stream] = {}
        self._free = deque(range(max_streams))
        self._closed: OrderedDict[Hashable, None] = OrderedDict()  # recent ids, for clear messages
        self._next_id = 0
        self._graphs: dict[tuple[int, int], _StepGraph] = {}
        self._graph_pool = None
        self._versions: tuple[int, ...] | None = None

    # --- streams ---------------------------------------------------------------------------------

    @property
    def streams(self) -> list[Hashable]:
        """Ids of the open streams."""
        return list(self._streams)

    def frames(self, stream_id: Hashable) -> int:
        """Frames of ``stream_id`` decoded so far (pushed but not stepped frames not counted)."""
        return self._get(stream_id).frames

    def open(self, stream_id: Hashable | None = None) -> Hashable:
        """Starts a stream in a free slot; returns its id (``stream_id``, or a new integer)."""
        if stream_id is None:
            while self._next_id in self._streams:
                self._next_id += 1
            stream_id = self._next_id
            self._next_id += 1
        else:
            _check_hashable(stream_id)
            if stream_id in self._streams:
                raise ValueError(f"stream {stream_id!r} is already open")
        if not self._free:
            raise ValueError(f"cannot open stream {stream_id!r}: all {self.max_streams} stream slots are in use; "
                             "close a stream or build the decoder with a larger max_streams")  # fmt: skip
        self._closed.pop(stream_id, None)
        self._streams[stream_id] = _Stream(self._free.popleft())
        return stream_id

    def push(self, stream_id: Hashable, codes: torch.Tensor) -> None:
        """Queues ``codes [Q, n]`` (any integer dtype, any device; ``n`` may be 0) for the next step.

        Raises ``ValueError`` naming the stream when the chunk is bad; nothing is queued then.
        """
        stream = self._get(stream_id)
        stream.pending.append(self._checked(stream_id, stream, codes))

    def step(self, chunks: Mapping[Hashable, torch.Tensor] | None = None) -> dict[Hashable, torch.Tensor]:
        """Pushes ``chunks`` (all checked before any is queued), then advances every stream with
        pushed frames; returns ``{stream: samples [1, m]}`` for those streams, ``m`` being
        ``output_length(frames after) - output_length(frames before)``.
        """
        if chunks:
            checked = {sid: self._checked(sid, self._get(sid), codes) for sid, codes in chunks.items()}
            for sid, codes in checked.items():
                self._streams[sid].pending.append(codes)
        return self._decode({sid: s for sid, s in self._streams.items() if s.pending})

    def close(self, stream_id: Hashable) -> torch.Tensor:
        """Ends a stream: decodes its pushed frames, frees its slot, returns their samples ``[1, m]``.

        With nothing pushed since the last step that is ``[1, 0]``: after ``n`` frames a stream has
        emitted all ``output_length(n)`` samples ``decode`` gives; the transposed convolutions'
        look-ahead tail is not part of ``decode``'s output, so there is nothing left to flush.
        """
        stream = self._get(stream_id)
        rest = self._decode({stream_id: stream})[stream_id] if stream.pending else None
        self._release(stream_id)
        return rest if rest is not None else torch.empty((1, 0), dtype=self.dtype, device=self.device)

    def stream(self, code_chunks: Iterable[torch.Tensor], stream_id: Hashable | None = None) -> Iterator[torch.Tensor]:
        """Decodes one stream: yields ``[1, m]`` per chunk of ``code_chunks``; closes it at the end.

        Other streams of this decoder are not advanced by it. The stream is closed (and its slot
        freed) also when the iteration stops early or a chunk is bad.
        """
        sid = self.open(stream_id)
        try:
            for codes in code_chunks:
                stream = self._get(sid)
                stream.pending.append(self._checked(sid, stream, codes))
                yield self._decode({sid: stream})[sid]
        finally:
            self._release(sid)

    def warmup(self, chunk_sizes: Iterable[int] = (1,), batch_sizes: Iterable[int] = (1,)) -> float:
        """Captures the CUDA graphs of these shapes now (valid codes, scratch slot); returns seconds.

        Does nothing on the CPU or with ``cuda_graphs`` off.
        """
        start = time.perf_counter()
        self._refresh_snakes()
        for c in chunk_sizes:
            for b in batch_sizes:
                self._graph_for(min(b, self.max_streams), min(c, self.max_graph_frames))
        return time.perf_counter() - start

    def _get(self, stream_id: Hashable) -> _Stream:
        _check_hashable(stream_id)
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id in self._closed:
                raise ValueError(f"stream {stream_id!r} is closed: a chunk after close() needs a new stream")
            raise ValueError(f"unknown stream {stream_id!r}: open() it first")
        return stream

    def _release(self, stream_id: Hashable) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        with torch.no_grad():
            for state in self._pool.values():  # a fresh stream's state is zero
                state[stream.slot].zero_()
        self._free.append(stream.slot)
        self._closed[stream_id] = None
        while len(self._closed) > 4096:
            self._closed.popitem(last=False)

    def _checked(self, stream_id: Hashable, stream: _Stream, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` as int64 ``[Q, n]`` after the checks ``decode`` makes, in this stream's terms."""
        cfg, name = self.config, f"stream {stream_id!r}"
        if not isinstance(codes, torch.Tensor):
            raise ValueError(f"{name}: codes must be a torch.Tensor [codebooks, frames], got {type(codes).__name__}")
        if codes.dtype == torch.bool or codes.is_floating_point() or codes.is_complex():
            raise ValueError(f"{name}: codes must be an integer tensor, got dtype {codes.dtype}")
        if codes.dim() != 2:
            raise ValueError(f"{name}: a chunk must have shape [codebooks, frames], got {tuple(codes.shape)}")
        if codes.shape[0] != cfg.num_quantizers:
            raise ValueError(f"{name}: chunk has {codes.shape[0]} codebooks, this model expects {cfg.num_quantizers}")
        codes = codes.long()  # compare in int64, as validate_codes does: uint16 has no `<` on the CPU, uint8 wraps
        bad = (codes < 0) | (codes >= cfg.codebook_size)
        if codes.numel() and bool(bad.any()):
            q, t = (int(i) for i in bad.nonzero()[0])
            at = stream.frames + sum(p.shape[1] for p in stream.pending) + t
            raise ValueError(
                f"{name}: code {int(codes[q, t])} at codebook {q}, frame {at} is outside "
                f"[0, {cfg.codebook_size}) ({int(bad.sum())} bad values in this chunk)"
            )
        return codes

    # --- batching, graphs ------------------------------------------------------------------------

    def _decode(self, work: dict[Hashable, _Stream]) -> dict[Hashable, torch.Tensor]:
        """Advances ``work``'s streams by all their pending frames, grouped by chunk size."""
        self._refresh_snakes()
        codes = {sid: s.pending[0] if len(s.pending) == 1 else torch.cat(s.pending, dim=1) for sid, s in work.items()}
        limit = self.max_graph_frames if self._graphs_on() else None
        plan = {sid: _split(c.shape[1], limit) for sid, c in codes.items()}
        pieces: dict[Hashable, list[torch.Tensor]] = {sid: [] for sid in work}
        done = dict.fromkeys(work, 0)
        tail = self.config.tail
        for r in range(max((len(p) for p in plan.values()), default=0)):
            groups: dict[int, list[Hashable]] = {}
            for sid, sizes in plan.items():
                if r < len(sizes):
                    groups.setdefault(sizes[r], []).append(sid)
            for c, sids in groups.items():
                batch = torch.stack([codes[sid][:, done[sid] : done[sid] + c] for sid in sids])
                wav = self._run(batch, [work[sid].slot for sid in sids], [work[sid].frames for sid in sids])
                for row, sid in enumerate(sids):
                    pieces[sid].append(wav[row, :, tail if work[sid].frames == 0 else 0 :])
                    work[sid].frames += c
                    done[sid] += c
        out = {}
        for sid, stream in work.items():
            stream.pending.clear()
            ps = pieces[sid]
            out[sid] = ps[0] if len(ps) == 1 else torch.cat(ps, dim=-1) if ps else self._empty()
        return out

    def _empty(self) -> torch.Tensor:
        return torch.empty((1, 0), dtype=self.dtype, device=self.device)

    def _graphs_on(self) -> bool:
        return self.cuda_graphs and self.device.type == "cuda"

    def _run(self, codes: torch.Tensor, slots: list[int], pos: list[int]) -> torch.Tensor:
        """One batch of equal-size chunks: ``[B, 1, c * total_upsample]`` in new storage."""
        batch, chunk = codes.shape[0], codes.shape[2]
        graph = self._graph_for(batch, chunk)
        rows = graph.batch if graph is not None else batch
        meta = torch.tensor(slots + [self.scratch] * (rows - batch) + pos + [0] * (rows - batch), dtype=torch.long)
        if self.device.type == "cuda":  # pinned: the copies do not wait for the device
            meta = meta.pin_memory()
            codes = codes.pin_memory() if codes.device.type == "cpu" else codes
        meta = meta.to(self.device, non_blocking=True)
        codes = codes.to(self.device, non_blocking=True)
        with torch.no_grad():
            if graph is not None:
                return graph.run(codes, meta[:rows], meta[rows:])[:batch].clone()
            return self._advance(codes, meta[:rows], meta[rows:])

    def _graph_for(self, batch: int, chunk: int) -> _StepGraph | None:
        if not self._graphs_on() or chunk > self.max_graph_frames:
            return None
        rows = 1
        while rows < batch:
            rows *= 2
        rows = min(rows, self.max_streams)
        graph = self._graphs.get((rows, chunk))
        if graph is None:
            if len(self._graphs) >= self.max_graphs:
                return None
            start = time.perf_counter()
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            try:
                graph = self._graphs[(rows, chunk)] = _StepGraph(self, rows, chunk)
            except RuntimeError as err:  # a capture that fails must not stop the stream: run eagerly
                log.warning("streaming: CUDA graph capture failed (%s); running eagerly from now on", err)
                self.cuda_graphs = False
                return None
            log.info("streaming: captured the CUDA graph for %d streams x %d frames in %.2f s", rows, chunk,
                     time.perf_counter() - start)  # fmt: skip
            if len(self._graphs) == self.max_graphs:
                log.info("streaming: %d CUDA graphs captured; other shapes run eagerly", self.max_graphs)
        return graph

    # --- layout of the model and of the state --------------------------------------------------

    def _build_plan(self) -> None:
        m, cfg = self.model, self.config
        for conv_t, _ in m.upsample:
            if conv_t.trim:
                raise NotImplementedError("streaming needs the upsampling transposed convs to have kernel == stride")
        self.blocks = []
        pending: list[torch.Tensor] = [m.decoder[0].conv.bias]
        for block in m.decoder[1:-2]:
            snake, conv_t, *units = block.block
            rate = conv_t.conv.stride[0]
            if conv_t.trim != rate or conv_t.conv.kernel_size[0] != 2 * rate:
                raise NotImplementedError("streaming needs decoder transposed convs of kernel 2*rate, trim rate")
            entry = {"snake": _Snake(snake, pending), "conv_t": conv_t.conv, "rate": rate, "units": []}
            pending = [conv_t.conv.bias]
            for unit in units:
                entry["units"].append(
                    {
                        "snake1": _Snake(unit.act1, list(pending)),
                        "conv1": unit.conv1.conv,
                        "snake2": _Snake(unit.act2, [unit.conv1.conv.bias]),
                        "conv2": unit.conv2.conv,
                    }
                )
                pending = pending + [unit.conv2.conv.bias]
            self.blocks.append(entry)
        self.final_snake = _Snake(m.decoder[-2], pending)
        self.final_conv = m.decoder[-1].conv
        self.snakes = [b["snake"] for b in self.blocks] + [self.final_snake]
        self.snakes += [u[k] for b in self.blocks for u in b["units"] for k in ("snake1", "snake2")]
        self._watched = [p for s in self.snakes for p in (s.module.alpha, s.module.beta, *s.biases)]
        # output samples of a fresh stream that depend on the zero "previous sample" (sums to tail)
        junk = 0
        for b in self.blocks:
            junk = (junk + 1) * b["rate"]
            b["junk"] = junk
        assert junk == cfg.tail, (junk, cfg.tail)

    def _allocate_state(self) -> dict[str, torch.Tensor]:
        """Per-slot state tensors, ``[max_streams + 1, ...]``, zero (a fresh stream's state)."""
        cfg, m = self.config, self.model
        shapes: dict[str, tuple[int, ...]] = {}
        past = cfg.sliding_window - 1
        if past:
            for i in range(cfg.num_hidden_layers):
                shapes[f"k{i}"] = shapes[f"v{i}"] = (cfg.num_key_value_heads, past, cfg.resolved_head_dim)
        for i, (_, convnext) in enumerate(m.upsample):
            shapes[f"up{i}"] = (_context(convnext.dwconv.conv), cfg.hidden_size)
        shapes["dec0"] = (_context(m.decoder[0].conv), cfg.hidden_size)
        for i, b in enumerate(self.blocks):
            shapes[f"b{i}"] = (1, b["conv_t"].in_channels)
            for j, u in enumerate(b["units"]):
                shapes[f"b{i}u{j}"] = (_context(u["conv1"]), u["conv1"].in_channels)
        shapes["final"] = (_context(self.final_conv), self.final_conv.in_channels)
        with torch.no_grad(), torch.inference_mode(False):  # normal tensors: updated under any mode
            return {
                name: torch.zeros((self.max_streams + 1, *shape), dtype=self.dtype, device=self.device)
                for name, shape in shapes.items()
            }

    def reads(self, model: Code2Wav) -> bool:
        """Whether this decoder runs ``model``'s current parameters (not moved or cast since)."""
        param = next(model.parameters())
        return model is self.model and param.data_ptr() == self._param_ptr and param.dtype == self.dtype

    @property
    def state_bytes_per_stream(self) -> int:
        """Bytes of state one stream holds, whatever its length (the pool holds ``max_streams + 1``)."""
        return sum(t[0].numel() * t.element_size() for t in self._pool.values())

    def _refresh_snakes(self) -> None:
        """Recomputes the fp32 SnakeBeta vectors when a parameter was updated in place."""
        if not self.reads(self.model):
            raise RuntimeError("the model's parameters were replaced (moved or cast?): build a new StreamingDecoder")
        versions = tuple(p._version for p in self._watched)
        if versions == self._versions:
            return
        with torch.no_grad(), torch.inference_mode(False):
            for s in self.snakes:
                alpha = s.module.alpha.detach().float().exp()
                inv_beta = 1.0 / (s.module.beta.detach().float().exp() + 1e-9)
                bias = sum(b.detach().float() for b in s.biases) if s.biases else None
                if s.alpha is None:  # allocated once: captured graphs read these addresses
                    s.alpha, s.inv_beta = alpha, inv_beta
                    s.bias = bias
                else:
                    s.alpha.copy_(alpha)
                    s.inv_beta.copy_(inv_beta)
                    if bias is not None:
                        s.bias.copy_(bias)
        self._versions = versions

    # --- the step itself (no host synchronization: CUDA-graph capturable) ----------------------

    def _advance(self, codes: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Advances the streams in ``slots`` (at ``pos`` frames) by ``codes [B, Q, c]``.

        Returns ``[B, 1, c * total_upsample]``; a fresh row's first ``tail`` samples are junk.
        """
        m = self.model
        fresh = (pos == 0).to(torch.int32)
        h = m.code_embedding(codes + m.code_offset).mean(1)  # [B, c, hidden]
        h = self._transformer(h, slots, pos)
        for i, (conv_t, convnext) in enumerate(m.upsample):
            h = _conv_transpose_cl(h, conv_t.conv.weight, conv_t.conv.bias, conv_t.conv.stride[0], 0)
            buf = self._state_buffer(f"up{i}", slots, h)
            d = _conv_cl(buf, convnext.dwconv.conv, bias=True)
            d = convnext.pwconv2(F.gelu(convnext.pwconv1(convnext.norm(d))))
            h = h + convnext.gamma * d
        h = _conv_cl(self._state_buffer("dec0", slots, h), m.decoder[0].conv, bias=False)
        for i, b in enumerate(self.blocks):
            buf = self._state_buffer(f"b{i}", slots, None, h.shape[1], h.shape[2])
            self._snake(h, b["snake"], buf[:, 1:], fresh, 0)
            self._save(f"b{i}", slots, buf)
            h = _conv_transpose_cl(buf, b["conv_t"].weight, None, b["rate"], b["rate"])
            for j, u in enumerate(b["units"]):
                buf = self._state_buffer(f"b{i}u{j}", slots, None, h.shape[1], h.shape[2])
                self._snake(h, u["snake1"], buf[:, -h.shape[1] :], fresh, b["junk"])
                self._save(f"b{i}u{j}", slots, buf)
                s = _conv_cl(buf, u["conv1"], bias=False)
                s = self._snake(s, u["snake2"], None, fresh, 0)
                c = h.shape[-1]  # 1x1 conv and residual add in one GEMM, in place
                h.view(-1, c).addmm_(s.reshape(-1, c), u["conv2"].weight.view(c, c).t())
        buf = self._state_buffer("final", slots, None, h.shape[1], h.shape[2])
        self._snake(h, self.final_snake, buf[:, -h.shape[1] :], fresh, self.blocks[-1]["junk"] if self.blocks else 0)
        self._save("final", slots, buf)
        wav = _conv_cl(buf, self.final_conv, bias=True)  # [B, T, 1]
        return wav.transpose(1, 2).clamp(-1.0, 1.0)

    def _transformer(self, h: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        pt, cfg = self.model.pre_transformer, self.config
        batch, c, _ = h.shape
        window, past = cfg.sliding_window, cfg.sliding_window - 1
        n_heads, n_kv, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim
        q_pos = pos[:, None] + torch.arange(c, device=h.device)  # absolute positions, as decode's
        freqs = q_pos[..., None].float() * pt.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, c, head_dim]
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        k_pos = torch.cat((pos[:, None] - past + torch.arange(past, device=h.device), q_pos), dim=1)
        offset = q_pos[:, :, None] - k_pos[:, None, :]  # query minus key; keys before frame 0 are empty
        mask = ((offset >= 0) & (offset < window) & (k_pos[:, None, :] >= 0))[:, None]
        for i, layer in enumerate(pt.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(batch, c, n_heads, head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(batch, c, n_kv, head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(batch, c, n_kv, head_dim).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if past:
                k = torch.cat((self._pool[f"k{i}"][slots], k), dim=2)
                v = torch.cat((self._pool[f"v{i}"][slots], v), dim=2)
                self._pool[f"k{i}"].index_copy_(0, slots, k[:, :, -past:])
                self._pool[f"v{i}"].index_copy_(0, slots, v[:, :, -past:])
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_heads != n_kv)
            h = h + layer.self_attn_layer_scale(attn.o_proj(y.transpose(1, 2).reshape(batch, c, -1)))
            h = h + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(h)))
        return pt.norm(h)

    def _state_buffer(self, name: str, slots: torch.Tensor, x: torch.Tensor | None,
                      length: int = 0, channels: int = 0) -> torch.Tensor:  # fmt: skip
        """``[B, context + length, C]``: the slots' state, then ``x`` (or room for it)."""
        state = self._pool[name]
        context = state.shape[1]
        if x is not None:
            length, channels = x.shape[1], x.shape[2]
        buf = torch.empty((slots.shape[0], context + length, channels), dtype=state.dtype, device=state.device)
        buf[:, :context].copy_(state.index_select(0, slots))
        if x is not None:
            buf[:, context:].copy_(x)
            self._save(name, slots, buf)
        return buf

    def _save(self, name: str, slots: torch.Tensor, buf: torch.Tensor) -> None:
        state = self._pool[name]
        state.index_copy_(0, slots, buf[:, buf.shape[1] - state.shape[1] :])

    def _snake(self, x: torch.Tensor, site: _Snake, out: torch.Tensor | None, fresh: torch.Tensor,
               junk: int) -> torch.Tensor:  # fmt: skip
        """``snake(x + bias)`` into ``out`` (or a new tensor); a fresh row's first ``junk`` samples 0."""
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.is_cuda and site.module.fused and fused.triton_available():
            fused.snake_beta_tc_into(x, out, site.alpha, site.inv_beta, site.bias, fresh, junk)
            return out
        t = x.float()
        if site.bias is not None:
            t = t + site.bias
        y = torch.sin(t * site.alpha).square_().mul_(site.inv_beta).add_(t)
        if junk:
            y[:, :junk].mul_((1 - fresh).to(y.dtype)[:, None, None])
        out.copy_(y)
        return out


class _StepGraph:
    """One ``(batch, chunk)`` step captured as a CUDA graph, with its static inputs and output."""

    def __init__(self, decoder: StreamingDecoder, batch: int, chunk: int) -> None:
        device = decoder.device
        self.batch = batch
        self.codes = torch.zeros((batch, decoder.config.num_quantizers, chunk), dtype=torch.long, device=device)
        self.slots = torch.full((batch,), decoder.scratch, dtype=torch.long, device=device)
        self.pos = torch.zeros((batch,), dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():  # autotune and compile first; scratch slot only
            for _ in range(2):
                decoder._advance(self.codes, self.slots, self.pos)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph, pool=decoder._graph_pool):
            self.out = decoder._advance(self.codes, self.slots, self.pos)

    def run(self, codes: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.codes[: codes.shape[0]].copy_(codes)  # rows past the batch keep earlier valid codes
        self.slots.copy_(slots)
        self.pos.copy_(pos)
        self.graph.replay()
        return self.out


def _split(n: int, limit: int | None) -> list[int]:
    if limit is None or n <= limit:
        return [n] if n else []
    return [limit] * (n // limit) + ([n % limit] if n % limit else [])


def _check_hashable(stream_id: Hashable) -> None:
    try:
        hash(stream_id)
    except TypeError:
        raise ValueError(f"stream ids must be hashable, got {type(stream_id).__name__}") from None


def _context(conv: torch.nn.Conv1d) -> int:
    return (conv.kernel_size[0] - 1) * conv.dilation[0]


def _conv_cl(buf: torch.Tensor, conv: torch.nn.Conv1d, bias: bool) -> torch.Tensor:
    """Valid (unpadded) conv of ``buf [B, T, Ci]`` channels-last: ``[B, T - context, Co]``."""
    x = buf.transpose(1, 2).unsqueeze(2)  # [B, Ci, 1, T], channels-last strides
    y = F.conv2d(x, conv.weight.unsqueeze(2), conv.bias if bias else None, dilation=(1, conv.dilation[0]),
                 groups=conv.groups)  # fmt: skip
    return y.squeeze(2).transpose(1, 2).contiguous()


def _conv_transpose_cl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int,
                       trim: int) -> torch.Tensor:  # fmt: skip
    """Transposed conv of ``x [B, T, Ci]`` channels-last, ``trim`` samples cut from both ends."""
    y = F.conv_transpose2d(x.transpose(1, 2).unsqueeze(2), weight.unsqueeze(2), bias, stride=(1, stride),
                           padding=(0, trim))  # fmt: skip
    return y.squeeze(2).transpose(1, 2).contiguous()
