"""A bounded load test of ``omni-lightning serve`` on loopback: N clients for T seconds, against the offline engine.

    python scripts/serve/load_test_serve.py --clients 16 --seconds 20 --out load_serve.json      # this machine (CPU)

Starts ``omni-lightning serve`` (tiny preset, random weights, seed 0; ``--preset``, ``--precision``) in its
own process on a free loopback port, then runs ``--clients`` client loops for ``--seconds``: each sends
requests back to back, a ``--stream-share`` of them WebSocket streams of random chunks (1 to 12 frames, the
next chunk sent once the last one's audio came), the others whole requests streamed back (``stream=true``,
raw PCM), each of ``--frames`` frames (a random length in the range). Nothing is sent after the time is up;
what is in flight is finished. Then the server is stopped (SIGTERM, drained) and, on the same machine and
model, the offline engine (``DecodeEngine.decode``, batches of ``--offline-batch`` requests) decodes the
same requests (the reference), and 32 requests of the same lengths, sorted by length as predict batches
them, before the load and after it (its speed: the better of the two, the machine may be shared).
Reported: requests/s, audio seconds per second (the server's over the offline engine's), first audio
p50/p99 (a stream's first chunk sent, or a request's body sent, to its first audio), and requests lost
(an error or a short answer) or wrong (any sample more than 1e-5 from ``decode`` alone).
Prints a table; writes JSON (``--out``). Loopback only; bounded in clients and time.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=16, help="client loops at once")
    p.add_argument("--seconds", type=float, default=20.0, help="how long new requests are sent")
    p.add_argument("--frames", type=int, nargs=2, default=(25, 125), help="a request's frames: min max (2 to 10 s)")
    p.add_argument("--stream-share", type=float, default=0.5, help="the share of WebSocket streams")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-streams", type=int, default=64)
    p.add_argument("--request-frames", type=int, default=32)
    p.add_argument("--offline-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="the JSON result")
    return p


def npy(codes: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, codes.astype("<i2"))
    return out.getvalue()


async def whole(http, url: str, codes: np.ndarray) -> tuple[float | None, np.ndarray]:
    start, first, data = time.perf_counter(), None, b""
    headers = {"Content-Type": "application/x-npy"}
    async with http.stream(
        "POST", f"{url}/v1/code2wav?format=pcm&stream=true", content=npy(codes), headers=headers
    ) as r:
        async for piece in r.aiter_bytes():
            first = first or time.perf_counter() - start
            data += piece
    return first, np.frombuffer(data, "<f4")


async def stream(ws_url: str, codes: np.ndarray, rng: random.Random) -> tuple[float | None, np.ndarray]:
    import websockets

    pieces, first, at = [], None, 0
    async with websockets.connect(f"{ws_url}/v1/code2wav/stream", max_size=None) as ws:
        start = time.perf_counter()
        while at < codes.shape[1]:
            n = rng.randint(1, 12)
            await ws.send(npy(codes[:, at : at + n]))
            at += n
            pieces.append(np.frombuffer(await ws.recv(), "<f4"))
            first = first or time.perf_counter() - start
        await ws.send(json.dumps({"end": True}))
        while isinstance(message := await ws.recv(), bytes):
            pieces.append(np.frombuffer(message, "<f4"))
    return first, np.concatenate(pieces)


async def load(url: str, args: argparse.Namespace) -> tuple[list[dict], float]:
    import httpx

    done: list[dict] = []
    deadline = time.perf_counter() + args.seconds

    async def client(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        async with httpx.AsyncClient(timeout=300) as http:
            while time.perf_counter() < deadline:
                n = rng.randint(*args.frames)
                codes = np.array([[rng.randrange(2048) for _ in range(n)] for _ in range(16)])
                kind = "stream" if rng.random() < args.stream_share else "whole"
                try:
                    job = stream(url.replace("http", "ws"), codes, rng) if kind == "stream" else whole(http, url, codes)
                    first, audio = await job
                    done.append({"kind": kind, "codes": codes, "first": first, "audio": audio})
                except Exception as err:  # counted as lost
                    done.append({"kind": kind, "codes": codes, "first": None, "audio": None, "error": repr(err)})

    start = time.perf_counter()
    await asyncio.gather(*[client(i) for i in range(args.clients)])
    return done, time.perf_counter() - start


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = ["serve", "--model.config", args.preset, "--model.random_weights", "true", "--port", "0",
            "--trainer.precision", args.precision, "--max_streams", str(args.max_streams),
            "--request_frames", str(args.request_frames), "--max_queue", str(4 * args.clients)]  # fmt: skip
    log = open(Path(args.out or "load_serve.json").with_suffix(".server.log"), "w")  # noqa: SIM115 - the server's
    proc = subprocess.Popen([sys.executable, "-m", "omni_lightning.cli", *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=log)  # fmt: skip
    line = proc.stdout.readline()
    found = re.search(r"listening on (http://[\d.:]+)", line)
    if not found:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, found.group(1)


def offline_engine(args: argparse.Namespace):
    """The offline engine over the server's model (same preset and seed: the same weights), warmed up."""
    import torch

    from omni_lightning import Code2WavModule
    from omni_lightning.engine.engine import DecodeEngine

    torch.manual_seed(0)
    model = Code2WavModule(config=args.preset, random_weights=True).model.eval()
    engine = DecodeEngine(model, max_rows=args.offline_batch)
    offline(engine, [np.zeros((16, 8), np.int64)], args.offline_batch)  # warm, as the server's warm-up
    return engine


