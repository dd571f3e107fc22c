"""A real server on loopback for the serving tests: ``build_app`` under uvicorn on a thread of the test process
(a free port), and what the tests compare its audio with."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import torch

from omni_lightning import Code2WavModule
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
