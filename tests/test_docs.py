"""The documentation runs: every ```python block of README.md and docs/*.md, as written, alone, on the CPU.

Alone: each block in a fresh namespace and a fresh working folder, as a reader who copies one block into a
new file runs it (a block that used a name an earlier block made failed with NameError); a block writes
only under ``runs/`` there (the clone's .gitignore covers it). A block may use
what the README's quick start leaves behind, ``omni_lightning_demo/data`` (the demo's code files and
pairs): the child process makes it once, with the demo's own function, and links it into each block's
folder. All blocks run in one child process (this file run as a script), so the package is imported once;
each block's result comes back as JSON. The bash blocks are not run: those that need a GPU or a real
checkpoint must say so in a comment. Blocks that talk to a server on ``127.0.0.1:8000`` (docs/serving.md),
bash (``curl``) and python alike, run against a server started on loopback, on a free port.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
DEMO_DATA = "omni_lightning_demo/data"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


SERVER = "127.0.0.1:8000"  # where a page's examples find `omni-lightning serve`


def blocks(page: Path, language: str, served: bool = False) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) of each fenced block in ``language``; ``served``: those
    that talk to a server on :data:`SERVER` (only those; else, none of those)."""
    text = page.read_text()
    found = [(text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]
    return [(line, code) for line, code in found if (SERVER in code) == served]


def run_block(name: str, line: int, code: str, folder: Path, demo_data: Path) -> dict:
    """Runs one block in a fresh namespace with ``folder`` as the working folder."""
    if DEMO_DATA in code:
        (folder / DEMO_DATA).parent.mkdir(parents=True)
        (folder / DEMO_DATA).symlink_to(demo_data)
    os.chdir(folder)
    start, cpu = time.perf_counter(), time.process_time()
    try:
        exec(compile(code, f"{name}:{line}", "exec"), {"__name__": "__main__"})
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the block
        return {"ok": False, "error": traceback.format_exc(limit=-8)}
    wall, cpu = round(time.perf_counter() - start, 2), round(time.process_time() - cpu, 2)
    # everything an example writes goes under runs/ (the repository's .gitignore covers it), not beside the
    # reader's files; the demo's data is only read
    read = [folder / "runs", folder / DEMO_DATA]
    outside = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not any(map(p.is_relative_to, read)))
    outside = [p for p in outside if p != "omni_lightning_demo"]
    if outside:
        return {"ok": False, "error": f"wrote outside runs/: {outside[:10]}"}
    return {"ok": True, "wall": wall, "cpu": cpu}


def _child(names: list[str]) -> None:
    import warnings

    from omni_lightning.cli.demo import demo_data

    # an example must say which weights it predicts with (checkpoint= or random_weights=True)
    warnings.filterwarnings("error", message="predicting with random weights", category=UserWarning)
    results = {}
    with tempfile.TemporaryDirectory(prefix="docs-") as root:
        demo_data(Path(root, "demo"))
        for name in names:
            for line, code in blocks(ROOT / name, "python"):
                folder = Path(tempfile.mkdtemp(prefix="block-", dir=root))
                results[f"{name}:{line}"] = run_block(name, line, code, folder, Path(root, "demo"))
        os.chdir(ROOT)
    print("RESULTS " + json.dumps(results), flush=True)


_RESULTS: dict = {}


def _run_all() -> dict:
    if not _RESULTS:
        names = [str(p.relative_to(ROOT)) for p in pages() if blocks(p, "python")]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
               "PYTHONWARNINGS": "ignore::DeprecationWarning"}  # fmt: skip
        proc = subprocess.run([sys.executable, __file__, *names], capture_output=True, text=True, env=env, timeout=600)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
        assert line is not None, f"the docs' child process ended with {proc.returncode}:\n{proc.stderr[-4000:]}"
        _RESULTS.update(json.loads(line[len("RESULTS ") :]))
    return _RESULTS


