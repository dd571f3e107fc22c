"""A front process: the app's routes (``app.py``) over a :class:`RemoteLoop` of the engine processes, under
uvicorn on the port every front shares (``SO_REUSEPORT``). It parses, checks and encodes; it never decodes.
Started by ``supervisor.py``, which waits for its ``("listening", port)`` on ``conn``, and once it has
stopped reads ``("stopped", summary)`` (``server.stop_summary``: whether clients were cut off)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_lightning.serving.app import app_over
from omni_lightning.serving.engine_client import RemoteLoop
from omni_lightning.serving.metrics import ServeMetrics
from omni_lightning.serving.request_log import to_stderr
from omni_lightning.serving.server import server_for, stop_summary
from omni_lightning.serving.supervisor import freeze_startup, reuse_port_socket


@dataclass(frozen=True)
class FrontSettings:
    """What a front needs of the command line (the engines hold the rest)."""

    host: str = "127.0.0.1"
    max_streams: int = 64
    max_body_bytes: int = 8 * 2**20
    drain_timeout: float = 30.0


def run_front(index: int, port: int, addresses: list[str], info: dict, conn: Any, settings: FrontSettings) -> None:
    """Serves until drained (SIGTERM or SIGINT from the supervisor)."""
    import torch

    torch.set_num_threads(1)  # a front never computes: torch's pool would only spin against the engines
    to_stderr()
    metrics = ServeMetrics()
    loop = RemoteLoop(addresses, info["config"], settings.max_streams, metrics)
    app = app_over(loop, metrics, settings.max_body_bytes)
    sock = reuse_port_socket(settings.host, port)
    server = server_for(app, settings.host, port, settings.drain_timeout, lambda h, p: conn.send(("listening", p)))
    sock.listen(2048)
    freeze_startup(f"front {index}")
    server.run(sockets=[sock])
    conn.send(("stopped", stop_summary(server)))
