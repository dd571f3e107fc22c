"""WaveformWriter and `omni-lightning predict`: real WAV files, resumable after kill -9, DDP on CPU."""

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import random_codes, random_model
from helpers import cli, save_model, trainer_kwargs

from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, Trainer, WaveformWriter


def write_codes(folder: Path, lengths, bad=()):
    """A manifest over .npy code files; `bad` names entries to break (missing or out of range)."""
    (folder / "codes").mkdir(parents=True)
    rows = []
    for i, n in enumerate(lengths):
        rid = f"r{i:03d}"
        codes = random_codes(1, n, seed=i)[0].numpy()
        if rid in bad and bad[rid] == "range":
            codes[0, 0] = 4096
        if not (rid in bad and bad[rid] == "missing"):
            np.save(folder / "codes" / f"{rid}.npy", codes)
        rows.append({"id": rid, "codes": f"codes/{rid}.npy"})
    manifest = folder / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def manifest_rows(out: Path):
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


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


def test_float_subtype_and_bad_configuration(tmp_path):
    model = random_model("tiny", seed=2)
    manifest = write_codes(tmp_path / "data", [4])
    writer = WaveformWriter(tmp_path / "out", subtype="FLOAT")
    Trainer(**trainer_kwargs(callbacks=[writer])).predict(
        Code2WavModule(model=model), datamodule=CodesDataModule(predict=str(manifest)), return_predictions=False
    )
    data, _ = sf.read(tmp_path / "out" / "r000.wav", dtype="float32")
    with torch.inference_mode():
        assert np.array_equal(data, model(random_codes(1, 4, seed=0))[0, 0].numpy())
    with pytest.raises(ValueError, match="subtype"):
        WaveformWriter(tmp_path, subtype="MP3")


def test_kill_9_then_rerun_writes_every_request_exactly_once(tmp_path):
    ckpt = save_model(tmp_path / "ckpt")
    manifest = write_codes(tmp_path / "data", [50 + (i * 7) % 40 for i in range(40)])
    out = tmp_path / "out"
    args = ["predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt),
            "--data.predict", str(manifest), "--data.batch_size", "1", "--out_dir", str(out)]  # fmt: skip
    proc = cli(*args)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (out / "manifest.jsonl").is_file() and len((out / "manifest.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before it could be killed:\n" + proc.stdout.read()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = len(manifest_rows(out))
    assert 3 <= written < 40
    rerun = cli(*args)
    log = rerun.communicate(timeout=600)[0]
    assert rerun.returncode == 0, log
    rows = manifest_rows(out)
    ids = [r["id"] for r in rows]
    assert sorted(ids) == [f"r{i:03d}" for i in range(40)] and len(set(ids)) == 40
    assert all(r["status"] == "ok" for r in rows)
    assert f"{written} already done" in log
    model = Code2Wav.from_pretrained(ckpt)
    for r in rows:
        info = sf.info(str(out / r["path"]))
        n = np.load(tmp_path / "data" / "codes" / f"{r['id']}.npy").shape[-1]
        assert info.frames == r["n_samples"] == model.output_length(n) and info.samplerate == 24000
    assert not list(out.glob(".*.tmp"))
    assert sorted(p.name for p in out.glob("*.wav")) == sorted(r["path"] for r in rows)


def test_cli_predict_with_bad_entries_and_summary(tmp_path):
    ckpt = save_model(tmp_path / "ckpt")
    manifest = write_codes(tmp_path / "data", [6, 9, 3, 4], bad={"r001": "missing", "r002": "range"})
    out = tmp_path / "out"
    proc = cli("predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt),
               "--data.predict", str(manifest), "--out_dir", str(out))  # fmt: skip
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 3, log  # finished, but not every request was written
    assert "2 requests written" in log and "2 failed" in log and "failed r001" in log
    rows = {r["id"]: r["status"] for r in manifest_rows(out)}
    assert rows == {"r000": "ok", "r001": "error", "r002": "error", "r003": "ok"}


def test_ddp_predict_on_two_cpu_processes_covers_every_request_once(tmp_path):
    ckpt = save_model(tmp_path / "ckpt")
    manifest = write_codes(tmp_path / "data", [3 + (i * 5) % 17 for i in range(13)])
    out = tmp_path / "out"
    proc = cli("predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt),
               "--data.predict", str(manifest), "--data.batch_size", "2", "--out_dir", str(out),
               "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp")  # fmt: skip
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log
    assert "predict: 13 requests written" in log  # the summary counts every rank's requests
    rows = manifest_rows(out)
    assert sorted(r["id"] for r in rows) == [f"r{i:03d}" for i in range(13)]
    assert not list(out.glob("manifest.rank*.jsonl"))
    assert len(list(out.glob("*.wav"))) == 13
