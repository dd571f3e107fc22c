"""A stream lane's decode beside bulk decodes on one GPU: what a talker's chunk computes in alone, beside a bulk
decoder kept busy, and what the lane's stream priority, the bulk's launches and the lane's kernels change.

    python scripts/serve/bench_lane.py --device cuda --out lane.json           # a GPU (qwen3-omni, bf16)
    python scripts/serve/bench_lane.py --preset tiny --device cpu --trials 3   # this machine: a smoke run

Two ``StreamingDecoder``s over one model, as ``serve --stream_lane`` runs them: the bulk one steps ``--bulk-rows``
rows of ``--bulk-frames`` frames (whole requests of ``--bulk-steps`` steps, each replaced by a new one as it
ends), up to two steps in flight; the lane's decodes ``--lane-rows`` streams' ``--chunk``-frame chunks on a
CUDA stream of the greatest priority. A lane decode is timed as the serving loop times it (``stream_decode``):
from the call to ``step`` to its audio's copy landing on the host (``HostAudio``), polled every 50 us. After a
random pause (0-8 ms, the bulk kept going) each scenario times ``--trials`` of them, median and p90:

- ``alone``: no bulk work;
- ``held``: bulk steps in flight when the lane launches, none launched until it lands (``serve``'s loop);
- ``launching``: the bulk launched on while the lane computes (two in flight: the loop of 0f05502, reverted);
- ``held_normal_priority``: ``held``, the lane on a stream of normal priority;
- ``held_reference_kernels``: ``held``, the lane's decoder on torch's kernels (cuDNN), not Triton's;
- ``held_green_<n>``: ``held``, the bulk launched on a green context of ``n`` SMs (torch's
  ``torch.cuda.green_contexts``, CUDA 12.8+: where it is missing or fails, the reason is kept instead).

Also the bulk's step alone and beside the lane's decodes (its frames per second: what the lane costs it), and the
kernels one lane decode runs (``lane_kernels_triton``, ``_torch``: the profiler's, a CUDA graph's included).
On a CPU every decode runs in turn (no streams): the smoke run checks the script, not the device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import statistics
import sys
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import device_model

from omni_lightning import StreamingDecoder
from omni_lightning.kernels import Kernels
from omni_lightning.serving.host_audio import HostAudio
from omni_lightning.serving.stream_lane import green_stream, lane_stream


def on(stream) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class Bulk:
    """The bulk decoder's whole requests, stepped on ``stream``, at most two steps in flight."""

    def __init__(self, decoder: StreamingDecoder, args: argparse.Namespace, codes: torch.Tensor, stream) -> None:
        self.decoder, self.args, self.codes, self.stream = decoder, args, codes, stream
        self.flight: deque = deque()
        self.host = HostAudio()
        self.frames = 0
        with on(stream):
            self.sids = [decoder.open() for _ in range(args.bulk_rows)]
        self.age = 0

    def launch(self) -> None:
        with on(self.stream):
            if self.age == self.args.bulk_steps:  # each request ended: new ones in their slots
                for i, sid in enumerate(self.sids):
                    self.decoder.close(sid)
                    self.sids[i] = self.decoder.open()
                self.age = 0
            out = self.decoder.step(dict.fromkeys(self.sids, self.codes))
            self.flight.append(self.host.start([out[sid] for sid in self.sids]))
        self.age += 1
        self.frames += self.args.bulk_rows * self.args.bulk_frames

    def keep_going(self) -> None:
        """Lands the steps done, and launches until two are in flight."""
        while self.flight and self.flight[0].ready():
            self.flight.popleft().wait()
        while len(self.flight) < 2:
            self.launch()

    def drain(self) -> None:
        while self.flight:
            self.flight.popleft().wait()


def lane_decode(
    lane: StreamingDecoder, sids: list, codes: torch.Tensor, host: HostAudio, stream, bulk: Bulk | None
) -> float:
    """Seconds of one lane decode, from its call to its audio on the host; ``bulk``: launched on meanwhile."""
    start = time.perf_counter()
    with on(stream):
        out = lane.step(dict.fromkeys(sids, codes))
        copy = host.start([out[sid] for sid in sids])
    while not copy.ready():
        if bulk is not None:
            bulk.keep_going()
        time.sleep(5e-5)
    copy.wait()
    return time.perf_counter() - start


def pause(bulk: Bulk | None, rng: random.Random) -> None:
    """0-8 ms, the bulk kept going (two steps in flight when it ends): the lane meets it at any phase."""
    end = time.perf_counter() + rng.uniform(0, 8e-3)
    while time.perf_counter() < end:
        if bulk is not None:
            bulk.keep_going()
        time.sleep(5e-5)
    if bulk is not None:
        bulk.keep_going()


