"""``--devices N``: N server processes behind one port, each with its own engine on its own device.

Each worker is a fresh process (``spawn``) that sees one GPU (``CUDA_VISIBLE_DEVICES`` set to its index, where
the parent sees GPUs) and listens on the same port with ``SO_REUSEPORT``, so the kernel spreads connections
over the workers. A WebSocket stream is one connection, so it stays with the worker that holds its state; a
whole request too. SIGTERM to the parent reaches every worker, each drains (``server.py``).

Not done: a worker that dies is not restarted (its connections fail; the others go on); ``/health`` and
``/metrics`` are each worker's own (the one the connection reached: each answer names its ``pid``); no
balancing by load, only by connection hash; ``build_app`` in Python serves one engine (a module fine-tuned
in the process is one module on one device).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from typing import Any


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` with ``SO_REUSEPORT`` (port 0: a free one), not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run_workers(count: int, host: str, port: int, target: Callable[..., Any], args: tuple) -> None:
    """Runs ``target(index, count, port, *args)`` in ``count`` processes until they end. A SIGTERM (here a
    ``SystemExit``) is passed on to every worker, which drains, and raised again once all have ended;
    Ctrl-C reaches the workers from the terminal itself, so it is not passed on (a second signal stops a
    worker at once)."""
    reserved = reuse_port_socket(host, port)  # holds the port (port 0: chooses it) until the workers listen
    port = reserved.getsockname()[1]
    gpus = _gpus()
    if gpus and count > len(gpus):
        reserved.close()
        raise ValueError(f"--devices {count}: this machine shows {len(gpus)} GPUs: give at most {len(gpus)}")
    context = multiprocessing.get_context("spawn")
    workers = []
    try:
        for index in range(count):
            with _environment("CUDA_VISIBLE_DEVICES", gpus[index] if gpus else None):
                worker = context.Process(target=target, args=(index, count, port, *args), name=f"omni-serve-{index}")
                worker.start()
            workers.append(worker)
        for worker in workers:
            worker.join()
    except SystemExit:
        for worker in workers:
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGTERM)
        for worker in workers:
            worker.join()
        raise
    finally:
        reserved.close()


def _gpus() -> list[str]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` entries (none: CPU workers)."""
    import torch

    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        visible.split(",")[: torch.cuda.device_count()]
        if visible
        else [str(i) for i in range(torch.cuda.device_count())]
    )


@contextlib.contextmanager
def _environment(name: str, value: str | None):
    """``os.environ[name] = value`` while a child starts (a spawned child copies the environment)."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
