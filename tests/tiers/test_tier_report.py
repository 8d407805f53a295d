"""report() with a local tier: the local commit, the durable copy behind it,
the persist policy, wait(checkpoint=...), durable_index; every location form
of the persistent tier."""

from __future__ import annotations

import json
import os

import pytest
from _tier_helpers import make_checkpoint, read_files

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointStoreError,
    InvalidConfigError,
    LocalTier,
    session,
)
from checkpoint_store.retention import EveryNSteps
from checkpoint_store.testing import session_internals
from checkpoint_store.tiers import TIER_STATE_FILE, read_tier_state


def _start(durable, tier, **kw):
    return session.start(experiment_name="e", trial_name="t", local_tier=tier,
                         **durable.start_kwargs(), **kw)


def _files(i: int) -> dict[str, bytes]:
    return {"model.bin": bytes([i]) * (1000 + i), "sub/opt.bin": b"o%d" % i}


def test_report_commits_locally_and_every_checkpoint_reaches_the_storage_path(durable, tmp_path):
    tier = LocalTier(tmp_path / "fast", num_to_keep=2)
    with _start(durable, tier, checkpoint_config=CheckpointConfig(num_to_keep=2)) as s:
        rows = [s.report({"loss": 1.0 / (i + 1)},
                         checkpoint=make_checkpoint(tmp_path, f"c{i}", _files(i)))
                for i in range(4)]
        # The local copy is committed when report() returns.
        local = s.get_checkpoint()
        assert local is not None and local.is_local
        assert local.path.startswith(str(tmp_path / "fast"))
        assert local.internal_metadata["index"] == 3
        assert read_files(local.path) == _files(3)
        s.wait()
        assert s.durable_index == 3
    assert [r["checkpoint_dir_name"] for r in rows] == [f"checkpoint_00000{i}" for i in range(4)]
    # The persistent tier applied its own retention (top 2 by recency).
    assert durable.committed() == [2, 3]
    ctx = durable.ctx()
    newest = ctx.checkpoint("checkpoint_000003")
    newest.verify()
    with newest.as_directory() as d:
        assert read_files(d) == _files(3)
    assert [r["loss"] for r in ctx.read_results()] == [1.0, 0.5, 1.0 / 3, 0.25]
    # The local tier keeps its newest 2; the state file says both are durable.
    trial = tmp_path / "fast" / "e" / "t"
    assert sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_")) == [
        "checkpoint_000002", "checkpoint_000003"]
    state = read_tier_state(str(trial))
    assert state is not None
    assert {i: e.durable for i, e in state.items()} == {2: "durable", 3: "durable"}
    body = json.loads((trial / TIER_STATE_FILE).read_text())
    assert body["version"] == 1 and body["checkpoints"][1]["dir_name"] == "checkpoint_000003"


def test_persist_policy_selects_what_reaches_the_storage_path(durable_uri, tmp_path):
    tier = LocalTier(tmp_path / "fast", num_to_keep=5, persist=EveryNSteps(2))
    with _start(durable_uri, tier) as s:
        rows = [s.report({"i": i}, checkpoint=make_checkpoint(tmp_path, f"c{i}", _files(i)))
                for i in range(5)]
        s.wait(checkpoint=rows[3])  # training_iteration 4
        with pytest.raises(CheckpointStoreError, match="not selected"):
            s.wait(checkpoint=rows[2])
        s.wait()
    # training_iteration 2 and 4 are checkpoints 1 and 3.
    assert durable_uri.committed() == [1, 3]
    state = read_tier_state(str(tmp_path / "fast" / "e" / "t"))
    assert state is not None
    assert {i: e.durable for i, e in state.items()} == {
        0: "local_only", 1: "durable", 2: "local_only", 3: "durable", 4: "local_only"}


def test_a_callable_persist_policy_gets_the_index_and_the_row(tmp_path):
    seen = []

    def every_third(index, metrics):
        seen.append((index, metrics["training_iteration"], metrics["loss"]))
        return index % 3 == 0

    store = str(tmp_path / "durable")
    tier = LocalTier(tmp_path / "fast", persist=every_third)
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        for i in range(4):
            s.report({"loss": float(i)}, checkpoint=make_checkpoint(tmp_path, f"c{i}", _files(i)))
    assert seen == [(0, 1, 0.0), (1, 2, 1.0), (2, 3, 2.0), (3, 4, 3.0)]
    from checkpoint_store import StorageContext

    assert [m["index"] for _, m in StorageContext(store, "e", "t").committed_checkpoints()] == [
        0, 3]


