"""`omni-lightning`: command-line entry point."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def demo(out_dir: str = "omni_lightning_demo", seconds: float = 4.0, requests: int = 4) -> None:
    """Decodes random codes with a randomly initialized `tiny` Code2Wav into WAV files (CPU)."""
    import soundfile as sf
    import torch

    from omni_lightning import Code2Wav, randomize_weights

    model = randomize_weights(Code2Wav("tiny")).eval()
    frames = [max(1, int(seconds * model.config.frame_rate * (1 - 0.15 * i))) for i in range(requests)]
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, model.config.codebook_size, (requests, model.config.num_quantizers, max(frames)),
                          generator=gen)  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with torch.inference_mode():
        wavs = model.decode(codes, torch.tensor(frames))
    elapsed = time.perf_counter() - start
    audio_s = 0.0
    for i, wav in enumerate(wavs):
        sf.write(out / f"req-{i}.wav", wav[0].numpy(), model.sample_rate, subtype="PCM_16")
        audio_s += wav.shape[-1] / model.sample_rate
    print(f"decoded {requests} requests, {audio_s:.1f} s of audio in {elapsed:.2f} s "
          f"({audio_s / elapsed:.0f}x real time); WAV files in {out.resolve()}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="omni-lightning")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="decode a synthetic batch with the tiny preset on CPU")
    d.add_argument("--out-dir", default="omni_lightning_demo")
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo(args.out_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
