"""The fine-tuning recipe at work (issues 53 and 54): a short fit learns, and says so in its last line; a
short run's warm-up and EMA do not hold its weights back; the waveform term of the objective."""

import re

import pytest
import torch
from helpers import ROOT

from omni_lightning.data.synthetic import make_demo_data, make_teacher
from omni_lightning.training.ema import _HostCountedAverage
from omni_lightning.training.losses import ReconstructionLoss
from omni_lightning.training.schedule import fine_tuning_optimizers

MOVED = re.compile(r"^fit: val/mel_distance ([\d.]+) \(step (\d+)\) -> ([\d.]+) \(step (\d+)\);")


def learning_rates(warmup_steps, run_steps, learning_rate=1e-3, decay_fraction=1.0):
    layer = torch.nn.Linear(2, 2)
    kw = dict(learning_rate=learning_rate, betas=(0.8, 0.99), weight_decay=0.0, discriminator_lr=1e-4)
    out = fine_tuning_optimizers(layer.parameters(), None, warmup_steps=warmup_steps, min_lr_ratio=0.1,
                                 total_steps=None, estimated_stepping_batches=run_steps, decay_fraction=decay_fraction,
                                 **kw)  # fmt: skip
    optimizer, scheduler = out["optimizer"], out["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(run_steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_a_short_run_warms_up_over_at_most_a_tenth_of_its_steps():
    """configs/finetune.yaml's 100 warm-up steps once spanned the README's whole 40-step fit."""
    short = learning_rates(100, 40)
    assert short[0] == pytest.approx(2.5e-4) and short[3] == pytest.approx(1e-3)  # 4 steps of warm-up
    assert all(r > 1e-4 for r in short)
    long = learning_rates(100, 2000)
    assert long[49] == pytest.approx(5e-4) and long[99] == pytest.approx(1e-3)  # a long run keeps its 100


@pytest.mark.parametrize("run_steps", [40, 600, 2000])
def test_a_late_decay_holds_the_peak_rate_then_ends_where_the_cosine_ends(run_steps):
    """decay_fraction 0.3: warm-up, the peak rate until 70 % of the steps after it, then the same cosine to the
    floor; 1.0 is the plain cosine, step for step."""
    plain, late = learning_rates(100, run_steps), learning_rates(100, run_steps, decay_fraction=0.3)
    warm = min(100, run_steps // 10)
    assert late[:warm] == plain[:warm]
    stable_until = run_steps - round((run_steps - warm) * 0.3)
    assert all(r == pytest.approx(1e-3) for r in late[warm:stable_until])
    assert all(a >= b for a, b in zip(late[stable_until:], late[stable_until + 1 :]))  # falling
    assert late[-1] < 1.5e-4  # near the same floor (1e-4) at the end
    assert all(a >= b for a, b in zip(late[warm:], plain[warm:]))  # never below the plain cosine


def test_a_short_runs_ema_follows_its_recent_weights():
    """A 0.999 average of 40 steps held 96 % of the starting weights; warmed up, it is near the last ones."""
    net = torch.nn.Linear(1, 1, bias=False)
    average = torch.optim.swa_utils.AveragedModel(net, use_buffers=False)
    average.__class__, average.weight = _HostCountedAverage, 1 - 0.999
    for step in range(1, 41):
        with torch.no_grad():
            net.weight.fill_(step / 40)  # weights moving from 0 to 1
        average.update_parameters(net)
    assert 0.85 < float(average.module.weight.detach()) < 1.0


def test_the_waveform_term_adds_its_weighted_l1_over_real_samples_only():
    torch.manual_seed(0)
    pred, target = torch.randn(2, 1, 4800), torch.randn(2, 4800)
    lengths = torch.tensor([4800, 3000])
    plain, weighted = ReconstructionLoss()(pred, target, lengths), ReconstructionLoss(waveform_weight=2.0)
    out = weighted(pred, target, lengths)
    expected = torch.stack([(pred[i, 0, :n] - target[i, :n]).abs().mean() for i, n in enumerate(lengths)]).mean()
    torch.testing.assert_close(out["waveform"], expected)
    torch.testing.assert_close(out["loss"], plain["loss"] + 2.0 * expected)
    assert "waveform" not in plain  # weight 0: not computed, not logged
    padded = pred.clone()
    padded[1, 0, 3000:] = 100.0  # padding never enters it
    torch.testing.assert_close(weighted(padded, target, lengths)["waveform"], expected)


@pytest.fixture(scope="module")
def demo_pairs(tmp_path_factory):
    """Pairs as ``omni-lightning demo`` makes them (its teacher, 1-3 s), fewer of them."""
    folder = tmp_path_factory.mktemp("demo")
    teacher = make_teacher("tiny")
    train = make_demo_data(folder, 8, 1.0, 3.0, teacher=teacher, seed=0, name="train.jsonl")
    val = make_demo_data(folder, 4, 1.0, 3.0, teacher=teacher, seed=1, name="val.jsonl")
    return train, val


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_a_short_fit_of_the_readme_learns_and_its_last_line_says_what_moved(demo_pairs, tmp_path, monkeypatch,
                                                                            capsys, seed):  # fmt: skip
    """The README's fit (configs/finetune.yaml, 32-true) sat in its warm-up for all 40 steps: val/mel_distance
    3.138 -> 3.122. Shorter here (20 steps, 1 s crops); its last line names the first and last validations."""
    from omni_lightning.cli import main

    train, val = demo_pairs
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(ROOT / "configs/finetune.yaml"), "--data.train", str(train), "--data.val", str(val),
            "--trainer.precision", "32-true", "--trainer.max_steps", "20", "--trainer.val_check_interval", "5",
            "--data.num_workers", "0", "--data.crop_frames", "12", "--data.batch_size", "4",
            "--trainer.enable_progress_bar", "false", "--seed_everything", str(seed)]  # fmt: skip
    assert main(args) == 0
    *_, line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("fit: ")]  # the last: its end
    moved = MOVED.match(line)
    assert moved, line
    first, first_step, last, last_step = float(moved[1]), int(moved[2]), float(moved[3]), int(moved[4])
    assert (first_step, last_step) == (5, 20)
    assert last < 0.8 * first, line  # learning, not rounding: a fifth of the distance or more in 15 steps
