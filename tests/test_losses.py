"""The batched spectral losses against each item alone, padding never scored; the discriminators in bf16."""

import pytest
import torch
import torch.nn.functional as F

from omni_lightning.training.discriminators import Discriminators
from omni_lightning.training.losses import MultiResolutionMelLoss, MultiResolutionSTFTLoss, ReconstructionLoss
from omni_lightning.training.spectrogram import reflect_at_lengths

LENGTHS = [24000, 17001, 9000, 1500]  # the last is shorter than the largest window
TOLERANCE = 1e-5  # relative: only float rounding differs (batched FFTs, sums in another order)


def padded_batch(seed=0):
    """Predictions and targets with junk past each item's length: large values, so any leak shows."""
    gen = torch.Generator().manual_seed(seed)
    n = max(LENGTHS)
    pred = 0.3 * torch.randn(len(LENGTHS), 1, n, generator=gen)
    target = 0.3 * torch.randn(len(LENGTHS), n, generator=gen)
    for i, m in enumerate(LENGTHS):
        pred[i, :, m:], target[i, m:] = 5.0, -7.0
    return pred, target, torch.tensor(LENGTHS)


def two_items(seed):
    """:func:`padded_batch`'s second and third items (17,001 and 9,000 samples): a shorter test."""
    pred, target, lengths = padded_batch(seed)
    return pred[1:3, :, : LENGTHS[1]], target[1:3, : LENGTHS[1]], lengths[1:3]


