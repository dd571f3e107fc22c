"""The LightningCLI behind ``omni-lightning`` (``omni_lightning.cli`` is the entry point, which checks
the command line before this module, torch and Lightning are imported).

What it adds to LightningCLI: ``--out_dir`` / ``--format`` / ``--subtype`` for predict (a
``WaveformWriter``; the data module is told the same folder, ``--data.skip_done``, so finished requests
are never read), the weights guard on the parsed config, defaults that need no config file (predict logs
nowhere; seed 0, set once; DDP's ``use_distributed_sampler`` off: the data module splits requests across
ranks itself), help with whole-sentence group headers and ``--timings`` / ``--debug`` listed,
configuration mistakes the classes raise while being built reported as usage errors, an end-of-run
summary, and phase timings when asked. What it leaves out: LightningCLI's ``--optimizer`` and
``--lr_scheduler`` (the module configures its own optimizers; those would replace them).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from omni_lightning.callbacks.timings import PhaseProfiler
from omni_lightning.callbacks.writer import WaveformWriter
from omni_lightning.cli.console import METHOD_GROUP, SUBCOMMAND_HELP, failed_lines, heading, log_places, one_line
from omni_lightning.cli.fit import check_resume_last, drop_callbacks_turned_off, fit_moved, stopped_fit_note, watch_fit
from omni_lightning.cli.help import HELP_OPTIONS, short_help
from omni_lightning.cli.lines import quiet_cli_run, say_start, set_cpu_threads
from omni_lightning.cli.preflight import check_weights, set_by_user
from omni_lightning.data.datamodule import CodesDataModule
from omni_lightning.data.output_folder import FORMATS, Finished
from omni_lightning.errors import UsageError
from omni_lightning.evaluation.metrics import metrics_line
from omni_lightning.module import Code2WavModule
from omni_lightning.trainer import Trainer, quiet_checkpoint_callbacks_warning, quiet_cli_trainer

SUBTYPES = tuple(dict.fromkeys(s for subtypes in FORMATS.values() for s in subtypes))


class SaveConfigWithLogger(SaveConfigCallback):
    """Saves the run's config.yaml into the logger's folder; with no logger (predict), nowhere."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.logger is not None:
            super().setup(trainer, pl_module, stage)


class OneLineErrorParser(LightningArgumentParser):
    """Its errors are the parser's tip (``--help``) and one ``error:`` line, not the ~100 lines of
    usage argparse prints above them (the usage of every trainer, model and data option). A subcommand's
    parser given ``short_help`` (its name) shows in ``--help`` only what that subcommand uses."""

    short_help: str | None = None

    def print_usage(self, file: Any = None) -> None:  # argparse calls it only from error()
        pass

    def error(self, message: str, ex: Exception | None = None) -> Any:
        super().error(one_line(message), ex)

    def format_help(self, *args: Any) -> str:
        return short_help(self, self.short_help) if self.short_help else super().format_help(*args)


# model arguments that set how a run computes, not what a checkpoint holds (see OmniCLI._parse_ckpt_path)
RUN_SETTINGS = ("frames_per_forward", "fast_path", "graph_frames", "fast_training", "log_samples")


