"""The progress bar counts audio seconds, not batches."""

import pytest
import torch
from conftest import random_codes
from helpers import TINY, trainer_kwargs

from omni_lightning import Code2WavModule, CodesDataModule, Trainer
from omni_lightning.callbacks.progress import AudioProgressBar


def test_progress_bar_counts_audio_seconds_on_length_sorted_batches(model):
    lengths = [2, 30, 3, 25, 4]
    job = {f"r{i}": random_codes(1, n, seed=i)[0] for i, n in enumerate(lengths)}
    job["bad"] = torch.full((16, 3), -1)
    bar = AudioProgressBar()
    kw = {**trainer_kwargs(callbacks=[bar]), "enable_progress_bar": True}
    data = CodesDataModule(predict=job, batch_size=2, config="tiny")
    Trainer(**kw).predict(Code2WavModule(model=model), datamodule=data, return_predictions=False)
    total = sum(TINY.output_length(n) for n in lengths) / TINY.sample_rate
    tqdm = bar.predict_progress_bar
    assert tqdm.total == pytest.approx(total, abs=0.05) and tqdm.n == tqdm.total  # audio seconds, not batches
    assert "requests=6/6" in tqdm.postfix
