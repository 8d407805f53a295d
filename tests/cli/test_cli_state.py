"""`best` of a trial reads the retention state, not every checkpoint (issue 19)."""

from __future__ import annotations

import json
import os
import posixpath

import pytest
from cli_helpers import invoke

from checkpoint_store import Checkpoint, CheckpointConfig, session
from checkpoint_store._format.layout import MANAGER_STATE
from checkpoint_store._util import fs as _fsutil


def _trial(tmp_path, losses: list[float], config: CheckpointConfig) -> str:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "w.bin").write_bytes(b"w" * 64)
    root = str(tmp_path / "runs")
    with session.start(storage_path=root, experiment_name="exp", trial_name="t",
                       checkpoint_config=config):
        for loss in losses:
            session.report({"loss": loss}, checkpoint=Checkpoint(str(src)))
    return os.path.join(root, "exp", "t")


def _metadata_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    real = _fsutil.read_bytes

    def spy(fs, path, **kw):
        if path.endswith(".internal_metadata.json"):
            reads.append(path)
        return real(fs, path, **kw)

    monkeypatch.setattr(_fsutil, "read_bytes", spy)
    return reads


@pytest.mark.parametrize("config", [CheckpointConfig(),
                                    CheckpointConfig(3, "loss", "min")])
def test_best_reads_the_state_and_agrees_with_the_full_walk(tmp_path, monkeypatch, config):
    losses = [0.9, 0.4, 0.7, 0.2, 0.8, 0.5, 0.3, 0.6] * 3
    trial = _trial(tmp_path, losses, config)
    reads = _metadata_reads(monkeypatch)
    res = invoke(["best", trial, "--metric", "loss", "--mode", "min", "--json"])
    assert res.exit_code == 0, res.output
    from_state = json.loads(res.stdout)
    assert from_state["score"] == 0.2 and from_state["metrics"]["loss"] == 0.2
    # The newest kept one, checked at restore, and the answer's marker.
    assert len(reads) <= 2, reads
    # Without the state, every checkpoint is read: same answer.
    os.remove(os.path.join(trial, MANAGER_STATE))
    reads.clear()
    res = invoke(["best", trial, "--metric", "loss", "--mode", "min", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["uri"] == from_state["uri"]
    assert len(reads) >= len([n for n in os.listdir(trial) if n.startswith("checkpoint_")])


def test_best_sees_a_checkpoint_committed_after_the_last_record(tmp_path):
    trial = _trial(tmp_path, [0.5, 0.4], CheckpointConfig())
    from checkpoint_store import StorageContext

    ctx = StorageContext(str(tmp_path / "runs"), "exp", "t")
    run_id = json.loads(_fsutil.read_bytes(ctx.filesystem, posixpath.join(
        trial, MANAGER_STATE)))["run_id"]
    ctx.persist_checkpoint(Checkpoint(str(tmp_path / "src")), 2,
                           {"metrics": {"loss": 0.1}, "run_id": run_id})
    res = invoke(["best", trial, "--metric", "loss", "--mode", "min"])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith("checkpoint_000002")


def test_best_skips_a_checkpoint_whose_marker_was_deleted_by_hand(tmp_path):
    """The state records what was committed; a commit marker removed since
    makes the directory uncommitted, and `best` must not name it (`download`
    would refuse it)."""
    trial = _trial(tmp_path, [0.5, 0.1, 0.3, 0.4], CheckpointConfig())
    os.remove(os.path.join(trial, "checkpoint_000001", ".internal_metadata.json"))
    res = invoke(["best", trial, "--metric", "loss", "--mode", "min", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["uri"].endswith("checkpoint_000002") and out["score"] == 0.3
    assert "checkpoint_000001" in res.stderr and "commit marker" in res.stderr
    os.remove(os.path.join(trial, "checkpoint_000002", ".internal_metadata.json"))
    os.remove(os.path.join(trial, "checkpoint_000003", ".internal_metadata.json"))
    os.remove(os.path.join(trial, "checkpoint_000000", ".internal_metadata.json"))
    res = invoke(["best", trial, "--metric", "loss", "--mode", "min"])
    assert res.exit_code != 0
    assert "no committed checkpoint" in res.output
