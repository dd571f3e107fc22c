"""The real job, timed phase by phase: ``omni-lightning predict`` from a folder of code files to audio files.

    python scripts/bench/bench_cli.py --files 12 --model.config tiny                           # CPU
    python scripts/bench/bench_cli.py --files 1500 --model.config qwen3-omni --trainer.precision bf16-true \\
        --trainer.accelerator gpu --data.batch_size 32                                 # a GPU

Options this script does not know go to the command line unchanged (after ``--config
configs/predict.yaml``). The job: ``--files`` ``.npy`` files of uint16 codes ``[16, T]``, 2-30 s long
(``--seed``), decoded with seeded random weights saved once as a checkpoint (``--model.checkpoint``),
or ``--random-weights`` (``--model.random_weights true``).

What runs, each in a fresh process:
  cli      the command, with ``--timings``: start-up to the first batch, decode (first batch to the
           last batch's end), writes (queue waits, busy time, drain), end (to process exit), wall;
           ``loader waits``: time the loop spent fetching batches.
  noop     the same command again, every request already done: wall time (it ends before torch loads).
  inproc   ``trainer.predict`` of the same job built by the same parser (``run=False``), no writer:
           cold, warm, then warm with the command's ``WaveformWriter`` (what writing costs the decode).
  loader   the predict dataloader alone, iterated once after the warm run: how fast loading could feed
           the engine.
Ratios: CLI decode phase speed / in-process (cold and warm). Prints a table; writes JSON (``--out``).
What it does not do: compare with transformers (``bench_forward.py``) or time fit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: child.py, shared by every group
from child import cli, package_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "predict.yaml"
FRAME_RATE = 12.5


def make_job(folder: Path, files: int, seed: int, seconds: tuple[float, float]) -> list[int]:
    """``files`` code files of random lengths; returns their frame counts."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    lengths = []
    for i in range(files):
        frames = max(1, round(rng.uniform(*seconds) * FRAME_RATE))
        np.save(folder / f"req{i:05d}.npy", rng.integers(0, 2048, (16, frames)).astype(np.uint16))
        lengths.append(frames)
    return lengths


def make_checkpoint(folder: Path, preset: str, seed: int) -> Path:
    """A standalone checkpoint of seeded random weights (kept between runs of the same preset)."""
    stamp = folder / "bench_preset.txt"
    if stamp.is_file() and stamp.read_text() == f"{preset} {seed}":
        return folder
    from omni_lightning import Code2Wav, randomize_weights

    randomize_weights(Code2Wav(preset), seed=seed).save_pretrained(folder)
    stamp.write_text(f"{preset} {seed}")
    return folder


def option(args: list[str], name: str, default: str) -> str:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


def run_cli(args: list[str], timings: Path | None) -> dict[str, Any]:
    command = cli(*args, *(["--timings", str(timings)] if timings else []))
    launched = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=package_env())
    exited = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = {"launched": launched, "exited": exited, "wall_s": exited - launched, "stdout": proc.stdout[-2000:]}
    if timings is not None:
        result["timings"] = json.loads(timings.read_text())
    return result


def cli_phases(run: dict[str, Any], audio_s: float) -> dict[str, float]:
    t, launched = run["timings"], run["launched"]
    decode = t["last_batch_end"] - t["first_batch"]
    return {
        "to_first_batch_s": t["first_batch"] - launched,
        "to_checked_s": t["checked"] - launched,
        "lightning_import_s": t["imported"] - t["checked"],
        "build_s": t["built"] - t["imported"],
        "setup_to_first_batch_s": t["first_batch"] - t["built"],
        "decode_s": decode,
        "decode_audio_s_per_s": audio_s / decode,
        "loader_waits_s": t["data_wait_s"],
        "writer_queue_waits_s": t["writer"]["queue_wait_s"],
        "writer_busy_s": t["writer"]["write_busy_s"],
        "writer_drain_s": t["writer"]["drain_s"],
        "end_s": run["exited"] - t["last_batch_end"],
        "wall_s": run["wall_s"],
        "wall_x_realtime": audio_s / run["wall_s"],
        "batches": t["batches"],
        "written": t["stats"]["ok"],
    }


