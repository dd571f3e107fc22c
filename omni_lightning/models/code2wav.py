"""Code2Wav: the codec decoder of Qwen3-Omni, in plain torch.

Multi-codebook codec codes ``[B, Q, T]`` at 12.5 frames/s go in, a 24 kHz waveform ``[B, 1, T']`` in
[-1, 1] comes out. The layer names (and so the ``state_dict`` keys) are those of transformers'
``Qwen3OmniMoeCode2Wav``, so a Qwen3-Omni checkpoint's ``code2wav.*`` tensors load with no mapping.

One forward serves every use, as litgpt's ``GPT.forward(idx, input_pos)`` serves prefill and cached
decode: ``forward(codes)`` decodes whole requests; ``forward(codes, state)`` continues each row of a
:class:`~omni_lightning.models.state.DecodeState` where its last forward stopped, so a request decoded
in chunks of any sizes equals its whole decode (the model is causal but for one trimmed look-ahead
sample per decoder block; ``layers.py`` says how that sample is carried). Output sample ``s`` never
depends on a frame after ``s // total_upsample``: a right-padded batch gives each request exactly
what it gives alone, and ``output_length(T) = total_upsample * T - tail`` (555 on Qwen3-Omni).

No CUDA, Triton or grad branch lives here: the forward's ``kernels`` (``omni_lightning.kernels``)
are chosen by whoever runs it (the decode engine, the training step); a plain ``model(codes)`` gets
``Kernels.for_call`` of its device (the fast kernels on CUDA, the torch reference on the CPU), and
``kernels=REFERENCE`` asks for the torch reference anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from omni_lightning.errors import UsageError, check_count
from omni_lightning.kernels import Kernels
from omni_lightning.models.checkpoint import load_pretrained, save_pretrained
from omni_lightning.models.codes import check_codes_layout, validate_codes
from omni_lightning.models.config import Code2WavConfig, resolve_config
from omni_lightning.models.layers import (
    CausalConv1d,
    CausalConvTranspose1d,
    ConvNeXtBlock,
    DecoderBlock,
    SnakeBeta,
    output_waveform,
)
from omni_lightning.models.state import DecodeState, Step
from omni_lightning.models.transformer import PreTransformer

REFERENCE = Kernels()


class Code2Wav(nn.Module):
    """Codec codes ``[B, Q, T]`` to waveform ``[B, 1, output_length(T)]`` in [-1, 1]."""

    def __init__(self, config: Code2WavConfig | str | dict | None = None) -> None:
        super().__init__()
        self.config = config = resolve_config(config)
        self.pre_transformer = PreTransformer(config)
        self.code_embedding = nn.Embedding(config.codebook_size * config.num_quantizers, config.hidden_size)
        self.register_buffer("code_offset", self._code_offset(), persistent=False)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [
                    CausalConvTranspose1d(config.hidden_size, config.hidden_size, r, r),
                    ConvNeXtBlock(config.hidden_size),
                ]
            )
            for r in config.upsampling_ratios
        )
        dims = [config.decoder_dim // 2**i for i in range(len(config.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(config.hidden_size, config.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(config.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)]
        )
        junk = 0  # samples before time 0 after each decoder block (layers.py), `tail` at the end
        for block, rate in zip(self.decoder[1:-2], config.upsample_rates):
            junk = block.junk = (junk + 1) * rate
        assert junk == config.tail, (junk, config.tail)
        for name, module in self.named_modules():
            if hasattr(module, "state_name"):
                module.state_name = name
        self.register_state_dict_post_hook(_contiguous_state)

    def _code_offset(self, device: torch.device | None = None) -> torch.Tensor:
        q = self.config.num_quantizers
        return (torch.arange(q, device=device) * self.config.codebook_size).view(1, q, 1)

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recomputes the non-persistent buffers (after building on the meta device)."""
        self.code_offset = self._code_offset(device)
        self.pre_transformer.inv_freq = self.pre_transformer._inv_freq(device)

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    def output_length(self, n_frames: int) -> int:
        return self.config.output_length(n_frames)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every layer's per-request history: name -> shape (what a ``DecodeState`` slot holds)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for module in self.modules():
            if module is not self and hasattr(module, "state_shapes"):
                shapes.update(module.state_shapes())
        return shapes

    def new_state(self, slots: int) -> DecodeState:
        """A fresh :class:`DecodeState` of ``slots`` requests on this model's device and dtype."""
        return DecodeState(self, slots)

    def forward(
        self, codes: torch.Tensor, state: DecodeState | None = None, kernels: Kernels | None = None
    ) -> torch.Tensor:
        """Codes ``[B, Q, T]`` of any integer dtype to a waveform in [-1, 1].

        Without ``state``: the whole requests, ``[B, 1, output_length(T)]``. With ``state``: row ``b``
        continues slot ``state.rows[b]`` (default: slot ``b``) from its ``pos`` frames; the result is
        ``[B, 1, T * total_upsample]``, samples ``[pos * up - tail, (pos + T) * up - tail)`` of that
        request (a row starting at frame 0 begins with ``tail`` zeros for the time before the
        request), and the state advances by ``state.valid`` frames per row (default ``T``).

        Always checked, at no cost: type, integer dtype, rank, codebook count, empty. The code range
        is checked only when ``codes`` is on the CPU: on CUDA, ``forward`` trusts its input, because
        the check needs a host sync in the hot path (out-of-range codes there end in a device-side
        assert). ``decode`` checks everything, range included, on any device.
        """
        check_codes_layout(codes, self.config)
        if codes.device.type == "cpu":
            validate_codes(codes, self.config)
        if codes.dtype not in (torch.int32, torch.int64):  # the embedding takes int32/int64 only
            codes = codes.long()
        step = Step(state, kernels or Kernels.for_call(codes.device), codes.shape[0], codes.shape[-1], codes.device)
        h = self.code_embedding(codes + self.code_offset).mean(1)  # [B, T, hidden], time-major
        h = self.pre_transformer(h, step)
        for conv_t, convnext in self.upsample:
            h = convnext(conv_t(h, step), step)
        first, *blocks, last_act, last_conv = self.decoder
        x = first(step.with_history(first.state_name, first.context, h), h.shape[1], bias=False)
        pending = first.conv.bias.float()
        for block in blocks:
            x, pending = block(x, pending, step)
        wav = output_waveform(last_act, last_conv, x, pending, step, self.config.tail)  # [B, 1, T * up]
        if state is None:
            return wav[..., self.config.tail :]
        step.commit()  # last: a forward that fails on the way changes no state
        return wav

    def decode(
        self,
        codes: torch.Tensor,
        lengths: torch.Tensor | Sequence[int] | None = None,
        req_ids: Sequence[str] | None = None,
        validate: bool = True,
    ) -> list[torch.Tensor]:
        """Decodes a right-padded batch; request i's waveform ``[1, output_length(lengths[i])]``.

        Each waveform is what that request gives decoded alone (the model never looks past a
        frame's own look-ahead). ``validate=False`` skips the range check, for callers that
        validated on the CPU already (the check on a GPU tensor synchronizes the device); the
        dtype, shape and lengths are checked either way (one length per request, in ``[1, T]``). One
        forward over the whole batch: for long requests or bounded memory use ``chunked_decode`` or
        the decode engine (``omni_lightning.engine``).
        """
        n = validate_codes(codes, self.config, lengths, req_ids, values=validate).tolist()
        codes = codes[..., : max(n)]
        if codes.dtype not in (torch.int32, torch.int64):  # uint16 & co. have no clamp kernel
            codes = codes.long()
        if min(n) < codes.shape[-1]:
            # pad frames may hold anything (-1, say) and are cut from the output anyway: clamp them
            # into the codebook on the device (building a pad mask would wait for a host copy)
            codes = codes.clamp(0, self.config.codebook_size - 1)
        wav = self(codes)
        return [wav[i, :, : self.output_length(n_i)] for i, n_i in enumerate(n)]

    def chunked_decode(self, codes: torch.Tensor, chunk_size: int = 300, validate: bool = True) -> torch.Tensor:
        """Decodes ``[B, Q, T]`` to ``[B, output_length(T)]`` ``chunk_size`` frames at a time, carrying
        the state from chunk to chunk: memory is bounded by the chunk, and the result equals the whole
        decode (no context is re-decoded, nothing is approximated). One request ``[1, Q, T]`` gives
        ``[1, N]``, as ``decode`` gives per request.
        """
        check_count("chunk_size", chunk_size)
        validate_codes(codes, self.config, values=validate)
        state = self.new_state(codes.shape[0])
        starts = range(0, codes.shape[-1], chunk_size)
        pieces = [self(codes[..., start : start + chunk_size], state) for start in starts]
        return torch.cat(pieces, dim=-1)[:, 0, self.config.tail :]

    @classmethod
    def resolve(
        cls, model: Code2Wav | None, checkpoint: str | Path | None = None, config: Code2WavConfig | str = "qwen3-omni"
    ) -> Code2Wav:
        """``model`` itself; None: loaded from ``checkpoint``, else built from ``config`` (random weights).
        UsageError naming a ``model`` that is not a ``Code2Wav`` (a preset's name, say)."""
        if model is None:
            return cls.from_pretrained(checkpoint) if checkpoint else cls(resolve_config(config))
        if not isinstance(model, Code2Wav):
            named = isinstance(model, str)
            hint = f"; pass config={model!r} (a preset) or checkpoint={model!r} (weights)" if named else ""
            raise UsageError(
                f"model must be a Code2Wav (or None: built from checkpoint or config), got "
                f"{type(model).__name__} {model!r:.60}{hint}"
            )
        return model

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Code2Wav:
        """Loads a standalone folder or the ``code2wav.*`` tensors of a full Qwen3-Omni checkpoint."""
        model = load_pretrained(cls, path, dtype=dtype, device=device)
        model.reset_buffers(torch.device(device or "cpu"))
        return model.eval()

    def save_pretrained(self, path: str | Path) -> Path:
        """Writes ``config.json`` + ``model.safetensors`` (transformers' standalone layout)."""
        return save_pretrained(self, self.config, path)


def _contiguous_state(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    """A state dict holds contiguous tensors: weights an engine laid out channels-last (``engine/graphs``)
    are given as plain copies, which every format saves (safetensors refuses strided tensors)."""
    for key, value in state.items():
        if key.startswith(prefix) and isinstance(value, torch.Tensor) and not value.is_contiguous():
            state[key] = value.contiguous()
