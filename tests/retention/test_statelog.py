"""The retention state as a log with snapshots (issue 19): what a report writes,
what a restart reads, version-1 files, and damaged parts."""

from __future__ import annotations

import json
import os
import posixpath
import warnings

import pytest
from _retention_helpers import save

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointManager,
    InvalidConfigError,
    StorageContext,
)
from checkpoint_store._format.layout import MANAGER_STATE, state_log_name
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.retention import restore as manager_mod
from checkpoint_store.retention.state import LogRecord, ManagerState, StoredCheckpoint
from checkpoint_store.retention.statelog import StateLog, load_state
from checkpoint_store.testing.faults import faulty_backend

FAST = pytest.mark.parametrize("backend_name", ["local", "memory"])
_REAL_INSPECT = manager_mod.inspect_checkpoint
KEEP_ALL = CheckpointConfig()


def _state_files(storage: StorageContext) -> list[str]:
    return sorted(posixpath.basename(fi.path) for fi in
                  _fsutil.list_dir(storage.filesystem, storage.trial_path)
                  if fi.type.name == "File" and (fi.path.endswith(MANAGER_STATE)
                                                 or "/.cs_state-" in fi.path))


def _write(storage: StorageContext, name: str, data: bytes) -> None:
    with storage.filesystem.open_output_stream(posixpath.join(storage.trial_path, name)) as f:
        f.write(data)


def _entry(i: int) -> StoredCheckpoint:
    return StoredCheckpoint(i, f"checkpoint_{i:06d}", float(i % 97),
                            {"loss": 1.0 / (i + 1), "step": i, "tag": "x" * 120})


# -- what a report writes ---------------------------------------------------------------


@FAST
def test_a_report_appends_a_record_and_every_sixteenth_writes_a_snapshot(make_storage,
                                                                        source_dir):
    storage = make_storage()
    with CheckpointManager(KEEP_ALL, storage) as m:
        save(m, storage, source_dir, {"score": 0.0})  # the first write is a snapshot
        assert _state_files(storage) == [MANAGER_STATE]
        for i in range(1, 16):
            save(m, storage, source_dir, {"score": float(i)})
        logs = [n for n in _state_files(storage) if n.startswith(".cs_state-log-")]
        assert logs == [state_log_name(s) for s in range(2, 17)]
        save(m, storage, source_dir, {"score": 16.0})  # folds them in, then deletes them
        assert _state_files(storage) == [MANAGER_STATE]
    state, _ = load_state(storage)
    assert state is not None and len(state.checkpoints) == 17 and state.next_index == 17


def test_bytes_written_per_change_stay_flat_as_the_kept_set_grows(tmp_path):
    """Keep-all: a snapshot holds every entry, yet a change writes a few KB on
    average whatever N is (chunks are sealed once and merged O(log N) times)."""
    storage = StorageContext(str(tmp_path), "exp", "t", fsync=False)
    log = StateLog(storage)
    written: list[int] = []
    real = _fsutil.write_bytes

    def counting(fs, path, data, *a, **kw):
        written.append(len(data))
        return real(fs, path, data, *a, **kw)

    kept: dict[str, StoredCheckpoint] = {}
    per_window = []
    _fsutil.write_bytes = counting
    try:
        for i in range(6000):
            e = _entry(i)
            kept[e.dir_name] = e
            assert log.append(LogRecord(0, e, next_index=i + 1),
                              lambda i=i: ManagerState("r", {}, i, i + 1, kept))
            if (i + 1) % 1500 == 0:
                per_window.append(sum(written) / 1500)
                written.clear()
    finally:
        _fsutil.write_bytes = real
    assert max(per_window) <= 16 * 1024, per_window
    assert per_window[-1] <= 2 * per_window[0] + 1024, per_window  # flat, not O(N)
    state, _ = StateLog(storage).load()
    assert state is not None and state.checkpoints == kept
    chunks = [n for n in os.listdir(storage.trial_path) if n.startswith(".cs_state-chunk-")]
    assert 1 <= len(chunks) <= 2 * 8  # O(log N) chunks: at most fanout per level


# -- what a restart reads ----------------------------------------------------------------