def test_a_persist_policy_that_answers_no_bool_fails_the_report(tmp_path):
    tier = LocalTier(tmp_path / "fast", persist=lambda index, metrics: "yes")
    with session.start(storage_path=str(tmp_path / "d"), experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        with pytest.raises(InvalidConfigError, match="True or False"):
            s.report({}, checkpoint=make_checkpoint(tmp_path, "c", _files(0)))


def test_metrics_only_reports_and_in_place_saves_with_a_tier(tmp_path):
    store = str(tmp_path / "durable")
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=LocalTier(tmp_path / "fast")) as s:
        s.report({"a": 1})
        target = s.next_checkpoint_dir()
        assert target == str(tmp_path / "fast" / "e" / "t" / "checkpoint_000000")
        with open(os.path.join(target, "w.bin"), "wb") as f:
            f.write(b"in place")
        row = s.report({"a": 2}, checkpoint=Checkpoint.from_directory(target))
        assert row["checkpoint_dir_name"] == "checkpoint_000000"
        s.wait(checkpoint="checkpoint_000000")
    from checkpoint_store import StorageContext

    ctx = StorageContext(store, "e", "t")
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0]
    with ctx.checkpoint("checkpoint_000000").as_directory() as d:
        assert read_files(d) == {"w.bin": b"in place"}
    assert [r["a"] for r in ctx.read_results()] == [1, 2]


def test_explicit_sync_upload_mode_waits_for_the_durable_copy(tmp_path):
    store = str(tmp_path / "durable")
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=LocalTier(tmp_path / "fast")) as s:
        s.report({}, checkpoint=make_checkpoint(tmp_path, "c", _files(0)), upload_mode="sync")
        assert s.durable_index == 0
        assert session_internals(s).uploader is not None
        assert session_internals(s).uploader.pending == 0


@pytest.mark.parametrize("bad, match", [
    (dict(num_to_keep=0), "num_to_keep"),
    (dict(num_to_keep=True), "num_to_keep"),
    (dict(max_bytes=0), "max_bytes"),
    (dict(max_bytes=1.5), "max_bytes"),
    (dict(persist="every"), "persist"),
    (dict(fsync="yes"), "fsync"),
    (dict(persist_timeout_s=-1), "persist_timeout_s"),
])
def test_bad_local_tier_settings_are_refused(tmp_path, bad, match):
    with pytest.raises(InvalidConfigError, match=match):
        LocalTier(tmp_path / "fast", **bad)


def test_a_remote_local_tier_path_and_a_non_tier_are_refused_before_anything_is_written(
        tmp_path):
    with pytest.raises(InvalidConfigError, match="local directory"):
        LocalTier("s3://bucket/fast")
    store = tmp_path / "durable"
    with pytest.raises(InvalidConfigError, match="local_tier"):
        session.start(storage_path=str(store), local_tier=str(tmp_path / "fast"))
    assert not store.exists()
    assert LocalTier(f"file://{tmp_path}/fast").path == str(tmp_path / "fast")


def test_a_trial_runner_forwards_its_local_tier(tmp_path):
    from checkpoint_store import StorageContext, TrialRunner

    def train(config):
        for i in range(2):
            session.report({"i": i}, checkpoint=make_checkpoint(tmp_path, f"c{i}", _files(i)))

    runner = TrialRunner(train, storage_path=str(tmp_path / "store"), experiment_name="e",
                         trial_name="t", local_tier=LocalTier(tmp_path / "fast"))
    results = [runner.step(timeout=60) for _ in range(2)]
    assert runner.step(timeout=60) is None
    # The result's checkpoint is the local copy, committed when report() returned.
    ck = results[1]["checkpoint"]
    assert ck.path == str(tmp_path / "fast" / "e" / "t" / "checkpoint_000001")
    assert read_files(ck.path) == _files(1)
    ctx = StorageContext(str(tmp_path / "store"), "e", "t")
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 1]
    with pytest.raises(InvalidConfigError, match="local_tier"):
        TrialRunner(train, storage_path=str(tmp_path / "store"), experiment_name="e",
                    trial_name="t", local_tier="fast")


def test_a_local_tier_path_that_is_a_file_is_refused_before_writing(tmp_path):
    store = tmp_path / "results"
    blocker = tmp_path / "fast"
    blocker.write_text("not a directory")
    for path in (blocker, blocker / "below"):
        with pytest.raises(InvalidConfigError, match="not a directory"):
            session.start(storage_path=str(store), experiment_name="e", trial_name="t",
                          local_tier=LocalTier(path))
    assert not store.exists()
    assert blocker.read_text() == "not a directory"


