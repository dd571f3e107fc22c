"""The fast training path against the plain one: 10 optimizer steps of a real fit from the same seed,
in fp32, give the same losses and gradients, and validation after them the same losses.

The fast path is ``Kernels.for_training``'s Triton SnakeBeta forward and backward and the residual units'
fused convolution + SnakeBeta forward and backward (``kernels/conv_snake.py``, in fp32 here: on CUDA it
takes 16-bit only, and the micro model's 32-channel units take it); here they run in Triton's
interpreter (``TRITON_INTERPRET=1``, in a subprocess), with libdevice's sine (``precise=True``: the
interpreter cannot run inline PTX), chosen through the module's ``configure_training_kernels`` hook.
The plain path is ``fast_training=False``. The script counts the
Triton calls of each path, so a module that ignored its kernels fails rather than comparing the
reference with itself. The CUDA twin of this test is in ``test_gpu_model.py``.

The objective is the mel loss alone (``stft_weight=0``) at a learning rate of 1e-4. The STFT loss's
log magnitudes amplify fp32 rounding, so any two implementations part over ten steps with it (with the
floored log of issue 41 the losses still part by 1.5e-3 at step 10, measured on the CPU; with the old
clamped log, after a step or two). AdamW at 1e-3 amplifies it too on this 64-channel decoder (its step
does not shrink with a gradient near zero): from gradients 1.5e-6 apart at step 1, the losses parted by
1e-4 at step 10 with the SnakeBeta kernels alone and with the fused convolution too (measured on the
CPU); at 1e-4 they stay within 3e-7. Tolerances allow
fp32 rounding carried by AdamW through ten steps: loss <= 1e-5; all gradients <= 1e-5 at step 1 and
<= 2e-4 at every step; any parameter's <= 1e-3 at step 1 and <= 2e-2 at every step. A wrong
gradient of any one input of the op misses these by orders of magnitude.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 10
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = (1e-5, 2e-4)  # all gradients: (step 1, any step)
PARAMETER_TOLERANCE = (1e-3, 2e-2)  # the worst parameter's gradient: (step 1, any step)


def fit_both_paths() -> dict:
    """Runs in the interpreter's subprocess: fits the fast and the plain path, returns their differences."""
    import lightning.pytorch as pl
    import torch
    from helpers import micro_config, random_model, trainer_kwargs
    from torch.utils.data import DataLoader

    from omni_lightning import Code2Wav, Code2WavModule, Trainer, collate_codes
    from omni_lightning.kernels import Kernels
    from omni_lightning.kernels.conv_snake import conv_snake_triton_autograd
    from omni_lightning.kernels.snake_beta import snake_beta_triton_autograd

    calls = {"triton": 0, "conv_snake": 0}

    class Interpreted(Code2WavModule):
        def configure_training_kernels(self, device):
            def snake_beta(*args, **kwargs):
                calls["triton"] += 1
                return snake_beta_triton_autograd(*args, precise=True, **kwargs)

            def conv_snake(*args, **kwargs):
                calls["conv_snake"] += 1
                return conv_snake_triton_autograd(*args, precise=True, **kwargs)

            return Kernels(snake_beta, name="triton-autograd, interpreted", conv_snake=conv_snake,
                           conv_snake_dtypes=(torch.float32,), conv_snake_grad=True)  # fmt: skip

    class Record(pl.Callback):
        def __init__(self):
            self.losses, self.grads = [], []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # before clipping
            self.grads.append({n: p.grad.clone() for n, p in pl_module.model.named_parameters() if p.grad is not None})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    config = micro_config(decoder_dim=64)  # the first decoder block's units: 32 channels, which conv_snake takes
    base = random_model(config, seed=3)
    gen = torch.Generator().manual_seed(0)
    items = []
    for i in range(2 * (STEPS + 1)):  # batches of a 2-frame and a 1-frame crop (right-padded)
        frames = 2 - i % 2
        samples = config.output_length(frames)
        items.append(
            {
                "id": str(i),
                "codes": torch.randint(0, config.codebook_size, (16, frames), generator=gen),
                "audio": 0.1 * torch.randn(samples, generator=gen),
                "audio_length": samples,
            }
        )
    train = DataLoader(items[: 2 * STEPS], batch_size=2, collate_fn=collate_codes)
    val = DataLoader(items[2 * STEPS :], batch_size=2, collate_fn=collate_codes)
    runs = {}
    for fast in (True, False):
        calls["triton"] = calls["conv_snake"] = 0
        model = Code2Wav(config)
        model.load_state_dict(base.state_dict())
        module = Interpreted(model=model, fast_training=fast, learning_rate=1e-4, total_steps=10**6, stft_weight=0.0)
        record = Record()
        trainer = Trainer(**trainer_kwargs(max_steps=STEPS, callbacks=[record]))  # fit: no validation
        trainer.fit(module, train_dataloaders=train)
        fit_calls, fit_conv = calls["triton"], calls["conv_snake"]
        validated = trainer.validate(module, dataloaders=val, verbose=False)[0]
        runs[fast] = dict(
            losses=record.losses,
            grads=record.grads,
            val=validated["val/loss"],
            kernels=module.training_kernels.name,
            fit_calls=fit_calls,
            val_calls=calls["triton"] - fit_calls,
            conv_calls=[fit_conv, calls["conv_snake"] - fit_conv],
        )
    fast, plain = runs[True], runs[False]
    loss_errors = [abs(a - b) / abs(b) for a, b in zip(fast["losses"], plain["losses"])]
    grad_errors, parameter_errors = [], []
    for got, want in zip(fast["grads"], plain["grads"]):
        assert got.keys() == want.keys()
        diff = sum(float((got[n] - want[n]).square().sum()) for n in want) ** 0.5
        grad_errors.append(diff / sum(float(want[n].square().sum()) for n in want) ** 0.5)
        parameter_errors.append(
            max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want if float(want[n].norm()) > 0)
        )
    return {
        "steps": [len(fast["losses"]), len(plain["losses"]), len(fast["grads"]), len(plain["grads"])],
        "kernels": [fast["kernels"], plain["kernels"]],
        "calls": [fast["fit_calls"], fast["val_calls"], plain["fit_calls"], plain["val_calls"]],
        "conv_calls": fast["conv_calls"] + plain["conv_calls"],
        "loss": loss_errors,
        "grad": grad_errors,
        "parameter": parameter_errors,
        "val": abs(fast["val"] - plain["val"]) / abs(plain["val"]),
    }


