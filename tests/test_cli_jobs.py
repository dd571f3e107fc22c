"""Jobs through the command line: every file ends as one WAV or one recorded failure, the exit
status says which, a mistake is one error line before torch loads, and a rerun skips finished work."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import random_codes
from helpers import ROOT, cli, rows, save_model, write_manifest

import omni_lightning
from omni_lightning import CodesDataset
from omni_lightning.data.output_folder import file_name


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
    assert "1 input file not read (not code files, hidden, or links to folders)" in log and "notes.txt" in log
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
    for fmt, subtype, value, fix in (
        ("flac", "FLOAT", "'FLOAT'", "cannot be written as flac: use one of PCM_16"),
        ("mp3", "PCM_16", "'mp3'", "is not an output format: use one of wav, flac"),
    ):
        runs.append([*good, "--format", fmt, "--subtype", subtype])
        wanted.append((value, fix))
    # settings a finished job would not reach the parser with, a preset of the data, data without audio
    for flag, value, fix in (("--trainer.precision", "fp8", "is not a precision Lightning takes: use one of 16-mixed"),
                             ("--data.batch_size", "0", "--data.batch_size must be an integer >= 1, got 0"),
                             ("--data.config", "tinyy", "is not a preset: use one of qwen3-omni, tiny")):  # fmt: skip
        runs.append([*good, flag, value])
        wanted.append((value, fix))
    runs.append(["fit", "--data.train", str(tmp_path)])
    wanted.append((f"--data.train {tmp_path} is a folder of code files", "fit needs a JSONL manifest naming codes"))
    runs.append([arg for arg in good if arg not in ("--out_dir", str(tmp_path / "out"))])
    wanted.append(("--out_dir", "predict has no --out_dir: give the folder"))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"id": "a", "codes": "one.npy", "audio": "a.wav"}) + "\n")
    # the weights guard: no --model.checkpoint, no --ckpt_path, no --model.random_weights true
    no_weights = {"predict": ["--config", "configs/predict.yaml", "--data.predict", str(tmp_path), "--out_dir",
                              str(tmp_path / "out")],
                  "validate": ["--config", "configs/eval_wandb.yaml", "--data.val", str(pairs)],
                  "test": ["--config", "configs/eval_wandb.yaml", "--data.test", str(pairs)]}  # fmt: skip
    for sub, args in no_weights.items():
        for random in ([], ["--model.random_weights", "false"]):
            runs.append([sub, *args, *random])
            wanted.append(
                (
                    f"{sub} has no weights",
                    "--model.checkpoint <folder> (a Qwen3-Omni or Code2Wav checkpoint) "
                    "or --ckpt_path <Lightning .ckpt>; --model.random_weights true",
                )
            )
    runs += [["predcit", *good[1:]], [], ["--config", "configs/predict.yaml"]]  # said before Lightning loads
    wanted += [("'predcit' is not a subcommand", "(did you mean predict?): use one of fit, validate, test, predict, "
                "serve, demo"), ("no subcommand given", "use one of fit"),
               ("no subcommand", "--help lists")]  # fmt: skip
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
    assert "nothing left to do" in report["out"] and "1 input file not read" in report["out"]
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


@pytest.mark.slow  # ~9 s of subprocesses: pytest -m slow (CI under 10 minutes)
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
