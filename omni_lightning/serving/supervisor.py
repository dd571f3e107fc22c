"""The command line's server: engine processes (one per device) and front processes (HTTP and WebSocket),
started, watched and stopped by the ``serve`` process, as vLLM splits its API servers from its engine core.

Each engine is a fresh process (``spawn``) seeing one GPU (``CUDA_VISIBLE_DEVICES``, where the parent sees
GPUs; on a CPU, CPU engines); it builds its model, warms up and says so on a pipe, then serves a ZeroMQ
socket (``engine_process.py``). Once every engine is ready, the fronts start: each listens on the same port
with ``SO_REUSEPORT`` (the kernel spreads connections over them) and talks to every engine
(``engine_client.py``). Metrics are written by every process into one folder and summed by any front's
``/metrics`` (``metrics.py``).

Children end with the parent however it dies (``PR_SET_PDEATHSIG``, and a watch on the parent's pid); a
child that dies while serving stops the whole server with a non-zero exit (never half-serving). SIGTERM or
Ctrl-C: the fronts drain (``server.py``), then the engines stop; a second signal stops the fronts at once.
Not done: restarting a dead child in place (a stream's state dies with its engine: the server exits and a
process manager restarts it).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

log = logging.getLogger("omni_lightning.serving")


class ChildDied(RuntimeError):
    """An engine or front process ended while the server was serving (or starting)."""


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` with ``SO_REUSEPORT`` (port 0: a free one), not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def freeze_startup(what: str) -> None:
    """Keeps every object alive now (imports, the model, the app) out of Python's cyclic collections from now on.
    A full collection of a process holding torch scans 0.2-0.5 M objects: 150-250 ms on a CPU core (a front:
    225 k objects; an engine holding qwen3-omni: 490 k), a stall of the decode loop or of every connection of a
    front, twice in 25 s of a front's load. Frozen, such a collection took 6-10 ms. Objects made later are
    collected as usual. Only in processes ``serve`` owns (its engines, its fronts, its one-process mode), never
    in a caller's (``build_app``): what a caller's process had would never be collected."""
    gc.collect()
    gc.freeze()
    log.info("serve: %s (pid %d): %d objects of its start-up kept out of Python's collections", what, os.getpid(),
             gc.get_freeze_count())  # fmt: skip


def end_with_parent() -> None:
    """In a child: die when the parent does (the kernel's parent-death signal, and a watch for the race
    where the parent died first), and leave the terminal's Ctrl-C to the parent (its own process group)."""
    parent = os.getppid()
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="omni-parent-watch", daemon=True).start()


