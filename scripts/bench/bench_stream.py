"""Streaming decode: time to first audio, steady-state throughput, fidelity, state per stream.

    python scripts/bench/bench_stream.py --preset tiny --device cpu --streams 4 --steps 3     # this machine
    python scripts/bench/bench_stream.py --preset qwen3-omni --device cuda --out bench_stream.json   # a GPU

Compares ``StreamingDecoder`` (stateful, exact) with what serving stacks do, re-decoding each
chunk with ``--context`` frames of left context (vLLM-Omni: 25; sglang-omni: 10-frame chunks, 25 of
context), eager and as a CUDA graph per shape, same weights, same GPU, same run:

- **time to first audio**: a new stream's 1-frame first chunk, from the call that opens the stream
  to its samples on the device (synchronized), median of ``--ttfa-trials``; its shape's CUDA graph
  captured before (``warmup``), no other stream running. Split (``first_audio_split``): ``open()``
  alone; the step alone (``stream_step``: the stream opened before the clock starts), and its host
  share (the step's call returning, every launch queued, not synchronized); the device's share (the
  first chunk's graph replayed alone, and the re-decode's, ``*_graph_only``). With ``--profile``, a
  table of one such first chunk (host and device time by op);
- **steady state**: ``--streams`` streams past the attention window, each advancing by ``--chunk``
  frames per step; x real time = audio seconds per wall second over ``--steps`` steps, host work
  included, both pipelined (no synchronization between steps) and synchronized after every step;
  "graph only" replays the step's CUDA graph alone (the device's share);
- **fidelity** (rel. L2 against an fp32 full decode with TF32 off, same codes): streaming in
  ``--dtype``, the batch path's ``decode`` in ``--dtype``, and the re-decode baseline in fp32
  (what a too-short context costs) and ``--dtype``; plus the fp32 streaming max abs difference.
Prints a table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from redecode import Redecode
from workload import rel_l2, sync, timed

from omni_lightning import Code2Wav, StreamingDecoder, randomize_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def first_audio(decoder: StreamingDecoder, codes: torch.Tensor) -> dict:
    """A new stream's first chunk: opened, stepped (left open: the caller closes it, off the clock)."""
    sid = decoder.open()
    return decoder.step({sid: codes})


def first_audio_split(decoder: StreamingDecoder, codes: torch.Tensor, device: torch.device) -> dict[str, float]:
    """Seconds of a new stream's first chunk's pieces: ``open()``, the step (to its samples on the device),
    the step's host share (its call returning, launches queued, nothing waited for)."""
    opened: list = []
    split = {"stream_open": timed(lambda: opened.append(decoder.open()), device)}
    split["stream_step"] = timed(lambda: decoder.step({opened[0]: codes}), device)
    decoder.close(opened.pop())
    sid = decoder.open()
    sync(device)
    start = time.perf_counter()
    decoder.step({sid: codes})
    split["stream_step_host"] = time.perf_counter() - start
    sync(device)
    decoder.close(sid)
    return split


def graph_only(replay: Callable[[], object], device: torch.device, n: int = 20) -> float:
    """Seconds of one replay of a captured graph alone (the device's share of its forward)."""
    replay()
    return timed(lambda: [replay() for _ in range(n)], device) / n


