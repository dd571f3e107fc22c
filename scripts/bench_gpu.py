"""The GPU job as users run it, side by side with transformers: one process, the same random weights.

    python scripts/bench_gpu.py --out bench_gpu.json                       # an H200: everything
    python scripts/bench_gpu.py --only e2e,lat1                             # a subset
    python scripts/bench_gpu.py --device cpu --preset tiny --requests 6 --batch 4 --max-s 3 \\
        --long-s 20 --fwd-batches 1 2 --only fidelity,fwd,e2e,long   # smoke test

Sections (``--only``, comma-separated; default all):
  fidelity  bf16 error against the fp32 reference (transformers, TF32 off), relative L2 and mel
            distance, ours (default path) vs transformers' own bf16; the guard: ours <= theirs
  fwd       model forward of batches of 10 s clips (``--fwd-batches``): ours through CUDA graphs
            (the default predict path), ours eager, ours eager with the layer-by-layer decoder,
            transformers
  lat1      batch-1 latency of one 10 s clip, codes on the GPU to waveform on the GPU
  e2e       a seeded mixed-length job (``--requests`` of ``--min-s``..``--max-s`` s, uniform
            random lengths): the default ``omni_lightning.Trainer`` + ``Code2WavModule`` +
            ``CodesDataModule`` into CPU tensors, cold (first run: captures, autotune, allocator)
            and warm; a plain transformers loop (batches in file order padded to their longest,
            ``.cpu()`` per request), cold and warm; shapes seen and padding cost; per-request
            equality of the Trainer's output with solo eager decodes (``--check-requests`` of them)
  long      one ``--long-s`` request: ours through the Trainer (chunked, graphs), ours' ``chunked_decode``
            through the graphs without the Trainer, transformers' ``chunked_decode`` (same chunk 300,
            left context 25); peaks also above the memory allocated before the call (the weights)
  profile   top CUDA kernels of ours, eager, batch 32 of 10 s (``--profile-out``)
  compile   transformers + torch.compile (defaults, ``dynamic=False``: one compile per shape) on the
            fwd shapes (``--compile-batches``), last because each compile takes a minute; its
            batch-1 row is its lat1. Not run on the e2e job: every new shape recompiles (the issue
            saw no first pass finish in 8 minutes)
x real time = audio seconds / wall seconds. ``torch.backends.cudnn.benchmark`` is ``--cudnn-benchmark``
(default off) for every row, and recorded in each. Peak memory = ``torch.cuda.max_memory_allocated``
(weights included) during the timed run. Prints tables; writes JSON after every section (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_model import reference  # noqa: E402

from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, Trainer, randomize_weights  # noqa: E402
from omni_lightning.models.cuda_graphs import CUDAGraphDecoder, ShapeBuckets  # noqa: E402

SECTIONS = ("fidelity", "fwd", "lat1", "e2e", "long", "profile", "compile")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median_time(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    times = [timed(fn, device) for _ in range(repeats)]
    med = statistics.median(times)
    return med, (max(times) - min(times)) / med


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def peak_reserved_gib(device: torch.device) -> float | None:
    """Allocator-reserved peak: unlike ``max_memory_allocated`` it sees CUDA-graph pools."""
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


def mixed_workload(config: Any, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The seeded e2e job: ``args.requests`` requests of uniform random ``args.min_s``..``args.max_s``
    seconds (``args.seed``); also ``scripts/profile_predict.py``'s."""
    rng = random.Random(args.seed)
    lo, hi = round(args.min_s * config.frame_rate), round(args.max_s * config.frame_rate)
    gen = torch.Generator().manual_seed(args.seed)
    reqs = {}
    for i in range(args.requests):
        n = rng.randint(lo, hi)
        reqs[f"req-{i:04d}"] = torch.randint(0, config.codebook_size, (config.num_quantizers, n), generator=gen)
    return reqs


