"""The clients of ``load_test_serve.py``: whole requests sent back to back (bulk), paced WebSocket streams
(a talker's chunks at 12.5 frames per second), and unpaced streams (each chunk once the last one's audio
came). Each returns what it measured: its codes, its audio, and its times (first audio; per chunk, sent
and answered). Loopback only; every loop ends at its deadline.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import random
import time

import numpy as np

FRAME_RATE = 12.5


def npy(codes: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, codes.astype("<i2"))
    return out.getvalue()


def random_codes(rng: random.Random, frames: tuple[int, int]) -> np.ndarray:
    n = rng.randint(*frames)
    return np.array([[rng.randrange(2048) for _ in range(n)] for _ in range(16)])


async def whole(http, url: str, codes: np.ndarray) -> dict:
    """One request, its audio streamed back as raw PCM; first audio: from the body sent to the first bytes."""
    start, first, data = time.perf_counter(), None, bytearray()
    headers = {"Content-Type": "application/x-npy"}
    async with http.stream("POST", f"{url}/v1/code2wav?format=pcm&stream=true", content=npy(codes),
                           headers=headers) as r:  # fmt: skip
        async for piece in r.aiter_bytes():
            first = first or time.perf_counter() - start
            data += piece
    return {"kind": "whole", "codes": codes, "first": first, "audio": np.frombuffer(bytes(data), "<f4")}


async def stream(ws_url: str, codes: np.ndarray, rng: random.Random, chunk: int | None, paced: bool) -> dict:
    """One WebSocket stream: chunks of ``chunk`` frames (None: 1 to 12 at random). Paced: chunk ``k`` is sent at
    ``k * chunk / 12.5`` s whatever came back; unpaced: each once the last one's audio came. Latency of a
    chunk: from its send to its audio."""
    import websockets

    sizes, at = [], 0
    while at < codes.shape[1]:
        sizes.append(min(chunk or rng.randint(1, 12), codes.shape[1] - at))
        at += sizes[-1]
    sent, answered, pieces = [], [], []
    async with websockets.connect(f"{ws_url}/v1/code2wav/stream", max_size=None) as ws:

        async def receive(count: int) -> None:
            for _ in range(count):
                message = await ws.recv()
                if isinstance(message, str):  # an error (a bad chunk, the server full or stopping): this stream is lost
                    raise RuntimeError(f"the server answered a chunk with {message}")
                pieces.append(np.frombuffer(message, "<f4"))
                answered.append(time.perf_counter())

        start, at = time.perf_counter(), 0
        receiver = asyncio.create_task(receive(len(sizes))) if paced else None
        for n in sizes:
            if paced:
                await asyncio.sleep(max(0.0, start + at / FRAME_RATE - time.perf_counter()))
            if receiver is not None and receiver.done():
                break  # it failed: its error is raised below
            sent.append(time.perf_counter())
            await ws.send(npy(codes[:, at : at + n]))
            at += n
            if not paced:
                await receive(1)
        if receiver is not None:
            await receiver
        await ws.send(json.dumps({"end": True}))
        while isinstance(message := await ws.recv(), bytes):
            pieces.append(np.frombuffer(message, "<f4"))
    latencies = [a - s for s, a in zip(sent, answered)]
    return {"kind": "paced" if paced else "stream", "codes": codes, "first": latencies[0] if latencies else None,
            "latencies": latencies, "chunk_s": (chunk or 0) / FRAME_RATE, "audio": np.concatenate(pieces)}  # fmt: skip


async def run_clients(url: str, plan: list[tuple[str, int]], seconds: float, frames: tuple[int, int],
                      chunk: int, seed: int, keep: int) -> tuple[list[dict], dict]:  # fmt: skip
    """``plan``: (kind, client number) for each client loop: "whole", "stream" (unpaced) or "paced". Each
    sends its requests back to back until ``seconds`` have passed; returns every result (an error: no audio;
    past a loop's first ``keep`` results, only the audio's length is kept) and the process's own delays
    (:class:`ClientWatch`)."""
    import httpx
    import websockets  # noqa: F401 - imported before the freeze below

    gc.freeze()  # the modules' objects out of the collector's way: its full passes stall every client here
    done: list[dict] = []
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async def client(kind: str, i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        if kind == "paced":  # talkers start at random times within a chunk, as real ones would
            await asyncio.sleep(rng.random() * chunk / FRAME_RATE)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            while time.perf_counter() < deadline:
                codes = random_codes(rng, frames)
                try:
                    if kind == "whole":
                        result = await whole(http, url, codes)
                    else:
                        result = await stream(url.replace("http", "ws"), codes, rng, chunk if kind == "paced"
                                              else None, kind == "paced")  # fmt: skip
                    result["samples"], kept = result["audio"].shape[0], sum(d["client"] == i for d in done)
                    result["client"], result["audio"] = i, result["audio"] if kept < keep else None
                    done.append(result)
                except Exception as err:  # counted as lost
                    done.append({"kind": kind, "codes": codes, "first": None, "audio": None, "samples": None,
                                 "client": i, "error": repr(err)})  # fmt: skip

    with ClientWatch() as watch:
        await asyncio.gather(watch.lags(deadline), *[client(kind, i) for kind, i in plan])
    return done, watch.figures()


class ClientWatch:
    """A client process's own delays, which its clients' latencies include though the server had no part in
    them: its event loop's lags (a 5 ms sleep's overshoot: a client's answer read late) and its garbage
    collector's pauses (``gc.callbacks``). A stall there delays every client of the process at once."""

    TICK_S, STALL_MS = 0.005, 20.0

    def __init__(self) -> None:
        self.lag_ms: list[float] = []
        self.gc_ms: list[float] = []
        self._gc_start = 0.0

    def __enter__(self) -> ClientWatch:
        gc.callbacks.append(self._collected)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self._collected)

    def _collected(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_ms.append((time.perf_counter() - self._gc_start) * 1000)

    async def lags(self, deadline: float) -> None:
        while time.perf_counter() < deadline:
            asked = time.perf_counter()
            await asyncio.sleep(self.TICK_S)
            self.lag_ms.append((time.perf_counter() - asked - self.TICK_S) * 1000)

    def figures(self) -> dict:
        return {"loop_lag_ms_max": round(max(self.lag_ms, default=0.0), 1),
                "loop_stalls_over_20ms": sum(x > self.STALL_MS for x in self.lag_ms),
                "gc_pauses_over_20ms": sum(x > self.STALL_MS for x in self.gc_ms),
                "gc_pause_ms_max": round(max(self.gc_ms, default=0.0), 1),
                "gc_ms_sum": round(sum(self.gc_ms), 1)}  # fmt: skip


def timed_clients(url: str, plan: list[tuple[str, int]], seconds: float, frames: tuple[int, int], chunk: int,
                  seed: int, keep: int) -> tuple[list[dict], float, float, dict]:  # fmt: skip
    """:func:`run_clients`, with the ``time.perf_counter()`` of its start and of its last answer (a system-wide
    clock on Linux, so comparable between processes)."""
    start = time.perf_counter()
    done, watched = asyncio.run(run_clients(url, plan, seconds, frames, chunk, seed, keep))
    return done, start, time.perf_counter(), watched


def client_process(url: str, plan: list[tuple[str, int]], seconds: float, frames: tuple[int, int], chunk: int,
                   seed: int, keep: int, results, barrier) -> None:  # fmt: skip
    """A client process's body (``--client-processes``): its share of the clients, started once every client
    process is up (``barrier``: a process's start-up is not load time); results and times onto a queue."""
    barrier.wait()
    results.put(timed_clients(url, plan, seconds, frames, chunk, seed, keep))
