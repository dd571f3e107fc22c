"""The demo command: it reruns only in a folder it made, and refuses counts below one."""

import pytest


def test_demo_reruns_only_in_its_own_folder(tmp_path):
    from omni_lightning.demo import prepare_work_dir

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
    from omni_lightning.demo import main as demo_main

    with pytest.raises(SystemExit) as stop:  # argparse: exit 2 with the flag and value named
        demo_main(["--work-dir", str(tmp_path / "demo"), flag, value])
    assert stop.value.code == 2 and not (tmp_path / "demo").exists()
