"""Fine-tuning from (codes, audio) pairs held in memory, and the "checked" mark of collated batches."""

import functools

import numpy as np
import pytest
import soundfile as sf
import torch
from helpers import random_codes, random_model, trainer_kwargs

from omni_lightning import Code2WavModule, CodesDataModule, CodesDataset, Trainer, collate_codes
from omni_lightning.data.synthetic import make_teacher
from omni_lightning.errors import UsageError
from omni_lightning.models import Code2WavConfig
from omni_lightning.models.codes import validate_batch

TINY = Code2WavConfig.from_name("tiny")


@functools.cache
def teacher():
    return make_teacher("tiny")


def teacher_pairs(lengths, seed=0):
    """(codes, audio) pairs: random codes and a fixed teacher's audio, made under inference mode as a
    user's talker and vocoder would."""
    pairs = []
    with torch.inference_mode():
        for i, n in enumerate(lengths):
            codes = random_codes(1, n, seed=seed + i)[0]
            pairs.append((codes, teacher()(codes[None])[0, 0]))
    return pairs


def test_pairs_in_memory_give_the_items_the_same_pairs_on_disk_give(tmp_path):
    """Alignment (cut, zero padded with ``audio_length``) and crops are the files' rule, exactly."""
    n_samples = [TINY.output_length(12) + 700, 3000, TINY.output_length(9)]  # longer, shorter, exact
    pairs, rows = {}, []
    for i, (frames, n) in enumerate(zip((12, 30, 9), n_samples)):
        codes = random_codes(1, frames, seed=i)[0].to(torch.int16)
        audio = torch.sin(torch.arange(n) / (7.0 + i)) * 0.5
        np.save(tmp_path / f"{i}.npy", codes.numpy())
        sf.write(tmp_path / f"{i}.wav", audio.numpy(), TINY.sample_rate, subtype="FLOAT")
        rows.append(f'{{"id": "r{i}", "codes": "{i}.npy", "audio": "{i}.wav"}}\n')
        shaped = audio[None] if i == 1 else audio  # [1, n] is accepted too
        pairs[f"r{i}"] = (codes.numpy() if i == 2 else codes, shaped.numpy() if i == 2 else shaped)
    (tmp_path / "m.jsonl").write_text("".join(rows))
    for crop in (None, 4):
        files = CodesDataset(str(tmp_path / "m.jsonl"), "tiny", crop_frames=crop, seed=5, paired=True)
        memory = CodesDataset(pairs, "tiny", crop_frames=crop, seed=5, paired=True)
        assert memory.ids == files.ids and memory.lengths == files.lengths and not memory.reads_files
        files.set_epoch(2), memory.set_epoch(2)
        for i in range(3):
            want, got = files[i], memory[i]
            assert torch.equal(got["codes"], want["codes"]) and got["codes"].dtype == torch.long
            assert torch.equal(got["audio"], want["audio"]) and got["audio_length"] == want["audio_length"]
    short = CodesDataset(pairs, "tiny")[1]
    assert short["audio_length"] == 3000 and short["audio"][3000:].abs().sum() == 0
    assert short["audio"].shape == (TINY.output_length(30),)
    listed = CodesDataset(list(pairs.values()), "tiny", paired=True)
    assert listed.ids == ["0", "1", "2"] and torch.equal(listed[0]["audio"], CodesDataset(pairs, "tiny")[0]["audio"])


@pytest.mark.parametrize(
    "pair, match",
    [
        (
            (random_codes(1, 5)[0], torch.zeros(100, dtype=torch.int16)),
            r"'x': audio has dtype int16; it must be a float",
        ),
        ((random_codes(1, 5)[0], torch.zeros(2, 100)), r"'x': audio has shape \(2, 100\); .* at 24000 Hz \(mono\)"),
        ((random_codes(1, 5)[0], torch.zeros(0)), r"'x': audio is empty"),
        ((random_codes(1, 5)[0], torch.tensor([0.0, float("nan")])), r"'x': audio holds 1 non-finite sample"),
        ((random_codes(1, 5)[0], [0.0, 0.1]), r"'x': audio must be a float tensor .* got list"),
        ((random_codes(1, 5)[0].float(), torch.zeros(100)), r"'x': codes have dtype float32"),
        ((random_codes(1, 5)[0] + 2048, torch.zeros(100)), r"'x': code \d+ at codebook 0, frame 0 is outside"),
        ((np.array([["a"]]), torch.zeros(100)), r"'x': codes holds <U1 values; codes must be integers"),
        ((random_codes(1, 5)[0], torch.zeros(100), 3), r"x: a pair is \(codes, audio\), got a tuple of 3"),
    ],
)
def test_a_bad_pair_is_refused_naming_its_id_or_skipped(pair, match):
    with pytest.raises(UsageError, match=match):
        CodesDataset({"x": pair, "ok": teacher_pairs([4])[0]}, "tiny", paired=True)
    skipped = CodesDataset({"x": pair, "ok": teacher_pairs([4])[0]}, "tiny", paired=True, on_bad_input="skip")
    assert list(skipped.bad) == ["x"] and skipped[0]["id"] == "x" and "error" in skipped[0]


def test_codes_without_audio_are_refused_for_fit_validate_and_test():
    with pytest.raises(UsageError, match=r"<memory> has no audio: .* need paired data, \(codes, audio\) pairs"):
        CodesDataModule(train=[random_codes(1, 5)[0]], config="tiny").setup("fit")
    mixed = CodesDataset({"a": random_codes(1, 5)[0], "b": teacher_pairs([5])[0]}, "tiny", paired=True,
                         on_bad_input="skip")  # fmt: skip
    assert mixed.bad == {
        "a": "codes without audio, not a (codes, audio) pair: fit, validate and test compare against it"
    }


