"""The writer under faults a real job meets: Ctrl-C while it hands a batch over, a second job on the
same output folder, a disk that refuses bytes, a hand-edited manifest, a file system gone read-only."""

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import random_codes, random_model
from helpers import ROOT, cli, manifest_rows, save_model, trainer_kwargs, write_codes
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from omni_lightning import Code2WavModule, CodesDataModule, Trainer, WaveformWriter
from omni_lightning.callbacks.audio_files import encode_durably
from omni_lightning.data import folder_lock
from omni_lightning.data.folder_lock import LOCK_NAME
from omni_lightning.data.output_folder import Finished
from omni_lightning.errors import UsageError


class InterruptedPut(Callback):
    """Stands in for a Ctrl-C that arrives while the writer hands its ``at``-th batch to the background
    thread: before the batch is queued (the loop waiting on a full queue) or just after (before the
    writer's own bookkeeping)."""

    def __init__(self, writer: WaveformWriter, at: int, after: bool) -> None:
        self.writer, self.at, self.after, self.calls = writer, at, after, 0

    def on_predict_start(self, trainer, pl_module):
        put = self.writer._queue.put

        def interrupted(item):
            self.calls += 1
            if self.calls == self.at and not self.after:
                raise KeyboardInterrupt
            put(item)
            if self.calls == self.at and self.after:
                raise KeyboardInterrupt

        self.writer._queue.put = interrupted


@pytest.mark.parametrize("after", [False, True])
def test_ctrl_c_while_a_batch_is_handed_over_writes_every_decoded_batch_once(tmp_path, after):
    """The batch being handed over was dropped: the writer let go of it before the queue took it."""
    manifest = write_codes(tmp_path / "data", [4] * 12)  # equal lengths: batches in id order
    out = tmp_path / "out"
    writer = WaveformWriter(out)
    trainer = Trainer(**trainer_kwargs(callbacks=[writer, InterruptedPut(writer, at=2, after=after)]))
    with pytest.raises(SystemExit):  # Lightning's graceful shutdown of a KeyboardInterrupt
        trainer.predict(
            Code2WavModule(model=random_model("tiny")),
            return_predictions=False,
            datamodule=CodesDataModule(predict=str(manifest), batch_size=2),
        )
    ids = [r["id"] for r in manifest_rows(out)]
    # the 2nd batch was handed over at the 3rd batch's end: three batches decoded, each written once
    assert sorted(ids) == [f"r{i:03d}" for i in range(6)], ids
    assert all(r["status"] == "ok" and (out / r["path"]).is_file() for r in manifest_rows(out))


