"""Configuration as users write it: config files and options in any order, misspelled keys on a rerun
with nothing left to do, nulls, seeds, class paths, environment variables, ``--ckpt_path last``."""

import json
import re

import numpy as np
import pytest
import yaml
from conftest import random_codes, random_model
from helpers import cli
from jsonargparse import Namespace

from omni_lightning import Code2WavModule, CodesDataModule
from omni_lightning.cli.fit import drop_callbacks_turned_off
from omni_lightning.cli.preflight import check_command_line, finished_job
from omni_lightning.data import folder_lock
from omni_lightning.data.output_folder import file_name
from omni_lightning.data.synthetic import make_demo_data, make_teacher
from omni_lightning.errors import UsageError

PREDICT = ["predict", "--config", "configs/predict.yaml", "--model.random_weights", "true"]


@pytest.fixture(autouse=True)
def release_locks():
    """The checks lock an existing --out_dir for the command they run; in this process, for the test."""
    yield
    folder_lock.unlock_all()


def finished_folder(tmp_path, name, ids):
    """A code folder with ``ids`` and an output folder in which they are all written."""
    src, out = tmp_path / name, tmp_path / f"{name}_out"
    src.mkdir()
    out.mkdir()
    for i in ids:
        np.save(src / f"{i}.npy", random_codes(1, 3)[0].numpy())
        (out / file_name(i)).write_bytes(b"RIFF")
    rows = [{"id": i, "path": file_name(i), "status": "ok"} for i in ids]
    (out / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src, out


def test_a_config_file_after_an_option_wins_as_in_the_parser(tmp_path):
    """The checks let options win over every config file: they judged another job than the one run (a
    rerun said "nothing left to do" for a folder the job would not even read)."""
    done, out = finished_folder(tmp_path, "done", ["a"])
    todo, _ = finished_folder(tmp_path, "todo", ["b"])
    later = tmp_path / "later.yaml"
    later.write_text(yaml.safe_dump({"data": {"predict": str(todo)}}))
    command = check_command_line([*PREDICT, "--data.predict", str(done), "--config", str(later), "--out_dir", str(out)])
    assert command.values["data"]["predict"] == str(todo) and finished_job(command) is None


def test_a_rerun_with_nothing_left_to_do_leaves_unknown_options_to_the_parser(tmp_path):
    """A misspelled key or an appended source on a finished folder ended with "nothing left to do"."""
    src, out = finished_folder(tmp_path, "src", ["a"])
    base = [*PREDICT, "--data.predict", str(src), "--out_dir", str(out)]
    assert finished_job(check_command_line(base)) is not None  # options the checks read, or a config sets
    for known in (["--trainer.precision", "bf16-true"], ["--trainer.strategy", "ddp", "--trainer.devices", "4"]):
        assert finished_job(check_command_line([*base, *known])) is not None, known  # a multi-GPU rerun too
    for extra in (["--data.predict+=more.jsonl"], ["--trainer.logger.init_args.save_dir", "x"]):
        assert finished_job(check_command_line([*base, *extra])) is None, extra  # the parser judges these
    for typo, known in (("--data.predcit", "--data.predict"), ("--trainer.max_epoch", "--trainer.max_epochs")):
        with pytest.raises(
            UsageError, match=f"{typo} is not an option of omni-lightning predict: did you mean {known}?"
        ):
            check_command_line([*base, typo, "3"])  # named as unknown, not judged as a finished job


def test_seeds_class_paths_and_environment_values(tmp_path, monkeypatch):
    src, out = finished_folder(tmp_path, "src", ["a"])
    base = [*PREDICT, "--data.predict", str(src), "--out_dir", str(out)]
    with pytest.raises(UsageError, match=r"--seed_everything -1 is out of range"):
        check_command_line([*base, "--seed_everything", "-1"])
    # a class_path is the parser's to judge (it names what it does not take), not "has no weights"
    check_command_line(["predict", "--config", "configs/predict.yaml", "--data.predict", str(src), "--out_dir",
                        str(out), "--model.class_path", "omni_lightning.module.Code2WavModule"])  # fmt: skip
    monkeypatch.setenv("JSONARGPARSE_DEFAULT_ENV", "true")  # values may come from PL_PREDICT__... variables
    check_command_line(["predict", "--config", "configs/predict.yaml", "--out_dir", str(out)])


def test_a_single_callback_mapping_with_its_feature_turned_off():
    """``trainer.callbacks`` given as one mapping, not a list, crashed beside ``--trainer.logger false``."""
    monitor = Namespace(class_path="lightning.pytorch.callbacks.LearningRateMonitor")
    trainer = Namespace(callbacks=monitor, logger=False)
    drop_callbacks_turned_off(trainer)
    assert trainer.callbacks is None
    bar = Namespace(class_path="omni_lightning.callbacks.progress.AudioProgressBar")
    trainer = Namespace(callbacks=bar, logger=False)
    drop_callbacks_turned_off(trainer)
    assert trainer.callbacks is bar


@pytest.mark.parametrize("key", ["learning_rate", "mel_weight", "min_lr_ratio", "betas", "log_samples"])
def test_a_null_setting_is_refused_by_name(key):
    """A config file's null passes the parser and failed deep inside (a TypeError traceback)."""
    with pytest.raises(ValueError, match=key):
        Code2WavModule(model=random_model("tiny"), **{key: None})


def test_ckpt_path_last_without_a_last_checkpoint_is_refused(tmp_path):
    """finetune.yaml's checkpoints go to a new version folder each run: "last" found nothing there,
    Lightning warned and the fit started over from step 0."""
    train = make_demo_data(tmp_path / "data", 2, 1.0, 1.2, teacher=make_teacher(), seed=0, name="train.jsonl")
    proc = cli("fit", "--config", "configs/finetune.yaml", "--data.train", str(train), "--trainer.max_steps", "1",
               "--trainer.precision", "32-true", "--trainer.accelerator", "cpu", "--ckpt_path", "last",
               "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--data.num_workers", "0")  # fmt: skip
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2 and "--ckpt_path last finds no last checkpoint in" in log, log


@pytest.mark.slow
def test_run_settings_given_beside_ckpt_path_are_used_not_the_checkpoints(tmp_path):
    """Stock LightningCLI lays the checkpoint's hyperparameters over the parsed ones: a bad run setting
    (log_samples -1) was accepted and ignored beside --ckpt_path (the fit's value ran), while the
    checkpoint's architecture must still win over the config's preset."""
    from helpers import trainer_kwargs

    from omni_lightning import CodesDataModule, Trainer

    train = make_demo_data(tmp_path / "data", 2, 1.0, 1.2, teacher=make_teacher(), seed=0, name="train.jsonl")
    trainer = Trainer(**trainer_kwargs(max_steps=1, num_sanity_val_steps=0, limit_val_batches=0))
    trainer.fit(Code2WavModule(model=random_model("tiny")), datamodule=CodesDataModule(train=str(train)))
    trainer.save_checkpoint(tmp_path / "fit.ckpt")
    args = ["predict", "--config", "configs/predict.yaml", "--ckpt_path", str(tmp_path / "fit.ckpt"), "--data.predict",
            str(train), "--out_dir", str(tmp_path / "out"), "--model.config", "qwen3-omni"]  # fmt: skip
    proc = cli(*args, "--model.log_samples", "-1")  # judged by the module, not before torch loads
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2 and "log_samples must be an integer >= 0, got -1" in log, log
    proc = cli(*args, "--model.frames_per_forward", "7")  # the architecture is the checkpoint's: tiny
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and "2 requests written" in log, log


def test_settings_a_user_gave_are_known_even_at_their_default_value(tmp_path):
    """Beside --ckpt_path, a run setting given at its default (or a config's null) lost to the fit's."""
    from omni_lightning.cli.preflight import set_by_user

    keys = ["model.frames_per_forward", "model.log_samples", "model.fast_path"]
    argv = ["predict", "--config", "configs/predict.yaml", "--model.log_samples", "4", "--ckpt_path", "x.ckpt"]
    assert set_by_user(argv, keys) == ["model.frames_per_forward", "model.log_samples"]  # null in the config
    assert set_by_user(["predict", "--model.fast_path=true"], keys) == ["model.fast_path"]


def test_an_option_without_its_value_goes_to_the_parser(tmp_path):
    src, out = finished_folder(tmp_path, "src", ["a"])
    command = check_command_line([*PREDICT, "--data.predict", str(src), "--out_dir", str(out),
                                  "--trainer.enable_progress_bar"])  # fmt: skip
    assert command.unchecked == ["trainer.enable_progress_bar"] and finished_job(command) is None


def test_bad_numbers_presets_and_precisions_are_named_before_torch_loads_even_on_a_finished_job(tmp_path):
    """A finished job said "nothing left to do" (exit 0) to --data.batch_size 0 or --trainer.precision
    fp8; an unfinished one printed the parser's dozen lines for a precision, and --data.config tinyy
    ended in a ValueError traceback (exit 1) once Lightning had loaded."""
    src, out = finished_folder(tmp_path, "src", ["a"])
    base = [*PREDICT, "--data.predict", str(src), "--out_dir", str(out)]
    mistakes = [
        ("--data.batch_size", "0", "--data.batch_size must be an integer >= 1, got 0"),
        ("--data.batch_size", "abc", "--data.batch_size must be an integer >= 1, got abc"),
        ("--data.num_workers", "-1", "--data.num_workers must be an integer >= 0 (or null), got -1"),
        ("--model.frames_per_forward", "2.5", "--model.frames_per_forward must be an integer >= 1 (or null), got 2.5"),
        ("--trainer.gpu_memory_utilization", "1.5", "--trainer.gpu_memory_utilization must be a fraction in (0, 1]"),
        ("--trainer.gpu_memory_utilization", "nan", "--trainer.gpu_memory_utilization must be a fraction in (0, 1]"),
        (
            "--trainer.precision",
            "fp8",
            "--trainer.precision fp8 is not a precision Lightning takes: use one of 16-mixed",
        ),
        ("--data.config", "tinyy", "--data.config 'tinyy' is not a preset: use one of qwen3-omni, tiny"),
    ]
    for option, value, message in mistakes:
        with pytest.raises(UsageError, match=re.escape(message)):
            check_command_line([*base, option, value])
    good = [("--data.num_workers", "null"), ("--trainer.precision", "16"), ("--trainer.gpu_memory_utilization", "1")]
    for option, value in [*good, ("--data.config", "tiny"), ("--trainer.precision", "bf16-true")]:
        assert finished_job(check_command_line([*base, option, value])) is not None, option
    with pytest.raises(UsageError, match=r"config 'tinyy' is not a preset: use one of qwen3-omni, tiny"):
        CodesDataModule(predict=str(src), config="tinyy")  # from Python: at once, not inside setup


def test_fit_on_data_without_audio_or_predict_without_out_dir_is_named_before_torch_loads(tmp_path):
    """Each was found ten seconds later, once Lightning had loaded (after its warnings)."""
    src, _ = finished_folder(tmp_path, "src", ["a"])
    for sub, key in (("fit", "train"), ("validate", "val"), ("test", "test")):
        argv = [sub, f"--data.{key}", str(src), "--model.config", "tiny", "--model.random_weights", "true"]
        with pytest.raises(
            UsageError, match=f"--data.{key} .* is a folder of code files, without audio: {sub} needs a JSONL"
        ):
            check_command_line(argv)
    (tmp_path / "codes.jsonl").write_text(json.dumps({"id": "a", "codes": "src/a.npy"}) + "\n")  # no audio
    argv = ["validate", "--data.val", str(tmp_path / "codes.jsonl"), "--model.random_weights", "true"]
    with pytest.raises(UsageError, match=r"codes.jsonl names no audio: validate needs a JSONL manifest naming codes"):
        check_command_line(argv)
    with pytest.raises(UsageError, match=r"fit needs data: --data.train is not set: give a JSONL manifest naming"):
        check_command_line(["fit", "--model.config", "tiny"])
    for out_dir in ([], ["--out_dir", ""]):
        with pytest.raises(UsageError, match=r"predict has no --out_dir: give the folder"):
            check_command_line([*PREDICT, "--data.predict", str(src), *out_dir])
    writer = "--trainer.callbacks+=omni_lightning.WaveformWriter"  # a writer of one's own: the parser's to judge
    assert check_command_line([*PREDICT, "--data.predict", str(src), writer]).sub == "predict"


def test_a_rerun_with_another_subtype_says_what_it_leaves_as_it_is(tmp_path):
    """--subtype PCM_24 over files written as PCM_16 said "nothing left to do" and nothing else."""
    src, out = finished_folder(tmp_path, "src", ["a", "b"])
    rows = [{"id": i, "path": file_name(i), "format": "wav", "subtype": "PCM_16", "status": "ok"} for i in "ab"]
    (out / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [*PREDICT, "--data.predict", str(src), "--out_dir", str(out)]
    command = check_command_line([*base, "--subtype", "PCM_24"])
    assert finished_job(command) is not None and command.other_format == (
        f"warning: 2 requests in {out} are already written as wav PCM_16, not wav PCM_24: they count as done "
        "and are not decoded again; use another output folder (--out_dir) to have every request as wav PCM_24"
    )
    command = check_command_line([*base, "--format", "flac"])  # another format: named alone, as before
    assert finished_job(command) is not None and "already written as wav, not flac:" in command.other_format
    command = check_command_line(base)
    assert finished_job(command) is not None and command.other_format is None
