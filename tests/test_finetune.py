"""Fine-tuning on (codes, audio) pairs with real Lightning trainers, then predict on the same module."""

import json
import math
from functools import partial

import lightning.pytorch as pl
import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import random_model
from helpers import precision_kwargs, trainer_kwargs

from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, CodesDataset, Trainer, collate_codes
from omni_lightning.callbacks.progress import start_lines
from omni_lightning.data.synthetic import make_demo_data, make_teacher
from omni_lightning.errors import UsageError
from omni_lightning.training.losses import MultiResolutionMelLoss


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pairs")
    teacher = make_teacher("tiny")
    train = make_demo_data(folder, 8, 1.0, 2.5, teacher=teacher, seed=0, name="train.jsonl")
    val = make_demo_data(folder, 4, 1.0, 2.0, teacher=teacher, seed=1, name="val.jsonl")
    return train, val


def datamodule(pairs, **kw):
    train, val = pairs
    return CodesDataModule(train=str(train), val=str(val), predict=str(val), batch_size=4, crop_frames=20, **kw)


def fit_kwargs(steps, **kw):
    base = trainer_kwargs(max_steps=steps, num_sanity_val_steps=0, limit_val_batches=0)
    return {**base, **kw}


class LossLog(pl.Callback):
    def __init__(self):
        self.losses, self.first_step = [], None

    def on_train_start(self, trainer, pl_module):
        self.first_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def mel_distance(module, val_manifest):
    """Mean mel L1 of the module's predictions (trainer.predict) against the teacher audio."""
    preds = Trainer(**trainer_kwargs()).predict(module, datamodule=CodesDataModule(predict=str(val_manifest)))
    ds = CodesDataset(str(val_manifest), "tiny")
    targets = {ds[i]["id"]: ds[i]["audio"] for i in range(len(ds))}
    mel = MultiResolutionMelLoss()
    dists = [
        float(mel(p["model_outputs"], targets[r][None]))
        for out in preds
        for r, p in zip(out.req_ids, out.pooler_output)
    ]
    return sum(dists) / len(dists)


def student(**kw):
    return Code2WavModule(model=random_model("tiny", seed=7), learning_rate=3e-3, **kw)


def test_fit_lowers_the_loss_and_moves_predictions_toward_the_targets(pairs):
    module = student(warmup_steps=2)
    before = mel_distance(module, pairs[1])
    log = LossLog()
    Trainer(**fit_kwargs(40, callbacks=[log])).fit(module, datamodule=datamodule(pairs))
    assert all(math.isfinite(x) for x in log.losses) and len(log.losses) == 40
    assert np.mean(log.losses[-5:]) < 0.85 * np.mean(log.losses[:5])
    module.train()  # as fit leaves it; predict must restore it afterwards
    after = mel_distance(module, pairs[1])  # the same in-memory module, no reload
    assert after < 0.9 * before
    assert module.training
    # predict's start-up line says so (it said "random weights" for a module fine-tuned a moment before)
    (line,) = start_lines(Trainer(**trainer_kwargs(gpu_memory_utilization=0.1)), module, module.config, 2_400_000)
    assert "weights fine-tuned in this process (40 steps); cpu 32-true" in line, line
    assert "no memory cap (gpu_memory_utilization 0.1 applies on a GPU)" in line, line  # on the CPU: no cap


