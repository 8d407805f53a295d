"""What a finished run and a copy leave on disk: only what docs/format.md lists
(no lock files, no retention log records), and `cp CKPT DIR` lands as `cp -r`."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from checkpoint_store import Checkpoint, StorageContext, session
from tests.cli.cli_helpers import invoke, write_tree

REPO = Path(__file__).resolve().parents[2]


def _seven_checkpoints(root: Path) -> Path:
    with session.start(storage_path=str(root), experiment_name="e", trial_name="t"):
        for step in range(7):
            src = write_tree(str(root.parent / f"src{step}"), {"model.bin": b"w%d" % step})
            session.report({"step": step}, checkpoint=Checkpoint.from_directory(src))
    return root / "e" / "t"


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_a_finished_trial_holds_no_log_records_and_no_lock_files(tmp_path) -> None:
    trial = _seven_checkpoints(tmp_path / "store")
    names = sorted(os.listdir(trial))
    assert not [n for n in names if n.startswith(".cs_state-log-")], names
    assert not [n for n in names if n.endswith(".lock")], names
    assert names == [".checkpoint_manager.json", *[f"checkpoint_{i:06d}" for i in range(7)],
                     "result.json"]
    # The state folded into the snapshot is whole: a resume numbers on.
    with session.start(storage_path=str(tmp_path / "store"), experiment_name="e",
                       trial_name="t"):
        assert session.get_checkpoint().path.endswith("checkpoint_000006")
        src = write_tree(str(tmp_path / "src7"), {"model.bin": b"w7"})
        session.report({"step": 7}, checkpoint=Checkpoint.from_directory(src))
    indices = [m["index"] for _, m in StorageContext(str(tmp_path / "store"), "e",
                                                        "t").committed_checkpoints()]
    assert indices == list(range(8))
    assert not [n for n in os.listdir(trial) if n.startswith(".cs_state-log-")]


def test_cp_of_a_checkpoint_into_a_directory_is_cp_r(tmp_path) -> None:
    trial = _seven_checkpoints(tmp_path / "store")
    ckpt = trial / "checkpoint_000006"
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    res = invoke(["cp", str(ckpt), str(ours)])
    assert res.exit_code == 0, res.output
    subprocess.run(["cp", "-r", str(ckpt), str(theirs)], check=True)
    assert _tree(ours) == _tree(theirs) == {
        "checkpoint_000006", "checkpoint_000006/model.bin",
        "checkpoint_000006/.internal_metadata.json"}
    assert (ours / "checkpoint_000006" / "model.bin").read_bytes() == b"w6"
    # A second copy is skipped, and still leaves nothing beside it.
    res = invoke(["cp", str(ckpt), str(ours)])
    assert res.exit_code == 0 and "already there" in res.output
    assert _tree(ours) == _tree(theirs)


def test_user_metadata_is_written_only_when_set_as_the_readme_says(tmp_path) -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert re.search(r"`\.user_metadata\.json` only once you set metadata", readme)
    trial = _seven_checkpoints(tmp_path / "store")
    assert sorted(os.listdir(trial / "checkpoint_000000")) == [".internal_metadata.json",
                                                               "model.bin"]
    ckpt = Checkpoint(str(trial / "checkpoint_000000"))
    ckpt.set_metadata({"note": "best so far"})
    assert sorted(os.listdir(trial / "checkpoint_000000")) == [
        ".internal_metadata.json", ".user_metadata.json", "model.bin"]
    ckpt.verify()  # user metadata is not in the manifest: still a valid checkpoint