def test_fast_training_path_gives_the_reference_losses_and_gradients_over_ten_steps():
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == [STEPS] * 4
    assert result["kernels"] == ["triton-autograd, interpreted", "reference, fp32 conv-transpose input grads"]
    conv_units = 3  # the first decoder block's (32 channels); the later blocks' are narrower than conv_snake takes
    snake_layers = 29 - conv_units  # micro's SnakeBetas (4 decoder blocks of 7 and the last one) less the fused
    fast_fit, fast_val, plain_fit, plain_val = result["calls"]
    assert fast_fit == STEPS * snake_layers and fast_val == snake_layers and plain_fit == plain_val == 0
    assert result["conv_calls"] == [STEPS * conv_units, conv_units, 0, 0], result["conv_calls"]
    assert max(result["loss"]) <= LOSS_TOLERANCE, result["loss"]
    for key, (first, any_step) in (("grad", GRAD_TOLERANCE), ("parameter", PARAMETER_TOLERANCE)):
        assert result[key][0] <= first and max(result[key]) <= any_step, (key, result[key])
    assert result["val"] <= LOSS_TOLERANCE, result["val"]


if __name__ == "__main__":  # the subprocess: TRITON_INTERPRET=1 is set before anything imports Triton
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(json.dumps(fit_both_paths()))