class WeightLog(pl.Callback):
    """The model's weights after every optimizer step."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({n: p.detach().clone() for n, p in pl_module.model.named_parameters()})


def ema_of(steps, decay, start=None, updates=0):
    """The EMA of recorded weights, computed here: from ``start`` (an average of ``updates`` updates; else
    the first step's weights, one update), then ``lerp`` toward each next step's by the warmed-up weight
    ``max(1 - decay, 9 / (10 + n))``, ``n`` the updates before it."""
    avg = {n: t.clone() for n, t in (start or steps[0]).items()}
    for count, step in enumerate(steps if start else steps[1:], start=updates if start else 1):
        avg = {n: torch.lerp(avg[n], step[n], max(1 - decay, 9 / (10 + count))) for n in avg}
    return avg


def weights(module):
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


def assert_weights(module, expected):
    for name, p in module.model.named_parameters():
        assert torch.equal(p, expected[name]), name


@pytest.mark.parametrize("ema_decay", [None, 0.5])
def test_frozen_prefixes_stay_bit_identical(pairs, ema_decay):
    module = student(train_only=["decoder."], freeze=["decoder.0."], ema_decay=ema_decay)
    before = weights(module)
    Trainer(**fit_kwargs(3)).fit(module, datamodule=datamodule(pairs))
    for name, p in module.model.named_parameters():
        frozen = not name.startswith("decoder.") or name.startswith("decoder.0.")
        assert torch.equal(p, before[name]) == frozen, name
    with pytest.raises(ValueError, match="no model parameter starts with 'encoder.'"):
        student(freeze=["encoder."])


class ValidationWeights(pl.Callback):
    """The model's weights as validation sees them (the EMA callback swaps at the epoch start)."""

    def __init__(self):
        self.seen = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0:
            self.seen.append((trainer.global_step, weights(pl_module)))


def test_ema_weights_are_used_after_fit_and_raw_weights_restorable(pairs):
    module = student(ema_decay=0.5)
    log, val = WeightLog(), ValidationWeights()
    kw = fit_kwargs(4, callbacks=[log, val], limit_val_batches=1, val_check_interval=4, check_val_every_n_epoch=None)
    Trainer(**kw).fit(module, datamodule=datamodule(pairs))
    assert len(log.steps) == 4
    ema, raw = ema_of(log.steps, 0.5), log.steps[-1]
    assert [step for step, _ in val.seen] == [4]
    assert all(torch.equal(val.seen[0][1][n], ema[n]) for n in ema)  # validation during fit: the EMA weights
    assert_weights(module, ema)  # fit leaves the EMA weights in the model
    ema_model, raw_model = Code2Wav(module.config), Code2Wav(module.config)
    ema_model.load_state_dict({**module.model.state_dict(), **ema})
    raw_model.load_state_dict({**module.model.state_dict(), **raw})
    ema_model.eval(), raw_model.eval()
    preds = Trainer(**trainer_kwargs()).predict(module, datamodule=CodesDataModule(predict=str(pairs[1])))
    ds = CodesDataset(str(pairs[1]), "tiny")
    codes = {ds[i]["id"]: ds[i]["codes"] for i in range(len(ds))}
    with torch.inference_mode():
        for out in preds:
            for r, p in zip(out.req_ids, out.pooler_output):
                assert (p["model_outputs"] - ema_model(codes[r][None])[0]).abs().max() <= 1e-5
                assert (p["model_outputs"] - raw_model(codes[r][None])[0]).abs().max() > 1e-4
    module.use_ema(False)
    assert_weights(module, raw)
    module.use_ema(True)
    assert_weights(module, ema)
    validated = Trainer(**trainer_kwargs()).validate(module, datamodule=datamodule(pairs), verbose=False)[0]
    assert_weights(module, ema)  # a later validate evaluates the EMA weights and leaves them in
    module.use_ema(False)
    raw_metrics = Trainer(**trainer_kwargs()).validate(module, datamodule=datamodule(pairs), verbose=False)[0]
    assert validated["val/mel_distance"] != raw_metrics["val/mel_distance"]


def test_a_second_fit_averages_its_own_steps_and_its_last_checkpoint_keeps_both_weights(pairs, tmp_path):
    """The module keeps its EMA callback across fits: the second fit (a new Trainer, steps from 0) must
    average its own steps (it once kept the first fit's weights), and a ``last.ckpt`` saved as fit ends
    with no validation after the last step must hold the raw weights and the averaging state too."""
    module = student(ema_decay=0.5)
    Trainer(**fit_kwargs(2)).fit(module, datamodule=datamodule(pairs))
    log, ckpt = WeightLog(), pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    Trainer(**fit_kwargs(3, callbacks=[log, ckpt], enable_checkpointing=True)).fit(module, datamodule=datamodule(pairs))
    assert len(log.steps) == 3
    assert_weights(module, ema_of(log.steps, 0.5))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 3 and "current_model_state" in saved
    assert all(torch.equal(saved["current_model_state"][f"model.{n}"], t) for n, t in log.steps[-1].items())
    assert all(torch.equal(saved["state_dict"][f"model.{n}"], t) for n, t in ema_of(log.steps, 0.5).items())


class BatchIds(pl.Callback):
    def __init__(self):
        self.epochs = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.epochs.setdefault(trainer.current_epoch, []).append(tuple(batch["req_ids"]))


def test_each_epoch_of_fit_takes_its_batches_in_a_new_order(pairs):
    """Lightning calls ``set_epoch`` on the batch sampler's ``sampler``, not on the batch sampler: the
    shuffle's epoch reached it through that sampler (it stayed 0: every epoch in one order, and a fit
    with ``limit_train_batches`` trained on the same requests forever)."""
    ids = BatchIds()
    data = CodesDataModule(train=str(pairs[0]), batch_size=1, crop_frames=20)
    Trainer(**fit_kwargs(24, callbacks=[ids], max_epochs=3)).fit(student(), datamodule=data)
    orders = [ids.epochs[e] for e in range(3)]
    assert all(sorted(o) == sorted(orders[0]) and len(o) == 8 for o in orders)  # each request once an epoch
    assert len(set(map(tuple, orders))) == 3, orders  # seeded (seed + epoch): the same orders every run
    firsts = Trainer(**fit_kwargs(3, callbacks=[ids := BatchIds()], max_epochs=3, limit_train_batches=1))
    firsts.fit(student(), datamodule=data)
    assert len({ids.epochs[e][0] for e in range(3)}) > 1  # one batch an epoch: not the same request each time


def variant(pairs, tmp_path, extra):
    """The training manifest's first 3 lines (their files by absolute path) and ``extra``'s lines."""
    train = pairs[0]
    rows = [json.loads(line) for line in train.read_text().splitlines()[:3]]
    for row in rows:
        row.update({k: str(train.parent / row[k]) for k in ("codes", "audio")})
    path = tmp_path / "variant.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + extra))
    return path, rows


def test_bad_paired_requests_are_refused_or_skipped_by_name_never_trained_on(pairs, tmp_path):
    """A target with NaN samples (it turned every weight into NaN) and a line with no audio (it crashed
    the fit mid-run with "training needs paired data") are bad input. With ``on_bad_input="raise"`` the
    line and the NaN target are refused at set-up, naming them; with ``"skip"`` both
    are left out, each named in one warning, and the fit trains on the rest with finite weights."""
    wav, _ = sf.read(str(pairs[0].parent / json.loads(pairs[0].read_text().splitlines()[3])["audio"]), dtype="float32")
    wav[100:200] = np.nan
    sf.write(tmp_path / "nan.wav", wav, 24000, subtype="FLOAT")
    _, rows = variant(pairs, tmp_path, [])
    manifest, _ = variant(
        pairs,
        tmp_path,
        [
            {**rows[0], "id": "nan target", "audio": str(tmp_path / "nan.wav")},
            {"id": "no audio", "codes": rows[1]["codes"]},
        ],
    )
    with pytest.raises(UsageError, match="no audio: no 'audio' path in its manifest line") as err:
        CodesDataModule(train=str(manifest), on_bad_input="raise").setup("fit")
    assert "nan target: audio file" in str(err.value) and "non-finite" in str(err.value)
    data = CodesDataModule(train=str(manifest), batch_size=1, crop_frames=20, on_bad_input="skip")
    module = student()
    with pytest.warns(UserWarning) as caught:
        Trainer(**fit_kwargs(5)).fit(module, datamodule=data)
    said = [str(w.message) for w in caught]
    assert sum("'nan target' skipped: audio file" in m and "non-finite" in m for m in said) == 1, said
    assert sum("'no audio' skipped: no 'audio' path" in m for m in said) == 1, said
    assert all(torch.isfinite(p).all() for p in module.model.parameters())


def test_a_gan_batch_too_short_for_the_discriminators_names_its_requests(pairs, tmp_path):
    """It failed inside torch ("Padding size should be less than the corresponding input dimension")."""
    train = pairs[0]
    row = json.loads(train.read_text().splitlines()[0])
    wav, sr = sf.read(str(train.parent / row["audio"]), dtype="float32")
    sf.write(tmp_path / "tiny.wav", wav[:500], sr, subtype="FLOAT")
    (tmp_path / "m.jsonl").write_text(
        json.dumps({"id": "tiny clip", "codes": str(train.parent / row["codes"]), "audio": str(tmp_path / "tiny.wav")})
        + "\n"
    )
    data = CodesDataModule(train=str(tmp_path / "m.jsonl"), batch_size=1)
    with pytest.raises(UsageError, match=r"need >= 1025 samples: request\(s\) \['tiny clip'\] have fewer"):
        Trainer(**fit_kwargs(2)).fit(student(adversarial=True), datamodule=data)


def test_crops_start_inside_the_real_audio(pairs, tmp_path):
    """Audio shorter than its codes imply: a crop past its end had an all-padding target (length 0)."""
    train = pairs[0]
    row = json.loads(train.read_text().splitlines()[0])
    wav, sr = sf.read(str(train.parent / row["audio"]), dtype="float32")
    sf.write(tmp_path / "short.wav", wav[: len(wav) // 4], sr, subtype="FLOAT")
    (tmp_path / "m.jsonl").write_text(
        json.dumps({"id": "s", "codes": str(train.parent / row["codes"]), "audio": str(tmp_path / "short.wav")}) + "\n"
    )
    ds = CodesDataset(str(tmp_path / "m.jsonl"), "tiny", crop_frames=4, paired=True)
    assert ds.lengths[0] > 4 * 4  # the codes run far past the audio
    assert all(ds[0]["audio_length"] > 0 for _ in range(30))


def test_out_of_range_optimization_settings_are_refused_by_name():
    for kw, name in (
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"mel_weight": -0.5}, "mel_weight"),
        ({"discriminator_lr": float("nan")}, "discriminator_lr"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"decay_fraction": 0.0}, "decay_fraction"),
        ({"decay_fraction": 1.5}, "decay_fraction"),
        ({"decay_fraction": "half"}, "decay_fraction"),
    ):
        with pytest.raises(ValueError, match=name):
            Code2WavModule(model=random_model("tiny"), **kw)


