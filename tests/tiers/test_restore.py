"""get_checkpoint() with a local tier: the newest complete copy from the fastest
tier; a wiped or corrupted local tier falls back to the persistent tier; two
ranks with their own local tiers; trials without tiers open unchanged."""

from __future__ import annotations

import os
import shutil

import pytest
from _tier_helpers import make_checkpoint, read_files

from checkpoint_store import CheckpointConfig, LocalTier, session
from checkpoint_store.testing import session_internals


def _start(durable, tier, **kw):
    return session.start(experiment_name="e", trial_name="t", local_tier=tier,
                         **durable.start_kwargs(), **kw)


def _run(durable, tier, tmp_path, n, start=0, **kw):
    with _start(durable, tier, **kw) as s:
        for i in range(start, start + n):
            s.report({"i": i}, checkpoint=make_checkpoint(tmp_path, f"c{i}", {"w.bin": b"%d" % i}))


def test_resume_reads_the_local_copy_when_it_is_newest(durable, tmp_path):
    tier = LocalTier(tmp_path / "fast")
    _run(durable, tier, tmp_path, 3)
    with _start(durable, tier) as s:
        got = s.get_checkpoint()
        assert got is not None and got.is_local
        assert got.path == str(tmp_path / "fast" / "e" / "t" / "checkpoint_000002")
        assert read_files(got.path) == {"w.bin": b"2"}
        row = s.report({"i": 3}, checkpoint=make_checkpoint(tmp_path, "c3", {"w.bin": b"3"}))
        assert row["checkpoint_dir_name"] == "checkpoint_000003"  # numbering continues


def test_a_wiped_local_tier_resumes_from_the_storage_path(durable, tmp_path):
    tier = LocalTier(tmp_path / "fast")
    _run(durable, tier, tmp_path, 2)
    shutil.rmtree(tmp_path / "fast")  # a new node, a wiped disk
    with _start(durable, tier) as s:
        assert s.durable_index == 1
        got = s.get_checkpoint()
        assert got is not None and got.uri == durable.ctx().checkpoint("checkpoint_000001").uri
        with got.as_directory() as d:
            assert read_files(d) == {"w.bin": b"1"}
        row = s.report({"i": 2}, checkpoint=make_checkpoint(tmp_path, "c2", {"w.bin": b"2"}))
        assert row["checkpoint_dir_name"] == "checkpoint_000002"


def test_a_corrupted_local_copy_is_not_listed_and_the_durable_copy_is_used(durable_uri,
                                                                            tmp_path):
    tier = LocalTier(tmp_path / "fast")
    _run(durable_uri, tier, tmp_path, 2)
    bad = tmp_path / "fast" / "e" / "t" / "checkpoint_000001" / "w.bin"
    bad.write_bytes(b"X")  # same size, another CRC32C
    with _start(durable_uri, tier) as s:
        with pytest.warns(RuntimeWarning, match="does not verify"):
            got = s.get_checkpoint()
        assert got is not None and got.uri == durable_uri.ctx().checkpoint(
            "checkpoint_000001").uri
        assert [e.index for e in session_internals(s).tier.entries()] == [0]
        assert not bad.parent.exists()
        assert s.get_checkpoint() == got  # asked again: still not listed


def test_a_local_copy_older_than_the_durable_one_is_not_used(tmp_path):
    store = str(tmp_path / "durable")
    tier = LocalTier(tmp_path / "fast")
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        s.report({}, checkpoint=make_checkpoint(tmp_path, "c0", {"w.bin": b"0"}))
    # A later run on another machine, without the local tier, went on.
    with session.start(storage_path=store, experiment_name="e", trial_name="t") as s:
        s.report({}, checkpoint=make_checkpoint(tmp_path, "c1", {"w.bin": b"1"}))
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        got = s.get_checkpoint()
        assert got is not None and got.path == os.path.join(store, "e", "t", "checkpoint_000001")


def test_trials_without_tiers_open_unchanged(durable_uri, tmp_path):
    with session.start(experiment_name="e", trial_name="t", **durable_uri.start_kwargs(),
                       checkpoint_config=CheckpointConfig(num_to_keep=2)) as s:
        for i in range(3):
            s.report({"i": i}, checkpoint=make_checkpoint(tmp_path, f"c{i}", {"w.bin": b"%d" % i}))
    tier = LocalTier(tmp_path / "fast")
    with _start(durable_uri, tier, checkpoint_config=CheckpointConfig(num_to_keep=2)) as s:
        got = s.get_checkpoint()
        assert got is not None and got.uri == durable_uri.ctx().checkpoint(
            "checkpoint_000002").uri
        s.report({"i": 3}, checkpoint=make_checkpoint(tmp_path, "c3", {"w.bin": b"3"}))
    assert durable_uri.committed() == [2, 3]
    # And a trial written with a tier opens without one.
    with session.start(experiment_name="e", trial_name="t", **durable_uri.start_kwargs()) as s:
        got = s.get_checkpoint()
        assert got is not None and got.uri == durable_uri.ctx().checkpoint(
            "checkpoint_000003").uri
    assert [r["i"] for r in durable_uri.ctx().read_results()] == [0, 1, 2, 3]


