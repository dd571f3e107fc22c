"""``omni-lightning serve``: predict's model options (``--model.*``, ``--ckpt_path``, ``--trainer.accelerator``,
``--trainer.precision``, ``--trainer.gpu_memory_utilization``, ``--config``), checked before torch loads as
predict's are (``preflight``), then built by the same LightningCLI (``OmniCLI``, not run: there is no
Trainer method to call) and served by ``omni_lightning.serving`` on ``--host``/``--port``.

``--ckpt_path`` loads a fit's Lightning checkpoint as predict does: its architecture and weights, with the
run settings given beside it (``RUN_SETTINGS``). A true precision (``bf16-true``) casts the weights; a
mixed one (``bf16-mixed``) runs the decode thread under the precision plugin's autocast.
``--devices N`` runs N worker processes behind the port, each parsing this same command line and serving
its own engine on its own GPU (``serving/workers.py``); on a CPU, CPU workers (that is what the tests run).
A config file given before ``serve`` holds a section per subcommand: its ``serve:`` section is passed to the
parser inline (``serve_arguments``). A stopped server's last line and exit status are ``stop_line``'s (not
with ``--devices N``: the workers' own).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from types import SimpleNamespace
from typing import Any

from omni_lightning.cli.arguments import SUBCOMMANDS, config_paths, read_arguments, section_for, subcommand_at
from omni_lightning.cli.lightning_cli import RUN_SETTINGS, OmniCLI, OneLineErrorParser
from omni_lightning.cli.lines import quiet_cli_run
from omni_lightning.errors import UsageError
from omni_lightning.module import Code2WavModule
from omni_lightning.trainer import Trainer, quiet_cli_trainer

# serve's own options: (name, type, default, help)
OPTIONS = (
    ("host", str, "127.0.0.1", "the address to listen on (0.0.0.0: every interface)"),
    ("port", int, 8000, "the port to listen on (0: a free one, named in the start-up line)"),
    ("max_streams", int, 64, "clients decoded at once (each holds a decode slot); more streams get 503"),
    ("max_queue", int, 256, "whole requests waiting for a slot; more get 503 with Retry-After"),
    ("max_body_bytes", int, 8 * 2**20, "a request body or WebSocket message past this gets 413"),
    ("request_frames", int, 32, "frames of a whole request decoded per step (streams interleave between)"),
    ("drain_timeout", float, 30.0, "on SIGTERM, seconds to finish what is in flight before exiting"),
    ("devices", int, 1, "processes behind the port, each its own engine on its own GPU (on a CPU: CPU workers)"),
)


class ServeCLI(OmniCLI):
    """``OmniCLI`` parsing serve's command line (no subcommand: ``run=False``) with serve's options."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        for name, kind, default, text in OPTIONS:
            parser.add_argument(f"--{name}", type=kind, default=default, help=text)
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="a Lightning checkpoint from fit")
        parser.add_argument("--debug", type=bool, default=False, help="print the traceback of usage errors too")
        parser.set_defaults({"trainer.logger": False, "trainer.use_distributed_sampler": False})
        if isinstance(parser, OneLineErrorParser) and not self.full_help:
            parser.short_help = "serve"

    def instantiate_classes(self) -> None:
        with quiet_cli_trainer("serve"):  # Lightning's device lines go, as for predict: the start-up line says them
            super().instantiate_classes()


def serves(argv: list[str]) -> bool:
    """Whether ``argv`` (the arguments after the program) runs ``serve``, config files given before it too."""
    try:
        return argv[subcommand_at(argv, SUBCOMMANDS)] == "serve"
    except UsageError:
        return False


def serve_arguments(argv: list[str]) -> list[str]:
    """``argv``'s arguments after ``serve``, each config file given before ``serve`` first as its ``serve``
    section (inline YAML, as the parser takes ``--config``)."""
    sub_at = subcommand_at(argv, SUBCOMMANDS)
    sections = [section_for(path, "serve") for path in config_paths(argv[:sub_at])]
    return [*(a for s in sections if s for a in ("--config", json.dumps(s))), *argv[sub_at + 1 :]]


def run_serve_cli(argv: list[str] | None = None, full_help: bool = False, **ignored: Any) -> Any:
    """``omni-lightning serve``: builds and serves until SIGTERM or Ctrl-C (drained first). ``argv``: the
    command line (None: ``sys.argv``), checked before torch loaded (``cli.main`` runs
    ``preflight.check_command_line``). Returns what ``cli`` reads of a run: its exit status."""
    argv = serve_arguments(list(sys.argv[1:] if argv is None else argv))
    with quiet_cli_run():  # Lightning's "Seed set to 0"
        status = main(argv, full_help)
    return SimpleNamespace(subcommand="serve", writer=None, exit_status=status)