def test_resume_from_a_lightning_checkpoint_continues_at_the_same_step(pairs, tmp_path):
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=4)
    first = student(ema_decay=0.9)
    Trainer(**fit_kwargs(4, callbacks=[ckpt], enable_checkpointing=True)).fit(first, datamodule=datamodule(pairs))
    last = tmp_path / "last.ckpt"
    assert last.is_file()
    saved = torch.load(last, weights_only=False)
    assert int(saved["averaging_state"]["n_averaged"]) == 4
    log, weight_log = LossLog(), WeightLog()
    resumed = student(ema_decay=0.9)
    trainer = Trainer(**fit_kwargs(7, callbacks=[log, weight_log]))
    trainer.fit(resumed, datamodule=datamodule(pairs), ckpt_path=str(last))
    assert log.first_step == 4 and trainer.global_step == 7 and len(log.losses) == 3
    # the EMA goes on from the checkpoint's average, not from the resumed weights
    average = {n: saved["state_dict"][f"model.{n}"] for n in weights(resumed)}
    assert_weights(resumed, ema_of(weight_log.steps, 0.9, start=average, updates=4))
    restored = Code2WavModule.load_from_checkpoint(str(last))  # the checkpoint's weights are the EMA weights
    assert_weights(restored, weights(first))
    assert restored.weights_origin == "weights from a Lightning checkpoint (step 4)"  # not "random weights"
    first.use_ema(False)  # and its raw weights are the ones fit ended with
    assert_weights(first, {n: saved["current_model_state"][f"model.{n}"] for n in weights(first)})


