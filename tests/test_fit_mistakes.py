"""What a new user's realistic fit and evaluation inputs do: each works, or is one clear error
naming the bad value, found at set-up where the docs say so."""

import json

import numpy as np
import pytest
import soundfile as sf
import torch
from helpers import micro_config, random_model, trainer_kwargs
from lightning.pytorch.loggers import WandbLogger

from omni_lightning import Code2WavModule, CodesDataModule, CodesDataset, Trainer
from omni_lightning.errors import UsageError
from omni_lightning.evaluation.metrics import AudioMetrics
from omni_lightning.training.losses import MultiResolutionSTFTLoss

CONFIG = micro_config()


def manifest(folder, audio: dict[str, np.ndarray], subtype="FLOAT", frames=4, suffix=".wav"):
    """A paired manifest of ``frames``-frame requests, one per audio array (24 kHz files)."""
    lines = []
    for i, (name, samples) in enumerate(audio.items()):
        np.save(folder / f"{name}.npy", np.random.default_rng(i).integers(0, 2048, (16, frames)))
        if samples is not None:
            sf.write(folder / f"{name}{suffix}", samples, 24000, subtype=subtype)
        lines.append({"id": name, "codes": f"{name}.npy", "audio": f"{name}{suffix}"})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_float_wav_holding_nan_or_inf_is_refused_at_set_up_naming_it(tmp_path):
    good = 0.1 * np.random.default_rng(0).standard_normal(CONFIG.output_length(4)).astype(np.float32)
    nan, inf = good.copy(), good.copy()
    nan[7], inf[9] = np.nan, -np.inf
    path = manifest(tmp_path, {"good": good, "nan": nan, "inf": inf})
    with pytest.raises(UsageError, match="2 bad") as err:
        CodesDataset(path, CONFIG, paired=True)
    assert "nan.wav holds 1 non-finite" in str(err.value) and "inf.wav holds 1 non-finite" in str(err.value)
    kept = CodesDataset(path, CONFIG, paired=True, on_bad_input="skip")  # skip: found when loaded
    assert "error" not in kept[0] and "non-finite" in kept[1]["error"] and "non-finite" in kept[2]["error"]


def test_an_undecodable_audio_file_is_not_called_missing(tmp_path):
    path = manifest(tmp_path, {"a": None}, suffix=".mp3")
    (tmp_path / "a.mp3").write_bytes(b"\xff\xfb\x90\x00" + bytes(64))
    with pytest.raises(UsageError, match="a.mp3 could not be read") as err:
        CodesDataset(path, CONFIG, paired=True)
    assert "does not exist" not in str(err.value)