def _ranks_run(ranks, durable, tmp_path, attempt, body, n=2):
    def rank_fn(rank):
        tier = LocalTier(tmp_path / f"fast{rank}")
        with session.start(experiment_name="e", trial_name="t", world_rank=rank, world_size=n,
                           attempt_id=attempt, sync_timeout_s=30, local_tier=tier,
                           **durable.start_kwargs()) as s:
            return body(s, rank)
    out = ranks(n, rank_fn)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def test_two_ranks_with_their_own_local_tiers(ranks, durable_uri, tmp_path):
    def write(s, rank):
        for i in range(2):
            s.report({"i": i}, checkpoint=make_checkpoint(
                tmp_path / f"r{rank}", f"c{i}", {f"shard_{rank}.bin": b"%d-%d" % (rank, i)}))
        s.wait()
        return s.durable_index

    assert _ranks_run(ranks, durable_uri, tmp_path, "a1", write) == [1, 1]
    # Every rank's part is in the durable checkpoint.
    with durable_uri.ctx().checkpoint("checkpoint_000001").as_directory() as d:
        assert read_files(d) == {"shard_0.bin": b"0-1", "shard_1.bin": b"1-1"}

    def resume(s, rank):
        got = s.get_checkpoint()
        return got.uri, got.is_local, read_files(got.path) if got.is_local else None

    both = _ranks_run(ranks, durable_uri, tmp_path, "a2", resume)
    for rank, (uri, is_local, files) in enumerate(both):
        assert is_local and uri.endswith(f"fast{rank}/e/t/rank_{rank}/checkpoint_000001")
        assert files == {f"shard_{rank}.bin": b"%d-1" % rank}

    shutil.rmtree(tmp_path / "fast1")  # rank 1's node lost its disk
    one = _ranks_run(ranks, durable_uri, tmp_path, "a3", resume)
    durable_uri_1 = durable_uri.ctx().checkpoint("checkpoint_000001").uri
    assert [uri for uri, _, _ in one] == [durable_uri_1] * 2

    def go_on(s, rank):
        row = s.report({"i": 2}, checkpoint=make_checkpoint(
            tmp_path / f"r{rank}", "c2", {f"shard_{rank}.bin": b"%d-2" % rank}))
        return row["checkpoint_dir_name"]

    assert _ranks_run(ranks, durable_uri, tmp_path, "a4", go_on) == ["checkpoint_000002"] * 2


