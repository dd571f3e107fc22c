"""``omni-lightning serve`` answers bad input and overload, and survives them: each bad body or chunk a 4xx
with one line naming the bad value; past ``max_streams`` a 503 with ``Retry-After``; a client killed
mid-stream frees its slot; a burst of garbage leaves ``/health`` answering and the other clients exact."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
import websockets
from serve_helpers import LiveServer, tiny_module, wait_until

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def server():
    live = LiveServer(tiny_module(), max_streams=2, max_queue=1, max_body_bytes=20_000)
    yield live
    live.stop()


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=array.dtype.hasobject)
    return out.getvalue()


OBJECT_NPY = npy(np.array([{"a": 1}]))  # a pickle inside: numpy's own error would advise allow_pickle=True


GOOD = [[1, 2, 3]] * 16
CASES = [  # (body, content type, query, status, what the one line names)
    (b'{"codes": [[1, 2', "application/json", "", 400, "not valid JSON"),
    (json.dumps({"codes": [[1, 2]] * 15}).encode(), "application/json", "", 422, "has 15 codebooks"),
    (json.dumps({"codes": [[1, 2]] * 15 + [[1, 2048]]}).encode(), "application/json", "", 422, "2048"),
    (json.dumps({"codes": [[1.5, 2]] * 16}).encode(), "application/json", "", 422, "dtype float64"),
    (json.dumps({"codes": []}).encode(), "application/json", "", 422, "0 codebooks"),
    (json.dumps({"codes": [[]] * 16}).encode(), "application/json", "", 422, "empty (0 frames)"),
    (b"", "application/json", "", 400, "the body is empty"),
    (json.dumps({"codes": [[1, 2], [3]] + [[1, 2]] * 14}).encode(), "application/json", "", 400, "different lengths"),
    (json.dumps({"code": GOOD}).encode(), "application/json", "", 400, "keys ['code']"),
    (json.dumps({"codes": GOOD}).encode(), "audio/mpeg", "", 415, "'audio/mpeg'"),
    (json.dumps({"codes": GOOD}).encode(), "application/json", "?format=mp3", 400, "format 'mp3'"),
    (json.dumps({"codes": GOOD}).encode(), "application/json", "?format=flac&stream=true", 400, "not streamed"),
    (json.dumps({"codes": GOOD}).encode(), "application/json", "?stream=maybe", 400, "stream='maybe'"),
    (npy(np.full((16, 4), -1, np.int16)), "application/x-npy", "", 422, "-1"),
    (npy(np.zeros((16, 4), np.float32)), "application/x-npy", "", 422, "dtype float32"),
    (b"\x93NUMPY garbage", "application/x-npy", "", 400, "is not a .npy file"),
    (npy(np.zeros((16, 4), np.int16))[:-5], "application/x-npy", "", 400, "cut short: its header says [16, 4] int16"),
    (OBJECT_NPY, "application/x-npy", "", 400, "holds Python objects (dtype object), which are never unpickled"),
    (OBJECT_NPY, "application/octet-stream", "", 400, "which are never unpickled"),
    (json.dumps({"codes": GOOD}).encode(), "text/plain", "", 415, "content type 'text/plain' is not taken"),
    (json.dumps({"codes": GOOD}).encode(), "", "", 415, "no Content-Type was given"),
    (b"x" * 20_001, "application/json", "", 413, "over the limit of 20000 bytes"),
]


def test_each_bad_body_is_a_4xx_naming_the_bad_value(server):
    for body, kind, query, status, named in CASES:
        r = httpx.post(f"{server.url}/v1/code2wav{query}", content=body, headers={"Content-Type": kind}, timeout=30)
        assert r.status_code == status, (body[:60], r.text)
        message = r.json()["error"]
        assert named in message and "\n" not in message and message.startswith("request r"), (named, message)
        assert "allow_pickle" not in message, message
    r = httpx.post(f"{server.url}/v1/code2wav", json={"codes": GOOD}, timeout=30)
    assert r.status_code == 200


def test_a_wrong_method_or_path_is_a_json_error_naming_the_routes(server):
    for method, path, status, said in [("GET", "/v1/code2wav", 405, "GET /v1/code2wav: the route does not take GET"),
                                       ("DELETE", "/health", 405, "DELETE /health: the route does not take DELETE"),
                                       ("POST", "/v2/code2wav", 404, "POST /v2/code2wav: no such route")]:  # fmt: skip
        r = httpx.request(method, f"{server.url}{path}", timeout=30)
        assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"].startswith(said) and "POST /v1/code2wav, WebSocket" in r.json()["error"], r.text
    assert r.status_code == 404 and set(r.json()) == {"error"}
    r = httpx.get(f"{server.url}/v1/code2wav", timeout=30)
    assert r.headers["allow"] == "POST"


def test_a_websocket_message_over_the_limit_closes_the_stream_naming_it(server):
    async def main():
        async with websockets.connect(f"{server.ws_url}/v1/code2wav/stream") as ws:
            await ws.send("x" * 20_001)
            with pytest.raises(websockets.ConnectionClosedError) as closed:
                await ws.recv()
            return closed.value.rcvd

    received = asyncio.run(main())
    assert received.code == 1009 and "over the limit of 20000 bytes (--max_body_bytes)" in received.reason
    assert wait_until(lambda: server.state.loop.open_jobs == 0)


def test_a_bad_chunk_is_answered_and_the_stream_goes_on(server):
    codes = torch.randint(0, 2048, (16, 6))

    async def main():
        async with websockets.connect(f"{server.ws_url}/v1/code2wav/stream") as ws:
            await ws.send(json.dumps({"codes": codes[:, :2].tolist()}))
            audio = [np.frombuffer(await ws.recv(), "<f4")]
            bad = codes[:, 2:4].clone()
            bad[3, 1] = 4096
            await ws.send(json.dumps({"codes": bad.tolist()}))
            errors = [json.loads(await ws.recv())]
            await ws.send(json.dumps({"codes": [[1]] * 4}))
            errors.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"codes": codes[:, 2:].tolist()}))
            audio.append(np.frombuffer(await ws.recv(), "<f4"))
            await ws.send(json.dumps({"end": True}))
            await ws.send(json.dumps({"codes": codes[:, :1].tolist()}))  # a chunk after end
            replies = [await ws.recv(), await ws.recv()]
            return np.concatenate(audio), errors, replies

    audio, errors, replies = asyncio.run(main())
    assert errors[0]["status"] == 422 and "4096" in errors[0]["error"] and "frame 3" in errors[0]["error"]
    assert errors[1]["status"] == 422 and "4 codebooks" in errors[1]["error"]
    np.testing.assert_allclose(audio, server.decode(codes), atol=1e-5, rtol=0)
    closed = [json.loads(r) for r in replies]
    assert {"status": 409}.items() <= next(c for c in closed if "error" in c).items()
    assert "a chunk after end needs a new stream" in next(c for c in closed if "error" in c)["error"]


def test_past_max_streams_a_503_with_retry_after_and_a_killed_client_frees_its_slot(server):
    """Two streams hold both slots: a third stream, and a whole request past the queue, get 503 with
    Retry-After. A client killed with SIGKILL mid-stream frees its slot within a step."""
    client = (
        "import json, sys, time\nfrom websockets.sync.client import connect\n"
        f"ws = connect('{server.ws_url}/v1/code2wav/stream')\n"
        "ws.send(json.dumps({'codes': [[1, 2]] * 16})); ws.recv(); print('streaming', flush=True); time.sleep(60)\n"
    )
    killed = subprocess.Popen([sys.executable, "-c", client], stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout.readline().strip() == "streaming"

        async def main():
            async with websockets.connect(f"{server.ws_url}/v1/code2wav/stream"):
                assert wait_until(lambda: server.state.loop.open_jobs == 2)
                with pytest.raises(websockets.InvalidStatus) as refused:
                    async with websockets.connect(f"{server.ws_url}/v1/code2wav/stream"):
                        pass
                async with httpx.AsyncClient(timeout=60) as http:
                    queued = asyncio.create_task(http.post(f"{server.url}/v1/code2wav", json={"codes": GOOD}))
                    await asyncio.sleep(0.3)  # it waits in the queue (max_queue=1)
                    over = await http.post(f"{server.url}/v1/code2wav", json={"codes": GOOD})
                    os.kill(killed.pid, signal.SIGKILL)  # its slot goes to the queued request
                    return refused.value.response, over, await queued

        response, over, queued = asyncio.run(main())
    finally:
        killed.kill()
        killed.wait()
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert "all 2 streams are in use" in json.loads(response.body)["error"]
    assert over.status_code == 503 and over.headers["retry-after"] == "1"
    assert "1 requests queued" in over.json()["error"]
    assert queued.status_code == 200
    assert wait_until(lambda: server.state.loop.open_jobs == 0)


def test_a_burst_of_garbage_leaves_the_server_answering(server):
    """Random bodies (bytes, broken JSON, wrong shapes, huge numbers) under random content types: all 4xx,
    none a 5xx; then /health answers and a good request is exact."""
    rng = random.Random(1)
    kinds = ["application/json", "application/x-npy", "application/x-safetensors", "application/octet-stream", "text/x"]

    def garbage() -> bytes:
        pick = rng.randrange(5)
        if pick == 0:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
        if pick == 1:
            value = rng.choice([1, -5, 2**70, "a", None, 1.5])
            return json.dumps({"codes": [[value] * 3] * rng.randrange(20)}).encode()
        if pick == 2:
            return b"\x93NUMPY" + bytes(rng.randrange(256) for _ in range(100))
        if pick == 3:
            return json.dumps(rng.choice([[], {}, 3, "codes", {"codes": {"a": 1}}, {"codes": [1, 2]}])).encode()
        return npy(np.asarray(rng.choice([np.zeros((3, 3)), np.array(["a"]), np.zeros((16, 0), np.int8)])))

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            sem = asyncio.Semaphore(16)

            async def one():
                async with sem:
                    kind = rng.choice(kinds)
                    r = await http.post(f"{server.url}/v1/code2wav", content=garbage(), headers={"Content-Type": kind})
                    return r.status_code

            return await asyncio.gather(*[one() for _ in range(1000)])

    statuses = asyncio.run(main())
    assert all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert httpx.get(f"{server.url}/health").json()["status"] == "ready"
    codes = torch.randint(0, 2048, (16, 5))
    r = httpx.post(f"{server.url}/v1/code2wav?format=pcm", json={"codes": codes.tolist()}, timeout=30)
    np.testing.assert_allclose(np.frombuffer(r.content, "<f4"), server.decode(codes), atol=1e-5, rtol=0)
