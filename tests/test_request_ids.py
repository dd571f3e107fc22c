"""Request ids in a predict job: each maps to one file inside the output folder, a rerun resumes,
and a repeated id stops the job before any decode (or is numbered on request)."""

import numpy as np
import pytest
import torch
from conftest import random_codes
from helpers import TINY, assert_wav, predict_to, rows, trainer_kwargs, write_manifest

from omni_lightning import Code2WavModule, CodesDataModule, CodesDataset, Trainer, WaveformWriter
from omni_lightning.data.output_folder import file_name
from omni_lightning.errors import UsageError

TRICKY = ["a b", "a_b", "x/a", "x_a", "../escape", ".hidden", "..", "/abs", "ü", "a~b", "A", "-", "a" * 150]


def test_ids_map_to_distinct_files_inside_out_dir_and_a_rerun_resumes(tmp_path, model, recwarn):
    items = [(rid, random_codes(1, 2 + i % 3, seed=40 + i)[0].numpy()) for i, rid in enumerate(TRICKY)]
    manifest = write_manifest(tmp_path / "data", items)
    out = tmp_path / "jobs" / "out"
    writer = predict_to(out, manifest, model, batch_size=5)
    got = rows(out)
    assert sorted(got) == sorted(TRICKY)
    paths = [r["path"] for r in got.values()]
    assert len(set(paths)) == len(TRICKY)  # no WAV overwrote another
    assert writer.all_written and writer.stats["ok"] == len(TRICKY)
    assert sorted(p.name for p in out.iterdir()) == sorted([*paths, "manifest.jsonl"])
    for rid, codes in items:
        assert "/" not in got[rid]["path"] and not got[rid]["path"].startswith(".")
        assert_wav(out, got[rid], codes, model)
    assert got["a_b"]["path"] == "a_b.wav" and got["A"]["path"] == "A.wav"  # plain ids keep their name
    assert [p for p in tmp_path.rglob("*.wav") if out not in p.parents] == []  # nothing escaped out_dir

    again = predict_to(out, manifest, model)  # a rerun finds every request done through the manifest
    assert again.stats["skipped"] == len(TRICKY) and again.stats["ok"] == 0 and again.all_written
    # the summary says so; Lightning's "make sure this was your intention" about the empty loader is not said
    assert not [w for w in recwarn if "across ranks is zero" in str(w.message)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*paths, "manifest.jsonl"])


def test_file_names_are_injective_and_case_clashes_are_refused():
    from omni_lightning.data.output_folder import check_names

    ids = [*TRICKY, "a", "a b ", "a  b", "x//a", "a" * 151, "", "a.", "a..", "ü2", "a~b~c"]
    names = [file_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    assert all("/" not in n and not n.startswith(".") and len(n) <= 110 for n in names)
    check_names(["A", "b"], fold=True)
    with pytest.raises(ValueError, match=r"'A', 'a'.*nothing was decoded|nothing was decoded.*'A', 'a'"):
        check_names(["A", "a"], fold=True)  # one file on a case-insensitive file system


def test_duplicate_ids_stop_the_job_before_any_decode_or_are_numbered_on_request(tmp_path, model):
    items = [(rid, random_codes(1, 3, seed=60 + i)[0].numpy()) for i, rid in enumerate("abacb")]
    manifest = write_manifest(tmp_path / "data", items)
    module = Code2WavModule(model=model)
    forwards = []
    handle = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError) as err:
            Trainer(**trainer_kwargs(callbacks=[WaveformWriter(tmp_path / "out")])).predict(
                module, datamodule=CodesDataModule(predict=str(manifest)), return_predictions=False
            )
    finally:
        handle.remove()
    message = str(err.value)
    assert "'a': line 1, line 3" in message and "'b': line 2, line 5" in message and "duplicate_ids" in message
    assert forwards == [] and not list(tmp_path.rglob("*.wav"))

    writer = predict_to(tmp_path / "out", manifest, model, duplicate_ids="rename")
    got = rows(tmp_path / "out")
    assert sorted(got) == ["a", "a#2", "b", "b#2", "c"] and writer.all_written
    assert_wav(tmp_path / "out", got["a#2"], items[2][1], model)

    folder = tmp_path / "folder"
    folder.mkdir()
    np.save(folder / "u.npy", items[0][1])
    torch.save(torch.from_numpy(items[1][1]), folder / "u.pt")
    with pytest.raises(ValueError, match=r"'u': u.npy, u.pt"):
        CodesDataset(str(folder), TINY)


def test_an_id_in_two_predict_sources_stops_a_writer_job_before_any_decode_with_or_without_skip_done(tmp_path, model):
    codes = random_codes(2, 3, seed=9)
    module = Code2WavModule(model=model)
    for skip_done in (None, tmp_path / "out"):
        data = CodesDataModule(predict=[{"a": codes[0], "b": codes[1]}, {"a": codes[1]}], skip_done=skip_done)
        writer = WaveformWriter(tmp_path / "out")
        with pytest.raises(UsageError, match=r"1 group\(s\) of requests share ids.*nothing was decoded.*'a', 'a'"):
            Trainer(**trainer_kwargs(callbacks=[writer])).predict(module, datamodule=data, return_predictions=False)
        assert not list(tmp_path.rglob("*.wav"))
    # without a writer the repeat names nothing: each source is its own dataloader, as in Lightning
    preds = Trainer(**trainer_kwargs()).predict(module, datamodule=data)
    assert [[i for out in p for i in out.req_ids] for p in preds] == [["a", "b"], ["a"]]


def test_a_name_that_is_not_utf8_is_printed_escaped_not_a_traceback(tmp_path, capsys):
    """Python holds a non-UTF-8 file name with surrogates; printing one (an id, an unread file) where
    stdout is strict UTF-8 (en_US.UTF-8, PYTHONIOENCODING) ended the job in a traceback, exit 1, at
    every rerun."""
    import json
    import os

    from omni_lightning.cli import main

    src, out = tmp_path / "codes", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    np.save(src / "a.npy", random_codes(1, 3)[0].numpy())
    (src / os.fsdecode(b"notes\xff.txt")).write_text("not codes")
    (out / "a.wav").write_bytes(b"RIFF")
    (out / "manifest.jsonl").write_text(json.dumps({"id": "a", "path": "a.wav", "status": "ok"}) + "\n")
    job = ["predict", "--data.predict", str(src), "--out_dir", str(out), "--model.random_weights", "true"]
    assert main(job) == 0  # a job with nothing left to do prints its summary, unread files named
    assert "notes\\udcff.txt" in capsys.readouterr().out


def test_failed_requests_print_a_line_each_whatever_their_ids_hold(tmp_path):
    from omni_lightning.cli.console import failed_lines

    failed = {"a\nb": "codes out of range\n(2048)", "x\ty/é z": "empty", **{f"r{i}": "bad" for i in range(30)}}
    lines = failed_lines(failed, tmp_path)
    assert lines[:2] == ["  failed a\\nb: codes out of range\\n(2048)", "  failed x\\ty/é z: empty"]
    assert len(lines) == 21 and lines[-1] == f"  ... 12 more in {tmp_path / 'manifest.jsonl'}"
