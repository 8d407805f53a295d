"""The commit protocol: a checkpoint is all there or invisible (issue cases)."""

from __future__ import annotations

import multiprocessing
import os
import posixpath
import threading
import warnings

import pytest
from _commit_helpers import make_source, read_tree

from checkpoint_store import Checkpoint, CheckpointConfig, session
from checkpoint_store._commit.commit import commit_checkpoint
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import INTERNAL_METADATA
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import read_internal_metadata
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
)
from checkpoint_store.testing.faults import FaultPlan, SimulatedCrash, faulty_backend


def _persist(storage, tmp_path, index: int, seed: int | None = None):
    src = make_source(tmp_path / f"src-{index}-{seed}", seed if seed is not None else index)
    return storage.persist_checkpoint(Checkpoint.from_directory(src), index,
                                      {"metrics": {"step": index}})


@pytest.mark.filterwarnings("ignore:retention state:RuntimeWarning")
def test_failure_before_commit_is_invisible_and_next_session_removes_it(any_trial, tmp_path,
                                                                        monkeypatch):
    storage = any_trial.storage()
    storage.ensure_trial_dir()
    first = _persist(storage, tmp_path, 1)
    # Checkpoint 2: every data file is written, then the process dies right
    # before the commit (the rename on local disks, the marker elsewhere).
    crash_at = ".cs_staging" if any_trial.backend.capabilities.atomic_rename else INTERNAL_METADATA
    plan = FaultPlan(crash_on_path=INTERNAL_METADATA)
    dying = any_trial.storage()
    dying.backend = faulty_backend(any_trial.backend, plan)
    with pytest.raises(SimulatedCrash):
        _persist(dying, tmp_path, 2)
    assert dying.backend.filesystem.handler.crashed
    left = storage.scan()
    assert [c.path for c, _ in storage.committed_checkpoints()] == [first.path]
    assert left.committed == ["checkpoint_000001"]
    assert len(left.uncommitted) == 1 and left.foreign == []
    assert crash_at in left.uncommitted[0] or left.uncommitted[0] == "checkpoint_000002"
    # The next session start (a new process: another run id) removes the
    # leftover and resumes from checkpoint 1.
    monkeypatch.setenv("CHECKPOINT_STORE_RUN_ID", "restarted")
    with session.start(**any_trial.session_kwargs()) as s:
        latest = s.get_checkpoint()
        assert latest is not None and latest.path == first.path
        assert latest.internal_metadata["index"] == 1
    after = storage.scan()
    assert after.uncommitted == [] and after.committed == ["checkpoint_000001"]
    assert not _fsutil.exists(storage.filesystem, posixpath.join(storage.trial_path,
                                                                  left.uncommitted[0]))


@pytest.mark.filterwarnings("ignore:retention state:RuntimeWarning")
def test_complete_directory_without_metadata_is_foreign(any_trial, tmp_path):
    storage = any_trial.storage()
    storage.ensure_trial_dir()
    # Copied in by hand: all the files, no internal metadata.
    src = make_source(tmp_path / "hand", 5)
    from checkpoint_store._transfer.trees import copy_tree

    copy_tree(_fsutil.pafs.LocalFileSystem(), src, storage.filesystem,
              storage.checkpoint_path(0), storage.backend.capabilities)
    assert storage.committed_checkpoints() == []
    assert storage.scan().foreign == ["checkpoint_000000"]
    with pytest.raises(CheckpointNotFoundError, match="adopt"):
        storage.checkpoint("checkpoint_000000").verify()
    # Neither cleanup nor retention (num_to_keep=1, three reports) deletes it.
    assert storage.remove_uncommitted() == []
    with session.start(checkpoint_config=CheckpointConfig(num_to_keep=1),
                       **any_trial.session_kwargs()) as s:
        assert s.get_checkpoint() is None
        for i in range(3):
            s.report({"i": i}, checkpoint=Checkpoint.from_directory(
                make_source(tmp_path / f"r{i}", 10 + i)))
    found = storage.scan()
    assert "checkpoint_000000" in found.foreign
    assert len(found.committed) == 1
    assert read_tree(storage.filesystem, storage.checkpoint_path(0)) == read_tree(
        _fsutil.pafs.LocalFileSystem(), src)
    # An explicit adopt turns it into a checkpoint that verifies.
    adopted = storage.adopt("checkpoint_000000", metrics={"note": "by hand"})
    adopted.verify()
    assert adopted.internal_metadata["index"] == 0
    assert adopted.internal_metadata["metrics"] == {"note": "by hand"}
    assert "checkpoint_000000" in storage.scan().committed
    with pytest.raises(CheckpointConflictError):
        storage.adopt("checkpoint_000000")