def test_every_python_block_runs_alone_as_written():
    """One assertion for all blocks: each failing block is named by its page and line, with its traceback."""
    results = _run_all()
    failed = {where: r for where, r in results.items() if not r["ok"]}
    assert not failed, "\n\n".join(f"{where}:\n{r['error']}" for where, r in failed.items())
    assert sum(where.startswith("README.md:") for where in results) >= 4 and len(results) >= 15, sorted(results)


def test_the_readme_tests_section_starts_with_the_ci_command():
    """.ci/run runs the first bash block after '## Tests': it must be the documented command."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index("\n## Tests\n") :]
    first = re.search(r"^```bash\n(.*?)^```", after, re.M | re.S)
    assert first is not None and first.group(1).strip() == 'pip install -e ".[dev]" && pytest -q'


NEEDS = re.compile(r"#.*\b(needs?|GPU|checkpoint)\b", re.I)
HEAVY = re.compile(r"/models/|--trainer\.accelerator gpu|bf16-true|torchrun|--trainer\.devices [2-9]|srun ")


def test_bash_blocks_that_need_a_gpu_or_a_checkpoint_say_so():
    missing = [f"{page.relative_to(ROOT)}:{line}" for page in pages() for line, code in blocks(page, "bash")
               if HEAVY.search(code) and not NEEDS.search(code)]  # fmt: skip
    assert not missing, f"bash blocks that need a GPU or a checkpoint without a comment saying so: {missing}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


INTERNAL = re.compile(r"\b[Ii]ssues? \d|\bdevice calls?\b|\bcarry \.(bench|whl)\b")


def test_pages_speak_to_users_and_contributors_not_to_one_labs_tracker():
    """No internal issue numbers or one lab's tooling words ("a device call") in the pages or the scripts'
    README: a reader of the repository has neither the tracker nor the tooling."""
    found = [f"{page.relative_to(ROOT)}:{n}: {line.strip()}" for page in [*pages(), ROOT / "scripts" / "README.md"]
             for n, line in enumerate(page.read_text().splitlines(), 1) if INTERNAL.search(line)]  # fmt: skip
    assert not found, "\n".join(found)


def test_relative_links_and_their_anchors_exist():
    broken = []
    for page in pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            page_text = file.read_text() if file.is_file() and file.suffix == ".md" else ""  # not an image's bytes
            headings = [anchor(h) for h in re.findall(r"^#+ (.+)$", page_text, re.M)]
            if not file.exists() or (fragment and fragment not in headings):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"links to missing files or headings: {broken}"


def test_the_serving_pages_examples_run_against_a_server_on_loopback(tmp_path):
    """docs/serving.md's curl commands and WebSocket client, as written but for the port, against a server of
    the tiny preset (``build_app``, the app ``omni-lightning serve`` runs)."""
    import pytest

    pytest.importorskip("fastapi")
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_helpers import LiveServer, tiny_module

    page = ROOT / "docs" / "serving.md"
    served = [("bash", line, code) for line, code in blocks(page, "bash", served=True)]
    served += [("python", line, code) for line, code in blocks(page, "python", served=True)]
    assert {"bash", "python"} <= {kind for kind, _, _ in served}
    live = LiveServer(tiny_module(), max_streams=4)
    try:
        for kind, line, code in served:
            code = code.replace(SERVER, live.url.removeprefix("http://"))
            command = ["bash", "-euo", "pipefail", "-c", code] if kind == "bash" else [sys.executable, "-c", code]
            proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, f"docs/serving.md:{line}:\n{proc.stdout}{proc.stderr}"
    finally:
        live.stop()
    assert (tmp_path / "reply.wav").read_bytes()[:4] == b"RIFF"
    assert (tmp_path / "reply.f32").stat().st_size == 4 * (1920 * 25 - 555)


if __name__ == "__main__":
    _child(sys.argv[1:])