def test_fit_validate_and_test_run_on_pairs_in_memory():
    pairs = teacher_pairs([10, 7, 12, 6])
    data = CodesDataModule(train=pairs, val=pairs[:2], test={"t": pairs[2]}, config="tiny", batch_size=2, crop_frames=6)
    module = Code2WavModule(model=random_model("tiny", seed=7).train(), learning_rate=3e-3)
    before = [p.detach().clone() for p in module.model.parameters()]
    trainer = Trainer(**trainer_kwargs(max_steps=2, num_sanity_val_steps=0, limit_val_batches=1))
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2 and "val/loss" in trainer.callback_metrics
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))
    (val,) = Trainer(**trainer_kwargs()).validate(module, datamodule=data)
    (test,) = Trainer(**trainer_kwargs()).test(module, datamodule=data)
    assert val["val/requests"] == 2 and test["test/requests"] == 1
    assert all(np.isfinite(v) for v in (*val.values(), *test.values()))


def batch_of(loader):
    return next(iter(loader))


def test_a_collated_batch_is_marked_checked_and_its_module_check_is_skipped():
    """A NumPy-view write bypasses the version counter: validate_batch not raising on it shows the
    marked batch was not read again, while the same codes in a hand-built batch are refused."""
    data = CodesDataModule(predict={"a": random_codes(1, 6)[0], "b": random_codes(1, 4, seed=1)[0]}, config="tiny")
    data.setup("predict")
    with torch.inference_mode():  # as in trainer.predict: the batch's tensors still have version counters
        batch = batch_of(data.predict_dataloader()[0])
    assert "checked" in batch
    row = batch["req_ids"].index("a")
    batch["codes"].numpy()[row, 0, 0] = 5000  # unseen by the mark (documented): proves the skip
    assert validate_batch(batch, TINY).tolist() == [6 if r == "a" else 4 for r in batch["req_ids"]]
    hand_built = {k: batch[k] for k in ("codes", "lengths", "req_ids")}
    with pytest.raises(ValueError, match=r"request 'a': code 5000 at codebook 0, frame 0"):
        validate_batch(hand_built, TINY)


@pytest.mark.parametrize("change", ["in place", "replaced", "lengths", "geometry", "ids"])
def test_a_batch_changed_after_collate_is_checked_again(change):
    ds = CodesDataset({"a": random_codes(1, 6)[0], "b": random_codes(1, 4, seed=1)[0]}, "tiny")
    batch = collate_codes([ds[0], ds[1]])
    config, match = TINY, r"request 'a': code 5000 at codebook 0, frame 1"
    if change == "in place":
        batch["codes"][0, 0, 1] = 5000
    elif change == "replaced":
        batch["codes"] = batch["codes"].clone().index_fill_(2, torch.tensor([1]), 5000)
    elif change == "lengths":
        batch["codes"].numpy()[1, 0, 5] = -1  # in request b's pad: unseen by the mark, and not decoded
        batch["lengths"][1] = 6  # now it is: the lengths' write is seen
        match = r"request 'b': code -1 at codebook 0, frame 5"
    elif change == "geometry":
        config, match = Code2WavConfig.from_name("tiny", codebook_size=16), r"request 'a': code \d+ .* \[0, 16\)"
    else:
        batch["req_ids"].append("c")
        match = r"3 request ids for a batch of 2 requests"
    with pytest.raises(ValueError, match=match):
        validate_batch(batch, config)


def test_a_batch_from_a_loader_worker_keeps_its_mark():
    data = CodesDataModule(predict=[random_codes(1, 5)[0]], config="tiny", num_workers=1)
    data.setup("predict")
    batch = batch_of(data.predict_dataloader()[0])
    batch["codes"].numpy()[0, 0, 0] = 5000  # unseen: the mark survived the trip from the worker
    assert validate_batch(batch, TINY).tolist() == [5]
    batch["codes"][0, 0, 0] = 5000
    with pytest.raises(ValueError, match="code 5000"):
        validate_batch(batch, TINY)


@pytest.mark.gpu
def test_a_pinned_batch_keeps_its_mark():
    ds = CodesDataset([random_codes(1, 5)[0]], "tiny")
    loader = torch.utils.data.DataLoader(ds, batch_size=1, collate_fn=collate_codes, pin_memory=True)
    with torch.inference_mode():  # as in trainer.predict, which pins there without loader workers
        batch = batch_of(loader)
    assert batch["codes"].is_pinned() and batch["checked"].codes is batch["codes"]
    batch["codes"].numpy()[0, 0, 0] = 5000
    assert validate_batch(batch, TINY).tolist() == [5]


def test_a_mark_moves_to_copies_of_unwritten_tensors_only():
    """What a pinned batch's mark does (``CodesBatch.pin_memory``), with plain copies on the CPU."""
    batch = collate_codes([CodesDataset([random_codes(1, 5)[0]], "tiny")[0]])
    mark = batch["checked"]
    codes, lengths = batch["codes"].clone(), batch["lengths"].clone()
    assert mark.moved(codes, lengths).holds(codes, lengths, TINY)
    batch["codes"][0, 0, 0] = 1
    assert mark.moved(codes, lengths) is None