def test_a_reference_shorter_than_the_spectrogram_window_is_logged_to_wandb(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    module = Code2WavModule(model=random_model(CONFIG), log_samples=2)
    short = 0.1 * torch.randn(300)  # a clip of 12.5 ms under 4 frames of codes: zero-padded, 300 real samples
    pairs = {"short": (torch.randint(0, 2048, (16, 4)), short)}
    logger = WandbLogger(project="omni-lightning-test", save_dir=str(tmp_path), offline=True)
    try:
        metrics = Trainer(**{**trainer_kwargs(), "logger": logger}).validate(
            module, datamodule=CodesDataModule(val=pairs, config=CONFIG), verbose=False
        )
    finally:
        wandb.finish()
    assert metrics[0]["val/requests"] == 1
    assert len(list((tmp_path / "wandb").glob("offline-run-*/files/media/audio/val/*.wav"))) == 2


def test_a_silent_target_gives_a_bounded_stft_loss_and_leaves_other_items_alone():
    """Spectral convergence divides by the target's norm: against digital silence it gave millions."""
    gen = torch.Generator().manual_seed(0)
    pred, target = 0.1 * torch.randn(2, 12000, generator=gen), 0.1 * torch.randn(2, 12000, generator=gen)
    target[1] = 0
    loss = MultiResolutionSTFTLoss()
    per_item = loss(pred, target, reduction="none")
    assert per_item[1] < 50, per_item
    torch.testing.assert_close(per_item[0], loss(pred[:1], target[:1])[()])
    quiet = loss(pred[:1], 1e-3 * target[:1])  # quiet but audible: convergence still counts
    assert quiet > loss(pred[:1], target[:1]) + 100


def test_si_sdr_and_snr_are_means_over_requests_whose_reference_is_not_silent():
    gen = torch.Generator().manual_seed(0)
    pred, target = 0.1 * torch.randn(3, 1, 6000, generator=gen), 0.1 * torch.randn(3, 6000, generator=gen)
    target[1] = 0
    target[2, 3000:] = 0
    lengths = torch.tensor([6000, 6000, 3000])
    metrics = AudioMetrics()
    metrics.update(pred, target, lengths)
    out = metrics.compute()
    audible = AudioMetrics()
    audible.update(pred[[0, 2]], target[[0, 2]], lengths[[0, 2]])
    for name in ("si_sdr", "snr"):
        torch.testing.assert_close(out[name], audible.compute()[name])
    assert out["requests"] == 3 and torch.isfinite(out["mel_distance"])
    silent = AudioMetrics()
    silent.update(pred[1:2], target[1:2], lengths[1:2])
    assert torch.isnan(silent.compute()["si_sdr"]) and torch.isfinite(silent.compute()["stft_distance"])
    pred[0] = float("nan")  # a diverged model's NaN is never left out
    broken = AudioMetrics()
    broken.update(pred, target, lengths)
    assert torch.isnan(broken.compute()["si_sdr"])


def test_pairs_whose_audio_is_far_longer_or_shorter_than_their_codes_are_named_in_one_warning(recwarn):
    """Cut or padded as documented, but a 44.1 kHz file taken as 24 kHz, or a wrong pair, is named."""
    n = CONFIG.output_length(8)
    pairs = {
        name: (torch.randint(0, 2048, (16, 8)), 0.1 * torch.randn(length))
        for name, length in [("close", n - 100), ("near", n + 1920), ("44k", n * 441 // 240), ("short", n // 3)]
    }
    CodesDataset(pairs, CONFIG, paired=True)
    said = [str(w.message) for w in recwarn if "pair(s)" in str(w.message)]
    assert len(said) == 1 and "2 pair(s)" in said[0], said
    assert "44k (" in said[0] and "short (" in said[0] and "close" not in said[0] and "near" not in said[0]


def test_audio_past_the_models_clamped_range_is_named_in_one_warning(tmp_path, recwarn):
    """int16 samples taken as floats (a missing / 32768) are targets the clamped output never reaches."""
    n = CONFIG.output_length(4)
    loud = 0.1 * np.random.default_rng(0).standard_normal(n).astype(np.float32)
    CodesDataset({"scaled": (torch.randint(0, 2048, (16, 4)), torch.from_numpy(loud * 32768))}, CONFIG, paired=True)
    clipped = np.clip(loud * 20, -1, 1)
    path = manifest(tmp_path, {"hot": loud * 20, "clipped": clipped})  # float WAVs
    CodesDataset(path, CONFIG, paired=True)  # raise: float files are read whole, so their peak is known
    manifest(tmp_path, {"pcm": clipped}, subtype="PCM_16")
    CodesDataset(path.with_name("pairs.jsonl"), CONFIG, paired=True)
    said = [str(w.message) for w in recwarn if "pair(s)" in str(w.message)]
    assert len(said) == 2, said
    assert (
        "1 pair(s) in <memory>" in said[0]
        and f"scaled (peak {np.abs(loud).max() * 32768:.3g}, past the model's [-1, 1])" in said[0]
    )
    assert "hot (peak" in said[1] and "clipped" not in said[1] and "/ 32768" in said[1]