def hold_lock(folder: Path) -> subprocess.Popen:
    """Another process that holds ``folder``'s lock until its stdin closes."""
    code = (
        "import sys; from omni_lightning.data.folder_lock import lock_output_folder; "
        f"lock_output_folder({str(folder)!r}); print('held', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_job_on_an_output_folder_in_use_is_refused_and_changes_nothing(tmp_path, capsys):
    """Two jobs on one folder used to interleave: ids twice in the manifest, others lost. (The command in this
    process: the same checks and run as in a subprocess, at a fraction of its cost.)"""
    from omni_lightning.cli import main

    ckpt = save_model(tmp_path / "ckpt")
    manifest = write_codes(tmp_path / "data", [3, 4, 5])
    out = tmp_path / "out"
    out.mkdir()
    (out / ".r000.wav.tmp").write_bytes(b"the other job is writing this")
    job = ["predict", "--config", str(ROOT / "configs/predict.yaml"), "--model.checkpoint", str(ckpt),
           "--data.predict", str(manifest), "--out_dir", str(out)]  # fmt: skip
    other = hold_lock(out)
    try:
        assert main(job) == 2
        err = capsys.readouterr().err
        assert f"is in use by another predict job (process {other.pid})" in err, err  # said by the checks
        writer = WaveformWriter(out)  # the Python API is refused alike, at the writer's set-up
        with pytest.raises(UsageError, match=f"in use by another predict job \\(process {other.pid}\\)"):
            Trainer(**trainer_kwargs(callbacks=[writer])).predict(
                Code2WavModule(model=random_model("tiny")), datamodule=CodesDataModule(predict=str(manifest))
            )
        assert (out / ".r000.wav.tmp").exists() and not (out / "manifest.jsonl").exists()  # untouched
    finally:
        other.communicate(timeout=60)
    assert main(job) == 0, capsys.readouterr()
    assert len(manifest_rows(out)) == 3
    assert not (out / LOCK_NAME).exists()  # released (and removed) as the job ended


ENCODE_UNDER_A_LIMIT = """
import resource, sys, numpy as np
from pathlib import Path
from omni_lightning.callbacks.audio_files import encode_durably
from omni_lightning.data import folder_lock
resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))  # bytes a file may hold: the disk refuses more
print(encode_durably(Path(sys.argv[1]), np.zeros(24_000, np.float32), 24_000, "wav", "PCM_16"))
"""


def test_a_disk_that_refuses_bytes_is_named_in_the_requests_failure(tmp_path):
    """A file over the process's size limit: the request's reason names the disk's error, and no traceback
    is printed (libsndfile writing to the file itself would hide the error)."""
    target = tmp_path / "a.wav"
    proc = subprocess.run(
        [sys.executable, "-c", ENCODE_UNDER_A_LIMIT, str(target)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "(0, 'OSError: [Errno 27] File too large')" in proc.stdout and proc.stderr == ""
    assert not target.exists()


def test_a_file_system_gone_read_only_fails_the_request_not_the_job(tmp_path, monkeypatch):
    """Removing the half-written file fails too (EROFS): the request fails and the job goes on."""

    def refuse(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    samples, reason = encode_durably(tmp_path / "gone" / "a.wav", np.zeros(100, np.float32), 24_000, "wav", "FLOAT")
    assert samples == 0 and reason.startswith("FileNotFoundError")


def test_hand_edited_manifest_lines_are_ignored_not_fatal(tmp_path):
    """A byte that is not UTF-8, or an id that is a list, crashed every later run before."""
    (tmp_path / "a.wav").write_bytes(b"RIFF")
    (tmp_path / "b.wav").write_bytes(b"RIFF")
    lines = [
        json.dumps({"id": "a", "path": "a.wav", "status": "ok"}).encode(),
        b"\xff\xfe not text",
        json.dumps({"id": ["b"], "path": "b.wav", "status": "ok"}).encode(),
        json.dumps({"id": "b", "status": "error"}).encode(),
    ]
    (tmp_path / "manifest.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    finished = Finished.read(tmp_path)
    assert finished.ids == {"a"}
    finished.compact()
    assert manifest_rows(tmp_path) == [{"id": "a", "path": "a.wav", "status": "ok"}]


def test_a_batch_that_cannot_be_written_does_not_take_the_queued_ones_with_it(tmp_path, monkeypatch):
    """A batch whose ids the writer refuses (an int id from a plain loader) stayed first in line, so the
    error handler failed on it again and dropped the batches queued behind a slow disk."""
    import omni_lightning.callbacks.writer as writer_module

    encode = writer_module.encode_durably
    monkeypatch.setattr(writer_module, "encode_durably", lambda *a, **k: (time.sleep(0.2), encode(*a, **k))[1])
    batches = [
        {"codes": random_codes(1, 6, seed=i), "n_frames": [6], "req_ids": [f"r{i}" if i != 4 else 4]} for i in range(7)
    ]
    out = tmp_path / "out"
    writer = WaveformWriter(out)
    with pytest.raises(Exception):  # noqa: B017 - whatever the writer raises for an id that is no string
        Trainer(**trainer_kwargs(callbacks=[writer])).predict(
            Code2WavModule(model=random_model("tiny")), DataLoader(batches, batch_size=None), return_predictions=False
        )
    assert sorted(r["id"] for r in manifest_rows(out)) == ["r0", "r1", "r2", "r3", "r5"]  # all decoded but the bad
    assert not (out / LOCK_NAME).exists() and out.resolve() not in folder_lock._held  # released: no teardown ran


def test_two_writers_of_one_process_on_one_folder_are_refused(tmp_path):
    """They were not (the lock is per process): each request was written twice."""
    manifest = write_codes(tmp_path / "data", [3, 4])
    out = tmp_path / "out"
    trainer = Trainer(**trainer_kwargs(callbacks=[WaveformWriter(out), WaveformWriter(out)]))
    with pytest.raises(UsageError, match="in use by another writer of this process"):
        trainer.predict(Code2WavModule(model=random_model("tiny")), datamodule=CodesDataModule(predict=str(manifest)))
    assert out.resolve() not in folder_lock._held


LOCK_FROM_A_CHILD = """
import sys
from omni_lightning.data.folder_lock import lock_output_folder
print(lock_output_folder(sys.argv[1]))
"""


def try_lock(folder, answers):
    try:
        answers.put(folder_lock.lock_output_folder(folder))
    except UsageError as err:
        answers.put(str(err))


@pytest.mark.slow
def test_a_rank_the_holder_started_goes_on_and_a_file_system_without_locks_locks_nothing(tmp_path, monkeypatch):
    """ddp_spawn's rank 0 is a child of the command that took the lock: it was refused as a rival job.
    Any other program the holder runs on that folder is a rival. A file system without locks (NFS
    without its lock daemon: ENOLCK) refused every job as "in use"."""
    import fcntl
    import multiprocessing

    from omni_lightning import cli

    assert folder_lock.lock_output_folder(tmp_path, owner="a host program's writer")
    try:
        spawn = multiprocessing.get_context("spawn")
        answers = spawn.Queue()
        rank = spawn.Process(target=try_lock, args=(tmp_path, answers))
        rank.start()
        assert answers.get(timeout=120) is False  # goes on without it: its job's launcher holds it
        rank.join(60)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        other = subprocess.run(
            [sys.executable, "-c", LOCK_FROM_A_CHILD, str(tmp_path)],
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=60,
            env=env,
        )
        assert "in use by another predict job" in other.stderr  # a program of its own: refused
        assert cli.main(["--version"]) == 0 and tmp_path.resolve() in folder_lock._held  # its host's lock kept
    finally:
        folder_lock.unlock_output_folder(tmp_path)

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert folder_lock.lock_output_folder(tmp_path) is False and tmp_path.resolve() not in folder_lock._held


@pytest.mark.slow
def test_a_ddp_rank_finding_every_request_done_leaves_the_folder_to_rank_0(tmp_path):
    """A rank process found the job finished and tidied the folder (another job's temp files removed)."""
    ckpt = save_model(tmp_path / "ckpt")
    manifest = write_codes(tmp_path / "data", [3])
    out = tmp_path / "out"
    proc = cli("predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt), "--data.predict",
               str(manifest), "--out_dir", str(out))  # fmt: skip
    assert proc.communicate(timeout=300)[0] and proc.returncode == 0
    (out / ".r000.wav.tmp").write_bytes(b"another job's file in progress")
    proc = cli("predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt), "--data.predict",
               str(manifest), "--out_dir", str(out), extra_env={"RANK": "1"})  # fmt: skip
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and "nothing left to do" in log, log
    assert (out / ".r000.wav.tmp").exists()


@pytest.mark.slow
def test_a_sigterm_in_the_last_batch_still_exits_143_with_every_file_written(tmp_path):
    """Lightning's loops stop after a batch but not after the last one: the job ended with exit 0."""
    ckpt = save_model(tmp_path / "ckpt")
    manifest = write_codes(tmp_path / "data", [3, 4, 5])
    out = tmp_path / "out"
    proc = cli("predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt), "--data.predict",
               str(manifest), "--out_dir", str(out), "--trainer.callbacks+=helpers.SigtermInLastBatch",
               extra_env={"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"})  # fmt: skip
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 143 and "error: terminated (SIGTERM)" in log, log
    assert sorted(r["id"] for r in manifest_rows(out)) == ["r000", "r001", "r002"]
