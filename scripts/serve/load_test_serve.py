"""A bounded load test of ``omni-lightning serve`` on loopback, in the field's terms, against the offline engine.

    python scripts/serve/load_test_serve.py --clients 4 --paced 16 --seconds 30 --out serve.json       # this CPU, tiny
    python scripts/serve/load_test_serve.py --device cuda --preset qwen3-omni --precision bf16-true \\
        --clients 64 --client-processes 8 --seconds 30 --frames 25 125 --check 64 --out serve_gpu.json

Starts ``omni-lightning serve`` (random weights, seed 0; the PYTHONPATH it was given kept) on a free port,
or with ``--free-decode`` the same server over a decode that costs nothing (``free_decoder.py``: the edge's
ceiling). Then, for ``--seconds``: ``--clients`` bulk clients send whole requests back to back (streamed
back as raw PCM), ``--streams`` unpaced WebSocket streams (random chunks of 1-12 frames, each sent once the
last one's audio came) and ``--paced`` streams sending ``--chunk-frames`` every ``chunk / 12.5`` s (a
talker at real time), spread over ``--client-processes`` processes; requests of ``--frames`` frames.
Then SIGTERM (drained), and the offline engine (``DecodeEngine.decode``, batches of ``--offline-batch``
sorted by length) on the same device, model and precision decodes ``--offline-requests`` requests of the
load's lengths before and after (the better) and the checked requests (the reference).

Reported: audio s/s served and its ratio to the offline engine's; requests/s; first audio p50/p99 (time to
first audio packet: a request's body sent, a stream's first chunk sent, to its first audio); paced streams'
chunk latency p50/p99 and real-time factor (mean chunk latency / chunk duration, over streams); the share of
wall time the decode loop computed (``/metrics``: step seconds / wall / engines; the wall time runs from the
clients' start, every client process up, to the last answer; with a stream lane (serve's default;
``--stream-lane true|false``) the streams' decodes overlap the bulk's, so the sum may pass 1: the bulk's
alone is ``bulk_decode_share``); with ``--sim-device``,
the share of it the simulated device was busy and computed the requests' own frames; a stream chunk's mean
time inside the decode loop (``omni_stream_chunk_seconds``) and inside the fronts (message read to audio sent,
``omni_stream_chunk_front_seconds``), each with the first chunks apart, and the two hand-offs between a front
and its engine the front's time holds (``omni_stream_chunk_to_engine_seconds``,
``omni_stream_audio_to_front_seconds``); lost (an error or a short answer) and wrong
(fp32: a sample > 1e-5 from the offline decode; bf16: relative L2 > 0.1); the client processes' own delays
(``client_*``: their event loops' stalls and their collectors' pauses past 20 ms, and the longest), which the
clients' latencies hold and the server's figures do not: a stall there delays every client of its process
(give the clients enough processes: 8 on a 16-core host held the talkers' first-audio tail to the server's).
Prints a table; writes JSON (``--out``). Loopback only; bounded in clients and time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from serve_clients import client_process, timed_clients

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: child.py, shared by every group
from child import cli, package_env  # noqa: E402
from sim_device import add_device_arguments, device_from, simulate

ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=16, help="bulk clients: whole requests back to back")
    p.add_argument("--streams", type=int, default=0, help="unpaced WebSocket streams")
    p.add_argument("--paced", type=int, default=0, help="paced WebSocket streams (a talker at 12.5 frames/s)")
    p.add_argument("--chunk-frames", type=int, default=10, help="a paced stream's chunk")
    p.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="processes the clients are spread over (default: half the cores, at most 8: a client process's own "
        "stalls delay every client in it)",
    )
    p.add_argument("--seconds", type=float, default=20.0, help="how long new requests are sent")
    p.add_argument("--frames", type=int, nargs=2, default=(25, 125), help="a request's frames: min max (2 to 10 s)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-true"))
    p.add_argument("--share", type=float, default=None, help="--trainer.gpu_memory_utilization")
    p.add_argument("--front-processes", type=int, default=None, help="serve's --front_processes (default: its own)")
    p.add_argument("--max-streams", type=int, default=64)
    p.add_argument("--request-frames", type=int, default=32)
    p.add_argument("--bulk-slice-ms", type=float, default=None, help="serve's --bulk_slice_ms (default: its own)")
    p.add_argument("--lane-sms", type=int, default=None, help="serve's --lane_sms (default: its own; a GPU's server)")
    p.add_argument("--free-decode", action="store_true", help="a decode that costs nothing (the edge's ceiling)")
    p.add_argument(
        "--sim-device",
        action="store_true",
        help="a GPU's decode time on this CPU (sim_device.py: the options below), server and offline",
    )
    p.add_argument("--offline-frames", type=int, default=2048, help="--sim-device: the offline engine's budget")
    p.add_argument("--offline-batch", type=int, default=16)
    p.add_argument("--offline-requests", type=int, default=32)
    p.add_argument("--check", type=int, default=1000, help="requests checked against the offline decode, at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="the JSON result")
    return add_device_arguments(p)


DEVICE_OPTIONS = ("frame-us", "forward-us", "eager-ms", "capture-ms", "graph-frames", "budget-frames", "lane-slowdown")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    script = None
    env = package_env()  # the package on the PYTHONPATH given first (an A/B runs another tree's), then ROOT's
    if args.free_decode or args.sim_device:
        script = "sim_device.py" if args.sim_device else "free_decoder.py"
        cmd = [sys.executable, str(ROOT / "scripts" / "serve" / script), "--preset", args.preset,
               "--max-streams", str(args.max_streams), "--request-frames", str(args.request_frames),
               "--max-queue", str(4 * total_clients(args)), "--front-processes",
               str(1 if args.front_processes is None else args.front_processes)]  # fmt: skip
        cmd += [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in DEVICE_OPTIONS] if args.sim_device else []
    else:
        cmd = cli("serve", "--model.config", args.preset, "--model.random_weights", "true", "--port", "0",
                  "--trainer.precision", args.precision, "--trainer.accelerator", args.device,
                  "--max_streams", str(args.max_streams), "--request_frames", str(args.request_frames),
                  "--max_queue", str(4 * total_clients(args)))  # fmt: skip
        cmd += ["--front_processes", str(args.front_processes)] if args.front_processes is not None else []
        cmd += ["--trainer.gpu_memory_utilization", str(args.share)] if args.share else []
        cmd += ["--lane_sms", str(args.lane_sms)] if args.lane_sms is not None else []
    if args.bulk_slice_ms is not None:
        cmd += ["--bulk_slice_ms" if script is None else "--bulk-slice-ms", str(args.bulk_slice_ms)]
    if args.stream_lane is not None and script is None:  # not given: the server's default (a lane on a GPU)
        cmd += ["--stream_lane", args.stream_lane]
    elif args.stream_lane == "true":  # (a free decode has nothing to put on a lane: refused in main)
        cmd += ["--stream-lane"]
    log = open(Path(args.out or "load_serve.json").with_suffix(".server.log"), "w")  # noqa: SIM115 - the server's
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=log)
    line = proc.stdout.readline()
    found = re.search(r"listening on (http://[\d.:]+)", line)
    if not found:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r} (its log: {log.name})")
    return proc, found.group(1)


def total_clients(args: argparse.Namespace) -> int:
    return args.clients + args.streams + args.paced


def load(url: str, args: argparse.Namespace) -> tuple[list[dict], float, dict]:
    """Every client's results, the wall time (from the clients' start, every client process up, to the last
    answer) and the client processes' own delays (``serve_clients.ClientWatch``: the worst, or their sum), the
    clients spread over ``--client-processes``."""
    plan = [("whole", i) for i in range(args.clients)]
    plan += [("stream", args.clients + i) for i in range(args.streams)]
    plan += [("paced", args.clients + args.streams + i) for i in range(args.paced)]
    keep = max(1, -(-args.check // max(1, len(plan))))
    common = (args.seconds, tuple(args.frames), args.chunk_frames, args.seed, keep)
    if args.client_processes <= 1:
        done, start, end, watched = timed_clients(url, plan, *common)
        return done, end - start, client_delays([watched])
    context = multiprocessing.get_context("spawn")
    results, barrier = context.Queue(), context.Barrier(args.client_processes)
    shares = [plan[i :: args.client_processes] for i in range(args.client_processes)]
    procs = [context.Process(target=client_process, args=(url, share, *common, results, barrier)) for share in shares]
    for proc in procs:
        proc.start()
    parts = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    done = [d for part in parts for d in part[0]]
    return done, max(p[2] for p in parts) - min(p[1] for p in parts), client_delays([p[3] for p in parts])


def client_delays(watched: list[dict]) -> dict:
    """The client processes' own delays as one set of figures: each maximum over processes, each count summed."""
    return {f"client_{k}": (max if k.endswith("max") else sum)(w[k] for w in watched) for k in watched[0]}


