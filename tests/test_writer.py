"""WaveformWriter and `omni-lightning predict`: real audio files written by a background thread, resumable
after kill -9 in the middle of its work, DDP on CPU."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import random_codes, random_model
from helpers import cli, manifest_rows, read_until, save_model, trainer_kwargs, write_codes
from lightning.pytorch.callbacks import Callback

from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, Trainer, WaveformWriter
from omni_lightning.callbacks.write_queue import BackgroundWriteError, WriteQueue


def test_wav_files_and_manifest(tmp_path):
    model = random_model("tiny", seed=2)
    lengths = [5, 12, 1, 30, 7]
    manifest = write_codes(tmp_path / "data", lengths, bad={"r003": "range"})
    writer = WaveformWriter(tmp_path / "out")
    trainer = Trainer(**trainer_kwargs(callbacks=[writer]))
    dm = CodesDataModule(predict=str(manifest), batch_size=2)
    assert trainer.predict(Code2WavModule(model=model), datamodule=dm, return_predictions=False) is None
    rows = {r["id"]: r for r in manifest_rows(tmp_path / "out")}
    assert sorted(rows) == ["r000", "r001", "r002", "r003", "r004"]
    assert rows["r003"]["status"] == "error" and "code 4096" in rows["r003"]["reason"]
    for i, n in enumerate(lengths):
        if i == 3:
            continue
        row = rows[f"r{i:03d}"]
        data, sr = sf.read(tmp_path / "out" / row["path"], dtype="float32")
        assert sr == 24000 and row["sr"] == 24000 and data.shape == (model.output_length(n),) == (row["n_samples"],)
        with torch.inference_mode():
            want = model(random_codes(1, n, seed=i))[0, 0].numpy()
        assert np.abs(data - want).max() <= 1.5 / 2**15  # PCM_16 rounding
        assert row["duration_s"] == pytest.approx(row["n_samples"] / 24000)
    assert not list((tmp_path / "out").glob(".*.tmp"))
    assert writer.stats["ok"] == 4 and writer.stats["error"] == 1


# the engine's forward (state, in-place residuals, chunks padded to a bucket) rounds in another order
# than the whole decode: 1e-5 is fp32's share of that, far below PCM_24's step
FORMAT_CASES = [
    ("wav", "FLOAT", 1e-5),
    ("wav", "PCM_24", 1.5 / 2**23 + 1e-5),
    ("flac", "PCM_16", 1.5 / 2**15),
    ("flac", "PCM_24", 1.5 / 2**23 + 1e-5),
]


def test_every_output_format_is_named_in_the_manifest_and_bad_ones_are_refused(tmp_path):
    model = random_model("tiny", seed=2)
    lengths = [4, 9]
    manifest = write_codes(tmp_path / "data", lengths)
    with torch.inference_mode():
        wants = [model(random_codes(1, n, seed=i))[0, 0].numpy() for i, n in enumerate(lengths)]
    for audio_format, subtype, tolerance in FORMAT_CASES:
        out = tmp_path / f"{audio_format}-{subtype}"
        writer = WaveformWriter(out, subtype=subtype, audio_format=audio_format)
        Trainer(**trainer_kwargs(callbacks=[writer])).predict(
            Code2WavModule(model=model),
            datamodule=CodesDataModule(predict=str(manifest), batch_size=1),
            return_predictions=False,
        )
        rows = manifest_rows(out)
        assert len(rows) == 2 and writer.all_written
        for row in rows:
            assert row["path"] == f"{row['id']}.{audio_format}"
            assert (row["format"], row["subtype"]) == (audio_format, subtype)
            info = sf.info(str(out / row["path"]))
            assert info.format == audio_format.upper() and info.subtype == subtype
            data, _ = sf.read(out / row["path"], dtype="float32")
            want = wants[int(row["id"][1:])]
            assert data.shape == want.shape and np.abs(data - want).max() <= tolerance, (audio_format, subtype)
    for bad, named in (
        (dict(subtype="MP3"), "MP3"),
        (dict(audio_format="ogg"), "ogg"),
        (dict(audio_format="flac", subtype="FLOAT"), "FLOAT"),
    ):
        with pytest.raises(ValueError, match=named):
            WaveformWriter(tmp_path, **bad)


@pytest.mark.parametrize("limit", [{"limit_predict_batches": 1}, {"fast_dev_run": True}])
def test_requests_a_trainer_limit_leaves_out_are_not_run_not_failed(tmp_path, limit):
    manifest = write_codes(tmp_path / "data", [4, 5, 6, 7])
    writer = WaveformWriter(tmp_path / "out")
    data = CodesDataModule(predict=str(manifest), batch_size=2, skip_done=tmp_path / "out")
    Trainer(**trainer_kwargs(callbacks=[writer], **limit)).predict(
        Code2WavModule(model=random_model("tiny", seed=2)), datamodule=data, return_predictions=False
    )
    assert writer.stats["ok"] == 2 and writer.stats["missing"] == 2 and not writer.all_written
    assert not writer.any_failed and "2 requests not run (the trainer limits predict batches" in writer.summary()


def test_a_file_that_cannot_be_written_fails_only_its_request_and_a_rerun_writes_it(tmp_path):
    model = random_model("tiny", seed=2)
    manifest = write_codes(tmp_path / "data", [4, 5, 6])
    out = tmp_path / "out"
    (out / "r001.wav").mkdir(parents=True)  # a folder where r001's file goes: renaming onto it fails

    def predict():
        writer = WaveformWriter(out)
        data = CodesDataModule(predict=str(manifest), batch_size=3, skip_done=out)
        Trainer(**trainer_kwargs(callbacks=[writer])).predict(
            Code2WavModule(model=model), datamodule=data, return_predictions=False
        )
        return writer

    writer = predict()
    rows = {r["id"]: r for r in manifest_rows(out)}
    assert rows["r000"]["status"] == rows["r002"]["status"] == "ok"
    assert rows["r001"]["status"] == "error" and "could not write r001.wav" in rows["r001"]["reason"]
    assert writer.stats["ok"] == 2 and writer.stats["error"] == 1 and not writer.all_written
    assert not list(out.glob(".*.tmp"))
    (out / "r001.wav").rmdir()
    again = predict()
    assert (again.stats["ok"], again.stats["skipped"], again.stats["error"]) == (1, 2, 0) and again.all_written
    assert sorted((r["id"], r["status"]) for r in manifest_rows(out)) == [(f"r00{i}", "ok") for i in range(3)]


class BreakManifest(Callback):
    """Turns the manifest into a folder once predict has started: the background thread's append fails."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_predict_start(self, trainer, pl_module):
        (self.out / "manifest.jsonl").unlink()
        (self.out / "manifest.jsonl").mkdir()


