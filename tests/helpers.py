"""Helpers the test files share (conftest.py re-exports the model ones; fixtures live there)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, Callback
from torch.utils.data import DataLoader

from omni_lightning import (
    Code2Wav,
    Code2WavConfig,
    Code2WavModule,
    CodesDataModule,
    CodesDataset,
    OmniModelRunnerOutput,
    Trainer,
    WaveformWriter,
    collate_codes,
    randomize_weights,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = Code2WavConfig.from_name("tiny")
PCM16 = 1.5 / 2**15  # PCM_16 rounding

# Small enough for many forwards in a test, with the real 1920x geometry.
MICRO = dict(
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=32,
    decoder_dim=16,
)


def micro_config(**overrides) -> Code2WavConfig:
    return Code2WavConfig.from_name("tiny", **{**MICRO, "name": "micro", **overrides})


def random_model(config: Code2WavConfig | str = "tiny", seed: int = 0) -> Code2Wav:
    return randomize_weights(Code2Wav(config), seed=seed).eval()


def random_codes(batch: int, frames: int, config: Code2WavConfig | None = None, seed: int = 0) -> torch.Tensor:
    config = config or Code2WavConfig.from_name("tiny")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.codebook_size, (batch, config.num_quantizers, frames), generator=gen)


def reference_model(model: Code2Wav):
    """transformers' Qwen3OmniMoeCode2Wav holding the same weights (the numerical reference)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    ref = Qwen3OmniMoeCode2Wav._from_config(Qwen3OmniMoeCode2WavConfig(**model.config.to_hf()))
    ref.load_state_dict(model.state_dict(), strict=True)
    return ref.eval()


LENGTHS = [9, 1, 23, 4, 17, 2, 30]


def trainer_kwargs(**kw):
    """A quiet one-device CPU Trainer's arguments; ``kw`` adds to them or overrides them."""
    quiet = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    return {**quiet, "enable_model_summary": False, **kw}


def precision_kwargs(precision, accelerator="cpu"):
    """Trainer arguments for ``precision`` on ``accelerator``. 16-mixed through a GradScaler whose first
    scale (4,096) does not overflow this model's first step, so that step is taken, not skipped (the
    default, 65,536, skips it on CUDA); on the CPU a CPU GradScaler (Lightning itself turns CPU
    16-mixed into bf16-mixed), so the scaler's path runs as it does on CUDA."""
    if precision != "16-mixed":
        return {"precision": precision, "accelerator": accelerator}
    from lightning.pytorch.plugins import MixedPrecision

    device = "cpu" if accelerator == "cpu" else "cuda"
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
    return {"plugins": [MixedPrecision("16-mixed", device, scaler=scaler)], "accelerator": accelerator}


def read_until(proc: subprocess.Popen, marker: str, timeout: float = 300) -> tuple[list[str], threading.Thread]:
    """Reads ``proc``'s stdout on a thread until ``marker`` appears, the process ends or ``timeout``
    passes; returns the list the thread keeps filling (joined: everything printed) and the thread."""
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(iter(lambda: proc.stdout.read(64), "")), daemon=True)
    reader.start()
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline and marker not in "".join(printed):
        time.sleep(0.02)
    return printed, reader


def requests(lengths=LENGTHS, seed=0):
    return {f"utt{i:02d}": random_codes(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)}


def loader(reqs, batch_size=3, **kw):
    ds = CodesDataset(reqs, "tiny", **kw)
    return DataLoader(ds, batch_size=batch_size, collate_fn=collate_codes)


class RecordingCapture:
    """A CUDA-graph capture stand-in on the CPU: "replaying" runs the function again into its output."""

    def __init__(self):
        self.recorded = 0

    def __call__(self, fn):
        out = fn()
        self.recorded += 1
        return (lambda: out.copy_(fn())), out


class ReplayCapture:
    """A CUDA-graph capture stand-in on the CPU that replays as a graph does: the capture records the
    forward's aten ops (as dispatched: after autocast) with the very tensors they read and wrote, and a
    replay runs those ops again on those tensors, whatever the module's parameters point at by then
    and whatever autocast is on. A host sync in the forward fails the capture, as on CUDA."""

    def __init__(self):
        self.recorded = 0

    def __call__(self, fn):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        from omni_lightning.engine.bucket_graphs import CaptureError

        ops = []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    raise CaptureError("a host sync (.item()) in a captured forward")
                out = func(*args, **(kwargs or {}))
                ops.append((func, args, kwargs or {}, out))
                return out

        fn()  # the warm-up
        with Record():
            out = fn()
        self.recorded += 1

        def replay():
            with torch.inference_mode(), torch.autocast("cpu", enabled=False):
                for func, args, kwargs, recorded in ops:
                    for old, new in zip(tree_leaves(recorded), tree_leaves(func(*args, **kwargs))):
                        if isinstance(old, torch.Tensor) and old.data_ptr() != new.data_ptr():  # not a view
                            old.copy_(new)  # where the graph's kernel wrote it

        return replay, out


