"""``omni-lightning serve`` with a decode that costs nothing: the HTTP and WebSocket edge's ceiling.

A test double for ``load_test_serve.py --free-decode``, never a server mode: :class:`FreeDecoder` has the
calls of a ``StreamingDecoder`` the decode loop makes and answers each step with silence of the right
length at once; everything else (fronts, engine process, sockets, decode loop, encoding) is the server's.

    python scripts/serve/free_decoder.py --port 0 --front-processes 1    # prints serve's start-up line
"""

from __future__ import annotations

import argparse
import itertools

import torch

from omni_lightning import Code2WavConfig


class FreeDecoder:
    """Streams whose steps decode nothing: ``output_length`` zeros per chunk, no model."""

    def __init__(self, config: Code2WavConfig, max_streams: int) -> None:
        self.config, self.max_streams = config, max_streams
        self.frames: dict[int, int] = {}
        self.pending: dict[int, int] = {}
        self.ids = itertools.count()
        self.silence = torch.zeros((1, 1 << 20))  # views of it: the double allocates nothing per step

    def open(self) -> int:
        if len(self.frames) >= self.max_streams:
            raise ValueError(f"all {self.max_streams} stream slots are in use")
        sid = next(self.ids)
        self.frames[sid], self.pending[sid] = 0, 0
        return sid

    def push(self, sid: int, codes: torch.Tensor) -> None:
        self.pending[sid] += codes.shape[1]

    def step(self) -> dict[int, torch.Tensor]:
        out, up, tail = {}, self.config.total_upsample, self.config.tail
        for sid, n in self.pending.items():
            if n:
                out[sid] = self.silence[:, : n * up - (tail if self.frames[sid] == 0 else 0)]
                self.frames[sid] += n
                self.pending[sid] = 0
        return out

    def close(self, sid: int) -> torch.Tensor:
        self.frames.pop(sid, None)
        self.pending.pop(sid, None)
        return torch.zeros((1, 0))

    def warmup(self, chunk_sizes=(1,), batch_sizes=(1,)) -> float:
        return 0.0


def free_loop(args: argparse.Namespace):
    from omni_lightning.serving.decode_loop import DecodeLoop
    from omni_lightning.serving.metrics import ServeMetrics

    config = Code2WavConfig.from_name(args.preset)
    loop = DecodeLoop(FreeDecoder(config, args.max_streams), args.max_queue, args.request_frames,
                      metrics=ServeMetrics(), bulk_slice_s=args.bulk_slice_ms / 1000, pipeline=False)  # fmt: skip
    return loop, {"config": config, "what": f"{args.preset} preset, free decode (a test double)", "limits": ""}


def free_engine(index: int, address: str, conn, args: argparse.Namespace) -> None:
    from omni_lightning.serving.engine_process import run_engine

    torch.set_num_threads(1)
    run_engine(lambda: free_loop(args), address, conn)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--front-processes", type=int, default=1, help="0: one process (the app and its loop thread)")
    p.add_argument("--max-streams", type=int, default=64)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--request-frames", type=int, default=32)
    p.add_argument("--bulk-slice-ms", type=float, default=10.0)
    return p


def main() -> None:
    serve_double(parser().parse_args(), free_loop, free_engine)


def serve_double(args: argparse.Namespace, make_loop, engine_entry) -> None:
    """The server (fronts, engine process, sockets) over ``make_loop(args)``'s decode loop; ``engine_entry``:
    the engine process's function (module level: spawned), which runs ``make_loop(args)`` there."""
    from omni_lightning.serving.app import app_over
    from omni_lightning.serving.front_process import FrontSettings, run_front
    from omni_lightning.serving.server import server_for
    from omni_lightning.serving.supervisor import Supervisor

    def say(info: dict, host: str, port: int) -> None:
        print(f"serve: {info['what']}; listening on http://{host}:{port}", flush=True)

    if args.front_processes == 0:
        loop, info = make_loop(args)
        app = app_over(loop, loop.metrics)
        server_for(app, args.host, args.port, on_listen=lambda h, p: say(info, h, p)).run()
        return
    settings = FrontSettings(args.host, args.max_streams)
    Supervisor(1, args.front_processes, args.host, args.port, engine_entry, (args,), run_front, (settings,), say).run()


if __name__ == "__main__":
    main()
