"""The benchmark scripts run end to end on the CPU (tiny preset, a few requests), as subprocesses the
way a user runs them, and write what they promise: a benchmark that broke would otherwise be found on
the GPU machine, where its time is scarce. Their speeds mean nothing here and are not checked; what
is checked is each script's own correctness figure where it has one (fp32 exactness of the job
against solo decodes, of streaming against the whole decode). ``bench_cli.py`` is covered by the CLI
tests' commands, ``bench_scale.py`` (several processes) by ``tests/test_ddp.py``."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

JOBS = {
    "bench_job": ["--preset", "tiny", "--device", "cpu", "--precision", "32-true", "--requests", "4", "--min-s", "0.3",
                  "--max-s", "1", "--batch", "2", "--repeats", "1", "--check", "4"],
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
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("name", sorted(JOBS))
def test_benchmark_script_runs_on_the_cpu_and_writes_its_result(name, tmp_path):
    out = tmp_path / f"{name}.json"
    run_script(name, [*JOBS[name], "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert result["meta"]["args"]["preset"] == "tiny"
    if name == "bench_job":  # every request checked equals its solo fp32 decode
        assert result["check"]["checked"] == 4 and result["check"]["max_abs_diff"] <= 1e-4
        assert result["x_realtime"] > 0 and result["frames_per_forward"] >= 1
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
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "simulate_plan.py"), "--frames", "1024"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1024 |")]
    assert [r.split("|")[5].strip() for r in rows] == ["job", "b1x125", "b32x125", "lone7500"]
    assert "| b1x125 | 1, " in proc.stdout  # a lone 10 s request is one forward (plan.py)
