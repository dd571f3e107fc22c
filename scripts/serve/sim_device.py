"""``omni-lightning serve`` on this CPU with a GPU's decode time: the host's share, measurable without a GPU.

A test double for ``load_test_serve.py --sim-device``, never a server mode. Everything is the server's (fronts,
engine process, sockets, the decode loop and its schedule, ``StreamingDecoder``, the engine's planner, its
inputs' packing and its outputs' split, the GPU's warm-up list and planner settings) but the forward itself:
:class:`SimDevice` answers it with noise of the right shape at once and books its time on a simulated device
queue, ``forward_us + frame_us * rows * chunk`` after the last booked forward ends (a GPU runs what the host
launched in order, while the host goes on); a decode's audio copy waits for its last forward's end, as an
event would. A forward longer than the CUDA graphs' ``--graph-frames`` also costs the host ``--eager-ms`` (its
launches, which the device's work on them overlaps: it ends no sooner than the last launch), and a shape
first run after the warm-up costs the host ``--capture-ms`` after the device drains (a capture). So the load
test's served rate against the offline engine (booked on its own simulated device) and the talkers' latencies
are those of a GPU as fast as the figures given, with this host's own overheads.

Defaults are an H100's, qwen3-omni bf16 (docs/performance.md): the eager forward at batch 32, 4,596x real time
(17.4 us a frame); a forward's fixed cost ~1.3 ms (a one-frame step replayed as a graph: 1.53 ms); an eager
forward's launches ~10 ms; a capture ~0.3 s; the server's decoder's budget with no cap (6 GiB): CUDA graphs and
forwards of up to 1,024 frames; the offline engine's: graphs of up to 256 frames, forwards of 2,048
(``load_test_serve.py --offline-frames``). Not modelled: the device running slower on small shapes than on
large ones (the per-frame cost is flat), memory.

    python scripts/serve/sim_device.py --port 0     # prints serve's start-up line
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from free_decoder import parser as free_parser
from free_decoder import serve_double


class SimDevice:
    """A device queue in simulated time (see the module docstring); ``charging()``: whether a shape first run
    now costs a capture (after the warm-up)."""

    def __init__(self, frame_s: float, forward_s: float, eager_s: float, capture_s: float, graph_frames: int) -> None:
        self.frame_s, self.forward_s, self.eager_s, self.capture_s = frame_s, forward_s, eager_s, capture_s
        self.graph_frames, self.free_at, self.seen = graph_frames, 0.0, set()
        self.charging: Callable[[], bool] = lambda: True
        self._lock = threading.Lock()
        # audio-like samples (noise), not silence: what the edge does with the audio (a WebSocket's
        # compression, say) costs what it would with a real decoder's output
        self._audio = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 0.1

    def forward(self, rows: int, chunk: int, up: int) -> torch.Tensor:
        """Books a forward of ``rows x chunk`` frames; its output ``[rows, 1, chunk * up]`` (noise)."""
        if (rows, chunk) not in self.seen:
            self.seen.add((rows, chunk))
            if self.charging() and rows * chunk <= self.graph_frames:
                self.wait()  # a capture runs on an idle device, the host busy throughout
                time.sleep(self.capture_s)
        launched = time.perf_counter()
        if rows * chunk > self.graph_frames:
            time.sleep(self.eager_s)  # the host launches an eager forward's kernels one by one
        with self._lock:  # the device starts on the first kernel launched: launches and compute overlap
            start = max(launched, self.free_at)
            self.free_at = max(start + self.forward_s + self.frame_s * rows * chunk, time.perf_counter())
        if rows * chunk * up > self._audio.numel():
            return torch.zeros(rows, 1, chunk * up)
        return self._audio[: rows * chunk * up].view(rows, 1, chunk * up)

    def wait(self, until: float | None = None) -> None:
        """Blocks until the device is done with what was booked (or until ``until``)."""
        delay = (self.free_at if until is None else until) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def simulate(engine, device: SimDevice, frames: int) -> None:
    """``engine`` (a CPU ``DecodeEngine``) planned as on a GPU with CUDA graphs up to ``device.graph_frames``
    and ``frames`` a forward, its forwards booked on ``device``."""
    engine.graph_frames = device.graph_frames
    engine.planner = replace(engine._planner(frames), new_shape_cost=engine.new_shape_cost)  # a CPU's is 0
    up, engine.sim = engine.model.config.total_upsample, device
    engine._run = lambda inputs: device.forward(inputs.rows, inputs.chunk, up)


class _BookedCopy:
    def __init__(self, copy, device: SimDevice, until: float) -> None:
        self.copy, self.device, self.until = copy, device, until

    def ready(self) -> bool:
        return time.perf_counter() >= self.until

    def wait(self) -> torch.Tensor:
        self.device.wait(self.until)
        return self.copy.wait()


def device_from(args: argparse.Namespace, graph_frames: int | None = None) -> SimDevice:
    """The device of the options below (``graph_frames``: instead of ``--graph-frames``)."""
    graphs = args.graph_frames if graph_frames is None else graph_frames
    return SimDevice(args.frame_us / 1e6, args.forward_us / 1e6, args.eager_ms / 1e3, args.capture_ms / 1e3, graphs)


def sim_loop(args: argparse.Namespace):
    from omni_lightning import Code2WavModule
    from omni_lightning.serving.decode_loop import DecodeLoop
    from omni_lightning.serving.metrics import ServeMetrics

    torch.manual_seed(0)
    module = Code2WavModule(config=args.preset, random_weights=True).eval()
    decoder = module.streaming_decoder(args.max_streams, False, step_frames=args.request_frames)
    device = device_from(args)
    simulate(decoder.engine, device, args.budget_frames)
    try:
        from omni_lightning.cli.serve import warmup_shapes
    except ImportError:  # a tree from before it (an A/B): the same lists
        warmup_shapes = lambda _, r: (tuple(sorted({1, 8, 10, 16, r})), tuple(2**i for i in range(8)))  # noqa: E731
    chunks, rows = warmup_shapes(True, args.request_frames)
    loop = DecodeLoop(decoder, args.max_queue, args.request_frames, metrics=ServeMetrics(), warmup=chunks,
                      bulk_slice_s=args.bulk_slice_ms / 1000, warmup_rows=rows, pipeline=True)  # fmt: skip
    device.charging = loop.ready.is_set
    start = loop.decodes.host.start
    loop.decodes.host.start = lambda outs: _BookedCopy(start(outs), device, device.free_at)
    what = f"{args.preset} preset on a simulated device ({args.frame_us} us a frame; a test double)"
    return loop, {"config": module.config, "what": what, "limits": ""}


def sim_engine(index: int, address: str, conn, args: argparse.Namespace) -> None:
    from omni_lightning.serving.engine_process import run_engine

    torch.set_num_threads(1)
    run_engine(lambda: sim_loop(args), address, conn)


def add_device_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--frame-us", type=float, default=17.4, help="device time a computed frame")
    p.add_argument("--forward-us", type=float, default=1300.0, help="device time a forward, fixed")
    p.add_argument("--eager-ms", type=float, default=10.0, help="host time an eager forward's launches")
    p.add_argument("--capture-ms", type=float, default=300.0, help="host time a capture")
    p.add_argument("--graph-frames", type=int, default=1024, help="the server's largest graphed forward (rows x chunk)")
    p.add_argument("--budget-frames", type=int, default=1024, help="the server's frames a forward at most")
    return p


def main() -> None:
    serve_double(add_device_arguments(free_parser()).parse_args(), sim_loop, sim_engine)


if __name__ == "__main__":
    main()
