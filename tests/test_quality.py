"""PESQ and STOI (evaluation/quality.py): the packages' own values on speech-like signals, NaN and a count
for requests a metric cannot score, what an offline W&B run holds read back from disk, a fit whose
validation waits for no score and leaves no process behind, and a user's mistakes as one line."""

import csv
import json
import math
import multiprocessing
import sys

import pytest
import torch
from conftest import random_model
from helpers import ROOT, trainer_kwargs
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from wandb_records import history, wait_for_exit

from omni_lightning import Code2WavModule, CodesDataModule, Trainer
from omni_lightning.data.synthetic import make_demo_data, make_teacher, speech_like
from omni_lightning.errors import UsageError
from omni_lightning.evaluation.quality import INSTALL, QualityScorer

pesq = pytest.importorskip("pesq")
pystoi = pytest.importorskip("pystoi")
RATE = 24000


def with_noise(clean, snr_db, seed):
    noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(seed))
    return clean + noise * (clean.pow(2).mean() / noise.pow(2).mean()).sqrt() * 10 ** (-snr_db / 20)


def padded(signals, extra=3000, fill=0.7):
    """[B, T] with junk past each signal's end (a batch's padding is never scored)."""
    out = torch.full((len(signals), max(len(s) for s in signals) + extra), fill)
    for i, s in enumerate(signals):
        out[i, : len(s)] = s
    return out


def packages_scores(reference, generated):
    """What the packages themselves give for one request (PESQ on torchaudio's 16 kHz resampling)."""
    from torchaudio.functional import resample

    ref16, gen16 = (resample(s, RATE, 16000).numpy() for s in (reference, generated))
    ref, gen = reference.numpy(), generated.numpy()
    return {"pesq": pesq.pesq(16000, ref16, gen16, "wb"), "stoi": pystoi.stoi(ref, gen, RATE),
            "estoi": pystoi.stoi(ref, gen, RATE, extended=True)}  # fmt: skip


def test_scores_are_the_packages_own_on_speech_like_signals():
    clean = speech_like(2.0, RATE, seed=1)
    delayed = torch.cat([torch.zeros(240), clean[:-240]])  # 10 ms late
    degraded = {"clean": clean, "snr20": with_noise(clean, 20, 2), "snr5": with_noise(clean, 5, 3), "delayed": delayed}
    cut = [len(clean)] * 3 + [len(clean) - 4000]  # the last one shorter than its padded row
    generated = padded([d[:n] for d, n in zip(degraded.values(), cut)])
    reference = padded([clean[:n] for n in cut], fill=-0.7)
    scorer = QualityScorer(("pesq", "stoi", "estoi"), RATE, workers=1)
    try:
        futures = scorer.submit(generated[:, None], reference, torch.tensor(cut))
        got = {name: f.result().values for name, f in zip(degraded, futures)}
        run = scorer.results(torch.device("cpu"))
    finally:
        scorer.close()
    for (name, d), n in zip(degraded.items(), cut):
        assert got[name] == pytest.approx(packages_scores(clean[:n], d[:n]), rel=1e-6, abs=1e-6), name
    assert got["clean"]["pesq"] > 4.6 and got["clean"]["stoi"] > 0.999  # a signal against itself
    for metric in ("pesq", "stoi", "estoi"):  # noisier is worse, on every metric
        assert got["clean"][metric] > got["snr20"][metric] > got["snr5"][metric], metric
    # PESQ aligns a delayed copy; STOI, frame by frame, does not
    assert got["delayed"]["pesq"] > got["snr20"]["pesq"] and got["delayed"]["stoi"] < got["snr20"]["stoi"]
    assert run["pesq"] == pytest.approx(sum(g["pesq"] for g in got.values()) / 4)
    assert run["pesq_unscored"] == run["stoi_unscored"] == 0 and run["quality_s"] > 0


