"""Batch jobs a user can trust: every request ends as one WAV or one recorded failure, ids map to
files injectively, the exit status says which, and a mistake on the command line is one line."""

import ctypes
import gc
import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import random_codes, random_model
from helpers import ROOT, cli, save_model, trainer_kwargs
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import omni_lightning
from omni_lightning import Code2WavConfig, Code2WavModule, CodesDataModule, CodesDataset, Trainer, WaveformWriter
from omni_lightning.callbacks.progress import AudioProgressBar
from omni_lightning.data.output_folder import file_name
from omni_lightning.errors import UsageError
from omni_lightning.models import validate_codes

TINY = Code2WavConfig.from_name("tiny")
PCM16 = 1.5 / 2**15  # PCM_16 rounding


@pytest.fixture(scope="module")
def model():
    return random_model("tiny", seed=6)


def predict_to(out, source, model, **data_kw):
    writer = WaveformWriter(out)
    data = CodesDataModule(predict=source if isinstance(source, dict) else str(source), skip_done=out, **data_kw)
    Trainer(**trainer_kwargs(callbacks=[writer])).predict(Code2WavModule(model=model), datamodule=data,
                                                          return_predictions=False)  # fmt: skip
    return writer


def rows(out):
    return {r["id"]: r for r in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}


def assert_wav(out, row, codes, model):
    data, sr = sf.read(out / row["path"], dtype="float32")
    with torch.inference_mode():
        want = model(torch.as_tensor(np.asarray(codes, dtype=np.int64))[None])[0, 0].numpy()
    assert sr == 24000 and data.shape == want.shape and np.abs(data - want).max() <= PCM16


def write_manifest(folder, items):
    """items: [(id, codes array)]; one .npy per line, named by position."""
    (folder / "codes").mkdir(parents=True)
    lines = []
    for i, (req_id, codes) in enumerate(items):
        np.save(folder / "codes" / f"{i}.npy", codes)
        lines.append(json.dumps({"id": req_id, "codes": f"codes/{i}.npy"}))
    (folder / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "manifest.jsonl"


# --- finding 1: any integer dtype; nothing one request holds ends the run ---------------------------


def test_every_integer_dtype_decodes_and_a_float_or_bool_file_is_a_recorded_failure(tmp_path, model):
    src = tmp_path / "codes"
    src.mkdir()
    small = random_codes(1, 6, seed=1)[0].numpy() % 128  # valid codes that fit int8
    wide = random_codes(1, 7, seed=2)[0].numpy()  # up to 2047
    expected = {}
    for dtype in ("uint8", "int8"):
        np.save(src / f"{dtype}.npy", small.astype(dtype))
        expected[dtype] = small
    for dtype in ("uint16", "int16", "uint32", "int32", "int64", "uint64", ">i4"):
        name = "big_endian_int32" if dtype == ">i4" else dtype
        np.save(src / f"{name}.npy", wide.astype(dtype))
        expected[name] = wide
    torch.save(torch.from_numpy(wide.astype(np.uint16)), src / "torch_uint16.pt")
    save_file({"codes": torch.from_numpy(wide.astype(np.int16))}, str(src / "st_int16.safetensors"))
    expected.update(torch_uint16=wide, st_int16=wide)
    np.save(src / "float.npy", wide.astype(np.float32))
    torch.save(torch.from_numpy(wide > 5), src / "flags.pt")

    writer = predict_to(tmp_path / "out", src, model, batch_size=4)
    got = rows(tmp_path / "out")
    assert sorted(got) == sorted([*expected, "float", "flags"])
    for name, codes in expected.items():
        assert got[name]["status"] == "ok", got[name]
        assert_wav(tmp_path / "out", got[name], codes, model)
    assert got["float"]["status"] == "error" and "dtype float32" in got["float"]["reason"]
    assert got["flags"]["status"] == "error" and "dtype bool" in got["flags"]["reason"]
    assert writer.stats["ok"] == len(expected) and writer.stats["error"] == 2 and not writer.all_written


def test_range_checks_compare_safely_in_every_integer_dtype():
    codes = random_codes(1, 5)[0] % 200
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32):
        validate_codes((codes % 100).to(dtype)[None], TINY)  # valid codes: no wrap-around "out of range"
    wide = codes.clone()
    wide[3, 2] = 4000
    with pytest.raises(ValueError, match=r"code 4000 at codebook 3, frame 2"):
        validate_codes(wide.to(torch.uint16)[None], TINY)
    with pytest.raises(ValueError, match=r"request 'u': code 70000 is outside"):
        CodesDataset({"u": torch.full((16, 3), 70000, dtype=torch.uint64)}, TINY)