def test_a_read_only_local_tier_path_is_refused_before_writing(tmp_path, read_only_dir):
    """A tier on a read-only mount failed the start with a raw OSError on its
    lock file, after the storage_path's trial directory was made. Now every
    way in refuses it first, typed, and names what to do."""
    from checkpoint_store import TrialRunner

    store = tmp_path / "results"
    for path in (read_only_dir, read_only_dir / "below" / "deeper"):
        with pytest.raises(InvalidConfigError, match="read-only.*writable node-local"):
            session.start(storage_path=str(store), experiment_name="e", trial_name="t",
                          local_tier=LocalTier(path))
        with pytest.raises(InvalidConfigError, match="read-only"):
            TrialRunner(lambda config: None, storage_path=str(store), experiment_name="e",
                        trial_name="t", local_tier=LocalTier(path))
    assert not store.exists()
    assert os.listdir(read_only_dir) == []
    # A writable directory below the same parent is taken as before.
    with session.start(storage_path=str(store), experiment_name="e", trial_name="t",
                       local_tier=LocalTier(tmp_path / "fast")) as s:
        s.report({"step": 0}, checkpoint=make_checkpoint(tmp_path, "c0", {"w": b"0"}))
    assert (tmp_path / "fast" / "e" / "t" / "checkpoint_000000").is_dir()


def test_a_local_tier_overlapping_the_storage_path_is_refused(tmp_path):
    store = tmp_path / "results"
    for path in (store, store / "e" / "t" / "fast"):
        with pytest.raises(InvalidConfigError, match="overlap"):
            session.start(storage_path=str(store), experiment_name="e", trial_name="t",
                          local_tier=LocalTier(path))
    assert not store.exists()
    # The storage_path inside the local tier's trial directory.
    with pytest.raises(InvalidConfigError, match="overlap"):
        session.start(storage_path=str(tmp_path / "fast" / "e" / "t" / "durable"),
                      experiment_name="e", trial_name="t", local_tier=LocalTier(tmp_path / "fast"))


def test_ls_of_a_local_tier_trial_without_checkpoints_lists_a_trial(tmp_path):
    """The local tier's own trial directory holds only its state file until a
    first local commit: ``ls`` there lists a trial (no rows), not a root."""
    from click.testing import CliRunner

    from checkpoint_store.cli import main

    with session.start(storage_path=str(tmp_path / "results"), experiment_name="e",
                       trial_name="t", local_tier=LocalTier(tmp_path / "fast")):
        pass
    trial = tmp_path / "fast" / "e" / "t"
    # Its state file, and the directory's lock and holder (tiers/lock.py).
    assert sorted(p.name for p in trial.iterdir()) == [
        ".cs_tier.lock", ".cs_tier_holder.json", ".cs_tier_state.json"]
    out = CliRunner().invoke(main, ["ls", str(trial)], catch_exceptions=False).output
    assert out.splitlines()[0].split()[:2] == ["INDEX", "CHECKPOINT"], out


@pytest.mark.parametrize("with_tier", [False, True], ids=["no_tier", "local_tier"])
def test_waiting_for_a_checkpoint_never_reported_is_refused(tmp_path, with_tier):
    # wait(checkpoint=99) used to return at once, as if checkpoint_000099 were durable.
    def start():
        tier = LocalTier(tmp_path / "fast") if with_tier else None
        return session.start(storage_path=str(tmp_path / "d"), experiment_name="e",
                             trial_name="t", local_tier=tier)

    with start() as s:
        row = s.report({"a": 1}, checkpoint=make_checkpoint(tmp_path, "c0", _files(0)))
        s.wait(checkpoint=row)
        with pytest.raises(InvalidConfigError, match=r"checkpoint_000099 was never reported"
                                                     r".*next checkpoint is checkpoint_000001"):
            s.wait(checkpoint=99)
        with pytest.raises(InvalidConfigError, match="checkpoint_000001 was never reported"):
            s.wait(checkpoint="checkpoint_000001")
    # A later session of the trial: what an earlier one reported is there to wait for.
    with start() as s:
        s.wait(checkpoint=0)
        with pytest.raises(InvalidConfigError, match="checkpoint_000001 was never reported"):
            s.wait(checkpoint=1)


def test_a_preemption_checkpoint_skips_the_older_copies_still_queued(tmp_path):
    """force_persist (a preemption report) with one rank: copies of older
    checkpoints still queued are skipped (kept on the local tier only), so
    a backlog never holds the preemption checkpoint's copy past the grace
    period; with several ranks (joint commits) nothing is skipped."""
    from checkpoint_store import StorageContext
    from checkpoint_store.tiers import FastTier

    durable = StorageContext(str(tmp_path / "store"), "e", "t")
    one = FastTier(LocalTier(tmp_path / "fast1"), durable)
    two = FastTier(LocalTier(tmp_path / "fast2"), durable, world_rank=0, world_size=2)
    try:
        for tier in (one, two):
            copied: list[str] = []
            record = copied.append
            tier.persist(3, lambda c, record=record: record(c.path))  # no preemption: copied
            tier.force_persist(5)
            tier.persist(4, lambda c, record=record: record(c.path))
            tier.persist(5, lambda c, record=record: record(c.path))
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in copied]
            want = ["checkpoint_000003", "checkpoint_000005"]
            if tier is two:
                want.insert(1, "checkpoint_000004")
            assert names == want
    finally:
        one.close()
        two.close()