@pytest.mark.parametrize("workers", [0, 2])
def test_a_fit_resumed_at_an_epoch_end_takes_the_crops_and_weights_of_an_uninterrupted_one(pairs, tmp_path, workers):
    """Training crops are keyed on (seed, epoch, request), so the resumed epoch crops as the
    uninterrupted run's did (not epoch 0's crops again). With loader workers too: Lightning makes the
    resumed fit's first iterator before it sets the epoch, and workers started there must not use epoch 0."""
    data = partial(datamodule, pairs, num_workers=workers)
    whole_log, whole = LossLog(), student(total_steps=100)  # a fixed schedule: runs of other lengths agree
    Trainer(**fit_kwargs(4, callbacks=[whole_log])).fit(whole, datamodule=data())
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    first = Trainer(**fit_kwargs(2, callbacks=[ckpt], enable_checkpointing=True))
    first.fit(student(total_steps=100), datamodule=data())  # 8 requests, 4 a batch: one epoch
    log, resumed = LossLog(), student(total_steps=100)
    Trainer(**fit_kwargs(4, callbacks=[log])).fit(resumed, datamodule=data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert log.first_step == 2 and log.losses == whole_log.losses[2:]
    assert_weights(resumed, weights(whole))


def test_export_loads_into_transformers_with_equal_outputs(pairs, tmp_path):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    module = student(ema_decay=0.5)
    Trainer(**fit_kwargs(3)).fit(module, datamodule=datamodule(pairs))
    module.export_pretrained(str(tmp_path / "tuned"))
    ref = Qwen3OmniMoeCode2Wav.from_pretrained(tmp_path / "tuned").eval()
    ours = Code2Wav.from_pretrained(tmp_path / "tuned")
    codes = torch.randint(0, 2048, (2, 16, 11))
    ema = weights(module)
    with torch.inference_mode():
        assert (ours(codes) - ref(codes)).abs().max() <= 1e-5
        assert torch.equal(ours(codes), module.model.eval()(codes))  # the EMA weights
    module.export_pretrained(str(tmp_path / "raw"), ema=False)
    assert_weights(module, ema)  # the export put the EMA weights back
    module.use_ema(False)
    raw = Code2Wav.from_pretrained(tmp_path / "raw")
    with torch.inference_mode():
        assert torch.equal(raw(codes), module.model.eval()(codes))
        assert not torch.equal(raw(codes), ours(codes))


@pytest.fixture(scope="module")
def short_pairs(tmp_path_factory):
    """Two requests of 1 and 2 frames: one padded batch, the same at every step (no crops), short
    enough for the discriminators on a CPU (their bf16 convolutions have no fast CPU kernel)."""
    folder = tmp_path_factory.mktemp("short")
    return make_demo_data(folder, 2, 0.08, 0.16, teacher=make_teacher("tiny"), seed=2, name="short.jsonl")


# 16-mixed with the GAN only: without it, the GradScaler's path is Lightning's own automatic optimization
CASES = [
    ("32-true", False),
    ("32-true", True),
    ("bf16-mixed", False),
    ("bf16-mixed", True),
    ("bf16-true", False),
    ("bf16-true", True),
    ("16-mixed", True),
]


GPU_CASES = [(p, a) for p in ("32-true", "bf16-mixed", "bf16-true", "16-mixed") for a in (False, True)]
needs_cuda = pytest.mark.gpu
ACCELERATED = [
    pytest.param(device, p, a, id=f"{device}-{p}-{'gan' if a else 'rec'}", marks=[needs_cuda][: device == "gpu"])
    for device, cases in (("cpu", CASES), ("gpu", GPU_CASES))
    for p, a in cases
]


@pytest.mark.parametrize(("accelerator", "precision", "adversarial"), ACCELERATED)
def test_fine_tunes_in_every_precision_then_predicts_in_place(short_pairs, accelerator, precision, adversarial):
    """On the CPU, and on CUDA (Triton SnakeBeta, fused AdamW, channels-last discriminators) when present."""
    module = student(adversarial=adversarial)
    model_before = weights(module)
    disc_before = [p.detach().clone() for p in module.discriminators.parameters()] if adversarial else []
    data = CodesDataModule(train=str(short_pairs), val=str(short_pairs), predict=str(short_pairs), batch_size=2)
    trainer = Trainer(**{**fit_kwargs(1, limit_val_batches=1), **precision_kwargs(precision, accelerator)})
    trainer.fit(module, datamodule=data)  # one step, then validation on that same batch

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    # the step lowered the mel distance on its own batch (train/mel: before it; val/mel: after it;
    # with learning_rate=0 they differ by <= 0.2 %, here the step takes off 3-11 %)
    assert metrics["val/mel"] < 0.99 * metrics["train/mel"]
    assert all(not torch.equal(p, model_before[n]) for n, p in module.model.named_parameters())
    if adversarial:
        assert all(not torch.equal(a, b) for a, b in zip(disc_before, module.discriminators.parameters()))
        assert {"train/adv", "train/disc", "train/feature_matching"} <= set(metrics)
        # clipped and measured unscaled: under 16-mixed a norm still multiplied by the loss scale
        # (4,096) would be far above 200; these are about 1 (discriminators) and 20-40 (generator)
        assert 0 < metrics["train/grad_norm"] < 200 and 0 < metrics["train/disc_grad_norm"] < 200
    # the losses' windows and filterbanks stay fp32 and out of the checkpoint, whatever the precision
    assert all(b.dtype == torch.float32 for b in module.reconstruction_loss.module.buffers())
    assert not any(k.startswith(("reconstruction", "eval_metrics")) for k in module.state_dict())

    predictions = trainer.predict(module, datamodule=data)  # the same module and trainer, in place
    ds = CodesDataset(str(short_pairs), "tiny")
    lengths = {ds[i]["id"]: module.config.output_length(ds[i]["codes"].shape[-1]) for i in range(len(ds))}
    outputs = {r: p["model_outputs"] for out in predictions for r, p in zip(out.req_ids, out.pooler_output)}
    assert {r: w.shape for r, w in outputs.items()} == {r: (1, n) for r, n in lengths.items()}
    assert all(torch.isfinite(w).all() and w.dtype == torch.float32 for w in outputs.values())


def test_paired_data_alignment_resampling_and_crops(tmp_path):
    config_frames = 10
    codes = torch.randint(0, 2048, (16, config_frames))
    np.save(tmp_path / "a.npy", codes.numpy())
    n = Code2Wav("tiny").output_length(config_frames)  # 18645 samples at 24 kHz
    t = np.arange(int(n * 2 / 3) + 500) / 16000  # 16 kHz, longer than needed
    sf.write(tmp_path / "long16k.wav", np.sin(2 * np.pi * 440 * t).astype(np.float32), 16000)
    sf.write(tmp_path / "short.wav", np.full(1000, 0.5, np.float32), 24000)
    (tmp_path / "m.jsonl").write_text(
        '{"id": "long", "codes": "a.npy", "audio": "long16k.wav"}\n'
        '{"id": "short", "codes": "a.npy", "audio": "short.wav"}\n'
    )
    ds = CodesDataset(str(tmp_path / "m.jsonl"), "tiny")
    long, short = ds[0], ds[1]
    assert long["audio"].shape == (n,) and long["audio_length"] == n  # resampled to 24 kHz, then cut
    assert short["audio"].shape == (n,) and short["audio_length"] == 1000 and short["audio"][1000:].abs().sum() == 0
    batch = collate_codes([long, short])
    assert batch["audio"].shape == (2, n) and batch["audio_lengths"].tolist() == [n, 1000]
    # the GAN's segment length is read on the CPU, before the transfer: the step never waits for it
    assert Code2WavModule(model=Code2Wav("tiny")).on_before_batch_transfer(batch, 0)["shortest"] == 1000

    cropped = CodesDataset(str(tmp_path / "m.jsonl"), "tiny", crop_frames=4, seed=3)
    item = cropped[0]
    start = next(s for s in range(7) if torch.equal(codes[:, s : s + 4], item["codes"]))
    assert torch.equal(item["audio"], long["audio"][start * 1920 : start * 1920 + Code2Wav("tiny").output_length(4)])

    (tmp_path / "nopair.jsonl").write_text('{"id": "x", "codes": "a.npy"}\n')
    with pytest.raises(ValueError, match="paired data"):
        Trainer(**fit_kwargs(1)).fit(student(), datamodule=CodesDataModule(train=str(tmp_path / "nopair.jsonl")))
    (tmp_path / "badaudio.jsonl").write_text('{"id": "x", "codes": "a.npy", "audio": "nope.wav"}\n')
    with pytest.raises(ValueError, match="audio file .*nope.wav does not exist"):
        CodesDataset(str(tmp_path / "badaudio.jsonl"), "tiny")


def test_ema_update_is_torchs_average_bit_for_bit_with_the_count_on_the_host():
    """``EMAWeights`` swaps torch's ``AveragedModel`` update (two reads of a device count per step,
    a launch per parameter) for one foreach lerp and a host count: the same weights, bit for bit."""

    from torch.optim.swa_utils import AveragedModel

    from omni_lightning.training.ema import _HostCountedAverage, _lerp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    ours, theirs = (AveragedModel(net, use_buffers=False, avg_fn=partial(_lerp, 0.25)).float() for _ in range(2))
    ours.__class__ = _HostCountedAverage
    ours.weight = 0.25
    for _ in range(5):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ours.update_parameters(net)
        theirs.update_parameters(net)
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    assert int(ours.n_averaged) == int(theirs.n_averaged) == 5
    resumed = AveragedModel(net, use_buffers=False, avg_fn=partial(_lerp, 0.25)).float()
    resumed.load_state_dict(theirs.state_dict())  # a resumed fit: the count comes from the checkpoint
    resumed.__class__ = _HostCountedAverage
    resumed.weight = 0.25
    resumed.update_parameters(net)
    theirs.update_parameters(net)
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), theirs.parameters()))