def test_a_tensor_in_memory_written_after_its_check_is_checked_again_when_loaded():
    """In memory, a request whose values passed at the build is not read again when loaded, unless
    it was written in place since (its version counter moved): then the write is caught there."""
    good, bad = random_codes(1, 6, seed=1)[0].to(torch.int16), random_codes(1, 6, seed=2)[0]
    ds = CodesDataset({"good": good, "bad": bad}, TINY, on_bad_input="skip")
    assert ds.bad == {} and [e.checked_version for e in ds.entries] == [good._version, bad._version]
    bad[2, 3] = 5000  # in place, after the build
    items = {item["id"]: item for item in (ds[0], ds[1])}
    assert torch.equal(items["good"]["codes"], good.long()) and items["good"]["codes"].dtype == torch.long
    assert "code 5000 at codebook 2, frame 3" in items["bad"]["error"]
    assert torch.equal(ds[0]["codes"], good.long())  # loaded again, the same
    with torch.inference_mode():  # a talker's codes made under inference mode: no version counter
        made = {"ok": random_codes(1, 5, seed=3)[0], "bad": random_codes(1, 5, seed=4)[0]}
        made["bad"][1, 1] = 7000
    ds = CodesDataset(made, TINY, on_bad_input="skip")
    assert [e.checked_version for e in ds.entries] == [None, None] and "code 7000" in ds.bad["bad"]
    with torch.inference_mode():
        made["ok"][0, 0] = 9000  # written after the build: caught when loaded, as every time
    assert "code 9000 at codebook 0, frame 0" in ds[0]["error"]


def test_a_bad_request_in_a_users_own_batch_fails_alone_in_predict_and_the_others_are_decoded(tmp_path, model):
    """A user's DataLoader (or codes written through a NumPy view after the dataset checked them: no
    version counter moves) can bring a bad request to the module's own check: in predict it fails
    alone, recorded with its reason, as a bad request the data finds does. A batch problem is raised."""
    good, bad = random_codes(1, 7, seed=1)[0], random_codes(1, 5, seed=2)[0]
    bad[3, 2] = 5000
    codes = torch.zeros(3, 16, 7, dtype=torch.long)
    codes[0], codes[1, :, :5], codes[2] = good, bad, good
    batch = {"codes": codes, "lengths": torch.tensor([7, 5, 7]), "req_ids": ["g1", "b", "g2"]}
    writer = WaveformWriter(tmp_path / "out")
    loader = DataLoader([batch], batch_size=None)  # the batches as they are
    preds = Trainer(**trainer_kwargs(callbacks=[writer])).predict(Code2WavModule(model=model), loader)
    (out,) = preds
    assert out.req_ids == ["g1", "g2"] and list(out.errors) == ["b"]
    assert out.errors["b"].startswith("request 'b': code 5000 at codebook 3, frame 2 is outside [0, 2048)")
    with torch.inference_mode():
        want = model(good[None])[0]
    assert all(torch.allclose(p["model_outputs"], want, atol=1e-5) for p in out.pooler_output)
    got = rows(tmp_path / "out")
    assert got["b"]["status"] == "error" and got["g1"]["status"] == got["g2"]["status"] == "ok"
    with pytest.raises(ValueError, match="has 8 codebooks"):  # the batch's own problem: not one request's
        broken = DataLoader([{**batch, "codes": codes[:, :8]}], batch_size=None)
        Trainer(**trainer_kwargs()).predict(Code2WavModule(model=model), broken)


