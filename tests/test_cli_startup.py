"""What a predict says as it starts and stops: the start-up line, the audio-seconds bar and quiet defaults
without a config file, an interrupted job's count of what it saved, requests finished in another format."""

import json
import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import random_codes
from helpers import ROOT, TINY, read_until, trainer_kwargs

from omni_lightning import Code2WavModule, CodesDataModule, Trainer
from omni_lightning.callbacks.progress import AudioProgressBar, start_lines
from omni_lightning.data.output_folder import file_name
from omni_lightning.data.synthetic import make_demo_data, make_teacher


def code_folder(folder, lengths):
    folder.mkdir(parents=True)
    for i, n in enumerate(lengths):
        np.save(folder / f"r{i:02d}.npy", random_codes(1, n, seed=i)[0].numpy().astype(np.uint16))
    return folder


def omni_lightning(*args, cwd, **kw):
    """The command as a user runs it from ``cwd``: stdout a pipe (not a terminal), stderr with it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-m", "omni_lightning.cli", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        **kw,
    )


def test_a_plain_predict_says_what_runs_writes_only_its_out_dir_and_counts_audio_seconds(tmp_path):
    code_folder(tmp_path / "codes", [9, 20, 33])
    proc = omni_lightning("predict", "--data.predict", "codes/", "--out_dir", "wavs/", "--model.config", "tiny",
                          "--model.random_weights", "true", "--trainer.accelerator", "cpu", cwd=tmp_path)  # fmt: skip
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and "3 requests written" in log, log
    start = next(line for line in log.splitlines() if line.startswith("predict: tiny preset"))
    threads = "cpu 32-true, 1 torch thread (OMP_NUM_THREADS);"
    for said in ("2.4 M parameters", "random weights", threads, "no memory cap", "frames per forward"):
        assert said in start, start
    audio_s = sum(TINY.output_length(n) for n in (9, 20, 33)) / TINY.sample_rate
    assert start.endswith(f"3 requests to decode ({audio_s:.1f} s of audio)"), start  # none done before: not said
    assert log.index(start) < log.index("Predicting")  # said before the bar's first draw, in a log file too
    assert "requests=3/3" in log and "DataLoader 0" not in log  # the bar counts audio seconds, one loader
    # Lightning's device lines: the start-up line says the device (and a GPU left unused)
    assert "GPU available" not in log and "TPU available" not in log, log
    assert "s/s" in log and "<00:00" in log  # the bar's rate (audio seconds per second) and its time left
    assert sorted(os.listdir(tmp_path)) == ["codes", "wavs"]  # no lightning_logs/: predict needs no logger
    assert "tensorboardX" not in log and "No seed found" not in log and "Seed set to" not in log, log
    assert "\x1b" not in log and "\r" not in log  # stdout is not a terminal: no ANSI codes, no redraws
    bar = [line for line in log.splitlines() if line.startswith("Predicting")]  # a line a tenth, and the last
    assert 1 <= len(bar) <= 10 and bar[-1].startswith("Predicting: 4.9/4.9 ["), log


@pytest.mark.slow
def test_an_interrupted_predict_says_how_many_requests_it_saved_and_the_same_command_resumes(tmp_path):
    code_folder(tmp_path / "codes", [30 + 5 * i for i in range(24)])
    args = ["predict", "--data.predict", "codes", "--out_dir", "wavs", "--model.config", "tiny",
            "--model.random_weights", "true", "--trainer.accelerator", "cpu", "--data.batch_size", "1"]  # fmt: skip
    # Ctrl-C as in a terminal: SIGINT at its default, whatever this test process inherited
    proc = omni_lightning(*args, cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    printed, reader = read_until(proc, "Predicting: ")  # its first line: a tenth of the audio decoded
    assert proc.poll() is None, "the job ended before it could be interrupted:\n" + "".join(printed)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    reader.join(timeout=60)
    log = "".join(printed)
    saved = len((tmp_path / "wavs" / "manifest.jsonl").read_text().splitlines())
    said = f"error: interrupted: {saved} requests saved by this run in wavs ({saved} of 24 done); the same command "
    assert proc.returncode == 130 and 3 <= saved < 24 and said + "resumes the rest" in log, log

    rerun = omni_lightning(*args, cwd=tmp_path)
    log = rerun.communicate(timeout=300)[0]
    written = f"{24 - saved} request{'s' * (24 - saved != 1)} written"
    assert rerun.returncode == 0 and written in log and f"{saved} already done" in log, log
    assert (
        f"{24 - saved} request{'s' * (24 - saved != 1)} to decode (" in log and f", {saved} already done" in log
    )  # the start-up line


def test_requests_finished_in_another_format_are_reported_in_one_line(tmp_path, capsys):
    from omni_lightning.cli import main

    code_folder(tmp_path / "codes", [3, 4])
    out = tmp_path / "wavs"
    out.mkdir()
    rows = [{"id": f"r{i:02d}", "path": file_name(f"r{i:02d}"), "format": "wav", "status": "ok"} for i in range(2)]
    for row in rows:
        (out / row["path"]).write_bytes(b"RIFF")
    (out / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = ["predict", "--data.predict", str(tmp_path / "codes"), "--out_dir", str(out), "--model.config", "tiny",
           "--model.random_weights", "true"]  # fmt: skip
    assert main([*job, "--format", "flac"]) == 0
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line == (
        f"warning: 2 requests in {out} are already written as wav, not flac: they count as done and are "
        "not decoded again; use another output folder (--out_dir) to have every request as flac"
    )
    assert main([*job, "--format", "wav"]) == 0 and capsys.readouterr().err == ""  # the same format: nothing said


def test_requests_finished_from_other_weights_are_reported_in_one_line_and_recorded(tmp_path, capsys):
    """A rerun into the same folder with other weights kept the old audio and said nothing (as one with
    another --format once did): the manifest names each file's weights, and a rerun says what it keeps."""
    from helpers import save_model

    from omni_lightning.cli import main
    from omni_lightning.data.job_lines import weights_label

    codes = code_folder(tmp_path / "codes", [3, 4])
    out = tmp_path / "wavs"
    job = ["predict", "--data.predict", str(codes), "--out_dir", str(out), "--trainer.accelerator", "cpu",
           "--trainer.enable_progress_bar", "false"]  # fmt: skip
    assert main([*job, "--model.config", "tiny", "--model.random_weights", "true"]) == 0
    assert main([*job, "--model.config", "tiny", "--model.random_weights", "true"]) == 0  # the same: nothing said
    assert "weights" not in capsys.readouterr().err
    folder = save_model(tmp_path / "hf")
    label = weights_label("", folder)
    assert main([*job, "--model.checkpoint", str(folder)]) == 0  # nothing left to do: said before loading
    said = (
        f"warning: 2 requests in {out} are written with other weights (random weights), not {label}: they count "
        "as done and are not decoded again; use another output folder (--out_dir) to have every request from "
        "these weights"
    )
    assert capsys.readouterr().err.splitlines() == [said]
    np.save(codes / "r02.npy", random_codes(1, 5, seed=9)[0].numpy())  # a job that runs: its writer says it
    with pytest.warns(UserWarning) as warned:  # (printed as a "warning:" line on the command line)
        assert main([*job, "--model.checkpoint", str(folder)]) == 0
    assert said.removeprefix("warning: ") in [str(w.message) for w in warned]
    rows = {r["id"]: r["weights"] for r in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}
    assert rows == {"r00": "random weights", "r01": "random weights", "r02": label}
    assert str(folder.resolve()) in label and "(modified 20" in label


