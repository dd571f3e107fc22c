"""``collate_codes``: requests to one right-padded batch, marked as checked when every request was."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omni_lightning.models.codes import CheckedCodes


class CodesBatch(dict):
    """The dict ``collate_codes`` returns. Its ``pin_memory`` (which a DataLoader with
    ``pin_memory=True`` calls) moves the ``"checked"`` mark to the pinned copies, so a pinned batch
    is not checked again either."""

    def pin_memory(self) -> CodesBatch:
        with torch.inference_mode(False):  # a loader without workers pins inside predict's inference mode
            pinned = CodesBatch({k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in self.items()})
        mark = pinned.pop("checked", None)
        if isinstance(mark, CheckedCodes) and mark.holds(self["codes"], self["lengths"]):
            pinned["checked"] = mark.moved(pinned["codes"], pinned["lengths"])
        return pinned


def collate_codes(items: Sequence[dict[str, Any]], pad_value: int = 0) -> dict[str, Any]:
    """``{"codes": Long[B, Q, T], "lengths": Long[B], "req_ids": [...], "errors": {id: reason}}``.

    Pads with ``pad_value`` (a valid code, so the padded frames are safe to look up). Error items
    (bad input kept by ``on_bad_input="skip"``) go to ``errors`` and not into the batch. Paired data
    adds ``"audio": Float[B, N]`` and ``"audio_lengths": Long[B]``. When every request carries an
    intact ``"checked"`` mark of one geometry (``CodesDataset`` items do), the batch gets its own
    (``CheckedCodes``), and ``validate_batch`` does not check it again. Returns a ``CodesBatch``.
    """
    good = [it for it in items if "error" not in it]
    errors = {it["id"]: it["error"] for it in items if "error" in it}
    lengths = [it["codes"].shape[-1] for it in good]
    n_q = good[0]["codes"].shape[0] if good else 0
    with torch.inference_mode(False):  # plain tensors: their version counters show a write after the mark
        codes = torch.full((len(good), n_q, max(lengths, default=0)), pad_value, dtype=torch.long)
        for i, it in enumerate(good):
            codes[i, :, : lengths[i]] = it["codes"]
        batch = CodesBatch(codes=codes, lengths=torch.tensor(lengths, dtype=torch.long))
    batch.update(req_ids=[it["id"] for it in good], errors=errors)
    if good and all("audio" in it for it in good):
        n = max(it["audio"].shape[-1] for it in good)
        audio = torch.zeros(len(good), n)
        for i, it in enumerate(good):
            audio[i, : it["audio"].shape[-1]] = it["audio"]
        batch["audio"] = audio
        batch["audio_lengths"] = torch.tensor([it["audio_length"] for it in good], dtype=torch.long)
    marks = [it.get("checked") for it in good]
    intact = all(isinstance(m, CheckedCodes) and m.holds(it["codes"]) for m, it in zip(marks, good))
    if good and intact and len({m.geometry for m in marks}) == 1:
        batch["checked"] = CheckedCodes(batch["codes"], marks[0].geometry, batch["lengths"])
    return batch
