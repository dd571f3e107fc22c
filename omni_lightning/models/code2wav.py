"""Code2Wav: the codec decoder of Qwen3-Omni, in plain torch.

Multi-codebook codec codes ``[B, Q, T]`` at 12.5 frames/s go in, a 24 kHz waveform ``[B, 1, T']`` in
[-1, 1] comes out. The layer names (and so the ``state_dict`` keys) are those of transformers'
``Qwen3OmniMoeCode2Wav``, so a Qwen3-Omni checkpoint's ``code2wav.*`` tensors load with no mapping.

The model is causal except for one frame of look-ahead in each transposed convolution, which the
stages trim away: output sample ``s`` never depends on a frame after ``s // total_upsample``. That is
why a right-padded batch gives each request exactly what it gives alone, and why
``output_length(T) = total_upsample * T - tail`` (``tail`` = 555 samples on Qwen3-Omni).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from omni_lightning.models import fused
from omni_lightning.models.codes import check_codes_layout, validate_codes
from omni_lightning.models.config import Code2WavConfig, resolve_config
from omni_lightning.models.layers import (
    CausalConv1d,
    CausalConvTranspose1d,
    ConvNeXtBlock,
    DecoderBlock,
    PreTransformer,
    SnakeBeta,
)


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
            )  # fmt: skip
            for r in config.upsampling_ratios
        )
        dims = [config.decoder_dim // 2**i for i in range(len(config.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(config.hidden_size, config.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(config.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)]
        )
        # inference on CUDA: the channels-last decoder with folded biases (models/fast_decoder.py)
        self.fast_decoder = True

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

    def set_fused_kernels(self, enabled: bool) -> Code2Wav:
        """Turns the fused CUDA inference kernels (and the decoder built on them) on or off (on by default)."""
        for module in self.modules():
            if isinstance(module, SnakeBeta):
                module.fused = enabled
        self.fast_decoder = enabled
        return self

    def output_length(self, n_frames: int) -> int:
        return self.config.output_length(n_frames)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[B, Q, T]`` of any integer dtype to ``[B, 1, output_length(T)]``.

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
        h = self.code_embedding(codes + self.code_offset).mean(1)
        h = self.pre_transformer(h).transpose(1, 2)
        for stage in self.upsample:
            for layer in stage:
                h = layer(h)
        if self.fast_decoder and h.is_cuda and not torch.is_grad_enabled() and fused.triton_available():
            from omni_lightning.models.fast_decoder import decoder_forward

            h = decoder_forward(self.decoder, h)
        else:
            for layer in self.decoder:
                h = layer(h)
        return h.clamp(-1.0, 1.0)

    def decode(
        self,
        codes: torch.Tensor,
        lengths: torch.Tensor | Sequence[int] | None = None,
        req_ids: Sequence[str] | None = None,
        validate: bool = True,
        forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Decodes a right-padded batch; request i's waveform ``[1, output_length(lengths[i])]``.

        Each waveform is what that request gives decoded alone (the model never looks past a
        frame's own look-ahead). ``validate=False`` skips the range check, for callers that
        validated on the CPU already (the check on a GPU tensor synchronizes the device).
        ``forward`` replaces ``self`` for the forward pass (a ``CUDAGraphDecoder``, say; one with a
        ``decode_rows`` method takes the whole decode, rows and lengths).
        """
        if validate:
            lengths = validate_codes(codes, self.config, lengths, req_ids)
        elif lengths is None:
            lengths = torch.full((codes.shape[0],), codes.shape[-1], dtype=torch.long)
        n = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
        codes = codes[..., : max(n)]
        if codes.dtype not in (torch.int32, torch.int64):  # uint16 & co. have no clamp kernel
            codes = codes.long()
        if min(n) < codes.shape[-1]:
            # pad frames may hold anything (-1, say) and are cut from the output anyway: clamp them
            # into the codebook on the device (building a pad mask would wait for a host copy)
            codes = codes.clamp(0, self.config.codebook_size - 1)
        if hasattr(forward, "decode_rows"):  # a CUDAGraphDecoder: runs rows of similar lengths together
            return forward.decode_rows(codes, n)
        wav = (forward or self)(codes)
        return [wav[i, :, : self.output_length(n_i)] for i, n_i in enumerate(n)]

    def decode_requests(
        self,
        codes: torch.Tensor,
        n_frames: Sequence[int],
        max_frames: int,
        chunk_size: int = 300,
        left_context: int = 25,
        forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """A validated right-padded batch, request by request: those of at most ``max_frames`` frames
        decoded together (``decode``), longer ones alone with ``chunked_decode``; in request order."""
        wavs: list[torch.Tensor | None] = [None] * len(n_frames)
        short = [i for i, n in enumerate(n_frames) if n <= max_frames]
        if short:
            # row slices and cat, not an index tensor: nothing here waits for the device
            sub = codes if len(short) == len(n_frames) else torch.cat([codes[i : i + 1] for i in short])
            sub = sub[..., : max(n_frames[i] for i in short)]
            lengths = [n_frames[i] for i in short]
            for i, wav in zip(short, self.decode(sub, lengths, validate=False, forward=forward)):
                wavs[i] = wav
        for i, n in enumerate(n_frames):
            if wavs[i] is None:
                wavs[i] = self.chunked_decode(codes[i : i + 1, :, :n], chunk_size, left_context, False, forward)
        return wavs

    def chunked_decode(
        self,
        codes: torch.Tensor,
        chunk_size: int = 300,
        left_context: int = 25,
        validate: bool = True,
        forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Decodes ``[B, Q, T]`` to ``[B, output_length(T)]`` in chunks of ``chunk_size`` frames with
        bounded peak memory: one request ``[1, Q, T]`` gives ``[1, N]``, as ``decode`` gives per request.

        Each chunk is decoded with up to ``left_context`` frames before it. Unlike transformers'
        ``chunked_decode``, which drops each chunk's last ``tail`` samples, the chunk after it
        re-decodes them from its left context, so the result has ``output_length(T)`` samples with
        no gaps, and equals a full decode when ``left_context >= T``. ``forward`` as in ``decode``.
        """
        if validate:
            validate_codes(codes, self.config)
        up, tail = self.config.total_upsample, self.config.tail
        min_context = -(-tail // up)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 frame, got {chunk_size}")
        if left_context < min_context:
            raise ValueError(
                f"left_context must be >= {min_context} frame(s) to refill the {tail}-sample chunk "
                f"tail, got {left_context}"
            )
        n_frames = codes.shape[-1]
        pieces = []
        for start in range(0, n_frames, chunk_size):
            end = min(start + chunk_size, n_frames)
            context = min(left_context, start)
            wav = (forward or self)(codes[..., start - context : end])
            # from absolute sample start*up - tail: the previous chunk's missing tail comes first
            pieces.append(wav[..., context * up - (tail if start else 0) :])
        return torch.cat(pieces, dim=-1)[:, 0]

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Code2Wav:
        """Loads a standalone folder or the ``code2wav.*`` tensors of a full Qwen3-Omni checkpoint."""
        from omni_lightning.models.checkpoint import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | Path) -> Path:
        """Writes ``config.json`` + ``model.safetensors`` (transformers' standalone layout)."""
        from omni_lightning.models.checkpoint import save_pretrained

        return save_pretrained(self, path)