def test_adopt_keeps_user_metadata_out_of_the_manifest(any_trial, tmp_path):
    # A downloaded checkpoint copied back by hand holds .user_metadata.json;
    # like every commit, the adoption leaves it out of the manifest (it may
    # change later), so the adopted checkpoint is committed and verifies.
    storage = any_trial.storage()
    storage.ensure_trial_dir()
    src = make_source(tmp_path / "hand", 7)
    with open(os.path.join(src, ".user_metadata.json"), "w") as f:
        f.write('{"epoch": 3}')
    from checkpoint_store._transfer.trees import copy_tree

    copy_tree(_fsutil.pafs.LocalFileSystem(), src, storage.filesystem,
              storage.checkpoint_path(0), storage.backend.capabilities)
    adopted = storage.adopt("checkpoint_000000")
    adopted.verify()
    assert ".user_metadata.json" not in {e["path"] for e in adopted.internal_metadata["manifest"]}
    assert adopted.get_metadata() == {"epoch": 3}
    assert storage.scan().committed == ["checkpoint_000000"]


def test_adopt_refuses_other_names(trial, tmp_path):
    storage = trial.storage()
    storage.ensure_trial_dir()
    with pytest.raises(Exception, match="rename"):
        storage.adopt("my_model")
    with pytest.raises(CheckpointNotFoundError):
        storage.adopt("checkpoint_000009")


def _race_commit(args):
    root, seed, index, barrier = args
    from checkpoint_store import Checkpoint, StorageContext

    storage = StorageContext(root, "exp", "trial")
    src = make_source(os.path.join(os.path.dirname(root), f"src-race-{seed}"), seed, files=6,
                      size=256 * 1024)
    barrier.wait()
    try:
        storage.persist_checkpoint(Checkpoint.from_directory(src), index, {"metrics": {}})
        return ("committed", seed)
    except CheckpointConflictError as exc:
        return ("conflict", str(exc))


@pytest.mark.slow
def test_two_processes_commit_the_same_checkpoint_local(tmp_path):
    root = str(tmp_path / "store")
    ctx = multiprocessing.get_context("spawn")
    from checkpoint_store import StorageContext

    storage = StorageContext(root, "exp", "trial")
    storage.ensure_trial_dir()
    with ctx.Manager() as mgr, ctx.Pool(2) as pool:
        for rnd in range(3):
            barrier = mgr.Barrier(2)
            outcomes = pool.map(_race_commit, [(root, 100 + rnd * 2, rnd, barrier),
                                               (root, 101 + rnd * 2, rnd, barrier)], chunksize=1)
            kinds = sorted(o[0] for o in outcomes)
            assert kinds == ["committed", "conflict"], outcomes
            winner = next(o[1] for o in outcomes if o[0] == "committed")
            ckpt = storage.checkpoint(f"checkpoint_{rnd:06d}")
            ckpt.verify()
            want = read_tree(_fsutil.pafs.LocalFileSystem(), make_source(
                tmp_path / f"src-race-{winner}", winner, files=6, size=256 * 1024))
            assert read_tree(storage.filesystem, ckpt.path) == want
    assert storage.scan().uncommitted == []


