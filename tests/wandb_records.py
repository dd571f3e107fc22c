"""Reads an offline W&B run's `.wandb` record file with wandb's own protobuf definitions.

The file is a LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB
blocks of chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)
holding a serialized `wandb_internal_pb2.Record`.
"""

import json
import struct
from pathlib import Path

from google.protobuf.message import DecodeError
from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768


def records(path: Path) -> list:
    data = Path(path).read_bytes()
    if len(data) < 7:  # created, its header not yet written (seen with wandb 0.19): no records yet
        return []
    assert data[:4] == b":W&B", "not a W&B record file"
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if pos + length > len(data):  # the writer is still appending this chunk
            break
        chunk, pos = data[pos : pos + length], pos + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
            pending = b""
    parsed = []
    for raw in out:
        rec = pb.Record()
        rec.ParseFromString(raw)
        parsed.append(rec)
    return parsed


def _has_exit(path: Path) -> bool:
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in records(path))
    except DecodeError:  # a record caught half-written (seen in CI): read again
        return False


def wait_for_exit(path: Path, timeout: float = 60.0) -> None:
    """wandb's service writes the file asynchronously: wait until the run's exit record is in it.

    Until then the file may end inside a record, so a read that fails to parse is retried."""
    import time

    deadline = time.time() + timeout
    while not _has_exit(path):
        if time.time() > deadline:
            records(path)  # raises the parse error, if that is what kept the exit record unseen
            raise TimeoutError(f"{path} has no exit record after {timeout} s")
        time.sleep(0.2)


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def history(path: Path) -> list[dict]:
    """Every history row as {key: value}."""
    return [
        {_key(i): json.loads(i.value_json) for i in r.history.item}
        for r in records(path)
        if r.WhichOneof("record_type") == "history"
    ]


def config(path: Path) -> dict:
    out = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "config":
            out.update({_key(i): json.loads(i.value_json) for i in r.config.update})
    return out