def profile(stream_step: Callable[[int, int], dict], start: int, args: argparse.Namespace) -> None:
    """Host and kernel time of two steps by op, to stderr (where the time goes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            stream_step(start, start + args.chunk)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
    print(table, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.backends.cudnn.benchmark = device.type == "cuda" and not args.no_cudnn_benchmark
    ref_model = randomize_weights(Code2Wav(args.preset), seed=0).eval().to(device)
    model = Code2Wav(ref_model.config).to(device=device, dtype=dtype).eval()
    model.load_state_dict(ref_model.state_dict())
    cfg = model.config
    up, q, sr = cfg.total_upsample, cfg.num_quantizers, cfg.sample_rate
    gen = torch.Generator().manual_seed(1)

    def codes_of(*shape: int) -> torch.Tensor:
        return torch.randint(0, cfg.codebook_size, shape, generator=gen)

    res: dict = {"preset": args.preset, "dtype": args.dtype, "device": str(device)}
    graphs = not args.no_graphs and device.type == "cuda"
    decoder = StreamingDecoder(model, max_streams=args.streams, cuda_graphs=graphs)
    res["state_bytes_per_stream"] = decoder.state_bytes_per_stream
    res["state_pool_bytes"] = sum(t.numel() * t.element_size() for t in decoder.engine.state.tensors.values())
    res["capture_s"] = decoder.warmup(chunk_sizes=(1, args.chunk), batch_sizes=(1, args.streams))
    res["graphs"] = len(decoder.engine.graphs.graphs) if decoder.engine.graphs else 0
    print(f"  {res['graphs']} graphs captured in {res['capture_s']:.1f} s", file=sys.stderr, flush=True)
    eager = StreamingDecoder(model, max_streams=args.streams, cuda_graphs=False) if graphs else None
    baselines = {"redecode_eager": Redecode(model, args.context, graphs=False)}
    if device.type == "cuda":
        baselines["redecode_graph"] = Redecode(model, args.context, graphs=True)

    # --- time to first audio: a new stream, a 1-frame first chunk -------------------------------
    first = [codes_of(q, 1) for _ in range(args.ttfa_trials)]
    streamers = {"stream": decoder, **({"stream_eager": eager} if eager else {})}
    split = ("stream_open", "stream_step", "stream_step_host")
    ttfa: dict[str, list[float]] = {k: [] for k in [*streamers, *split, *baselines]}
    with torch.no_grad():
        for base in baselines.values():  # warm-up (autotune, capture)
            base.chunk(first[0][None].to(device), 0, 1)
        if eager:
            list(eager.stream([first[0]]))
        for codes in first:
            for name, dec in streamers.items():
                ttfa[name].append(timed(lambda c=codes, d=dec: first_audio(d, c), device))
                dec.close(dec.streams[-1])
            for key, seconds in first_audio_split(decoder, codes, device).items():
                ttfa[key].append(seconds)
            for name, base in baselines.items():
                ttfa[name].append(timed(lambda c=codes, b=base: b.chunk(c[None].to(device), 0, 1), device))
        if args.profile and device.type == "cuda":
            profile(lambda a, b: first_audio(decoder, first[0]), 0, args)  # two new streams' first chunks
            for sid in decoder.streams:
                decoder.close(sid)
        first_graph = decoder.engine.graphs.graphs.get((1, 1)) if graphs else None
        if first_graph is not None:  # the device's share of a first chunk, and of the re-decode's
            first_graph.rows.fill_(decoder.engine.scratch)
            first_graph.valid.zero_()
            ttfa["stream_graph_only"] = [graph_only(first_graph.replay, device)]
            redecode = baselines["redecode_graph"]._graphs.get((1, q, 1))
            ttfa["redecode_graph_only"] = [graph_only(redecode[0].replay, device)] if redecode else []
    res["ttfa_ms"] = {k: 1e3 * statistics.median(v) for k, v in ttfa.items() if v}
    res["ttfa_p90_ms"] = {k: 1e3 * sorted(v)[int(0.9 * (len(v) - 1))] for k, v in ttfa.items() if v}
    print(f"  ttfa {res['ttfa_ms']}", file=sys.stderr, flush=True)

    # --- steady state: many streams past the window, --chunk frames each per step ---------------
    ramp = 1 + args.chunk * -(-cfg.sliding_window // args.chunk)  # 1 frame, then chunks past the window
    total = ramp + args.chunk * args.steps
    codes = codes_of(args.streams, q, total)
    step_audio = args.streams * args.chunk * up / sr
    starts = [ramp + k * args.chunk for k in range(args.steps)]
    half = args.steps // 2
    steady: dict[str, float] = {}
    with torch.no_grad():
        for name, dec in streamers.items():
            sids = [dec.open() for _ in range(args.streams)]

            def stream_step(a: int, b: int, d: StreamingDecoder = dec, sids: list = sids) -> dict:
                return d.step({sid: codes[i, :, a:b] for i, sid in enumerate(sids)})

            stream_step(0, 1)
            for a in range(1, ramp, args.chunk):
                stream_step(a, a + args.chunk)
            steady[f"{name}_pipelined"] = (
                timed(lambda f=stream_step: [f(a, a + args.chunk) for a in starts[:half]], device) / half
            )
            steady[f"{name}_sync"] = statistics.median(
                timed(lambda a=a, f=stream_step: f(a, a + args.chunk), device) for a in starts[half:]
            )
            if name == "stream_eager" and args.profile:
                profile(stream_step, starts[-1], args)
            for sid in sids:
                dec.close(sid)
        on_device = codes.to(device)
        for name, base in baselines.items():
            base.chunk(on_device, ramp, ramp + args.chunk)  # warm-up (autotune, capture)
            steady[f"{name}_pipelined"] = (
                timed(lambda b=base: [b.chunk(on_device, a, a + args.chunk) for a in starts[:half]], device) / half
            )
            steady[f"{name}_sync"] = statistics.median(
                timed(lambda a=a, b=base: b.chunk(on_device, a, a + args.chunk), device) for a in starts[half:]
            )
        rows = decoder.engine.planner.row_bucket(args.streams)
        graph = decoder.engine.graphs.graphs.get((rows, args.chunk)) if graphs else None
        if graph is not None:  # the device's share: replays alone, every row on the scratch slot
            graph.rows.fill_(decoder.engine.scratch)
            graph.valid.zero_()
            steady["stream_graph_only"] = timed(lambda: [graph.replay() for _ in range(args.steps)], device)
            steady["stream_graph_only"] /= args.steps
    res["steady_step_ms"] = {k: 1e3 * v for k, v in steady.items()}
    res["steady_x_realtime"] = {k: step_audio / v for k, v in steady.items()}
    print(f"  steady x real time {res['steady_x_realtime']}", file=sys.stderr, flush=True)

    # --- fidelity against an fp32 full decode (TF32 off) -----------------------------------------
    frames = 1 + args.chunk * ((args.fidelity_frames - 1) // args.chunk)  # chunks the graphs already cover
    req = codes_of(args.fidelity_requests, q, frames).to(device)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    fp32_stream = StreamingDecoder(ref_model, max_streams=1, cuda_graphs=False)
    errors: dict[str, list[float]] = {"stream": [], "decode": [], "redecode_fp32": [], "redecode": []}
    exact = []
    with torch.no_grad():
        for i in range(args.fidelity_requests):
            ref = ref_model.decode(req[i : i + 1])[0]
            sizes = [1] + [args.chunk] * ((frames - 1) // args.chunk)
            bounds = [(sum(sizes[:k]), sum(sizes[: k + 1])) for k in range(len(sizes))]
            pieces = list(decoder.stream(req[i, :, a:b] for a, b in bounds))
            errors["stream"].append(rel_l2(torch.cat(pieces, -1), ref))
            errors["decode"].append(rel_l2(model.decode(req[i : i + 1])[0], ref))
            for key, m in (("redecode_fp32", ref_model), ("redecode", model)):
                base = Redecode(m, args.context, graphs=False)
                wav = torch.cat([base.chunk(req[i : i + 1], a, b)[0] for a, b in bounds], -1)
                errors[key].append(rel_l2(wav, ref))
            streamed32 = torch.cat(list(fp32_stream.stream(req[i, :, a:b] for a, b in bounds)), -1)
            exact.append((streamed32 - ref).abs().max().item())
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    res["fidelity_rel_l2"] = {k: statistics.mean(v) for k, v in errors.items()}
    res["fp32_stream_max_abs_diff"] = max(exact)
    res["fidelity_frames"] = frames
    if device.type == "cuda":
        res["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return res


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=10)
    parser.add_argument("--context", type=int, default=25, help="left context of the re-decode baseline")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ttfa-trials", type=int, default=30)
    parser.add_argument("--fidelity-frames", type=int, default=125)
    parser.add_argument("--fidelity-requests", type=int, default=4)
    parser.add_argument("--no-graphs", action="store_true", help="streaming without CUDA graphs")
    parser.add_argument("--no-cudnn-benchmark", action="store_true")
    parser.add_argument("--profile", action="store_true", help="kernel table of two eager streaming steps")
    parser.add_argument("--out", default="bench_stream.json")
    return parser


def main() -> None:
    args = parser().parse_args()
    res = run(args)
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine()
    res["meta"] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": machine,
        "threads": torch.get_num_threads(),
        "args": vars(args),
    }
    Path(args.out).write_text(json.dumps(res, indent=2))
    names = [
        ("stream", "streaming (ours)"),
        ("stream_eager", "streaming (ours), eager"),
        ("redecode_eager", f"re-decode, {args.context} ctx, eager"),
        ("redecode_graph", f"re-decode, {args.context} ctx, CUDA graphs"),
    ]
    print(
        f"\n{args.preset} {args.dtype} on {machine}, torch {torch.__version__}; "
        f"{args.streams} streams x {args.chunk}-frame chunks"
    )
    print("| decoder | first audio, median (p90) ms | steady x real time, pipelined | synced each step | step ms |")
    print("|---|---|---|---|---|")
    for key, label in names:
        if key not in res["ttfa_ms"]:
            continue
        x, ms = res["steady_x_realtime"], res["steady_step_ms"]
        print(
            f"| {label} | {res['ttfa_ms'][key]:.2f} ({res['ttfa_p90_ms'][key]:.2f}) | {x[key + '_pipelined']:,.0f} "
            f"| {x[key + '_sync']:,.0f} | {ms[key + '_pipelined']:.2f} |"
        )
    t, nan = res["ttfa_ms"], float("nan")
    print(f"first audio split (median ms): open() {t['stream_open']:.3f}, the step {t['stream_step']:.2f} (host "
          f"{t['stream_step_host']:.2f}); graphs alone: the first chunk's {t.get('stream_graph_only', nan):.2f}, "
          f"the re-decode's {t.get('redecode_graph_only', nan):.2f}")  # fmt: skip
    if "stream_graph_only" in res["steady_x_realtime"]:
        print(
            f"| streaming, graph replay only | | {res['steady_x_realtime']['stream_graph_only']:,.0f} | | "
            f"{res['steady_step_ms']['stream_graph_only']:.2f} |"
        )
    f = res["fidelity_rel_l2"]
    print(
        f"\nfidelity vs fp32 decode ({res['fidelity_frames']} frames), rel L2: streaming {args.dtype} "
        f"{f['stream']:.2e}, decode {args.dtype} {f['decode']:.2e}, re-decode fp32 {f['redecode_fp32']:.2e}, "
        f"re-decode {args.dtype} {f['redecode']:.2e}; fp32 streaming max abs diff "
        f"{res['fp32_stream_max_abs_diff']:.1e}"
    )
    print(f"state per stream: {res['state_bytes_per_stream']:,} bytes; graphs captured in {res['capture_s']:.1f} s")


if __name__ == "__main__":
    main()