def cut_item_losses(pred, target):
    """The per-item definitions, from torchaudio and torch.stft directly: one item, no padding."""
    import torchaudio

    mel, stft = [], []
    for n, m in zip((512, 1024, 2048), (40, 80, 128)):
        spectrogram = torchaudio.transforms.MelSpectrogram(24000, n_fft=n, hop_length=n // 4, n_mels=m, power=1.0)
        mel.append(F.l1_loss(torch.log(spectrogram(pred) + 1e-5), torch.log(spectrogram(target) + 1e-5)))
        pm, tm = (
            torch.stft(x, n, n // 4, window=torch.hann_window(n), return_complex=True).abs() for x in (pred, target)
        )
        floor = (1e-3 * tm.max()).clamp_min(1e-7)  # the log magnitudes' floor: -60 dB under the item's peak
        convergence = torch.linalg.norm(tm.clamp_min(1e-7) - pm.clamp_min(1e-7)) / torch.linalg.norm(tm.clamp_min(1e-7))
        stft.append(convergence + F.l1_loss(torch.log(torch.hypot(pm, floor)), torch.log(torch.hypot(tm, floor))))
    return torch.stack(mel).mean(), torch.stack(stft).mean()


@pytest.mark.parametrize("loss_type", [MultiResolutionMelLoss, MultiResolutionSTFTLoss])
def test_a_padded_batch_scores_each_item_as_alone(loss_type):
    pred, target, lengths = padded_batch()
    loss = loss_type()
    batched = loss(pred, target, lengths, reduction="none")
    alone = torch.stack([loss(pred[i : i + 1, :, :m], target[i : i + 1, :m]) for i, m in enumerate(LENGTHS)])
    torch.testing.assert_close(batched, alone, rtol=TOLERANCE, atol=0)
    torch.testing.assert_close(loss(pred, target, lengths), alone.mean(), rtol=TOLERANCE, atol=0)
    # and each item alone is the per-item definition (the full cut, reflected at its own end)
    kind = 0 if loss_type is MultiResolutionMelLoss else 1
    for i, m in enumerate(LENGTHS[:3]):  # torch.stft cannot reflect-pad the shortest alone
        reference = cut_item_losses(pred[i, 0, :m], target[i, :m])[kind]
        torch.testing.assert_close(alone[i], reference, rtol=TOLERANCE, atol=0)


def test_padding_gets_no_gradient_and_the_objective_shares_its_spectra():
    pred, target, lengths = padded_batch(1)
    pred.requires_grad_()
    rec = ReconstructionLoss()(pred, target, lengths)
    rec["loss"].backward()
    for i, m in enumerate(LENGTHS):
        assert torch.count_nonzero(pred.grad[i, :, m:]) == 0 and torch.count_nonzero(pred.grad[i, :, :m]) > 0
    torch.testing.assert_close(rec["mel"], MultiResolutionMelLoss()(pred, target, lengths), rtol=TOLERANCE, atol=0)
    torch.testing.assert_close(rec["stft"], MultiResolutionSTFTLoss()(pred, target, lengths), rtol=TOLERANCE, atol=0)
    assert torch.isfinite(rec["loss"])


def test_reflection_at_each_items_end_matches_torch_pad():
    x = torch.arange(2 * 30, dtype=torch.float32).reshape(2, 30)
    out = reflect_at_lengths(x, torch.tensor([30, 12]), 5)
    assert torch.equal(out[0], F.pad(x[None, :1], (5, 5), mode="reflect")[0, 0])
    assert torch.equal(out[1, :22], F.pad(x[None, 1:, :12], (5, 5), mode="reflect")[0, 0])


def test_discriminators_run_in_bf16_and_score_real_and_fake_in_one_pass():
    """bf16 weights with the STFT branch's fp32 FFT once crashed in conv2d (``Input type (float) and
    bias type (c10::BFloat16)``); the joint real + fake pass equals two separate passes. (Training
    under bf16-true, backward included: tests/test_finetune.py.)"""
    gen = torch.Generator().manual_seed(0)
    real, fake = 0.1 * torch.randn(2, 1, 2000, generator=gen), 0.1 * torch.randn(2, 1, 2000, generator=gen)
    disc = Discriminators()
    separate = [((1 - r) ** 2).mean() + (f**2).mean() for (r, _), (f, _) in zip(disc(real), disc(fake))]
    torch.testing.assert_close(disc.discriminator_loss(real, fake), sum(separate) / len(separate))
    with torch.no_grad():
        loss = disc.to(torch.bfloat16).discriminator_loss(real.to(torch.bfloat16), fake.to(torch.bfloat16))
    assert loss.dtype == torch.bfloat16 and torch.isfinite(loss)


def test_discriminators_run_channels_last_and_score_as_channels_first():
    """cuDNN's half-precision convolutions are NHWC: channels-first tensors got transposed around each.
    The weights are channels-last from construction through dtype casts; every feature map comes out
    channels-last; logits, features and the input's gradient equal a channels-first copy's."""
    gen = torch.Generator().manual_seed(0)
    x = 0.1 * torch.randn(2, 1, 3000, generator=gen)
    disc = Discriminators()
    first = Discriminators().to(memory_format=torch.contiguous_format)
    first.load_state_dict(disc.state_dict())
    four_d = [p for p in disc.parameters() if p.dim() == 4]
    assert four_d and all(p.is_contiguous(memory_format=torch.channels_last) for p in four_d)
    assert not all(p.is_contiguous() for p in four_d)  # (a [out, 1, k, 1] weight is both)
    assert all(p.is_contiguous() for p in first.parameters())
    assert all(
        p.is_contiguous(memory_format=torch.channels_last)
        for p in Discriminators().bfloat16().parameters()
        if p.dim() == 4
    )
    grads = []
    for d in (disc, first):
        inp = x.clone().requires_grad_()
        outs = d(inp)
        loss = sum(o.pow(2).mean() + sum(f.abs().mean() for f in fs) for o, fs in outs)
        loss.backward()
        grads.append((outs, inp.grad))
    (cl, cl_grad), (cf, cf_grad) = grads
    assert all(f.is_contiguous(memory_format=torch.channels_last) for _, fs in cl for f in fs if f.dim() == 4)
    for (a, fa), (b, fb) in zip(cl, cf):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for u, v in zip(fa, fb):
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cl_grad, cf_grad, rtol=1e-5, atol=1e-7)


def test_the_losses_compute_in_fp32_under_autocast():
    """The mel filterbank's matmul once ran in bf16 under bf16-mixed (outside the spectra's fp32 block):
    the mel loss moved by ~1e-3. Under autocast both losses give their fp32 values, gradient included."""
    pred, target, lengths = two_items(2)
    rec = ReconstructionLoss()
    results = []
    for mixed in (False, True):
        p = pred.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=mixed):
            out = rec(p, target, lengths)
        out["loss"].backward()
        results.append(({k: v.detach() for k, v in out.items()}, p.grad))
    (fp32, fp32_grad), (mixed, mixed_grad) = results
    for key in ("mel", "stft", "loss"):
        assert mixed[key].dtype == torch.float32
        torch.testing.assert_close(mixed[key], fp32[key], rtol=1e-6, atol=0)
    torch.testing.assert_close(mixed_grad, fp32_grad, rtol=1e-5, atol=1e-7)


