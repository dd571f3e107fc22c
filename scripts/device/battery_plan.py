"""What ``device_battery.py`` runs: its steps as data, and the figures its summary reads from each result.

Standard library only. ``args`` are a step's arguments on the GPU, ``smoke`` the dry run's (the tiny
preset on the CPU); ``est_s`` is a guess at one run on an H200 until a run of that step is timed;
``ab`` steps run on the before tree and on this one, ``rounds`` times, interleaved (before, after,
before, after); ``limit`` is a figure's ceiling, said in the summary. ``FIGURES`` are keyed by script; a script
without an entry (pytest aside) shows no figures, only its exit status.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Step:
    name: str
    part: str
    script: str  # scripts/<script>.py, or "pytest"
    args: tuple[str, ...]
    smoke: tuple[str, ...]
    est_s: float
    ab: bool = False
    rounds: int = 1
    limit: tuple[str, float] | None = None


TINY = ("--preset", "tiny", "--device", "cpu")
SMALL_JOB = (*TINY, "--precision", "32-true", "--batch", "2", "--repeats", "1")
JOB_SMOKE = (*SMALL_JOB, "--requests", "4", "--min-s", "0.3", "--max-s", "1", "--check", "4")
STREAM_SMOKE = (*TINY, "--dtype", "fp32", "--streams", "2", "--chunk", "2", "--steps", "2", "--ttfa-trials", "2",
                "--fidelity-frames", "8", "--fidelity-requests", "1", "--no-graphs")  # fmt: skip
TRAIN = ("--preset", "qwen3-omni", "--device", "cuda", "--batch", "32", "--crop-seconds", "2", "--steps", "10")
TRAIN_SMOKE = (*TINY, "--batch", "2", "--steps", "1", "--warmup", "1", "--crop-seconds", "0.3")
BF16, MIXED = ("--precision", "bf16-true"), ("--precision", "bf16-mixed")
LONE = ("--requests", "1", "--batch", "1", "--check", "1")  # one request of --min-s = --max-s seconds

SERVE = ("--device", "cuda", "--preset", "qwen3-omni", "--precision", "bf16-true", "--frames", "25", "125",
         "--offline-batch", "32", "--offline-requests", "256", "--check", "64", "--max-streams", "128",
         "--client-processes", "8", "--seconds", "25")  # fmt: skip
# (8 client processes on the lent 16-core host: with 4, a client process's own stalls made most of the talkers'
# first-audio tail, docs/performance.md; the server's part is its front's figures, the same with either)
SERVE_SMOKE = (*TINY, "--clients", "2", "--paced", "2", "--seconds", "2", "--offline-requests", "4", "--check", "4")

UNITS_SMOKE = ("--preset", "tiny", "--device", "cpu", "--seconds", "0.1", "--batch", "1", "--repeats", "1")

STEPS = (
    # first, where GPU time is short: the residual units' fused convolution + SnakeBeta against the layers,
    # stage by stage and whole forwards (Kernels.for_inference's conv_snake); what holds memory in a predict
    Step("units", "kernels", "bench_units", (), UNITS_SMOKE, 90),
    # the output layer (SnakeBeta, the 96 > 1 convolution, the clamp): the layers against its one kernel at each
    # setting, alone at batch 32 x 10 s; then whole forwards with it off and on, in turns, each with its fidelity
    # guard (decides Kernels.for_inference(last_conv=...)'s default)
    Step("last-conv", "kernels", "bench_last_conv", (), UNITS_SMOKE, 30),
    Step(
        "forward-last-conv",
        "kernels",
        "bench_forward",
        ("--last-conv", "off", "on", "--rounds", "3", "--repeats", "5"),
        (*TINY, "--batches", "1", "--seconds", "1", "--repeats", "1", "--last-conv", "off", "on"),
        90,
    ),
    Step("convs", "kernels", "probe_convs", (), (*UNITS_SMOKE[:4], "--seconds", "0.5", "--batch", "1"), 60),
    Step("memory", "kernels", "profile_memory", (), ("--device", "cpu", "--jobs", "tiny"), 120),
    # the predict job, uncapped and at 0.03, and streaming, before and after
    Step("job", "ab", "bench_job", ("--check", "4"), JOB_SMOKE, 45, ab=True, rounds=2),
    Step(
        "job-0.03",
        "ab",
        "bench_job",
        ("--share", "0.03", "--check", "4"),
        (*JOB_SMOKE, "--share", "0.03"),
        45,
        ab=True,
        rounds=2,
    ),  # fmt: skip
    Step(
        "job-600s",
        "ab",
        "bench_job",
        (*LONE, "--min-s", "600", "--max-s", "600"),
        (*JOB_SMOKE, *LONE, "--min-s", "20", "--max-s", "20"),
        45,
        ab=True,
        limit=("outside batches s", 0.03),
    ),  # fmt: skip
    Step("stream", "ab", "bench_stream", (), STREAM_SMOKE, 60, ab=True, rounds=2),
    # a new stream's first audio alone, split (open(), the step, its host share, the graphs alone), before and after
    Step(
        "stream-first-audio",
        "engine",
        "bench_stream",
        ("--streams", "8", "--steps", "4", "--ttfa-trials", "50", "--fidelity-requests", "1"),
        STREAM_SMOKE,
        50,
        ab=True,
        limit=("first audio ms", 1.0),
    ),
    # `omni-lightning serve` under load (engine and front processes): 64 bulk clients against the offline
    # engine, then 64 paced talkers beside 16 bulk clients; before and after
    Step("serve-whole", "serve", "load_test_serve", (*SERVE, "--clients", "64"), SERVE_SMOKE, 90, ab=True),
    Step(
        "serve-mix", "serve", "load_test_serve", (*SERVE, "--clients", "16", "--paced", "64"), SERVE_SMOKE, 90, ab=True
    ),  # fmt: skip
    # the same mix without the stream lane (serve's default since 36488d9: --stream_lane false; this
    # tree only), the lane's gain in one run
    Step(
        "serve-mix-no-lane",
        "serve",
        "load_test_serve",
        (*SERVE, "--clients", "16", "--paced", "64", "--stream-lane", "false"),
        (*SERVE_SMOKE, "--stream-lane", "false"),
        90,
    ),
    # the same mix with SMs kept from the bulk for the lane while talkers are open (serve --lane_sms; this tree
    # only: against serve-mix's after, in the same call); the CPU smoke passes it to a CPU server, which ignores it
    Step(
        "serve-mix-lane-sms",
        "serve",
        "load_test_serve",
        (*SERVE, "--clients", "16", "--paced", "64", "--stream-lane", "true", "--lane-sms", "20"),
        (*SERVE_SMOKE, "--lane-sms", "20"),
        90,
    ),
    # a stream lane's decode alone and beside bulk decodes: what its priority, the bulk's launches, its kernels and
    # a green context for the bulk change (this tree only)
    Step(
        "lane",
        "serve",
        "bench_lane",
        ("--device", "cuda"),
        ("--preset", "tiny", "--device", "cpu", "--trials", "3"),
        120,
    ),
    # every CUDA test on the GPU
    Step("gpu-tests", "tests", "pytest", ("-m", "gpu", "-q", "-p", "no:cacheprovider", "--durations=10"), (), 420),
    # forward and fine-tuning throughput, the long-tailed job
    Step(
        "long-tailed-0.03",
        "throughput",
        "bench_job",
        ("--job", "long-tailed", "--share", "0.03", "--check", "4"),
        (
            *JOB_SMOKE[:4],
            "--precision",
            "32-true",
            "--job",
            "long-tailed",
            "--requests",
            "3",
            "--batch",
            "2",
            "--repeats",
            "1",
            "--check",
            "0",
        ),
        45,
        ab=True,
    ),  # fmt: skip
    Step(
        "forward", "throughput", "bench_forward", (), (*TINY, "--batches", "1", "--seconds", "1", "--repeats", "1"), 60
    ),
    Step("train-bf16-true", "throughput", "bench_train", (*TRAIN, "--precision", "bf16-true"), TRAIN_SMOKE, 60),
    Step(
        "train-gan",
        "throughput",
        "bench_train",
        (*TRAIN, "--precision", "bf16-true", "--adversarial"),
        (*TRAIN_SMOKE, "--adversarial"),
        75,
    ),  # fmt: skip
    Step("train-bf16-mixed", "throughput", "bench_train", (*TRAIN, "--precision", "bf16-mixed"), TRAIN_SMOKE, 60),
    # issue 60: the user's `omni-lightning fit` (configs/finetune.yaml: EMA, bar, logging, checkpoints, its
    # bf16-mixed) against the benchmark at the same settings; the table's last row says "N of the benchmark"
    Step(
        "train-fit-cli",
        "throughput",
        "bench_train",
        (*TRAIN, "--precision", "bf16-mixed", "--fit-cli"),
        (*TRAIN_SMOKE, "--fit-cli"),
        150,
    ),  # fmt: skip
    # the engine at the forward's speed: a smaller share, the default budget at 6 and 8 GiB (this tree, same
    # call), whole-budget graphs under a cap (the fallback that crashed, under compute-sanitizer too)
    Step(
        "job-0.02",
        "engine",
        "bench_job",
        ("--share", "0.02", "--check", "4"),
        (*JOB_SMOKE, "--share", "0.02"),
        45,
        ab=True,
    ),
    Step(
        "job-6g",
        "engine",
        "bench_job",
        ("--default-budget-gib", "6", "--check", "4"),
        (*JOB_SMOKE, "--default-budget-gib", "6"),
        45,
    ),
    Step(
        "job-8g",
        "engine",
        "bench_job",
        ("--default-budget-gib", "8", "--check", "4"),
        (*JOB_SMOKE, "--default-budget-gib", "8"),
        45,
    ),
    Step(
        "forward-6g",
        "engine",
        "bench_forward",
        ("--budget-gib", "6", "--no-fidelity"),
        (*TINY, "--batches", "1", "--seconds", "1", "--repeats", "1", "--no-fidelity"),
        45,
    ),
    Step(
        "forward-8g",
        "engine",
        "bench_forward",
        ("--budget-gib", "8", "--no-fidelity"),
        (*TINY, "--batches", "1", "--seconds", "1", "--repeats", "1", "--no-fidelity"),
        45,
    ),
    Step(
        "capped-graphs",
        "engine",
        "repro_capped_graphs",
        ("--share", "0.03"),
        (*TINY, "--batches", "1", "--requests", "2", "--modes", "forced"),
        90,
    ),
    Step(
        "capped-graphs-ab",
        "engine",
        "repro_capped_graphs",
        ("--share", "0.03", "--modes", "forced"),
        (*TINY, "--batches", "1", "--requests", "2", "--modes", "forced"),
        45,
        ab=True,
    ),
    Step(
        "stream-first-audio-profile",
        "engine",
        "bench_stream",
        ("--profile", "--steps", "4", "--ttfa-trials", "10", "--fidelity-requests", "1"),
        STREAM_SMOKE,
        60,
    ),
    Step(
        "job-600s-profile",
        "engine",
        "bench_job",
        (*LONE, "--min-s", "600", "--max-s", "600", "--repeats", "1", "--check", "0", "--profile"),
        (*JOB_SMOKE, *LONE, "--min-s", "20", "--max-s", "20", "--check", "0"),
        60,
    ),
    Step(
        "capped-graphs-sanitize",
        "engine",
        "repro_capped_graphs",
        ("--share", "0.03", "--batches", "1", "--modes", "forced", "eager", "--sanitize"),
        (*TINY, "--batches", "1", "--requests", "2", "--modes", "forced"),
        240,
    ),
)
PARTS = tuple(dict.fromkeys(s.part for s in STEPS))


def _get(result: dict, *keys: Any) -> float | None:
    for key in keys:
        if not isinstance(result, (dict, list)):
            return None
        try:
            result = result[key]
        except (KeyError, IndexError):
            return None
    return result if isinstance(result, (int, float)) else None


def _forward(result: dict, kernels: str, which: int, key: str) -> float | None:
    """``bench_units``' forward row of ``kernels`` at its first (0) or last (-1) batch size."""
    rows = [r for r in result.get("forward", ()) if isinstance(r, dict) and r.get("kernels") == kernels]
    return _get(rows, which, key) if rows else None


