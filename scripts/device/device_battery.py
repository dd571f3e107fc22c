"""The GPU tests and benchmarks, on a GPU machine: a past commit (before) against this tree (after),
interleaved, in one command that ends inside its time; results as JSON under ``--out``.

    python scripts/device/device_battery.py --prepare --wheels    # where git works: .bench/ and .whl/
    python3 scripts/device/device_battery.py --parts ab           # on a GPU machine (with .bench/ and .whl/)
    python3 scripts/device/device_battery.py --parts tests throughput
    python scripts/device/device_battery.py --dry-run --out DIR   # any CPU: every step on the tiny preset
    python scripts/device/device_battery.py --plan                # the steps and commands, nothing run

Before a GPU run, ``python scripts/kernels/kernel_report.py`` runs on any machine (no GPU needed): every Triton
launch the code makes on qwen3-omni's shapes compiled for sm_90a, exit status 1 where one on the
default path spills or exceeds shared memory; a GPU run then confirms a design the report passed.

The steps are ``battery_plan.STEPS``. This tree's scripts time both versions; only the package on
``PYTHONPATH`` differs. The before tree comes from ``--before-tar`` (``--prepare`` makes it with
``git archive``: the device gets the working tree, not ``.git``), else from ``git archive`` where git
has the commit. Wheels in ``.whl/`` are installed into a temporary folder first. A run starts only if
its estimate fits the time left of ``--budget-s``; a skipped run is said, with why. The JSON and the
log are rewritten after every run. Standard library only: it starts before any wheel is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from battery_plan import FIGURES, PARTS, STEPS, Step

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "c4e9603"  # the last GPU-measured tree (2026-12-07, H100: docs/performance.md)
WHEELS = (
    "soundfile==0.14.0",
    "cffi==2.1.1",
    "pycparser==3.12",
    "jsonargparse==4.53.0",
    "docstring_parser==0.18.0",
    "typeshed_client==2.15.0",
    # the serve extra (httpx, uvloop and prometheus_client are there)
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "annotated_doc==0.0.7",
    "opentelemetry_api==1.45.3",
    "importlib_metadata==10.2.0",
    "zipp==4.1.2",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "annotated_types==0.8.0",
    "typing_inspection==0.4.5",
    "typing_extensions==4.16.0",
    "uvicorn==0.55.0",
    "h11==0.16.0",
    "click==8.5.1",
    "websockets==17.4",
    "httptools==0.9.0",
    "pyzmq==27.3.0",
    "msgpack==1.2.4",
)  # fmt: skip  (what the test suite and the server import that the device lacks, wandb aside)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")  # fmt: skip
PROBE = """import importlib.util, json, torch
mods = {m: importlib.util.find_spec(m) is not None for m in
        ("wandb", "soundfile", "jsonargparse", "transformers", "pytest_timeout")}
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": cuda, "modules": mods,
                  "gpu": torch.cuda.get_device_name() if cuda else None}))"""


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def git(*args: str, **kw) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True, **kw).stdout.strip()


def package_digest(root: Path) -> str:
    """A digest of ``root``'s package sources: whether the tree run is the one ``--prepare`` saw."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((root / "omni_lightning").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def after_label(manifest: dict, root: Path) -> str:
    """The after tree's name: the commit ``--prepare`` saw, unless the package run differs from its."""
    after = manifest.get("after", "this tree")[:7]
    if manifest.get("after_package", package_digest(root)) != package_digest(root):
        return f"this tree (its package changed since --prepare at {after})"
    return after


