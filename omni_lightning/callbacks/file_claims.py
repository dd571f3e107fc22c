"""``FileClaims``: which requests of a batch ``WaveformWriter`` writes in this run, decided on the predict
loop's thread before the batch is queued.

A request gets a file once. Not when an earlier run finished it (counted as skipped: the data was
not told to skip it). Not twice in a run (a repeated id is an error line). Not into a file name that
another id holds (ids whose names differ only by case, on a file system that ignores case). The
claims change only through :meth:`FileClaims.commit`, once the batch is queued, so a decision that
was interrupted (Ctrl-C while the writer's queue is full) can be made again with the same result.

What it does not do: name files or read the folder (``data/output_folder.py``), or write anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from omni_lightning.data.job_lines import counted, other_format_line, other_weights_line, weights_source
from omni_lightning.data.output_folder import Finished, PredictPlan, file_name, file_stem
from omni_lightning.runner.output import OmniModelRunnerOutput

DUPLICATE = "duplicate id: a request with this id was already written in this run"


@dataclass
class Decision:
    """A batch's work: files to write ``(id, waveform, sample rate)``, manifest error lines, how many
    requests an earlier run finished, and the file names it claims (stem key -> id)."""

    files: list[tuple[str, Any, int]] = field(default_factory=list)
    lines: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    claims: dict[str, str] = field(default_factory=dict)


class FileClaims:
    """The run's claims on file names over an output folder's finished requests (see the module docstring).
    ``fold``: the file system ignores case, so names are compared casefolded."""

    def __init__(self, finished: Finished, fold: bool = False, audio_format: str = "wav") -> None:
        self.finished, self.fold, self.audio_format = finished, fold, audio_format
        self.owners = finished.owners(fold)  # file stem key -> the id written there
        self.claimed: set[str] = set()  # ids queued for writing in this run

    def decide(self, output: OmniModelRunnerOutput) -> Decision:
        d = Decision()
        for req_id, payload in zip(output.req_ids, output.pooler_output):
            # the data module skips finished requests and checks ids up front; plain dataloaders get this net
            stem = file_stem(req_id)
            key = stem.casefold() if self.fold else stem
            owner = d.claims.get(key, self.owners.get(key))
            if req_id in self.claimed or (owner == req_id and key in d.claims):
                d.lines.append(error_line(req_id, DUPLICATE))
            elif req_id in self.finished:
                d.skipped += 1
            elif owner is not None and owner != req_id:
                taken = f"its file name {file_name(req_id, self.audio_format)} is taken by request {owner!r}"
                d.lines.append(error_line(req_id, taken))
            else:
                d.claims[key] = req_id
                d.files.append((req_id, payload["model_outputs"], int(payload["sr"])))
        d.lines += [error_line(req_id, reason) for req_id, reason in output.errors.items()]
        return d

    def commit(self, decision: Decision) -> None:
        """Records a queued decision's claims."""
        self.claimed.update(decision.claims.values())
        self.owners.update(decision.claims)


def error_line(req_id: str, reason: str) -> dict[str, Any]:
    """A manifest line for a request that failed."""
    return {"id": req_id, "status": "error", "reason": reason}


def written_line(
    req_id: str, path: str, audio_format: str, subtype: str, n_samples: int, sr: int, weights: str | None = None
) -> dict[str, Any]:
    """A manifest line for a request whose file ``path`` (relative to the folder) is durable, made by
    ``weights`` (a :func:`~omni_lightning.data.job_lines.weights_label`; None: not recorded)."""
    return {
        "id": req_id,
        "path": path,
        "format": audio_format,
        "subtype": subtype,
        "n_samples": n_samples,
        "duration_s": n_samples / sr,
        "sr": sr,
        "status": "ok",
        **({"weights": weights} if weights is not None else {}),
    }


def weights_at_start(trainer: Any, pl_module: Any, finished: Finished) -> str | None:
    """At predict start (the trainer has loaded its checkpoint): the :func:`weights_in_use`, and a warning
    (rank zero) for the job's requests ``finished`` from other weights (:func:`other_weights_line`)."""
    weights = weights_in_use(trainer, pl_module)
    listed = getattr(trainer.datamodule, "predict_plan", None)
    said = other_weights_line(finished, listed.ids, weights) if isinstance(listed, PredictPlan) else None
    if said:
        rank_zero_warn(said.removeprefix("warning: "))
    return weights


def weights_in_use(trainer: Any, pl_module: Any) -> str | None:
    """The :func:`~omni_lightning.data.job_lines.weights_source` of the weights a predict runs on: the
    checkpoint the trainer loaded, else the module's own account of them (``weights_origin``: its
    checkpoint folder, random weights, a fit in this process); None where the module gives none."""
    origin = getattr(pl_module, "weights_origin", None)
    checkpoint = getattr(pl_module, "hparams", {}).get("checkpoint")
    loaded = checkpoint if checkpoint and origin == f"weights from {checkpoint}" else None  # not fine-tuned since
    return weights_source(getattr(trainer, "ckpt_path", None), loaded, origin)


def unwritten_warnings(listed: PredictPlan | None, writes_here: bool, finished: Finished, audio_format: str,
                       subtype: str) -> list[str]:  # fmt: skip
    """What a writer says at set-up of the listed requests it will not write: those finished in its folder
    in another format (they count as done), or, when the data skipped another folder's finished requests
    (``writes_here`` False), those."""
    if listed is None:
        return []
    other_format = other_format_line(finished, listed.ids, audio_format, subtype)
    said = [other_format.removeprefix("warning: ")] if other_format else []
    if not writes_here and listed.skipped:  # finished in another folder: never written to this one
        said.append(f"{counted(listed.skipped, 'request')} finished in skip_done={listed.out_dir}: not written here")
    return said