class Collector(BasePredictionWriter):
    def __init__(self, interval):
        super().__init__(interval)
        self.batches, self.epoch = [], None

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        assert isinstance(prediction, OmniModelRunnerOutput)
        self.batches.append((list(batch_indices), prediction.req_ids, prediction.pooler_output))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epoch = (predictions, batch_indices)


def cli(*args, extra_env=None, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(extra_env or {})}
    # a test that ran W&B in this process left its service's address here; a subprocess that
    # inherits it hands its run to that service, which finishes it on its own time (a user's
    # command starts its own)
    env.pop("WANDB_SERVICE", None)
    cmd = [sys.executable, "-m", "omni_lightning.cli", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def save_model(folder: Path) -> Path:
    random_model("tiny", seed=4).save_pretrained(folder)
    return folder


def waveforms(preds):
    """req_id -> waveform, from predictions of one or several dataloaders."""
    outs = [o for p in preds for o in (p if isinstance(p, list) else [p])]
    return {r: o.pooler_output[i]["model_outputs"] for o in outs for i, r in enumerate(o.req_ids)}


class FailingModule(Code2WavModule):
    def __init__(self, fail_at, exc=RuntimeError, **kw):
        super().__init__(**kw)
        self.fail_at, self.exc = fail_at, exc

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        if batch_idx == self.fail_at:
            raise self.exc("boom")
        return super().predict_step(batch, batch_idx)


def write_codes(folder: Path, lengths, bad=()):
    """A manifest over .npy code files; `bad` names entries to break (missing or out of range)."""
    (folder / "codes").mkdir(parents=True)
    rows = []
    for i, n in enumerate(lengths):
        rid = f"r{i:03d}"
        codes = random_codes(1, n, seed=i)[0].numpy()
        if rid in bad and bad[rid] == "range":
            codes[0, 0] = 4096
        if not (rid in bad and bad[rid] == "missing"):
            np.save(folder / "codes" / f"{rid}.npy", codes)
        rows.append({"id": rid, "codes": f"codes/{rid}.npy"})
    manifest = folder / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def manifest_rows(out: Path):
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


class SigtermInLastBatch(Callback):
    """Sends this process SIGTERM as predict's last batch ends (a scheduler's stop arriving late): a
    ``--trainer.callbacks+=helpers.SigtermInLastBatch`` for a command run with ``tests`` on its path."""

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.predict_loop.batch_progress.is_last_batch:
            os.kill(os.getpid(), signal.SIGTERM)


def predict_to(out, source, model, **data_kw):
    writer = WaveformWriter(out)
    data = CodesDataModule(predict=source if isinstance(source, dict) else str(source), skip_done=out, **data_kw)
    Trainer(**trainer_kwargs(callbacks=[writer])).predict(
        Code2WavModule(model=model), datamodule=data, return_predictions=False
    )
    return writer


def rows(out):
    return {r["id"]: r for r in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}


def assert_wav(out, row, codes, model):
    import soundfile as sf

    data, sr = sf.read(out / row["path"], dtype="float32")
    with torch.inference_mode():
        want = model(torch.as_tensor(np.asarray(codes, dtype=np.int64))[None])[0, 0].numpy()
    assert sr == 24000 and data.shape == want.shape and np.abs(data - want).max() <= PCM16


def write_manifest(folder, items):
    """items: [(id, codes array)]; one .npy per line, named by position."""
    (folder / "codes").mkdir(parents=True)
    lines = []
    for i, (req_id, codes) in enumerate(items):
        np.save(folder / "codes" / f"{i}.npy", codes)
        lines.append(json.dumps({"id": req_id, "codes": f"codes/{i}.npy"}))
    (folder / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "manifest.jsonl"


class CtrlCAfterFirstStep(Callback):
    """Sends this process SIGINT (Ctrl-C) once fit's first optimizer step is done: a
    ``--trainer.callbacks+=helpers.CtrlCAfterFirstStep`` for a command run with ``tests`` on its path."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            os.kill(os.getpid(), signal.SIGINT)


def bf16_errors(kernel_sets):
    """qwen3-omni (random weights) on CUDA: each of ``kernel_sets`` (name: ``Kernels``) in bf16, its relative
    L2 error against the fp32 forward of the plain layers (a GPU fidelity check of a fused path)."""
    from conftest import random_model

    from omni_lightning.kernels import Kernels

    model = random_model("qwen3-omni", seed=0).cuda()
    codes = random_codes(2, 40, model.config, seed=1).cuda()
    with torch.inference_mode():
        want = model(codes, kernels=Kernels()).double()
        low = model.to(torch.bfloat16)
        errors = {}
        for name, kernels in kernel_sets.items():
            got = low(codes, kernels=kernels).double()
            errors[name] = float((got - want).norm() / want.norm())
    return errors