class Supervisor:
    """Runs ``engine(index, address, conn, *engine_args)`` in ``engines`` processes, then, once all are
    ready, ``front(index, port, addresses, info, conn, *front_args)`` in ``fronts`` processes; ``on_ready(info,
    host, port)`` once every front listens. :meth:`run` returns after a drain (SIGTERM, Ctrl-C; then
    :meth:`stop_line` says how it ended) and raises :class:`ChildDied` if a child ends on its own."""

    def __init__(self, engines: int, fronts: int, host: str, port: int, engine: Callable[..., Any],
                 engine_args: tuple, front: Callable[..., Any], front_args: tuple,
                 on_ready: Callable[[Any, str, int], None]) -> None:  # fmt: skip
        self.engines, self.fronts, self.host, self.port = engines, fronts, host, port
        self.engine, self.engine_args, self.front, self.front_args = engine, engine_args, front, front_args
        self.on_ready = on_ready
        self.children: dict[str, multiprocessing.Process] = {}
        self.conns: dict[str, Any] = {}  # each child's pipe: its start-up message, a front's stop summary
        self.signals: list[int] = []

    def run(self) -> None:
        gpus = _gpus()
        if gpus and self.engines > len(gpus):
            raise ValueError(f"--devices {self.engines}: this machine shows {len(gpus)} GPUs: give at most {len(gpus)}")
        from omni_lightning.serving.server import bound_socket

        with bound_socket(self.host, self.port) as probe:  # in use by anyone (even with SO_REUSEPORT): said now
            port = probe.getsockname()[1]  # (port 0: a free one, chosen)
        reserved = reuse_port_socket(self.host, port)  # held until the fronts listen on it
        folder = tempfile.mkdtemp(prefix="omni-serve-")
        metrics_dir = os.path.join(folder, "metrics")
        os.mkdir(metrics_dir)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            with _environment("PROMETHEUS_MULTIPROC_DIR", metrics_dir):
                addresses = [f"ipc://{folder}/engine-{i}" for i in range(self.engines)]
                info = self._start("engine", self.engines, lambda i, conn: (self.engine, (i, addresses[i], conn,
                                   *self.engine_args)), gpus)  # fmt: skip
                self._start("front", self.fronts, lambda i, conn: (self.front, (i, port, addresses, info[0], conn,
                            *self.front_args)), [])  # fmt: skip
            reserved.close()
            self.on_ready(info[0], self.host, port)
            self._watch()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_all()
            reserved.close()
            shutil.rmtree(folder, ignore_errors=True)

    def _start(self, kind: str, count: int, target: Callable[[int, Any], tuple], gpus: list[str]) -> list[Any]:
        """Starts ``count`` children of a kind and waits for each one's first message (its info)."""
        context = multiprocessing.get_context("spawn")
        pending = {}
        for index in range(count):
            receive, send = context.Pipe(duplex=False)
            function, args = target(index, send)
            with _environment("CUDA_VISIBLE_DEVICES", gpus[index] if gpus else None):
                child = context.Process(target=_child, args=(function, args), name=f"omni-{kind}-{index}")
                child.start()
            self.children[child.name] = child
            self.conns[child.name] = receive
            pending[receive] = (index, child)
        infos: list[Any] = [None] * count
        while pending:
            if self.signals:
                raise KeyboardInterrupt
            ready = wait([*pending, *(c.sentinel for _, c in pending.values())], timeout=0.5)
            for conn in [r for r in ready if r in pending]:
                index, child = pending.pop(conn)
                with contextlib.suppress(EOFError):
                    status, infos[index] = conn.recv()
                    if status == "failed":
                        raise ChildDied(f"{child.name} failed as it started: {infos[index]}")
                    continue
                raise ChildDied(f"{child.name} ended as it started (exit {child.exitcode})")
            for _, child in list(pending.values()):
                if not child.is_alive():
                    raise ChildDied(f"{child.name} ended as it started (exit {child.exitcode})")
        return infos

    def _on_signal(self, sig: int, frame: Any) -> None:
        self.signals.append(sig)
        for name, child in self.children.items():
            if name.startswith("omni-front") and child.is_alive():  # a second signal stops them at once
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, sig)

    def _watch(self) -> None:
        """Waits until the fronts have ended after a signal (returns) or a child ends unasked (raises)."""
        while True:
            alive = {n: c for n, c in self.children.items() if c.is_alive()}
            fronts = [c for n, c in alive.items() if n.startswith("omni-front")]
            if self.signals and not fronts:
                return
            dead = [n for n in self.children if n not in alive]
            if dead and not self.signals:
                child = self.children[dead[0]]
                raise ChildDied(f"{child.name} ended while serving (exit {child.exitcode}): the server stops")
            wait([c.sentinel for c in alive.values()], timeout=0.5)

    def _stop_all(self) -> None:
        for child in self.children.values():
            if child.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for child in self.children.values():
            child.join(max(0.1, deadline - time.monotonic()))
            if child.is_alive():
                child.kill()
                child.join()

    def stop_line(self) -> tuple[int, str]:
        """The exit status and last line of the stopped server, from every front's ``stop_summary``."""
        from omni_lightning.serving.server import stop_line

        by = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}.get(self.signals[0] if self.signals else 0, "request")
        summaries = []
        for name, conn in self.conns.items():
            if name.startswith("omni-front"):
                said = conn.recv() if conn.poll() else None
                summaries.append(said[1] if said and said[0] == "stopped" else
                                 {"by": by, "cut_reason": f"{name} ended without saying how", "cut_off": 0,
                                  "drained_s": 0.0})  # fmt: skip
        return stop_line(*summaries)


def _child(function: Callable[..., Any], args: tuple) -> None:
    end_with_parent()
    function(*args)


def _gpus() -> list[str]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` entries (none: CPU engines)."""
    import torch

    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    return visible.split(",")[:count] if visible else [str(i) for i in range(count)]


@contextlib.contextmanager
def _environment(name: str, value: str | None):
    """``os.environ[name] = value`` while children start (a spawned child copies the environment)."""
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
