"""Retention as the session applies it."""

from __future__ import annotations

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session


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