def offline_engine(args: argparse.Namespace):
    """The offline engine over the server's model (same preset, seed, device and precision), warmed up."""
    import torch

    from omni_lightning import Code2WavModule
    from omni_lightning.engine.engine import DecodeEngine

    torch.manual_seed(0)
    model = Code2WavModule(config=args.preset, random_weights=True).model.eval()
    dtype = torch.bfloat16 if args.precision == "bf16-true" else torch.float32
    model = model.to(args.device, dtype)
    engine = DecodeEngine(model, max_rows=args.offline_batch, gpu_memory_utilization=args.share)
    if args.sim_device:  # on its own simulated device, planned as on a GPU (its CUDA graphs: up to 256 frames)
        simulate(engine, device_from(args, graph_frames=256), args.offline_frames)
    offline(engine, [np.zeros((16, 8), np.int64)], args.offline_batch)  # warm, as the server's warm-up
    return engine


def offline(engine, requests: list[np.ndarray], batch: int) -> tuple[float, list[np.ndarray]]:
    """``requests`` decoded by ``engine`` in right-padded batches of ``batch``: (seconds, each one's audio)."""
    import torch

    outs, device = [], engine.device
    start = time.perf_counter()
    for i in range(0, len(requests), batch):
        chunk = [torch.from_numpy(c) for c in requests[i : i + batch]]
        lengths = [c.shape[1] for c in chunk]
        padded = torch.zeros((len(chunk), 16, max(lengths)), dtype=torch.long)
        for j, c in enumerate(chunk):
            padded[j, :, : c.shape[1]] = c
        with torch.no_grad():
            outs += [o[0].float().cpu().numpy() for o in engine.decode(padded.to(device), lengths)]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if getattr(engine, "sim", None) is not None:
        engine.sim.wait()
    return time.perf_counter() - start, outs


