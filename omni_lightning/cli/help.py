"""``omni-lightning <subcommand> --help``: the options that subcommand uses, its usual ones first, each with
the first sentence of its description and its default; ``--help-all`` prints the parser's own help, every
option (other subcommands' and Lightning's too). Standard library only: the parser is handed in."""

from __future__ import annotations

import argparse

from omni_lightning.cli.console import SUBCOMMAND_HELP, heading

# `omni-lightning <subcommand> --help`: what that subcommand uses, its usual options first; `--help-all`: every
# option the parser takes (fit's, Lightning's own). Each name is an option string of the parser (tests check).
SUBCOMMAND_USAGE = {
    "predict": "omni-lightning predict --data.predict SOURCE --out_dir FOLDER "
    "(--model.checkpoint FOLDER | --ckpt_path FILE | --model.random_weights true) [options]",
    "fit": "omni-lightning fit --data.train MANIFEST [--data.val MANIFEST] [--config configs/finetune.yaml] [options]",
    "validate": "omni-lightning validate --data.val MANIFEST (--model.checkpoint FOLDER | --ckpt_path FILE) [options]",
    "test": "omni-lightning test --data.test MANIFEST (--model.checkpoint FOLDER | --ckpt_path FILE) [options]",
    "serve": "omni-lightning serve (--model.checkpoint FOLDER | --ckpt_path FILE | --model.random_weights true) "
    "[--host HOST] [--port PORT] [options]",
}
_WEIGHTS = ("--model.checkpoint", "--ckpt_path", "--model.config", "--model.random_weights")
_DEVICE = ("--trainer.accelerator", "--trainer.precision", "--trainer.devices", "--config")
_RUN = ("--trainer.strategy", "--trainer.num_nodes", "--trainer.callbacks", "--trainer.default_root_dir",
        "--seed_everything", "--print_config", "--debug")  # fmt: skip
_EVALUATE_DATA = ("--data.batch_size", "--data.num_workers", "--data.on_bad_input", "--data.max_frames",
                  "--data.duplicate_ids", "--data.config")  # fmt: skip
_QUALITY = ("--model.quality_metrics", "--model.quality_workers")
_EVALUATE = (*_EVALUATE_DATA, *_QUALITY, "--model.log_samples", "--model.mel_weight", "--model.stft_weight",
             "--model.fast_training", "--trainer.logger", "--trainer.enable_progress_bar", "--verbose",
             *_RUN)  # fmt: skip
