"""Each `omni-lightning` subcommand end to end in a subprocess on the tiny preset."""

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from helpers import ROOT, cli, random_codes, save_model
from wandb_records import history, wait_for_exit

from omni_lightning import Code2WavModule, CodesDataset
from omni_lightning.data.synthetic import make_demo_data, make_teacher


def run(*args, timeout=600):
    proc = cli(*args)
    log = proc.communicate(timeout=timeout)[0]
    assert proc.returncode == 0, log
    return log


@pytest.mark.slow
def test_fit_then_predict_with_the_checkpoint_then_validate_and_test(tmp_path):
    teacher = make_teacher()
    train = make_demo_data(tmp_path / "data", 6, 1.0, 2.0, teacher=teacher, seed=0, name="train.jsonl")
    val = make_demo_data(tmp_path / "data", 3, 1.0, 2.0, teacher=teacher, seed=1, name="val.jsonl")
    runs = tmp_path / "runs"
    log = run("fit", "--config", "configs/finetune.yaml", "--data.train", str(train), "--data.val", str(val),
              "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.precision", "32-true",
              "--trainer.accelerator", "cpu", "--trainer.logger.init_args.save_dir", str(runs),
              "--data.num_workers", "0", "--data.crop_frames", "12", "--data.batch_size", "3")  # fmt: skip
    (said,) = [line for line in log.splitlines() if line.startswith("fit: val/mel_distance ")]
    assert " (step 2) -> " in said and "(step 4); best checkpoint " in said, said  # what the metric did, where
    for noise in ("litlogger", "litmodels", "LeafSpec", "Epoch 3/-", "\x1b"):  # nothing a user cannot act on
        assert noise not in log, noise
    ckpt = next(runs.rglob("last.ckpt"))
    assert (ckpt.parent.parent / "config.yaml").is_file()  # the run's config beside its logs
    assert torch.load(ckpt, weights_only=False)["global_step"] == 4

    out = tmp_path / "wavs"
    log = run("predict", "--config", "configs/predict.yaml", "--ckpt_path", str(ckpt), "--data.predict", str(val),
              "--out_dir", str(out), "--trainer.accelerator", "cpu")  # fmt: skip
    assert "3 requests written" in log
    # the finetune config keeps EMA weights: a fit checkpoint's state dict holds them, and predict uses them
    tuned = Code2WavModule.load_from_checkpoint(str(ckpt), map_location="cpu")
    ds = CodesDataset(str(val), "tiny")
    rows = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    with torch.inference_mode():
        for i in range(len(ds)):
            item = ds[i]
            data, sr = sf.read(out / f"{item['id']}.wav", dtype="float32")
            want = tuned.model.eval()(item["codes"][None])[0, 0].numpy()
            # PCM_16 rounded to nearest (full scale, 1.0, is 32767/32768): half a step, plus the engine's
            # and the forward's rounding
            want = want.clip(-1.0, 32767 / 32768)
            assert sr == 24000 and data.shape == want.shape and abs(data - want).max() <= 0.5 / 2**15 + 2e-6

    log = run("validate", "--config", "configs/eval_wandb.yaml", "--ckpt_path", str(ckpt), "--data.val", str(val),
              "--trainer.logger.init_args.save_dir", str(tmp_path / "wb"), "--trainer.accelerator", "cpu")  # fmt: skip
    assert "validate: " in log and "val/mel_distance=" in log
    # W&B and Lightning's noise a user cannot act on, and wandb's colours at exit: stdout is a pipe here
    for noise in ("Be aware that when using `ckpt_path`", "anonymous setting", "git root", "\x1b"):
        assert noise not in log, noise
    record_file = next((tmp_path / "wb").rglob("run-*.wandb"))
    wait_for_exit(record_file)
    merged = {k: v for row in history(record_file) for k, v in row.items()}
    assert merged["val/requests"] == 3 and "val/si_sdr" in merged and merged["val/generated/count"] == 3

    log = run("test", "--config", "configs/eval_wandb.yaml", "--model.checkpoint", str(export(tuned, tmp_path)),
              "--data.test", str(val), "--trainer.logger", "false", "--trainer.accelerator", "cpu")  # fmt: skip
    assert "test/mel_distance=" in log and "test/requests=3" in log


def export(module, tmp_path: Path) -> Path:
    module.export_pretrained(str(tmp_path / "hf"))
    return tmp_path / "hf"