def in_process(args: list[str]) -> dict[str, Any]:
    """Runs in a fresh process (``--in-process-child``): the same job through ``trainer.predict``."""
    started = time.time()
    from omni_lightning import Code2WavModule, CodesDataModule, Trainer
    from omni_lightning.callbacks.timings import PhaseProfiler
    from omni_lightning.callbacks.writer import WaveformWriter
    from omni_lightning.cli.lightning_cli import OmniCLI

    cli = OmniCLI(
        Code2WavModule, CodesDataModule, trainer_class=Trainer, run=False, args=args, save_config_callback=None
    )
    built = time.time()
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    out: dict[str, Any] = {"built_s": built - started}
    for name in ("cold", "warm", "warm_writer"):
        trainer.profiler = profiler = PhaseProfiler()
        writer = None
        if name == "warm_writer":  # the same warm run writing the files as the command does: the writer's cost
            folder = Path(tempfile.mkdtemp(prefix="inproc-out-"))
            writer = WaveformWriter(str(folder))
            trainer.callbacks.append(writer)
        called = time.time()
        trainer.predict(model, datamodule=data, return_predictions=False)
        returned = time.time()
        if writer is not None:
            trainer.callbacks.remove(writer)
            shutil.rmtree(folder, ignore_errors=True)
        phases = profiler.phases()
        out[name] = {
            "call_s": returned - called,
            "to_first_batch_s": phases["first_batch"] - called,
            "decode_s": phases["last_batch_end"] - phases["first_batch"],
            "loader_waits_s": phases["data_wait_s"],
            "batches": phases["batches"],
        }
    config = model.config
    datasets = data.datasets["predict"]
    audio_s = sum(config.output_length(n) for ds in datasets for n in ds.lengths) / config.sample_rate
    out["audio_s"] = audio_s
    for name in ("cold", "warm", "warm_writer"):
        out[name]["decode_audio_s_per_s"] = audio_s / out[name]["decode_s"]
    loader = data.predict_dataloader()[0]
    out["loader"] = {"workers": loader.num_workers, "pin_memory": loader.pin_memory}
    start = time.perf_counter()
    try:  # after the runs: its failure loses no run
        requests = sum(len(batch["req_ids"]) + len(batch["errors"]) for batch in loader)
    except RuntimeError as err:
        out["loader"]["error"] = str(err)
        return out
    seconds = time.perf_counter() - start
    out["loader"].update(
        requests=requests, s=seconds, requests_per_s=requests / seconds, audio_s_per_s=audio_s / seconds
    )
    return out


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, nargs=2, default=(2.0, 30.0), help="request lengths, min max")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "omni-lightning-bench-cli")
    parser.add_argument("--random-weights", action="store_true", help="--model.random_weights true, no checkpoint")
    parser.add_argument("--out", type=Path, default=Path("bench_cli.json"))
    parser.add_argument("--in-process-child", type=Path, help=argparse.SUPPRESS)
    args, passed = parser.parse_known_args()
    if args.in_process_child is not None:  # the child process of the in-process run
        args.in_process_child.write_text(json.dumps(in_process(passed)))
        return

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    codes, out = work / "codes", work / "out"
    lengths = make_job(codes, args.files, args.seed, tuple(args.seconds))
    preset = option(passed, "--model.config", "tiny")
    if args.random_weights:
        weights = ["--model.random_weights", "true"]
    else:
        weights = ["--model.checkpoint", str(make_checkpoint(work / f"ckpt-{preset}", preset, args.seed))]
    job = ["--config", str(CONFIG), "--data.predict", str(codes), *weights, *passed]
    shutil.rmtree(out, ignore_errors=True)

    print(f"job: {args.files} files, {sum(lengths) / FRAME_RATE:.0f} s of codes; {' '.join(job)}", flush=True)
    cold = run_cli(["predict", *job, "--out_dir", str(out)], work / "timings.json")
    audio_s = cold["timings"]["stats"]["audio_s"]
    cli = cli_phases(cold, audio_s)
    noop = run_cli(["predict", *job, "--out_dir", str(out)], None)
    if "nothing left to do" not in noop["stdout"]:
        raise SystemExit(f"the rerun did not find the job done:\n{noop['stdout']}")
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "command": " ".join(["python", "scripts/bench/bench_cli.py", *sys.argv[1:]]),
    }
    result = {
        "meta": meta,
        "job": {"files": args.files, "seed": args.seed, "audio_s": audio_s, "args": job},
        "cli": cli,
        "cli_timings": cold["timings"],
        "noop_wall_s": noop["wall_s"],
    }
    args.out.write_text(json.dumps(result, indent=2))  # the CLI's phases are kept if the in-process run fails
    print(
        "cli:",
        json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in cli.items()}),
        f"no-op rerun {noop['wall_s']:.2f} s",
        flush=True,
    )
    child = work / "in_process.json"
    proc = subprocess.run(
        [sys.executable, __file__, "--in-process-child", str(child), *job], cwd=ROOT, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"the in-process run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    inproc = json.loads(child.read_text())

    ratios = {name: cli["decode_audio_s_per_s"] / inproc[name]["decode_audio_s_per_s"] for name in ("cold", "warm")}
    rows = [
        ("job", f"{args.files} files, {audio_s:.0f} s of audio, {cli['batches']} batches"),
        (
            "cli: start-up to first batch",
            f"{cli['to_first_batch_s']:.2f} s (checks done {cli['to_checked_s']:.2f}, "
            f"Lightning import {cli['lightning_import_s']:.2f}, build "
            f"{cli['build_s']:.2f}, setup {cli['setup_to_first_batch_s']:.2f})",
        ),
        (
            "cli: decode",
            f"{cli['decode_s']:.2f} s, {cli['decode_audio_s_per_s']:.0f} audio s/s "
            f"(loader waits {cli['loader_waits_s']:.2f} s)",
        ),
        (
            "cli: writes",
            f"queue waits {cli['writer_queue_waits_s']:.2f} s, busy {cli['writer_busy_s']:.2f} s, "
            f"drained {cli['writer_drain_s']:.2f} s after the last batch",
        ),
        ("cli: end (last batch to exit)", f"{cli['end_s']:.2f} s"),
        ("cli: wall", f"{cli['wall_s']:.2f} s, {cli['wall_x_realtime']:.0f}x real time"),
        ("cli: no-op rerun", f"{noop['wall_s']:.2f} s"),
        (
            "in-process cold",
            f"first batch {inproc['cold']['to_first_batch_s']:.2f} s after predict(), decode "
            f"{inproc['cold']['decode_s']:.2f} s, {inproc['cold']['decode_audio_s_per_s']:.0f} "
            "audio s/s",
        ),
        (
            "in-process warm",
            f"decode {inproc['warm']['decode_s']:.2f} s, {inproc['warm']['decode_audio_s_per_s']:.0f} audio s/s",
        ),
        (
            "in-process warm, writing",
            f"decode {inproc['warm_writer']['decode_s']:.2f} s, "
            f"{inproc['warm_writer']['decode_audio_s_per_s']:.0f} audio s/s (the writer's "
            "cost: this against the warm row)",
        ),
        (
            "loader alone",
            f"failed: {inproc['loader']['error']}"
            if "error" in inproc["loader"]
            else f"{inproc['loader']['requests_per_s']:.0f} requests/s, "
            f"{inproc['loader']['audio_s_per_s']:.0f} audio s/s ({inproc['loader']['workers']} workers, "
            f"pin_memory={inproc['loader']['pin_memory']})",
        ),
        ("cli decode / in-process", f"{ratios['cold']:.2f} of cold, {ratios['warm']:.2f} of warm"),
    ]
    print(table(rows))
    result.update(in_process=inproc, ratios=ratios)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
