"""The WebSocket ``/v1/code2wav/stream``: code chunks in as the talker writes them, each chunk's audio out as
soon as it is decoded, exactly ``StreamingDecoder``'s.

The protocol: the client sends chunks ``[16, n]`` (``n >= 1``), each a text message ``{"codes": [[...], ...]}``
or a binary ``.npy`` / ``.safetensors`` file; the server answers each chunk with one binary message, its
samples (float32 little-endian; ``?subtype=PCM_16``: int16), in order. The client sends ``{"end": true}``
when the talker is done; the server sends the audio still to come, then ``{"done": true, "samples": N}``
and closes (1000). A bad chunk is answered ``{"error": "<one line>", "status": 4xx}`` and dropped; the
stream goes on. A decode that fails ends the stream with ``{"error": ..., "status": 500}`` and close 1011.
Past ``--max_streams`` the handshake is refused with a 503 and ``Retry-After``; a client that disconnects
frees its slot at the next step. Not done: resuming a stream on a new connection (its state is the slot's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from omni_lightning.serving.audio_encoding import sample_bytes
from omni_lightning.serving.jobs import Job, Overloaded, queue_sink
from omni_lightning.serving.request_body import BadRequest, body_codes
from omni_lightning.serving.request_log import ended

log = logging.getLogger("omni_lightning.serving")
ROUTE = "stream"


def add_stream_route(app: FastAPI, state: Any) -> None:
    """Adds ``/v1/code2wav/stream`` over ``state`` (``app.ServeState``)."""

    @app.websocket("/v1/code2wav/stream")
    async def stream(ws: WebSocket) -> None:
        rid = state.request_id(ws.headers.get("x-request-id"))
        subtype = ws.query_params.get("subtype", "FLOAT").upper()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            if subtype not in ("FLOAT", "PCM_16"):
                raise BadRequest(400, f"stream {rid}: subtype {subtype!r} is not one of FLOAT, PCM_16")
            if state.draining:
                raise Overloaded("the server is shutting down: retry on another instance", retry_after=5)
            job = state.loop.open_stream(rid, queue_sink(queue))
        except (BadRequest, Overloaded) as err:
            status = err.status if isinstance(err, BadRequest) else 503
            retry = {"Retry-After": str(err.retry_after)} if isinstance(err, Overloaded) else {}
            state.metrics.requests.labels(ROUTE, str(status)).inc()
            log.info("serve: %s %d %s", rid, status, err)
            headers = {"X-Request-Id": rid, **retry}
            try:
                await ws.send_denial_response(JSONResponse({"error": str(err)}, status, headers=headers))
            except RuntimeError:  # a server without the denial-response extension: refused after the handshake
                await ws.accept()
                await ws.close(1013 if status == 503 else 1008, str(err)[:120])
            return
        state.handlers += 1
        log.info("serve: %s stream opened", rid)
        status, started, frames = "200", time.perf_counter(), [0]  # frames: those received, counted by _receive
        try:
            await ws.accept(headers=[(b"x-request-id", rid.encode())])
            status = await _serve_stream(ws, state, job, rid, queue, subtype, frames)
        finally:
            if not job.done:
                state.loop.abort(job)
                log.info("serve: %s client went away: slot freed", rid)
            state.metrics.requests.labels(ROUTE, status).inc()
            state.handlers -= 1
            ended(rid, status, frames[0], started, " stream")


async def _serve_stream(
    ws: WebSocket, state: Any, job: Job, rid: str, queue: asyncio.Queue, subtype: str, frames: list[int]
) -> str:
    """Receives chunks and sends audio until the stream ends; returns the status counted in the metrics."""
    lock = asyncio.Lock()  # the receiver's error replies and the sender's audio, one message at a time
    clock = ChunkClock(state.metrics)
    receiver = asyncio.create_task(_receive(ws, state, job, rid, lock, frames, clock))
    sender = asyncio.create_task(_send(ws, queue, subtype, lock, clock))
    try:
        done, _ = await asyncio.wait({receiver, sender}, return_when=asyncio.FIRST_COMPLETED)
        if sender in done:
            return sender.result()
        if receiver.result() == "gone":
            return "499"
        return await sender
    finally:
        for task in (receiver, sender):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _receive(
    ws: WebSocket, state: Any, job: Job, rid: str, lock: asyncio.Lock, received: list[int], clock: ChunkClock
) -> str:
    """Chunks into the loop until ``{"end": true}`` (returns "ended") or a disconnect ("gone"); ``received[0]``
    counts the frames taken; ``clock`` is told when each chunk taken was read."""
    frames, config, who = 0, state.loop.config, f"stream {rid}"
    while True:
        try:
            message = await ws.receive()
            came = time.perf_counter()
        except (WebSocketDisconnect, RuntimeError):
            return "gone"
        if message["type"] == "websocket.disconnect":
            return "gone"
        text, data = message.get("text"), message.get("bytes")
        try:
            if len(text or data or b"") > state.max_body_bytes:
                raise BadRequest(413, f"{who}: a message over the limit of {state.max_body_bytes} bytes")
            if text is not None and _is_end(text):
                if job.finishing:
                    raise BadRequest(409, f"{who} is ended already: it takes no more messages")
                state.loop.finish(job)
                continue
            if job.finishing:
                raise BadRequest(409, f"{who} is ended already: a chunk after end needs a new stream")
            body, kind = (text.encode(), "application/json") if text is not None else (data, "application/octet-stream")
            codes = body_codes(body, kind, config, who, chunk_from=frames)
            if codes.shape[1] == 0:
                raise BadRequest(422, f"{who}: chunk at frame {frames} is empty (0 frames): send n >= 1 frames")
        except BadRequest as err:
            state.metrics.requests.labels(ROUTE, str(err.status)).inc()
            log.info("serve: %s %d %s", rid, err.status, err)
            async with lock:
                await ws.send_text(json.dumps({"error": str(err), "status": err.status}))
            continue
        frames += codes.shape[1]
        received[0] = frames
        state.loop.push(job, codes)
        clock.came.append(came)


class ChunkClock:
    """A stream's chunks timed in its front, from the message read to its audio sent (``ServeMetrics``'
    ``stream_chunk_front_seconds``; the first chunk's in ``stream_first_chunk_front_seconds`` too): against the
    same chunks in the decode loop and at the client, where a chunk's latency goes. The server answers each
    chunk taken with one audio message, in order, so the times read pair with the messages sent."""

    def __init__(self, metrics: Any) -> None:
        self.metrics, self.came, self.first = metrics, deque(), True

    def sent(self) -> None:
        if not self.came:
            return
        seconds = time.perf_counter() - self.came.popleft()
        self.metrics.stream_chunk_front_seconds.observe(seconds)
        if self.first:
            self.metrics.stream_first_chunk_front_seconds.observe(seconds)
            self.first = False


def _is_end(text: str) -> bool:
    with contextlib.suppress(ValueError):
        value = json.loads(text)
        return isinstance(value, dict) and value.get("end") is True and "codes" not in value
    return False


async def _send(ws: WebSocket, queue: asyncio.Queue, subtype: str, lock: asyncio.Lock, clock: ChunkClock) -> str:
    """Each chunk's audio as it comes, then the end (or the error) and the close; returns the status
    ("499": the client was gone before all was sent)."""
    try:
        return await _send_all(ws, queue, subtype, lock, clock)
    except (WebSocketDisconnect, RuntimeError, OSError):  # the connection closed under a send
        return "499"


async def _send_all(ws: WebSocket, queue: asyncio.Queue, subtype: str, lock: asyncio.Lock, clock: ChunkClock) -> str:
    samples = 0
    while True:
        kind, value = await queue.get()
        async with lock:
            if kind == "audio":
                for piece in value:
                    samples += piece.shape[-1]
                    await ws.send_bytes(sample_bytes(piece, subtype))
                    clock.sent()
            elif kind == "end":
                await ws.send_text(json.dumps({"done": True, "samples": samples}))
                await ws.close(1000)
                return "200"
            else:
                status, message = value
                await ws.send_text(json.dumps({"error": message, "status": status}))
                await ws.close(1011 if status == 500 else 1013, message[:120])
                return str(status)
