"""The benchmark scripts run end to end on the CPU (tiny preset, a few requests), as subprocesses the
way a user runs them, and write what they promise: a benchmark that broke would otherwise be found on
the GPU machine, where its time is scarce. Their speeds mean nothing here and are not checked; what
is checked is each script's own correctness figure where it has one (fp32 exactness of the job
against solo decodes, of streaming against the whole decode). ``bench_job.py`` runs inside the device
battery's dry run, on a before tree and this one. Every script is imported; the ones in ``NOT_RUN``
take too long for CI and are not run here, and three of ``JOBS`` run in the slow tier only (``SLOW_JOBS``)."""

import importlib
import json
import os
import subprocess
import sys
import tarfile

import pytest
from helpers import ROOT

# scripts/<group>/<name>.py by name; each group's folder on the path, as a script run has its own
SCRIPTS = {p.stem: p for p in sorted((ROOT / "scripts").glob("*/*.py"))}
sys.path[:0] = sorted({str(p.parent) for p in SCRIPTS.values()}) + [str(ROOT / "scripts")]
from battery_plan import STEPS  # noqa: E402

JOBS = {
    "bench_forward": ["--preset", "tiny", "--device", "cpu", "--batches", "1", "--seconds", "1", "--repeats", "1",
                      "--no-fidelity"],
    "bench_train": ["--preset", "tiny", "--device", "cpu", "--batch", "2", "--steps", "1", "--warmup", "1",
                    "--crop-seconds", "0.3"],
    "bench_stream": ["--preset", "tiny", "--device", "cpu", "--dtype", "fp32", "--streams", "2", "--chunk", "2",
                     "--steps", "2", "--ttfa-trials", "2", "--fidelity-frames", "8", "--fidelity-requests", "1",
                     "--no-graphs"],
    "profile_engine": ["--preset", "tiny", "--device", "cpu", "--shapes", "2x4", "--profile-shape", "2x4"],
}  # fmt: skip


def run_script(name, args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SCRIPTS[name]), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


