"""The default GPU predict path on a real mixed-length job, under memory caps, and its bf16 fidelity
(``pytest -m gpu``; skipped without CUDA).

The default ``omni_lightning.Trainer`` (async host copies on) and ``Code2WavModule`` (the decode
engine with Triton kernels and CUDA graphs) are tested with nothing changed but the memory cap.
"""

import gc
import random

import pytest
import torch
from conftest import random_codes, random_model, reference_model
from helpers import trainer_kwargs

from omni_lightning import Code2Wav, Code2WavModule, CodesDataModule, DecodeEngine, Trainer
from omni_lightning.callbacks import AsyncD2HCallback

pytestmark = pytest.mark.gpu  # every test here needs CUDA


def rel_l2(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(("precision", "share"), [("32-true", 0.02), ("bf16-true", None), ("bf16-true", 0.03)])
def test_default_trainer_mixed_lengths_equal_solo_decodes(precision, share, no_tf32):
    gc.collect()  # earlier tests' engines and training graphs, if unreachable, must not count against the share
    torch.cuda.empty_cache()
    rng = random.Random(precision)
    lengths = [rng.randint(25, 375) for _ in range(40)] + [2000]  # 2-30 s, random; one of 160 s
    reqs = {f"req {i}/x": random_codes(1, n, seed=100 + i)[0] for i, n in enumerate(lengths)}
    module = Code2WavModule(model=random_model("tiny", seed=11))
    trainer = Trainer(**trainer_kwargs(accelerator="gpu", precision=precision, gpu_memory_utilization=share))
    assert any(isinstance(cb, AsyncD2HCallback) for cb in trainer.callbacks)
    preds = trainer.predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=8))
    got = {r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)}
    assert sorted(got) == sorted(reqs)
    stats = module.engine_stats  # short forwards replay graphs, long ones run eagerly
    assert stats["failures"] == 0
    if share is not None:  # the engine is kept, with its weights, graphs and state, within the cap
        assert module.engine is not None
        assert torch.cuda.get_per_process_memory_fraction(0) == 1.0  # the cap held during predict only
        assert torch.cuda.memory_reserved() <= share * torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0)  # the solo decodes below are the reference, uncapped
    model = module.model.cuda()  # in the trainer's dtype; Lightning moved it back to the CPU
    worst = 0.0
    with torch.inference_mode():
        for req_id, codes in reqs.items():
            alone = model(codes[None].cuda())[0].float().cpu()  # eager, this request's own shape
            assert got[req_id].shape == alone.shape and got[req_id].device.type == "cpu"
            if precision == "32-true":
                assert (got[req_id] - alone).abs().max() <= 1e-4, req_id
            worst = max(worst, rel_l2(got[req_id], alone))
    # bf16: other shapes pick other kernels, so roundings differ; a misplaced or mistrimmed request
    # would be off by ~100 %
    bf16_tolerance = 1e-1
    assert worst <= (1e-4 if precision == "32-true" else bf16_tolerance), worst
    # a second predict (the module moved to the CPU and back in between)
    kept = dict(module.engine.graphs.graphs)
    torch.cuda.empty_cache()  # the solo decodes' blocks (the trainer caps the process again at its predict)
    again = trainer.predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=8))
    # the engine was kept (weights, state); Lightning's CUDA teardown freed the cuBLAS workspaces its graphs
    # recorded, so they were captured again, not replayed into freed memory (engine/cuda_capture.py)
    assert module.engine.graphs.graphs and not any(module.engine.graphs.graphs.get(k) is g for k, g in kept.items())
    assert module.engine_stats["failures"] == 0 and module.engine_stats["replays"] > stats["replays"]
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0  # lifted again: the next test is not capped
    second = {r: o.pooler_output[i]["model_outputs"] for o in again for i, r in enumerate(o.req_ids)}
    assert max(rel_l2(second[r], got[r]) for r in reqs) <= (1e-5 if precision == "32-true" else bf16_tolerance)


