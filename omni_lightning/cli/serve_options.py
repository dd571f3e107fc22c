"""``serve``'s own options (``OPTIONS``: the parser's) and :func:`check_serve_values`, which reads their values
as the parser would, before torch loads (``preflight.py``): a mistake is one line naming the option and value,
not an engine process's parser error after the model loaded. Standard library only."""

from __future__ import annotations

from typing import Any

from omni_lightning.errors import UsageError

# serve's own options: (name, type, default, help)
OPTIONS = (
    ("host", str, "127.0.0.1", "the address to listen on (0.0.0.0: every interface)"),
    ("port", int, 8000, "the port to listen on (0: a free one, named in the start-up line)"),
    ("max_streams", int, 64, "clients decoded at once (each holds a decode slot); more streams get 503"),
    ("max_queue", int, 256, "whole requests waiting for a slot; more get 503 with Retry-After"),
    ("max_body_bytes", int, 8 * 2**20, "a request body or WebSocket message past this gets 413"),
    ("request_frames", int, 32, "frames of a whole request decoded per step (streams interleave between)"),
    ("bulk_slice_ms", float, 10.0, "while a stream is open, the engine time a step gives whole requests"),
    (
        "stream_lane",
        bool | None,
        None,
        "WebSocket streams on a decoder of their own, on a high-priority CUDA stream: a chunk does not wait "
        "for whole requests' work (a second decoder's memory; on a GPU no slice cap). null (default): on where "
        "its memory holds, else a warning; true: else an error",
    ),
    (
        "lane_sms",
        int,
        0,
        "SMs the whole requests' decodes leave to the stream lane while a stream is open (a green context, "
        "CUDA 12.8+): a talker's chunk need not wait for bulk blocks to retire. 0 (default): none",
    ),
    ("drain_timeout", float, 30.0, "on SIGTERM, seconds to finish what is in flight before exiting"),
    ("devices", int, 1, "engine processes, each its own engine on its own GPU (on a CPU: CPU engines)"),
    (
        "front_processes",
        int,
        -1,
        "HTTP/WebSocket processes in front of the engines (-1: a quarter of the cores, "
        "1 to 8; 0: one process, the app and its decode thread together)",
    ),
)

# counts: the least each takes
LEAST = {"lane_sms": 0, "port": 0, "max_streams": 1, "max_queue": 0, "request_frames": 1, "max_body_bytes": 1}


def check_serve_values(values: dict[str, Any]) -> None:
    """UsageError naming the first of serve's options (top-level keys of ``values``; absent for the other
    subcommands) whose value its type does not take, or a count under its least."""
    for name, kind, _, _ in OPTIONS:
        value = values.get(name)
        if value is None:
            continue
        text = str(value).strip().lower()
        try:
            if kind == bool | None and text not in ("true", "false", "null"):
                raise ValueError
            number = kind(text) if kind in (int, float) and not isinstance(value, bool) else None
            if kind in (int, float) and (isinstance(value, bool) or number < LEAST.get(name, number)):
                raise ValueError
        except ValueError:
            if name in LEAST:
                raise UsageError(f"--{name} must be an integer >= {LEAST[name]}, got {value}") from None
            taken = {int: "an integer", float: "a number", str: "text"}.get(kind, "true, false or null")
            raise UsageError(f"--{name} takes {taken}, got {value!r}") from None
    if str(values.get("stream_lane")).strip().lower() == "false" and int(values.get("lane_sms") or 0) > 0:
        raise UsageError(f"--lane_sms {values['lane_sms']} keeps SMs for the stream lane, which --stream_lane false "
                         "turns off: drop one of them")  # fmt: skip