def _trial_with(tmp_path, source_dir, n: int) -> StorageContext:
    storage = StorageContext(str(tmp_path / f"n{n}"), "exp", "t", fsync=False)
    with CheckpointManager(KEEP_ALL, storage) as m:
        for i in range(n):
            save(m, storage, source_dir, {"score": float(i)})
    return storage


def _restart_calls(storage: StorageContext, monkeypatch) -> tuple[int, list[str]]:
    backend = faulty_backend(storage.backend)
    counted = StorageContext.from_backend(backend, storage.storage_path, "exp", "t")
    inspected: list[str] = []
    real = _REAL_INSPECT

    def spy(fs, path, **kw):
        inspected.append(posixpath.basename(path))
        return real(fs, path, **kw)

    monkeypatch.setattr(manager_mod, "inspect_checkpoint", spy)
    handler = counted.filesystem.handler
    before = sum(handler.calls.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a trusted state restores without a warning
        with CheckpointManager(KEEP_ALL, counted, read_only=True) as m:
            assert len(m.kept_dir_names) == len(storage.checkpoint_dirs())
    return sum(handler.calls.values()) - before, inspected


def test_restart_reads_the_state_and_inspects_only_the_newest(tmp_path, source_dir,
                                                              monkeypatch):
    small = _trial_with(tmp_path, source_dir, 33)
    large = _trial_with(tmp_path, source_dir, 161)
    calls_small, inspected_small = _restart_calls(small, monkeypatch)
    calls_large, inspected_large = _restart_calls(large, monkeypatch)
    assert inspected_small == ["checkpoint_000032"]
    assert inspected_large == ["checkpoint_000160"]
    assert calls_large <= calls_small + 2 and calls_large <= 12, (calls_small, calls_large)


@FAST
def test_restart_checks_what_changed_since_the_last_record(make_storage, source_dir):
    storage = make_storage()
    with CheckpointManager(KEEP_ALL, storage) as m:
        for i in range(4):
            save(m, storage, source_dir, {"score": float(i)})
        run_id = m.run_id
    # Committed after the last record (the process died before registering it) ...
    storage.persist_checkpoint(Checkpoint(source_dir), 4,
                               {"metrics": {"score": 4.0}, "run_id": run_id})
    # ... and a kept one deleted by hand.
    _fsutil.delete_dir(storage.filesystem, posixpath.join(storage.trial_path,
                                                          "checkpoint_000001"))
    with CheckpointManager(KEEP_ALL, make_storage()) as m2:
        assert m2.kept_dir_names == ["checkpoint_000000", "checkpoint_000002",
                                     "checkpoint_000003", "checkpoint_000004"]
        assert m2.next_index == 5
    state, _ = load_state(storage)
    assert state is not None and sorted(state.checkpoints) == m2.kept_dir_names


# -- version 1, damaged and newer parts --------------------------------------------------


@FAST
def test_a_version_1_state_file_reads_back_and_is_upgraded(make_storage, source_dir):
    storage = make_storage()
    with CheckpointManager(CheckpointConfig(2, "score", "max"), storage) as m:
        for v in [3.0, 1.0, 2.0]:
            save(m, storage, source_dir, {"score": v})
        run_id = m.run_id
        kept = m.kept_dir_names
    state, _ = load_state(storage)
    assert state is not None
    v1 = {"kind": "checkpoint_manager_state", "format_version": 1, "run_id": run_id,
          "config": CheckpointConfig(2, "score", "max").to_json(),
          "latest_index": 2, "next_index": 3, "pending_deletes": [], "updated_at": 0.0,
          "checkpoints": [{"index": c.index, "dir_name": c.dir_name, "score": c.score,
                           "metrics": dict(c.metrics)} for c in state.checkpoints.values()]}
    for name in _state_files(storage):
        _fsutil.delete_file(storage.filesystem, posixpath.join(storage.trial_path, name))
    _write(storage, MANAGER_STATE, json.dumps(v1).encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m2 = CheckpointManager(CheckpointConfig(2, "score", "max"), make_storage())
    assert m2.kept_dir_names == kept and m2.run_id == run_id
    save(m2, storage, source_dir, {"score": 9.0})  # the first write upgrades it
    m2.close()
    root = json.loads(_fsutil.read_bytes(storage.filesystem,
                                         posixpath.join(storage.trial_path, MANAGER_STATE)))
    assert root["format_version"] == 2 and root["seq"] >= 1


@FAST
@pytest.mark.parametrize("damage", ["torn record", "missing chunk"])
def test_a_damaged_part_rebuilds_from_the_checkpoints(make_storage, source_dir, damage,
                                                      monkeypatch):
    from checkpoint_store.retention import statelog

    monkeypatch.setattr(statelog, "CHUNK_ENTRIES", 2)
    monkeypatch.setattr(statelog, "COMPACT_EVERY", 4)
    storage = make_storage()
    with CheckpointManager(KEEP_ALL, storage) as m:
        for i in range(6):
            save(m, storage, source_dir, {"score": float(i)})
    files = _state_files(storage)
    if damage == "torn record":
        # The close folded every record into the snapshot; a record after it,
        # torn (another writer's, damaged on storage).
        assert not [n for n in files if n.startswith(".cs_state-log-")]
        root = json.loads(_fsutil.read_bytes(storage.filesystem,
                                             posixpath.join(storage.trial_path, MANAGER_STATE)))
        victim = state_log_name(root["seq"] + 1)
        _write(storage, victim, b'{"format_version": 2, "seq": ')
    else:
        victim = [n for n in files if n.startswith(".cs_state-chunk-")][0]
        _fsutil.delete_file(storage.filesystem, posixpath.join(storage.trial_path, victim))
    with pytest.warns(RuntimeWarning, match="rebuilt it from 6 committed"):
        m2 = CheckpointManager(KEEP_ALL, make_storage())
    assert m2.kept_dir_names == [f"checkpoint_{i:06d}" for i in range(6)]
    m2.close()
    state, problem = load_state(storage)  # written back whole, the damaged part gone
    assert state is not None and len(state.checkpoints) == 6, problem
    root = json.loads(_fsutil.read_bytes(storage.filesystem,
                                         posixpath.join(storage.trial_path, MANAGER_STATE)))
    assert _state_files(storage) == sorted([MANAGER_STATE, *(c["name"] for c in root["chunks"])])
    assert victim not in _state_files(storage)


@FAST
def test_a_record_already_in_the_snapshot_is_ignored(make_storage, source_dir):
    storage = make_storage()
    with CheckpointManager(CheckpointConfig(1, "score", "max"), storage) as m:
        for i in range(3):
            save(m, storage, source_dir, {"score": float(i)})
        name = [n for n in _state_files(storage) if n.startswith(".cs_state-log-")][0]
        old = _fsutil.read_bytes(storage.filesystem, posixpath.join(storage.trial_path, name))
        assert m.retry_deletes() == []
        before, _ = load_state(storage)
        assert m._log.compact(m._state())  # folds the record in and deletes it
    # The delete of the folded record was cut short: it is back.
    _write(storage, name, old)
    after, _ = load_state(storage)
    assert before is not None and after is not None
    assert after.checkpoints == before.checkpoints
    assert after.pending_deletes == before.pending_deletes


@FAST
def test_a_record_of_a_newer_format_is_refused(make_storage, source_dir):
    storage = make_storage()
    with CheckpointManager(KEEP_ALL, storage) as m:
        save(m, storage, source_dir, {})
    _write(storage, state_log_name(99), b'{"format_version": 3, "seq": 99}')
    with pytest.raises(InvalidConfigError, match="newer than this checkpoint-store reads"):
        CheckpointManager(KEEP_ALL, make_storage(), read_only=True)


@FAST
def test_the_previous_checkpoint_of_a_report_is_found_without_a_listing(make_storage,
                                                                       source_dir,
                                                                       monkeypatch):
    storage = make_storage()
    for i in (0, 1, 2):
        storage.persist_checkpoint(Checkpoint(source_dir), i, {"metrics": {}})
    listings: list[int] = []
    real = StorageContext.checkpoint_dirs
    monkeypatch.setattr(StorageContext, "checkpoint_dirs",
                        lambda self: listings.append(1) or real(self))
    found = storage.previous_checkpoint(3)
    assert found is not None and found.root.endswith("checkpoint_000002") and listings == []
    # A gap below (the previous one evicted): the listing finds the one before.
    _fsutil.delete_dir(storage.filesystem, posixpath.join(storage.trial_path,
                                                          "checkpoint_000002"))
    found = storage.previous_checkpoint(3)
    assert found is not None and found.root.endswith("checkpoint_000001") and listings == [1]