# --- finding 2: ids -----------------------------------------------------------------------------------

TRICKY = ["a b", "a_b", "x/a", "x_a", "../escape", ".hidden", "..", "/abs", "ü", "a~b", "A", "-", "a" * 150]


def test_ids_map_to_distinct_files_inside_out_dir_and_a_rerun_resumes(tmp_path, model):
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


def test_a_single_code_file_or_a_binary_file_as_a_source_is_a_usage_error_naming_it(tmp_path):
    """From Python as on the command line: a code file is not a manifest (it used to be read as one
    and fail with a UnicodeDecodeError)."""
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

    lines = [{"id": "", "codes": "elsewhere/x.npy"}, {"id": True, "codes": "in/a.npy"},
             {"id": {"k": 1}, "codes": "in/a.npy"}, {"id": 7, "codes": "in/a.npy"}]  # fmt: skip
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    dataset = CodesDataset(str(tmp_path / "m.jsonl"), TINY, on_bad_input="skip")
    assert dataset.ids == ["x", "line-2", "line-3", "7"]  # "" takes the file's name, as no id does
    must = "'id' must be a string (or a number), got"
    assert dataset.bad == {"line-2": f"{tmp_path / 'm.jsonl'}:2: {must} true",
                           "line-3": f"{tmp_path / 'm.jsonl'}:3: {must} {{\"k\": 1}}"}


def test_a_pt_file_that_torch_did_not_write_is_told_apart_from_one_holding_other_objects(tmp_path):
    (tmp_path / "noise.pt").write_bytes(bytes(range(256)) * 4)
    torch.save(np.zeros((16, 3), dtype=np.int64), tmp_path / "array.pt")
    bad = CodesDataset(str(tmp_path), TINY, on_bad_input="skip").bad
    assert "is not a file torch.save wrote (corrupt, or another format)" in bad["noise"]
    assert "holds objects other than tensors (a numpy array saved with torch.save?)" in bad["array"]


def test_a_predict_limited_to_no_batch_counts_every_request_as_not_run(tmp_path, model):
    """Lightning runs no predict hook after ``setup`` at ``limit_predict_batches=0``: the counts the
    writer set there are the summary."""
    (tmp_path / "out" / ".a.wav.tmp").mkdir(parents=True)  # a folder so named is the user's: kept
    writer = WaveformWriter(tmp_path / "out")
    data = CodesDataModule(predict={"a": random_codes(1, 3)[0], "b": random_codes(1, 4)[0]}, skip_done=tmp_path / "out")
    Trainer(**trainer_kwargs(callbacks=[writer], limit_predict_batches=0)).predict(
        Code2WavModule(model=model), datamodule=data, return_predictions=False)  # fmt: skip
    assert writer.stats["missing"] == 2 and writer.stats["limited"] and not writer.any_failed
    assert "2 requests not run (the trainer limits predict batches" in writer.summary()
    assert (tmp_path / "out" / ".a.wav.tmp").is_dir()


# --- findings 3, 4, 5: the command line ---------------------------------------------------------------


def test_cli_job_accounts_for_every_file_and_exits_3_when_a_request_failed(tmp_path):
    ckpt = save_model(tmp_path / "ckpt")
    src = tmp_path / "codes"
    (src / "x").mkdir(parents=True)
    np.save(src / "good.npy", random_codes(1, 4, seed=1)[0].numpy().astype(np.uint16))
    np.save(src / "x" / "a.npy", random_codes(1, 3, seed=2)[0].numpy())
    np.save(src / "x_a.npy", random_codes(1, 5, seed=3)[0].numpy())
    np.save(src / "float.npy", random_codes(1, 3, seed=4)[0].numpy().astype(np.float64))
    (src / "notes.txt").write_text("not codes")
    out = tmp_path / "out"
    proc = cli("predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt),
               "--data.predict", str(src), "--out_dir", str(out))  # fmt: skip
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 3, log
    assert "predict: 3 requests written" in log and "0 already done, 1 failed" in log, log
    assert "failed float: request 'float': codes have dtype float64" in log
    assert "1 input files not read (not code files, or links to folders)" in log and "notes.txt" in log
    got = rows(out)
    assert {k: v["status"] for k, v in got.items()} == {"good": "ok", "x/a": "ok", "x_a": "ok", "float": "error"}
    assert got["x_a"]["path"] == "x_a.wav" != got["x/a"]["path"]
    for noise in ("LightningCLI's args", "LeafSpec", "litlogger", "Traceback", "num_workers", "UserWarning"):
        assert noise not in log


