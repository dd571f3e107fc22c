"""The real command on a GPU under a small memory cap: code files in, audio files out, every request
equal to its own decode (CUDA only; the CPU runs of the command are in test_cli.py and test_cli_jobs.py)."""

import json
import random
import time

import numpy as np
import pytest
import soundfile as sf
import torch
from helpers import cli, random_codes, random_model, save_model

pytestmark = pytest.mark.gpu  # every test here needs CUDA


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_cli_predict_on_cuda_under_a_small_cap_writes_every_request_exact(tmp_path, precision, no_tf32):
    ckpt = save_model(tmp_path / "ckpt")
    rng = random.Random(precision)
    src = tmp_path / "codes in"
    lengths = {f"batch {i // 10}/utt {i}": rng.randint(4, 400) for i in range(30)}  # 0.3-32 s, random
    lengths["long/one of 160 s"] = 2000
    for i, (req_id, n) in enumerate(lengths.items()):
        path = src / f"{req_id}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        dtype = (np.uint16, np.int64, np.int32)[i % 3]
        np.save(path, random_codes(1, n, seed=200 + i)[0].numpy().astype(dtype))
    (src / "README.txt").write_text("a stray file")
    out = tmp_path / "wavs out"
    args = ["predict", "--config", "configs/predict.yaml", "--model.checkpoint", str(ckpt), "--data.predict",
            str(src), "--out_dir", str(out), "--trainer.accelerator", "gpu", "--trainer.precision", precision,
            "--trainer.gpu_memory_utilization", "0.02", "--subtype", "FLOAT", "--data.batch_size", "8"]  # fmt: skip
    env = {"NVIDIA_TF32_OVERRIDE": "0"}  # fp32 means fp32 in the command too (cuDNN and cuBLAS)
    proc = cli(*args, extra_env=env)
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log
    assert f"predict: {len(lengths)} requests written" in log and "README.txt" in log, log
    rows = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(lengths) and all(r["status"] == "ok" for r in rows)
    model = random_model("tiny", seed=4).cuda()  # save_model's weights
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    worst = 0.0
    with torch.inference_mode():
        for row in rows:
            codes = torch.as_tensor(np.load(src / f"{row['id']}.npy").astype(np.int64))
            want = model(codes[None].cuda())[0, 0].float().cpu().numpy()
            got, sr = sf.read(out / row["path"], dtype="float32")
            assert sr == 24000 and got.shape == want.shape, row
            if precision == "32-true":
                assert np.abs(got - want).max() <= 1e-4, row
            worst = max(worst, rel_l2(got, want))
    assert worst <= (1e-4 if precision == "32-true" else 1e-1), worst  # bf16: other shapes round otherwise
    start = time.perf_counter()
    again = cli(*args, extra_env=env)
    log = again.communicate(timeout=600)[0]
    assert again.returncode == 0 and "nothing left to do" in log, log
    assert len((out / "manifest.jsonl").read_text().splitlines()) == len(lengths)  # written once
    print(f"no-op rerun: {time.perf_counter() - start:.2f} s")
