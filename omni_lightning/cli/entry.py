"""``omni-lightning``: LightningCLI (fit / validate / test / predict) over Code2WavModule and
CodesDataModule with omni_lightning's Trainer, plus ``serve`` and ``demo``. ``omni-lightning --help``
(``console.HELP``, printed before torch loads) lists the subcommands, options, examples and exit statuses:

0 done (predict: every request has its file; serve: stopped after answering all in flight); 1 an unexpected
error (a bug or a broken environment: the traceback is printed); 2 a usage error (one ``error:`` line); 3 predict
finished but some requests failed (each is in <out_dir>/manifest.jsonl with its reason); 130 interrupted (Ctrl-C);
143 terminated (SIGTERM: stopped after the batch in progress, or the step in fit; serve: a drain cut short).
Interrupted or terminated, predict writes the batches already decoded first and says how many requests are
saved; a fit that checkpoints saves interrupted.ckpt beside its checkpoints and says how to resume from it.
"""

from __future__ import annotations

import gc
import io
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from omni_lightning.cli.console import SUBCOMMAND_HELP, compact_warnings, top_level_help, write_timings

EXIT_OK, EXIT_BUG, EXIT_USAGE, EXIT_FAILED_REQUESTS, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 130, 143
DEBUG_ENV = "OMNI_LIGHTNING_DEBUG"
TERMINATED = "error: terminated (SIGTERM)"  # predict wrote the batches it had decoded
INTERRUPTED = "error: interrupted"


def _is_usage_error(err: BaseException) -> bool:
    """Raised as a usage error: ours, or Lightning's own for a trainer configured wrongly."""
    from omni_lightning.errors import UsageError

    if isinstance(err, UsageError):
        return True
    exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")
    return exceptions is not None and isinstance(err, exceptions.MisconfigurationException)


