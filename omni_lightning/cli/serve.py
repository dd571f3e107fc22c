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
import os
import sys
from types import SimpleNamespace
from typing import Any

from omni_lightning.cli.arguments import SUBCOMMANDS, config_paths, read_arguments, section_for, subcommand_at
from omni_lightning.cli.lightning_cli import RUN_SETTINGS, OmniCLI, OneLineErrorParser
from omni_lightning.cli.lines import quiet_cli_run
from omni_lightning.cli.serve_options import OPTIONS
from omni_lightning.errors import UsageError
from omni_lightning.module import Code2WavModule
from omni_lightning.trainer import Trainer, quiet_cli_trainer


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
    devices, fronts = str(values.get("devices") or 1), str(values.get("front_processes") or -1)
    if not devices.isdigit() or int(devices) < 1:
        raise UsageError(f"--devices must be an integer >= 1, got {devices}")
    if not fronts.lstrip("-").isdigit() or int(fronts) < -1:
        raise UsageError(f"--front_processes must be an integer >= -1 (-1: chosen from the cores), got {fronts}")
    fronts_n = int(fronts) if int(fronts) >= 0 else max(1, min(8, (os.cpu_count() or 4) // 4))
    if fronts_n == 0 and int(devices) > 1:
        raise UsageError(f"--front_processes 0 (one process) serves one device: --devices {devices} needs fronts")
    if fronts_n == 0 or {"-h", "--help"} & set(argv):
        return serve_here(argv, values, full_help)
    from omni_lightning.serving.app import ROUTES
    from omni_lightning.serving.front_process import FrontSettings, run_front
    from omni_lightning.serving.supervisor import ChildDied, Supervisor

    host, port = str(values.get("host") or "127.0.0.1"), int(values.get("port") or 8000)
    settings = FrontSettings(host, int(values.get("max_streams") or 64), int(values.get("max_body_bytes") or 8 * 2**20),
                             float(values.get("drain_timeout") or 30.0))  # fmt: skip

    def on_ready(info: dict, host: str, port: int) -> None:
        processes = f"{devices} engine process{'es' * (int(devices) > 1)}, {fronts_n} front{'s' * (fronts_n > 1)}"
        print(f"serve: {info['what']}; {info['limits']}; {processes}; listening on http://{host}:{port} ({ROUTES})",
              flush=True)  # fmt: skip

    supervisor = Supervisor(int(devices), fronts_n, host, port, engine_main, (argv,), run_front, (settings,), on_ready)
    try:
        supervisor.run()
    except ValueError as err:
        raise UsageError(str(err)) from err
    except ChildDied as err:
        raise SystemExit(f"error: serve: {err}") from None
    status, line = supervisor.stop_line()
    print(line, file=sys.stderr if status else sys.stdout, flush=True)
    return status


def engine_main(index: int, address: str, conn: Any, argv: list[str]) -> None:
    """An engine process: this command line's module on this process's device, its decode loop served."""
    from omni_lightning.serving.engine_process import run_engine

    def build() -> tuple[Any, dict]:
        with quiet_cli_run():  # Lightning's "Seed set to 0"
            cli = _parse(argv)
        return decode_loop_for(_load(cli, argv), cli.trainer, cli.config, cli.config.ckpt_path)

    run_engine(build, address, conn)


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


def decode_loop_for(module: Any, trainer: Any, config: Any, ckpt_path: str | None) -> tuple[Any, dict]:
    """``module`` on the trainer's device and precision, in a decode loop; and what the start-up line says."""
    import torch

    from omni_lightning.callbacks.progress import what_runs
    from omni_lightning.runner.cpu_threads import choose_threads
    from omni_lightning.serving.decode_loop import DecodeLoop
    from omni_lightning.serving.metrics import ServeMetrics
    from omni_lightning.serving.stream_lane import lane_arguments

    device, plugin = trainer.strategy.root_device, trainer.strategy.precision_plugin
    if device.type == "cpu":
        choose_threads()  # the cores free to this process (its fronts' load counted), as predict does
    else:
        torch.set_num_threads(1)  # the host only launches: threads would spin against the fronts
    module = plugin.convert_module(module.to(device)).eval()
    params = sum(p.numel() for p in module.model.parameters())
    what = what_runs(module, module.config, params, ckpt_path, device, trainer.precision)
    cuda_graphs = bool(module.fast_path and module.hparams.get("graph_frames", 512))
    share = getattr(trainer.predict_loop, "gpu_memory_utilization", None)

    def decoder() -> Any:
        return module.streaming_decoder(config.max_streams, cuda_graphs, share, step_frames=config.request_frames)

    chunks, rows = warmup_shapes(device.type == "cuda", config.request_frames)
    lane = lane_arguments(config.stream_lane, decoder, config.lane_sms)
    loop = DecodeLoop(decoder(), config.max_queue, config.request_frames, plugin.forward_context, ServeMetrics(),
                      warmup=chunks, bulk_slice_s=config.bulk_slice_ms / 1000, warmup_rows=rows, **lane)  # fmt: skip
    limits = f"{config.max_streams} streams at once, {config.max_queue} requests queued"
    limits += "; streams on a lane of their own" if lane["stream_lane"] else ""
    return loop, {"config": module.config, "what": what, "limits": limits}


def warmup_shapes(graphs: bool, request_frames: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The chunk sizes and stream counts the server runs before its first client: with CUDA graphs, the shapes
    steps take (streams' chunks, whole requests' pieces, at each row bucket), captured then and not in a
    client's way; on a CPU there is nothing to capture (one small step checks the model runs)."""
    if not graphs:
        return (1, 8), (1,)
    return tuple(sorted({1, 8, 10, 16, request_frames})), tuple(2**i for i in range(8))


def serve_here(argv: list[str], values: dict, full_help: bool = False) -> int:
    """``--front_processes 0``: the app and its decode thread in this process (and ``--help``); returns the
    exit status (``stop_line``). The port is bound before the model loads: a port in use is said at once."""
    from omni_lightning.serving.server import bound_socket, stop_line, stop_summary

    help_only = bool({"-h", "--help"} & set(argv))
    sock = None if help_only else bound_socket(str(values.get("host") or "127.0.0.1"), int(values.get("port") or 8000))
    try:
        cli = _parse(argv, full_help)
        server = serve_module(_load(cli, argv), cli.trainer, cli.config, cli.config.ckpt_path, sock)
    finally:
        if sock is not None:
            sock.close()
    status, line = stop_line(stop_summary(server))
    print(line, file=sys.stderr if status else sys.stdout, flush=True)
    return status


def serve_module(module: Any, trainer: Any, config: Any, ckpt_path: str | None, sock: Any = None) -> Any:
    """Serves ``module`` in this process until stopped (``sock``: a bound socket to listen on); returns the
    stopped ``DrainingServer``."""
    from omni_lightning.serving.app import ROUTES, app_over
    from omni_lightning.serving.request_log import to_stderr
    from omni_lightning.serving.server import server_for
    from omni_lightning.serving.supervisor import freeze_startup

    to_stderr()
    loop, info = decode_loop_for(module, trainer, config, ckpt_path)
    app = app_over(loop, loop.metrics, config.max_body_bytes)

    def on_listen(host: str, port: int) -> None:
        print(f"serve: {info['what']}; {info['limits']}; one process; listening on http://{host}:{port} ({ROUTES})",
              flush=True)  # fmt: skip

    server = server_for(app, config.host, config.port, config.drain_timeout, on_listen, log_level="warning")
    if sock is not None:
        sock.listen(2048)
    freeze_startup("one process")
    server.run(sockets=[sock] if sock is not None else None)
    sys.stdout.flush()
    return server