def test_a_fused_run_resumes_under_a_mixed_precision(short_pairs, tmp_path):
    """32-true fits with fused AdamW; resumed under 16-mixed (a GradScaler, clipping), where Lightning
    refuses fused optimizers, it steps a foreach AdamW that loaded the fused run's state."""
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)
    data = CodesDataModule(train=str(short_pairs), batch_size=2)
    first = student()
    trainer = Trainer(**fit_kwargs(1, callbacks=[ckpt], enable_checkpointing=True))
    trainer.fit(first, datamodule=data)
    assert trainer.optimizers[0].defaults["fused"]
    resumed = student()
    trainer = Trainer(**{**fit_kwargs(3), **precision_kwargs("16-mixed")})
    trainer.fit(resumed, datamodule=data, ckpt_path=str(tmp_path / "last.ckpt"))
    optimizer = trainer.optimizers[0]
    assert trainer.global_step == 3 and not optimizer.defaults["fused"]
    assert int(optimizer.state[next(iter(resumed.model.parameters()))]["step"]) == 3
    assert all(torch.isfinite(p).all() for p in resumed.model.parameters())


def test_fit_with_training_data_only_runs_no_validation_and_validate_asks_for_it(short_pairs):
    data = CodesDataModule(train=str(short_pairs), batch_size=2)
    module = student()
    trainer = Trainer(**trainer_kwargs(max_steps=2))  # Lightning's defaults: validation on, sanity check on
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2 and not any(k.startswith("val/") for k in trainer.callback_metrics)
    with pytest.raises(UsageError, match="CodesDataModule has no 'validate' data: pass val="):
        trainer.validate(module, datamodule=data)
    # refused in setup, not in the dataloader hook, where Lightning 2.6 leaves DataLoader.__init__
    # patched when the hook raises (a later DataLoader with a positional batch size then fails)
    assert len(torch.utils.data.DataLoader([1, 2, 3], 2)) == 2