SLOW_JOBS = ("bench_forward", "bench_train", "profile_engine")  # ~8 s each: pytest -m slow (CI's 10 minutes)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] * (n in SLOW_JOBS)) for n in sorted(JOBS)])
def test_benchmark_script_runs_on_the_cpu_and_writes_its_result(name, tmp_path):
    out = tmp_path / f"{name}.json"
    run_script(name, [*JOBS[name], "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert result["meta"]["args"]["preset"] == "tiny"
    if name == "bench_stream":
        assert result["fp32_stream_max_abs_diff"] <= 1e-4  # streaming against the whole fp32 decode
        assert result["ttfa_ms"]["stream"] > 0
    if name == "bench_train":
        (row,) = result["rows"]
        assert row["audio_s_per_s"] > 0 and 0 < row["updated"] <= 1
    if name in ("bench_forward", "profile_engine"):
        assert result["forward" if name == "bench_forward" else "rows"]


def test_simulate_plan_prices_every_job():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SCRIPTS["simulate_plan"]), "--frames", "1024"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1024 |")]
    assert [r.split("|")[5].strip() for r in rows] == ["job", "long-tailed", "b1x125", "b32x125", "lone7500"]
    assert "| b1x125 | 1, " in proc.stdout  # a lone 10 s request is one forward (plan.py)


NOT_RUN = {  # script: its CPU smoke command's arguments, and why CI does not run it
    "bench_cli": ("--files 4 --seconds 0.5 1 --model.config tiny", "~30 s: the CLI, its rerun, a fresh process"),
    "bench_predict": ("--preset tiny --device cpu --dtype fp32 --batch 2 --seconds 1 --audio-per-run 4", "~6 s"),
    "bench_quality": ("--seconds 1 --repeats 1 --requests 4 --fit-steps 2 --batch 2", "~25 s: 3 test runs, 2 fits"),
    "bench_scale": ("--preset tiny --device cpu --devices 1 --requests 4 --fit-steps 1", "~75 s: DDP processes"),
    "measure_predict_rss": ("--audio-mb 2 --min-seconds 0.5 --max-seconds 1", "~20 s: a process per variant"),
    "profile_train": ("--preset tiny --device cpu --batch 2 --crop-seconds 0.3", "~10 s: two fits profiled"),
    "recipe_sweep": ("--variants lr-1e-3 --steps 2 --eval-every 2 --out r.json --work data", "~20 s: 30 pairs"),
    "recipe_stoi": ("--out s.json --work data", "~100 s: 6 pairs, 4 students and 13 changed copies scored"),
    "lightning_predict_tests": ("--lightning-src PATH", "needs a checkout of Lightning's repository and its tests"),
    "bench_litserve": ("--clients 2 --seconds 2", "needs litserve (not a dependency); two servers in turn"),
}


def test_every_script_imports_and_is_run_here_or_says_why_not():
    scripts = {*SCRIPTS, "workload"}
    run = {*JOBS, "simulate_plan", "device_battery", "battery_plan", "workload"}
    run |= {"kernel_report"}  # by tests/test_kernel_report.py
    run |= {
        "load_test_serve",
        "serve_clients",
        "free_decoder",
        "sim_device",
    }  # by test_the_serve_load_test_runs_on_the_cpu
    run |= {"redecode"}  # by bench_stream
    run |= {s.script for s in STEPS}
    assert scripts - run - {"pytest"} == set(NOT_RUN), "a script neither run here nor listed in NOT_RUN"
    for name in sorted(scripts):  # a name the package no longer has fails here, not on the GPU machine
        assert callable(getattr(importlib.import_module(name), "main", None)) or name in (
            "battery_plan",
            "workload",
            "serve_clients",
            "redecode",
        )


def test_every_battery_step_parses_its_gpu_and_smoke_arguments():
    for step in STEPS:
        if step.script == "pytest":
            continue
        parser = importlib.import_module(step.script).parser()
        for args in (step.args, step.smoke):
            parsed = parser.parse_args([*args, "--out", "x.json"])
            assert parsed.out == "x.json"
        assert "tiny" in step.smoke and "cpu" in step.smoke, step.name


def test_battery_summary_has_a_line_for_every_step_whatever_its_script_reports(monkeypatch):
    device_battery = importlib.import_module("device_battery")
    from battery_plan import FIGURES

    runs = []
    for step in STEPS:  # the summary under test: its input fabricated, every step, both versions, a failure
        labels = [label for label, _, _ in FIGURES.get(step.script, ())]
        for version in ("before", "after") if step.ab else ("after",):
            for result in ({}, {"rows": [], "forward": [{}], "x_realtime": "?"}):  # readers of an odd result
                assert device_battery.figures(step, result) == {}
            got = {"passed": 3} if step.script == "pytest" else dict.fromkeys(labels, 1.0)
            runs.append({"step": step.name, "version": version, "round": 1, "rc": int(step.name == "convs"),
                         "figures": got, "tail": []})  # fmt: skip
    lines = device_battery.summary(runs)
    for step in STEPS:
        assert any(line.startswith(f"| {step.name} |") for line in lines), step.name
        assert step.script == "pytest" or step.script in FIGURES, f"{step.script}: no FIGURES entry"
    assert lines[-1] == "FAILED: convs after r1 (exit 1)"
    monkeypatch.delitem(FIGURES, "probe_convs")  # a script with no figures: its exit status, not a KeyError
    assert "| convs | exit status |  | 1 | |" in device_battery.summary(runs)


def battery(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPTS["device_battery"]), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_battery_plan_lists_each_ab_step_before_then_after_round_by_round(tmp_path):
    proc = battery("--plan", "--parts", "ab", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    runs = [line.split()[1:4] for line in proc.stdout.splitlines()]
    assert runs[:2] == [["job", "before", "r1"], ["job", "after", "r1"]]
    assert ["job-600s", "after", "r1"] in runs and ["job-600s", "before", "r2"] not in runs
    assert ["stream", "after", "r2"] in runs and all(r[0] in {s.name for s in STEPS} for r in runs)


def test_battery_without_a_before_tree_says_how_to_make_one(tmp_path):
    proc = battery("--dry-run", "--steps", "job", "--before", "0000000", "--before-tar", str(tmp_path / "none.tar"),
                   "--out", str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and "error: no before tree" in proc.stderr and "--prepare" in proc.stderr


@pytest.mark.slow
def test_battery_dry_run_times_the_job_on_a_prepared_before_tree_and_this_one(tmp_path):
    tar = tmp_path / "bench" / "before.tar"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout: --prepare needs git")
    prepared = battery("--prepare", "--before", head, "--before-tar", str(tar), cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    manifest = json.loads(tar.with_name("manifest.json").read_text())
    assert manifest["before"] == head
    # the after tree is named by the commit --prepare saw while the package is the one it saw, else not
    label = importlib.import_module("device_battery").after_label
    assert label(manifest, ROOT) == manifest["after"][:7]
    assert label({**manifest, "after_package": "0" * 16}, ROOT).startswith("this tree (its package changed")
    with tarfile.open(tar) as t:
        assert "omni_lightning/__init__.py" in t.getnames()
    out = tmp_path / "out"
    args = (
        "--dry-run",
        "--parts",
        "ab",
        "--steps",
        "job",
        "--before",
        head,
        "--before-tar",
        str(tar),
        "--out",
        str(out),
    )
    proc = battery(*args, cwd=ROOT)  # from the repository's root, as on the device
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((out / "battery_ab_dry.json").read_text())
    package = result["meta"]["environment"]["package"]
    assert package["after"] == str(ROOT / "omni_lightning" / "__init__.py")
    assert not package["before"].startswith(str(ROOT))  # the extracted tree, not this one
    assert [(r["version"], r["rc"]) for r in result["runs"]] == [("before", 0), ("after", 0)]
    for run in result["runs"]:  # every request checked equals its solo fp32 decode
        job = run["result"]
        assert job["check"]["checked"] == 4 and job["check"]["max_abs_diff"] <= 1e-4
        assert job["x_realtime"] > 0 and job["frames_per_forward"] >= 1 and job["outside_batches_s"] > 0
    assert any(line.startswith("| job | x real time |") for line in result["summary"])
    assert "| job | x real time |" in proc.stdout


def test_long_tailed_job_is_mostly_short_with_a_few_over_a_minute_and_the_mixed_job_unchanged():
    from omni_lightning import Code2WavConfig

    workload, bench_job = importlib.import_module("workload"), importlib.import_module("bench_job")
    config = Code2WavConfig.from_name("qwen3-omni")
    seconds = [c.shape[-1] / config.frame_rate for c in workload.long_tailed_job(config).values()]
    assert len(seconds) == 384 and sum(s < 5 for s in seconds) >= 0.8 * 384
    assert 8 <= sum(s > 60 for s in seconds) <= 16 and max(seconds) <= 120
    assert [c.shape[-1] for c in workload.long_tailed_job(config, 3).values()] == [
        c.shape[-1] for c in workload.long_tailed_job(config, 3).values()
    ]  # seeded
    assert max(c.shape[-1] for c in workload.long_tailed_job(config, 3).values()) >= 60 * config.frame_rate
    mixed = [c.shape[-1] for c in workload.mixed_job(config).values()]  # the job docs/performance.md measured
    assert mixed[:5] == [222, 240, 45, 157, 286] and sum(mixed) == 76475
    parser = bench_job.parser()
    args = parser.parse_args(["--job", "long-tailed", "--requests", "3"])
    assert len(bench_job.job(config, args, parser)) == 3
    with pytest.raises(SystemExit):  # a range belongs to the mixed job
        bench_job.job(config, parser.parse_args(["--job", "long-tailed", "--max-s", "5"]), parser)


@pytest.mark.slow
def test_the_serve_load_test_runs_on_the_cpu_every_answer_exact(tmp_path):
    """Bulk clients and paced talkers against ``serve`` (its engine and front processes), then against the
    free decode: nothing lost, every checked answer ``decode``'s, and the field's figures reported."""
    out = tmp_path / "load.json"
    # (the stream lane asked for by name, as the battery's steps do; serve's default takes one where it fits)
    run_script("load_test_serve", ["--clients", "2", "--paced", "2", "--seconds", "3", "--offline-requests", "4",
                                   "--stream-lane", "true", "--out", str(out)], tmp_path)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["lost"] == 0 and result["wrong"] == 0 and result["checked"] >= 2, result
    assert result["chunk_latency_ms_p50"] > 0 and result["ratio_to_offline"] > 0 and result["decode_loop_share"] > 0
    # the talkers' chunks decode apart from the bulk clients' frames: both kinds of decode counted and timed
    assert result["stream_decodes"] > 0 and result["bulk_decodes"] > 0, result
    assert result["stream_decode_ms_mean"] > 0 and result["bulk_decode_ms_mean"] > 0, result
    assert result["new_shapes"] >= 0 and result["new_shape_s"] >= 0, result  # counted (on a CPU: cuDNN-free, few)
    # a stream's first chunk in the loop, and the first audio's tail in the loop and at the clients
    assert 0 < result["stream_first_chunk_in_loop_ms_mean"] < 60_000, result
    paced = result["by_kind"]["paced"]
    assert 0 <= result["stream_first_chunks_in_loop_over_50ms"] <= result["stream_first_chunks_in_loop_over_20ms"]
    assert result["stream_first_chunks_in_loop_over_20ms"] <= paced, result
    assert 0 <= result["first_audio_streams_over_50ms"] <= result["first_audio_streams_over_20ms"] <= paced, result
    # the same chunks in the fronts (the engine's figures and the fronts' gathered over processes): longer each
    assert result["stream_chunk_at_front_ms_mean"] > result["stream_chunk_in_loop_ms_mean"] > 0, result
    assert result["stream_first_chunk_at_front_ms_mean"] > result["stream_first_chunk_in_loop_ms_mean"], result
    assert result["stream_first_chunks_in_loop_over_20ms"] <= result["stream_first_chunks_at_front_over_20ms"] <= paced
    # of a chunk's front time, its hand-off to the engine comes before its time in the loop (each chunk: read,
    # sent, read by the engine, pushed into the loop, decoded, its audio sent by the front): the means add up under it
    handed_in, loop, front = (result[f"stream_chunk_{k}_ms_mean"] for k in ("to_engine", "in_loop", "at_front"))
    assert handed_in > 0 and handed_in + loop < front and result["stream_audio_to_front_ms_mean"] > 0, result
    # the client processes' own delays, which the clients' figures hold and the server's do not
    assert result["client_loop_lag_ms_max"] >= 0 and result["client_gc_pause_ms_max"] >= 0, result
    assert min(result["client_loop_stalls_over_20ms"], result["client_gc_pauses_over_20ms"]) >= 0, result
    assert len(result["first_audio_ms_streams_slowest"]) == min(8, paced), result
    run_script("load_test_serve", ["--free-decode", "--clients", "2", "--seconds", "2", "--out", str(out)], tmp_path)
    assert json.loads(out.read_text())["lost"] == 0
    # a GPU's decode time on the CPU: the server's engine planned as on a GPU, its forwards booked, nothing lost
    # (two client processes: the wall time starts once both are up, not at their spawn)
    run_script("load_test_serve", ["--sim-device", "--clients", "4", "--paced", "2", "--seconds", "3",
                                   "--client-processes", "2", "--offline-requests", "8", "--out", str(out)],
               tmp_path)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["lost"] == 0 and result["ratio_to_offline"] > 0 and result["forwards"] > 0, result
    assert 0 <= result["padding_share"] < 1 and result["frames_per_forward"] > 1, result
    assert 0 < result["sim_device_useful_share"] <= result["sim_device_busy_share"] <= 1.1, result
    assert result["wall_s"] >= 3 and result["by_kind"]["whole"] > 0 and result["by_kind"]["paced"] > 0, result


def test_a_client_process_counts_its_own_stalls_and_collections():
    """A load-test client process's stall delays every client in it, though the server had no part: the
    watch sees a blocked event loop and the collector's passes, and leaves ``gc.callbacks`` as it found them."""
    import asyncio
    import gc
    import time

    serve_clients = importlib.import_module("serve_clients")
    callbacks = list(gc.callbacks)

    async def stall() -> None:
        await asyncio.sleep(0.03)
        time.sleep(0.08)  # a client's work holding the event loop
        gc.collect()

    async def watched() -> dict:
        with serve_clients.ClientWatch() as watch:
            await asyncio.gather(watch.lags(time.perf_counter() + 0.3), stall())
        return watch.figures()

    for _ in range(3):  # a loaded host only lengthens the stall
        figures = asyncio.run(watched())
        assert figures["loop_stalls_over_20ms"] >= 1 and figures["loop_lag_ms_max"] >= 60, figures
        assert figures["gc_ms_sum"] > 0, figures
    assert gc.callbacks == callbacks


def test_a_lost_result_is_counted_once_by_identity_not_compared_by_value():
    """Results hold arrays: a lost one among others of other lengths is counted, not compared elementwise."""
    import argparse
    import collections

    import numpy as np

    load_test = importlib.import_module("load_test_serve")
    ok = {"kind": "whole", "codes": np.zeros((16, 55), np.int64), "first": 0.01, "samples": 55 * 1920 - 555}
    lost = {"kind": "whole", "codes": np.zeros((16, 46), np.int64), "first": None, "samples": None, "error": "x"}
    steps = collections.defaultdict(lambda: 1.0)  # the server's metrics: not what is checked here
    result = load_test.figures([ok, lost], 1.0, [], steps, argparse.Namespace(sim_device=False))
    assert result["lost"] == 1 and result["audio_s_per_s"] == round((55 * 1920 - 555) / 24000, 2), result


@pytest.mark.slow
def test_the_load_tests_server_imports_the_tree_on_its_pythonpath_even_run_from_the_checkout(tmp_path, monkeypatch):
    """An A/B selects a tree by PYTHONPATH. Run from the checkout, ``python -m`` would import the checkout's
    package instead (every GPU "before" of the serve A/B once did): the server started here must report the
    given tree's metrics (a copy of the package with its forwards counter renamed)."""
    import shutil
    import signal

    import httpx

    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "omni_lightning", tree / "omni_lightning", ignore=shutil.ignore_patterns("__pycache__"))
    metrics = tree / "omni_lightning" / "serving" / "metrics.py"
    assert '"omni_forwards", ' in metrics.read_text()
    metrics.write_text(metrics.read_text().replace('"omni_forwards", ', '"omni_tree_marker", '))
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(tree))
    load_test = importlib.import_module("load_test_serve")
    proc, url = load_test.start_server(load_test.parser().parse_args(["--out", str(tmp_path / "load.json")]))
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert "omni_tree_marker_total" in text and "omni_forwards_total" not in text


def test_every_script_is_in_the_readmes_table():
    """scripts/README.md names each script (its question, where it runs, the figure it prints)."""
    readme = (ROOT / "scripts" / "README.md").read_text()
    missing = [
        str(p.relative_to(ROOT / "scripts"))
        for p in SCRIPTS.values()
        if f"`{p.relative_to(ROOT / 'scripts')}`" not in readme
    ]
    assert not missing, f"scripts not in scripts/README.md: {missing}"


def test_recipe_sweeps_shifted_pairs_are_the_same_audio_late_by_at_most_a_millisecond(tmp_path):
    """``recipe_sweep.py``'s ``shifted`` benchmark: each training audio is the pair's own, made late by 0 to
    ``SHIFT`` samples (zeros first, the same length), the codes the same; made once."""
    import numpy as np
    import soundfile as sf
    from recipe_sweep import SHIFT, shifted_pairs

    (tmp_path / "audio").mkdir()
    rng, rows = np.random.default_rng(0), []
    for i in range(40):
        wav = rng.standard_normal(2000 + 37 * i).astype(np.float32) * 0.1
        sf.write(tmp_path / "audio" / f"p{i}.wav", wav, 24000, subtype="FLOAT")
        rows.append({"id": f"p{i}", "codes": f"codes/p{i}.npy", "audio": f"audio/p{i}.wav"})
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = shifted_pairs(train)
    lates = []
    for row, shifted in zip(rows, map(json.loads, out.read_text().splitlines())):
        assert shifted["codes"] == row["codes"] and shifted["audio"] != row["audio"]
        wav, _ = sf.read(tmp_path / row["audio"], dtype="float32")
        late_wav, rate = sf.read(tmp_path / shifted["audio"], dtype="float32")
        assert rate == 24000 and len(late_wav) == len(wav)
        late = next(k for k in range(SHIFT + 1) if np.array_equal(late_wav[k:], wav[: len(wav) - k]))
        assert not late_wav[:late].any()
        lates.append(late)
    assert SHIFT == 24 and len(set(lates)) > 10 and max(lates) <= SHIFT  # up to 1 ms at 24 kHz, spread
    assert shifted_pairs(train) == out


@pytest.mark.parametrize("slowdown", [0.0, 1.0])
def test_a_simulated_lanes_forward_beside_bulk_work_takes_its_slowdown_and_alone_its_cost(slowdown):
    """``sim_device --lane-slowdown``: a high-priority forward that starts while a normal one runs shares the SMs
    (1 + slowdown times its cost) and pushes the normal one back by its cost; on an idle device it takes its cost."""
    import time

    from sim_device import SimDevice

    device = SimDevice(0.0, 0.05, 0.0, 0.0, graph_frames=1 << 20, lane_slowdown=slowdown)
    device.charging = lambda: False
    start = time.perf_counter()
    device.forward(1, 1, 4)  # the bulk's: 50 ms from now
    device.forward(1, 1, 4, high=True)  # a lane's, beside it
    assert device.last[True].end - start == pytest.approx(0.05 * (1 + slowdown), abs=0.01)
    assert device.last[False].end - start == pytest.approx(0.1, abs=0.01)
    device.wait()
    alone = time.perf_counter()
    device.forward(1, 1, 4, high=True)
    assert device.last[True].end - alone == pytest.approx(0.05, abs=0.01)
