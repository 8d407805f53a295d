"""Leftovers without a trace of their writer: garbage to replace, never a
reason to refuse a commit; and cleanup never makes one (issue 17)."""

from __future__ import annotations

import posixpath

import pytest
from _commit_helpers import make_source, read_tree

from checkpoint_store import Checkpoint
from checkpoint_store._format.layout import claim_name
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.ids import new_writer_id
from checkpoint_store.testing.faults import FaultPlan, SimulatedCrash, faulty_backend


@pytest.fixture
def where(any_trial):
    """Local disk, memory, S3 on moto (slow)."""
    return any_trial


def _leave(storage, index: int, files: dict[str, bytes]) -> str:
    """Write ``files`` into ``checkpoint_<index>`` as a writer killed mid-way
    would: data only, no claim, no marker."""
    path = storage.checkpoint_path(index)
    caps = storage.backend.capabilities
    _fsutil.ensure_dir(storage.filesystem, path, caps)
    for rel, data in files.items():
        full = posixpath.join(path, rel)
        _fsutil.ensure_dir(storage.filesystem, posixpath.dirname(full), caps)
        _fsutil.write_bytes(storage.filesystem, full, data, caps)
    return path


def test_commit_replaces_a_leftover_data_file_without_a_claim(where, tmp_path):
    storage = where.storage()
    storage.ensure_trial_dir()
    path = _leave(storage, 3, {"part0.bin": b"half a shard", "sub/stray.bin": b"x" * 10})
    src = make_source(tmp_path / "src", 3)
    ckpt = storage.persist_checkpoint(Checkpoint.from_directory(src), 3, {"metrics": {"i": 3}})
    ckpt.verify()
    assert ckpt.internal_metadata["index"] == 3
    # Exactly the new files: the leftover's bytes and names are gone.
    assert read_tree(storage.filesystem, path) == read_tree(_fsutil.pafs.LocalFileSystem(), src)
    assert storage.scan().committed == ["checkpoint_000003"]


def test_commit_replaces_a_leftover_a_dead_run_claimed(trial, tmp_path):
    # Data of another run's writer next to its claim, stamped long ago, is
    # replaced, not refused. (An object store dates a claim by its mtime: one
    # written a moment ago is a live writer's there, and is waited for.)
    storage = trial.storage(run_id="now")
    storage.ensure_trial_dir()
    path = _leave(storage, 2, {"model.pt": b"old"})
    dead = new_writer_id("before")
    _fsutil.write_bytes(storage.filesystem, posixpath.join(path, claim_name(1, dead)),
                        dead.encode(), storage.backend.capabilities)
    src = make_source(tmp_path / "src", 2)
    storage.persist_checkpoint(Checkpoint.from_directory(src), 2, {}).verify()
    assert read_tree(storage.filesystem, path) == read_tree(_fsutil.pafs.LocalFileSystem(), src)


@pytest.mark.parametrize("crash_after", [0, 1, 2])
def test_cleanup_cut_short_leaves_a_trace(where, tmp_path, crash_after):
    """remove_uncommitted() dies after ``crash_after`` deletions: what stays
    is still recognisably ours (never foreign), and the next cleanup ends it."""
    storage = where.storage(run_id="later")
    storage.ensure_trial_dir()
    path = _leave(storage, 0, {"a.bin": b"a", "b.bin": b"b", "c/d.bin": b"d"})
    dead = new_writer_id("crashed")
    _fsutil.write_bytes(storage.filesystem, posixpath.join(path, claim_name(1, dead)),
                        dead.encode(), storage.backend.capabilities)
    assert storage.scan().uncommitted == ["checkpoint_000000"]
    dying = where.storage(run_id="later")
    dying.backend = faulty_backend(where.backend, FaultPlan(crash_after_writes=crash_after))
    try:
        dying.remove_uncommitted()
    except SimulatedCrash:
        pass
    found = storage.scan()
    assert found.foreign == [], found
    assert storage.remove_uncommitted() == found.uncommitted
    assert storage.scan().uncommitted == []