def test_an_error_of_the_background_writer_stops_predict_with_that_error(tmp_path):
    manifest = write_codes(tmp_path / "data", [3, 4, 5, 6, 7])
    writer = WaveformWriter(tmp_path / "out", max_pending=1)
    trainer = Trainer(**trainer_kwargs(callbacks=[writer, BreakManifest(tmp_path / "out")]))
    with pytest.raises(BackgroundWriteError) as err:
        trainer.predict(
            Code2WavModule(model=random_model("tiny")),
            return_predictions=False,
            datamodule=CodesDataModule(predict=str(manifest), batch_size=1),
        )
    assert isinstance(err.value.__cause__, IsADirectoryError)
    assert not [t for t in threading.enumerate() if t.name.startswith("omni-lightning")]  # the threads stopped


def test_write_queue_runs_items_in_order_and_never_hangs_on_a_failed_worker():
    done = []
    queue = WriteQueue(done.append, max_pending=2)
    for i in range(20):
        queue.put(i)
    queue.drain()
    assert done == list(range(20))
    queue.close()

    def fail(item):
        if item == 1:
            raise OSError("disk gone")
        time.sleep(0.01)
        done.append(item)

    done.clear()
    queue = WriteQueue(fail, max_pending=1)
    with pytest.raises(BackgroundWriteError, match="disk gone"):
        for i in range(50):  # blocks on the full queue at times: the worker's error ends the wait
            queue.put(i)
    assert done == [0]  # nothing after the failed item ran, nothing ran out of order
    with pytest.raises(BackgroundWriteError):
        queue.close()
    assert not queue._thread.is_alive()


