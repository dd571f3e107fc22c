"""Does cuDNN's autotuner make the graphed forward faster, and what does it cost? (a CUDA probe)

Times ``CUDAGraphDecoder`` on a batch of 32 ten-second clips with ``torch.backends.cudnn.benchmark``
off and then on (median of 7 replays, CUDA events), and each first call (capture of the batch
size's largest bucket and of this one, plus autotuning when on).

    python scripts/probe_cudnn_benchmark.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_lightning import Code2Wav, randomize_weights  # noqa: E402
from omni_lightning.models.cuda_graphs import CUDAGraphDecoder  # noqa: E402


def main() -> None:
    model = randomize_weights(Code2Wav("qwen3-omni"), seed=0).eval().cuda().to(torch.bfloat16)
    codes = torch.randint(0, model.config.codebook_size, (32, 16, 125)).cuda()
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        graphs = CUDAGraphDecoder(model)
        with torch.inference_mode():
            torch.cuda.synchronize()
            start = time.perf_counter()
            graphs(codes)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            times = []
            for _ in range(7):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                graphs(codes)
                end.record()
                torch.cuda.synchronize()
                times.append(begin.elapsed_time(end))
        ms = sorted(times)[3]
        print(f"cudnn.benchmark={bench}: batch 32 x 10 s through graphs {ms:.2f} ms ({320 / ms * 1e3:,.0f}x real "
              f"time), first call {first:.1f} s", flush=True)  # fmt: skip
        graphs.close()


if __name__ == "__main__":
    main()
