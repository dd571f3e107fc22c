"""``omni-lightning serve`` as a command: short help, mistakes said before torch loads, the start-up line, and
a drain on SIGTERM (new work refused with 503, the streams in flight answered to their end, exact)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch
import websockets
from helpers import ROOT
from serve_helpers import LiveServer, clients_exact, serve_command, tiny_module, wait_until

from omni_lightning.cli import main
from omni_lightning.cli.arguments import unknown_option

pytest.importorskip("fastapi")
TIMED_OUT = (
    "error: serve: the drain timed out after 1 s (--drain_timeout): 1 request or stream in flight cut off, each told so"  # noqa: E501
)


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
        (["--model.random_weights", "true", "--stream_lane", "None"], "error: --stream_lane takes true, false or null"),
        (["--model.random_weights", "true", "--lane_sms", "-8"], "error: --lane_sms must be an integer >= 0, got -8"),
        (
            ["--model.random_weights", "true", "--stream_lane", "false", "--lane_sms", "16"],
            "error: --lane_sms 16 keeps SMs for the stream lane, which --stream_lane false turns off",
        ),
        (
            ["--model.random_weights", "true", "--bulk_slice_ms", "1e"],
            "error: --bulk_slice_ms takes a number, got '1e'",
        ),
        (
            ["--model.random_weights", "true", "--max_body_bytes", "0"],
            "error: --max_body_bytes must be an integer >= 1",
        ),
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


@pytest.mark.parametrize(
    "config, said",
    [
        ("port: 0\nmodel:\n  random_weights: true\n", "sets port, model at its top level, where only a section per"),
        ("serv:\n  port: 0\n", "has a section 'serv': did you mean serve?"),
        ("serve:\n  prot: 0\n  model:\n    random_weights: true\n", "config key prot is not an option of "),
    ],
)
def test_a_config_before_serve_is_read_as_its_section_or_refused_naming_the_key(tmp_path, config, said):
    """``omni-lightning -c cfg.yaml serve``: a flat config, a misspelled section or key is one line, status 2,
    before torch loads (a flat config there was ignored without a word)."""
    path = tmp_path / "cfg.yaml"
    path.write_text(config)
    code = (
        "import sys, json; from omni_lightning.cli import main; rc = main(json.loads(sys.argv[1])); "
        "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules}))"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(["-c", str(path), "serve"])], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)  # fmt: skip
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"rc": 2, "torch": False} and proc.stderr.startswith("error: ") and said in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_config_before_serve_routes_to_serve(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text("serve:\n  max_streams: 3\n  model:\n    random_weights: true\n")
    with pytest.raises(SystemExit) as exited:
        main(["-c", str(path), "serve", "--help"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("usage: omni-lightning serve")


@pytest.mark.slow  # (a process loading torch and Lightning: ~10 s)
def test_a_port_in_use_is_one_line_and_status_2_before_the_model_loads():
    """A port another process listens on: one ``error:`` line naming it, status 2 (not uvicorn's start-up
    failure, 3, after the model loaded)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = ["serve", "--model.config", "tiny", "--model.random_weights", "true", "--port", str(port)]
        proc = subprocess.run([sys.executable, "-m", "omni_lightning.cli", *argv], cwd=ROOT, text=True,
                              capture_output=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: --port {port}: cannot listen on 127.0.0.1:{port} (Address already in use): give another --port, "
        "or 0 for a free one"
    ], proc.stderr


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


def test_past_the_drain_timeout_the_clients_in_flight_are_told_and_the_server_stops():
    """``drain_timeout`` is a hard limit: a stream still open past it gets an error message and close 1013,
    and the server stops (the command's last line and status 143 come from ``stop_line``)."""
    from omni_lightning.serving.server import stop_line, stop_summary

    live = LiveServer(tiny_module(), max_streams=4, drain_timeout=1)

    async def main():
        async with websockets.connect(f"{live.ws_url}/v1/code2wav/stream") as ws:
            await ws.send(json.dumps({"codes": [[1, 2]] * 16}))
            await ws.recv()
            live.server.handle_exit(signal.SIGTERM, None)  # what the signal calls: a drain, the stream left open
            error = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            return error, closed.value.rcvd

    try:
        error, closed = asyncio.run(main())
        assert error["status"] == 503 and "stopped before all of it was decoded" in error["error"]
        assert closed.code == 1013 and closed.reason == error["error"]
        assert wait_until(lambda: not live.thread.is_alive(), 30)
        status, line = stop_line(stop_summary(live.server))
        assert status == 143, line
        assert line == TIMED_OUT, line
    finally:
        live.stop()


