"""``collate_codes``: requests to one right-padded batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def collate_codes(items: Sequence[dict[str, Any]], pad_value: int = 0) -> dict[str, Any]:
    """``{"codes": Long[B, Q, T], "lengths": Long[B], "req_ids": [...], "errors": {id: reason}}``.

    Pads with ``pad_value`` (a valid code, so the padded frames are safe to look up). Error items
    (bad input kept by ``on_bad_input="skip"``) go to ``errors`` and not into the batch. Paired data
    adds ``"audio": Float[B, N]`` and ``"audio_lengths": Long[B]``.
    """
    good = [it for it in items if "error" not in it]
    errors = {it["id"]: it["error"] for it in items if "error" in it}
    lengths = [it["codes"].shape[-1] for it in good]
    n_q = good[0]["codes"].shape[0] if good else 0
    codes = torch.full((len(good), n_q, max(lengths, default=0)), pad_value, dtype=torch.long)
    for i, it in enumerate(good):
        codes[i, :, : lengths[i]] = it["codes"]
    batch: dict[str, Any] = {
        "codes": codes,
        "lengths": torch.tensor(lengths, dtype=torch.long),
        "req_ids": [it["id"] for it in good],
        "errors": errors,
    }
    if good and all("audio" in it for it in good):
        n = max(it["audio"].shape[-1] for it in good)
        audio = torch.zeros(len(good), n)
        for i, it in enumerate(good):
            audio[i, : it["audio"].shape[-1]] = it["audio"]
        batch["audio"] = audio
        batch["audio_lengths"] = torch.tensor([it["audio_length"] for it in good], dtype=torch.long)
    return batch