def test_bf16_fidelity_guard_against_transformers_bf16(no_tf32):
    from omni_lightning.training.losses import MultiResolutionMelLoss

    base = random_model("qwen3-omni", seed=0)
    codes = random_codes(4, 125, base.config, seed=5).cuda()  # four 10 s clips
    with torch.inference_mode():
        want = reference_model(base).cuda()(codes).float()  # fp32, TF32 off
        theirs = reference_model(base).cuda().to(torch.bfloat16)(codes).float()
        ours_model = Code2Wav(base.config).cuda().to(torch.bfloat16).eval()
        ours_model.load_state_dict(base.state_dict())
        engine = DecodeEngine(ours_model)
        engine.decode(codes, [125] * 4)  # captures
        ours = torch.stack(engine.decode(codes, [125] * 4))  # the default predict path: graph replays
    assert engine.graphs.stats.failures == 0
    mel = MultiResolutionMelLoss(base.config.sample_rate).cuda()
    ours_err, theirs_err = rel_l2(ours, want), rel_l2(theirs, want)
    ours_mel, theirs_mel = float(mel(ours[:, 0], want[:, 0])), float(mel(theirs[:, 0], want[:, 0]))
    assert ours_err <= theirs_err, (ours_err, theirs_err)
    assert ours_mel <= theirs_mel, (ours_mel, theirs_mel)


def test_a_budget_too_large_for_the_cap_falls_back_and_finishes_exact():
    """qwen3-omni under a 0.02 cap (sglang-omni's share) with a frame budget far past it:
    forwards run out of memory, the engine halves its budget until they fit (at one frame, without CUDA
    graphs), and every request is still its own decode."""
    gc.collect()  # earlier tests' engines (their graphs' pools), if unreachable, must not count against the cap
    base = random_model("qwen3-omni", seed=0)
    lengths = [3000, 2500, 125, 7]  # a first forward of ~7,500 frames: far past the cap, whatever is cached
    reqs = {f"r{i}": random_codes(1, n, base.config, seed=i)[0] for i, n in enumerate(lengths)}
    module = Code2WavModule(model=base, frames_per_forward=8192)
    torch.cuda.empty_cache()  # this test's own peak, not the earlier tests' cached blocks
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(**trainer_kwargs(accelerator="gpu", precision="bf16-true", gpu_memory_utilization=0.02))
    preds = trainer.predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=4))
    got = {r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)}
    assert module.engine_stats["frames_per_forward"] < 8192  # it shrank
    assert torch.cuda.max_memory_reserved() <= 0.0201 * torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0)
    model = module.model.cuda()
    with torch.inference_mode():
        for r, codes in reqs.items():
            alone = model(codes[None].cuda())[0].float().cpu()
            # bf16 of other shapes: roundings differ (a misplaced request would be ~100 % off)
            assert got[r].shape == alone.shape and rel_l2(got[r], alone) <= 1e-1, r


def test_a_share_too_small_for_one_frame_fails_at_once_with_the_figures():
    module = Code2WavModule(model=random_model("tiny", seed=5))
    trainer = Trainer(**trainer_kwargs(accelerator="gpu", gpu_memory_utilization=1e-5))
    with pytest.raises(torch.OutOfMemoryError, match=r"gpu_memory_utilization=1e-05 leaves no room .* allows 0\.00"):
        trainer.predict(module, datamodule=CodesDataModule(predict={"a": random_codes(1, 30)[0]}, batch_size=1))
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0  # the cap is lifted after the failure


@pytest.mark.parametrize("share", [0.02, 0.03, 0.05, 0.1, 0.2])
def test_the_budget_is_right_the_first_time_at_any_share(share, no_tf32):
    """qwen3-omni, bf16, the default Trainer at shares 0.02-0.2 of this card: a job of 2-30 s requests
    and one of 90 s runs at the frame budget the engine chose when it was built (no out-of-memory
    fallback) and within the cap. Prints the budget and the peak (pytest -s) for docs/performance.md."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = random_model("qwen3-omni", seed=0)
    rng = random.Random(share)
    lengths = [rng.randint(25, 375) for _ in range(15)] + [1125]
    reqs = {f"r{i}": random_codes(1, n, base.config, seed=i)[0] for i, n in enumerate(lengths)}
    module = Code2WavModule(model=base)
    trainer = Trainer(**trainer_kwargs(accelerator="gpu", precision="bf16-true", gpu_memory_utilization=share))
    preds = trainer.predict(module, datamodule=CodesDataModule(predict=reqs, batch_size=8))
    assert sorted(r for o in preds for r in o.req_ids) == sorted(reqs)
    stats, total = module.engine_stats, torch.cuda.get_device_properties(0).total_memory
    peak = torch.cuda.max_memory_reserved()
    print(f"\nshare {share}: {stats['frames_per_forward']} frames per forward, peak {peak / 2**30:.2f} GiB of "
          f"{share * total / 2**30:.2f}, {stats['captures']} captures, {stats['eager']} eager, "
          f"{1 - stats['frames'] / stats['computed']:.1%} padding")  # fmt: skip
    assert stats["shrinks"] == 0, stats
    assert peak <= share * total, (peak / 2**30, share * total / 2**30)