def prepare(args: argparse.Namespace) -> None:
    """Here, where git works: the before tree as a tar and a manifest beside it (+ the wheels)."""
    tar = Path(args.before_tar).resolve()
    tar.parent.mkdir(parents=True, exist_ok=True)
    before = git("rev-parse", "--verify", f"{args.before}^{{commit}}")
    git("archive", "--format=tar", "-o", str(tar), before)
    manifest = {"before": before, "after": git("rev-parse", "HEAD"), "made": now(),
                "after_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
                "after_package": package_digest(ROOT)}  # fmt: skip
    tar.with_name("manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"{tar}: {before[:7]}; after = HEAD {manifest['after'][:7]}{' + changes' * manifest['after_dirty']}")
    inside = tar.parent.is_relative_to(ROOT)
    if inside and subprocess.run(["git", "check-ignore", "-q", str(tar.parent)], cwd=ROOT).returncode:
        exclude = ROOT / git("rev-parse", "--git-path", "info/exclude")
        with exclude.open("a") as f:
            f.write(f"/{tar.parent.relative_to(ROOT)}/\n")
        print(f"{tar.parent.name}/ added to {exclude} (carry it)")
    if args.wheels:
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(ROOT / ".whl"),
                        *WHEELS], check=True)  # fmt: skip
        print(f"wheels in {ROOT / '.whl'}: {', '.join(WHEELS)}")


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def before_tree(args: argparse.Namespace, work: Path) -> tuple[Path, dict]:
    dest = work / "before"
    dest.mkdir()
    tar = Path(args.before_tar)
    manifest_path = tar.with_name("manifest.json")
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    if tar.exists():
        if manifest.get("before") and not manifest["before"].startswith(args.before):
            fail(f"{tar} holds {manifest['before'][:7]}, not --before {args.before}: run --prepare again")
        with tarfile.open(tar) as t:
            t.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    else:
        try:
            full = git("rev-parse", "--verify", f"{args.before}^{{commit}}")
        except (OSError, subprocess.CalledProcessError):
            hint = (
                f"run `python scripts/device/device_battery.py --prepare` where git works and carry {tar.parent.name}"
            )
            fail(f"no before tree: {tar} is missing and git cannot read {args.before}; {hint}")
        data = subprocess.run(["git", "archive", "--format=tar", full], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=data.stdout, check=True)
        manifest = {"before": full, "after": git("rev-parse", "HEAD")}
    if not (dest / "omni_lightning" / "__init__.py").exists():
        fail(f"the before tree from {tar} has no omni_lightning package")
    return dest, manifest


def install_wheels(work: Path, log) -> Path | None:
    """The device's missing packages (``--prepare --wheels``); a dry run skips them: they are built for
    the device's Python and may not install here."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        say("no wheels in .whl/: the packages python has", log)
        return None
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--target", str(site), *map(str, wheels)], check=True)  # fmt: skip
    say(f"installed {len(wheels)} wheels from .whl/ into {site}", log)
    return site


def say(line: str, log) -> None:
    print(line, flush=True)
    if log is not None:
        log.write(line + "\n")
        log.flush()


def environment(roots: dict[str, Path], site: Path | None, cwd: Path) -> dict:
    """What the runs import (probed from their ``cwd``: a package in the current folder wins), and the GPU."""
    out = {}
    for version, root in roots.items():
        probe = "import omni_lightning, json; print(json.dumps(omni_lightning.__file__))"
        env = child_env(root, site)
        run = subprocess.run(
            [sys.executable, "-c", probe], env=env, cwd=cwd, capture_output=True, text=True, check=True
        )
        out[version] = json.loads(run.stdout)
    probe = subprocess.run([sys.executable, "-c", PROBE], env=child_env(ROOT, site), cwd=cwd, capture_output=True,
                           text=True)  # fmt: skip
    if probe.returncode:
        fail(f"python cannot import torch: {probe.stderr[-500:]}")
    gpu = ""
    if shutil.which("nvidia-smi"):  # the card as found: memory in use, temperature, clocks
        query = "--query-gpu=name,memory.used,memory.total,temperature.gpu,clocks.sm,clocks.max.sm"
        gpu = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True).stdout
    return {"package": out, **json.loads(probe.stdout), "python": sys.version.split()[0], "nvidia_smi": gpu.strip()}


def child_env(root: Path, site: Path | None) -> dict[str, str]:
    path = [str(root), *([str(site)] if site else []), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "PYTHONUNBUFFERED": "1"}


def schedule(parts: list[str], names: list[str] | None, most: int | None) -> list[tuple[Step, str, int]]:
    """(step, version, round): each part in order, round by round, before then after; ``most`` caps
    a step's rounds."""
    runs = []
    for part in parts:
        steps = [s for s in STEPS if s.part == part and (not names or s.name in names)]
        rounds = {s.name: min(s.rounds, most or s.rounds) for s in steps}
        for r in range(max(rounds.values(), default=0)):
            for s in (s for s in steps if rounds[s.name] > r):
                runs += [(s, v, r + 1) for v in (("before", "after") if s.ab else ("after",))]
    return runs