def offline_rate(engine, args: argparse.Namespace) -> float:
    """Audio seconds per second of the offline engine on requests of the load's lengths, sorted by length."""
    rng = np.random.default_rng(args.seed)
    requests = [rng.integers(0, 2048, (16, rng.integers(args.frames[0], args.frames[1] + 1)))
                for _ in range(args.offline_requests)]  # fmt: skip
    requests.sort(key=lambda r: r.shape[1])
    seconds, _ = offline(engine, requests, args.offline_batch)
    return sum(r.shape[1] * 1920 - 555 for r in requests) / 24000 / seconds


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)", text, re.M))


DECODE_METRICS = ("omni_step_seconds_sum", "omni_step_seconds_count", "omni_stream_step_seconds_sum",
                  "omni_stream_step_seconds_count", "omni_new_shapes_total",
                  "omni_new_shape_seconds_total", "omni_forwards_total", "omni_frames_total",
                  "omni_computed_frames_total", "omni_stream_chunk_seconds_sum",
                  "omni_stream_chunk_seconds_count", "omni_stream_first_chunk_seconds_sum",
                  "omni_stream_first_chunk_seconds_count", "omni_stream_chunk_front_seconds_sum",
                  "omni_stream_chunk_front_seconds_count", "omni_stream_first_chunk_front_seconds_sum",
                  "omni_stream_first_chunk_front_seconds_count", "omni_stream_chunk_to_engine_seconds_sum",
                  "omni_stream_chunk_to_engine_seconds_count", "omni_stream_audio_to_front_seconds_sum",
                  "omni_stream_audio_to_front_seconds_count")  # fmt: skip
TAIL_MS = (20, 50)  # a first chunk's tail: how many passed these, in the loop, the fronts, at the client (buckets')
WHERE = (("in_loop", ""), ("at_front", "front_"))  # a figure's name part, and its metrics' (decode loop, fronts)


