"""Lightning's own predict tests, run with ``omni_lightning.Trainer`` in place of ``lightning.pytorch.Trainer``.

    python scripts/contract/lightning_predict_tests.py --lightning-src ~/src/pytorch-lightning [--stock]

``--lightning-src``: a checkout of Lightning's repository at the installed release (its
``tests/tests_pytorch``); its test requirements installed (``cloudpickle``, ``pandas``, ``psutil``).
Runs the predict loop, prediction writer and TQDM bar test files whole, and every test named
``*predict*`` in the trainer, loop and fetcher files; ``--stock`` runs them with Lightning's own
Trainer, for the same count. Not run by CI: Lightning's tests are not part of its PyPI release.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WHOLE = ("loops/test_prediction_loop.py", "callbacks/test_prediction_writer.py",
         "callbacks/progress/test_tqdm_progress_bar.py")  # fmt: skip
PREDICT_ONLY = ("trainer/test_trainer.py", "loops/test_loops.py", "loops/test_fetchers.py")
PLUGIN = """import lightning.pytorch as pl
import lightning.pytorch.trainer as trainer_package
import omni_lightning

pl.Trainer = trainer_package.Trainer = omni_lightning.Trainer
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lightning-src", required=True, type=Path)
    parser.add_argument("--stock", action="store_true", help="lightning.pytorch.Trainer itself")
    args = parser.parse_args()
    tests = args.lightning_src / "tests" / "tests_pytorch"
    if not tests.is_dir():
        sys.exit(f"error: --lightning-src {args.lightning_src}: no tests/tests_pytorch in it")
    with tempfile.TemporaryDirectory() as plugin_dir:
        Path(plugin_dir, "omni_trainer_plugin.py").write_text(PLUGIN)
        path = os.pathsep.join([plugin_dir, str(args.lightning_src), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}
        base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        base += [] if args.stock else ["-p", "omni_trainer_plugin"]
        codes = [
            subprocess.run([*base, *(str(tests / f) for f in WHOLE)], cwd=args.lightning_src, env=env).returncode,
            subprocess.run(
                [*base, "-k", "predict", *(str(tests / f) for f in PREDICT_ONLY)], cwd=args.lightning_src, env=env
            ).returncode,  # fmt: skip
        ]
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