class Clock(pl.Callback):
    """From the first predict batch's start to the end of predict (setup and teardown left out)."""

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and not hasattr(self, "start"):
            self.start = time.perf_counter()

    def on_predict_end(self, trainer, pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self.seconds = time.perf_counter() - self.start


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
        self.base = randomize_weights(Code2Wav(args.preset), seed=0).eval()
        self.config = self.base.config
        self.state = self.base.state_dict()
        self.ours = self.fresh_ours().to(self.device, torch.bfloat16)
        self.ref = reference(self.base, torch.bfloat16, self.device)
        self.results: dict[str, Any] = {"meta": self.meta()}

    def fresh_ours(self) -> Code2Wav:
        model = Code2Wav(self.config).eval()
        model.load_state_dict(self.state)
        return model

    def meta(self) -> dict[str, Any]:
        import lightning
        import transformers

        return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
                "lightning": lightning.__version__, "transformers": transformers.__version__,
                "machine": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                "cudnn_benchmark": self.args.cudnn_benchmark, "args": vars(self.args)}  # fmt: skip

    def save(self) -> None:
        Path(self.args.out).write_text(json.dumps(self.results, indent=2, default=str))

    def codes(self, batch: int, frames: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        shape = (batch, self.config.num_quantizers, frames)
        return torch.randint(0, self.config.codebook_size, shape, generator=gen).to(self.device)

    def audio_s(self, frames: int, batch: int = 1) -> float:
        return batch * self.config.output_length(frames) / self.config.sample_rate

    # --- fidelity ------------------------------------------------------------------------------

    def fidelity(self) -> dict[str, Any]:
        from omni_lightning.training.losses import MultiResolutionMelLoss

        codes = self.codes(self.args.fidelity_clips, 125, seed=123)
        tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        try:
            ref32 = reference(self.base, torch.float32, self.device)
            with torch.inference_mode():
                want = ref32(codes).float()
        finally:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
            del ref32
        mel = MultiResolutionMelLoss(self.config.sample_rate).to(self.device)
        outputs = {"transformers bf16": lambda: self.ref(codes), "ours bf16 eager": lambda: self.ours(codes)}
        if self.device.type == "cuda":
            graphs = CUDAGraphDecoder(self.ours)
            outputs["ours bf16 default (graphs)"] = lambda: (graphs(codes), graphs(codes))[1]  # capture, replay
        rows = {}
        with torch.inference_mode():
            for name, fn in outputs.items():
                got = fn().float()
                rows[name] = {
                    "rel_l2": float((got - want).norm() / want.norm()),
                    "mel_distance": float(mel(got[:, 0], want[:, 0])),
                    "max_abs": float((got - want).abs().max()),
                }
        theirs = rows["transformers bf16"]
        ours = rows.get("ours bf16 default (graphs)", rows["ours bf16 eager"])
        guard = ours["rel_l2"] <= theirs["rel_l2"] and ours["mel_distance"] <= theirs["mel_distance"]
        return {"clips": self.args.fidelity_clips, "clip_s": 10.0, "rows": rows, "guard_holds": guard}

    # --- fixed-shape forwards and latency ------------------------------------------------------

    def forward_rows(self, batches: list[int], repeats: int, compiled: bool = False) -> list[dict[str, Any]]:
        rows = []
        graphs = CUDAGraphDecoder(self.ours) if self.device.type == "cuda" and not compiled else None
        for batch in batches:
            codes = self.codes(batch, 125, seed=batch)
            impls: dict[str, Callable[[], Any]] = {}
            if compiled:
                impls["transformers + torch.compile"] = self.compiled_ref(codes)
            else:
                if graphs is not None:
                    impls["ours (graphs, default)"] = lambda codes=codes: graphs(codes)
                impls["ours eager"] = lambda codes=codes: self.ours(codes)
                impls["ours eager, layer-by-layer decoder"] = lambda codes=codes: self.layer_by_layer(codes)
                impls["transformers"] = lambda codes=codes: self.ref(codes)
            for name, fn in impls.items():
                with torch.inference_mode():
                    first = timed(fn, self.device)  # capture / compile / first-use costs
                    seconds, spread = median_time(fn, self.device, self.args.warmup, repeats)
                rows.append({"impl": name, "batch": batch, "clip_s": 10.0, "seconds": seconds, "spread": spread,
                             "first_call_s": first, "x_realtime": self.audio_s(125, batch) / seconds,
                             "cudnn_benchmark": self.args.cudnn_benchmark})  # fmt: skip
                print(f"  fwd {name} batch {batch}: {rows[-1]['x_realtime']:,.0f}x", file=sys.stderr, flush=True)
        if graphs is not None:
            graphs.close()
        return rows

    def layer_by_layer(self, codes: torch.Tensor) -> torch.Tensor:
        self.ours.fast_decoder = False
        try:
            return self.ours(codes)
        finally:
            self.ours.fast_decoder = True

    def compiled_ref(self, codes: torch.Tensor) -> Callable[[], Any]:
        compiled = torch.compile(self.ref, dynamic=False)
        return lambda: compiled(codes)

    def fwd(self) -> dict[str, Any]:
        return {"rows": self.forward_rows(self.args.fwd_batches, self.args.repeats)}

    def lat1(self) -> dict[str, Any]:
        rows = self.forward_rows([1], self.args.latency_repeats)
        return {"rows": [{**r, "latency_ms": 1e3 * r["seconds"]} for r in rows]}

    def compile(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": []}
        for batch in self.args.compile_batches:  # saved row by row: each compile takes a while
            repeats = self.args.latency_repeats if batch == 1 else self.args.repeats
            out["rows"] += [{**r, "latency_ms": 1e3 * r["seconds"]}
                            for r in self.forward_rows([batch], repeats, compiled=True)]  # fmt: skip
            self.results["compile"] = out
            self.save()
        return out

    # --- the mixed-length job ------------------------------------------------------------------

    def trainer_predict(self, module: Code2WavModule, reqs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One ``trainer.predict`` of the default Trainer (a clock callback added to read the batch time)."""
        datamodule = CodesDataModule(predict=reqs, batch_size=self.args.batch)
        clock = Clock()
        trainer = Trainer(accelerator=self.device.type, devices=1, precision="bf16-true", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[clock])  # fmt: skip
        peak_reset(self.device)
        start = time.perf_counter()
        preds = trainer.predict(module, datamodule=datamodule)
        seconds = time.perf_counter() - start
        wavs = {r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)}
        return {"seconds": seconds, "batches_s": clock.seconds, "wavs": wavs, "peak_gib": peak_gib(self.device),
                "peak_reserved_gib": peak_reserved_gib(self.device)}  # fmt: skip

    def shapes_and_padding(self, lengths: list[int]) -> dict[str, Any]:
        """What the default datamodule's batches cost in padding: as they come, in one bucket per batch,
        and split into the groups the graph decoder runs (``ShapeBuckets.plan``)."""
        from omni_lightning.data import LengthBucketBatchSampler

        buckets = ShapeBuckets()
        batches = list(LengthBucketBatchSampler(range(len(lengths)), self.args.batch, lengths=lengths))
        groups = [[b[i] for i in g] for b in batches for g in buckets.plan([lengths[i] for i in b])]
        real = sum(lengths)

        def padded(runs: list[list[int]]) -> tuple[int, set]:
            keys = [buckets.bucket(len(r), max(lengths[i] for i in r)) for r in runs]
            work = sum(k[0] * k[1] if k else len(r) * max(lengths[i] for i in r) for k, r in zip(keys, runs))
            return work, {k for k in keys if k}

        in_batch = sum(len(b) * max(lengths[i] for i in b) for b in batches)
        one, one_keys = padded(batches)
        split, split_keys = padded(groups)
        return {"batches": len(batches), "distinct_batch_shapes": len({(len(b), max(lengths[i] for i in b))
                                                                       for b in batches}),
                "padding_in_batch": in_batch / real - 1, "padding_one_bucket_per_batch": one / real - 1,
                "buckets_one_per_batch": len(one_keys), "groups": len(groups),
                "padding_with_buckets": split / real - 1, "distinct_buckets": len(split_keys)}  # fmt: skip

    def ours_job(self, module: Code2WavModule, reqs: dict[str, torch.Tensor], audio: float) -> dict[str, Any]:
        """The job through ``module``: a cold run then ``--e2e-repeats`` warm ones."""
        cold = self.trainer_predict(module, reqs)
        runs = [self.trainer_predict(module, reqs) for _ in range(self.args.e2e_repeats)]
        warm = statistics.median(r["seconds"] for r in runs)
        warm_batches = statistics.median(r["batches_s"] for r in runs)
        stats = module.graph_decoder.stats if module.graph_decoder is not None else None
        out = {"cold_s": cold["seconds"], "warm_s": warm, "warm_runs": [r["seconds"] for r in runs],
               "x_realtime": audio / warm, "cold_x_realtime": audio / cold["seconds"],
               "cold_overhead_s": cold["seconds"] - warm, "warm_batches_s": warm_batches,
               "x_realtime_batches": audio / warm_batches, "peak_gib": runs[-1]["peak_gib"],
               "peak_reserved_gib": runs[-1]["peak_reserved_gib"], "cold_peak_reserved_gib": cold["peak_reserved_gib"],
               "graphs": len(module.graph_decoder.graphs) if stats else 0,
               "captures": stats.captures if stats else 0, "capture_s": stats.capture_s if stats else None,
               "eager_forwards": stats.eager if stats else None, "wavs": runs[-1]["wavs"]}  # fmt: skip
        print(f"  e2e ours: {out['x_realtime']:,.0f}x warm ({out['x_realtime_batches']:,.0f}x batches only), "
              f"cold {cold['seconds']:.1f} s, {out['captures']} captures", file=sys.stderr, flush=True)  # fmt: skip
        if module.graph_decoder is not None:
            module.graph_decoder.close()
        return out

    def e2e(self) -> dict[str, Any]:
        reqs = mixed_workload(self.config, self.args)
        lengths = [c.shape[-1] for c in reqs.values()]
        audio = sum(self.config.output_length(n) for n in lengths) / self.config.sample_rate
        out: dict[str, Any] = {"requests": len(reqs), "audio_s": audio, "batch": self.args.batch,
                               "lengths_s": [self.args.min_s, self.args.max_s], "seed": self.args.seed,
                               "cudnn_benchmark": self.args.cudnn_benchmark}  # fmt: skip
        out.update(self.shapes_and_padding(lengths))
        # ours: the default Trainer; a fresh fp32 copy that the Trainer moves and casts (bf16-true)
        out["ours"] = self.ours_job(Code2WavModule(model=self.fresh_ours()), reqs, audio)
        out["equality"] = self.equality(reqs, out["ours"].pop("wavs"))
        # variants of the batch split's replay cost (ShapeBuckets.plan)
        for cost in self.args.group_costs if self.device.type == "cuda" else []:
            module = Code2WavModule(model=self.fresh_ours())
            buckets = ShapeBuckets(group_cost=cost)
            module.graph_decoder = CUDAGraphDecoder(module.model, buckets, out_dtype=torch.float32)
            out[f"ours_group_cost_{cost}"] = self.ours_job(module, reqs, audio)
            out[f"ours_group_cost_{cost}"].pop("wavs")
            del module
        if self.args.fused_variant and self.device.type == "cuda":  # the residual units' fused Triton GEMM
            from omni_lightning.models import fast_decoder

            default, fast_decoder.FUSE_POINTWISE = fast_decoder.FUSE_POINTWISE, True
            try:
                out["ours_fused_pointwise"] = self.ours_job(Code2WavModule(model=self.fresh_ours()), reqs, audio)
            finally:  # the rows after this one (the transformers loop) are not affected either way
                fast_decoder.FUSE_POINTWISE = default
            out["ours_fused_pointwise"].pop("wavs")
        free_memory()
        if not self.args.no_peer:
            out["transformers"] = self.plain_loop(reqs, audio)
            out["ours_over_transformers"] = out["ours"]["x_realtime"] / out["transformers"]["x_realtime"]
        return out

    def equality(self, reqs: dict[str, torch.Tensor], wavs: dict[str, torch.Tensor]) -> dict[str, Any]:
        ids = random.Random(1).sample(sorted(reqs), min(self.args.check_requests, len(reqs)))
        rel, worst = [], 0.0
        with torch.inference_mode():
            for req_id in ids:
                alone = self.ours(reqs[req_id][None].to(self.device))[0].float().cpu()
                got = wavs[req_id]
                assert got.shape == alone.shape, (req_id, got.shape, alone.shape)
                rel.append(float((got - alone).norm() / alone.norm()))
                worst = max(worst, float((got - alone).abs().max()))
        return {"checked": len(ids), "max_rel_l2": max(rel), "median_rel_l2": statistics.median(rel),
                "max_abs": worst, "solo": "ours bf16 eager, batch 1, own length"}  # fmt: skip

    def plain_loop(self, reqs: dict[str, torch.Tensor], audio: float) -> dict[str, Any]:
        items = list(reqs.values())

        def run() -> None:
            with torch.inference_mode():
                for start in range(0, len(items), self.args.batch):
                    chunk = items[start : start + self.args.batch]
                    longest = max(c.shape[-1] for c in chunk)
                    codes = torch.zeros((len(chunk), self.config.num_quantizers, longest), dtype=torch.long)
                    for i, c in enumerate(chunk):
                        codes[i, :, : c.shape[-1]] = c
                    wav = self.ref(codes.to(self.device))
                    _ = [wav[i, :, : self.config.output_length(c.shape[-1])].float().cpu() for i, c in enumerate(chunk)]

        cold = timed(run, self.device)
        peak_reset(self.device)
        warm = timed(run, self.device)
        print(f"  e2e transformers: {audio / warm:,.0f}x warm, cold {cold:.1f} s", file=sys.stderr, flush=True)
        return {"cold_s": cold, "warm_s": warm, "x_realtime": audio / warm, "cold_x_realtime": audio / cold,
                "peak_gib": peak_gib(self.device), "peak_reserved_gib": peak_reserved_gib(self.device)}  # fmt: skip

    # --- one long request ----------------------------------------------------------------------

    def long(self) -> dict[str, Any]:
        frames = round(self.args.long_s * self.config.frame_rate)
        codes = self.codes(1, frames, seed=600)[0].cpu()
        audio = self.audio_s(frames)
        module = Code2WavModule(model=self.fresh_ours())
        self.trainer_predict(module, {"long": codes})  # cold: captures the chunk buckets
        run = self.trainer_predict(module, {"long": codes})
        ours = {"seconds": run["seconds"], "x_realtime": audio / run["seconds"], "peak_gib": run["peak_gib"],
                "peak_reserved_gib": run["peak_reserved_gib"], "batches_s": run["batches_s"],
                "x_realtime_batches": audio / run["batches_s"],
                "chunk_size": module.chunk_size, "left_context": module.left_context}  # fmt: skip
        if module.graph_decoder is not None:
            module.graph_decoder.close()
        del module, run
        free_memory()

        graphs = CUDAGraphDecoder(self.ours, out_dtype=torch.float32) if self.device.type == "cuda" else None

        def ours_api() -> None:  # the module's decode path without the Trainer: chunks through the graphs
            with torch.inference_mode():
                self.ours.chunked_decode(codes[None].to(self.device), 300, 25, False, graphs).cpu()

        def theirs() -> None:
            with torch.inference_mode():
                self.ref.chunked_decode(codes[None].to(self.device), chunk_size=300, left_context_size=25).cpu()

        out = {"request_s": self.args.long_s, "ours (Trainer, chunked)": ours}
        rows = (("ours chunked_decode (graphs, no Trainer)", ours_api), ("transformers chunked_decode", theirs))
        for name, fn in rows:
            fn()
            base = torch.cuda.memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
            peak_reset(self.device)
            t = timed(fn, self.device)
            peak = peak_gib(self.device)
            out[name] = {"seconds": t, "x_realtime": audio / t, "peak_gib": peak,
                         "peak_above_weights_gib": peak - base if peak is not None else None,
                         "peak_reserved_gib": peak_reserved_gib(self.device)}  # fmt: skip
        if graphs is not None:
            graphs.close()
        return out

    # --- profile -------------------------------------------------------------------------------

    def profile(self) -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        codes = self.codes(32, 125, seed=32)
        with torch.inference_mode():
            self.ours(codes), self.ours(codes)
            sync(self.device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                self.ours(codes)
                sync(self.device)
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        total = sum(e.self_device_time_total for e in kernels)
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
        rows = [{"kernel": e.key[:120], "ms": e.self_device_time_total / 1e3, "share": e.self_device_time_total / total,
                 "calls": e.count} for e in top]  # fmt: skip
        layout = sum(e.self_device_time_total for e in kernels if "nchwToNhwc" in e.key or "nhwcToNchw" in e.key)
        if self.args.profile_out:
            Path(self.args.profile_out).write_text(
                prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=100)
            )
        return {"batch": 32, "clip_s": 10.0, "kernel_ms": total / 1e3, "layout_conversion_share": layout / total,
                "top": rows}  # fmt: skip


def print_tables(results: dict[str, Any]) -> None:
    meta = results["meta"]
    print(f"\n{meta['machine']}, torch {meta['torch']}, cudnn.benchmark={meta['cudnn_benchmark']} for every row")
    if "fidelity" in results:
        f = results["fidelity"]
        print(f"\nFidelity vs fp32 transformers (TF32 off), {f['clips']} clips of 10 s; "
              f"guard holds: {f['guard_holds']}")
        print("| output | rel L2 | mel distance | max abs |\n|---|---|---|---|")
        for name, r in f["rows"].items():
            print(f"| {name} | {r['rel_l2']:.2e} | {r['mel_distance']:.4f} | {r['max_abs']:.2e} |")
    for key in ("fwd", "lat1", "compile"):
        if key in results:
            print(f"\n{key}: batches of 10 s clips, median; first call includes capture/compile")
            print("| impl | batch | x real time | ms | first call (s) |\n|---|---|---|---|---|")
            for r in results[key]["rows"]:
                print(f"| {r['impl']} | {r['batch']} | {r['x_realtime']:,.0f} | {1e3 * r['seconds']:.2f} "
                      f"| {r['first_call_s']:.2f} |")  # fmt: skip
    if "e2e" in results:
        e = results["e2e"]
        print(f"\ne2e: {e['requests']} requests, {e['audio_s']:.0f} s of audio, batch {e['batch']}; "
              f"{e['batches']} batches, {e['distinct_batch_shapes']} distinct batch shapes -> "
              f"{e['distinct_buckets']} buckets; padding {e['padding_in_batch']:.1%} in batch, "
              f"{e['padding_one_bucket_per_batch']:.1%} one bucket per batch, {e['padding_with_buckets']:.1%} in "
              f"{e['groups']} groups")  # fmt: skip
        print("| impl | warm x real time | warm (s) | cold (s) | peak GiB alloc / reserved |\n|---|---|---|---|---|")
        for name in ["ours", *(k for k in e if k.startswith(("ours_group_cost_", "ours_fused"))), "transformers"]:
            if name not in e:
                continue
            r = e[name]
            peak = f"{r['peak_gib']:.2f} / {r['peak_reserved_gib']:.2f}" if r["peak_gib"] is not None else "-"
            print(f"| {name} | {r['x_realtime']:,.0f} | {r['warm_s']:.2f} | {r['cold_s']:.2f} | {peak} |")
        o = e["ours"]
        print(f"ours batches only (first batch to last output): {o['x_realtime_batches']:,.0f}x; "
              f"{o['captures']} captures in {o['capture_s'] or 0:.2f} s")  # fmt: skip
        q = e["equality"]
        ratio = f"{e['ours_over_transformers']:.2f}x" if "ours_over_transformers" in e else "not run (--no-peer)"
        print(f"ours/transformers {ratio}; equality vs solo ({q['checked']} requests): "
              f"max rel L2 {q['max_rel_l2']:.2e}, max abs {q['max_abs']:.2e}")  # fmt: skip
    if "long" in results:
        lg = results["long"]
        print(f"\nlong: one {lg['request_s']:g} s request")
        for name, r in lg.items():
            if not isinstance(r, dict):
                continue
            peak = f"{r['peak_gib']:.2f} / {r['peak_reserved_gib']:.2f} GiB" if r["peak_gib"] is not None else "-"
            above = f", {r['peak_above_weights_gib']:.2f} GiB above the resident weights" if r.get(
                "peak_above_weights_gib") is not None else ""  # fmt: skip
            batches = f" ({r['x_realtime_batches']:,.0f}x first batch to end)" if "x_realtime_batches" in r else ""
            print(f"  {name}: {r['x_realtime']:,.0f}x{batches}, {r['seconds']:.2f} s, "
                  f"peak alloc / reserved {peak}{above}")  # fmt: skip
    if "profile" in results:
        p = results["profile"]
        print(f"\nprofile: ours eager, batch 32 of 10 s: {p['kernel_ms']:.1f} ms of kernels, "
              f"layout conversions {p['layout_conversion_share']:.1%}")  # fmt: skip
        for r in p["top"][:12]:
            print(f"  {r['share']:6.1%} {r['ms']:8.2f} ms {r['calls']:4d}x {r['kernel']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--preset", default="qwen3-omni")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cudnn-benchmark", action="store_true")
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-s", type=float, default=2.0)
    parser.add_argument("--max-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--e2e-repeats", type=int, default=2, help="warm runs of the Trainer")
    parser.add_argument("--group-costs", type=int, nargs="*", default=[], help="e2e again with these plan costs")
    parser.add_argument("--no-peer", action="store_true", help="e2e without the transformers loop")
    parser.add_argument("--fused-variant", action="store_true",
                        help="e2e again with fast_decoder.FUSE_POINTWISE on (the fused residual GEMM)")  # fmt: skip
    parser.add_argument("--check-requests", type=int, default=96, help="requests compared with solo decodes")
    parser.add_argument("--fwd-batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--compile-batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--latency-repeats", type=int, default=20)
    parser.add_argument("--fidelity-clips", type=int, default=4)
    parser.add_argument("--long-s", type=float, default=600.0)
    parser.add_argument("--profile-out", default=None)
    parser.add_argument("--out", default="bench_gpu.json")
    args = parser.parse_args()
    sections = [s for s in args.only.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {','.join(SECTIONS)}")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("omni_lightning.models.cuda_graphs").setLevel(logging.INFO)
    bench = Bench(args)
    for section in SECTIONS:
        if section in sections:
            start = time.perf_counter()
            bench.results[section] = getattr(bench, section)()
            bench.results[section]["section_s"] = time.perf_counter() - start
            bench.save()
            free_memory()
            print(f"  section {section}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    print_tables(bench.results)


if __name__ == "__main__":
    main()