def kernels_in(fn, *args) -> int:
    """How many kernels the device ran in ``fn(*args)`` (the profiler's CUDA kernel events, a graph's included)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*args)
            torch.cuda.synchronize()
    except Exception as err:  # no CUPTI: say so, time the rest
        print(f"  kernels not counted: {err}", file=sys.stderr, flush=True)
        return -1
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def scenario(name, lane, lane_sids, codes, host, lane_s, bulk, mode, args, rng) -> dict:
    times = []
    frames0, t0 = (bulk.frames, time.perf_counter()) if bulk is not None else (0, 0.0)
    for _ in range(args.trials):
        pause(bulk, rng)
        times.append(lane_decode(lane, lane_sids, codes, host, lane_s, bulk if mode == "launching" else None))
    res = {"lane_ms_median": 1e3 * statistics.median(times), "lane_ms_p90": 1e3 * sorted(times)[int(0.9 * len(times))]}
    if bulk is not None:
        bulk.drain()
        res["bulk_frames_per_s"] = (bulk.frames - frames0) / (time.perf_counter() - t0)
    print(f"  {name}: {json.dumps({k: round(v, 2) for k, v in res.items()})}", file=sys.stderr, flush=True)
    return res


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = device.type == "cuda"
    model = device_model(args.preset, device)
    cfg, rng = model.config, random.Random(0)
    pool = [torch.randint(0, cfg.codebook_size, (cfg.num_quantizers, n)) for n in (args.bulk_frames, args.chunk)]
    bulk_codes, chunk_codes = pool  # the same codes each step: only the shapes matter to the timings
    graphs = device.type == "cuda"
    bulk_decoder = StreamingDecoder(model, max_streams=args.streams, cuda_graphs=graphs)
    bulk_decoder.warmup(chunk_sizes=(args.bulk_frames,), batch_sizes=(args.bulk_rows,))
    res: dict = {"preset": args.preset, "device": str(device), "scenarios": {}}
    # (name, the lane's kernels, its stream's priority, the bulk's mode, the bulk's green context SMs): the green
    # contexts last, as a failure there may leave the device unusable
    plans = [("alone", "triton", "greatest", "alone", None), ("held", "triton", "greatest", "held", None),
             ("launching", "triton", "greatest", "launching", None),
             ("held_normal_priority", "triton", "normal", "held", None),
             ("held_reference_kernels", "torch", "greatest", "held", None),
             *((f"held_green_{n}", "triton", "greatest", "held", n) for n in args.green_sms if graphs)]  # fmt: skip
    lanes: dict[str, StreamingDecoder] = {}
    with torch.no_grad():
        bulk = Bulk(bulk_decoder, args, bulk_codes, None)
        t0 = time.perf_counter()
        for _ in range(args.trials * 4):
            bulk.keep_going()
            time.sleep(5e-5)
        bulk.drain()
        res["bulk_alone_frames_per_s"] = bulk.frames / (time.perf_counter() - t0)
        for name, kernels, priority, mode, sms in plans:
            stream = lane_stream(device) if priority == "greatest" or not graphs else torch.cuda.Stream(device)
            if kernels not in lanes:  # built and warmed up once, on the lane's stream
                lanes[kernels] = lane = StreamingDecoder(model, max_streams=args.streams, cuda_graphs=graphs)
                if kernels == "torch":
                    lane.engine.kernels = Kernels.for_inference(device, fused=False)
                with on(stream):
                    lane.warmup(chunk_sizes=(args.chunk,), batch_sizes=(args.lane_rows,))
            try:  # (the context kept while its stream is in use)
                green, bulk_stream = green_stream(device, sms) if sms is not None else (None, None)
            except RuntimeError as err:  # no green context: why
                res["scenarios"][name] = {"error": str(err)}
                print(f"  {name}: {err}", file=sys.stderr, flush=True)
                continue
            lane, host = lanes[kernels], HostAudio()
            with on(stream):
                sids = [lane.open() for _ in range(args.lane_rows)]
            if graphs and f"lane_kernels_{kernels}" not in res:  # the kernels of one lane decode, its graph's too
                res[f"lane_kernels_{kernels}"] = kernels_in(lane_decode, lane, sids, chunk_codes, host, stream, None)
            try:
                b = None if mode == "alone" else Bulk(bulk_decoder, args, bulk_codes, bulk_stream)
                res["scenarios"][name] = scenario(name, lane, sids, chunk_codes, host, stream, b, mode, args, rng)
                for sid in b.sids if b is not None else ():
                    bulk_decoder.close(sid)
            except Exception as err:  # a green context whose stream the graphs cannot replay on
                if sms is None:
                    raise
                res["scenarios"][name] = {"error": f"{type(err).__name__}: {err}"}
                print(f"  {name}: {err}", file=sys.stderr, flush=True)
            with on(stream):
                for sid in sids:
                    lane.close(sid)
            if graphs:
                torch.cuda.synchronize(device)  # the slots zeroed before the next scenario's streams use them
    return res


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-omni")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--streams", type=int, default=64, help="slots of each decoder")
    p.add_argument("--bulk-rows", type=int, default=16)
    p.add_argument("--bulk-frames", type=int, default=32)
    p.add_argument("--bulk-steps", type=int, default=4, help="steps of a whole request")
    p.add_argument("--lane-rows", type=int, default=2)
    p.add_argument("--chunk", type=int, default=10)
    p.add_argument("--trials", type=int, default=60)
    p.add_argument("--green-sms", type=int, nargs="*", default=[120, 112, 96])
    p.add_argument("--out", default="bench_lane.json")
    return p


def main() -> None:
    args = parser().parse_args()
    res = run(args)
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine()
    res["meta"] = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
                   "machine": machine, "args": vars(args)}  # fmt: skip
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