def _option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """``--name VALUE`` or ``--name=VALUE`` taken out of ``argv``: (value or None, the rest)."""
    rest, value, i = [], None, 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith(name + "="):
            value = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return value, rest


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (see the module docstring)."""
    timings: dict[str, Any] = {"process_start": process_start_time(), "main": time.time()}
    program = argv is None  # run as the program (not called from Python): the process ends after this
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    full_help = "--help-all" in argv  # a subcommand's every option, not only those it uses
    argv = ["--help" if a == "--help-all" else a for a in argv]
    timings_path, argv = _option(argv, "--timings")
    if debug:
        os.environ[DEBUG_ENV] = "1"  # DDP ranks, started from sys.argv, inherit it
    compact_warnings()
    restore_output = _escaping_output()
    lock_module = sys.modules.get("omni_lightning.data.folder_lock")  # a host program's locks are its own
    locked_before = lock_module.held() if lock_module is not None else frozenset()
    interrupted, restore_handler = _catch_interrupt()
    terminated, restore_term = _catch_terminate()
    timings_ok = False  # --timings names a file that can be written
    command = None  # the checked command line, once read
    try:
        if _wants_top_level_help(argv):
            print(top_level_help())
            return EXIT_OK
        if timings_path:
            from omni_lightning.cli.path_checks import check_timings

            check_timings(timings_path)
            timings_ok = True
        if argv[:1] == ["--version"]:
            from omni_lightning import __version__

            print(f"omni-lightning {__version__}")
            return EXIT_OK
        if argv and argv[0] == "demo":
            from omni_lightning.cli.demo import main as demo_main

            demo_main(argv[1:])
            return _ended(terminated, EXIT_OK)
        from omni_lightning.cli.preflight import check_command_line, finished_job

        command = check_command_line(argv)  # before torch and Lightning load: a mistake costs a second, not ten
        timings["checked"] = time.time()
        done = finished_job(command)
        if done is not None:
            for warning in (command.other_format, command.other_weights):  # (a job that runs has its writer say it)
                if warning:
                    print(warning, file=sys.stderr)
            print(f"predict: {done}")
            return EXIT_OK
        finished = command.finished if command else None
        return _ended(terminated, _run(argv, timings if timings_path else None, finished, full_help))
    except KeyboardInterrupt as stop:
        print(INTERRUPTED + saved_so_far(command, stop), file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as stop:
        if interrupted:  # Lightning turns Ctrl-C into exit(1) after its graceful shutdown
            print(INTERRUPTED + saved_so_far(command, stop), file=sys.stderr)
            return EXIT_INTERRUPTED
        if terminated:  # Lightning's loops stop after a batch with an exception that would exit 0
            print(TERMINATED + saved_so_far(command, stop), file=sys.stderr)
            return EXIT_TERMINATED
        raise
    except Exception as err:
        if terminated or _workers_terminated(err):  # a stop sent to the process group: workers died of it first
            print(TERMINATED + saved_so_far(command, err), file=sys.stderr)
            return EXIT_TERMINATED
        if not _is_usage_error(err):
            traceback.print_exc()
            if getattr(err, "fit_stopped", None):  # the fit saved where it was before the error ended it
                print(f"fit stopped by the error above{err.fit_stopped}", file=sys.stderr)
            return EXIT_BUG
        if debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        restore_handler()
        restore_term()
        restore_output()
        if "omni_lightning.data.folder_lock" in sys.modules:  # output folders this command locked
            sys.modules["omni_lightning.data.folder_lock"].unlock_all(keep=locked_before)
        if timings_ok:
            timings["end"] = time.time()
            try:
                write_timings(timings_path, timings)
            except OSError as err:  # checked at the start; the job's own exit status stands
                print(f"warning: --timings {timings_path} was not written: {err}", file=sys.stderr)
        if program:
            # the process exits next: its final garbage collection would walk every object torch and
            # Lightning made (1.5 s of a 2 s exit on a 2-core machine); nothing left needs collecting
            gc.freeze()


def _escaping_output() -> Any:
    """stdout and stderr escape what they cannot encode (ids of non-UTF-8 file names); returns the undo."""
    streams = [(s, s.errors) for s in (sys.stdout, sys.stderr) if isinstance(s, io.TextIOWrapper)]
    for stream, _ in streams:
        stream.reconfigure(errors="backslashreplace")
    return lambda: [stream.reconfigure(errors=errors) for stream, errors in streams]


def _wants_top_level_help(argv: list[str]) -> bool:
    """``-h``/``--help`` with no subcommand before it: this command's own help, not a subcommand's."""
    for arg in argv:
        if arg in ("-h", "--help", "--help-all"):
            return True
        if arg in SUBCOMMAND_HELP:
            return False
    return False


def saved_so_far(command: Any, stop: BaseException | None = None) -> str:
    """For a job stopped early, what it saved and how to resume: a fit's checkpoint (``stop.fit_stopped``,
    set by ``lightning_cli``), or how many requests a predict saved in ``--out_dir``."""
    if getattr(stop, "fit_stopped", None):
        return stop.fit_stopped
    out_dir = command.values.get("out_dir") if command is not None and command.sub == "predict" else None
    if not isinstance(out_dir, str) or not os.path.isdir(out_dir):
        return ""
    from omni_lightning.data.output_folder import Finished

    finished, ids = Finished.read(out_dir), command.predict_ids
    if ids is None:
        return f"; what was decoded is saved in {out_dir}: the same command resumes the rest"
    before = sum(i in command.finished for i in ids) if command.finished is not None else 0
    done = sum(i in finished for i in ids)
    return (
        f": {done - before} requests saved by this run in {out_dir} ({done} of {len(ids)} done); "
        "the same command resumes the rest"
    )


def _catch_interrupt() -> tuple[list[bool], Any]:
    """Ctrl-C still raises KeyboardInterrupt; the returned list records that it came. Returns it and
    a function that puts the previous handler back (``main`` may run inside another program)."""
    interrupted: list[bool] = []
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler or threading.current_thread() is not threading.main_thread():
        return interrupted, lambda: None  # someone else handles it (or ignores it): left alone

    def on_interrupt(signum: int, frame: Any) -> None:
        interrupted.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    return interrupted, lambda: signal.signal(signal.SIGINT, previous)


def _ended(terminated: list[bool], status: int) -> int:
    """``status``, or 143 after a SIGTERM that came in a stage's last batch or end hooks (Lightning's
    loops did not stop there; the work is done, yet the command was asked to stop)."""
    if terminated:
        print(TERMINATED, file=sys.stderr)
        return EXIT_TERMINATED
    return status


def _workers_terminated(err: BaseException) -> bool:
    """torch's error for a loader worker that SIGTERM ended (where Lightning's handler failed before
    this command's could record the signal: a DDP rank whose peers were gone)."""
    return isinstance(err, RuntimeError) and "killed by signal: Terminated" in str(err)