class OmniCLI(LightningCLI):
    """LightningCLI plus what the module docstring lists. ``timings``: a dict to fill with the run's
    phase times (wall clock), or None. ``finished``: ``--out_dir``'s finished requests as the
    command-line checks read them, handed to the data module instead of a second reading."""

    writer: WaveformWriter | None = None

    def __init__(
        self,
        *args: Any,
        timings: dict[str, Any] | None = None,
        finished: Finished | None = None,
        full_help: bool = False,
        **kwargs: Any,
    ) -> None:
        self.timings = timings
        self.finished = finished
        self.full_help = full_help  # --help lists every option (--help-all), not only the subcommand's
        self.profiler: PhaseProfiler | None = None
        given = kwargs.get("args")
        self._argv = list(given) if isinstance(given, (list, tuple)) else sys.argv[1:]  # what the user typed
        super().__init__(*args, **kwargs)

    def _mark(self, name: str) -> None:
        if self.timings is not None:
            self.timings[name] = time.time()

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--out_dir",
            type=str | None,
            default=None,
            help="predict: the folder the audio files and manifest.jsonl go to (created if missing)",
        )
        parser.add_argument("--format", type=Literal[tuple(FORMATS)], default="wav", help="predict: wav or flac")
        subtype = "predict: sample format (FLAC: PCM_16 or PCM_24)"
        parser.add_argument("--subtype", type=Literal[SUBTYPES], default="PCM_16", help=subtype)
        # read by omni_lightning.cli before this parser runs: listed here so that --help shows them
        parser.add_argument(
            "--timings",
            type=str | None,
            default=None,
            help="write the job's phase times (process start to end) to this JSON file",
        )
        parser.add_argument("--debug", type=bool, default=False, help="print the traceback of usage errors too")
        # CodesDataModule splits requests across DDP ranks itself (by length; a rank may get none)
        parser.set_defaults({"trainer.use_distributed_sampler": False})

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        """Each subcommand's parser, with whole-sentence group headers; predict logs nowhere by default
        (it writes audio files: a logger would only add a lightning_logs/ folder per run)."""
        kwargs["description"] = SUBCOMMAND_HELP.get(subcommand, kwargs.get("description"))
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        for name, cls in (("trainer", Trainer), ("model", self._model_class), ("data", self._datamodule_class)):
            if name in parser.groups and heading(getattr(cls, "__doc__", None)):
                parser.groups[name].title = heading(cls.__doc__)
        if subcommand in parser.groups and subcommand in METHOD_GROUP:
            parser.groups[subcommand].title = METHOD_GROUP[subcommand]
        if subcommand == "predict":
            parser.set_defaults({"trainer.logger": False})
        parser.set_defaults({"trainer.enable_model_summary": False})  # the start-up line counts the parameters
        if isinstance(parser, OneLineErrorParser) and not self.full_help and subcommand in HELP_OPTIONS:
            parser.short_help = subcommand
        return parser

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        for choice in parser._subcommands_action._choices_actions:  # the list under `omni-lightning --help`
            choice.help = SUBCOMMAND_HELP.get(choice.dest, choice.help)

    def before_instantiate_classes(self) -> None:
        self._mark("parsed")
        if self.subcommand is None:
            return  # run=False (benchmarks): the caller decides what runs
        config = self.config[self.subcommand]
        drop_callbacks_turned_off(config.get("trainer"))
        model = config.get("model")
        if model is None or "random_weights" not in model:
            return  # another model class: its own rules
        check_weights(self.subcommand, model.checkpoint, config.get("ckpt_path"), model.random_weights)
        if self.subcommand == "predict" and config.get("out_dir") and config.data.get("skip_done") is None:
            config.data.skip_done = config.out_dir  # one reading of the folder decides what is finished

    def instantiate_classes(self) -> None:
        """Builds model, data and trainer. What a class raises while being built (``ValueError``, and
        Lightning's ``TypeError`` or missing package for an accelerator) is about its arguments: a usage
        error (as is Lightning's ``MisconfigurationException``, anywhere). Later errors keep their kind."""
        try:
            with quiet_cli_trainer(self.subcommand):
                super().instantiate_classes()
        except UsageError:
            raise
        except (ValueError, TypeError, ModuleNotFoundError) as err:
            raise UsageError(f"the configuration could not be built: {err}") from err

        self._mark("built")
        data, finished = getattr(self, "datamodule", None), self.finished
        set_cpu_threads(self.trainer, data)
        same = isinstance(data, CodesDataModule) and isinstance(data.skip_done, (str, Path)) and finished is not None
        if same and Path(data.skip_done).resolve() == finished.out_dir.resolve():
            data.skip_done = finished  # the folder as the checks read it a moment ago: not read again

    def _parse_ckpt_path(self) -> None:
        """Stock LightningCLI lays a ``--ckpt_path`` checkpoint's hyperparameters over the parsed model
        arguments, so a run setting given on the command line or in a config file was silently replaced
        by the fit's (``--model.frames_per_forward 256``, ``--model.log_samples 1``). The settings of
        :data:`RUN_SETTINGS`, which shape how this run computes and not what the checkpoint holds, are
        put back where a config file or an option set them (a default value or null too). The rest
        stays the checkpoint's, as in stock: the architecture, the GAN and EMA the state dict holds."""
        sub = self.config.get("subcommand")
        given = self.config[sub].get("model") if sub else None
        super()._parse_ckpt_path()
        if given is None or not hasattr(given, "get"):
            return
        model = self.config[sub].model
        for key in set_by_user(self._argv, [f"model.{k}" for k in RUN_SETTINGS]):
            model[key.split(".", 1)[1]] = given.get(key.split(".", 1)[1])

    def _run_subcommand(self, subcommand: str) -> None:
        """Runs it; a fit stopped by an exception (Ctrl-C, SIGTERM, an error) carries, as the exception's
        ``fit_stopped``, what ``cli.main`` adds to its last line: where it saved and how to resume."""
        try:
            super()._run_subcommand(subcommand)
        except BaseException as stop:
            if subcommand == "fit":
                stop.fit_stopped = stopped_fit_note(self.trainer)  # type: ignore[attr-defined]
            raise

    def before_fit(self) -> None:
        """Saves on a stop (:func:`save_on_stop`); refuses a ``--ckpt_path last`` that would find nothing
        (:func:`check_resume_last`); and drops Lightning's warning that a resumed fit checkpoints into
        another folder (``configs/finetune.yaml`` makes a new ``version_N`` per run, by design)."""
        warnings.filterwarnings("ignore", message="The dirpath has changed from .* won't be reloaded")
        watch_fit(self.trainer)
        if self.config[self.subcommand].get("ckpt_path") == "last":
            check_resume_last(self.trainer)
        say_start(self)

    def before_validate(self) -> None:
        """Lightning's metrics table (``--verbose``) becomes one line, printed after the run."""
        quiet_checkpoint_callbacks_warning()
        args = self.config_init[self.subcommand]
        self._verbose, args["verbose"] = args["verbose"], False
        say_start(self)

    def before_predict(self) -> None:
        quiet_checkpoint_callbacks_warning()
        config = self.config[self.subcommand]
        self.writer = None
        if config.get("out_dir"):
            self.writer = WaveformWriter(config["out_dir"], subtype=config["subtype"], audio_format=config["format"])
            self.trainer.callbacks.append(self.writer)
            self.config_init[self.subcommand]["return_predictions"] = False  # the files are the output
        elif not any(isinstance(cb, BasePredictionWriter) for cb in self.trainer.callbacks):
            raise UsageError("predict has no --out_dir: give the folder the audio files and manifest.jsonl go to")
        if self.timings is not None:
            self.profiler = self.trainer.profiler = PhaseProfiler()

    def after_predict(self) -> None:
        if self.timings is not None and self.profiler is not None:
            self.timings.update(self.profiler.phases())
            if self.writer is not None:
                self.timings.update(writer=self.writer.timing, stats=self.writer.stats)
        if self.writer is not None and self.trainer.is_global_zero:
            print(
                "\n".join([f"predict: {self.writer.summary()}", *failed_lines(self.writer.failed, self.writer.out_dir)])
            )

    def after_fit(self) -> None:
        """One line: the checkpoints written (or that none was), and a W&B run's folder (wandb's own lines
        are silenced)."""
        ckpt, parts = self.trainer.checkpoint_callback, []
        if ckpt is not None and (ckpt.best_model_path or ckpt.last_model_path):
            score = f" ({ckpt.monitor} {float(ckpt.best_model_score):.4g})" if ckpt.best_model_score is not None else ""
            saved = {"best": ckpt.best_model_path and ckpt.best_model_path + score, "last": ckpt.last_model_path}
            parts = [f"{which} checkpoint {path}" for which, path in saved.items() if path]
        elif self.trainer.global_step == 0:  # max_steps 0, or no training batch: nothing to checkpoint
            parts = ["no optimizer step was taken, no checkpoint written"]
        else:
            parts = [f"{self.trainer.global_step} steps, no checkpoint written"]
        runs = log_places(self.trainer, wandb_only=True)
        parts += [f"W&B run in {', '.join(runs)}"] if runs else []
        if self.trainer.is_global_zero:
            print("fit: " + "; ".join(fit_moved(self.trainer) + parts))

    def after_validate(self) -> None:
        if self.trainer.is_global_zero and self._verbose:
            metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
            logs = log_places(self.trainer)
            where = f"; logs in {', '.join(logs)}" if logs else ""
            print(f"{self.subcommand}: {metrics_line(metrics)}{where}")

    before_test, after_test = before_validate, after_validate


def run_lightning_cli(
    argv: list[str] | None = None,
    description: str | None = None,
    timings: dict[str, Any] | None = None,
    finished: Finished | None = None,
    full_help: bool = False,
) -> OmniCLI:
    """Parses ``argv`` (None: ``sys.argv``), builds model, data and trainer, runs the subcommand;
    ``timings``, ``finished`` and ``full_help``: see :class:`OmniCLI`."""
    if timings is not None:
        timings["imported"] = time.time()  # torch and Lightning are loaded once this module is
    with quiet_cli_run():
        return OmniCLI(
            Code2WavModule,
            CodesDataModule,
            trainer_class=Trainer,
            args=argv,
            save_config_callback=SaveConfigWithLogger,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,  # seeded once, quietly (True logs "No seed found" and then the seed)
            auto_configure_optimizers=False,  # the module configures its own (an --optimizer would replace them)
            parser_class=OneLineErrorParser,
            parser_kwargs={
                "prog": "omni-lightning",
                "description": description,
                "formatter_class": argparse.RawDescriptionHelpFormatter,
            },
            timings=timings,
            finished=finished,
            full_help=full_help,
        )