# descriptions in a subcommand's --help where the parser's (Lightning's docstrings) would mislead or run long;
# keyed by option, or by (subcommand, option)
HELP_TEXT = {
    ("predict", "--ckpt_path"): "a Lightning checkpoint from fit (.ckpt): its architecture and weights",
    ("fit", "--ckpt_path"): "a Lightning checkpoint to resume from (an earlier fit's interrupted.ckpt or last.ckpt)",
    ("validate", "--ckpt_path"): "a Lightning checkpoint from fit (.ckpt) to evaluate",
    ("test", "--ckpt_path"): "a Lightning checkpoint from fit (.ckpt) to evaluate",
    ("serve", "--ckpt_path"): "a Lightning checkpoint from fit (.ckpt): its architecture and weights",
    ("serve", "--trainer.gpu_memory_utilization"): "the share of the GPU the decoder's memory budget comes from",
    "--trainer.accelerator": "cpu, gpu, or auto: a GPU when there is one",
    "--trainer.max_steps": "stop after this many training steps (-1: no limit)",
    "--trainer.precision": "32-true, bf16-mixed, bf16-true, or 16-mixed (a GPU's)",
    "--trainer.devices": "how many devices (2), which ([0, 1]), or auto",
    "--trainer.strategy": "auto, or ddp for several devices or nodes",
    "--trainer.num_nodes": "machines the job runs on",
    "--trainer.logger": "false, or a logger class (lightning.pytorch.loggers.CSVLogger, ...)",
    "--trainer.callbacks": "callbacks to add, by class path (--trainer.callbacks+=... appends one)",
    "--config": "a YAML file of options (configs/ has one for each job); later options override it",
    "--seed_everything": "the seed set before anything is built (true: a random one)",
    "--model.quality_metrics": "perceptual scores beside the spectral ones: [pesq,stoi,estoi] (the quality extra)",
    "--model.quality_workers": "processes that score them (default: half the CPUs)",
}
# fmt: off
HELP_OPTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "predict": (
        ("--data.predict", "--out_dir", *_WEIGHTS, "--format", "--subtype", *_DEVICE),
        ("--data.batch_size", "--data.num_workers", "--data.max_frames", "--data.on_bad_input", "--data.duplicate_ids",
         "--data.config", "--model.frames_per_forward", "--model.fast_path", "--model.graph_frames",
         "--trainer.gpu_memory_utilization", "--trainer.async_d2h", "--trainer.enable_progress_bar",
         "--trainer.limit_predict_batches", "--timings", *_RUN),
    ),
    "fit": (
        ("--data.train", "--data.val", "--model.checkpoint", "--ckpt_path", "--model.config", "--trainer.max_steps",
         "--model.learning_rate", "--data.batch_size", "--data.crop_frames", *_DEVICE),
        ("--model.warmup_steps", "--model.min_lr_ratio", "--model.total_steps", "--model.betas", "--model.weight_decay",
         "--model.grad_clip", "--model.mel_weight", "--model.stft_weight", "--model.freeze", "--model.train_only",
         "--model.ema_decay", "--model.adversarial", "--model.adversarial_weight", "--model.feature_matching_weight",
         "--model.discriminator_lr", "--model.fast_training", "--model.log_samples", *_QUALITY, "--data.num_workers",
         "--data.on_bad_input", "--data.seed", "--data.max_frames", "--data.duplicate_ids", "--data.config",
         "--trainer.max_epochs", "--trainer.max_time", "--trainer.val_check_interval",
         "--trainer.check_val_every_n_epoch", "--trainer.limit_train_batches", "--trainer.limit_val_batches",
         "--trainer.num_sanity_val_steps", "--trainer.log_every_n_steps", "--trainer.accumulate_grad_batches",
         "--trainer.gradient_clip_val", "--trainer.logger", "--trainer.enable_checkpointing",
         "--trainer.enable_progress_bar", "--trainer.enable_model_summary", "--trainer.deterministic", *_RUN),
    ),
    "validate": (("--data.val", *_WEIGHTS, *_DEVICE), ("--trainer.limit_val_batches", *_EVALUATE)),
    "test": (("--data.test", *_WEIGHTS, *_DEVICE), ("--trainer.limit_test_batches", *_EVALUATE)),
    "serve": (
        ("--host", "--port", "--max_streams", *_WEIGHTS, "--trainer.accelerator", "--trainer.precision", "--config"),
        ("--max_queue", "--max_body_bytes", "--request_frames", "--bulk_slice_ms", "--stream_lane", "--lane_sms",
         "--drain_timeout",
         "--devices", "--front_processes",
         "--trainer.gpu_memory_utilization", "--model.fast_path", "--model.graph_frames", "--seed_everything",
         "--debug"),
    ),
}
# fmt: on


class ShortHelpFormatter(argparse.HelpFormatter):
    """An option per entry: its name, a short metavar, the first sentence of its description (or
    ``console.HELP_TEXT``'s for the subcommand ``sub``), its default."""

    sub = ""

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return action.dest.rsplit(".", 1)[-1].upper()

    def _get_help_string(self, action: argparse.Action) -> str:
        given = [HELP_TEXT.get((self.sub, o)) or HELP_TEXT.get(o) for o in action.option_strings]
        text = next((t for t in given if t), None) or heading(action.help) or ""
        default = action.default
        shown = isinstance(default, (str, int, float)) and default not in ("", argparse.SUPPRESS)
        return (text + (f" (default: {default})" if shown and "default" not in text else "")).replace("%", "%%")


def short_help(parser: argparse.ArgumentParser, sub: str) -> str:
    """``omni-lightning <sub> --help``: usage, then the options of ``console.HELP_OPTIONS`` (the usual ones
    first), then how to list every option. A name there that the parser lacks is a KeyError (tests run it)."""
    actions = {option: action for action in parser._actions for option in action.option_strings}
    common, others = HELP_OPTIONS[sub]
    parts = [f"usage: {SUBCOMMAND_USAGE[sub]}\n\n{SUBCOMMAND_HELP[sub]}\n"]
    for title, names in (("usual options", common), (f"other options {sub} uses", others)):
        formatter = ShortHelpFormatter("omni-lightning", max_help_position=34)
        formatter.sub = sub
        formatter.start_section(title)
        formatter.add_arguments([actions[name] for name in names])
        formatter.end_section()
        parts.append(formatter.format_help())
    every = len({id(action) for action in actions.values()})
    parts.append(
        f"omni-lightning {sub} --help-all lists all {every} options: those of the other subcommands and "
        "Lightning's own too.\n"
    )
    return "\n".join(parts)