def test_a_local_tier_of_another_storage_path_is_refused(tmp_path):
    from checkpoint_store import InvalidConfigError

    tier = LocalTier(tmp_path / "fast")
    with session.start(storage_path=str(tmp_path / "a"), experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        s.report({}, checkpoint=make_checkpoint(tmp_path, "c0", {"w.bin": b"0"}))
    with pytest.raises(InvalidConfigError, match="holds the checkpoints of"):
        session.start(storage_path=str(tmp_path / "b"), experiment_name="e", trial_name="t",
                      local_tier=tier)
    # The same trial spelled another way is the same trial.
    with session.start(storage_path=f"file://{tmp_path}/./a/", experiment_name="e",
                       trial_name="t", local_tier=tier) as s:
        got = s.get_checkpoint()
        assert got is not None and got.is_local
        assert got.path.startswith(str(tmp_path / "fast"))


@pytest.mark.parametrize("damage", ["empty", "torn", "deleted"])
def test_a_foreign_tier_without_a_readable_state_file_is_refused(tmp_path, damage):
    """Job A's tier directory lost its state file (emptied by a crash of an
    unsynced disk, cut short, deleted): the copies themselves still say they
    are A's, so job B (another storage_path, the same names) is refused
    instead of resuming A's checkpoint and copying it into B."""
    from checkpoint_store import InvalidConfigError, StorageContext
    from checkpoint_store.tiers import TIER_STATE_FILE

    tier = LocalTier(tmp_path / "fast")
    with session.start(storage_path=str(tmp_path / "a"), experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        for i in range(2):
            s.report({"i": i}, checkpoint=make_checkpoint(tmp_path, f"c{i}", {"w.bin": b"A%d" % i}))
    state = tmp_path / "fast" / "e" / "t" / TIER_STATE_FILE
    if damage == "deleted":
        state.unlink()
    else:
        state.write_text("" if damage == "empty" else state.read_text()[:40])
    with pytest.raises(InvalidConfigError, match=f"holds the checkpoints of .*{tmp_path}/a/e/t"):
        session.start(storage_path=str(tmp_path / "b"), experiment_name="e", trial_name="t",
                      local_tier=tier)
    assert StorageContext(str(tmp_path / "b"), "e", "t").committed_checkpoints() == []
    # A's own restart still resumes its local copy (the state file is rebuilt);
    # the durable copy never names the local tier's trial.
    with session.start(storage_path=str(tmp_path / "a"), experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        got = s.get_checkpoint()
        assert got is not None and got.is_local and read_files(got.path) == {"w.bin": b"A1"}
    durable = StorageContext(str(tmp_path / "a"), "e", "t").checkpoint("checkpoint_000001")
    assert "durable_uri" not in durable.internal_metadata


def test_a_foreign_tier_of_states_without_its_state_file_is_refused(tmp_path):
    """The same through ``report(state=...)``: the persist process writes the
    state straight into the tier's ``checkpoint_<index>``, committed in place."""
    from checkpoint_store import InvalidConfigError
    from checkpoint_store.tiers import TIER_STATE_FILE

    tier = LocalTier(tmp_path / "fast")
    with session.start(storage_path=str(tmp_path / "a"), experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        for i in range(2):
            s.report({"i": i}, state={"step": i, "who": "A"})
    (tmp_path / "fast" / "e" / "t" / TIER_STATE_FILE).unlink()
    with pytest.raises(InvalidConfigError, match="holds the checkpoints of"):
        session.start(storage_path=str(tmp_path / "b"), experiment_name="e", trial_name="t",
                      local_tier=tier)
    with session.start(storage_path=str(tmp_path / "a"), experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        got = s.get_checkpoint()
        assert got is not None and got.load_state() == {"step": 1, "who": "A"}


def _local_only_newest(tmp_path, damage):
    """Three copies on the local tier, 0 and 1 durable, 2 local only (``persist``),
    then checkpoint 2 on the local tier damaged as ``damage`` says."""
    tier = LocalTier(tmp_path / "fast", num_to_keep=3, persist=lambda index, row: index < 2)
    with session.start(storage_path=str(tmp_path / "store"), experiment_name="e",
                       trial_name="t", local_tier=tier) as s:
        for i in range(3):
            s.report({"i": i}, checkpoint=make_checkpoint(tmp_path, f"c{i}", {"w.bin": b"%d" % i}))
    newest = tmp_path / "fast" / "e" / "t" / "checkpoint_000002"
    marker = newest / ".internal_metadata.json"
    if damage == "marker cut short":
        marker.write_text(marker.read_text()[:30])
    elif damage == "marker emptied":
        marker.write_text("")
    elif damage == "file truncated":
        os.truncate(newest / "w.bin", 0)
    else:
        shutil.rmtree(newest)
    return tier, newest


@pytest.mark.parametrize("damage", ["marker cut short", "marker emptied", "file truncated",
                                    "directory deleted"])
def test_a_restart_past_a_damaged_local_only_copy_says_so(tmp_path, damage, caplog):
    """The newest checkpoint lived on the local tier only and is damaged since:
    the restart goes back to checkpoint 1, and says so, naming the copy;
    what is left of it goes, and its index is not numbered again."""
    tier, newest = _local_only_newest(tmp_path, damage)
    with caplog.at_level("WARNING"), session.start(
            storage_path=str(tmp_path / "store"), experiment_name="e", trial_name="t",
            local_tier=tier) as s:
        got = s.get_checkpoint()
        assert got is not None and read_files(got.path) == {"w.bin": b"1"}
        row = s.report({"i": 3}, checkpoint=make_checkpoint(tmp_path, "c3", {"w.bin": b"3"}))
        assert row["checkpoint_dir_name"] == "checkpoint_000003"
    assert f"{newest} is " in caplog.text and "that checkpoint is lost" in caplog.text
    assert not newest.exists()


@pytest.mark.parametrize("damage", ["marker cut short", "file truncated"])
def test_a_restore_without_a_session_past_a_damaged_local_copy_warns(tmp_path, damage):
    """The readers that open no session (HF restore_latest, Lightning
    resume_path: trial_copies) name the damaged local copy they go back past."""
    from checkpoint_store import StorageContext
    from checkpoint_store.tiers.history import trial_copies

    tier, newest = _local_only_newest(tmp_path, damage)
    with pytest.warns(RuntimeWarning, match=f"{newest}.*damaged"):
        copies = trial_copies(StorageContext(str(tmp_path / "store"), "e", "t"), tier)
    assert [(c.index, c.where) for c in copies][:2] == [(1, "local"), (1, "durable")]
