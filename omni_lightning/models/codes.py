"""The one code validator: batches (``validate_codes``), single requests and stream chunks
(``check_request_codes``), and the mark of a batch already checked (``CheckedCodes``).

Every check raises ``ValueError`` naming the request (or stream), and, for a bad value, the codebook
and the frame. Values are compared after widening to int64 (a uint8 or uint16 tensor compared with
the codebook size in its own dtype would wrap, or has no comparison kernel).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from omni_lightning.models.config import Code2WavConfig

INTEGER_DTYPES = "int8 ... int64 or uint8 ... uint64"


def _name(req_ids: Sequence[str] | None, i: int) -> str:
    return f"request {req_ids[i]!r}" if req_ids is not None and i < len(req_ids) else f"request {i}"


def _say(who: str, what: str) -> str:
    return f"{who}: {what}" if who else what


def _check_tensor(codes: Any, who: str, dims: str) -> None:
    if not isinstance(codes, torch.Tensor):
        raise ValueError(_say(who, f"codes must be a torch.Tensor {dims}, got {type(codes).__name__}"))
    if codes.dtype == torch.bool or codes.is_floating_point() or codes.is_complex():
        dtype = str(codes.dtype).removeprefix("torch.")
        raise ValueError(_say(who, f"codes have dtype {dtype}; codes must be integers ({INTEGER_DTYPES})"))


def _check_codebooks(shape: Sequence[int], config: Code2WavConfig, who: str) -> None:
    n_q, n_frames = shape
    if n_q != config.num_quantizers:
        hint = " (frames first? codes are [codebooks, frames])" if n_frames == config.num_quantizers else ""
        raise ValueError(
            _say(who, f"shape {tuple(shape)} has {n_q} codebooks, this model expects {config.num_quantizers}{hint}")
        )


def _check_values(
    codes: torch.Tensor,
    config: Code2WavConfig,
    name: Callable[[int], str],
    scope: str,
    lengths: torch.Tensor | None = None,
    first_frame: int = 0,
) -> torch.Tensor:
    """``codes [B, Q, T]`` widened to int64 after checking every value inside ``lengths`` (pad frames
    are not read); frames are reported from ``first_frame``. One host sync on a GPU tensor."""
    wide = codes if codes.dtype == torch.long else codes.long()  # a uint64 past int64's range wraps negative: bad
    bad = (wide < 0) | (wide >= config.codebook_size)
    if lengths is not None:
        frame = torch.arange(codes.shape[-1], device=codes.device)
        bad &= (frame[None, :] < lengths.to(codes.device)[:, None])[:, None, :]
    if codes.numel() and bool(bad.any()):
        b, q, t = (int(i) for i in bad.nonzero()[0])
        # a uint64 value past int64's range wrapped negative in `wide`: report it as given
        value = int(codes[b, q, t].cpu().numpy()) if codes.dtype == torch.uint64 else int(wide[b, q, t])
        raise ValueError(
            f"{name(b)}: code {value} at codebook {q}, frame {first_frame + t} is outside "
            f"[0, {config.codebook_size}) ({int(bad.sum())} bad values in the {scope})"
        )
    return wide


def check_codes_layout(codes: Any, config: Code2WavConfig, req_ids: Sequence[str] | None = None) -> None:
    """A batch ``[B, Q, T]``'s checks that read no value (type, dtype, rank, batch size, codebook
    count, frames); works on meta tensors and never waits for a device. ValueError on the first problem."""
    _check_tensor(codes, "", "[batch, codebooks, frames]")
    if codes.dim() != 3:
        one = " (one request? codes[None] is a batch of it)" if codes.dim() == 2 else ""
        raise ValueError(f"codes must have shape [batch, codebooks, frames], got {tuple(codes.shape)}{one}")
    if codes.shape[0] == 0:
        raise ValueError("codes hold no request (batch size 0)")
    _check_codebooks(codes.shape[1:], config, _name(req_ids, 0) if codes.shape[0] == 1 else "codes")
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
    values: bool = True,
) -> torch.Tensor:
    """Checks a batch ``[B, Q, T]`` of any integer dtype (and its ``lengths``) before any lookup;
    returns the lengths (int64, CPU). ``values=False``: the layout and lengths only (no device wait).

    Raises ``ValueError`` naming the request (id or index), codebook and frame of the first problem.
    Only frames inside each request's length are checked, so any pad value is accepted. On a GPU
    tensor the range check waits for the device (one host sync).
    """
    check_codes_layout(codes, config, req_ids)
    batch, _, n_frames = codes.shape
    if req_ids is not None and len(req_ids) != batch:  # else outputs would go to the wrong requests
        shown = f"{list(req_ids)[:8]!r}{' ...' if len(req_ids) > 8 else ''}"
        raise ValueError(f"{len(req_ids)} request ids for a batch of {batch} requests: req_ids {shown}")
    lengths = check_lengths(lengths, batch, n_frames, req_ids)
    if values:
        _check_values(codes, config, lambda i: _name(req_ids, i), "batch" if batch > 1 else "request", lengths)
    return lengths


def all_codes(chunks: Sequence[torch.Tensor], config: Code2WavConfig) -> bool:
    """Whether every value of these int64 tensors is a code: one pass per device (one sync on a GPU),
    where checking each would take one per tensor. It names nothing: check the tensors one by one
    where it says no."""
    for device in {c.device for c in chunks}:
        flat = [c.reshape(-1) for c in chunks if c.device == device and c.numel()]
        if flat:  # the least and the largest value: one kernel (a check per bound would take four)
            low, high = torch.stack(torch.aminmax(flat[0] if len(flat) == 1 else torch.cat(flat))).tolist()
            if low < 0 or high >= config.codebook_size:
                return False
    return True


def check_request_codes(
    codes: Any, config: Code2WavConfig, who: str, values: bool = True, chunk_from: int | None = None
) -> torch.Tensor:
    """One request's codes ``[Q, T]`` (``[1, Q, T]`` accepted) as int64 on their device, or a
    ValueError starting with ``who`` (``"request 'a'"``, ``"stream 3"``).

    ``values=False``: the layout only (type, dtype, shape, codebooks, frames; works on meta tensors).
    ``chunk_from``: a stream's chunk that starts at that frame: exactly ``[Q, n]``, ``n`` may be 0,
    bad values reported at their frame in the stream.
    """
    _check_tensor(codes, who, "[codebooks, frames]")
    if chunk_from is None and codes.dim() == 3 and codes.shape[0] == 1:
        codes = codes[0]
    if codes.dim() != 2:
        hint = " (a batch of one? pass codes[0])" if codes.dim() == 3 and codes.shape[0] == 1 else ""
        raise ValueError(_say(who, f"codes must have shape [codebooks, frames], got {tuple(codes.shape)}{hint}"))
    _check_codebooks(codes.shape, config, who)
    if codes.shape[1] == 0 and chunk_from is None:
        raise ValueError(f"{who} is empty (0 frames)")
    if not values:
        return codes.long()
    scope = "request" if chunk_from is None else "chunk"
    return _check_values(codes[None], config, lambda _: who, scope, first_frame=chunk_from or 0)[0]


def geometry(config: Code2WavConfig) -> tuple[int, int]:
    """What a code check depends on: ``(num_quantizers, codebook_size)``."""
    return config.num_quantizers, config.codebook_size


class CheckedCodes:
    """The mark of ``codes`` (and ``lengths``) that passed the checks for a codebook ``geometry``.

    A batch holds it under ``"checked"`` (``collate_codes`` adds it when every item was checked);
    :func:`validate_batch` skips a batch whose mark still holds: the same tensor objects, not written
    in place since (their version counters), the same geometry. A hand-built batch has no mark and is
    checked. Not detected: writes that bypass the version counter (through a NumPy view); a batch of
    inference tensors (no version counter) is always checked again.
    """

    __slots__ = ("codes", "lengths", "geometry", "versions")

    def __init__(self, codes: torch.Tensor, geometry: tuple[int, int], lengths: torch.Tensor | None = None) -> None:
        self.codes, self.lengths, self.geometry = codes, lengths, geometry
        self.versions = self._versions()

    def _versions(self) -> tuple[int, ...] | None:
        tensors = [t for t in (self.codes, self.lengths) if t is not None]
        if any(t.is_inference() for t in tensors):
            return None
        return tuple(t._version for t in tensors)

    def intact(self) -> bool:
        """Whether the marked tensors were not written in place since the mark."""
        return self.versions is not None and self.versions == self._versions()

    def holds(self, codes: Any, lengths: Any = None, config: Code2WavConfig | None = None) -> bool:
        """Whether ``codes`` (and ``lengths``) are the marked tensors, unwritten, checked for ``config``."""
        same = codes is self.codes and lengths is self.lengths
        return same and (config is None or geometry(config) == self.geometry) and self.intact()

    def moved(self, codes: torch.Tensor, lengths: torch.Tensor | None = None) -> CheckedCodes | None:
        """The mark for copies of the marked tensors (pinned, say), or None when it no longer holds."""
        return CheckedCodes(codes, self.geometry, lengths) if self.intact() else None

    def __getstate__(self) -> dict[str, Any]:  # a loader worker's batch: the tensors travel with the mark
        return {"codes": self.codes, "lengths": self.lengths, "geometry": self.geometry, "intact": self.intact()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.codes, self.lengths, self.geometry = state["codes"], state["lengths"], state["geometry"]
        self.versions = self._versions() if state["intact"] else None


def _marked(batch: dict[str, Any], config: Code2WavConfig) -> bool:
    """Whether ``batch`` holds a mark that still holds for its codes, lengths and request ids."""
    mark, codes, lengths, req_ids = batch.get("checked"), batch["codes"], batch.get("lengths"), batch.get("req_ids")
    if not isinstance(mark, CheckedCodes) or not isinstance(lengths, torch.Tensor):
        return False
    return mark.holds(codes, lengths, config) and (req_ids is None or len(req_ids) == codes.shape[0])


def validate_batch(batch: dict[str, Any], config: Code2WavConfig, drop_bad: bool = False) -> torch.Tensor:
    """:func:`validate_codes` of ``batch["codes"]`` with its ``lengths`` and ``req_ids``; returns the lengths.

    A batch whose ``"checked"`` mark holds (:class:`CheckedCodes`) is not checked again.
    ``drop_bad`` (predict, a batch with ``req_ids``): a request whose codes fail is taken out of the
    batch (``codes``, ``lengths``, ``req_ids``, in place) into ``batch["errors"]`` with its reason, so
    it fails alone and the others are decoded. A problem of the batch itself (its type, rank or
    codebook count, lengths that do not fit it) is raised.
    """
    codes, lengths, req_ids = batch["codes"], batch.get("lengths"), batch.get("req_ids")
    if _marked(batch, config):
        return lengths
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
    batch.pop("checked", None)
    return batch["lengths"]
