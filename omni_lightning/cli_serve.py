"""``omni-lightning serve``: predict's model options (``--model.*``, ``--ckpt_path``, ``--trainer.accelerator``,
``--trainer.precision``, ``--trainer.gpu_memory_utilization``, ``--config``), checked before torch loads as
predict's are (``preflight``), then built by the same LightningCLI (``OmniCLI``, not run: there is no
Trainer method to call) and served by ``omni_lightning.serving`` on ``--host``/``--port``.

``--ckpt_path`` loads a fit's Lightning checkpoint as predict does: its architecture and weights, with the
run settings given beside it (``RUN_SETTINGS``). A true precision (``bf16-true``) casts the weights; a
mixed one (``bf16-mixed``) runs the decode thread under the precision plugin's autocast.
Not done: ``--devices`` above 1 (one engine per GPU behind one port, streams pinned to their worker):
refused with a usage error until it is built and tested.
"""

from __future__ import annotations

import sys
from typing import Any

from omni_lightning.arguments import read_arguments
from omni_lightning.errors import UsageError
from omni_lightning.lightning_cli import RUN_SETTINGS, OmniCLI, OneLineErrorParser
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
    ("devices", int, 1, "engines (GPUs) behind the port; only 1 is done"),
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


def main(argv: list[str], full_help: bool = False) -> int:
    """Builds and serves until SIGTERM or Ctrl-C (drained first); returns 0. ``argv`` (after ``serve``) was
    checked before torch loaded (``preflight.check_command_line``, from ``cli.main``)."""
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]  # LightningCLI reads sys.argv (given args too, it warns)
    try:
        cli = _parse(full_help)
    finally:
        sys.argv = saved
    config = cli.config
    if config.devices != 1:
        raise UsageError(f"--devices {config.devices}: one engine per device is not done yet; use --devices 1")
    serve_module(_load(cli, argv), cli.trainer, config, config.ckpt_path)
    return 0


def _parse(full_help: bool = False) -> ServeCLI:
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


def serve_module(module: Any, trainer: Any, config: Any, ckpt_path: str | None) -> None:
    """Puts ``module`` on the trainer's device and precision and serves it until stopped."""
    from omni_lightning.callbacks.progress import what_runs
    from omni_lightning.serving import build_app, server_for

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
        print(f"serve: {what}; {limits}; listening on http://{host}:{port} (POST /v1/code2wav, "
              f"WebSocket /v1/code2wav/stream, GET /health, GET /metrics)", flush=True)  # fmt: skip

    server_for(app, config.host, config.port, config.drain_timeout, on_listen, log_level="warning").run()
    sys.stdout.flush()
