"""``omni-lightning serve`` as a command: short help, mistakes said before torch loads, the start-up line, and
a drain on SIGTERM (new work refused with 503, the streams in flight answered to their end, exact)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch
import websockets
from helpers import ROOT
from serve_helpers import LiveServer, tiny_module, wait_until

from omni_lightning.cli import main
from omni_lightning.cli.arguments import unknown_option

pytest.importorskip("fastapi")


def test_serve_help_is_short_and_lists_what_serve_uses(capsys):
    from omni_lightning.cli.help import HELP_OPTIONS

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    text = capsys.readouterr().out
    assert exited.value.code == 0
    shown = [o for _, o in re.findall(r"^  (-c CONFIG, )?(--[\w.]+)", text, re.M)]
    assert shown == [*HELP_OPTIONS["serve"][0], *HELP_OPTIONS["serve"][1]] and len(text.splitlines()) < 80, text
    assert text.startswith("usage: omni-lightning serve (--model.checkpoint FOLDER")
    assert all(unknown_option("serve", o[2:]) is None for o in shown)


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--model.config", "tiny"], "error: serve has no weights: give --model.checkpoint"),
        (["--model.random_weights", "true", "--max_streams", "0"], "error: --max_streams must be an integer >= 1"),
        (["--model.random_weights", "true", "--prot", "80"], "error: --prot is not an option of omni-lightning serve"),
        (["--model.config", "huge", "--model.random_weights", "true"], "error: --model.config 'huge' is not a preset"),
    ],
)
def test_a_mistake_is_one_line_and_status_2_before_torch_loads(argv, said):
    code = (
        "import sys, json; from omni_lightning.cli import main; rc = main(json.loads(sys.argv[1])); "
        "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules}))"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(["serve", *argv])], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)  # fmt: skip
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"rc": 2, "torch": False} and proc.stderr.strip().startswith(said), proc.stderr


async def _stream_across_a_drain(ws_url: str, codes: torch.Tensor, drain, url: str) -> tuple[np.ndarray, dict]:
    """Opens a stream, sends half, calls ``drain()``, checks new work is refused, sends the rest."""
    seen = {}
    async with websockets.connect(f"{ws_url}/v1/code2wav/stream") as ws:
        await ws.send(json.dumps({"codes": codes[:, :7].tolist()}))
        audio = [np.frombuffer(await ws.recv(), "<f4")]
        drain()
        async with httpx.AsyncClient(timeout=30) as http:
            for _ in range(100):
                health = await http.get(f"{url}/health")
                if health.status_code == 503:
                    break
                await asyncio.sleep(0.05)
            seen["health"] = health.json()["status"]
            refused = await http.post(f"{url}/v1/code2wav", json={"codes": [[1]] * 16})
            seen["refused"] = (refused.status_code, refused.headers.get("retry-after"))
        await ws.send(json.dumps({"codes": codes[:, 7:].tolist()}))
        audio.append(np.frombuffer(await ws.recv(), "<f4"))
        await ws.send(json.dumps({"end": True}))
        seen["end"] = json.loads(await ws.recv())
    return np.concatenate(audio), seen


def test_a_drain_refuses_new_work_and_finishes_the_streams_in_flight():
    live = LiveServer(tiny_module(), max_streams=4)
    codes = torch.randint(0, 2048, (16, 20))
    try:
        audio, seen = asyncio.run(_stream_across_a_drain(live.ws_url, codes, live.server.start_drain, live.url))
        assert seen["health"] == "draining" and seen["refused"] == (503, "5") and seen["end"]["done"]
        np.testing.assert_allclose(audio, live.decode(codes), atol=1e-5, rtol=0)
        assert wait_until(lambda: not live.thread.is_alive(), 10)  # it exits once nothing is in flight
    finally:
        live.stop()


@pytest.mark.slow
def test_sigterm_mid_stream_drains_then_exits_0():
    """The command itself: its start-up line, then SIGTERM while a stream is open; the stream is answered
    to its end (exact), new work gets 503, and the command exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = ["serve", "--model.config", "tiny", "--model.random_weights", "true", "--port", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "omni_lightning.cli", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("serve: tiny preset,") and "random weights; cpu 32-true" in line, line
        url = re.search(r"listening on (http://[\d.:]+)", line).group(1)
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        torch.manual_seed(0)
        reference = tiny_module()  # the same seed (0, the command's --seed_everything): the same weights
        codes = torch.randint(0, 2048, (16, 20))
        drain = lambda: proc.send_signal(signal.SIGTERM)  # noqa: E731
        audio, seen = asyncio.run(_stream_across_a_drain(url.replace("http", "ws"), codes, drain, url))
        assert seen["health"] == "draining" and seen["refused"][0] == 503 and seen["end"]["done"]
        with torch.no_grad():
            np.testing.assert_allclose(audio, reference.model.decode(codes[None])[0][0].numpy(), atol=1e-5, rtol=0)
        assert proc.wait(60) == 0
        log = proc.stderr.read()
        assert re.search(r"serve: r\d+ stream opened", log) and "serve: draining" in log, log
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_devices_2_runs_two_cpu_engines_behind_one_port_each_exact():
    """``--devices 2`` on the CPU: two engine processes behind the fronts; streams spread over them are each
    exact; SIGTERM ends them all."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = ["serve", "--model.config", "tiny", "--model.random_weights", "true", "--port", "0", "--devices", "2",
            "--trainer.accelerator", "cpu", "--front_processes", "1"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "omni_lightning.cli", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert "2 engine processes, 1 front;" in line, line
        url = re.search(r"listening on (http://[\d.:]+)", line).group(1)
        torch.manual_seed(0)
        reference = tiny_module()
        codes = [torch.randint(0, 2048, (16, n)) for n in (5, 9, 14, 20, 3, 11)]

        async def one(c: torch.Tensor) -> np.ndarray:
            async with websockets.connect(f"{url.replace('http', 'ws')}/v1/code2wav/stream") as ws:
                pieces = []
                for start in range(0, c.shape[1], 4):
                    await ws.send(json.dumps({"codes": c[:, start : start + 4].tolist()}))
                    pieces.append(np.frombuffer(await ws.recv(), "<f4"))
                return np.concatenate(pieces)

        async def main():
            return await asyncio.gather(*[one(c) for c in codes])

        for c, audio in zip(codes, asyncio.run(main())):
            with torch.no_grad():
                want = reference.model.decode(c[None])[0][0].numpy()
            np.testing.assert_allclose(audio, want, atol=1e-5, rtol=0)
        steps = re.findall(r"^omni_step_seconds_count (\S+)", httpx.get(f"{url}/metrics").text, re.M)
        assert float(steps[0]) >= 2  # both engines' steps, summed
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
