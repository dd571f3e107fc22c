"""Whole-budget CUDA graphs under a memory cap: the out-of-memory fallback, and the decode after it.

    python scripts/profiling/repro_capped_graphs.py --share 0.03                 # a GPU: the old setting, then eager
    python scripts/profiling/repro_capped_graphs.py --share 0.03 --sanitize      # the same under compute-sanitizer
    python scripts/profiling/repro_capped_graphs.py --device cpu --preset tiny --batches 1 --requests 4   # smoke

Each mode runs in a process of its own (a cap applies to a process), over the first ``--batches``
batches of 32 of the 2-30 s job, decoded twice by one ``DecodeEngine`` (the second pass is "the run
after the fallback"), each checked request against its solo decode:
- ``forced``: what crashed on an H100 (``unspecified launch failure`` after the fallback): whole-budget
  graphs under the cap at the frame budget eager forwards get (``--frames``, default 512 with graphs
  of up to 64 frames: a 0.03 share of an H100), so their pool and the eager forwards overflow the cap.
  The engine is not told of the cap (the process is capped), so any version of it runs this mode;
- ``whole``: whole-budget graphs under the cap as the engine sizes them (``whole_graphs=True``: half
  the frames);
- ``eager``: the default (whole-budget forwards eager under a cap).
Per mode: x real time of the second pass, out-of-memory fallbacks, failed captures, and the live
blocks of the graph pools after the first pass with the allocation's innermost frames
(``torch.cuda.memory._record_memory_history``, C++ frames included): what a dropped pool held.
``--sanitize`` runs each mode under ``compute-sanitizer --tool memcheck`` (slow: use few batches), its
report saved beside the JSON. On a CPU no mode captures anything (the smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: workload.py, shared by every group
from workload import audio_seconds, device_model, mixed_job, rel_l2, save

from omni_lightning import CodesDataModule, DecodeEngine

MODES = ("forced", "whole", "eager")


def batches(config, args: argparse.Namespace) -> list[tuple[torch.Tensor, list[int]]]:
    data = CodesDataModule(predict=mixed_job(config, args.requests, 2.0, 30.0, 0), batch_size=32)
    data.setup("predict")
    loader = data.predict_dataloader()
    loader = loader[0] if isinstance(loader, list) else loader
    return [(b["codes"], b["lengths"].tolist()) for _, b in zip(range(args.batches), loader)]


def pool_blocks(device: torch.device) -> list[dict]:
    """Live blocks of segments outside the default pool, each with its innermost recorded frames."""
    if device.type != "cuda":
        return []
    out = []
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0):
            continue
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{f.get('name', '?')} ({Path(f.get('filename', '?')).name})" for f in block.get("frames", [])]
            out.append({"pool": list(seg["segment_pool_id"]), "bytes": block["size"], "frames": frames[:12]})
    return out


def run_mode(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    model = device_model(args.preset, device)
    jobs = batches(model.config, args)
    share = args.share if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="all")
        torch.cuda.set_per_process_memory_fraction(args.share)
    kw = {"gpu_memory_utilization": share}
    if args.mode == "forced":  # an engine that knows of no cap graphs its whole-budget forwards
        kw = {"frames_per_forward": args.frames, "graph_frames": args.graph_frames}
    elif args.mode == "whole":
        kw.update(whole_graphs=True)
    engine = DecodeEngine(model, **kw)
    res: dict = {"mode": args.mode, "frames_per_forward": engine.frames_per_forward}
    outs: dict = {}
    with torch.inference_mode():
        for name in ("first", "second"):
            start = time.perf_counter()
            outs[name] = [engine.decode(codes.to(device), lengths) for codes, lengths in jobs]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            res[name] = {"seconds": seconds, "stats": engine.stats()}
            if name == "first":
                res["pool_blocks_after_first"] = pool_blocks(device)
        audio = audio_seconds(model.config, [n for _, lengths in jobs for n in lengths])
        res["x_realtime"] = audio / res["second"]["seconds"]
        errors = []
        for (codes, lengths), wavs in zip(jobs, outs["second"]):
            for i in range(min(args.check, len(lengths))):
                alone = model(codes[i : i + 1, :, : lengths[i]].to(device))[0].float()
                errors.append(rel_l2(wavs[i].float(), alone))
        res["max_rel_l2"] = max(errors) if errors else None
    if device.type == "cuda":
        torch.cuda.memory._record_memory_history(enabled=None)
    return res


def child(args: argparse.Namespace, mode: str, out: Path) -> dict:
    """``mode`` in a fresh process (under compute-sanitizer with ``--sanitize``): its result, or how it died."""
    cmd = [sys.executable, __file__, "--mode", mode, "--out", str(out), *forwarded(args)]
    if args.sanitize:
        tool = shutil.which("compute-sanitizer")
        if tool is None:
            return {"mode": mode, "error": "compute-sanitizer not found"}
        log = out.with_suffix(".sanitizer.txt")
        cmd = [tool, "--tool", "memcheck", "--print-limit", "20", "--log-file", str(log), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode or not out.exists():
        return {"mode": mode, "returncode": proc.returncode, "error": proc.stderr[-3000:]}
    return json.loads(out.read_text())


def forwarded(args: argparse.Namespace) -> list[str]:
    keep = ("preset", "device", "share", "requests", "batches", "frames", "graph_frames", "check")
    return [x for k in keep for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--share", type=float, default=0.03)
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--batches", type=int, default=4, help="batches of 32 decoded per pass")
    parser.add_argument("--frames", type=int, default=512, help="forced mode: frames per forward")
    parser.add_argument("--graph-frames", type=int, default=64, help="forced mode: longest short graph")
    parser.add_argument("--check", type=int, default=2, help="requests per batch checked against solo decodes")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--mode", choices=MODES, default=None, help="(internal) run one mode here")
    parser.add_argument("--sanitize", action="store_true")
    parser.add_argument("--out", default="repro_capped_graphs.json")
    return parser


def main() -> None:
    args = parser().parse_args()
    if args.mode is not None:
        Path(args.out).write_text(json.dumps(run_mode(args), default=str))
        return
    out = Path(args.out)
    res = {"modes": {m: child(args, m, out.with_name(f"{out.stem}.{m}.json")) for m in args.modes}}
    save(out, res, args)
    print("| mode | frames | x real time | fallbacks | failed captures | max rel L2 | graph-pool blocks | error |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in res["modes"].items():
        stats = r.get("second", {}).get("stats", {})
        x, rel = r.get("x_realtime"), r.get("max_rel_l2")
        print(
            f"| {mode} | {r.get('frames_per_forward', '')} | {'' if x is None else f'{x:,.0f}'} | "
            f"{stats.get('shrinks', '')} | {stats.get('failures', '')} | {'' if rel is None else f'{rel:.1e}'} | "
            f"{len(r.get('pool_blocks_after_first', []))} | {r.get('error', '').strip()[-200:]} |"
        )


if __name__ == "__main__":
    main()