@pytest.mark.slow
def test_kill_9_while_the_background_writer_is_mid_batch_then_rerun_writes_every_request_once(tmp_path):
    ckpt = save_model(tmp_path / "ckpt")
    lengths = [20 + (i * 7) % 30 for i in range(16)]
    manifest = write_codes(tmp_path / "data", lengths)
    out = tmp_path / "out"
    args = ["predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt),
            "--data.predict", str(manifest), "--data.batch_size", "4", "--out_dir", str(out)]  # fmt: skip
    # Batches are sorted by length, so the longest request is in the last batch. Its temp file is made a
    # FIFO, whose open blocks until a reader comes, as a stalled disk would: the background thread stops
    # in the middle of that batch, the batch's other files in durable temp files, not yet renamed or listed.
    # Only that batch's temp files are waited for: an earlier batch's are renamed a moment after they appear.
    last_batch = sorted(range(16), key=lambda i: (lengths[i], i))[-4:]
    target = f"r{last_batch[-1]:03d}"
    stalled = {out / f".r{i:03d}.wav.tmp" for i in last_batch}
    proc = cli(*args)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and not manifest_rows_or_none(out):
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before the writer could be stalled:\n" + proc.stdout.read()
    os.mkfifo(out / f".{target}.wav.tmp")
    while proc.poll() is None and time.time() < deadline and not stalled <= set(temp_files(out)):
        time.sleep(0.05)
    now = temp_files(out)
    assert proc.poll() is None and stalled <= set(now), f"the writer never got to the stalled batch: {now}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    rows = manifest_rows(out)
    assert 1 <= len(rows) < 16 and all((out / r["path"]).is_file() for r in rows)  # a line only for a durable file
    assert target not in {r["id"] for r in rows} and not (out / f"{target}.wav").exists()

    rerun = cli(*args)
    log = rerun.communicate(timeout=600)[0]
    assert rerun.returncode == 0, log
    assert f"{16 - len(rows)} requests written" in log and f"{len(rows)} already done" in log
    rows = manifest_rows(out)
    ids = [r["id"] for r in rows]
    assert sorted(ids) == [f"r{i:03d}" for i in range(16)] and len(set(ids)) == 16
    assert all(r["status"] == "ok" for r in rows)
    model = Code2Wav.from_pretrained(ckpt)
    for r in rows:
        info = sf.info(str(out / r["path"]))
        assert info.frames == r["n_samples"] == model.output_length(lengths[int(r["id"][1:])])
    assert temp_files(out) == [] and sorted(p.name for p in out.glob("*.wav")) == sorted(r["path"] for r in rows)

    done = cli(*args)  # nothing left: decided before the model is built
    log = done.communicate(timeout=120)[0]
    assert done.returncode == 0 and "16 already done" in log and "nothing left to do" in log, log


def temp_files(out: Path) -> list[Path]:
    return sorted(out.glob(".*.tmp"))


def manifest_rows_or_none(out: Path):
    return manifest_rows(out) if (out / "manifest.jsonl").is_file() else None


def test_cli_predict_with_bad_entries_and_summary(tmp_path):
    ckpt = save_model(tmp_path / "ckpt")
    manifest = write_codes(tmp_path / "data", [6, 9, 3, 4], bad={"r001": "missing", "r002": "range"})
    out = tmp_path / "out"
    proc = cli("predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt),
               "--data.predict", str(manifest), "--out_dir", str(out),
               "--timings", str(tmp_path / "t.json"))  # fmt: skip
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 3, log  # finished, but not every request was written
    assert "2 requests written" in log and "2 failed" in log and "failed r001" in log
    rows = {r["id"]: r["status"] for r in manifest_rows(out)}
    assert rows == {"r000": "ok", "r001": "error", "r002": "error", "r003": "ok"}
    # --timings: the phases as the run saw them (wall clock), in order, and the writer's share
    t = json.loads((tmp_path / "t.json").read_text())
    order = [
        "process_start",
        "main",
        "checked",
        "imported",
        "parsed",
        "built",
        "predict_start",
        "first_batch",
        "last_batch_end",
        "predict_end",
        "end",
    ]
    assert [t[k] for k in order] == sorted(t[k] for k in order), t
    assert (
        t["batches"] >= 1 and t["stats"]["ok"] == 2 and set(t["writer"]) == {"queue_wait_s", "write_busy_s", "drain_s"}
    )
    assert "timings (since process start): arguments checked" in log and "Lightning loaded" in log


@pytest.mark.slow
def test_ddp_predict_on_two_cpu_processes_covers_every_request_once(tmp_path):
    ckpt = save_model(tmp_path / "ckpt")
    manifest = write_codes(tmp_path / "data", [3 + (i * 5) % 17 for i in range(13)])
    out = tmp_path / "out"
    args = ("predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt),
            "--data.predict", str(manifest), "--data.batch_size", "2", "--out_dir", str(out),
            "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp")  # fmt: skip
    proc = cli(*args)
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log
    assert "predict: 13 requests written" in log  # the summary counts every rank's requests
    rows = manifest_rows(out)
    assert sorted(r["id"] for r in rows) == [f"r{i:03d}" for i in range(13)]
    assert not list(out.glob("manifest.rank*.jsonl"))
    assert len(list(out.glob("*.wav"))) == 13

    # one request left for two ranks: rank 1 is dealt none, yet joins the job's end (the merge, the counts)
    (out / "r004.wav").unlink()
    proc = cli(*args)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and "predict: 1 request written" in log and "12 already done" in log, log
    assert sorted(r["id"] for r in manifest_rows(out)) == [f"r{i:03d}" for i in range(13)]