def _choice(last_conv: str, which: int, measure: str, key: str) -> Callable[[dict], float | None]:
    """A reader of ``bench_forward --last-conv``' figure ``key`` of ``measure`` under ``last_conv`` (``off``,
    ``on``) at its first (0) or last (-1) batch size."""
    return lambda r: _get(r, "forward", which, "last_conv", last_conv, measure, key)


def _sum(result: dict, key: str, **where: Any) -> float | None:
    rows = [r for r in result.get("rows", ()) if all(r.get(k) == v for k, v in where.items())]
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(values) if values else None


Figure = tuple[str, Callable[[dict], float | None], str]  # label, reader, format
FIGURES: dict[str, tuple[Figure, ...]] = {
    "bench_job": (
        ("x real time", lambda r: _get(r, "x_realtime"), ",.0f"),
        ("peak reserved GiB", lambda r: _get(r, "warm", "peak_reserved_gib"), ".2f"),
        ("outside batches s", lambda r: _get(r, "outside_batches_s"), ".3f"),
        ("padding", lambda r: _get(r, "padding"), ".1%"),
        ("check max rel L2", lambda r: _get(r, "check", "max_rel_l2"), ".1e"),
    ),
    "load_test_serve": (
        ("served audio s/s", lambda r: _get(r, "audio_s_per_s"), ",.0f"),
        ("served / offline", lambda r: _get(r, "ratio_to_offline"), ".2f"),
        ("decode loop share", lambda r: _get(r, "decode_loop_share"), ".2f"),
        ("first audio p50 ms (whole)", lambda r: _get(r, "first_audio_ms_whole_p50"), ".0f"),
        ("first audio p99 ms (whole)", lambda r: _get(r, "first_audio_ms_whole_p99"), ".0f"),
        ("talkers' first audio p99 ms", lambda r: _get(r, "first_audio_ms_paced_p99"), ".0f"),
        # where that tail waits: a stream's first chunk in the decode loop, and the first chunks past 50 ms there,
        # in the fronts (the loop's time and the hand-offs) and at the clients (the sockets and the client too)
        ("first chunk in the loop ms (mean)", lambda r: _get(r, "stream_first_chunk_in_loop_ms_mean"), ".1f"),
        ("first chunks past 50 ms, in the loop", lambda r: _get(r, "stream_first_chunks_in_loop_over_50ms"), ".0f"),
        ("first chunks past 50 ms, in the fronts", lambda r: _get(r, "stream_first_chunks_at_front_over_50ms"), ".0f"),
        ("first audio past 50 ms, at the clients", lambda r: _get(r, "first_audio_streams_over_50ms"), ".0f"),
        ("chunk latency p50 ms", lambda r: _get(r, "chunk_latency_ms_p50"), ".1f"),
        ("chunk latency p99 ms", lambda r: _get(r, "chunk_latency_ms_p99"), ".1f"),
        ("chunk in the fronts ms (mean)", lambda r: _get(r, "stream_chunk_at_front_ms_mean"), ".1f"),
        # of which: the loop's, the hand-off to the engine and the audio's back (the rest is the front's own)
        ("chunk in the loop ms (mean)", lambda r: _get(r, "stream_chunk_in_loop_ms_mean"), ".1f"),
        ("chunk to the engine ms (mean)", lambda r: _get(r, "stream_chunk_to_engine_ms_mean"), ".2f"),
        ("audio back to the front ms (mean)", lambda r: _get(r, "stream_audio_to_front_ms_mean"), ".2f"),
        ("client stalls past 20 ms", lambda r: _get(r, "client_loop_stalls_over_20ms"), ".0f"),
        ("streams' decode ms (mean)", lambda r: _get(r, "stream_decode_ms_mean"), ".2f"),
        ("bulk decode ms (mean)", lambda r: _get(r, "bulk_decode_ms_mean"), ".2f"),
        ("shapes first run under load", lambda r: _get(r, "new_shapes"), ".0f"),
        ("frames a forward", lambda r: _get(r, "frames_per_forward"), ".0f"),
        ("padding (served)", lambda r: _get(r, "padding_share"), ".1%"),
        ("lost", lambda r: _get(r, "lost"), ".0f"),
        ("wrong", lambda r: _get(r, "wrong"), ".0f"),
    ),
    "bench_lane": (
        ("lane decode alone ms", lambda r: _get(r, "scenarios", "alone", "lane_ms_median"), ".2f"),
        ("beside bulk, bulk held ms", lambda r: _get(r, "scenarios", "held", "lane_ms_median"), ".2f"),
        ("beside bulk, bulk launching ms", lambda r: _get(r, "scenarios", "launching", "lane_ms_median"), ".2f"),
        ("normal priority ms", lambda r: _get(r, "scenarios", "held_normal_priority", "lane_ms_median"), ".2f"),
        ("torch's kernels ms", lambda r: _get(r, "scenarios", "held_reference_kernels", "lane_ms_median"), ".2f"),
        ("bulk on 112 SMs ms", lambda r: _get(r, "scenarios", "held_green_112", "lane_ms_median"), ".2f"),
        ("bulk on 96 SMs ms", lambda r: _get(r, "scenarios", "held_green_96", "lane_ms_median"), ".2f"),
        ("kernels in a lane decode (Triton's)", lambda r: _get(r, "lane_kernels_triton"), ",.0f"),
        ("kernels in a lane decode (torch's)", lambda r: _get(r, "lane_kernels_torch"), ",.0f"),
        ("bulk frames/s alone", lambda r: _get(r, "bulk_alone_frames_per_s"), ",.0f"),
        ("bulk frames/s beside (held)", lambda r: _get(r, "scenarios", "held", "bulk_frames_per_s"), ",.0f"),
    ),
    "bench_stream": (
        ("first audio ms", lambda r: _get(r, "ttfa_ms", "stream"), ".2f"),
        ("steady x real time", lambda r: _get(r, "steady_x_realtime", "stream_pipelined"), ",.0f"),
        ("re-decode first audio ms", lambda r: _get(r, "ttfa_ms", "redecode_graph"), ".2f"),
        # first audio split: open(), the first chunk's step (to its samples; its host share), graphs replayed alone
        ("first audio: open() ms", lambda r: _get(r, "ttfa_ms", "stream_open"), ".3f"),
        ("first audio: the step ms", lambda r: _get(r, "ttfa_ms", "stream_step"), ".2f"),
        ("first audio: the step's host ms", lambda r: _get(r, "ttfa_ms", "stream_step_host"), ".2f"),
        ("first chunk's graph alone ms", lambda r: _get(r, "ttfa_ms", "stream_graph_only"), ".2f"),
        ("re-decode's graph alone ms", lambda r: _get(r, "ttfa_ms", "redecode_graph_only"), ".2f"),
    ),
    "bench_forward": (
        ("batch 1 ms", lambda r: _get(r, "forward", 0, "ours", "ms"), ".2f"),
        ("last batch x real time", lambda r: _get(r, "forward", -1, "ours", "x_realtime"), ",.0f"),
        ("transformers, last batch x", lambda r: _get(r, "forward", -1, "transformers", "x_realtime"), ",.0f"),
        ("guard holds (1 = yes)", lambda r: _get(r, "fidelity", "guard_holds"), ".0f"),
        *(  # --last-conv: each choice's forwards, timed in turns, and its guard
            figure
            for u in ("off", "on")
            for figure in (
                (f"[last conv {u}] engine, last batch x", _choice(u, -1, "ours", "x_realtime"), ",.0f"),
                (f"[last conv {u}] eager, last batch x", _choice(u, -1, "eager", "x_realtime"), ",.0f"),
                (f"[last conv {u}] engine, batch 1 ms", _choice(u, 0, "ours", "ms"), ".2f"),
                (
                    f"[last conv {u}] guard holds",
                    lambda r, u=u: _get(r, "fidelity", "last_conv", u, "guard_holds"),
                    ".0f",
                ),
            )
        ),
    ),
    "bench_units": (
        ("fused units, batch x real time", lambda r: _forward(r, "fused", 0, "x_realtime"), ",.0f"),
        ("layers, batch x real time", lambda r: _forward(r, "layers", 0, "x_realtime"), ",.0f"),
        ("fused units, batch 1 ms", lambda r: _forward(r, "fused", -1, "ms"), ".2f"),
        ("layers, batch 1 ms", lambda r: _forward(r, "layers", -1, "ms"), ".2f"),
    ),
    "bench_last_conv": (  # the output layer alone: the layers, the kernel's best setting, its ratio
        ("layers ms", lambda r: _get(r, "layers_ms"), ".3f"),
        ("kernel, best setting, ms", lambda r: _get(r, "best_ms"), ".3f"),
        ("kernel speedup over the layers", lambda r: _get(r, "speedup"), ".2f"),
        ("bandwidth floor ms", lambda r: _get(r, "floor_ms"), ".3f"),
    ),
    "probe_convs": (
        ("convolutions, as run, ms", lambda r: _sum(r, "ms", variant="as run"), ".2f"),
        ("convolutions, cudnn.benchmark, ms", lambda r: _sum(r, "benchmark_ms", variant="as run"), ".2f"),
    ),
    "profile_memory": (
        ("qwen share 0.03, peak reserved GiB", lambda r: _get(r, "qwen-0.03", "peak_reserved_gib"), ".2f"),
        ("tiny share 0.02, peak reserved GiB", lambda r: _get(r, "tiny-0.02", "peak_reserved_gib"), ".2f"),
    ),
    "repro_capped_graphs": (  # per mode: forced (the old crash setting), whole-budget graphs, eager
        *(
            (f"{m} x real time", lambda r, m=m: _get(r, "modes", m, "x_realtime"), ",.0f")
            for m in ("forced", "whole", "eager")
        ),
        *(
            (f"{m} max rel L2", lambda r, m=m: _get(r, "modes", m, "max_rel_l2"), ".1e")
            for m in ("forced", "whole", "eager")
        ),
    ),
    "bench_train": (
        ("audio s/s", lambda r: _get(r, "rows", 0, "audio_s_per_s"), ",.1f"),
        ("step ms", lambda r: None if (s := _get(r, "rows", 0, "step_s")) is None else 1e3 * s, ".0f"),
        ("peak GiB", lambda r: _get(r, "rows", 0, "peak_memory_gib"), ".2f"),
    ),
}
