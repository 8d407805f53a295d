"""`cp` of a trial copies its retention state whole: the snapshot root, the
log records after it and its chunks, as one snapshot at the destination.

It copied the root alone, which is the state as of its last snapshot (up to
16 reports old). A run resumed on the copy then numbered its next checkpoint
with an index the source had already used (`result.json` then named two
different checkpoints `checkpoint_000002`).
"""

from __future__ import annotations

import json

from cli_helpers import Store, invoke

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session
from checkpoint_store.retention import CheckpointManager


def _run(store: Store, tmp_path, losses, config, trial="t1") -> None:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "w.bin").write_bytes(b"w" * 64)
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name=trial,
                       checkpoint_config=config, storage_options=dict(store.options) or None):
        for loss in losses:
            session.report({"loss": loss}, checkpoint=Checkpoint(str(src)))


def _kept(store: Store, root: str, trial: str = "t1") -> tuple[list[str], int]:
    ctx = StorageContext(root, "exp", trial, storage_options=dict(store.options) or None)
    with CheckpointManager(CheckpointConfig(), ctx, read_only=True) as m:
        assert m.restored_from_state
        return sorted(m.kept_dir_names), m.next_index


def test_a_run_resumed_on_a_copy_never_reuses_an_index(every_store, tmp_path):
    config = CheckpointConfig(2, "loss", "min")
    _run(every_store, tmp_path, [0.8, 0.3, 0.5, 0.4], config)
    ctx = every_store.ctx()
    ctx.filesystem.delete_dir_contents(ctx.checkpoint_path(3))  # gone by hand
    if ctx.backend.capabilities.directories:
        ctx.filesystem.delete_dir(ctx.checkpoint_path(3))
    backup = every_store.join("backup")
    res = invoke(["cp", every_store.join("exp", "t1"), backup + "/exp/t1",
                  *every_store.opt_args()])
    assert res.exit_code == 0, res.output
    assert _kept(every_store, backup)[1] == 4
    with session.start(storage_path=backup, experiment_name="exp", trial_name="t1",
                       checkpoint_config=config,
                       storage_options=dict(every_store.options) or None):
        src = tmp_path / "src"
        row = session.report({"loss": 0.1}, checkpoint=Checkpoint(str(src)))
    assert row["checkpoint_dir_name"] == "checkpoint_000004"
    res = invoke(["ls", backup + "/exp/t1", "--json", *every_store.opt_args()])
    assert [c["name"] for c in json.loads(res.stdout)["checkpoints"]] == [
        "checkpoint_000001", "checkpoint_000004"]


def test_a_copy_of_a_long_keep_all_trial_has_its_whole_state(near_store, tmp_path):
    """Past several snapshots (chunks, records after the root), and copied again
    over an earlier copy: the copy's state keeps what the source's keeps."""
    _run(near_store, tmp_path, [0.5] * 40, CheckpointConfig())
    backup = near_store.join("backup")
    src_trial, dst_trial = near_store.join("exp", "t1"), backup + "/exp/t1"
    assert invoke(["cp", src_trial, dst_trial]).exit_code == 0
    _run(near_store, tmp_path, [0.4] * 7, CheckpointConfig())
    res = invoke(["cp", src_trial, dst_trial])
    assert res.exit_code == 0, res.output
    assert "40 already there" in res.output
    assert _kept(near_store, backup) == _kept(near_store, near_store.uri)
    assert _kept(near_store, backup)[1] == 47
    # The stored state itself, before any restore reconciles it with a listing.
    stored = [_stored(near_store, root) for root in (near_store.uri, backup)]
    assert stored[0] == stored[1]
    assert stored[1][1:] == (46, 47)


def _stored(store: Store, root: str) -> tuple[list[str], int | None, int | None]:
    from checkpoint_store.retention.statelog import StateLog

    state, problem = StateLog(StorageContext(root, "exp", "t1")).load()
    assert state is not None, problem
    return sorted(state.checkpoints), state.latest_index, state.next_index
