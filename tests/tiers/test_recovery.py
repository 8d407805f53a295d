"""What a restart finds on the local tier: pending copies (one rank, two ranks),
copies whose durable commit landed before the kill, a damaged state file."""

from __future__ import annotations

import json
import os

import pytest
from _tier_helpers import make_checkpoint, read_files, tiered_rank

from checkpoint_store import LocalTier, StorageContext, session
from checkpoint_store.testing import session_internals
from checkpoint_store.tiers import TIER_STATE_FILE, FastTier, read_tier_state


def _state(trial_dir) -> dict[int, str]:
    state = read_tier_state(str(trial_dir))
    assert state is not None
    return {i: e.durable for i, e in state.items()}


def _mark(trial_dir, index: int, status: str) -> None:
    path = trial_dir / TIER_STATE_FILE
    body = json.loads(path.read_text())
    for e in body["checkpoints"]:
        if e["index"] == index:
            e["durable"] = status
    path.write_text(json.dumps(body))


def _run(store, tier, tmp_path, n, **kw):
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=tier, **kw) as s:
        for i in range(n):
            s.report({"i": i}, checkpoint=make_checkpoint(tmp_path, f"c{i}", {"w.bin": b"%d" % i}))


def test_a_pending_entry_whose_durable_commit_landed_is_recorded_durable(tmp_path):
    store = str(tmp_path / "durable")
    tier = LocalTier(tmp_path / "fast")
    _run(store, tier, tmp_path, 2)
    trial = tmp_path / "fast" / "e" / "t"
    _mark(trial, 1, "pending")  # killed after the durable commit, before the state write
    ctx = StorageContext(store, "e", "t")
    before = ctx.checkpoint("checkpoint_000001").internal_metadata["writer_id"]
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        assert session_internals(s).tier.pending() == []
        assert s.durable_index == 1
    assert _state(trial) == {0: "durable", 1: "durable"}
    assert ctx.checkpoint("checkpoint_000001").internal_metadata["writer_id"] == before


def test_a_copy_found_committed_there_while_persisting_is_registered_once(tmp_path,
                                                                         monkeypatch):
    """The persistent tier could not be read at start (so the entry stays
    pending) but the copy had landed: the persist finds it and moves on."""
    store = str(tmp_path / "durable")
    tier = LocalTier(tmp_path / "fast")
    _run(store, tier, tmp_path, 2)
    trial = tmp_path / "fast" / "e" / "t"
    _mark(trial, 1, "pending")
    monkeypatch.setattr(FastTier, "_durable_has", lambda self, index: False)
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        s.wait(timeout=60)
        assert s.durable_index == 1
        assert s.manager.kept_dir_names == ["checkpoint_000000", "checkpoint_000001"]
    assert _state(trial) == {0: "durable", 1: "durable"}


def test_a_damaged_state_file_is_rebuilt_from_the_committed_copies(tmp_path):
    store = str(tmp_path / "durable")
    tier = LocalTier(tmp_path / "fast", num_to_keep=3)
    _run(store, tier, tmp_path, 3)
    trial = tmp_path / "fast" / "e" / "t"
    (trial / TIER_STATE_FILE).write_text("{torn")
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        assert [e.index for e in session_internals(s).tier.entries()] == [0, 1, 2]
        assert session_internals(s).tier.pending() == []
        got = s.get_checkpoint()
        assert got is not None and read_files(got.path) == {"w.bin": b"2"}
    assert _state(trial) == {0: "durable", 1: "durable", 2: "durable"}


@pytest.mark.slow  # two rank processes: about 7 s
def test_two_ranks_persist_what_a_failed_run_left_pending(ranks, tmp_path):
    """The persistent tier refused the copies of checkpoint 1 (both ranks keep it
    pending); the next attempt persists it with every rank's part."""
    store = str(tmp_path / "durable")

    def first(rank):
        s = tiered_rank(store, rank, 2, tmp_path / f"fast{rank}", refused="checkpoint_000001",
                        sync_timeout_s=3)
        try:
            for i in range(2):
                s.report({"i": i}, checkpoint=make_checkpoint(
                    tmp_path / f"r{rank}", f"c{i}", {f"shard_{rank}.bin": b"%d-%d" % (rank, i)}))
            session_internals(s).uploader.wait()
            return session_internals(s).tier.pending()
        finally:
            try:
                s.close()
            except Exception:  # the refused copy's error, raised at the end
                pass

    assert ranks(2, first) == [[1], [1]]
    assert [m["index"] for _, m in StorageContext(store, "e", "t").committed_checkpoints()] == [0]

    def second(rank):
        with session.start(storage_path=store, experiment_name="e", trial_name="t",
                           world_rank=rank, world_size=2, attempt_id="a2", sync_timeout_s=30,
                           local_tier=LocalTier(tmp_path / f"fast{rank}")) as s:
            s.wait(timeout=60)
            got = s.get_checkpoint()
            return s.durable_index, got.is_local and os.path.basename(got.path)

    assert ranks(2, second) == [(1, "checkpoint_000001")] * 2
    ctx = StorageContext(store, "e", "t")
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 1]
    with ctx.checkpoint("checkpoint_000001").as_directory() as d:
        assert read_files(d) == {"shard_0.bin": b"0-1", "shard_1.bin": b"1-1"}