def test_the_stft_losss_gradient_does_not_hinge_on_rounding():
    """``log|X|`` has gradient ``1/|X|``: a bin passing near zero (frame 0 of a reflect-padded STFT is
    nearly real) carried whole steps, and rounding the prediction to bf16 moved it: its waveform
    gradient turned (cosine 0.07 to 0.46 over these seeds, -0.32 to 0.65 over 8) and its norm moved by
    up to 2.2x (20x over 8), and bf16 steps raised the loss. Floored at -60 dB under each item's peak,
    the gradients of a prediction and of its bf16 rounding agree (cosine >= 0.99 over 8 seeds). A
    digitally silent target still gives a finite loss and gradient."""
    loss = MultiResolutionSTFTLoss()

    def gradient(pred, target, lengths):
        pred = pred.clone().requires_grad_()
        loss(pred, target, lengths).backward()
        return pred.grad.flatten()

    for seed in range(4):
        pred, target, lengths = two_items(seed)
        pred = 0.5 * (pred + target[:, None])  # part way to the target
        exact, rounded = gradient(pred, target, lengths), gradient(pred.bfloat16().float(), target, lengths)
        assert F.cosine_similarity(exact, rounded, dim=0) > 0.8, seed
        assert 0.8 < rounded.norm() / exact.norm() < 1.25, seed
    pred, target, lengths = two_items(0)
    target[1] = 0.0
    silent = gradient(pred, target, lengths)
    assert torch.isfinite(silent).all() and silent.abs().sum() > 0


def test_discriminators_pad_their_first_convolution_and_equal_the_plain_layers():
    """The first convolutions' one or two input channels padded to eight (tensor cores) and the fused bias +
    leaky ReLU give each discriminator's plain layers' logits and features (conv modules, then leaky ReLU)."""
    from omni_lightning.training.discriminators import SLOPE, PeriodDiscriminator

    gen = torch.Generator().manual_seed(1)
    x = 0.1 * torch.randn(2, 1, 3000, generator=gen)
    for d in Discriminators().discriminators:
        got_logits, got = d(x)
        if isinstance(d, PeriodDiscriminator):
            b, _, t = x.shape
            pad = (-t) % d.period
            h = F.pad(x, (0, pad), mode="reflect").view(b, -1, d.period, 1).permute(0, 3, 1, 2)
        else:
            spec = torch.stft(x[:, 0], d.n_fft, d.n_fft // 4, window=d.window, return_complex=True).transpose(1, 2)
            h = torch.stack([spec.real, spec.imag], dim=1)
        assert h.shape[1] in (1, 2)  # what the padding widens
        want = []
        for conv in d.convs:
            h = F.leaky_relu(conv(h), SLOPE)
            want.append(h)
        want.append(d.out(h))
        torch.testing.assert_close(got_logits, want[-1].flatten(1), rtol=1e-5, atol=1e-6)
        for u, v in zip(got, want, strict=True):
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