def test_two_threads_commit_the_same_checkpoint(any_trial, tmp_path):
    storage = any_trial.storage()
    storage.ensure_trial_dir()
    for rnd in range(3):
        sources = {s: make_source(tmp_path / f"t{rnd}-{s}", s, files=4, size=64 * 1024)
                   for s in (rnd * 2, rnd * 2 + 1)}
        barrier = threading.Barrier(2)
        out: dict[int, object] = {}

        def go(seed: int, rnd: int = rnd, barrier=barrier, out=out, sources=sources) -> None:
            barrier.wait()
            try:
                commit_checkpoint(_fsutil.pafs.LocalFileSystem(), sources[seed], storage.backend,
                                  storage.checkpoint_path(rnd), {"index": rnd, "metrics": {}})
                out[seed] = "committed"
            except CheckpointConflictError as exc:
                out[seed] = exc

        threads = [threading.Thread(target=go, args=(s,)) for s in sources]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = [s for s, o in out.items() if o == "committed"]
        assert len(winners) == 1, out
        loser = next(o for o in out.values() if o != "committed")
        assert "committed" in str(loser)
        ckpt = storage.checkpoint(f"checkpoint_{rnd:06d}")
        ckpt.verify()
        assert read_tree(storage.filesystem, ckpt.path) == read_tree(
            _fsutil.pafs.LocalFileSystem(), sources[winners[0]])
    assert storage.scan().uncommitted == []


def test_second_commit_of_a_committed_index_changes_nothing(any_trial, tmp_path):
    storage = any_trial.storage()
    storage.ensure_trial_dir()
    first = _persist(storage, tmp_path, 0, seed=1)
    before = read_tree(storage.filesystem, first.path)
    meta_before = dict(first.internal_metadata)
    with pytest.raises(CheckpointConflictError, match="already"):
        _persist(storage, tmp_path, 0, seed=2)
    assert read_tree(storage.filesystem, first.path) == before
    assert dict(first.internal_metadata) == meta_before
    first.verify()


def _flip_byte(fs, path: str, offset: int = 10) -> None:
    data = bytearray(_fsutil.read_bytes(fs, path))
    data[offset] ^= 0x01
    with fs.open_output_stream(path) as f:
        f.write(bytes(data))


@pytest.mark.filterwarnings("ignore:retention state:RuntimeWarning")
def test_flipped_byte_is_named_and_resume_falls_back(any_trial, tmp_path):
    storage = any_trial.storage()
    storage.ensure_trial_dir()
    _persist(storage, tmp_path, 0)
    newest = _persist(storage, tmp_path, 1)
    _flip_byte(storage.filesystem, posixpath.join(newest.path, "shards/part1.bin"))
    # Same size: listings still call it committed; the checksum catches it.
    assert newest.is_committed
    with pytest.raises(CheckpointCorruptError, match="shards/part1.bin") as err:
        newest.verify()
    assert err.value.file == "shards/part1.bin"
    with pytest.raises(CheckpointCorruptError, match="shards/part1.bin"):
        newest.to_directory(tmp_path / "dl")
    assert not (tmp_path / "dl").exists()
    with session.start(**any_trial.session_kwargs()) as s:
        with pytest.warns(RuntimeWarning, match="checkpoint_000001") as rec:
            got = s.get_checkpoint()
        assert "shards/part1.bin" in str(rec[0].message)
        assert got is not None and got.path == storage.checkpoint_path(0)


@pytest.mark.parametrize("damage", ["missing_file", "size", "extra_file", "version",
                                    "not_json", "unsafe_path"])