def command(step: Step, args: argparse.Namespace, out: Path, env: dict) -> list[str]:
    if step.script == "pytest":
        files = sorted({str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                        if "mark.gpu" in p.read_text()})  # fmt: skip
        # a test file that imports wandb cannot be collected without it; every gpu test is in these files
        where = ["tests"] if env.get("has_wandb") else files
        timeout = ["--timeout=300"] if env.get("has_timeout") else []
        return [sys.executable, "-m", "pytest", *step.args, *timeout, *where]
    own = step.smoke if args.dry_run else step.args
    return [sys.executable, str(script_path(step.script)), *own, "--out", str(out)]


def script_path(name: str) -> Path:
    """``scripts/<group>/<name>.py``: a step names its script, not the folder the script is grouped in."""
    (path,) = (ROOT / "scripts").glob(f"*/{name}.py")
    return path


def run_child(cmd: list[str], cwd: Path, env: dict, timeout: float, log) -> tuple[int, str]:
    """Runs ``cmd`` in its own process group, killed with its children at ``timeout``; its output to the log."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[killed after {timeout:.0f} s]"
        proc.returncode = 124
    log.write(f"$ {' '.join(cmd)}\n{output}\n")
    log.flush()
    return proc.returncode, output


def figures(step: Step, result: dict) -> dict[str, float]:
    return {label: v for label, read, _ in FIGURES.get(step.script, ()) if (v := read(result)) is not None}


def pytest_counts(output: str) -> dict[str, float]:
    tail = output.strip().splitlines()[-1:] or [""]
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail[0])}


def summary(step_runs: list[dict]) -> list[str]:
    """A markdown table: each step's figures, before and after, every round, and after over before."""
    lines = ["| step | figure | before | after | after / before |", "|---|---|---|---|---|"]
    for step in STEPS:
        runs = [r for r in step_runs if r["step"] == step.name]
        if not runs:
            continue
        if step.script == "pytest":
            last = runs[-1]
            counts = ", ".join(f"{n} {k}" for k, n in last["figures"].items()) or (last["tail"] or ["no output"])[-1]
            lines.append(f"| {step.name} | pytest -m gpu | | {counts} (exit {last['rc']}) | |")
            continue
        shown = len(lines)
        for label, _, fmt in FIGURES.get(step.script, ()):
            got = {v: [r["figures"][label] for r in runs if r["version"] == v and label in r["figures"]]
                   for v in ("before", "after")}  # fmt: skip
            if not any(got.values()):
                continue
            ratio = ""
            if got["before"] and got["after"] and statistics.median(got["before"]):
                ratio = f"{statistics.median(got['after']) / statistics.median(got['before']):.2f}"
            if step.limit and step.limit[0] == label and got["after"]:
                ratio += f" (limit {step.limit[1]:g}: {'ok' if max(got['after']) <= step.limit[1] else 'OVER'})"
            cells = [", ".join(format(v, fmt) for v in got[k]) for k in ("before", "after")]
            lines.append(f"| {step.name} | {label} | {cells[0]} | {cells[1]} | {ratio} |")
        if len(lines) == shown:  # a script without figures (or none read): its exit statuses
            exits = {v: ", ".join(str(r["rc"]) for r in runs if r["version"] == v) for v in ("before", "after")}
            lines.append(f"| {step.name} | exit status | {exits['before']} | {exits['after']} | |")
    failed = [f"{r['step']} {r['version']} r{r['round']} (exit {r['rc']})" for r in step_runs if r["rc"]]
    return lines + ([f"FAILED: {'; '.join(failed)}"] if failed else [])