def _catch_terminate() -> tuple[list[bool], Any]:
    """SIGTERM (a scheduler's stop, ``kill``) is recorded. While a Trainer runs, Lightning's handler
    (which calls this one too) stops the loops after the batch in progress, the decoded batches are
    written, and ``main`` exits 143, also when the stop, sent to the whole process group, killed the
    loader workers first (their death is then the error that ends the run). Outside a Trainer it ends
    the command at once, as the default action would, with the same status."""
    terminated: list[bool] = []
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL or threading.current_thread() is not threading.main_thread():
        return terminated, lambda: None  # someone else handles it: left alone

    def on_terminate(signum: int, frame: Any) -> None:
        terminated.append(True)
        if signal.getsignal(signal.SIGTERM) is on_terminate:  # no Trainer's handler around this one
            raise SystemExit(EXIT_TERMINATED)

    signal.signal(signal.SIGTERM, on_terminate)
    return terminated, lambda: signal.signal(signal.SIGTERM, previous)


def _run(argv: list[str], timings: dict[str, Any] | None, finished: Any = None, full_help: bool = False) -> int:
    # LightningCLI reads sys.argv (passing args as well makes it warn), and DDP starts the other
    # ranks from sys.argv: both see exactly these arguments
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]
    # wandb's ~30 lines (run history and summary) after the metrics line: the line names the run's folder
    # and the command that uploads it instead (WANDB_SILENT=false keeps wandb's own)
    silenced = "WANDB_SILENT" not in os.environ
    if silenced:
        os.environ["WANDB_SILENT"] = "true"
    try:
        cli = run_cli(None, timings, finished, full_help)
        _finish_wandb(0)
    except BaseException:
        _finish_wandb(1)
        raise
    finally:
        sys.argv = saved
        if silenced:
            os.environ.pop("WANDB_SILENT", None)
    failed = cli.subcommand == "predict" and getattr(cli, "writer", None) is not None and cli.writer.any_failed
    return getattr(cli, "exit_status", EXIT_FAILED_REQUESTS if failed else EXIT_OK)  # (serve: how it stopped)


def _finish_wandb(exit_code: int) -> None:
    """Ends a W&B run the job started: left to exit, wandb prints its closing lines with ANSI colour
    codes even where stderr is not a terminal (a log file)."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=exit_code)


def run_cli(
    argv: list[str] | None, timings: dict[str, Any] | None = None, finished: Any = None, full_help: bool = False
) -> Any:
    """Builds and runs the LightningCLI (this imports torch and Lightning); ``finished``: the output
    folder's finished requests as the checks read them (not read again); ``full_help``: ``--help`` lists
    every option (``--help-all``), not only those the subcommand uses."""
    from omni_lightning.cli.lightning_cli import run_lightning_cli
    from omni_lightning.cli.serve import run_serve_cli, serves

    compact_warnings()  # again: importing Lightning replaced the format
    run = run_serve_cli if serves(sys.argv[1:] if argv is None else argv) else run_lightning_cli
    return run(argv, description=__doc__, timings=timings, finished=finished, full_help=full_help)


def process_start_time() -> float:
    """When this process started (wall clock, ~10 ms resolution on Linux), else now."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()