CHECK_MISTAKES = """
import contextlib, io, json, sys
from omni_lightning.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    results.append([rc, err.getvalue()])
print(json.dumps({"results": results, "torch_imported": "torch" in sys.modules}))
"""


def test_cli_mistakes_are_one_error_line_given_before_torch_is_imported(tmp_path):
    ckpt = save_model(tmp_path / "ckpt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    np.save(tmp_path / "one.npy", random_codes(1, 3)[0].numpy())
    good = ["predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt), "--out_dir",
            str(tmp_path / "out"), "--data.predict", str(tmp_path)]  # fmt: skip
    torch.save(torch.zeros(3), tmp_path / "tensor.ckpt")  # files torch saved that are no Lightning checkpoint
    torch.save({"state_dict": {"w": torch.zeros(3)}}, tmp_path / "state.ckpt")
    (tmp_path / "cut.ckpt").write_bytes((tmp_path / "state.ckpt").read_bytes()[:300])
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "taken" / "manifest.jsonl").mkdir(parents=True)
    cases = {
        "--data.predict": [(str(tmp_path / "nope"), "does not exist"), (str(tmp_path / "empty"), "holds no code files"),
                           (str(tmp_path / "manifst.jsonl"), "does not exist"),
                           (str(tmp_path / "one.npy"), "is a single code file")],
        "--model.checkpoint": [(str(tmp_path / "nockpt"), "does not exist"),
                               (str(tmp_path / "empty"), "no config.json")],
        "--out_dir": [(str(tmp_path / "afile"), "is a file: give a folder"),
                      (str(tmp_path / "dangling"), "which does not exist: give a folder"),
                      (str(tmp_path / "taken"), "holds a folder named manifest.jsonl")],
        "--model.random_weights": [("maybe", "--model.random_weights must be true or false, got 'maybe'")],
        "--ckpt_path": [(str(tmp_path / "x.ckpt"), "does not exist"), ("last", "and predict runs no fit"),
                        (str(ckpt), "is a folder: give a Lightning .ckpt file"),
                        (str(ckpt / "model.safetensors"), "is a safetensors file"),
                        (str(tmp_path / "afile"), "is not a checkpoint torch saved"),
                        (str(tmp_path / "tensor.ckpt"), "is not a Lightning checkpoint (a saved tensor or state"),
                        (str(tmp_path / "state.ckpt"), "is not a Lightning checkpoint"),
                        (str(tmp_path / "cut.ckpt"), "cannot be read as a checkpoint")],
        "--timings": [(str(tmp_path / "nodir" / "t.json"), "does not exist"), (str(tmp_path), "is a folder")],
        "--config": [("configs/nope.yaml", "config file configs/nope.yaml does not exist"),
                     ("configs", "config file configs is a folder, not a YAML file")],
    }  # fmt: skip
    runs, wanted = [], []
    for flag, values in cases.items():
        for value, fix in values:
            runs.append([*good, flag, value])
            wanted.append((value, fix))
    runs.append(["predict", "--config", "configs/predict.yaml", "--model.config", "tinyy", "--data.predict",
                 str(tmp_path), "--out_dir", str(tmp_path / "out")])  # fmt: skip
    wanted.append(("'tinyy'", "is not a preset: use one of qwen3-omni, tiny"))
    runs.append(["predict", "--config", "configs/predict.yaml", "--out_dir", str(tmp_path / "out")])
    wanted.append(("--data.predict", "is not set"))
    for twin in ("s1", "s2"):  # one id in two sources: refused naming both, whatever duplicate_ids says
        (tmp_path / twin).mkdir()
        np.save(tmp_path / twin / "a.npy", random_codes(1, 3)[0].numpy())
    runs.append([*good[:-1], f"[{tmp_path / 's1'}, {tmp_path / 's2'}]", "--data.duplicate_ids", "rename"])
    wanted.append((f"'a' ({tmp_path / 's1'}, {tmp_path / 's2'})", "occur in more than one --data.predict source"))
    own = tmp_path / "job"  # an input manifest where the job writes its own: it would be replaced
    own.mkdir()
    (own / "manifest.jsonl").write_text(json.dumps({"id": "a", "codes": str(tmp_path / "one.npy")}) + "\n")
    runs.append([*good[:-1], str(own / "manifest.jsonl"), "--out_dir", str(own)])
    wanted.append((str(own / "manifest.jsonl"), "is the manifest this job writes in --out_dir"))
    for fmt, subtype, value, fix in (("flac", "FLOAT", "'FLOAT'", "cannot be written as flac: use one of PCM_16"),
                                     ("mp3", "PCM_16", "'mp3'", "is not an output format: use one of wav, flac")):
        runs.append([*good, "--format", fmt, "--subtype", subtype])
        wanted.append((value, fix))
    # the weights guard: no --model.checkpoint, no --ckpt_path, no --model.random_weights true
    no_weights = {"predict": ["--config", "configs/predict.yaml", "--data.predict", str(tmp_path), "--out_dir",
                              str(tmp_path / "out")],
                  "validate": ["--config", "configs/eval_wandb.yaml", "--data.val", str(tmp_path)],
                  "test": ["--config", "configs/eval_wandb.yaml", "--data.test", str(tmp_path)]}  # fmt: skip
    for sub, args in no_weights.items():
        for random in ([], ["--model.random_weights", "false"]):
            runs.append([sub, *args, *random])
            wanted.append((f"{sub} has no weights", "--model.checkpoint <folder> (a Qwen3-Omni or Code2Wav checkpoint) "
                           "or --ckpt_path <Lightning .ckpt>; --model.random_weights true"))
    runs += [["predcit", *good[1:]], [], ["--config", "configs/predict.yaml"]]  # said before Lightning loads
    wanted += [("'predcit' is not a subcommand", "(did you mean predict?): use one of fit, validate, test, predict, "
                "demo"), ("no subcommand given", "use one of fit"), ("no subcommand", "--help lists")]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", CHECK_MISTAKES, json.dumps(runs)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for (rc, err), (value, fix) in zip(report["results"], wanted):
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert value in err and fix in err, err
    assert not report["torch_imported"]  # every mistake was found before torch or Lightning loaded

    debug = cli("predict", "--config", "configs/nope.yaml", "--debug").communicate(timeout=300)[0]
    assert "Traceback" in debug and "UsageError" in debug  # --debug keeps the traceback
    version = subprocess.run([sys.executable, "-m", "omni_lightning.cli", "--version"], cwd=ROOT, text=True,
                             capture_output=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert version.returncode == 0 and version.stdout == f"omni-lightning {omni_lightning.__version__}\n"


def test_a_rerun_with_nothing_left_to_do_ends_before_torch_is_imported(tmp_path):
    src = tmp_path / "codes"
    (src / "x").mkdir(parents=True)
    for rid in ("a", "x/b"):
        np.save(src / f"{rid}.npy", random_codes(1, 3)[0].numpy())
    (src / "notes.txt").write_text("not codes")
    out = tmp_path / "out"
    out.mkdir()
    for rid in ("a", "x/b"):  # as a finished run leaves them
        (out / file_name(rid)).write_bytes(b"RIFF")
    lines = [{"id": "a", "path": "a.wav", "status": "ok"}, {"id": "x/b", "status": "error", "reason": "earlier"},
             {"id": "x/b", "path": file_name("x/b"), "status": "ok"}]  # fmt: skip
    (out / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"id": "torn')
    (out / ".a.wav.tmp").write_bytes(b"left by a killed run")
    (out / ".draft.tmp").write_text("a file of the user's own")
    config = tmp_path / "random.yaml"  # the weights guard's switch, set in a config file
    config.write_text("model:\n  random_weights: true\n")
    argv = ["predict", "--config", "configs/predict.yaml", "--config", str(config), "--data.predict", str(src),
            "--out_dir", str(out), "--timings", str(tmp_path / "timings.json")]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", NOTHING_TO_DO, json.dumps(argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0 and not report["torch_imported"], proc.stderr
    assert "0 requests written" in report["out"] and "2 already done, 0 failed" in report["out"]
    assert "nothing left to do" in report["out"] and "1 input files not read" in report["out"]
    assert not (out / ".a.wav.tmp").exists()  # the folder tidied as a run's start tidies it
    assert (out / ".draft.tmp").is_file()  # only the writer's own temp files go
    assert [json.loads(x)["id"] for x in (out / "manifest.jsonl").read_text().splitlines()] == ["a", "x/b"]
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert timings["process_start"] <= timings["main"] <= timings["checked"] <= timings["end"]


NOTHING_TO_DO = """
import contextlib, io, json, sys
from omni_lightning.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(json.loads(sys.argv[1]))
print(json.dumps({"rc": rc, "out": out.getvalue(), "torch_imported": "torch" in sys.modules}))
"""


def test_cli_duplicate_ids_refuse_the_job_in_one_listing_and_help_prints_no_warnings(tmp_path):
    items = [(rid, random_codes(1, 3, seed=i)[0].numpy()) for i, rid in enumerate(["a", "b", "a"])]
    manifest = write_manifest(tmp_path / "data", items)
    proc = cli("predict", "--config", "configs/predict.yaml", "--data.predict", str(manifest),
               "--out_dir", str(tmp_path / "out"))  # fmt: skip
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 2, log
    assert "error: 1 request id(s) occur more than once" in log and "'a': line 1, line 3" in log
    assert "Traceback" not in log and not list(tmp_path.rglob("*.wav"))

    proc = cli("predict", "--help")
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0 and "--out_dir" in log and "usage: omni-lightning" in log
    for noise in ("LightningCLI's args", "LeafSpec", "litlogger", "Warning", "warn("):
        assert noise not in log


# --- finding 7: returned predictions hold about their own size --------------------------------------


def rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim") or not os.path.exists("/proc/self/status"),
                    reason="measures glibc's heap through /proc")  # fmt: skip
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


# --- findings 8, 9, 10 ---------------------------------------------------------------------------------


def test_demo_reruns_only_in_its_own_folder(tmp_path):
    from omni_lightning.demo import prepare_work_dir

    work = tmp_path / "demo"
    assert prepare_work_dir(work) is False and (work / ".omni_lightning_demo").is_file()
    (work / "wavs_after").mkdir()
    (work / "wavs_after" / "old.wav").write_bytes(b"")
    assert prepare_work_dir(work) is True and not (work / "wavs_after").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep me")
    with pytest.raises(ValueError, match="not made by the demo"):
        prepare_work_dir(mine)
    assert (mine / "thesis.tex").read_text() == "keep me"


@pytest.mark.parametrize(("flag", "value"), [("--threads", "0"), ("--requests", "0"), ("--steps", "-1")])
def test_demo_refuses_counts_below_one_before_any_work(tmp_path, flag, value):
    from omni_lightning.demo import main as demo_main

    with pytest.raises(SystemExit) as stop:  # argparse: exit 2 with the flag and value named
        demo_main(["--work-dir", str(tmp_path / "demo"), flag, value])
    assert stop.value.code == 2 and not (tmp_path / "demo").exists()


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


def test_saved_checkpoint_files_get_the_mode_open_gives(tmp_path, tiny_model):
    umask = os.umask(0o022)
    os.umask(umask)
    tiny_model.save_pretrained(tmp_path / "c2w")
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE(os.stat(tmp_path / "c2w" / name).st_mode) == 0o666 & ~umask


@pytest.mark.parametrize(
    "codes, match",
    [
        (random_codes(1, 5).float(), "integer tensor, got dtype torch.float32"),
        (random_codes(1, 5).bool(), "integer tensor, got dtype torch.bool"),
        (random_codes(1, 5)[0], r"shape \[batch, codebooks, frames\]"),
        (random_codes(1, 5)[:, :8], "8 codebooks, this model expects 16"),
        (random_codes(1, 5)[..., :0], "empty"),
        (torch.zeros(0, 16, 5, dtype=torch.long), "batch size 0"),
        (random_codes(1, 5) + 2048, "outside \\[0, 2048\\)"),
        (random_codes(1, 5) - 2048, "outside \\[0, 2048\\)"),
    ],
)
def test_forward_rejects_bad_codes_with_a_clear_value_error(tiny_model, codes, match):
    with pytest.raises(ValueError, match=match):
        tiny_model(codes)


def test_forward_and_decode_take_any_integer_dtype(tiny_model):
    codes = random_codes(2, 5) % 200
    with torch.inference_mode():
        want = tiny_model(codes)
        for dtype in (torch.uint8, torch.int16, torch.uint16, torch.int32):
            assert torch.equal(tiny_model(codes.to(dtype)), want)
            assert torch.equal(tiny_model.decode(codes.to(dtype), [5, 3])[1], want[1, :, : tiny_model.output_length(3)])


def test_training_crops_differ_between_loader_workers_and_epochs():
    # loader workers are the default for files on machines with cores to spare (num_workers=None)
    from torch.utils.data import DataLoader

    frames = torch.arange(60).repeat(16, 1)  # code == frame index: a crop's first code is its start
    ds = CodesDataset({f"r{i}": frames for i in range(8)}, TINY, crop_frames=5)
    loader = DataLoader(ds, batch_size=1, num_workers=2, collate_fn=lambda items: items[0])
    epochs = [[int(item["codes"][0, 0]) for item in loader] for _ in range(2)]
    worker0, worker1 = epochs[0][0::2], epochs[0][1::2]
    assert worker0 != worker1 and epochs[0] != epochs[1]


def test_one_reading_of_the_output_folder_decides_what_a_rerun_skips(tmp_path, monkeypatch):
    from omni_lightning.cli import main
    from omni_lightning.data.output_folder import Finished

    ckpt = save_model(tmp_path / "ckpt")
    src = tmp_path / "codes"
    src.mkdir()
    for i in range(3):
        np.save(src / f"r{i}.npy", random_codes(1, 2 + i, seed=i)[0].numpy())
    out = tmp_path / "out"
    job = ["predict", "--config", str(ROOT / "configs/predict.yaml"), "--model.checkpoint", str(ckpt),
           "--data.predict", str(src), "--out_dir", str(out), "--trainer.accelerator", "cpu"]  # fmt: skip
    assert main(job) == 0
    (out / "r1.wav").unlink()  # r1 is no longer finished, r0 and r2 are
    readings = []
    read = Finished.read.__func__
    monkeypatch.setattr(Finished, "read", classmethod(lambda cls, d: readings.append(d) or read(cls, d)))
    forwards = []
    monkeypatch.setattr(CodesDataset, "__getitem__", lambda ds, i, get=CodesDataset.__getitem__: forwards.append(
        ds.entries[i].id) or get(ds, i))  # fmt: skip
    assert main(job) == 0
    assert readings == [str(out)]  # the checks read it before torch; data module and writer reuse that
    assert forwards == ["r1"]  # finished requests were never loaded
    assert sorted(rows(out)) == ["r0", "r1", "r2"] and (out / "r1.wav").is_file()