def test_marker_that_does_not_match_is_not_a_checkpoint(trial, tmp_path, damage):
    storage = trial.storage()
    storage.ensure_trial_dir()
    ckpt = _persist(storage, tmp_path, 0)
    fs, marker = storage.filesystem, posixpath.join(ckpt.path, INTERNAL_METADATA)
    meta = _json.loads(_fsutil.read_bytes(fs, marker))
    caps = storage.backend.capabilities
    if damage == "missing_file":
        fs.delete_file(posixpath.join(ckpt.path, "part0.bin"))
    elif damage == "size":
        with fs.open_output_stream(posixpath.join(ckpt.path, "part0.bin")) as f:
            f.write(b"short")
    elif damage == "extra_file":
        _fsutil.write_bytes(fs, posixpath.join(ckpt.path, "stray.txt"), b"x", caps)
    elif damage == "version":
        meta["format_version"] = 99
        _fsutil.write_bytes(fs, marker, _json.dumps(meta), caps)
    elif damage == "not_json":
        _fsutil.write_bytes(fs, marker, b"{not json", caps)
    else:
        meta["manifest"][0]["path"] = "../../escape.bin"
        _fsutil.write_bytes(fs, marker, _json.dumps(meta), caps)
    assert read_internal_metadata(fs, ckpt.path) is None
    assert storage.committed_checkpoints() == []
    with pytest.raises(CheckpointCorruptError):
        ckpt.verify()
    # Not ours to delete: a marker we cannot trust is reported, never removed.
    assert storage.scan().foreign == ["checkpoint_000000"]
    assert storage.remove_uncommitted() == []


def test_delete_cut_short_never_lists_as_committed(trial, tmp_path):
    storage = trial.storage()
    storage.ensure_trial_dir()
    _persist(storage, tmp_path, 0)
    doomed = _persist(storage, tmp_path, 1)
    dying = trial.storage()
    # Local: the rename away succeeds, the removal dies. Elsewhere: the
    # tombstone and the marker removal succeed, the data removal dies.
    if trial.backend.capabilities.atomic_rename:
        plan = FaultPlan(crash_after_writes=1)
    else:
        # create_dir + PUT of the tombstone, DELETE of the marker; dies at the rest.
        plan = FaultPlan(crash_after_writes=3)
    dying.backend = faulty_backend(trial.backend, plan)
    with pytest.raises(SimulatedCrash):
        dying.delete_checkpoint("checkpoint_000001")
    assert read_internal_metadata(storage.filesystem, doomed.path) is None
    if not trial.backend.capabilities.atomic_rename:
        assert _fsutil.exists(storage.filesystem, posixpath.join(doomed.path, "part0.bin"))
    found = storage.scan()
    assert found.committed == ["checkpoint_000000"]
    assert len(found.uncommitted) == 1 and found.foreign == []
    assert storage.remove_uncommitted() == found.uncommitted
    assert storage.scan().uncommitted == []


def test_cleanup_spares_the_current_run(trial, tmp_path, monkeypatch):
    storage = trial.storage(run_id="jobA")
    storage.ensure_trial_dir()
    fs, caps = storage.filesystem, storage.backend.capabilities
    mine = posixpath.join(storage.trial_path, ".cs_staging-checkpoint_000003-jobA.11.abc")
    other = posixpath.join(storage.trial_path, ".cs_staging-checkpoint_000004-jobB.12.def")
    for d in (mine, other):
        _fsutil.write_bytes(fs, posixpath.join(d, "part.bin"), b"data", caps)
    found = storage.scan()
    assert found.active == [posixpath.basename(mine)]
    assert sorted(found.uncommitted) == sorted([posixpath.basename(mine),
                                                posixpath.basename(other)])
    assert storage.remove_uncommitted() == [posixpath.basename(other)]
    assert _fsutil.exists(fs, posixpath.join(mine, "part.bin"))
    # A rank of the same torchrun attempt shares the run id from the environment.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "jobA")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    from checkpoint_store import StorageContext

    rank1 = StorageContext.from_backend(trial.backend, trial.root, "exp", "trial")
    assert rank1.run_id == "jobA_r0"
    assert rank1.remove_uncommitted(run_id="jobA") == []
    # A later attempt (another run id) removes what the old one left.
    later = StorageContext.from_backend(trial.backend, trial.root, "exp", "trial",
                                        run_id="jobA_r1")
    assert later.remove_uncommitted() == [posixpath.basename(mine)]


