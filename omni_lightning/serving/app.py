"""``build_app``: the FastAPI app over one :class:`DecodeLoop`: ``POST /v1/code2wav`` (whole requests, the
audio whole or streamed as decoded), the WebSocket ``/v1/code2wav/stream`` (``stream_route.py``),
``GET /health`` and ``GET /metrics``.

The HTTP layer is thin: it reads and checks a body (``request_body.py``), hands the codes to the loop and
encodes what comes back (``audio_encoding.py``). Errors are JSON ``{"error": "<one line>"}`` with a 4xx
(the client's mistake), 503 with ``Retry-After`` (overloaded or shutting down) or 500 (a decode failed).
Each request has an id (the client's ``X-Request-Id``, else a new one), sent back in that header and
written in the log. Not done: authentication and TLS (put the server behind a proxy for either).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from omni_lightning.serving.audio_encoding import (
    MEDIA_TYPES,
    PCM_NAMES,
    check_output,
    flac_bytes,
    sample_bytes,
    wav_header,
)
from omni_lightning.serving.decode_loop import DecodeLoop
from omni_lightning.serving.jobs import Job, Overloaded, queue_sink
from omni_lightning.serving.metrics import ServeMetrics
from omni_lightning.serving.request_body import BadRequest, body_codes
from omni_lightning.serving.request_log import ended
from omni_lightning.serving.stream_lane import lane_arguments

log = logging.getLogger("omni_lightning.serving")
MAX_BODY_BYTES = 8 * 2**20  # a JSON body of ~100 k frames (2 h of audio); .npy int16 takes 32 bytes a frame
_SAFE_ID = re.compile(r"[^A-Za-z0-9._:-]")
ROUTES = "POST /v1/code2wav, WebSocket /v1/code2wav/stream, GET /health, GET /metrics"


@dataclass
class ServeState:
    """What the routes share: the loop, the metrics, the limits, and whether the server is draining."""

    loop: DecodeLoop
    metrics: ServeMetrics
    max_body_bytes: int = MAX_BODY_BYTES
    draining: bool = False
    handlers: int = 0  # requests and streams being answered (a drain waits for none)
    ids: Any = field(default_factory=lambda: itertools.count(1))

    def request_id(self, given: str | None) -> str:
        """The client's ``X-Request-Id`` (printable, 64 characters at most), else ``r<n>``."""
        return _SAFE_ID.sub("_", given)[:64] if given else f"r{next(self.ids)}"


def build_app(
    module: Any,
    max_streams: int = 64,
    max_queue: int = 256,
    max_body_bytes: int = MAX_BODY_BYTES,
    request_frames: int = 32,
    cuda_graphs: bool = True,
    gpu_memory_utilization: float | None = None,
    context: Callable[[], Any] = contextlib.nullcontext,
    warmup: tuple[int, ...] = (1, 8),
    bulk_slice_s: float = 0.01,
    stream_lane: bool | None = None,
    lane_sms: int = 0,
) -> FastAPI:
    """The app serving ``module`` (a ``Code2WavModule``, e.g. one fine-tuned in this process, or a bare
    ``Code2Wav``) on the device and in the dtype it has now.

    ``max_streams``: clients decoded at once (WebSocket streams past it get 503); ``max_queue``: whole
    requests waiting for a slot (past it, 503); ``max_body_bytes``: a body or a WebSocket message past it
    gets 413; ``request_frames``: frames of a whole request per decode step; ``context``: entered on the
    decode thread (autocast for a mixed precision); ``warmup``: chunk sizes run before ``/health`` says ready;
    ``bulk_slice_s``: while a stream is open, the engine time a step gives whole requests (``schedule.py``);
    ``stream_lane``: the streams on a decoder of their own, on a high-priority CUDA stream (``stream_lane.py``;
    None: where its memory holds one, else a warning; True: else the warm-up fails; False: none); ``lane_sms``:
    the SMs the bulk decodes leave to the lane while a stream is open (``stream_lane.py``; 0: none).
    A module's decoder is retired when ``trainer.fit`` starts on it: every request then fails with a 500
    saying so (build a new app after a fit).
    """
    from omni_lightning.engine.streaming import StreamingDecoder
    from omni_lightning.errors import check_count

    for name, value, least in (("max_queue", max_queue, 0), ("max_body_bytes", max_body_bytes, 1),
                               ("request_frames", request_frames, 1), ("lane_sms", lane_sms, 0)):  # fmt: skip
        check_count(name, value, least)  # (max_streams: the decoder checks it)

    def decoder() -> StreamingDecoder:
        if hasattr(module, "streaming_decoder"):
            return module.streaming_decoder(max_streams, cuda_graphs, gpu_memory_utilization)
        return StreamingDecoder(module, max_streams, cuda_graphs, gpu_memory_utilization=gpu_memory_utilization)

    metrics = ServeMetrics()
    loop = DecodeLoop(decoder(), max_queue, request_frames, context, metrics, warmup, bulk_slice_s,
                      **lane_arguments(stream_lane, decoder, lane_sms))  # fmt: skip
    return app_over(loop, metrics, max_body_bytes)