def decode_metrics(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{url}/metrics").text
    # the first chunks at or under each tail bound, in the decode loop and in the fronts
    first_under = {f"first_chunk_{at}under_{ms}ms": bucket(text, f"omni_stream_first_chunk_{at}seconds", ms / 1000)
                   for ms in TAIL_MS for _, at in WHERE}  # fmt: skip
    return {**{name: metric(text, name) for name in DECODE_METRICS}, **first_under}


def bucket(text: str, name: str, le: float) -> float:
    """A histogram's count at or under ``le`` seconds (its bucket of that bound, summed over processes)."""
    found = re.findall(rf'^{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)', text, re.M)
    return sum(float(v) for bound, v in found if bound != "+Inf" and abs(float(bound) - le) < 1e-9)


def ms_mean(seconds: float, count: float) -> float | None:
    return round(1000 * seconds / count, 2) if count else None


def histogram_ms_mean(steps: dict[str, float], name: str) -> float | None:
    return ms_mean(steps[f"{name}_sum"], steps[f"{name}_count"])


def decode_figures(steps: dict[str, float], wall: float) -> dict:
    """The decode loop's share of the wall time, and its mean decode of the streams' chunks and of bulk."""
    streams_n, streams_s = steps["omni_stream_step_seconds_count"], steps["omni_stream_step_seconds_sum"]
    bulk_n, bulk_s = steps["omni_step_seconds_count"] - streams_n, steps["omni_step_seconds_sum"] - streams_s
    return {
        "decode_loop_share": round(steps["omni_step_seconds_sum"] / wall, 3),
        # the bulk decodes alone: with --stream-lane the streams' decodes overlap them (the sum may pass 1)
        "bulk_decode_share": round(bulk_s / wall, 3),
        "stream_decodes": int(streams_n), "bulk_decodes": int(bulk_n),
        "stream_decode_ms_mean": ms_mean(streams_s, streams_n),
        "bulk_decode_ms_mean": ms_mean(bulk_s, bulk_n),
        # a stream chunk inside the server's decode loop (arrival to audio handed out), and in the fronts (its
        # message read to its audio sent: the loop's time, the hand-offs between processes and the front's own
        # work); the client's figures add the sockets and the client
        **{f"stream_chunk_{where}_ms_mean": histogram_ms_mean(steps, f"omni_stream_chunk_{at}seconds")
           for where, at in WHERE},
        # of the front's part, the two hand-offs between a front and its engine (each timed by its receiver;
        # none with --front-processes 0): a chunk's on its way in, its audio message's on its way back
        "stream_chunk_to_engine_ms_mean": histogram_ms_mean(steps, "omni_stream_chunk_to_engine_seconds"),
        "stream_audio_to_front_ms_mean": histogram_ms_mean(steps, "omni_stream_audio_to_front_seconds"),
        # a stream's first chunk alone (its first audio's share) and how many passed 20 and 50 ms, in the loop
        # and in the fronts: against the clients' first audio over the same (``figures``), where its tail waits
        **{f"stream_first_chunk_{where}_ms_mean": histogram_ms_mean(steps, f"omni_stream_first_chunk_{at}seconds")
           for where, at in WHERE},
        **{f"stream_first_chunks_{where}_over_{ms}ms":
           int(steps[f"omni_stream_first_chunk_{at}seconds_count"] - steps[f"first_chunk_{at}under_{ms}ms"])
           for where, at in WHERE for ms in TAIL_MS},
        # shapes first run during the load (not warmed): each a capture or new plans in the clients' way
        "new_shapes": int(steps["omni_new_shapes_total"]),
        "new_shape_s": round(steps["omni_new_shape_seconds_total"], 3),
        # the engine's forwards: their mean size and the share of their frames that was padding
        "forwards": int(forwards := steps["omni_forwards_total"]),
        "frames_per_forward": round(steps["omni_computed_frames_total"] / forwards, 1) if forwards else None,
        "padding_share": round(1 - steps["omni_frames_total"] / steps["omni_computed_frames_total"], 3)
        if steps["omni_computed_frames_total"] else None,
    }  # fmt: skip


def sim_busy(steps: dict[str, float], wall: float, args: argparse.Namespace) -> dict:
    """--sim-device: the share of the wall time the simulated device was busy (its forwards' booked time), and
    the share it computed the requests' own frames; the rest of the served / offline ratio is the host's."""
    busy = (steps["omni_forwards_total"] * args.forward_us + steps["omni_computed_frames_total"] * args.frame_us) / 1e6
    return {
        "sim_device_busy_share": round(busy / wall, 3),
        "sim_device_useful_share": round(steps["omni_frames_total"] * args.frame_us / 1e6 / wall, 3),
    }


def figures(done: list[dict], wall: float, rates: list[float], steps: dict, args: argparse.Namespace) -> dict:
    """The report's figures from the clients' results."""
    lost = [d for d in done if d["samples"] is None or d["samples"] != d["codes"].shape[1] * 1920 - 555]
    lost_ids = {id(d) for d in lost}  # (by identity: a result holds arrays, which == compares elementwise)
    audio_s = sum(d["samples"] for d in done if id(d) not in lost_ids) / 24000
    firsts = {kind: sorted(d["first"] * 1000 for d in done if d["kind"] == kind and d["first"] is not None)
              for kind in ("whole", "stream", "paced")}  # fmt: skip
    paced = [d for d in done if d["kind"] == "paced" and id(d) not in lost_ids]
    chunks = [x * 1000 for d in paced for x in d["latencies"]]
    rtf = sorted(float(np.mean(d["latencies"])) / d["chunk_s"] for d in paced if d["latencies"])
    offline_s = max(rates) if rates else None
    return {
        "requests": len(done), "by_kind": {k: sum(d["kind"] == k for d in done) for k in firsts},
        "wall_s": round(wall, 2), "requests_per_s": round(len(done) / wall, 2),
        "audio_s_per_s": round(audio_s / wall, 2),
        "offline_audio_s_per_s": round(offline_s, 2) if offline_s else None,
        "offline_before_after": [round(r, 2) for r in rates],
        "ratio_to_offline": round(audio_s / wall / offline_s, 3) if offline_s else None,
        **{f"first_audio_ms_{k}_p{q}": percentile(v, q) for k, v in firsts.items() if v for q in (50, 99)},
        **{f"first_audio_streams_over_{ms}ms": sum(f > ms for k in ("stream", "paced") for f in firsts[k])
           for ms in TAIL_MS},
        "first_audio_ms_streams_slowest": [round(f, 1) for f in sorted(firsts["stream"] + firsts["paced"])[:-9:-1]],
        "chunk_latency_ms_p50": percentile(chunks, 50), "chunk_latency_ms_p99": percentile(chunks, 99),
        "paced_rtf_p50": round(rtf[len(rtf) // 2], 3) if rtf else None,
        "paced_rtf_max": round(rtf[-1], 3) if rtf else None,
        "paced_keeping_up": round(sum(max(d["latencies"]) < d["chunk_s"] for d in paced) / len(paced), 3)
        if paced else None,
        **decode_figures(steps, wall),
        **(sim_busy(steps, wall, args) if args.sim_device else {}),
        "lost": len(lost), "errors": sorted({d.get("error", "short") for d in lost})[:5],
    }  # fmt: skip


def check(engine, done: list[dict], args: argparse.Namespace) -> dict:
    """The kept answers against the offline engine's decode of the same codes."""
    kept = [d for d in done if d["audio"] is not None][: args.check]
    _, reference = offline(engine, [d["codes"] for d in kept], args.offline_batch)
    worst_abs, worst_rel, wrong = 0.0, 0.0, 0
    for d, want in zip(kept, reference):
        got = d["audio"]
        diff = float(np.abs(got - want).max()) if got.shape == want.shape else float("inf")
        rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12)) if got.shape == want.shape else 1.0
        worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, rel)
        wrong += diff > 1e-5 if args.precision == "32-true" else rel > 0.1
    return {"checked": len(kept), "wrong": wrong, "max_abs_diff": worst_abs, "max_rel_l2": round(worst_rel, 5)}


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    if args.client_processes is None:
        args.client_processes = max(1, min(8, (os.cpu_count() or 2) // 2, total_clients(args)))
    if args.client_processes < 1:
        p.error(f"--client-processes must be >= 1, got {args.client_processes}")
    if args.lane_sms is not None and (args.free_decode or args.sim_device):
        p.error(f"--lane-sms {args.lane_sms} is a GPU server's: the free and simulated decodes have no SMs to keep")
    if args.free_decode and args.stream_lane == "true":
        p.error("--stream-lane with --free-decode: a free decode has no device to share")
    engine = None if args.free_decode else offline_engine(args)
    rates = [] if engine is None else [offline_rate(engine, args)]  # before and after: the machine may be shared
    proc, url = start_server(args)
    try:
        import httpx

        while httpx.get(f"{url}/health").status_code != 200:
            time.sleep(0.1)
        before = decode_metrics(url)
        done, wall, delays = load(url, args)
        steps = {k: v - before[k] for k, v in decode_metrics(url).items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    if engine is not None:
        rates.append(offline_rate(engine, args))
    result = {**figures(done, wall, rates, steps, args), **delays}
    checked = engine is not None and not args.sim_device  # a simulated device decodes noise
    result.update(check(engine, done, args) if checked else {"checked": 0, "wrong": 0})
    result["meta"] = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
                      "commit": _commit(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                      "gpu": _gpu(), "args": vars(args)}  # fmt: skip
    rows = [(k, v) for k, v in result.items() if k not in ("meta", "errors", "offline_before_after")]
    print("| figure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows))
    if result["errors"]:
        print("errors:", result["errors"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or None


if __name__ == "__main__":
    main()