def test_the_trainers_default_bar_writes_no_ansi_codes_into_a_log(tmp_path, capsys):
    """Lightning's default bar (rich) showed "Epoch 4/-2" for a fit bounded by steps; TQDM's validation bar
    moves the cursor with ANSI codes, which a log file keeps."""
    train = make_demo_data(tmp_path / "data", 2, 1.0, 1.2, teacher=make_teacher(), seed=0, name="train.jsonl")
    kw = {**trainer_kwargs(max_steps=2, val_check_interval=1, num_sanity_val_steps=1), "enable_progress_bar": True}
    trainer = Trainer(**kw)
    assert isinstance(trainer.progress_bar_callback, AudioProgressBar)
    data = CodesDataModule(train=str(train), val=str(train), batch_size=2, crop_frames=12)
    trainer.fit(Code2WavModule(config="tiny", random_weights=True), datamodule=data)
    out = capsys.readouterr().out
    assert "Validation" in out and "Epoch 1" in out and "\x1b" not in out and "/-" not in out, out
    assert "Sanity Checking" in out  # a batch of its validation data
    data = CodesDataModule(train=str(train), batch_size=2, crop_frames=12)  # no validation data: no sanity bar
    Trainer(**{**kw, "max_steps": 1}).fit(Code2WavModule(config="tiny", random_weights=True), datamodule=data)
    assert "Sanity Checking" not in capsys.readouterr().out