def test_requests_a_metric_cannot_score_are_nan_and_counted_never_averaged_in():
    speech = speech_like(1.5, RATE, seed=4)
    generated = with_noise(speech, 10, 5)
    cases = {  # (reference, generated): what each metric makes of it
        "good": (speech, generated),
        "0.2 s": (speech[:4800], generated[:4800]),  # too short for PESQ (0.25 s) and for STOI (~0.4 s)
        "0.3 s": (speech[:7200], generated[:7200]),  # long enough for PESQ only
        "silent reference": (torch.zeros_like(speech), generated),
        "silent output": (speech, torch.zeros_like(speech)),  # scored: the floor of each scale
        "not finite": (speech, torch.where(torch.arange(len(speech)) == 99, math.nan, generated)),
    }
    scorer = QualityScorer(("pesq", "stoi"), RATE, workers=1, pending_audio_s=0.0)  # one request at a time
    try:
        lengths = torch.tensor([len(r) for r, _ in cases.values()])
        futures = scorer.submit(padded([g for _, g in cases.values()])[:, None], padded([r for r, _ in cases.values()]),
                                lengths)  # fmt: skip
        assert all(f.done() for f in futures[:-1])  # each waited for the one before: bounded host memory
        got = {name: f.result().values for name, f in zip(cases, futures)}
        run = scorer.results(torch.device("cpu"))
    finally:
        scorer.close()
    nan = {name: [m for m, v in values.items() if math.isnan(v)] for name, values in got.items()}
    assert nan == {"good": [], "0.2 s": ["pesq", "stoi"], "0.3 s": ["stoi"], "silent reference": ["pesq", "stoi"],
                   "silent output": [], "not finite": ["pesq", "stoi"]}  # fmt: skip
    assert got["silent output"]["stoi"] == pytest.approx(0.0, abs=1e-6)
    # a model that falls silent scores PESQ's floor: about loud noise's, below the 10 dB noisy copy (1.38)
    from torchaudio.functional import resample

    loud_noise = 0.1 * torch.randn(len(speech), generator=torch.Generator().manual_seed(9))
    noise = pesq.pesq(16000, *(resample(x, RATE, 16000).numpy() for x in (speech, loud_noise)), "wb")
    assert 0.99 < got["silent output"]["pesq"] < min(1.1, noise + 0.05) < got["good"]["pesq"] - 0.2
    pesqs = [got[k]["pesq"] for k in ("good", "0.3 s", "silent output")]
    assert run["pesq"] == pytest.approx(sum(pesqs) / 3)  # the silent output's floor is averaged in
    assert run["stoi"] == pytest.approx(got["good"]["stoi"] / 2)  # the silent output's 0 is a score
    assert run["pesq_unscored"] == 3 and run["stoi_unscored"] == 4


def test_the_wait_for_the_media_tables_scores_counts_and_workers_stop_at_the_cpus():
    """The W&B table waits for the scores it shows through ``QualityScorer.wait``: that time is in
    ``quality_wait_s`` (it was lost when the media waited first). Asked for more workers than CPUs, the
    scorer says so and starts one per CPU."""
    import time

    from omni_lightning.evaluation.scoring import usable_cpus

    speech = speech_like(3.0, RATE, seed=1)
    scorer = QualityScorer(("pesq",), RATE, workers=1)
    try:
        futures = scorer.submit(with_noise(speech, 10, 2)[None, None], speech[None], torch.tensor([len(speech)]))
        start = time.perf_counter()
        scores = scorer.wait([futures[0], None])
        waited = time.perf_counter() - start
        assert scores == [futures[0].result().values, {}] and waited > 0.01  # 3 s of PESQ: a real wait
        run = scorer.results(torch.device("cpu"))
        assert run["quality_wait_s"] >= 0.9 * waited and run["pesq"] == scores[0]["pesq"]
    finally:
        scorer.close()
    many = QualityScorer(("stoi",), RATE, workers=usable_cpus() + 7)
    try:
        with pytest.warns(
            UserWarning, match=f"quality_workers={usable_cpus() + 7}: this machine has {usable_cpus()} CPUs"
        ):
            many.submit(speech[None, None], speech[None], torch.tensor([len(speech)]))
        assert len(multiprocessing.active_children()) == usable_cpus()
        assert many.results(torch.device("cpu"))["stoi"] == pytest.approx(1.0, abs=1e-3)
    finally:
        many.close()


def speech_pairs(module, frames=(14, 10), seed=0):
    """In-memory pairs: random codes and speech-like references."""
    gen = torch.Generator().manual_seed(seed)
    n = module.model.output_length
    return {f"u{i}": (torch.randint(0, 2048, (16, f), generator=gen), speech_like(n(f) / RATE, RATE, seed=i)[: n(f)])
            for i, f in enumerate(frames)}  # fmt: skip


def write_pairs(folder, frames):
    """A manifest of random codes with speech-like reference audio, as a user's validation set."""
    import numpy as np
    import soundfile as sf

    folder.mkdir()
    rows = []
    for i, f in enumerate(frames):
        np.save(folder / f"u{i}.npy", torch.randint(0, 2048, (16, f), generator=torch.Generator().manual_seed(i)))
        sf.write(folder / f"u{i}.wav", speech_like(f * 1920 / RATE, RATE, seed=i).numpy(), RATE, subtype="FLOAT")
        rows.append(json.dumps({"id": f"u{i}", "codes": f"u{i}.npy", "audio": f"u{i}.wav"}))
    (folder / "val.jsonl").write_text("\n".join(rows) + "\n")
    return folder / "val.jsonl"


