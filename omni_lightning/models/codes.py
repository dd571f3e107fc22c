"""``validate_codes``: a batch of codec codes checked against a config before any lookup."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omni_lightning.models.config import Code2WavConfig


def _name(req_ids: Sequence[str] | None, i: int) -> str:
    return f"request {req_ids[i]!r}" if req_ids is not None and i < len(req_ids) else f"request {i}"


def check_codes_layout(codes: Any, config: Code2WavConfig, req_ids: Sequence[str] | None = None) -> None:
    """The checks that cost nothing (no pass over the values, no device sync): type, dtype, rank,
    batch size, codebook count, frames. ValueError on the first problem."""
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"codes must be a torch.Tensor [B, Q, T], got {type(codes).__name__}")
    if codes.dtype == torch.bool or codes.is_floating_point() or codes.is_complex():
        raise ValueError(f"codes must be an integer tensor, got dtype {codes.dtype}")
    if codes.dim() != 3:
        raise ValueError(f"codes must have shape [batch, codebooks, frames], got {tuple(codes.shape)}")
    if codes.shape[0] == 0:
        raise ValueError("codes hold no request (batch size 0)")
    if codes.shape[1] != config.num_quantizers:
        who = _name(req_ids, 0) if codes.shape[0] == 1 else "codes"
        hint = " (frames first? codes are [codebooks, frames])" if codes.shape[2] == config.num_quantizers else ""
        raise ValueError(f"{who}: shape {tuple(codes.shape[1:])} has {codes.shape[1]} codebooks, this model "
                         f"expects {config.num_quantizers}{hint}")  # fmt: skip
    if codes.shape[2] == 0:
        raise ValueError(f"{_name(req_ids, 0)} is empty (0 frames)")


def check_lengths(lengths: Any, batch: int, n_frames: int, req_ids: Sequence[str] | None = None) -> torch.Tensor:
    """``lengths`` (None: every request ``n_frames`` long) as int64 on the CPU, after checking that
    there is one per request, each in ``[1, n_frames]``; ``ValueError`` naming the request otherwise."""
    if lengths is None:
        return torch.full((batch,), n_frames, dtype=torch.long)
    lengths = torch.as_tensor(lengths)
    if lengths.numel() == 0:  # [] (a batch of only bad requests) is float32 to torch
        lengths = lengths.long()
    if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.shape != (batch,):
        raise ValueError(f"lengths must be integers of shape [{batch}], got {lengths.dtype} {tuple(lengths.shape)}")
    lengths = lengths.to(device="cpu", dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        if n < 1:
            raise ValueError(f"{_name(req_ids, i)} is empty (length {n})")
        if n > n_frames:
            raise ValueError(f"{_name(req_ids, i)} has length {n}, longer than the {n_frames} padded frames")
    return lengths


def validate_codes(
    codes: Any,
    config: Code2WavConfig,
    lengths: Any = None,
    req_ids: Sequence[str] | None = None,
) -> torch.Tensor:
    """Checks a batch ``[B, Q, T]`` (and its ``lengths``) before any lookup; returns ``lengths``.

    Raises ``ValueError`` naming the request (id or index), codebook and frame of the first problem.
    Only frames inside each request's length are checked, so any pad value is accepted. Any integer
    dtype is accepted: values are compared after widening to int64 (a uint8 or uint16 tensor compared
    with the codebook size in its own dtype would wrap, or has no comparison kernel at all). On a GPU
    tensor the range check waits for the device (one host sync).
    """
    check_codes_layout(codes, config, req_ids)
    batch, n_q, n_frames = codes.shape
    if req_ids is not None and len(req_ids) != batch:  # else outputs would go to the wrong requests
        raise ValueError(f"{len(req_ids)} request ids for a batch of {batch} requests: "
                         f"req_ids {list(req_ids)[:8]!r}{' ...' if len(req_ids) > 8 else ''}")  # fmt: skip

    def name(i: int) -> str:
        return _name(req_ids, i)

    lengths = check_lengths(lengths, batch, n_frames, req_ids)
    frame = torch.arange(n_frames, device=codes.device)
    in_request = (frame[None, :] < lengths.to(codes.device)[:, None])[:, None, :]
    wide = codes if codes.dtype == torch.long else codes.long()  # uint64 past int64's range wraps negative: still bad
    bad = ((wide < 0) | (wide >= config.codebook_size)) & in_request
    if bool(bad.any()):
        b, q, t = (int(i) for i in bad.nonzero()[0])
        # a uint64 value past int64's range wrapped negative in `wide`: report it as given
        value = int(codes[b, q, t].cpu().numpy()) if codes.dtype == torch.uint64 else int(wide[b, q, t])
        raise ValueError(
            f"{name(b)}: code {value} at codebook {q}, frame {t} is outside "
            f"[0, {config.codebook_size}) ({int(bad.sum())} bad values in the {'batch' if batch > 1 else 'request'})"
        )
    return lengths


def validate_batch(batch: dict[str, Any], config: Code2WavConfig, drop_bad: bool = False) -> torch.Tensor:
    """:func:`validate_codes` of ``batch["codes"]`` with its ``lengths`` and ``req_ids``; returns the lengths.

    ``drop_bad`` (predict, a batch with ``req_ids``): a request whose codes fail is taken out of the
    batch (``codes``, ``lengths``, ``req_ids``, in place) into ``batch["errors"]`` with its reason, so
    it fails alone, as a bad request the data found does, and the others are decoded. A problem of
    the batch itself (its type, rank or codebook count, lengths that do not fit it) is raised. The
    whole batch is checked first; only a batch that fails is checked request by request.
    """
    codes, lengths, req_ids = batch["codes"], batch.get("lengths"), batch.get("req_ids")
    try:
        return validate_codes(codes, config, lengths, req_ids)
    except ValueError:
        if not drop_bad or req_ids is None:
            raise
        check_codes_layout(codes, config)  # the batch's own problems are raised, naming no request
        n_frames = check_lengths(lengths, codes.shape[0], codes.shape[-1], req_ids).tolist()
        if len(req_ids) != codes.shape[0]:
            raise
    keep, errors = [], {}
    for i, (req_id, n) in enumerate(zip(req_ids, n_frames)):
        try:
            validate_codes(codes[i : i + 1, :, :n], config, req_ids=[req_id])
            keep.append(i)
        except ValueError as err:
            errors[req_id] = str(err)
    index = torch.tensor(keep, dtype=torch.long)
    batch["codes"] = codes.index_select(0, index.to(codes.device))
    batch["req_ids"] = [req_ids[i] for i in keep]
    batch["errors"] = {**(batch.get("errors") or {}), **errors}
    batch["lengths"] = torch.tensor([n_frames[i] for i in keep], dtype=torch.long)
    return batch["lengths"]