def test_a_large_model_on_the_cpu_is_said_before_starting(tmp_path, capsys):
    """Predict through the Python API prints the start-up line too, before the default bar's first draw;
    the warning's threshold is a parameter count."""
    module = Code2WavModule(config="tiny", random_weights=True)
    data = CodesDataModule(predict={"a": random_codes(1, 5)[0]}, batch_size=1)
    trainer = Trainer(**trainer_kwargs(enable_progress_bar=True))
    trainer.predict(module, datamodule=data, return_predictions=False)
    out = capsys.readouterr().out
    start = "predict: tiny preset, 2.4 M parameters, random weights; cpu 32-true"
    assert start in out and out.index(start) < out.index("Predicting"), out
    (line,) = start_lines(trainer, module, module.config, 2_400_000)
    assert line.startswith("predict: tiny preset")
    line, warning = start_lines(trainer, module, module.config, 1_500_000_000)
    assert warning.startswith("warning: the tiny model (1500 M parameters) on the CPU is slow"), warning


PYTHON_PREDICT = """
import torch
from omni_lightning import Code2WavModule, CodesDataModule, Trainer
data = CodesDataModule(predict={"a": torch.randint(0, 100, (16, 5))}, batch_size=1)
Trainer(accelerator="cpu", logger=False).predict(Code2WavModule(config="tiny"), datamodule=data)
import sys
print("STOCK", flush=True)
print("STOCK", file=sys.stderr, flush=True)
import lightning
lightning.Trainer(accelerator="cpu", logger=False)  # Lightning's own trainer says what it says
"""