def test_the_cli_summary_and_the_offline_wandb_run_show_the_same_scores_per_run_and_per_request(tmp_path, capsys):
    """``omni-lightning validate --model.quality_metrics [pesq,stoi]``: its one-line summary, the W&B
    run's history and its samples table (every request here) agree; the run leaves no worker behind."""
    import wandb

    from omni_lightning.cli import main

    val = write_pairs(tmp_path / "data", frames=(20, 3))  # 1.6 s, and 0.24 s: too short for either metric
    job = ["validate", "--config", str(ROOT / "configs/eval_wandb.yaml"), "--data.val", str(val),
           "--model.random_weights", "true", "--model.quality_metrics", "[pesq,stoi]", "--trainer.accelerator", "cpu",
           "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]  # fmt: skip
    try:
        assert main(job) == 0
    finally:
        wandb.finish()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("validate: val/"))
    said = dict(item.split("=") for item in line.removeprefix("validate: ").split("; ")[0].split(", "))
    record_file = next((tmp_path / "runs").rglob("run-*.wandb"))
    wait_for_exit(record_file)
    logged = {k: v for row in history(record_file) for k, v in row.items()}
    for key in ("val/pesq", "val/stoi", "val/pesq_unscored", "val/stoi_unscored", "val/quality_s"):
        assert float(said[key]) == pytest.approx(logged[key], rel=1e-3), key
    assert logged["val/pesq_unscored"] == logged["val/stoi_unscored"] == 1 and logged["val/quality_s"] > 0
    table = json.loads(next(record_file.parent.rglob("samples_*.table.json")).read_text())
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["data"]}
    for name in ("pesq", "stoi"):
        assert rows["u0"][name] == pytest.approx(logged[f"val/{name}"], rel=1e-6)  # the one request scored
        assert rows["u1"][name] is None or math.isnan(rows["u1"][name])
    assert not multiprocessing.active_children()


def test_a_fits_validation_waits_for_no_score_and_logs_them_at_its_step(tmp_path):
    """The training goes on after a validation with its scores still in the workers; they are logged at
    that validation's step (where its other metrics are) when the next one starts, or when fit ends."""
    module = Code2WavModule(model=random_model("tiny", seed=7), learning_rate=1e-3, quality_metrics=["stoi"])
    pairs = speech_pairs(module)
    seen = []

    class AfterValidation(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((trainer.global_step, module.quality_scorer.pending, "val/stoi" in trainer.callback_metrics))

    kw = trainer_kwargs(logger=CSVLogger(str(tmp_path)), max_steps=2, val_check_interval=1, num_sanity_val_steps=0,
                        check_val_every_n_epoch=None, callbacks=[AfterValidation()])  # fmt: skip
    trainer = Trainer(**kw)
    trainer.fit(module, datamodule=CodesDataModule(train=pairs, val=pairs, batch_size=2, crop_frames=12))
    assert seen[1] == (1, 2, False)  # the step after the first validation: 2 requests not gathered, nothing logged
    rows = csv_rows(tmp_path)
    steps = {name: sorted(int(r["step"]) for r in rows if r.get(name)) for name in ("val/stoi", "val/mel_distance")}
    assert steps["val/stoi"] == steps["val/mel_distance"] and len(steps["val/stoi"]) == 2
    assert all(0 < float(r["val/stoi"]) < 1 for r in rows if r.get("val/stoi"))
    assert module.quality_scorer.pending == 0 and not multiprocessing.active_children()
    trainer.save_checkpoint(tmp_path / "tuned.ckpt")  # how a later run scores is not the checkpoint's
    assert "quality_metrics" not in torch.load(tmp_path / "tuned.ckpt", weights_only=False)["hyper_parameters"]


def csv_rows(folder):
    with open(next(folder.rglob("metrics.csv"))) as f:
        return list(csv.DictReader(f))


def test_a_mistake_naming_the_metrics_or_a_missing_extra_is_one_line(tmp_path, monkeypatch, capsys):
    for bad, said in [("pesq", "must be a list of names from pesq, stoi, estoi, got 'pesq'"),
                      (["pesq", "mos"], "unknown metric 'mos'; choose from pesq, stoi, estoi"),
                      ([3], "unknown metric 3")]:  # fmt: skip
        with pytest.raises(UsageError, match=said):
            Code2WavModule(config="tiny", quality_metrics=bad)
    with pytest.raises(UsageError, match="quality_workers must be an integer >= 1"):
        Code2WavModule(config="tiny", quality_metrics=["stoi"], quality_workers=0)
    monkeypatch.setitem(sys.modules, "pystoi", None)  # as if the quality extra were not installed
    with pytest.raises(UsageError) as missing:
        Code2WavModule(config="tiny", quality_metrics=["pesq", "stoi"])
    assert str(missing.value) == f"quality_metrics ['pesq', 'stoi'] need the pystoi package: {INSTALL}"

    from omni_lightning.cli import main

    val = make_demo_data(tmp_path, 1, 0.5, 0.5, teacher=make_teacher(), name="val.jsonl")
    job = ["validate", "--config", str(ROOT / "configs/eval_wandb.yaml"), "--data.val", str(val),
           "--trainer.logger", "false", "--trainer.accelerator", "cpu", "--model.random_weights", "true"]  # fmt: skip
    for given, said in [("[pesq,stoi]", f"need the pystoi package: {INSTALL}"), ("[pesq,mos]", "unknown metric 'mos'")]:
        assert main([*job, "--model.quality_metrics", given]) == 2  # before the run: no batch was generated
        err = capsys.readouterr().err
        assert err.startswith("error: quality_metrics") and said in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as exited:  # the parser's own: a name where a list goes
        main([*job, "--model.quality_metrics", "pesq"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "error: --model.quality_metrics takes list[str] or null, not 'pesq'" in err, err