def main(argv: list[str], full_help: bool = False) -> int:
    """Serves ``argv`` (after ``serve``) until stopped; returns the exit status (:func:`stop_line`)."""
    values = read_arguments(["serve", *argv], ("serve",)).values
    devices = str(values.get("devices") or 1)
    if not devices.isdigit() or int(devices) < 1:
        raise UsageError(f"--devices must be an integer >= 1, got {devices}")
    if int(devices) > 1 and not {"-h", "--help"} & set(argv):  # a process per device, each parsing this line
        from omni_lightning.serving.workers import run_workers

        host, port = str(values.get("host") or "127.0.0.1"), int(values.get("port") or 8000)
        try:
            run_workers(int(devices), host, port, worker_main, (host, argv))
        except ValueError as err:
            raise UsageError(str(err)) from err
        return 0
    from omni_lightning.serving.server import bound_socket

    help_only = bool({"-h", "--help"} & set(argv))
    sock = None if help_only else bound_socket(str(values.get("host") or "127.0.0.1"), int(values.get("port") or 8000))
    try:  # (bound before the model loads: a port in use is said at once)
        cli = _parse(argv, full_help)
        server = serve_module(_load(cli, argv), cli.trainer, cli.config, cli.config.ckpt_path, sock)
    finally:
        if sock is not None:
            sock.close()
    status, line = stop_line(server)
    print(line, file=sys.stderr if status else sys.stdout, flush=True)
    return status


def stop_line(server: Any) -> tuple[int, str]:
    """How a stopped server ended: 0 and a ``serve:`` line when every client in flight was answered;
    130 (Ctrl-C) or 143 (SIGTERM) and an ``error:`` line when some were cut off."""
    n, by = server.cut_off, server.stopped_by or "request"
    if server.cut_reason is not None:
        cut = f"{n} {'request or stream' if n == 1 else 'requests and streams'} in flight cut off, each told so"
        return (130 if by == "Ctrl-C" else 143), f"error: serve: {server.cut_reason}: {cut}"
    took = time.monotonic() - (server.drain_started or time.monotonic())
    return 0, f"serve: stopped on {by}, every request and stream in flight answered (drained in {took:.1f} s)"


def worker_main(index: int, count: int, port: int, host: str, argv: list[str]) -> None:
    """One of ``--devices`` processes: the same command line, its own engine, listening with ``SO_REUSEPORT``."""
    from omni_lightning.serving.workers import reuse_port_socket

    cli = _parse(argv)
    sock = reuse_port_socket(host, port)
    serve_module(
        _load(cli, argv), cli.trainer, cli.config, cli.config.ckpt_path, sock, f"worker {index + 1} of {count}"
    )


def _parse(argv: list[str], full_help: bool = False) -> ServeCLI:
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]  # LightningCLI reads sys.argv (given args too, it warns)
    try:
        return _serve_cli(full_help)
    finally:
        sys.argv = saved


def _serve_cli(full_help: bool) -> ServeCLI:
    return ServeCLI(
        Code2WavModule,
        None,
        run=False,
        trainer_class=Trainer,
        parser_class=OneLineErrorParser,
        parser_kwargs={"prog": "omni-lightning serve", "description": __doc__},
        seed_everything_default=0,
        auto_configure_optimizers=False,
        full_help=full_help,
    )


def _load(cli: ServeCLI, argv: list[str]) -> Any:
    """The module the parser built, or the ``--ckpt_path`` checkpoint's with the run settings given beside it."""
    ckpt_path = cli.config.ckpt_path
    if not ckpt_path:
        return cli.model
    args = read_arguments(["serve", *argv], ("serve",))
    settings = {k: cli.config.model[k] for k in RUN_SETTINGS if args.sets(f"model.{k}")}
    return type(cli.model).load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=False, **settings)


def serve_module(module: Any, trainer: Any, config: Any, ckpt_path: str | None, sock: Any = None,
                 worker: str | None = None) -> Any:  # fmt: skip
    """Puts ``module`` on the trainer's device and precision and serves it until stopped (``sock``: a bound
    socket to listen on, a worker's); returns the stopped ``DrainingServer``."""
    from omni_lightning.callbacks.progress import what_runs
    from omni_lightning.serving import build_app, server_for
    from omni_lightning.serving.app import ROUTES

    log = logging.getLogger("omni_lightning.serving")  # a line per request and stream, with its id
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    device, plugin = trainer.strategy.root_device, trainer.strategy.precision_plugin
    module = plugin.convert_module(module.to(device)).eval()
    params = sum(p.numel() for p in module.model.parameters())
    what = what_runs(module, module.config, params, ckpt_path, device, trainer.precision)
    cuda_graphs = bool(module.fast_path and module.hparams.get("graph_frames", 512))
    share = getattr(trainer.predict_loop, "gpu_memory_utilization", None)
    app = build_app(module, config.max_streams, config.max_queue, config.max_body_bytes, config.request_frames,
                    cuda_graphs, share, context=plugin.forward_context)  # fmt: skip

    def on_listen(host: str, port: int) -> None:
        limits = f"{config.max_streams} streams at once, {config.max_queue} requests queued"
        who = f"{worker}: " if worker else ""
        print(f"serve: {who}{what}; {limits}; listening on http://{host}:{port} ({ROUTES})", flush=True)

    server = server_for(app, config.host, config.port, config.drain_timeout, on_listen, log_level="warning")
    if sock is not None:
        sock.listen(2048)
    server.run(sockets=[sock] if sock is not None else None)
    sys.stdout.flush()
    return server
