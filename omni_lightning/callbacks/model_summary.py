"""``ParameterSummary``: Lightning's model summary at the start of fit, less a FLOPs count it never took."""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # where Lightning's own summary goes


class ParameterSummary(ModelSummary):
    """Lightning's ``ModelSummary`` table (layers, parameters, trainable, size, modes), as plain text.

    Lightning counts FLOPs only through a forward on the module's ``example_input_array``; a module
    without one (``Code2WavModule``: its input is a batch of codes) gets a FLOPs column of zeros and
    ``Total FLOPs: 0``, which this summary leaves out. A module with one keeps them.
    """

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            ModelSummary.summarize(
                summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, total_flops
            )
            return
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, 0, *columns
        )
        log.info("\n" + table.rsplit("\n", 1)[0])  # its last line is the FLOPs total