def offline(engine, requests: list[np.ndarray], batch: int) -> tuple[float, list[np.ndarray]]:
    """``requests`` decoded by ``engine`` in right-padded batches of ``batch``: (seconds, each one's audio)."""
    import torch

    outs = []
    start = time.perf_counter()
    for i in range(0, len(requests), batch):
        chunk = [torch.from_numpy(c) for c in requests[i : i + batch]]
        lengths = [c.shape[1] for c in chunk]
        padded = torch.zeros((len(chunk), 16, max(lengths)), dtype=torch.long)
        for j, c in enumerate(chunk):
            padded[j, :, : c.shape[1]] = c
        with torch.no_grad():
            outs += [o[0].numpy() for o in engine.decode(padded, lengths)]
    return time.perf_counter() - start, outs


def offline_rate(engine, args: argparse.Namespace) -> float:
    """Audio seconds per second of the offline engine on 32 requests of the load's lengths."""
    rng = np.random.default_rng(args.seed)
    requests = [rng.integers(0, 2048, (16, rng.integers(args.frames[0], args.frames[1] + 1))) for _ in range(32)]
    requests.sort(key=lambda r: r.shape[1])  # batches of similar lengths, as predict's sampler makes them
    seconds, _ = offline(engine, requests, args.offline_batch)
    return sum(r.shape[1] * 1920 - 555 for r in requests) / 24000 / seconds


def _commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or None


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    engine = offline_engine(args)
    rates = [offline_rate(engine, args)]  # before the load and after it: the machine may be shared
    proc, url = start_server(args)
    try:
        import httpx

        while httpx.get(f"{url}/health").status_code != 200:
            time.sleep(0.1)
        done, wall = asyncio.run(load(url, args))
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    rates.append(offline_rate(engine, args))
    _, reference = offline(engine, [d["codes"] for d in done], args.offline_batch)
    rate = 24000
    audio_s = sum(d["codes"].shape[1] * 1920 - 555 for d in done) / rate
    lost = [d for d in done if d["audio"] is None or d["audio"].shape != (d["codes"].shape[1] * 1920 - 555,)]
    wrong = [d for d, r in zip(done, reference) if d not in lost and np.abs(d["audio"] - r).max() > 1e-5]
    firsts = sorted(d["first"] * 1000 for d in done if d["first"] is not None)
    steps = re.search(r"^omni_step_seconds_count (\S+)", metrics, re.M)
    result = {
        "meta": {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": platform.platform(),
            "commit": _commit(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "args": vars(args),
        },  # fmt: skip
        "requests": len(done),
        "streams": sum(d["kind"] == "stream" for d in done),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(done) / wall, 2),
        "audio_s_per_s": round(audio_s / wall, 2),
        "offline_audio_s_per_s": round(max(rates), 2),
        "offline_before_after": [round(r, 2) for r in rates],
        "ratio_to_offline": round(audio_s / wall / max(rates), 3),
        "first_audio_ms_p50": round(float(np.percentile(firsts, 50)), 1) if firsts else None,
        "first_audio_ms_p99": round(float(np.percentile(firsts, 99)), 1) if firsts else None,
        "decode_steps": float(steps.group(1)) if steps else None,
        "lost": len(lost),
        "wrong": len(wrong),
        "errors": sorted({d.get("error", "short") for d in lost})[:5],
    }
    rows = [(k, result[k]) for k in ("requests", "streams", "wall_s", "requests_per_s", "audio_s_per_s",
                                     "offline_audio_s_per_s", "ratio_to_offline", "first_audio_ms_p50",
                                     "first_audio_ms_p99", "decode_steps", "lost", "wrong")]  # fmt: skip
    print("| figure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
