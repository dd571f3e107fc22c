"""Help a user can read: every subcommand listed before torch loads, whole-sentence group headers, a
description for every option of the project's own classes, and an unknown option named with the closest one."""

import json
import re
import subprocess
import sys

import pytest
from helpers import ROOT

from omni_lightning.cli import main
from omni_lightning.cli.arguments import unknown_option
from omni_lightning.cli.console import SUBCOMMAND_HELP

IN_A_FRESH_PROCESS = """
import contextlib, io, json, sys
from omni_lightning.cli.arguments import unknown_option
from omni_lightning.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        rc = main(json.loads(sys.argv[1]))
    except SystemExit as exit:
        rc = exit.code
print(json.dumps({"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "torch_imported": "torch" in sys.modules}))
"""


def fresh(argv: list[str]) -> dict:
    """``main(argv)`` in a new interpreter: its status, output, and whether torch was imported."""
    proc = subprocess.run(
        [sys.executable, "-c", IN_A_FRESH_PROCESS, json.dumps(argv)],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=300,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_top_level_help_lists_every_subcommand_and_the_options_read_before_torch_loads():
    report = fresh(["--help"])
    assert report["rc"] == 0 and not report["torch_imported"], report
    listed = {line.split()[0] for line in report["out"].splitlines() if line.startswith("  ") and line.split()}
    assert set(SUBCOMMAND_HELP) <= listed  # fit, validate, test, predict and demo
    for said in ("--timings FILE", "--debug", "--version", "Work folder: ./omni_lightning_demo/", "exit status: 0"):
        assert said in report["out"]


def test_demo_help_shows_its_defaults_in_plain_text(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exited.value.code == 0 and "(default: ./omni_lightning_demo)" in out
    for said in ("training requests (>= 1; default: 12)", "steps (>= 1; default: 40)", "threads (>= 1; default: 1)"):
        assert said in out, out
    assert "``" not in out, out  # reST literals are for the docstring, not the terminal


@pytest.mark.parametrize(
    "typo, known",
    [
        ("--model.random_weight", "--model.random_weights"),
        ("--out-dir", "--out_dir"),
        ("--trainer.max_epoch", "--trainer.max_epochs"),
    ],
)
def test_an_unknown_option_is_named_with_the_closest_one_before_any_other_check(tmp_path, typo, known):
    """``--model.random_weight true`` was reported as "predict has no weights", ``--out-dir`` as
    unrecognized arguments once Lightning had loaded, with no closest match."""
    report = fresh(["predict", "--data.predict", str(tmp_path / "missing"), typo, "true"])
    assert report["rc"] == 2 and not report["torch_imported"], report
    assert report["err"] == (
        f"error: {typo} is not an option of omni-lightning predict: did you mean {known}? "
        "(omni-lightning predict --help lists them)\n"
    )


def test_the_demos_unknown_option_is_named_with_the_closest_one(tmp_path, capsys):
    assert main(["demo", "--work_dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "error: --work_dir is not an option of omni-lightning demo: did you mean "
        "--work-dir? (omni-lightning demo --help lists them)\n"
    )
    assert list(tmp_path.iterdir()) == []  # refused before any work


def test_a_config_files_unknown_key_is_named_too(tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text("model:\n  random_weight: true\n")
    assert main(["predict", "--config", str(config), "--data.predict", str(tmp_path)]) == 2
    assert (
        "error: config key model.random_weight is not an option of omni-lightning predict: did you mean "
        "model.random_weights?" in capsys.readouterr().err
    )


def predict_help(capsys, sub: str = "predict", flag: str = "--help-all") -> str:
    with pytest.raises(SystemExit) as exited:
        main([sub, flag])
    assert exited.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("sub", list(SUBCOMMAND_HELP)[:4])
def test_a_subcommands_help_shows_what_it_uses_the_usual_options_first_and_every_option_one_flag_away(capsys, sub):
    """predict --help was 529 lines, listed fit-only options (--model.adversarial) and showed --out_dir
    on line 97."""
    from omni_lightning.cli.help import HELP_OPTIONS

    text = predict_help(capsys, sub, "--help")  # a name HELP_OPTIONS lists that the parser lacks: a KeyError
    lines = text.splitlines()
    shown = re.findall(r"^  (-c CONFIG, )?(--[\w.]+)", text, re.M)
    usual, others = HELP_OPTIONS[sub]
    assert [o for _, o in shown] == [*usual, *others] and len(lines) < 170, text
    assert lines[0].startswith(f"usage: omni-lightning {sub} --data.")
    assert f"omni-lightning {sub} --help-all" in lines[-1], lines[-1]
    if sub == "predict":
        assert "--model.adversarial" not in text and "--trainer.max_steps" not in text
        assert [i for i, line in enumerate(lines) if line.startswith("  --out_dir")][0] < 12
    if sub == "fit":
        assert "--out_dir" not in text and "--model.frames_per_forward" not in text


@pytest.mark.parametrize("sub", list(SUBCOMMAND_HELP)[:4])
def test_every_option_the_parser_takes_is_known_to_the_check_before_torch_loads(capsys, sub):
    """The check reads the classes' source, not the parser: it must never refuse an option the parser takes."""
    options = set(re.findall(r"^  (--[\w.]+)", predict_help(capsys, sub), re.M)) - {"--help"}
    assert len(options) > 90 and [o for o in sorted(options) if unknown_option(sub, o[2:])] == []


def options_without_description(text: str, prefixes: tuple[str, ...]) -> list[str]:
    """The options of ``--help`` output starting with ``prefixes`` that have no description."""
    lines = text.splitlines()
    missing = []
    for i, line in enumerate(lines):
        match = re.match(r"  (--[\w.]+)( [^ ].*?)?(  +\S.*)?$", line)
        if not match or not match.group(1).startswith(prefixes) or match.group(1).endswith(".help"):
            continue
        following = lines[i + 1] if i + 1 < len(lines) else ""
        described = match.group(3) or re.match(r" {20,}\S", following) and not following.strip().startswith("--")
        if not described:
            missing.append(match.group(1))
    return missing


def test_predict_help_has_whole_sentence_headers_and_the_options_read_before_parsing(capsys):
    text = predict_help(capsys)
    for option in ("--timings", "--debug", "--out_dir", "--format", "--subtype"):
        assert re.search(rf"^  {option} ", text, re.M), option
    assert "--optimizer" not in text and "--lr_scheduler" not in text  # the module configures its own
    headers = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert len(headers) >= 5, headers  # options, trainer, model, data, predict's own
    for header in headers:
        assert header.count("(") == header.count(")") and "``" not in header and ":class:" not in header, header
        assert not re.search(r"\b(to|one|of|the|a|and)[.:]?:$", header), header  # not cut mid-sentence
    assert options_without_description(text, ("--out_dir", "--format", "--timings", "--trainer.gpu_memory")) == []


def test_every_option_of_the_projects_own_classes_has_a_description(capsys):
    """jsonargparse reads each option's description from the ``Args:`` section of the class docstring."""
    mine = ("--model.", "--data.", "--trainer.gpu_memory_utilization", "--trainer.async_d2h")
    missing = options_without_description(predict_help(capsys), mine)
    assert missing == [], f"{len(missing)} options without a description: {', '.join(missing)}"