@pytest.mark.parametrize(
    "sig, status, said",
    [
        (signal.SIGINT, 130, "error: interrupted"),
        pytest.param(signal.SIGTERM, 143, "error: terminated (SIGTERM)", marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_or_sigterm_writes_what_was_decoded_then_exits(tmp_path, sig, status, said):
    """SIGTERM (a scheduler's stop): stock Lightning's predict loop records it and decodes every request.
    The signal goes to the whole process group, loader workers too, as a terminal's Ctrl-C or Slurm's
    stop does: a worker killed by SIGTERM used to fail the job (exit 1, a traceback)."""
    ckpt = save_model(tmp_path / "ckpt")
    manifest = write_codes(tmp_path / "data", [20 + (i * 7) % 30 for i in range(60)])
    out = tmp_path / "out"
    # Ctrl-C as in a terminal: SIGINT at its default in the command, whatever this test process inherited
    # (a shell's background job ignores it, and Python keeps an ignored SIGINT ignored: no interrupt)
    proc = cli("predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt),
               "--data.predict", str(manifest), "--data.batch_size", "2", "--out_dir", str(out),
               "--data.num_workers", "2", start_new_session=True,
               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    # the signal goes once the progress bar counts 10 of the 60 requests decoded: 50 are left (seconds of
    # decode). Waiting for the first manifest line instead raced twice on a loaded machine: the writer's
    # fsyncs lagged and that line came as the job ended
    printed, reader = read_until(proc, "requests=10/60")
    assert proc.poll() is None, "the job ended before it could be interrupted:\n" + "".join(printed)
    seen = len(manifest_rows_or_none(out) or [])
    os.killpg(proc.pid, sig)
    proc.wait(timeout=120)
    reader.join(timeout=60)
    log = "".join(printed)
    assert proc.returncode == status and said in log, log
    rows = manifest_rows(out)
    # every request decoded before the signal is written (at least the 10 the bar counted), not all 60
    assert max(seen, 10) <= len(rows) < 60 and all((out / r["path"]).is_file() for r in rows)
    assert temp_files(out) == []  # the background thread finished its batches: nothing half-written


def test_an_output_folder_that_is_a_file_is_named_so(tmp_path):
    """From Python (the command line checks it first) it read "cannot be used ([Errno 17] File exists)"."""
    (tmp_path / "wavs").write_text("a file")
    trainer = Trainer(**trainer_kwargs(callbacks=[WaveformWriter(tmp_path / "wavs")]))
    data = CodesDataModule(predict={"a": random_codes(1, 3)[0]}, config="tiny")
    with pytest.raises(ValueError, match=r"output folder .*wavs is a file, not a folder: pick another"):
        trainer.predict(Code2WavModule(config="tiny", random_weights=True), datamodule=data)


def test_requests_left_out_as_finished_in_another_folder_are_not_left_out_silently(tmp_path):
    """CodesDataModule(skip_done=a) with a writer to b: b got none of a's requests and the summary
    said every request was written."""
    done = tmp_path / "a"
    done.mkdir()
    (done / "r0.wav").write_bytes(b"RIFF")
    (done / "manifest.jsonl").write_text(json.dumps({"id": "r0", "path": "r0.wav", "status": "ok"}) + "\n")
    data = CodesDataModule(predict={f"r{i}": random_codes(1, 3, seed=i)[0] for i in range(2)}, skip_done=done)
    trainer = Trainer(**trainer_kwargs(callbacks=[WaveformWriter(tmp_path / "b")]))
    with pytest.warns(UserWarning, match=r"1 request finished in skip_done=.*a: not written here"):
        trainer.predict(Code2WavModule(config="tiny", random_weights=True), datamodule=data, return_predictions=False)
    # FLAC into a folder of finished WAVs: those count as done, and the writer says so (it wrote only r1)
    flac = WaveformWriter(done, audio_format="flac")
    data = CodesDataModule(predict={f"r{i}": random_codes(1, 3, seed=i)[0] for i in range(2)}, skip_done=done)
    with pytest.warns(UserWarning, match=r"1 request in .*a is already written as wav, not flac: it counts as done"):
        Trainer(**trainer_kwargs(callbacks=[flac])).predict(
            Code2WavModule(config="tiny", random_weights=True), datamodule=data, return_predictions=False
        )
    assert flac.stats["ok"] == 1 and (done / "r1.flac").is_file()
