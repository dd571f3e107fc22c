"""What holds STOI back on the recipe's benchmark: the metrics of degraded copies of the teacher's
validation audio, beside the same degradations of a speech-like signal, and what the two signals'
STOI envelopes look like. Writes JSON and prints a table.

    OMP_NUM_THREADS=1 python scripts/quality/recipe_stoi.py --out docs/results/recipe_stoi.json

Degradations of each reference (the teacher's six validation pairs; ``speech_like`` of the same lengths):

- ``decoder-<s>``: the teacher with every weight but the code embedding perturbed by ``s`` of its
  tensor's std (the sweep's student at 0.25), run on the same codes (teacher only);
- ``phase-random``: the STFT magnitudes kept (n_fft 1024, hop 256), the phases random: a vocoder whose
  magnitudes are right at that resolution and whose phase is free;
- ``griffin-lim``: phases rebuilt from the magnitudes by 64 Griffin-Lim iterations (the same STFT);
- ``noise-<d>dB``: white noise at ``d`` dB SNR, the familiar scale;
- ``delay-<n>``: the reference ``n`` samples late (STOI does not align; a phase-free vocoder may shift).

Not done: a trained student's audio (the sweep scores those); only the six validation lengths.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from recipe_sweep import make_pairs, perturbed  # this group's sweep: its data and its students

N_FFT, HOP = 1024, 256


def _stft(x: torch.Tensor) -> torch.Tensor:
    return torch.stft(x, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True)


def _istft(spec: torch.Tensor, n: int) -> torch.Tensor:
    return torch.istft(spec, N_FFT, HOP, window=torch.hann_window(N_FFT), length=n)


def degradations(ref: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mag = _stft(ref).abs()
    phase = torch.rand(mag.shape, generator=gen) * 2 * math.pi
    out = {"phase-random": _istft(torch.polar(mag, phase), ref.numel())}
    spec = torch.polar(mag, phase)
    for _ in range(64):  # Griffin-Lim from random phases
        spec = torch.polar(mag, _stft(_istft(spec, ref.numel())).angle())
    out["griffin-lim"] = _istft(spec, ref.numel())
    noise = torch.randn(ref.shape, generator=gen)
    for db in (20, 10, 0):
        out[f"noise-{db}dB"] = ref + noise * ref.norm() / noise.norm() * 10 ** (-db / 20)
    for n in (24, 240):  # 1 ms, 10 ms
        out[f"delay-{n}"] = torch.cat([torch.zeros(n), ref[:-n]])
    return out


def scores(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    import torchaudio

    from omni_lightning.evaluation.metrics import request_metrics
    from omni_lightning.evaluation.scoring import score_request
    from omni_lightning.training.losses import MultiResolutionMelLoss, MultiResolutionSTFTLoss

    m = request_metrics(out, ref, MultiResolutionMelLoss(), MultiResolutionSTFTLoss())
    r16, o16 = (torchaudio.functional.resample(x, 24000, 16000).numpy() for x in (ref, out))
    q = score_request(("pesq", "stoi"), 24000, ref.numpy(), out.numpy(), r16, o16).values
    return {"mel": float(m["mel_distance"]), "si_sdr": float(m["si_sdr"]), "snr": float(m["snr"]), **q}


def envelope_depth(x: np.ndarray) -> dict[str, float]:
    """STOI's view of a signal: its 1/3-octave band envelopes at 10 kHz (pystoi's own functions), the
    std over time of each band's level in dB (median over bands), and the share of energy below 5 kHz."""
    from pystoi import utils
    from pystoi.stoi import FS, MINFREQ, N_FRAME, NFFT, NUMBAND
    from scipy.signal import resample_poly

    x10 = resample_poly(x, FS, 24000)
    obm, _ = utils.thirdoct(FS, NFFT, NUMBAND, MINFREQ)
    spec = utils.stft(x10, N_FRAME, NFFT, overlap=2).T  # [bins, frames]
    bands = np.sqrt(obm @ np.abs(spec) ** 2)
    level = 20 * np.log10(bands + 1e-12)
    power = np.abs(np.fft.rfft(x)) ** 2
    below = power[: len(power) * 5000 // 12000].sum() / power.sum()
    return {"band_level_std_db": float(np.median(level.std(axis=1))), "energy_below_5khz": float(below)}


def main() -> None:
    from omni_lightning.data.synthetic import make_teacher, speech_like

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results/recipe_stoi.json"))
    parser.add_argument("--work", type=Path, default=Path("runs/recipe/data"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, val = make_pairs(args.work)
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    teacher = make_teacher("tiny", seed=21)
    students = {s: perturbed(teacher, s, keep=("code_embedding",)).eval() for s in (0.01, 0.03, 0.1, 0.25)}
    table: dict[str, dict[str, list[float]]] = {}
    depth: dict[str, list[dict[str, float]]] = {"teacher": [], "speech-like": []}
    for i, r in enumerate(rows):
        codes = torch.from_numpy(np.load(args.work / r["codes"]))[None]
        with torch.inference_mode():
            ref = teacher(codes)[0, 0].float()
            outs = {f"decoder-{s}": m(codes)[0, 0].float() for s, m in students.items()}
        speech = speech_like(ref.numel() / 24000, seed=i)[: ref.numel()]
        for signal, reference, degraded in (("teacher", ref, {**outs, **degradations(ref, i)}),
                                             ("speech-like", speech, degradations(speech, i))):  # fmt: skip
            depth[signal].append(envelope_depth(reference.numpy()))
            for name, out in degraded.items():
                for k, v in scores(reference, out).items():
                    table.setdefault(f"{signal}/{name}", {}).setdefault(k, []).append(v)
    means = {name: {k: round(float(np.nanmean(v)), 4) for k, v in d.items()} for name, d in table.items()}
    signals = {s: {k: round(float(np.mean([d[k] for d in ds])), 3) for k in ds[0]} for s, ds in depth.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"degradations": means, "signals": signals}, indent=1) + "\n")
    print("| reference / degradation | mel distance | PESQ | STOI | SI-SDR (dB) | SNR (dB) |")
    print("|---|---|---|---|---|---|")
    for name, m in means.items():
        print(f"| {name} | {m['mel']:.3f} | {m['pesq']:.2f} | {m['stoi']:.3f} | {m['si_sdr']:.1f} | {m['snr']:.1f} |")
    for s, d in signals.items():
        print(f"{s}: band level std {d['band_level_std_db']:.1f} dB, energy below 5 kHz {d['energy_below_5khz']:.2f}")


if __name__ == "__main__":
    main()
