"""LitServe against ``omni-lightning serve`` on whole requests: the same clients, the same model, one after the other.

    pip install litserve && python scripts/serve/bench_litserve.py --clients 16 --seconds 30 --out bench_litserve.json

LitServe (the Lightning ecosystem's server) has no WebSocket input, so only whole requests are compared:
``--clients`` loops for ``--seconds`` each, JSON codes of 25-125 frames in, raw float32 samples out (both
checked for length). LitServe's ``LitAPI`` batches up to 16 requests (10 ms wait) in its worker process and
decodes each batch with the offline engine (``DecodeEngine.decode``, the tiny preset, seed 0);
``omni-lightning serve`` decodes them in its decode loop. Both listen on loopback. Reported per server:
requests/s, audio seconds per second, latency p50/p99 (a whole response: its first audio). Prints a table;
writes JSON (``--out``). ``--litserve-port PORT`` runs the LitServe server alone (what this script starts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--litserve-port", type=int, default=None, help="run the LitServe server on this port, alone")
    p.add_argument("--out", default=None)
    return p


try:  # not a dependency: only this script needs it
    import litserve as ls
except ImportError:
    ls = None

if ls is not None:  # at module level: LitServe pickles its API into its worker process

    class Code2WavAPI(ls.LitAPI):
        def setup(self, device):
            import torch

            from omni_lightning import Code2WavModule
            from omni_lightning.engine.engine import DecodeEngine

            torch.manual_seed(0)
            self.engine = DecodeEngine(Code2WavModule(config="tiny", random_weights=True).model.eval(), max_rows=16)

        def decode_request(self, request):
            import torch

            return torch.tensor(request["codes"], dtype=torch.long)

        def batch(self, inputs):
            return inputs

        def predict(self, batch):
            import torch

            lengths = [c.shape[1] for c in batch]
            padded = torch.zeros((len(batch), 16, max(lengths)), dtype=torch.long)
            for i, c in enumerate(batch):
                padded[i, :, : c.shape[1]] = c
            with torch.no_grad():
                return [o[0].numpy() for o in self.engine.decode(padded, lengths)]

        def unbatch(self, output):
            return output

        def encode_response(self, output):
            from fastapi import Response

            return Response(output.astype("<f4").tobytes(), media_type="application/octet-stream")


def litserve_server(port: int) -> None:
    if ls is None:
        raise SystemExit("bench_litserve.py needs litserve: pip install litserve")
    api = Code2WavAPI(max_batch_size=16, batch_timeout=0.01)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=port, generate_client_file=False)  # no client.py in the working folder


async def load(url: str, clients: int, seconds: float) -> dict:
    import httpx

    done, latency = [], []

    async def client(i: int) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient(timeout=300) as http:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                n = rng.randint(25, 125)
                codes = [[rng.randrange(2048) for _ in range(n)] for _ in range(16)]
                start = time.perf_counter()
                r = await http.post(url, json={"codes": codes})
                latency.append(time.perf_counter() - start)
                done.append((n, r.status_code == 200 and len(r.content) == 4 * (1920 * n - 555)))

    start = time.perf_counter()
    await asyncio.gather(*[client(i) for i in range(clients)])
    wall = time.perf_counter() - start
    audio = sum(1920 * n - 555 for n, ok in done if ok) / 24000
    return {"requests": len(done), "ok": sum(ok for _, ok in done), "wall_s": round(wall, 1),
            "requests_per_s": round(len(done) / wall, 2), "audio_s_per_s": round(audio / wall, 2),
            "latency_ms_p50": round(1000 * float(np.percentile(latency, 50))),
            "latency_ms_p99": round(1000 * float(np.percentile(latency, 99)))}  # fmt: skip


def run(command: list[str], health: str, url: str, args: argparse.Namespace) -> dict:
    """Starts a server in its own process group, loads it, stops the whole group."""
    import httpx

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(health).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{command} did not start")
            time.sleep(0.5)
        return asyncio.run(load(url, args.clients, args.seconds))
    finally:
        os.killpg(proc.pid, 15)  # the server and its workers (LitServe's are processes too)
        proc.wait(60)


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.litserve_port:
        litserve_server(args.litserve_port)
        return {}
    python = sys.executable
    serve = [python, "-m", "omni_lightning.cli", "serve", "--model.config", "tiny", "--model.random_weights", "true",
             "--port", "8766"]  # fmt: skip
    result = {
        "litserve": run([python, __file__, "--litserve-port", "8765"], "http://127.0.0.1:8765/health",
                        "http://127.0.0.1:8765/predict", args),
        "omni-lightning serve": run(serve, "http://127.0.0.1:8766/health",
                                    "http://127.0.0.1:8766/v1/code2wav?format=pcm", args),
        "meta": {"clients": args.clients, "seconds": args.seconds, "cpus": os.cpu_count(),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
    }  # fmt: skip
    keys = ["requests", "ok", "requests_per_s", "audio_s_per_s", "latency_ms_p50", "latency_ms_p99"]
    print("| server | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for name in ("litserve", "omni-lightning serve"):
        print(f"| {name} | " + " | ".join(str(result[name][k]) for k in keys) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
