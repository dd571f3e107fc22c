"""The demo command: it reruns only in a folder it made, and refuses counts below one."""

import logging
import os
from pathlib import Path

import pytest


def test_demo_reruns_only_in_its_own_folder(tmp_path):
    from omni_lightning.cli.demo import prepare_work_dir

    work = tmp_path / "demo"
    assert prepare_work_dir(work) is False and (work / ".omni_lightning_demo").is_file()
    (work / "wavs_after").mkdir()
    (work / "wavs_after" / "old.wav").write_bytes(b"")
    assert prepare_work_dir(work) is True and not (work / "wavs_after").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep me")
    with pytest.raises(ValueError, match="not made by the demo"):
        prepare_work_dir(mine)
    assert (mine / "thesis.tex").read_text() == "keep me"


@pytest.mark.parametrize(("flag", "value"), [("--threads", "0"), ("--requests", "0"), ("--steps", "-1")])
def test_demo_refuses_counts_below_one_before_any_work(tmp_path, flag, value):
    from omni_lightning.cli.demo import main as demo_main

    with pytest.raises(SystemExit) as stop:  # argparse: exit 2 with the flag and value named
        demo_main(["--work-dir", str(tmp_path / "demo"), flag, value])
    assert stop.value.code == 2 and not (tmp_path / "demo").exists()


def test_every_path_the_demo_prints_exists(tmp_path, monkeypatch, capsys, recwarn):
    """The data folder was printed as given (relative to where the demo ran), the W&B hint named no run to
    sync, and fewer requests than two batches' worth brought Lightning's warning about the logging interval."""
    from omni_lightning.cli.demo import main as demo_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    demo_main(["--work-dir", "demo", "--requests", "2", "--steps", "1"])
    assert lightning_log.level == level and "WANDB_SILENT" not in os.environ  # quiet while it ran only
    out = capsys.readouterr().out
    printed = [word.rstrip(";,)`") for word in out.split() if word.lstrip("`").startswith("/")]
    assert len(printed) >= 5 and all(Path(p.lstrip("`")).exists() for p in printed), out
    assert f"Code2Wav): {tmp_path / 'demo' / 'data'}\n" in out, out
    if "W&B" in out:  # wandb installed: the hint names the offline run's folder
        run = Path(out.split("`wandb sync ")[1].split("`")[0])
        assert run.name.startswith("offline-run-") and any(run.glob("*.wandb")), out
    assert not [w for w in recwarn if "logging interval" in str(w.message)]
