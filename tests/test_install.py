"""A broken install is one line naming the fix: torchaudio whose compiled library cannot load beside torch."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torchaudio
from helpers import ROOT

MISSING = "libc10_cuda_of_another_build.so"  # a library torch's build does not have, as a CUDA torchaudio's is


def broken_torchaudio(folder: Path) -> Path:
    """A torchaudio package in ``folder``: the installed one, linked file by file, but for a ``_torchaudio.so``
    that needs ``MISSING`` (a CUDA torchaudio beside a CPU torch), or, without a C compiler, one that is
    not a library at all. Returns the folder to put first on ``PYTHONPATH``."""
    real = Path(torchaudio.__file__).parent
    package = folder / "torchaudio"
    package.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "lib":
            (package / entry.name).symlink_to(entry)
    (package / "lib").mkdir()
    for entry in (real / "lib").iterdir():
        if not entry.name.startswith("_torchaudio"):
            (package / "lib" / entry.name).symlink_to(entry)
    library = package / "lib" / "_torchaudio.so"
    if shutil.which("cc"):
        build = folder / "build"
        build.mkdir()
        (build / "dep.c").write_text("void dep(void) {}\n")
        (build / "ext.c").write_text("void ext(void) {}\n")
        cc = ["cc", "-shared", "-fPIC"]
        subprocess.run([*cc, "-o", build / MISSING, build / "dep.c"], check=True)
        subprocess.run([*cc, "-Wl,--no-as-needed", "-o", library, build / "ext.c", build / MISSING], check=True)
        shutil.rmtree(build)  # the dependency is gone: loading the library fails as in the report
    else:
        library.write_bytes(b"not a shared library\n")
    return folder


def test_a_torchaudio_that_cannot_load_beside_torch_is_one_error_line_naming_the_reinstall(tmp_path):
    shadow = broken_torchaudio(tmp_path / "site")
    (tmp_path / "codes").mkdir()
    np.save(tmp_path / "codes" / "a.npy", np.zeros((16, 5), dtype=np.int64))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}
    args = ["predict", "--data.predict", "codes", "--out_dir", "runs/wavs", "--model.config", "tiny",
            "--model.random_weights", "true"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "omni_lightning.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = lines[0]
    assert line.startswith("error: torchaudio cannot load beside torch "), line
    assert (MISSING if shutil.which("cc") else "OSError") in line, line  # what failed, in the loader's words
    fix = f"{sys.executable} -m pip install --force-reinstall torch torchaudio --index-url https://download.pytorch.org/whl/"
    assert fix in line and "same build" in line, line
    assert not (tmp_path / "runs" / "wavs" / "manifest.jsonl").exists()
