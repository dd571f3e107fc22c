"""Evaluation runs: an offline W&B run read back from disk, metric correctness, CSVLogger, val in fit."""

import csv
import math

import pytest
import soundfile as sf
import torch
from conftest import random_model
from helpers import trainer_kwargs
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from wandb_records import config, history, wait_for_exit

from omni_lightning import Code2WavModule, CodesDataModule, Trainer
from omni_lightning.data.synthetic import make_demo_data, make_teacher
from omni_lightning.evaluation.media import content_hash
from omni_lightning.evaluation.metrics import NAMES, AudioMetrics

METRICS = [f"val/{n}" for n in (*NAMES, "requests", "audio_s", "audio_s_per_s")]


@pytest.fixture(scope="module")
def val_manifest(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval")
    return make_demo_data(folder, 5, 1.0, 2.0, teacher=make_teacher(), seed=1, name="val.jsonl")


def eval_kwargs(logger, **kw):
    base = trainer_kwargs(**kw)
    base["logger"] = logger
    return base


def test_offline_wandb_run_holds_metrics_media_and_config_after_a_run_without_wandb(
    tmp_path, val_manifest, monkeypatch
):
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    module = Code2WavModule(model=random_model("tiny", seed=7), log_samples=3)
    data = CodesDataModule(val=str(val_manifest), batch_size=2)
    Trainer(**eval_kwargs(False)).validate(module, datamodule=data)  # no W&B first, as the demo does
    logger = WandbLogger(project="omni-lightning-test", save_dir=str(tmp_path), offline=True)
    try:
        Trainer(**eval_kwargs(logger)).validate(module, datamodule=data)
        run_dir = next((tmp_path / "wandb").glob("offline-run-*"))
    finally:
        wandb.finish()
    record_file = next(run_dir.glob("run-*.wandb"))
    wait_for_exit(record_file)
    rows = history(record_file)
    merged = {k: v for row in rows for k, v in row.items()}
    for key in METRICS:
        assert key in merged and math.isfinite(merged[key]), key
    assert merged["val/requests"] == 5
    ids = merged["val/generated/captions"]
    assert len(ids) == 3 and merged["val/reference/captions"] == ids
    assert merged["val/samples/nrows"] == 3 and merged["val/samples/ncols"] == 7
    media = run_dir / "files" / "media"
    wavs = sorted((media / "audio" / "val").glob("*.wav"))
    pngs = sorted((media / "images" / "val").glob("*.png"))
    assert len(wavs) == 6 and len(pngs) == 6
    for wav in wavs:
        info = sf.info(str(wav))
        assert info.samplerate == 24000 and info.frames > 20000
    table = next((media / "table" / "val").glob("samples_*.table.json")).read_text()
    assert all(i in table for i in ids)
    cfg = config(record_file)
    assert cfg["model/preset"] == "tiny" and cfg["model/content_hash"] == content_hash(module.model)
    assert cfg["data/validate"] == str(val_manifest) and cfg["hparams"]["log_samples"] == 3


def test_metrics_on_known_signals():
    gen = torch.Generator().manual_seed(0)
    t = torch.arange(24000) / 24000
    clean = 0.5 * torch.sin(2 * math.pi * 220 * t) + 0.2 * torch.sin(2 * math.pi * 1330 * t)
    metrics = AudioMetrics()
    metrics.update(clean[None, None], clean[None], torch.tensor([24000]))
    same = metrics.compute()
    assert same["mel_distance"] == 0 and same["stft_distance"] < 1e-5 and same["si_sdr"] > 100
    noise = torch.randn(24000, generator=gen)
    noise = noise * (clean.pow(2).mean() / noise.pow(2).mean()).sqrt() / math.sqrt(10)  # exactly 10 dB
    metrics.reset()
    metrics.update((clean + noise)[None, None], clean[None], torch.tensor([24000]))
    noisy = metrics.compute()
    assert abs(float(noisy["snr"]) - 10.0) <= 0.5 and noisy["mel_distance"] > 0.05
    # padding past a request's length is never scored
    metrics.reset()
    padded = torch.cat([clean, torch.ones(5000)])
    metrics.update(padded[None, None], torch.cat([clean, torch.zeros(5000)])[None], torch.tensor([24000]))
    assert metrics.compute()["si_sdr"] > 100 and metrics.compute()["audio_s"] == 1.0


def test_an_evaluation_that_scored_nothing_is_nan_not_perfect():
    """A checkpoint monitor (mode min) must not take an epoch whose requests were all skipped for its best."""
    empty = AudioMetrics().compute()
    assert all(math.isnan(float(empty[name])) for name in NAMES) and empty["requests"] == 0
    assert "loss" not in empty  # no batch brought losses
    metrics = AudioMetrics()
    clean = torch.sin(torch.arange(4800) / 10.0)
    metrics.update(
        clean[None, None],
        clean[None],
        torch.tensor([4800]),
        losses={"loss": torch.tensor(2.0), "mel": torch.tensor(0.5), "stft": torch.tensor(1.5)},
    )
    metrics.update(
        clean.repeat(3, 1)[:, None],
        clean.repeat(3, 1),
        torch.tensor([4800] * 3),
        losses={"loss": torch.tensor(1.0), "mel": torch.tensor(0.25), "stft": torch.tensor(0.75)},
    )
    out = metrics.compute()  # losses are batch means: weighted by batch size, as Lightning's logging did
    assert out["loss"] == pytest.approx((2.0 + 3 * 1.0) / 4) and out["mel"] == pytest.approx((0.5 + 0.75) / 4)


def test_a_padded_batch_scores_like_each_request_cut():
    """One batched update (no per-request loop) equals the per-request definitions: spectral
    distances on each cut request, SI-SDR and SNR from torchmetrics on it; padding is junk here."""
    from torchmetrics.functional.audio import scale_invariant_signal_distortion_ratio, signal_noise_ratio

    gen = torch.Generator().manual_seed(3)
    lengths = [24000, 13001, 7000]
    pred, target = torch.randn(3, 1, 24000, generator=gen), torch.randn(3, 24000, generator=gen)
    target[:, :13001] += 2 * pred[:, 0, :13001]  # some signal in common, so SI-SDR and SNR are not all noise
    for i, n in enumerate(lengths):
        pred[i, :, n:], target[i, n:] = 9.0, -9.0
    metrics = AudioMetrics()
    metrics.update(pred, target, torch.tensor(lengths))
    batched = metrics.compute()
    cut = [(pred[i, 0, :n], target[i, :n]) for i, n in enumerate(lengths)]
    expected = {
        "mel_distance": [metrics.mel(p[None], t[None]) for p, t in cut],
        "stft_distance": [metrics.stft(p[None], t[None]) for p, t in cut],
        "si_sdr": [scale_invariant_signal_distortion_ratio(p, t) for p, t in cut],
        "snr": [signal_noise_ratio(p, t) for p, t in cut],
    }
    for name, values in expected.items():
        torch.testing.assert_close(batched[name], torch.stack(values).double().mean(), rtol=1e-5, atol=1e-6)
    assert batched["requests"] == 3 and batched["audio_s"] == sum(lengths) / 24000


def read_csv(folder):
    path = next(folder.rglob("metrics.csv"))
    with open(path) as f:
        return list(csv.DictReader(f))


def test_csv_logger_gets_the_same_metrics(tmp_path, val_manifest):
    module = Code2WavModule(model=random_model("tiny", seed=7))
    Trainer(**eval_kwargs(CSVLogger(str(tmp_path)))).validate(
        module, datamodule=CodesDataModule(val=str(val_manifest), batch_size=2)
    )
    rows = read_csv(tmp_path)
    merged = {k: v for r in rows for k, v in r.items() if v}
    assert all(key in merged and math.isfinite(float(merged[key])) for key in METRICS)


def test_validation_every_k_steps_during_fit(tmp_path, val_manifest):
    module = Code2WavModule(model=random_model("tiny", seed=7), learning_rate=1e-3)
    dm = CodesDataModule(train=str(val_manifest), val=str(val_manifest), batch_size=2, crop_frames=12)
    kw = eval_kwargs(
        CSVLogger(str(tmp_path)),
        max_steps=4,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
    )
    Trainer(**kw).fit(module, datamodule=dm)
    steps = sorted({int(r["step"]) for r in read_csv(tmp_path) if r.get("val/mel_distance")})
    assert len(steps) == 2 and steps[-1] >= 3


def test_an_offline_run_of_in_memory_pairs_names_their_count_not_their_tensors(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    module = Code2WavModule(model=random_model("tiny", seed=7), log_samples=1)
    gen = torch.Generator().manual_seed(3)
    pairs = {
        f"u{i}": (torch.randint(0, 2048, (16, 12), generator=gen), 0.1 * torch.randn(module.model.output_length(12)))
        for i in range(3)
    }
    logger = WandbLogger(project="omni-lightning-test", save_dir=str(tmp_path), offline=True)
    try:
        Trainer(**eval_kwargs(logger)).validate(module, datamodule=CodesDataModule(val=pairs, batch_size=2))
        run_dir = next((tmp_path / "wandb").glob("offline-run-*"))
    finally:
        wandb.finish()
    record_file = next(run_dir.glob("run-*.wandb"))
    wait_for_exit(record_file)
    assert config(record_file)["data/validate"] == "<in memory: 3 requests>"


def test_the_metrics_line_shows_what_a_listener_hears_first_and_the_waveform_match_apart():
    """A vocoder's phase is free: SI-SDR and SNR are named apart, after the magnitudes and perceptual scores."""
    from omni_lightning.evaluation.metrics import metrics_line

    metrics = {"val/audio_s": 1.5, "val/si_sdr": -18.1, "val/snr": -2.0, "val/stoi": 0.61, "val/pesq_unscored": 0.0,
               "val/mel_distance": 0.2706, "val/pesq": 2.5, "val/requests": 3.0, "val/stft_distance": 1.2}  # fmt: skip
    heard, waveform = metrics_line(metrics).split("; ")
    assert heard.startswith("val/mel_distance=0.2706, val/stft_distance=1.2, val/pesq=2.5, val/pesq_unscored=0, "
                            "val/stoi=0.61, "), heard  # fmt: skip
    assert waveform == "waveform match (phase-sensitive): val/si_sdr=-18.1, val/snr=-2", waveform
    assert metrics_line({"test/mel_distance": 0.5}) == "test/mel_distance=0.5"
