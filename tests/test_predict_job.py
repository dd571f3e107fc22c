"""A predict job's accounting: requests a limit left unrun are counted, and returned predictions
keep about their own size resident."""

import ctypes
import gc
import os

import pytest
from conftest import random_codes
from helpers import TINY, trainer_kwargs

from omni_lightning import Code2WavModule, CodesDataModule, Trainer, WaveformWriter


def test_a_predict_limited_to_no_batch_counts_every_request_as_not_run(tmp_path, model):
    """Lightning runs no predict hook after ``setup`` at ``limit_predict_batches=0``: the counts the
    writer set there are the summary."""
    (tmp_path / "out" / ".a.wav.tmp").mkdir(parents=True)  # a folder so named is the user's: kept
    writer = WaveformWriter(tmp_path / "out")
    data = CodesDataModule(predict={"a": random_codes(1, 3)[0], "b": random_codes(1, 4)[0]}, skip_done=tmp_path / "out")
    Trainer(**trainer_kwargs(callbacks=[writer], limit_predict_batches=0)).predict(
        Code2WavModule(model=model), datamodule=data, return_predictions=False
    )
    assert writer.stats["missing"] == 2 and writer.stats["limited"] and not writer.any_failed
    assert "2 requests not run (the trainer limits predict batches" in writer.summary()
    assert (tmp_path / "out" / ".a.wav.tmp").is_dir()


def rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "malloc_trim") or not os.path.exists("/proc/self/status"),
    reason="measures glibc's heap through /proc",
)
def test_returned_predictions_keep_about_their_own_size_resident(model):
    job = {f"r{i}": random_codes(1, 190, seed=80 + i)[0] for i in range(4)}  # 4 x 15 s
    module = Code2WavModule(model=model)

    def predict(keep):
        data = CodesDataModule(predict=job, batch_size=4, config="tiny")
        return Trainer(**trainer_kwargs()).predict(module, datamodule=data, return_predictions=keep)

    predict(False)  # one-off growth (kernel caches, thread pools) is not what is measured
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    before = rss_bytes()
    outputs = predict(True)
    gc.collect()
    growth = rss_bytes() - before
    audio = sum(p["model_outputs"].nbytes for out in outputs for p in out.pooler_output)
    assert audio == 4 * TINY.output_length(190) * 4
    assert growth <= 1.5 * audio + 16e6, f"{growth / 1e6:.0f} MB resident for {audio / 1e6:.0f} MB of audio"
