"""On the CPU the command line sets torch's threads to the cores free to it and says so; OMP_NUM_THREADS stands."""

import os
import re

import numpy as np
import torch

from omni_lightning.runner.cpu_threads import free_cores


def test_a_cpu_run_takes_the_free_cores_less_its_loader_workers_and_says_so(tmp_path, monkeypatch, capsys):
    from omni_lightning.cli import main

    (tmp_path / "codes").mkdir()
    for i in range(2):
        np.save(tmp_path / "codes" / f"r{i}.npy", np.random.default_rng(i).integers(0, 2048, (16, 6)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    job = ["predict", "--data.predict", str(tmp_path / "codes"), "--out_dir", str(tmp_path / "wavs"),
           "--model.config", "tiny", "--model.random_weights", "true", "--trainer.accelerator", "cpu",
           "--data.num_workers", "1", "--trainer.enable_progress_bar", "false"]  # fmt: skip
    assert main(job) == 0
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("predict: tiny preset"))
    said = re.search(r"cpu 32-true, (\d+) torch threads? \((\d+) cores?, load ([\d.]+), 1 loader worker\);", start)
    assert said is not None, start
    threads, cores, load = int(said[1]), int(said[2]), float(said[3])
    assert cores == len(os.sched_getaffinity(0))
    assert threads == max(1, cores - min(cores, int(load)) - 1), start  # the busy cores and the worker left out
    assert torch.get_num_threads() == before  # put back: the command may run inside another program


def test_free_cores_leave_one_at_least_and_name_their_reasons():
    n, reason = free_cores(workers=64)
    assert n == 1 and re.match(r"\d+ cores?, load [\d.]+, 64 loader workers$", reason), reason
