"""Retention as the session applies it."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from _retention_helpers import committed_names

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session
from checkpoint_store.session import Session


def test_get_checkpoint_never_returns_an_evicted_checkpoint(tmp_path, source_dir):
    cfg = CheckpointConfig(1, "score", "max", keep_latest=False)
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
                       checkpoint_config=cfg):
        session.report({"score": 1.0}, checkpoint=Checkpoint.from_directory(source_dir))
        session.report({"score": 0.5}, checkpoint=Checkpoint.from_directory(source_dir))
        got = session.get_checkpoint()
        assert got is not None and got.is_committed
        assert got.path.endswith("checkpoint_000000")


def test_run_id_links_state_and_checkpoints_across_sessions(tmp_path, source_dir):
    cfg = CheckpointConfig(2, "acc", "max")
    kw = dict(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
              checkpoint_config=cfg)
    with session.start(**kw) as s:
        for acc in (0.2, 0.9):
            session.report({"acc": acc}, checkpoint=Checkpoint.from_directory(source_dir))
        run_id = s.manager.run_id
    with session.start(**kw) as s:
        assert s.manager.run_id == run_id
        for acc in (0.3, 0.4):
            session.report({"acc": acc}, checkpoint=Checkpoint.from_directory(source_dir))
        assert [m["acc"] for _, m in s.manager.best_checkpoints] == [0.9, 0.4]
    storage = StorageContext(str(tmp_path), "e", "t")
    committed = storage.committed_checkpoints()
    assert [c.path.rsplit("/", 1)[-1] for c, _ in committed] == [
        "checkpoint_000001", "checkpoint_000003"]
    assert {meta["run_id"] for _, meta in committed} == {run_id}


# The retention cases, reported through a session in both upload modes: one
# bookkeeping path, so the kept set and get_checkpoint() must not depend on
# the mode (issue 12). Expected: indices of the kept checkpoints.
NAN = float("nan")
SESSION_MATRIX = [
    (CheckpointConfig(1, "score", "max"), [3, 1, 2], [0, 2]),
    (CheckpointConfig(1, "score", "max", keep_latest=False), [3, 1, 2], [0]),
    (CheckpointConfig(1, "score", "max", keep_latest=False), [0.9, 0.1], [0]),
    (CheckpointConfig(1, "score", "min", keep_latest=False), [0.9, 0.1, 0.5], [1]),
    (CheckpointConfig(2, "score", "max"), [NAN, 0.5, 0.7, 0.6], [2, 3]),
    (CheckpointConfig(2, "score", "min"), [1, 2, 3, 4], [0, 1, 3]),
    (CheckpointConfig(2, "score", "max", keep_latest=False, missing_score="keep"),
     [NAN, 0.1, 0.5, 0.3], [0, 2, 3]),
    (CheckpointConfig(2), [5, 4, 3, 2], [2, 3]),
    (CheckpointConfig(None, "score", "max"), [1, 2, 3], [0, 1, 2]),
]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("cfg,values,kept", SESSION_MATRIX)
def test_session_retention_matrix_in_both_upload_modes(make_storage, source_dir, mode, cfg,
                                                       values, kept):
    storage = make_storage()
    s = Session(storage, dataclasses.replace(cfg, upload_mode=mode))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for v in values:
                s.report({"score": v}, checkpoint=Checkpoint.from_directory(source_dir))
        s.wait()
        names = [f"checkpoint_{i:06d}" for i in kept]
        assert s.manager.kept_dir_names == names
        assert committed_names(storage) == names
        latest = s.get_checkpoint()
        assert latest is not None and latest.path.rsplit("/", 1)[-1] == names[-1]
        assert latest.is_committed
    finally:
        s.close()