def app_over(loop: Any, metrics: ServeMetrics, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The routes over ``loop``: a :class:`DecodeLoop` in this process (``build_app``), or a front process's
    ``RemoteLoop`` over engine processes (``engine_client.py``); started and stopped with the app."""
    from omni_lightning.serving.stream_route import add_stream_route

    state = ServeState(loop, metrics, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        yield
        await asyncio.to_thread(state.loop.stop)

    app = FastAPI(title="omni-lightning serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = state

    @app.get("/health")
    async def health() -> JSONResponse:
        loop, pid = state.loop, os.getpid()  # pid: which process answered (--devices N: each worker for itself)
        if state.draining:
            return JSONResponse({"status": "draining", "open": loop.open_jobs, "pid": pid}, 503)
        if loop.warmup_error:
            return JSONResponse({"status": "failed", "error": loop.warmup_error, "pid": pid}, 503)
        if not loop.ready.is_set():
            return JSONResponse({"status": "starting", "pid": pid}, 503)
        return JSONResponse({"status": "ready", "open": loop.open_jobs, "max_streams": loop.max_streams, "pid": pid})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/code2wav")
    async def code2wav(request: Request) -> Response:
        rid = state.request_id(request.headers.get("x-request-id"))
        state.handlers += 1
        try:
            return await _whole_request(state, request, rid)
        except BadRequest as err:
            return _error(state, "code2wav", rid, err.status, str(err))
        except Overloaded as err:
            return _error(state, "code2wav", rid, 503, str(err), {"Retry-After": str(err.retry_after)})
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            log.info("serve: %s client went away while sending", rid)
            return Response(status_code=499)
        finally:
            state.handlers -= 1

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        """A wrong path or method (404, 405) as every other error: ``{"error": "<one line>"}``."""
        where = f"{request.method} {request.url.path}"
        said = {404: f"{where}: no such route", 405: f"{where}: the route does not take {request.method}"}
        message = said.get(err.status_code, f"{where}: {err.detail}")
        if err.status_code in (404, 405):
            message += f" (routes: {ROUTES})"
        return JSONResponse({"error": message}, err.status_code, headers=err.headers)

    add_stream_route(app, state)
    return app


async def _whole_request(state: ServeState, request: Request, rid: str) -> Response:
    started, query = time.perf_counter(), request.query_params
    audio_format, subtype = query.get("format", "wav").lower(), query.get("subtype", "FLOAT").upper()
    stream = query.get("stream", "false").lower()
    if stream not in ("true", "false", "1", "0"):
        raise BadRequest(400, f"request {rid}: stream={stream!r}: use true or false")
    stream_out = stream in ("true", "1")
    problem = check_output(audio_format, subtype, stream_out)
    if problem:
        raise BadRequest(400, f"request {rid}: {problem}")
    if state.draining:
        raise Overloaded("the server is shutting down: retry on another instance", retry_after=5)
    body = await read_body(request, state.max_body_bytes, f"request {rid}")
    codes = body_codes(body, request.headers.get("content-type"), state.loop.config, f"request {rid}")
    config = state.loop.config
    log.info(
        "serve: %s POST /v1/code2wav %d frames, %s %s%s",
        rid,
        codes.shape[1],
        audio_format,
        subtype,
        " streamed" if stream_out else "",
    )
    queue: asyncio.Queue = asyncio.Queue()
    job = state.loop.submit(rid, codes, queue_sink(queue))
    headers = {"X-Request-Id": rid, "X-Sample-Rate": str(config.sample_rate)}
    if audio_format == "pcm":
        headers["X-Sample-Format"] = PCM_NAMES[subtype]
    if stream_out:
        state.handlers += 1  # until the body is sent
        body_iter = _streamed(state, job, queue, audio_format, subtype, codes.shape[1], started)
        return StreamingResponse(body_iter, media_type=MEDIA_TYPES[audio_format], headers=headers)
    pieces: list[torch.Tensor] = []
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(queue.get(), 0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    log.info("serve: %s client went away: slot freed", rid)
                    ended(rid, "499", codes.shape[1], started)
                    return Response(status_code=499)
                continue
            if kind == "audio":
                pieces.extend(value)
            elif kind == "error":
                ended(rid, str(value[0]), codes.shape[1], started)
                return _error(state, "code2wav", rid, *value)
            else:
                break
    finally:
        if not job.done:
            state.loop.abort(job)
    samples = torch.cat(pieces, dim=-1) if pieces else torch.zeros((1, 0))
    if audio_format == "flac":
        data = flac_bytes(samples, config.sample_rate, subtype)
    else:
        data = sample_bytes(samples, subtype)
        data = wav_header(samples.shape[-1], config.sample_rate, subtype) + data if audio_format == "wav" else data
    state.metrics.requests.labels("code2wav", "200").inc()
    ended(rid, "200", codes.shape[1], started)
    return Response(data, media_type=MEDIA_TYPES[audio_format], headers=headers)


async def _streamed(
    state: ServeState, job: Job, queue: asyncio.Queue, audio_format: str, subtype: str, frames: int, started: float
) -> AsyncIterator[bytes]:
    """The body of a streamed response: the WAV header first (its length known from the codes), then each
    piece as it is decoded. A decode that fails after the header ends the body short (the log says why)."""
    status = "200"
    try:
        if audio_format == "wav":
            config = state.loop.config
            yield wav_header(config.output_length(frames), config.sample_rate, subtype)
        while True:
            kind, value = await queue.get()
            if kind == "audio":
                for piece in value:
                    yield sample_bytes(piece, subtype)
            elif kind == "error":
                status = str(value[0])
                log.error("serve: %s %s (the streamed body ends short)", job.rid, value[1])
                return
            else:
                return
    finally:
        if not job.done:
            state.loop.abort(job)
            status = "499"
        state.metrics.requests.labels("code2wav", status).inc()
        state.handlers -= 1
        ended(job.rid, status, frames, started)


async def read_body(request: Request, limit: int, who: str) -> bytes:
    """The body, or a 413 :class:`BadRequest` as soon as it passes ``limit`` bytes (declared or read)."""
    declared = request.headers.get("content-length", "")
    too_big = f"{who}: the body is over the limit of {limit} bytes (--max_body_bytes): send fewer frames per request"
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, too_big)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, too_big)
        chunks.append(chunk)
    return b"".join(chunks)


def _error(
    state: ServeState, route: str, rid: str, status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    state.metrics.requests.labels(route, str(status)).inc()
    log.info("serve: %s %d %s", rid, status, message)
    return JSONResponse({"error": message}, status, headers={"X-Request-Id": rid, **(headers or {})})
