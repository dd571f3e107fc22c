"""The clients of ``load_test_serve.py``: whole requests sent back to back (bulk), paced WebSocket streams
(a talker's chunks at 12.5 frames per second), and unpaced streams (each chunk once the last one's audio
came). Each returns what it measured: its codes, its audio, and its times (first audio; per chunk, sent
and answered). Loopback only; every loop ends at its deadline.
"""

from __future__ import annotations

import asyncio
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
                pieces.append(np.frombuffer(await ws.recv(), "<f4"))
                answered.append(time.perf_counter())

        start, at = time.perf_counter(), 0
        receiver = asyncio.create_task(receive(len(sizes))) if paced else None
        for n in sizes:
            if paced:
                await asyncio.sleep(max(0.0, start + at / FRAME_RATE - time.perf_counter()))
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
                      chunk: int, seed: int, keep: int) -> list[dict]:  # fmt: skip
    """``plan``: (kind, client number) for each client loop: "whole", "stream" (unpaced) or "paced". Each
    sends its requests back to back until ``seconds`` have passed; returns every result (an error: no audio;
    past a loop's first ``keep`` results, only the audio's length is kept)."""
    import httpx

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

    await asyncio.gather(*[client(kind, i) for kind, i in plan])
    return done


def timed_clients(url: str, plan: list[tuple[str, int]], seconds: float, frames: tuple[int, int], chunk: int,
                  seed: int, keep: int) -> tuple[list[dict], float, float]:  # fmt: skip
    """:func:`run_clients`, with the ``time.perf_counter()`` of its start and of its last answer (a system-wide
    clock on Linux, so comparable between processes)."""
    start = time.perf_counter()
    done = asyncio.run(run_clients(url, plan, seconds, frames, chunk, seed, keep))
    return done, start, time.perf_counter()


def client_process(url: str, plan: list[tuple[str, int]], seconds: float, frames: tuple[int, int], chunk: int,
                   seed: int, keep: int, results, barrier) -> None:  # fmt: skip
    """A client process's body (``--client-processes``): its share of the clients, started once every client
    process is up (``barrier``: a process's start-up is not load time); results and times onto a queue."""
    barrier.wait()
    results.put(timed_clients(url, plan, seconds, frames, chunk, seed, keep))