def test_a_restart_on_fewer_ranks_never_persists_the_parts_it_has(ranks, tmp_path):
    """Three ranks leave checkpoint 1 pending on their local tiers (rank 2's
    upload of it was refused, so the index was aborted on every rank). A
    restart on two ranks has two of the three parts: it never commits them
    as checkpoint 1 (the checkpoint would lack rank 2's files), nor restores
    from them; the newest complete checkpoint, 0, is the resume point."""
    store = str(tmp_path / "durable")

    def first(rank):
        s = tiered_rank(store, rank, 3, tmp_path / f"fast{rank}",
                        refused="checkpoint_000001-a1/shard_2" if rank == 2 else None)
        try:
            for i in range(2):
                s.report({"i": i}, checkpoint=make_checkpoint(
                    tmp_path / f"r{rank}", f"c{i}", {f"shard_{rank}.bin": b"%d-%d" % (rank, i)}))
            try:
                s.wait()
            except Exception:  # the abort of checkpoint 1
                pass
            return session_internals(s).tier.pending()
        finally:
            try:
                s.close()
            except Exception:
                pass

    assert ranks(3, first) == [[1], [1], [1]]

    def second(rank):
        with session.start(storage_path=store, experiment_name="e", trial_name="t",
                           world_rank=rank, world_size=2, attempt_id="a2", sync_timeout_s=30,
                           local_tier=LocalTier(tmp_path / f"fast{rank}")) as s:
            s.wait(timeout=60)
            got = s.get_checkpoint()
            return session_internals(s).tier.pending(), got.path

    assert ranks(2, second) == [([], os.path.join(store, "e", "t", "checkpoint_000000"))] * 2
    assert [m["index"] for _, m in StorageContext(store, "e", "t").committed_checkpoints()] == [0]


def test_a_pending_copy_persists_past_its_own_runs_killed_upload(s3_location, tmp_path,
                                                                 monkeypatch):
    """The run id is kept across restarts (``CHECKPOINT_STORE_RUN_ID``) and the
    upload of the local tier's checkpoint 2 was killed on S3 after its claim
    and some data. The restart persists the pending copy at once: the dead
    upload is removed at start, not a live writer's claim waited on for 120 s,
    then refused (CheckpointConflictError) by every restart for an hour."""
    import time

    from checkpoint_store._format.layout import claim_name
    from checkpoint_store._util.ids import new_writer_id

    monkeypatch.setenv("CHECKPOINT_STORE_RUN_ID", "job1")
    kw = dict(storage_path=s3_location.uri, storage_options=dict(s3_location.storage_options),
              experiment_name="e", trial_name="t")
    tier = LocalTier(tmp_path / "fast", num_to_keep=3)
    with session.start(**kw, local_tier=LocalTier(tmp_path / "fast", num_to_keep=3,
                                                  persist=lambda index, row: index < 2)) as s:
        for i in range(3):
            s.report({"i": i}, checkpoint=make_checkpoint(tmp_path, f"c{i}", {"w.bin": b"%d" % i}))
    _mark(tmp_path / "fast" / "e" / "t", 2, "pending")  # its upload was under way
    ctx = StorageContext(**kw)
    dead = new_writer_id("job1")  # what the killed upload left: its claim, then data
    base = ctx.checkpoint_path(2)
    for name, data in ((claim_name(time.time_ns(), dead), dead.encode()), ("w.bin", b"2-cut")):
        with ctx.filesystem.open_output_stream(f"{base}/{name}") as f:
            f.write(data)
    started = time.monotonic()
    with session.start(**kw, local_tier=tier) as s:
        s.wait(timeout=30)
        assert s.durable_index == 2
    assert time.monotonic() - started < 30
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 1, 2]
    with ctx.checkpoint("checkpoint_000002").as_directory() as d:
        assert read_files(d) == {"w.bin": b"2"}
