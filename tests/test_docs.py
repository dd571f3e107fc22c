"""The documentation runs: every ```python block of README.md and docs/*.md, as written, on the CPU.

A page's blocks run in order in one namespace (a block may use what an earlier one of its page made),
in a fresh working folder per page. All pages run in one child process (this file run as a script),
so the package is imported once; each page's result comes back as JSON and is asserted per page.
The bash blocks are not run: those that need a GPU or a real checkpoint must say so in a comment.
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


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path, language: str) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) of each fenced block in ``language``."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]


def run_page(page: Path, folder: Path) -> dict:
    """Runs a page's python blocks in order in ``folder``; the first failure ends the page."""
    namespace: dict = {"__name__": "__main__"}
    os.chdir(folder)
    seconds = {}
    for line, code in blocks(page, "python"):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the page
            return {"ok": False, "line": line, "error": traceback.format_exc(limit=-8)}
        seconds[line] = {"wall": round(time.perf_counter() - start, 2), "cpu": round(time.process_time() - cpu, 2)}
    return {"ok": True, "seconds": seconds}


def _child(names: list[str]) -> None:
    import warnings

    # an example must say which weights it predicts with (checkpoint= or random_weights=True)
    warnings.filterwarnings("error", message="predicting with random weights", category=UserWarning)
    results = {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix="docs-") as folder:
            results[name] = run_page(ROOT / name, Path(folder))
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


def test_every_page_with_python_runs_as_written():
    """One assertion per page: the first block that fails is named with its line and traceback."""
    results = _run_all()
    failed = {name: r for name, r in results.items() if not r["ok"]}
    report = "\n\n".join(f"{name}, block at line {r['line']}:\n{r['error']}" for name, r in failed.items())
    assert not failed, report
    assert "README.md" in results and len(results) >= 5, sorted(results)


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


def test_relative_links_and_their_anchors_exist():
    broken = []
    for page in pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            headings = [anchor(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)] if file.is_file() else []
            if not file.exists() or (fragment and fragment not in headings):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"links to missing files or headings: {broken}"


if __name__ == "__main__":
    _child(sys.argv[1:])
