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


class Booking:
    """A forward booked on the device: when it ends (later, if higher-priority work is booked before then)."""

    def __init__(self, end: float) -> None:
        self.end = end


class SimDevice:
    """A device queue in simulated time (see the module docstring); ``charging()``: whether a shape first run
    now costs a capture (after the warm-up). A forward booked ``high`` (a stream lane's, on a CUDA stream of
    the greatest priority) starts when it is launched, or after the high-priority work before it, and every
    normal forward not done by then ends that much later: the device runs the high-priority blocks first.
    A real device finishes the blocks it started and shares its SMs meanwhile, so a high-priority forward that
    starts while normal work runs takes ``1 + lane_slowdown`` times its cost (0: exactly its cost; an H200,
    2026-12-07: a lane's decode 3.9 ms beside the bulk against ~2 ms alone, about 1)."""

    def __init__(
        self, frame_s: float, forward_s: float, eager_s: float, capture_s: float, graph_frames: int,
        lane_slowdown: float = 0.0,
    ) -> None:  # fmt: skip
        self.frame_s, self.forward_s, self.eager_s, self.capture_s = frame_s, forward_s, eager_s, capture_s
        self.graph_frames, self.seen, self.lane_slowdown = graph_frames, set(), lane_slowdown
        self.last = {False: Booking(0.0), True: Booking(0.0)}  # the last forward booked, normal and high
        self.pending: list[Booking] = []  # normal forwards booked, perhaps not done
        self.charging: Callable[[], bool] = lambda: True
        self._lock = threading.Lock()
        # audio-like samples (noise), not silence: what the edge does with the audio (a WebSocket's
        # compression, say) costs what it would with a real decoder's output
        self._audio = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 0.1

    @property
    def free_at(self) -> float:
        """When the device is done with everything booked so far."""
        return max(self.last[False].end, self.last[True].end)

    def forward(self, rows: int, chunk: int, up: int, high: bool = False) -> torch.Tensor:
        """Books a forward of ``rows x chunk`` frames; its output ``[rows, 1, chunk * up]`` (noise)."""
        if (rows, chunk) not in self.seen:
            self.seen.add((rows, chunk))
            if self.charging() and rows * chunk <= self.graph_frames:
                self.wait()  # a capture runs on an idle device, the host busy throughout
                time.sleep(self.capture_s)
        launched = time.perf_counter()
        if rows * chunk > self.graph_frames:
            time.sleep(self.eager_s)  # the host launches an eager forward's kernels one by one
        cost = self.forward_s + self.frame_s * rows * chunk
        with self._lock:  # the device starts on the first kernel launched: launches and compute overlap
            now = time.perf_counter()
            if high:
                start = max(launched, self.last[True].end)
                self.pending = [b for b in self.pending if b.end > start]
                for booked in self.pending:  # not done when the high-priority work starts: it waits for it
                    booked.end += cost
                span = cost * (1 + self.lane_slowdown) if self.pending else cost  # sharing the SMs with them
                self.last[True] = Booking(max(start + span, now))
            else:
                start = max(launched, self.last[False].end, self.last[True].end)
                self.last[False] = Booking(max(start + cost, now))
                self.pending.append(self.last[False])
        if rows * chunk * up > self._audio.numel():
            return torch.zeros(rows, 1, chunk * up)
        return self._audio[: rows * chunk * up].view(rows, 1, chunk * up)

    def wait(self, until: float | None = None) -> None:
        """Blocks until the device is done with what was booked (or until ``until``)."""
        delay = (self.free_at if until is None else until) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def simulate(engine, device: SimDevice, frames: int, high: bool = False) -> None:
    """``engine`` (a CPU ``DecodeEngine``) planned as on a GPU with CUDA graphs up to ``device.graph_frames``
    and ``frames`` a forward, its forwards booked on ``device`` (``high``: at the greatest priority)."""
    engine.graph_frames = device.graph_frames
    engine.planner = replace(engine._planner(frames), new_shape_cost=engine.new_shape_cost)  # a CPU's is 0
    up, engine.sim = engine.model.config.total_upsample, device
    engine._run = lambda inputs: device.forward(inputs.rows, inputs.chunk, up, high)


class _BookedCopy:
    """A decode's audio copy, landed when its last forward's booking ends (read when asked: it may move)."""

    def __init__(self, copy, device: SimDevice, booking: Booking) -> None:
        self.copy, self.device, self.booking = copy, device, booking

    def ready(self) -> bool:
        return time.perf_counter() >= self.booking.end

    def wait(self) -> torch.Tensor:
        while not self.ready():
            self.device.wait(self.booking.end)
        return self.copy.wait()


def book_copies(host, device: SimDevice, high: bool) -> None:
    """``host`` (a ``HostAudio``) hands out copies that land when the device is done with their decode."""
    start = host.start
    host.start = lambda outs: _BookedCopy(start(outs), device, device.last[high])


def device_from(args: argparse.Namespace, graph_frames: int | None = None) -> SimDevice:
    """The device of the options below (``graph_frames``: instead of ``--graph-frames``)."""
    graphs = args.graph_frames if graph_frames is None else graph_frames
    return SimDevice(args.frame_us / 1e6, args.forward_us / 1e6, args.eager_ms / 1e3, args.capture_ms / 1e3, graphs,
                     args.lane_slowdown)  # fmt: skip


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

    def lane():  # the streams' own decoder (--stream-lane), its forwards booked at the greatest priority
        own = module.streaming_decoder(args.max_streams, False, step_frames=args.request_frames)
        simulate(own.engine, device, args.budget_frames, high=True)
        return own

    lanes = {"stream_lane": lane} if args.stream_lane == "true" else {}  # (a tree from before lanes: none)
    loop = DecodeLoop(decoder, args.max_queue, args.request_frames, metrics=ServeMetrics(), warmup=chunks,
                      bulk_slice_s=args.bulk_slice_ms / 1000, warmup_rows=rows, pipeline=True, **lanes)  # fmt: skip
    device.charging = loop.ready.is_set
    book_copies(loop.decodes.host, device, False)
    if loop.lane is not None:  # its decodes are made with the decoder, in the warm-up
        build = loop.lane.build

        def build_and_book(*args):
            seconds = build(*args)
            book_copies(loop.lane.decodes.host, device, True)
            loop.lane.overlaps = True  # its forwards run beside the bulk's on the simulated device, as on CUDA
            return seconds

        loop.lane.build = build_and_book
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
    slow = "a lane's forward that starts beside bulk work takes 1 + this times its cost (its kernels wait for the"
    slow += " bulk's blocks to retire); 0: none; about 1 on an H200 (docs/performance.md#serving)"
    p.add_argument("--lane-slowdown", type=float, default=0.0, help=slow)
    lane = "serve's --stream_lane: the flag alone or true, false; not given, the server's default (a lane;"
    lane += " the simulated device: none). A lane's forwards are booked at a high priority"
    p.add_argument("--stream-lane", nargs="?", const="true", choices=("true", "false"), help=lane)
    return p


def main() -> None:
    serve_double(add_device_arguments(free_parser()).parse_args(), sim_loop, sim_engine)


if __name__ == "__main__":
    main()
