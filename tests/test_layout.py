"""The package's layout rules (docs/architecture.md): imports point down, no cycles, small files,
and ``import omni_lightning`` stays light.

Layers, lowest first; a file may import its own layer and the layers below it, never above:

    errors, imports, kernels < models < engine < data < runner < callbacks < training < evaluation < module
        < trainer < __init__ < serving < cli: console, help, arguments, path_checks, serve_options < cli.preflight
        < cli: lines, fit, lightning_cli < cli.serve < cli: demo, entry, __init__, __main__

- ``errors``: ``UsageError``, the user's mistakes (exit status 2), raised from data up to the CLI; public API.
- ``imports``: how the package imports: its names on first use (``lazy``), torchaudio once (``torchaudio``).
- ``kernels``: one op per file (Triton kernel, launcher, torch reference) and ``Kernels``, a choice of them.
- ``models``: the pure-torch model, its config, state and checkpoints; no Lightning.
- ``engine``: the decode engine (planner, memory budget, CUDA graphs, streaming) over the model.
- ``data``: datasets, collate, sampler, datamodule; it needs the model's config (codebook geometry).
- ``runner``: Lightning's predict side: the loop, the runner output, the session owning the device weights,
  the host's memory and threads.
- ``callbacks``: the async copy and the writer act on the runner's output.
- ``training``: losses, discriminators, schedule, freezing, EMA (a Lightning callback, but a
  fine-tuning one: it sits with what fine-tuning composes, above the predict-side callbacks).
- ``evaluation``: metrics (built on training's spectral losses) and the W&B media callback.
- ``module``: Code2WavModule composes models, training and evaluation.
- ``trainer``: installs the loop and the default callbacks; it does not need the module.
- ``__init__``: the public API, re-exported from everything below.
- ``serving``: the server over a module (FastAPI, uvicorn: the ``serve`` extra); ``import omni_lightning``
  never imports it.
- ``cli``: the command line, one package with layers of its own (``cli/__init__.py`` says what each file does):
  what it prints, reads and checks before torch loads; the LightningCLI and what a run says as it starts;
  ``serve`` over the LightningCLI's parser; the demo and ``main`` on top.

Edges are every ``import`` in a file, at the top and inside functions (a lazy import still binds the
two files); imports under ``if TYPE_CHECKING:`` are not counted for the layers (they never run) but are
for cycles: a type one module needs from another that imports it belongs in the module that owns it.
Importing a subpackage's ``__init__`` counts as importing that subpackage's layer.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "omni_lightning"
LAYERS = [("errors", "imports", "kernels"), "models", "engine", "data", "runner", "callbacks", "training", "evaluation",
          "module", "trainer", "__init__", "serving",
          ("cli.console", "cli.help", "cli.arguments", "cli.path_checks", "cli.serve_options"),
          "cli.preflight", ("cli.lines", "cli.fit", "cli.lightning_cli"), "cli.serve",
          ("cli.demo", "cli.entry", "cli", "cli.__main__")]  # fmt: skip
MAX_LINES = 300
# Files allowed past MAX_LINES, each with the reason.
LONG_FILES: dict[str, str] = {
    "omni_lightning/kernels/snake_beta.py": "one op per file: SnakeBeta's forward and backward Triton "
    "kernels, their launchers, the autograd function and the torch reference together, and the launch settings the "
    "kernel report compiles (hopper_launches, from the launchers' own settings functions)",
    "omni_lightning/kernels/conv_snake.py": "one op per file: the fused convolution + SnakeBeta's forward and "
    "backward Triton kernels, their launchers and tile settings, the autograd function and the torch reference "
    "together, and the launches the kernel report compiles (hopper_launches)",
    "omni_lightning/runner/session.py": "the one owner of the device weights: every place that points a "
    "parameter elsewhere (host weights held, lent, restored; layouts for graphs) and the session that decides when",
    "omni_lightning/callbacks/writer.py": "the one writer of a job's folder, start to end (what is finished, "
    "decisions one batch behind, the background thread, the end's merge and counts); its parts are their own files",
    "omni_lightning/module.py": "the LightningModule: Lightning's hooks of every stage, each a few lines calling a "
    "collaborator, its documented entry points (engine, streams, training kernels) and the Args the CLI shows",
}
# Heavy optional dependencies: imported where they are used, never by `import omni_lightning`.
HEAVY = ("wandb", "soundfile", "jsonargparse", "transformers", "matplotlib", "pesq", "pystoi", "fastapi", "uvicorn")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> int:
    """A module's layer: its subpackage's, or its own where LAYERS names it (``cli.console``)."""
    parts = name.split(".")[1:]
    for key in [".".join(parts[:2])] * (len(parts) > 1) + [parts[0] if parts else "__init__"]:
        for i, entry in enumerate(LAYERS):
            if key == entry or (isinstance(entry, tuple) and key in entry):
                return i
    raise AssertionError(f"{name} is in no layer: add it to LAYERS in tests/test_layout.py")


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def imports(name: str, path: Path, known: set[str], type_checking: bool = False) -> set[str]:
    """The package modules ``name`` imports (``from pkg import sub`` resolves to ``pkg.sub``); with
    ``type_checking``, those under ``if TYPE_CHECKING:`` too."""
    tree = ast.parse(path.read_text())
    skipped = set() if type_checking else _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known and "." in target:  # import a.b.c where c is a name
                target = target.rpartition(".")[0]
            if target in known and target != name:
                out.add(target)
    return out


def graph(type_checking: bool = False) -> dict[str, set[str]]:
    found = files()
    return {name: imports(name, path, set(found), type_checking) for name, path in found.items()}


def test_imports_point_down_the_layers():
    upward = [
        f"{src} imports {dst}" for src, targets in graph().items() for dst in sorted(targets) if layer(dst) > layer(src)
    ]
    assert not upward, "upward imports (see the layer order in this file's docstring):\n" + "\n".join(upward)


def test_no_import_cycles():
    """Not even for types: ``if TYPE_CHECKING:`` imports count here."""
    edges, cycles, state = graph(type_checking=True), [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layout_check_sees_function_level_and_type_checking_imports():
    edges, typed = graph(), graph(type_checking=True)
    assert "omni_lightning.cli.demo" in edges["omni_lightning.cli.entry"]  # imported inside main()
    assert "omni_lightning.kernels" not in edges["omni_lightning.models.state"]  # TYPE_CHECKING only: no layer edge
    assert "omni_lightning.kernels" in typed["omni_lightning.models.state"]  # but an edge a cycle would count


def test_the_cycle_check_counts_type_checking_imports(tmp_path, monkeypatch):
    """A circle closed only by an ``if TYPE_CHECKING:`` import is seen (the check is not vacuous)."""
    package = tmp_path / "omni_lightning"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from omni_lightning.b import B\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from omni_lightning.a import A\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert "omni_lightning.a" in graph(type_checking=True)["omni_lightning.b"]
    assert "omni_lightning.a" not in graph()["omni_lightning.b"]


def test_no_file_is_too_long():
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    unexplained = {f: n for f, n in long.items() if f not in LONG_FILES}
    assert not unexplained, f"files over {MAX_LINES} lines (split them, or list them with a reason): {unexplained}"


def _loaded(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True, cwd=PACKAGE.parent)  # fmt: skip
    return {m.split(".")[0] for m in out.stdout.split()}


def test_import_omni_lightning_loads_no_heavy_optional_dependency():
    """``import omni_lightning`` adds none of :data:`HEAVY` to what torch, torchaudio and Lightning
    load by themselves. (Lightning imports torchmetrics, which imports matplotlib and transformers
    when they are installed; those two are checked against that baseline, the others absolutely.)"""
    baseline = _loaded("import torch, torchaudio, lightning.pytorch")
    loaded = _loaded("import omni_lightning")
    assert "omni_lightning" in loaded
    added = sorted(m for m in HEAVY if m in loaded and m not in baseline)
    assert not added, f"import omni_lightning loads {added}: import them where they are used"
    assert not {"wandb", "soundfile", "jsonargparse"} & loaded


def test_test_files_share_helpers_not_each_other():
    """Shared test code lives in tests/helpers.py (or conftest.py): no test file imports another."""
    offenders = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.name} imports {n}" for n in names if n and n.split(".")[0].startswith("test_")]
    assert not offenders, offenders


def test_the_repository_root_holds_only_the_projects_files():
    """What git tracks at the top: the package, its tests, docs, configs, scripts and CI, and the project's own
    files (a tool's leftover, as LitServe's generated client.py was, fails here)."""
    root = PACKAGE.parent
    listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if listed.returncode or not listed.stdout:
        pytest.skip("not a git checkout")
    top = {path.split("/")[0] for path in listed.stdout.splitlines()} - {"LICENSE"}
    allowed = {
        ".ci",
        ".gitignore",
        "README.md",
        "pyproject.toml",
        "configs",
        "docs",
        "omni_lightning",
        "scripts",
        "tests",
    }
    assert top <= allowed, f"not the project's: {sorted(top - allowed)}"
    assert (root / "LICENSE").read_text().startswith("\n                                 Apache License")