def test_fsync_covers_files_and_directories(tmp_path, monkeypatch):
    from checkpoint_store import StorageContext

    calls: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    src = make_source(tmp_path / "src", 1, files=4)
    durable = StorageContext(str(tmp_path / "a"), "exp", "trial")
    durable.ensure_trial_dir()
    durable.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    # 4 data files + the marker, and at least the two data directories,
    # the staging directory and the trial directory after the rename.
    assert len(calls) >= 4 + 1 + 3
    calls.clear()
    fast = StorageContext(str(tmp_path / "b"), "exp", "trial", fsync=False)
    fast.ensure_trial_dir()
    fast.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    assert calls == []
    fast.checkpoint("checkpoint_000000").verify()


def test_session_warns_nothing_for_a_clean_trial(trial, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with session.start(**trial.session_kwargs()) as s:
            s.report({"x": 1}, checkpoint=Checkpoint.from_directory(
                make_source(tmp_path / "s", 3)))
        with session.start(**trial.session_kwargs()) as s:
            got = s.get_checkpoint()
            assert got is not None and got.internal_metadata["index"] == 0


def test_temporary_files_of_dead_writers_are_removed(tmp_path):
    import subprocess
    import sys

    from checkpoint_store import StorageContext

    storage = StorageContext(str(tmp_path / "store"), "exp", "trial")
    storage.ensure_trial_dir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    trial = tmp_path / "store" / "exp" / "trial"
    orphan = trial / f".cs_tmp-.checkpoint_manager.json-{int(dead.stdout)}-0a1b2c3d"
    live = trial / f".cs_tmp-.checkpoint_manager.json-{os.getpid()}-0a1b2c3d"
    orphan.write_bytes(b"{")
    live.write_bytes(b"{")
    assert storage.scan().uncommitted == [orphan.name]
    assert storage.remove_uncommitted() == [orphan.name]
    assert not orphan.exists() and live.exists()


def test_marker_last_claims_of_live_and_dead_writers(memory_trial, tmp_path):
    import time

    storage = memory_trial.storage()
    storage.ensure_trial_dir()
    fs, caps = storage.filesystem, storage.backend.capabilities
    src = make_source(tmp_path / "src", 4)
    dest = storage.checkpoint_path(0)
    # A live writer's fresh claim: we wait for it, then give up without writing.
    live = posixpath.join(dest, f".cs_claim-{time.time_ns():020d}-other.1.abc")
    _fsutil.write_bytes(fs, live, b"other", caps)
    with pytest.raises(CheckpointConflictError, match="another writer"):
        commit_checkpoint(_fsutil.pafs.LocalFileSystem(), src, storage.backend, dest,
                          {"index": 0}, claim_timeout=0.3)
    assert sorted(read_tree(fs, dest)) == []
    # A writer that died an hour ago left its claim and half its data: ignored
    # and replaced by a whole checkpoint.
    _fsutil.delete_file(fs, live)
    dead = posixpath.join(dest, f".cs_claim-{time.time_ns() - 7200 * 10**9:020d}-dead.2.def")
    _fsutil.write_bytes(fs, dead, b"dead", caps)
    _fsutil.write_bytes(fs, posixpath.join(dest, "part0.bin"), b"half", caps)
    _fsutil.write_bytes(fs, posixpath.join(dest, "stale_extra.bin"), b"junk", caps)
    commit_checkpoint(_fsutil.pafs.LocalFileSystem(), src, storage.backend, dest, {"index": 0})
    ckpt = storage.checkpoint("checkpoint_000000")
    ckpt.verify()
    assert read_tree(fs, dest) == read_tree(_fsutil.pafs.LocalFileSystem(), src)