def test_delete_cut_short_keeps_its_tombstone_last(where, tmp_path):
    storage = where.storage()
    storage.ensure_trial_dir()
    src = make_source(tmp_path / "src", 1)
    storage.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
    # Every write succeeds but the last deletion: on object stores the
    # tombstone must be what stays, not a data file.
    n = len(storage.checkpoint("checkpoint_000001").internal_metadata["manifest"])
    dying = where.storage()
    dying.backend = faulty_backend(where.backend, FaultPlan(crash_after_writes=n + 2))
    try:
        dying.delete_checkpoint("checkpoint_000001")
    except SimulatedCrash:
        pass
    found = storage.scan()
    assert found.committed == [] and found.foreign == [], found
    assert storage.remove_uncommitted() == found.uncommitted
    assert not _fsutil.exists(storage.filesystem, storage.checkpoint_path(1))


def test_a_rank_killed_before_its_marker_leaves_its_attempts_data(where, tmp_path):
    """Ranks copy straight into the checkpoint on marker-last stores: a rank
    killed after its data, before its rank marker, leaves files that are the
    attempt's (kept while it runs, removed by the next), never foreign ones."""
    from checkpoint_store.session._multirank import Coordinator

    storage = where.storage()
    storage.ensure_trial_dir()
    dying = where.storage()
    dying.backend = faulty_backend(where.backend, FaultPlan(crash_on_path=".cs_rank-"))
    rank1 = Coordinator(dying, 1, 2, attempt_id="job_r0", timeout_s=5)
    src = make_source(tmp_path / "src", 1)
    target = dying.commit_protocol.workdir(dying.checkpoint_path(0), rank1.attempt_id)
    with pytest.raises(SimulatedCrash):
        rank1._write_part(0, Checkpoint.from_directory(src), target, None)
    found = storage.scan("job_r0")
    assert found.foreign == [] and found.committed == [], found
    assert found.active == found.uncommitted and len(found.active) == 1
    # Rank 0 of the next attempt cleans it; the index is free again.
    assert storage.remove_uncommitted("job_r1") == found.uncommitted
    assert storage.scan().uncommitted == [] and storage.scan().foreign == []


def test_delete_with_glob_like_names_removes_exactly_the_checkpoint(where, tmp_path):
    # Object stores delete top-level data files in one batched call; names
    # fsspec would read as a glob go one by one, and the neighbour stays.
    storage = where.storage()
    storage.ensure_trial_dir()
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a*", "b[1]", "c?", "plain.bin"):
        (src / name).write_bytes(name.encode())
    storage.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {})
    keep = storage.persist_checkpoint(Checkpoint.from_directory(str(src)), 1, {})
    storage.delete_checkpoint("checkpoint_000000")
    assert not _fsutil.exists(storage.filesystem, storage.checkpoint_path(0))
    assert storage.scan().committed == ["checkpoint_000001"]
    keep.verify()


@pytest.mark.parametrize("alive", [False, True])
def test_a_claim_write_killed_before_its_rename_leaves_a_directory_of_ours(tmp_path, alive):
    """On a local disk a claim is written as ``.cs_tmp-<claim>-<tag>-<token>``
    and renamed into place: a kill between the two left a directory holding
    only that temporary file, which the scan called foreign (never resumed,
    never removed; the SIGKILL harness hit it). Ours now: removed by cleanup
    once its writer is dead, kept while that process lives (its rename may
    still come)."""
    import os
    import subprocess
    import sys

    from checkpoint_store import StorageContext
    from checkpoint_store._format.layout import temp_file_name
    from checkpoint_store._util.liveness import writer_tag

    storage = StorageContext(str(tmp_path / "runs"), "e", "t")
    storage.ensure_trial_dir()
    path = storage.checkpoint_path(7)
    os.makedirs(path)
    if alive:
        tag = writer_tag()
    else:  # a process that has exited: its tag names no live process
        proc = subprocess.run([sys.executable, "-c",
                               "from checkpoint_store._util.liveness import writer_tag;"
                               "print(writer_tag())"], capture_output=True, text=True,
                              check=True)
        tag = proc.stdout.strip()
    claim = claim_name(1_796_536_218_746_191_390, new_writer_id("an_old_run"))
    with open(os.path.join(path, temp_file_name(claim, tag, "dcce93c6")), "wb") as f:
        f.write(b"writer")
    scan = storage.scan()
    assert scan.foreign == []
    if alive:
        assert scan.active == ["checkpoint_000007"]
    else:
        assert scan.uncommitted == ["checkpoint_000007"] and scan.active == []
        storage.remove_uncommitted()
        assert not os.path.exists(path)
