"""Predict sources: a code file, a binary file or a missing path is a usage error naming it; links
and odd manifest ids are reported, never dropped or rewritten silently."""

import json

import numpy as np
import pytest
import torch
from conftest import random_codes
from helpers import TINY

from omni_lightning import CodesDataModule, CodesDataset
from omni_lightning.data.sources import check_source
from omni_lightning.errors import UsageError


def test_a_single_code_file_or_a_binary_file_as_a_source_is_a_usage_error_naming_it(tmp_path):
    """From Python as on the command line: a code file is not a manifest, and a binary file is named,
    not a UnicodeDecodeError."""
    np.save(tmp_path / "a.npy", random_codes(1, 3)[0].numpy())
    (tmp_path / "blob.jsonl").write_bytes(b"\x93\xff\x00binary")
    (tmp_path / "late.jsonl").write_bytes(b'{"id": "x", "codes": "a.npy"}\n\xff\xfe\n')
    with pytest.raises(UsageError, match=r"a.npy is a single code file: give its folder, or a JSONL manifest"):
        CodesDataset(str(tmp_path / "a.npy"), TINY)
    with pytest.raises(UsageError, match=r"blob.jsonl cannot be read as UTF-8 JSON lines \(UnicodeDecodeError"):
        CodesDataModule(predict=str(tmp_path / "blob.jsonl"), config="tiny").setup("predict")
    with pytest.raises(UsageError, match=r"late.jsonl cannot be read as .*UnicodeDecodeError"):
        CodesDataset(str(tmp_path / "late.jsonl"), TINY)
    with pytest.raises(UsageError, match=r"missing does not exist"):
        CodesDataset(str(tmp_path / "missing"), TINY)
    with pytest.raises(UsageError, match=r"\*.npy does not exist \(a pattern is not expanded\): give a folder"):
        CodesDataset(str(tmp_path / "*.npy"), TINY)  # a quoted glob, or one the shell found nothing for
    # a manifest whose first line is broken is still a manifest in Python: that line is one bad request
    (tmp_path / "torn.jsonl").write_text('{"id": "x", "co\n{"id": "a", "codes": "a.npy"}\n')
    torn = CodesDataset(str(tmp_path / "torn.jsonl"), TINY, on_bad_input="skip")
    assert torn.ids == ["line-1", "a"] and list(torn.bad) == ["line-1"]


def test_links_to_folders_and_odd_manifest_ids_are_reported_never_dropped_or_rewritten_silently(tmp_path, model):
    codes = random_codes(1, 3, seed=4)[0].numpy()
    (tmp_path / "elsewhere").mkdir()
    np.save(tmp_path / "elsewhere" / "x.npy", codes)
    folder = tmp_path / "in"
    folder.mkdir()
    np.save(folder / "a.npy", codes)
    (folder / "linked").symlink_to(tmp_path / "elsewhere")  # not followed: listed as not read
    dataset = CodesDataset(str(folder), TINY)
    assert dataset.ids == ["a"] and [p.name for p in dataset.unread] == ["linked"]
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsageError, match=r"holds no code files \(it holds 1 other file\(s\), e.g. linked\)"):
        CodesDataset(str(tmp_path / "only"), TINY)

    lines = [
        {"id": "", "codes": "elsewhere/x.npy"},
        {"id": True, "codes": "in/a.npy"},
        {"id": {"k": 1}, "codes": "in/a.npy"},
        {"id": 7, "codes": "in/a.npy"},
    ]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    dataset = CodesDataset(str(tmp_path / "m.jsonl"), TINY, on_bad_input="skip")
    assert dataset.ids == ["x", "line-2", "line-3", "7"]  # "" takes the file's name, as no id does
    must = "'id' must be a string (or a number), got"
    assert dataset.bad == {
        "line-2": f"{tmp_path / 'm.jsonl'}:2: {must} true",
        "line-3": f'{tmp_path / "m.jsonl"}:3: {must} {{"k": 1}}',
    }