def test_a_python_predict_prints_its_start_line_and_no_lightning_advertisements():
    proc = subprocess.run(
        [sys.executable, "-c", PYTHON_PREDICT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "predict: tiny preset, 2.4 M parameters" in proc.stdout and "1 request to decode" in proc.stdout
    (ours, stock), (ours_err, stock_err) = proc.stdout.split("STOCK\n"), proc.stderr.split("STOCK\n")
    assert "GPU available: " not in ours + ours_err, ours + ours_err  # the start-up line says the device
    assert "GPU available: " in stock + stock_err  # a stock lightning.Trainer is left as it is
    for noise in ("litlogger", "litmodels", "LeafSpec"):
        assert noise not in proc.stdout + proc.stderr, noise


def test_fit_then_validate_say_where_their_files_are_and_validate_prints_its_metrics_once(
    tmp_path, monkeypatch, capsys, recwarn
):
    """Fit said "best checkpoint -" where there was none. Validate printed Lightning's metrics table and
    then the same metrics in one line; evaluated from a checkpoint, Lightning warned about the
    ModelCheckpoint's folder, which validate does not write to."""
    from omni_lightning.cli import main

    pairs = make_demo_data(tmp_path / "data", 2, 1.0, 1.2, teacher=make_teacher(), seed=0, name="pairs.jsonl")
    monkeypatch.chdir(tmp_path)  # configs/finetune.yaml logs and checkpoints into runs/
    options = {
        "--config": ROOT / "configs/finetune.yaml",
        "--data.val": pairs,
        "--data.num_workers": 0,
        "--data.batch_size": 2,
        "--trainer.precision": "32-true",
        "--trainer.enable_progress_bar": "false",
    }
    job = [str(x) for option in options.items() for x in option]
    fit = [
        "fit",
        *job,
        "--data.train",
        str(pairs),
        "--trainer.max_steps",
        "1",
        "--trainer.enable_model_summary",
        "false",
    ]
    assert main([*fit, "--data.crop_frames", "12"]) == 0
    start, line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("fit: ")]
    threads = "1 torch thread (OMP_NUM_THREADS)" if os.environ.get("OMP_NUM_THREADS") else "torch thread"
    assert start.startswith("fit: tiny preset, 2.4 M parameters (2.4 M trained), random weights; cpu 32-true, "), start
    assert threads in start, start
    last = line.removeprefix("fit: last checkpoint ")  # no validation ran: there is no best one to name
    assert line != last and (tmp_path / last).is_file(), line

    assert main(["validate", *job, "--ckpt_path", last]) == 0
    out = capsys.readouterr().out
    assert f"validate: tiny preset, 2.4 M parameters, weights from {last}; cpu 32-true, " in out, out
    (line,) = [x for x in out.splitlines() if "val/mel_distance" in x]  # no table besides the line
    assert line.startswith("validate: val/mel_distance=") and line.endswith("; logs in runs/finetune/version_1"), out
    assert "; waveform match (phase-sensitive): val/si_sdr=" in line, line  # apart from what a listener hears
    assert (tmp_path / "runs/finetune/version_1/metrics.csv").is_file()
    assert not [w for w in recwarn if "dirpath has changed" in str(w.message)]
    assert main([*fit, "--data.crop_frames", "12", "--trainer.max_steps", "0"]) == 0  # ends with its line too
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == "fit: no optimizer step was taken, no checkpoint written"


def test_fit_without_val_and_validate_without_a_logger_config_warn_of_neither(tmp_path, monkeypatch, capsys, recwarn):
    """A fit given no validation data warned that a list was empty across ranks; a validate with
    Lightning's default logger advised installing tensorboard (it logs to CSV, as its line says)."""
    from omni_lightning.cli import main

    pairs = make_demo_data(tmp_path / "data", 2, 1.0, 1.2, teacher=make_teacher(), seed=0, name="pairs.jsonl")
    monkeypatch.chdir(tmp_path)
    common = ["--model.config", "tiny", "--model.random_weights", "true", "--data.num_workers", "0"]
    common += ["--data.batch_size", "2", "--trainer.enable_progress_bar", "false"]
    fit = ["--data.train", str(pairs), "--trainer.max_steps", "1", "--trainer.enable_model_summary", "false"]
    assert main(["fit", *common, *fit]) == 0
    assert main(["validate", *common, "--data.val", str(pairs)]) == 0
    said = [str(w.message) for w in recwarn] + capsys.readouterr().err.splitlines()
    assert not [s for s in said if "tensorboardX" in s or "across ranks is zero" in s], said


def test_an_interrupted_fit_saves_where_it_was_says_how_to_resume_and_resumes_there(
    tmp_path, monkeypatch, capsys, caplog, recwarn
):
    """Ctrl-C before configs/finetune.yaml's first checkpoint (every 200 steps) left nothing to resume from,
    and the command said only "error: interrupted". Stopped within an epoch (4 pairs, 2 a batch), the resumed
    fit goes on there, where Lightning warned that the loader was "not resumable"; Lightning's seed,
    KeyboardInterrupt, restoring, model-table and "`Trainer.fit` stopped" lines are left out."""
    import torch

    from omni_lightning.cli import main

    pairs = make_demo_data(tmp_path / "data", 4, 1.0, 1.2, teacher=make_teacher(), seed=0, name="pairs.jsonl")
    monkeypatch.chdir(tmp_path)  # configs/finetune.yaml checkpoints into runs/finetune/version_N/
    fit = ["fit", "--config", str(ROOT / "configs/finetune.yaml"), "--data.train", str(pairs), "--trainer.max_steps",
           "2", "--trainer.precision", "32-true", "--data.num_workers", "0", "--data.batch_size", "2",
           "--data.crop_frames", "12", "--trainer.enable_progress_bar", "false"]  # fmt: skip
    caplog.set_level(logging.INFO)  # Lightning's info lines (under pytest they go to the root logger's handlers)
    # Ctrl-C as in a terminal: a shell's background job inherits SIGINT ignored, and Python keeps it ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main([*fit, "--trainer.callbacks+=helpers.CtrlCAfterFirstStep"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    saved = "runs/finetune/version_0/checkpoints/interrupted.ckpt"
    first = capsys.readouterr()
    err = first.err.splitlines()
    said = f"error: interrupted at step 1: saved {saved}; the same command with --ckpt_path {saved} resumes it"
    assert err[-1] == said, err
    assert torch.load(saved, weights_only=False)["global_step"] == 1

    assert main([*fit, "--ckpt_path", saved]) == 0
    captured = capsys.readouterr()
    assert "fit: last checkpoint runs/finetune/version_1/checkpoints/last.ckpt" in captured.out, captured.out
    assert "random weights; cpu 32-true" in first.out and f"resuming from {saved}; cpu 32-true" in captured.out
    last = torch.load("runs/finetune/version_1/checkpoints/last.ckpt", weights_only=False)
    assert last["global_step"] == 2 and not (tmp_path / "runs/finetune/version_1/checkpoints/interrupted.ckpt").exists()
    said = first.out + first.err + captured.out + captured.err + caplog.text
    said += "\n".join(str(w.message) for w in recwarn)
    for noise in ("Total Flops", "FLOPs", "weights_only", "current_model_state", "dirpath has changed", "Seed set",
                  "Restored all states", "Trainable params", "KeyboardInterrupt", "not resumable",
                  "`Trainer.fit` stopped"):  # fmt: skip
        assert noise not in said, noise