def test_demo_runs_and_fine_tuning_moves_toward_the_teacher(tmp_path):
    # a folder a previous demo left, holding a stale WAV: the rerun recomputes and says so
    work = tmp_path / "demo"
    (work / "wavs_after").mkdir(parents=True)
    (work / ".omni_lightning_demo").write_text("")
    (work / "wavs_after" / "stale.wav").write_bytes(b"not from this run")
    log = run("demo", "--work-dir", str(work), timeout=300)
    assert "[0/4]" in log and "recomputed" in log and not (work / "wavs_after" / "stale.wav").exists()
    assert "[4/4] evaluation" in log and "demo done" in log
    line = next(x for x in log.splitlines() if x.startswith("[4/4]"))
    before, after = (float(x.split()[0]) for x in line.split("teacher ")[1].split(" before fine-tuning, "))
    assert after < before
    assert len(list((tmp_path / "demo" / "wavs_after").glob("*.wav"))) == 4


def test_exit_status_2_only_for_usage_errors_and_1_with_a_traceback_for_a_bug(tmp_path, monkeypatch, capsys):
    from omni_lightning.cli import main

    ckpt = save_model(tmp_path / "ckpt")
    src = tmp_path / "codes"
    src.mkdir()
    np.save(src / "a.npy", random_codes(1, 3)[0].numpy())
    job = ["predict", "--config", str(ROOT / "configs/predict.yaml"), "--model.checkpoint", str(ckpt),
           "--data.predict", str(src), "--out_dir", str(tmp_path / "out"), "--trainer.accelerator", "cpu"]  # fmt: skip
    built = "the configuration could not be built: "
    mistakes = [  # found once torch is loaded, by the classes or by Lightning: still the user's, one line
        ("--data.max_frames", "0", "max_frames must be an integer >= 1 (or None), got 0"),
        ("--trainer.devices", "0", "`Trainer(devices='0')` value is not a valid input"),
        ("--trainer.devices", "foo", built + "`devices` selected with `CPUAccelerator` should be an int > 0"),
        ("--trainer.strategy", "nope", built + "You selected an invalid strategy"),
        ("--trainer.accelerator", "tpu", built + "Requirement 'torch_xla"),
    ]
    for flag, value, message in mistakes:
        assert main([*job, flag, value]) == 2
        err = capsys.readouterr().err
        assert f"error: {message}" in err and "Traceback" not in err, err

    parser_says = {"--data.seed": "abc", "--trainer.num_nodes": "two", "--trainer.enable_progress_bar": "0"}
    for flag, value in parser_says.items():  # jsonargparse's own errors (it exits): one line, no usage above
        with pytest.raises(SystemExit) as exited:
            main([*job, flag, value])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {flag} takes " in err and f", not '{value}'" in err and err.count("\n") <= 2, err

    def broken(self, batch):
        raise ValueError("an internal check failed")  # a bug deep inside: not the user's mistake

    monkeypatch.setattr(Code2WavModule, "decode_batch", broken)
    assert main(job) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ValueError: an internal check failed" in err and "\nerror: " not in err


def test_fit_with_the_logger_turned_off_drops_the_configs_learning_rate_monitor(tmp_path, capsys):
    """configs/finetune.yaml lists LearningRateMonitor, which Lightning refuses without a logger. (In this
    process: the command's checks and its run are the same code as in a subprocess, at a fraction of its cost.)"""
    from omni_lightning.cli import main

    train = make_demo_data(tmp_path / "data", 2, 1.0, 1.0, teacher=make_teacher(), seed=0, name="train.jsonl")
    rc = main(["fit", "--config", str(ROOT / "configs/finetune.yaml"), "--data.train", str(train),
               "--trainer.max_steps", "1", "--trainer.logger", "false", "--trainer.accelerator", "cpu",
               "--trainer.precision", "32-true", "--data.num_workers", "0", "--data.crop_frames", "12",
               "--trainer.default_root_dir", str(tmp_path / "r")])  # fmt: skip
    said = capsys.readouterr()
    log = said.out + said.err
    assert rc == 0 and "LearningRateMonitor" not in log and "error" not in log.lower(), log


def test_predict_with_the_progress_bar_turned_off_drops_the_configs_bar(tmp_path, capsys):
    """configs/predict.yaml lists AudioProgressBar; `--trainer.enable_progress_bar false` must win (Lightning
    refuses a progress bar callback with the flag off)."""
    from omni_lightning.cli import main

    codes = tmp_path / "codes"
    codes.mkdir()
    np.save(codes / "one request.npy", random_codes(1, 9, seed=2)[0].numpy().astype(np.uint16))
    out = tmp_path / "wavs"
    rc = main(["predict", "--config", str(ROOT / "configs/predict.yaml"), "--data.predict", str(codes), "--out_dir",
               str(out), "--model.random_weights", "true", "--trainer.accelerator", "cpu",
               "--trainer.enable_progress_bar", "false"])  # fmt: skip
    said = capsys.readouterr()
    log = said.out + said.err
    assert rc == 0, log
    assert "Predicting" not in log and "1 request written" in log, log
    (line,) = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert line["id"] == "one request" and sf.info(str(out / line["path"])).frames == line["n_samples"] > 0
