"""bf16-true fine-tuning keeps every AdamW update: fp32 master weights (``training/master_weights.py``).

Without them, an update below half a bf16 step of its weight is rounded away, so the same weights
move at every step and the rest never do. With them, every step changes every fp32 copy, and the
bf16 weights move as the copies cross rounding boundaries.
"""

import io

import lightning.pytorch as pl
import pytest
import torch
from helpers import micro_config, random_model, trainer_kwargs
from torch.utils.data import DataLoader

from omni_lightning import Code2WavModule, Trainer, collate_codes
from omni_lightning.training.master_weights import MasterWeightAdamW
from omni_lightning.training.schedule import WarmupCosine, adamw_with_schedule, fused_adamw


def one_frame_pairs(config, count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = config.output_length(1)
    return [
        {
            "id": str(i),
            "codes": torch.randint(0, config.codebook_size, (16, 1), generator=gen),
            "audio": 0.1 * torch.randn(samples, generator=gen),
            "audio_length": samples,
        }
        for i in range(count)
    ]


class Weights(pl.Callback):
    """The generator's trainable weights (the code embedding excepted: rows a batch does not look up
    get no gradient) at the start and after every step, the optimizer's fp32 copies around the last
    step, and which weights ever had a gradient (on 1-frame crops some never do: the attention's
    queries and keys over one frame, convolution taps that only see the zero history)."""

    def __init__(self, steps):
        self.steps, self.after, self.copies, self.had_gradient = steps, [], [], {}

    @staticmethod
    def named(module):
        return {n: p for n, p in module.model.named_parameters() if p.requires_grad and not n.startswith("code_")}

    def on_train_start(self, trainer, pl_module):
        self.start = {n: p.detach().clone() for n, p in self.named(pl_module).items()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if len(self.after) == self.steps - 1:
            self.copies.append(self.fp32_copies(trainer, pl_module))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for n, p in self.named(pl_module).items():
            self.had_gradient[n] = self.had_gradient.get(n, False) | (p.grad != 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append({n: p.detach().clone() for n, p in self.named(pl_module).items()})
        if len(self.after) == self.steps:
            self.copies.append(self.fp32_copies(trainer, pl_module))

    def fp32_copies(self, trainer, pl_module):
        copies = {id(p): m for p, m in trainer.optimizers[0].master_weights()}
        return {n: copies[id(p)].clone() for n, p in self.named(pl_module).items()}


def moved(weights, start, where=None):
    """The share of the weights (of those ``where`` is true) that differ between ``weights`` and ``start``."""
    where = where or {n: torch.ones_like(t, dtype=torch.bool) for n, t in start.items()}
    changed = sum(int(((weights[n] != start[n]) & where[n]).sum()) for n in start)
    return changed / sum(int(w.sum()) for w in where.values())


def test_bf16_true_keeps_every_update_in_fp32_copies():
    config, steps = micro_config(), 6
    module = Code2WavModule(model=random_model(config, seed=1), learning_rate=1e-4, total_steps=10**6)
    weights = Weights(steps)
    trainer = Trainer(**trainer_kwargs(max_steps=steps, precision="bf16-true", callbacks=[weights]))
    trainer.fit(module, DataLoader(one_frame_pairs(config, 2 * steps), batch_size=2, collate_fn=collate_codes))
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, MasterWeightAdamW)
    assert optimizer.fp32.defaults["fused"]  # the CPU has torch's fused AdamW, and no GradScaler runs
    assert all(p.dtype == torch.bfloat16 for p in module.model.parameters())
    before, after = weights.copies
    assert all(m.dtype == torch.float32 for m in after.values())
    with_gradient = sum(int(w.sum()) for w in weights.had_gradient.values())
    assert with_gradient > 0.85 * sum(w.numel() for w in weights.had_gradient.values())
    # the last step changed every copy with a gradient but a few whose update is below fp32's own rounding
    assert moved(after, before, weights.had_gradient) > 0.999
    for p, m in optimizer.master_weights():  # the weights are the copies, rounded to nearest
        assert torch.equal(p, m.to(p.dtype))
    first, last = moved(weights.after[0], weights.start), moved(weights.after[-1], weights.start)
    assert 0 < first < 0.5 and last > 2 * first, (first, last)  # plain bf16 AdamW: last == first


def test_fp32_parameters_get_plain_adamw():
    module = Code2WavModule(model=random_model(micro_config()), total_steps=10)
    trainer = Trainer(**trainer_kwargs(max_steps=1))
    trainer.fit(module, DataLoader(one_frame_pairs(module.config, 2), batch_size=2, collate_fn=collate_codes))
    assert type(trainer.optimizers[0]) is torch.optim.AdamW and trainer.optimizers[0].defaults["fused"]


def test_fused_adamw_where_torch_has_it_under_plain_precision():
    from lightning.pytorch.plugins import HalfPrecision, MixedPrecision, Precision

    assert fused_adamw(torch.device("cpu"), Precision()) and fused_adamw(torch.device("cuda", 1), Precision())
    assert fused_adamw(torch.device("cuda"), HalfPrecision("bf16-true"))
    assert not fused_adamw(torch.device("meta"), Precision())
    # bf16-mixed scales nothing: fused (the module clips past Lightning's refusal); 16-mixed's fused AdamW
    # would unscale its gradients after the clipping
    assert fused_adamw(torch.device("cuda"), MixedPrecision("bf16-mixed", "cuda"))
    assert not fused_adamw(torch.device("cuda"), MixedPrecision("16-mixed", "cpu", scaler=None))


def test_bf16_mixed_fits_with_fused_adamw_and_clips_its_gradients():
    """Lightning's bf16-mixed plugin refuses to clip a fused optimizer's gradients; the module clips them
    itself: the step's gradient norm, measured after clipping, is the clip (the raw one is far above it)."""

    class Norms(pl.Callback):
        def __init__(self):
            self.clipped = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # the step's clipped gradients
            grads = [p.grad for p in pl_module.model.parameters() if p.grad is not None]
            self.clipped.append(float(torch.nn.utils.get_total_norm(grads)))

    norms = Norms()
    module = Code2WavModule(model=random_model(micro_config()), total_steps=10, grad_clip=1e-3)
    trainer = Trainer(**trainer_kwargs(max_steps=2, precision="bf16-mixed", callbacks=[norms]))
    trainer.fit(module, DataLoader(one_frame_pairs(module.config, 2), batch_size=2, collate_fn=collate_codes))
    assert type(trainer.optimizers[0]) is torch.optim.AdamW and trainer.optimizers[0].defaults["fused"]
    assert len(norms.clipped) == 2 and all(abs(n - 1e-3) < 1e-5 for n in norms.clipped), norms.clipped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_step_agrees_with_the_foreach_step(dtype):
    """Fused (CUDA's default here) and foreach AdamW, with master weights (bf16) and without (fp32)."""
    layers = [bf16_linear(0).to(dtype) for _ in range(2)]
    schedule = WarmupCosine(0, 100, 0.1)
    optimizers = [
        adamw_with_schedule(layer.parameters(), schedule, fused, lr=1e-3, weight_decay=0.1)[0]
        for layer, fused in zip(layers, (False, True))
    ]
    for seed in range(4):
        for optimizer, layer in zip(optimizers, layers):
            step(optimizer, layer, seed)
    if dtype == torch.bfloat16:
        assert all(isinstance(o, MasterWeightAdamW) for o in optimizers) and optimizers[1].fp32.defaults["fused"]
        pairs = zip(*(o.master_weights() for o in optimizers))
        for (_, a), (_, b) in pairs:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    else:
        assert optimizers[1].defaults["fused"] and not optimizers[0].defaults["fused"]
    start = bf16_linear(0).to(dtype)
    for a, b, s in zip(*(layer.parameters() for layer in (*layers, start))):
        assert not torch.equal(a, s)  # the steps moved the weights
        torch.testing.assert_close(a, b, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-7)


def bf16_linear(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 32).to(torch.bfloat16)


def step(optimizer, layer, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    optimizer.step()


@pytest.mark.parametrize("load", [True, False])
def test_a_resumed_optimizer_continues_from_the_fp32_copies(load):
    layer = bf16_linear(0)
    optimizer = MasterWeightAdamW(layer.parameters(), lr=1e-4, weight_decay=0.1)
    for seed in range(3):
        step(optimizer, layer, seed)
    optimizer.param_groups[0]["lr"] = 3e-4  # as a schedule would leave it
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)  # as a checkpoint holds it

    resumed = bf16_linear(1)
    resumed.load_state_dict(layer.state_dict())  # the bf16 weights, as the checkpoint restores them
    other = MasterWeightAdamW(resumed.parameters(), lr=1e-4, weight_decay=0.1)
    if load:
        buffer.seek(0)
        other.load_state_dict(torch.load(buffer))
    step(optimizer, layer, 3)
    step(other, resumed, 3)
    copies = [m for _, m in optimizer.master_weights()]
    same = all(torch.equal(a, b) for a, b in zip(copies, (m for _, m in other.master_weights())))
    # loaded: the same copies, moments, step count and lr; not loaded: copies rounded from bf16, fresh moments
    assert same == load
    if load:
        assert all(torch.equal(a, b) for a, b in zip(layer.parameters(), resumed.parameters()))


def test_the_schedules_learning_rate_reaches_the_fp32_step():
    layer = bf16_linear(0)
    optimizer = MasterWeightAdamW(layer.parameters(), lr=1e-3, weight_decay=0.0)
    copies = [m.clone() for _, m in optimizer.master_weights()]
    optimizer.param_groups[0]["lr"] = 0.0
    step(optimizer, layer, 0)
    assert all(torch.equal(a, m) for a, (_, m) in zip(copies, optimizer.master_weights()))
    optimizer.param_groups[0]["lr"] = 1e-3
    step(optimizer, layer, 1)
    assert not any(torch.equal(a, m) for a, (_, m) in zip(copies, optimizer.master_weights()))
