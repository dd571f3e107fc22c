"""What the serving tests share: a real server on loopback (``build_app`` under uvicorn on a thread of the test
process, a free port; or the ``serve`` command in processes of its own) and clients of it, the decode loop driven
step by step on a real decoder that records its steps, and what the tests compare the audio with."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import torch
import websockets
from helpers import ROOT

from omni_lightning import Code2WavModule
from omni_lightning.engine.streaming import StreamingDecoder
from omni_lightning.serving import build_app, server_for


def tiny_module(seed: int = 0) -> Code2WavModule:
    torch.manual_seed(seed)
    return Code2WavModule(config="tiny", random_weights=True)


class LiveServer:
    """``build_app(module, **settings)`` served on 127.0.0.1 until ``stop()``; ready once ``/health`` says so."""

    def __init__(self, module: Code2WavModule, drain_timeout: float = 30.0, **settings) -> None:
        self.module, self.app = module, build_app(module, **settings)
        ports: list[int] = []
        listen = lambda host, port: ports.append(port)  # noqa: E731
        self.server = server_for(self.app, port=0, drain_timeout=drain_timeout, on_listen=listen)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not ports and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ports, "the server did not start"
        self.url, self.ws_url = f"http://127.0.0.1:{ports[0]}", f"ws://127.0.0.1:{ports[0]}"
        while httpx.get(self.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, httpx.get(self.url + "/health").text
            time.sleep(0.05)

    @property
    def state(self):
        return self.app.state.serving

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def decode(self, codes: torch.Tensor) -> np.ndarray:
        """What the server must send for ``codes [16, n]``: ``decode`` of them alone (float32)."""
        with torch.no_grad():
            return self.module.model.decode(codes[None])[0][0].numpy()


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def serve_command(*options: str) -> tuple[subprocess.Popen, str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = ["serve", "--model.config", "tiny", "--model.random_weights", "true", "--port", "0", *options]
    proc = subprocess.Popen([sys.executable, "-m", "omni_lightning.cli", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    line = proc.stdout.readline()
    found = re.search(r"listening on (http://[\d.:]+)", line)
    if not found:
        proc.kill()
        raise AssertionError(f"no start-up line: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, line, found.group(1)


async def _clients(url: str, codes: list[torch.Tensor]) -> list[np.ndarray]:
    async def whole(c: torch.Tensor) -> np.ndarray:
        async with httpx.AsyncClient(timeout=120) as http:  # a new connection each: spread over the fronts
            r = await http.post(f"{url}/v1/code2wav?format=pcm", json={"codes": c.tolist()})
            assert r.status_code == 200, r.text
            return np.frombuffer(r.content, "<f4")

    async def stream(c: torch.Tensor) -> np.ndarray:
        async with websockets.connect(f"{url.replace('http', 'ws')}/v1/code2wav/stream") as ws:
            pieces = []
            for at in range(0, c.shape[1], 4):
                await ws.send(json.dumps({"codes": c[:, at : at + 4].tolist()}))
                pieces.append(np.frombuffer(await ws.recv(), "<f4"))
            await ws.send(json.dumps({"end": True}))
            assert json.loads(await ws.recv())["done"]
            return np.concatenate(pieces)

    return await asyncio.gather(*[(whole if i % 2 else stream)(c) for i, c in enumerate(codes)])


def clients_exact(url: str, n: int, seed: int) -> None:
    """``n`` clients of random lengths (whole requests and streams, alternately) each get ``decode`` of their
    codes from the tiny model of the command's seed (0)."""
    torch.manual_seed(0)
    reference = tiny_module()  # the command's seed: the same weights
    rng = np.random.default_rng(seed)
    codes = [torch.from_numpy(rng.integers(0, 2048, (16, int(k)))) for k in rng.integers(1, 30, n)]
    for c, got in zip(codes, asyncio.run(_clients(url, codes))):
        with torch.no_grad():
            want = reference.model.decode(c[None])[0][0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


class RecordingDecoder(StreamingDecoder):
    """The real decoder; each ``step`` records which streams it advanced (to see what shared a forward), and on
    CUDA the stream it launched on (``launched_on``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[set] = []
        self.launched_on: list[torch.cuda.Stream | None] = []

    def step(self, chunks=None):
        out = super().step(chunks)
        self.steps.append({sid for sid, samples in out.items() if samples.shape[-1]})
        cuda = self.engine.device.type == "cuda"
        self.launched_on.append(torch.cuda.current_stream(self.engine.device) if cuda else None)
        return out


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def tiny_on(seed: int, device: str) -> Code2WavModule:
    torch.manual_seed(seed)
    return Code2WavModule(config="tiny", random_weights=True).eval().to(device)


def check_decode(got: torch.Tensor, module: Code2WavModule, codes: torch.Tensor) -> None:
    expected = module.model.decode(codes[None].to(module.device))[0].cpu()
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=1e-5 if module.device.type == "cpu" else 1e-4)


def sink_into(into: list):
    return lambda kind, value: into.append((kind, [v.clone() for v in value] if kind == "audio" else value))


def audio_of(messages: list) -> torch.Tensor:
    assert messages[-1][0] == "end", messages[-1]
    return torch.cat([piece for kind, pieces in messages if kind == "audio" for piece in pieces], dim=-1)


def count_sum(histogram) -> tuple[float, float]:
    """A histogram's observations: how many, and their sum."""
    samples = {s.name: s.value for s in histogram.collect()[0].samples}
    return next(v for k, v in samples.items() if k.endswith("_count")), next(
        v for k, v in samples.items() if k.endswith("_sum")
    )
