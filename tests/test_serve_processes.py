"""``omni-lightning serve`` as processes: engine processes decode, front processes speak HTTP and WebSocket
(``serving/supervisor.py``). Every client is exact whichever front it reached, ``/metrics`` sums every
process, SIGTERM drains and exits 0, and no child outlives the server or a dead sibling."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import websockets
from helpers import ROOT
from serve_helpers import tiny_module, wait_until

pytest.importorskip("fastapi")


def children(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (from /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found + [g for c in found for g in children(c)]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start(*options: str) -> tuple[subprocess.Popen, str, str]:
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


def test_engine_and_two_fronts_each_client_exact_metrics_summed_sigterm_exits_0():
    proc, line, url = start("--front_processes", "2")
    try:
        assert "1 engine process, 2 fronts; listening on" in line, line
        pids = set()
        while len(pids) < 2:  # both fronts answer (a new connection each: the kernel spreads them)
            pids.add(httpx.get(f"{url}/health").json()["pid"])
        clients_exact(url, 12, seed=0)
        text = httpx.get(f"{url}/metrics").text  # one front answers for every process
        ok = sum(float(v) for v in re.findall(r'omni_requests_total\{route="(?:code2wav|stream)",status="200"\} (\S+)',
                                              text))  # fmt: skip
        assert ok == 12, text
        assert float(re.search(r"^omni_audio_seconds_total (\S+)", text, re.M).group(1)) > 0
        kids = children(proc.pid)
        assert len(kids) >= 3  # the engine and two fronts (and multiprocessing's helper)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_until(lambda: not any(alive(k) for k in kids), 10)
        # every process serve owns logs to stderr: the engine's warm-up and start-up lines too, not only the fronts'
        said = proc.stderr.read()
        assert re.search(r"serve: warm-up \(chunks of .* took \d+\.\d\d s", said), said[-3000:]
        for who in ("engine", "front 0", "front 1"):
            kept = rf"serve: {who} \(pid \d+\): \d+ objects of its start-up kept out"
            assert re.search(kept, said), (who, said[-3000:])
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_dead_engine_stops_the_server_non_zero_and_children_die_with_a_killed_parent():
    proc, line, url = start("--front_processes", "1")
    try:
        kids = children(proc.pid)
        spawned = sorted(k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes())
        assert len(spawned) == 2, kids
        os.kill(spawned[0], signal.SIGKILL)  # the engine: started before the front
        assert proc.wait(60) != 0
        assert "ended while serving" in proc.stderr.read()
        assert wait_until(lambda: not any(alive(k) for k in kids), 10)
    finally:
        proc.kill()
        proc.wait()
    proc, line, url = start("--front_processes", "2")
    try:
        kids = children(proc.pid)
        proc.kill()  # the parent dies without a word: its children follow
        proc.wait()
        assert wait_until(lambda: not any(alive(k) for k in kids), 15), [k for k in kids if alive(k)]
    finally:
        proc.kill()
        proc.wait()
