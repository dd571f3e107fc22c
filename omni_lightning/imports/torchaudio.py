"""``import_torchaudio``: the one place the package imports torchaudio.

``import torchaudio`` loads its compiled library, which must come from the same build as torch (CPU or
the same CUDA line, one package index): a CPU torch beside a CUDA torchaudio fails there with a 30-line
traceback ending in ``OSError: libc10_cuda.so: cannot open shared object file``. Here that failure is a
``UsageError`` (the command line's one ``error:`` line, exit status 2) naming what is wrong and the
command that reinstalls both from one index.
"""

from __future__ import annotations

import sys
from types import ModuleType

from omni_lightning.errors import UsageError

INDEX = "https://download.pytorch.org/whl"


def import_torchaudio() -> ModuleType:
    """torchaudio, imported; a UsageError naming the fix when it cannot load beside this torch."""
    try:
        import torchaudio
    except (OSError, ImportError, RuntimeError) as err:  # its compiled library (OSError), or it is missing
        raise UsageError(broken_torchaudio(err)) from err
    return torchaudio


def broken_torchaudio(err: BaseException) -> str:
    """One line: torch's build, what failed, and the pip command that installs both from torch's index."""
    import torch

    cuda = torch.version.cuda
    build = f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    root = err
    while root.__cause__ is not None or root.__context__ is not None:  # torch wraps the loader's own OSError
        root = root.__cause__ or root.__context__
    reason = " ".join(str(root).split()) or type(root).__name__
    if isinstance(err, ModuleNotFoundError) and err.name == "torchaudio":
        what = "torchaudio is not installed"
    else:
        what = f"torchaudio cannot load beside torch {torch.__version__} ({type(root).__name__}: {_first(reason)})"
    return (
        f"{what}: torch and torchaudio must come from the same build ({'CUDA ' + cuda if cuda else 'CPU'}) and the "
        f"same package index; reinstall both: {sys.executable} -m pip install --force-reinstall torch torchaudio "
        f"--index-url {INDEX}/{build}"
    )


def _first(reason: str, limit: int = 160) -> str:
    """The error's text cut to ``limit`` characters (a loader's message can name several long paths)."""
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."