def main() -> None:
    args = parser().parse_args()
    if args.prepare:
        return prepare(args)
    if args.steps and (unknown := set(args.steps) - {s.name for s in STEPS}):
        fail(f"unknown --steps {sorted(unknown)}; known: {[s.name for s in STEPS]}")
    parts = args.parts or list(PARTS)
    plan = schedule(parts, args.steps, args.rounds or (1 if args.dry_run else None))
    if args.plan:
        for step, version, r in plan:
            cmd = command(step, args, Path("OUT.json"), {})
            print(f"{step.part:10} {step.name:17} {version:6} r{r}  ~{step.est_s:.0f} s  {' '.join(cmd[1:])}")
        return
    start = time.monotonic()
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="battery-out-"))
    out.mkdir(parents=True, exist_ok=True)
    stem = "battery_" + "-".join(parts) + ("_dry" if args.dry_run else "")
    with tempfile.TemporaryDirectory(prefix="battery-") as tmp, (out / f"{stem}.log").open("w") as log:
        work = Path(tmp)
        site = None if args.dry_run else install_wheels(work, log)  # the device's wheels may not fit this machine
        roots = {"after": ROOT}
        manifest = {}
        if any(s.ab for s, _, _ in plan):
            roots["before"], manifest = before_tree(args, work)
        env_info = environment(roots, site, work)
        if not env_info["cuda"] and not args.dry_run:
            fail("no CUDA here: --dry-run runs the battery on the CPU (tiny preset)")
        say(f"battery {' '.join(parts)}: {len(plan)} runs, budget {args.budget_s:.0f} s; {json.dumps(env_info)}", log)
        say(f"before {manifest.get('before', '-')[:7]}, after {after_label(manifest, ROOT)}", log)
        meta = {"date": now(), "args": vars(args), "environment": env_info, "manifest": manifest}
        flags = {"has_wandb": env_info["modules"]["wandb"], "has_timeout": env_info["modules"]["pytest_timeout"]}
        done: list[dict] = []
        skipped: list[str] = []
        took: dict[str, float] = {}
        for step, version, r in plan:
            label = f"{step.name} {version} r{r}"
            if args.dry_run and step.script == "pytest":
                skipped.append(f"{label}: needs CUDA (dry run on the CPU)")
                say(f"skip {skipped[-1]}", log)
                continue
            est = took.get(step.name, 0.0 if args.dry_run else step.est_s)
            left = args.budget_s - (time.monotonic() - start)
            if est * (2 if step.ab and version == "before" else 1) > left:
                skipped.append(f"{label}: needs ~{est:.0f} s, {left:.0f} s left")
                say(f"skip {skipped[-1]}", log)
                continue
            result_path = work / f"{step.name}-{version}-{r}.json"
            cwd = ROOT if step.script == "pytest" else work
            env = child_env(roots[version], site)
            t0 = time.monotonic()
            rc, output = run_child(command(step, args, result_path, flags), cwd, env, left, log)
            took[step.name] = max(took.get(step.name, 0.0), time.monotonic() - t0)
            result = json.loads(result_path.read_text()) if result_path.exists() else {}
            got = pytest_counts(output) if step.script == "pytest" else figures(step, result)
            tail = output.strip().splitlines()[-(40 if step.script == "pytest" else 3) :]
            done.append({"step": step.name, "version": version, "round": r, "rc": rc, "seconds": time.monotonic() - t0,
                         "figures": got, "tail": tail, "result": result})  # fmt: skip
            if step.script == "pytest" or rc:
                say("\n".join(tail), log)
            shown = ", ".join(f"{k} {v:.4g}" for k, v in got.items())
            say(f"[{time.monotonic() - start:4.0f} s] {label}: exit {rc}, {time.monotonic() - t0:.0f} s; {shown}", log)
            table = summary(done)
            (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "runs": done, "skipped": skipped,
                                                          "summary": table}, indent=1, default=str))  # fmt: skip
        say("\n" + "\n".join(summary(done)), log)
        say(f"skipped: {len(skipped)}; {time.monotonic() - start:.0f} s in all; results in {out}/{stem}.json", log)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, help=f"default: all, in this order: {' '.join(PARTS)}")
    p.add_argument("--steps", nargs="+", help="only these steps (battery_plan.STEPS names)")
    p.add_argument("--rounds", type=int, help="at most this many rounds a step (default: its own; dry run: 1)")
    p.add_argument("--budget-s", type=float, default=560, help="no run starts that would end past this")
    p.add_argument("--before", default=BEFORE, help="the commit compared against")
    p.add_argument("--before-tar", default=str(ROOT / ".bench" / "before.tar"))
    p.add_argument("--out", help="results folder (default: $OUT, else a new temporary folder)")
    p.add_argument("--dry-run", action="store_true", help="the CPU, the tiny preset: a check of the battery itself")
    p.add_argument("--plan", action="store_true", help="print the runs and their commands; run nothing")
    p.add_argument("--prepare", action="store_true", help="make --before-tar and its manifest here (needs git)")
    p.add_argument("--wheels", action="store_true", help="with --prepare: download the wheels into .whl/")
    return p


if __name__ == "__main__":
    main()