def test_hidden_files_and_folders_are_listed_as_not_read_never_taken_as_requests(tmp_path):
    """macOS leaves ``._a.npy`` beside ``a.npy`` on a copied folder, Jupyter ``.ipynb_checkpoints/``:
    read as requests, they failed (exit 3 on every rerun) or decoded a stale copy."""
    codes = random_codes(1, 3, seed=4)[0].numpy()
    for name in ("a.npy", "x/b.npy", ".ipynb_checkpoints/a-checkpoint.npy"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        np.save(tmp_path / name, codes)
    (tmp_path / "._a.npy").write_bytes(b"\x00\x05\x16\x07 resource fork")
    dataset = CodesDataset(str(tmp_path), TINY)
    assert dataset.ids == ["a", "x/b"] and not dataset.bad
    assert sorted(p.name for p in dataset.unread) == ["._a.npy", ".ipynb_checkpoints"]


def test_a_pt_file_that_torch_did_not_write_is_told_apart_from_one_holding_other_objects(tmp_path):
    (tmp_path / "noise.pt").write_bytes(bytes(range(256)) * 4)
    torch.save(np.zeros((16, 3), dtype=np.int64), tmp_path / "array.pt")
    bad = CodesDataset(str(tmp_path), TINY, on_bad_input="skip").bad
    assert "is not a file torch.save wrote (corrupt, or another format)" in bad["noise"]
    assert "holds objects other than tensors (a numpy array saved with torch.save?)" in bad["array"]


def test_a_manifests_comments_are_skipped_and_a_path_taken_from_the_wrong_folder_is_explained(tmp_path, monkeypatch):
    """A ``#`` line was a failed request (exit 3 at every rerun), a first-line comment refused the whole
    manifest; a codes path written from the current folder said only "does not exist"."""
    data = tmp_path / "data"
    (data / "c" / "d.npy").mkdir(parents=True)
    np.save(data / "c" / "a.npy", random_codes(1, 3)[0].numpy())
    text = '# made by hand\n{"id": "a", "codes": "c/a.npy"}\n  # the next path is from tmp_path\n'
    (data / "m.jsonl").write_text(text + '{"id": "b", "codes": "data/c/a.npy"}\n{"id": "d", "codes": "c/d.npy"}\n')
    monkeypatch.chdir(tmp_path)
    check_source("--data.predict", "data/m.jsonl")  # the command line's check of the first line
    dataset = CodesDataset("data/m.jsonl", TINY, on_bad_input="skip")
    assert dataset.ids == ["a", "b", "d"]
    assert dataset.bad == {
        "b": "codes file data/data/c/a.npy does not exist (paths in a manifest are relative to its folder data; "
        "data/c/a.npy is relative to the current one)",
        "d": "codes file data/c/d.npy is a folder, not a file",
    }


def test_predict_reads_no_audio_its_manifest_names(tmp_path):
    """Predict on a paired manifest (a validation set) read and resampled every audio file, moved it to
    the device unused, and failed each request whose audio was missing."""
    import soundfile as sf

    for name in ("a", "b"):
        np.save(tmp_path / f"{name}.npy", random_codes(1, 3)[0].numpy())
    sf.write(tmp_path / "a.wav", np.zeros(16000, dtype=np.float32), 16000)
    lines = [{"id": n, "codes": f"{n}.npy", "audio": f"{n}.wav"} for n in ("a", "b")]  # b.wav is missing
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = CodesDataModule(predict=str(tmp_path / "val.jsonl"), val=str(tmp_path / "val.jsonl"), config="tiny")
    data.setup("predict")
    (predict,) = data.datasets["predict"]
    assert predict.bad == {} and "audio" not in predict[0] and "audio" not in next(iter(data.predict_dataloader()[0]))
    data.setup("validate")  # evaluation reads it, and names what is missing
    assert list(data.datasets["validate"].bad) == ["b"] and data.datasets["validate"][0]["audio"].shape[0] > 0


def test_codes_given_as_a_nested_list_are_named_as_such():
    """``codes.tolist()`` was told only "a pair is (codes, audio), got a list of 16"."""
    bad = CodesDataset({"l": [[1, 2]] * 16}, TINY, on_bad_input="skip").bad
    want = "codes alone must be a tensor or NumPy array [codebooks, frames], not a list"
    assert bad == {"l": f"a pair is (codes, audio), got a list of 16; {want}"}


def test_one_request_given_as_the_whole_source_is_refused_with_the_fix():
    """A tensor [16, T] as the source was read as 16 requests of one row each, all failing."""
    for source in (random_codes(1, 5)[0], random_codes(1, 5)[0].numpy(), torch.tensor(3)):
        with pytest.raises(UsageError, match=r"source is a batch \[requests, codebooks, frames\], got shape"):
            CodesDataModule(predict=source, config="tiny").setup("predict")
    assert CodesDataset(random_codes(2, 5), TINY).ids == ["0", "1"]  # a batch: one request a row


def test_a_fit_or_evaluation_whose_every_request_is_bad_is_refused_at_setup(tmp_path):
    """Every request skipped, a fit ran its epochs on nothing and exited 0 (a validation logged no metric)."""
    np.save(tmp_path / "a.npy", random_codes(1, 3)[0].numpy())
    lines = [{"id": i, "codes": "a.npy", "audio": "missing.wav"} for i in ("x", "y")]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    for stage, key in (("fit", "train"), ("validate", "val"), ("test", "test")):
        data = CodesDataModule(**{key: str(tmp_path / "m.jsonl")}, config="tiny")
        with pytest.raises(
            UsageError, match=rf"all 2 {key} request\(s\) are bad, e.g. x: audio file .* does not exist"
        ):
            data.setup(stage)