def test_a_second_signal_stops_at_once_each_client_told_in_json(capfd):
    """A second Ctrl-C while a long request and a stream are in flight: the request gets a JSON 503 (not
    uvicorn's plain-text 500), the stream its error message, no traceback is printed, and the server stops."""
    from omni_lightning.serving.server import stop_line, stop_summary

    live = LiveServer(tiny_module(), max_streams=4)
    codes = torch.randint(0, 2048, (16, 8000))  # hundreds of steps: still decoding when the signals come

    async def main():
        async with httpx.AsyncClient(timeout=60) as http, websockets.connect(f"{live.ws_url}/v1/code2wav/stream") as ws:
            await ws.send(json.dumps({"codes": [[1, 2]] * 16}))
            await ws.recv()
            body, kind = npy_bytes(codes), {"Content-Type": "application/x-npy"}
            post = asyncio.create_task(http.post(f"{live.url}/v1/code2wav", content=body, headers=kind))
            while live.state.loop.open_jobs < 2:
                await asyncio.sleep(0.02)
            live.server.handle_exit(signal.SIGINT, None)
            live.server.handle_exit(signal.SIGINT, None)
            error = json.loads(await ws.recv())
            return error, await post

    try:
        error, response = asyncio.run(main())
        assert error["status"] == 503
        assert response.status_code == 503 and response.headers["content-type"] == "application/json", response.text
        assert "stopped before all of it was decoded" in response.json()["error"]
        assert wait_until(lambda: not live.thread.is_alive(), 30)
        status, line = stop_line(stop_summary(live.server))
        assert status == 130 and line.startswith("error: serve: stopped at once by a second Ctrl-C: 2 requests"), line
        printed = capfd.readouterr()
        assert "Traceback" not in printed.err and "Exception in ASGI" not in printed.err, printed.err
    finally:
        live.stop()


def npy_bytes(codes: torch.Tensor) -> bytes:
    out = io.BytesIO()
    np.save(out, codes.numpy().astype("<i2"))
    return out.getvalue()


@pytest.mark.slow
def test_a_config_before_serve_then_sigterm_mid_stream_drains_and_exits_0(tmp_path):
    """The command itself, its options in a config file given before ``serve`` (a ``serve:`` section): its
    start-up line, then SIGTERM while a stream is open; the stream is answered to its end (exact), new work
    gets 503, and the command exits 0 with one line (no ``Seed set to 0`` at the start)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    config = tmp_path / "serve.yaml"
    config.write_text("serve:\n  port: 0\n  stream_lane: false\n  model:\n    config: tiny\n    random_weights: true\n")
    argv = ["-c", str(config), "serve"]
    proc = subprocess.Popen([sys.executable, "-m", "omni_lightning.cli", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("serve: tiny preset,") and "random weights; cpu 32-true" in line, line
        assert "lane" not in line, line  # stream_lane: false (the default is a lane)
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
        log, out = proc.stderr.read(), proc.stdout.read()
        assert re.search(r"serve: r\d+ stream opened", log) and "serve: draining" in log, log
        assert re.search(r"serve: r\d+ stream ended 200: 20 frames in [\d.]+ s", log), log
        assert "Seed set" not in log and "error" not in log, log
        assert re.fullmatch(r"serve: stopped on SIGTERM, every request and stream in flight answered "
                            r"\(drained in [\d.]+ s\)\n", out), out  # fmt: skip
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_drain_past_its_timeout_ends_the_command_143_without_a_traceback():
    """``--drain_timeout 1`` and a stream left open: SIGTERM, then the stream is told and closed, and the
    command exits 143 with one ``error:`` line naming the timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = ["serve", "--model.config", "tiny", "--model.random_weights", "true", "--port", "0", "--drain_timeout", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "omni_lightning.cli", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        url = re.search(r"listening on (http://[\d.:]+)", proc.stdout.readline()).group(1)
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 60)

        async def main():
            async with websockets.connect(f"{url.replace('http', 'ws')}/v1/code2wav/stream") as ws:
                await ws.send(json.dumps({"codes": [[1, 2]] * 16}))
                await ws.recv()
                proc.send_signal(signal.SIGTERM)
                return json.loads(await ws.recv())

        assert asyncio.run(main())["status"] == 503
        assert proc.wait(60) == 143
        log = proc.stderr.read()
        assert log.splitlines()[-1] == TIMED_OUT, log
        assert "Traceback" not in log, log
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_devices_2_runs_two_cpu_engines_behind_one_port_each_exact():
    """``--devices 2`` on the CPU: two engine processes behind the fronts; clients spread over them are each
    exact; SIGTERM ends them all."""
    proc, line, url = serve_command("--devices", "2", "--trainer.accelerator", "cpu", "--front_processes", "1")
    try:
        assert "2 engine processes, 1 front;" in line, line
        clients_exact(url, 8, seed=2)  # whole requests and streams, over both engines
        steps = re.findall(r"^omni_step_seconds_count (\S+)", httpx.get(f"{url}/metrics").text, re.M)
        assert float(steps[0]) >= 2  # both engines' steps, summed
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
