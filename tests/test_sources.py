"""Predict sources: a code file, a binary file or a missing path is a usage error naming it; links
and odd manifest ids are reported, never dropped or rewritten silently."""

import json

import numpy as np
import pytest
import torch
from conftest import random_codes
from helpers import TINY

from omni_lightning import CodesDataModule, CodesDataset
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


def test_a_pt_file_that_torch_did_not_write_is_told_apart_from_one_holding_other_objects(tmp_path):
    (tmp_path / "noise.pt").write_bytes(bytes(range(256)) * 4)
    torch.save(np.zeros((16, 3), dtype=np.int64), tmp_path / "array.pt")
    bad = CodesDataset(str(tmp_path), TINY, on_bad_input="skip").bad
    assert "is not a file torch.save wrote (corrupt, or another format)" in bad["noise"]
    assert "holds objects other than tensors (a numpy array saved with torch.save?)" in bad["array"]
