"""State that survives restarts, ownership, deletes, ordering and movable trees."""

from __future__ import annotations

import datetime as dt
import json
import os
import posixpath
import uuid
import warnings

import pyarrow.fs as pafs
import pytest
from _retention_helpers import committed_names, save, scores_of

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointConflictError,
    CheckpointManager,
    InvalidConfigError,
    StorageContext,
)
from checkpoint_store._format.layout import MANAGER_STATE
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.backends.base import MEMORY_CAPABILITIES, Backend
from checkpoint_store.retention import LEASE_FILE
from checkpoint_store.retention.statelog import load_state

FAST = pytest.mark.parametrize("backend_name", ["local", "memory"])
K2MAX = CheckpointConfig(2, "score", "max")


def _read_state(storage: StorageContext) -> dict:
    """The stored state (snapshot and log folded), in the snapshot's JSON form."""
    state, problem = load_state(storage)
    assert state is not None, problem
    out = state.to_json()
    out["checkpoints"].sort(key=lambda c: c["index"])
    return out


def _write_raw(storage: StorageContext, name: str, data: bytes) -> None:
    with storage.filesystem.open_output_stream(posixpath.join(storage.trial_path, name)) as f:
        f.write(data)


def _fail_deletes(storage: StorageContext, flag: dict) -> None:
    real = storage.delete_checkpoint

    def delete_checkpoint(name: str) -> None:
        if flag["fail"]:
            raise OSError(f"injected: cannot delete {name}")
        real(name)

    storage.delete_checkpoint = delete_checkpoint  # type: ignore[method-assign]


# -- state and restore ---------------------------------------------------------------


@FAST
def test_state_is_written_before_delete_and_failed_deletes_are_retried(make_storage, source_dir):
    storage = make_storage()
    flag = {"fail": True}
    _fail_deletes(storage, flag)
    m = CheckpointManager(CheckpointConfig(1, "score", "max", keep_latest=False), storage)
    save(m, storage, source_dir, {"score": 1.0})
    save(m, storage, source_dir, {"score": 2.0})  # evicts checkpoint_000000: delete fails
    assert m.kept_dir_names == ["checkpoint_000001"]
    assert m.pending_deletes == ["checkpoint_000000"]
    assert committed_names(storage) == ["checkpoint_000000", "checkpoint_000001"]
    state = _read_state(storage)
    assert [c["dir_name"] for c in state["checkpoints"]] == ["checkpoint_000001"]
    assert state["pending_deletes"] == ["checkpoint_000000"]
    flag["fail"] = False
    save(m, storage, source_dir, {"score": 3.0})  # retries the failed delete too
    assert m.pending_deletes == []
    assert committed_names(storage) == ["checkpoint_000002"]
    assert _read_state(storage)["pending_deletes"] == []
    m.close()


@FAST
def test_failed_delete_is_retried_by_the_next_manager(make_storage, source_dir):
    storage = make_storage()
    flag = {"fail": True}
    _fail_deletes(storage, flag)
    m = CheckpointManager(CheckpointConfig(1, "score", "max"), storage)
    for v in [5.0, 1.0, 2.0]:
        save(m, storage, source_dir, {"score": v})
    assert m.pending_deletes == ["checkpoint_000001"]
    m.close()
    m2 = CheckpointManager(CheckpointConfig(1, "score", "max"), make_storage())
    assert m2.pending_deletes == []
    assert committed_names(storage) == ["checkpoint_000000", "checkpoint_000002"]
    m2.close()


@FAST
def test_deletes_are_idempotent(make_storage, source_dir):
    storage = make_storage()
    flag = {"fail": True}
    _fail_deletes(storage, flag)
    m = CheckpointManager(CheckpointConfig(1), storage)
    save(m, storage, source_dir, {})
    save(m, storage, source_dir, {})
    assert m.pending_deletes == ["checkpoint_000000"]
    # Someone removed it meanwhile: the retry finds nothing and is content.
    _fsutil.delete_dir(storage.filesystem, posixpath.join(storage.trial_path, "checkpoint_000000"))
    flag["fail"] = False
    assert m.retry_deletes() == []
    storage.delete_checkpoint("checkpoint_000000")  # again: absent is fine
    assert committed_names(storage) == ["checkpoint_000001"]
    m.close()


@FAST
@pytest.mark.parametrize("damage", ["missing", "corrupt", "wrong-shape"])
def test_missing_or_corrupt_state_is_rebuilt_with_a_warning(
    make_storage, source_dir, damage
):
    storage = make_storage()
    m = CheckpointManager(K2MAX, storage)
    for v in [0.3, 0.9, 0.1, 0.5]:
        save(m, storage, source_dir, {"score": v})
    run_id = m.run_id
    m.close()
    state = posixpath.join(storage.trial_path, MANAGER_STATE)
    if damage == "missing":
        _fsutil.delete_file(storage.filesystem, state)
    elif damage == "corrupt":
        _write_raw(storage, MANAGER_STATE, b'{"format_version": 1, "checkp')
    else:
        _write_raw(storage, MANAGER_STATE, b'{"format_version": 1, "checkpoints": 7}')
    with pytest.warns(RuntimeWarning, match="rebuilt it from 2 committed"):
        m2 = CheckpointManager(K2MAX, make_storage())
    assert scores_of(m2, "score") == [0.9, 0.5]
    assert m2.best_checkpoints[0][1]["score"] == 0.9
    assert m2.run_id == run_id  # it continues the same run
    assert _read_state(storage)["run_id"] == run_id  # and wrote the state back
    m2.close()


@FAST
def test_never_hands_out_a_deleted_checkpoint(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(K2MAX, storage)
    for v in [0.9, 0.5, 0.7]:
        save(m, storage, source_dir, {"score": v})
    m.close()
    # The best is deleted behind the manager's back.
    storage.delete_checkpoint("checkpoint_000000")
    m2 = CheckpointManager(K2MAX, make_storage())
    assert m2.kept_dir_names == ["checkpoint_000002"]
    assert m2.best_checkpoint.is_committed
    assert m2.best_checkpoints[0][1]["score"] == 0.7
    m2.close()


@FAST
def test_numbering_continues_after_the_latest_is_deleted_by_hand(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(None), storage)
    for _ in range(3):
        save(m, storage, source_dir, {})
    m.close()
    storage.delete_checkpoint("checkpoint_000002")
    m2 = CheckpointManager(CheckpointConfig(None), make_storage())
    assert m2.next_index == 3
    assert save(m2, storage, source_dir, {}) == "checkpoint_000003"
    m2.close()


@FAST
def test_crash_between_commit_and_registration(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(1, "score", "max", keep_latest=False), storage)
    save(m, storage, source_dir, {"score": 1.0})
    # Committed with its metrics, then the process died before register().
    storage.persist_checkpoint(Checkpoint(source_dir), 1,
                               {"metrics": {"score": 2.0}, "run_id": m.run_id})
    m.close()
    m2 = CheckpointManager(CheckpointConfig(1, "score", "max", keep_latest=False), make_storage())
    assert m2.kept_dir_names == ["checkpoint_000001"]
    assert committed_names(storage) == ["checkpoint_000001"]
    m2.close()


@FAST
def test_state_file_is_relative_and_names_the_run(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(K2MAX, storage)
    for v in [1.0, 2.0, 3.0]:
        save(m, storage, source_dir, {"score": v})
    raw = _fsutil.read_bytes(storage.filesystem, m.state_path).decode()
    assert json.loads(raw)["format_version"] == 2
    state = _read_state(storage)
    assert state["run_id"] == m.run_id
    assert [c["dir_name"] for c in state["checkpoints"]] == ["checkpoint_000001",
                                                             "checkpoint_000002"]
    assert [c["score"] for c in state["checkpoints"]] == [2.0, 3.0]
    assert storage.trial_path not in raw  # no absolute paths: the tree can move
    for ckpt, _ in m.best_checkpoints:
        assert ckpt.internal_metadata["run_id"] == m.run_id
    m.close()


def test_state_of_a_newer_format_is_refused(tmp_path):
    storage = StorageContext(str(tmp_path), "exp", "t")
    storage.ensure_trial_dir()
    _write_raw(storage, MANAGER_STATE, b'{"format_version": 99, "run_id": "x", "checkpoints": []}')
    with pytest.raises(InvalidConfigError, match="upgrade"):
        CheckpointManager(K2MAX, storage)
    # The refusal released the lease.
    assert not _fsutil.exists(storage.filesystem, posixpath.join(storage.trial_path, LEASE_FILE))


@FAST
def test_config_change_on_restore_applies_the_new_rules(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(None, "score", "max"), storage)
    for v in [0.1, 0.9, 0.5, 0.3]:
        save(m, storage, source_dir, {"score": v})
    m.close()
    m2 = CheckpointManager(CheckpointConfig(1, "score", "max"), make_storage())
    assert scores_of(m2, "score") == [0.9, 0.3]
    assert committed_names(storage) == m2.kept_dir_names
    m2.close()


# -- ownership ---------------------------------------------------------------------------


@FAST
def test_checkpoints_of_another_run_are_never_deleted(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(1, "score", "max", keep_latest=False), storage)
    save(m, storage, source_dir, {"score": 1.0})
    # Copied in by hand from another run (with a much better score).
    foreign = storage.persist_checkpoint(
        Checkpoint(source_dir), 1, {"metrics": {"score": 99.0}, "run_id": "another-run"}
    )
    with pytest.raises(CheckpointConflictError, match="another-run"):
        m.register(foreign, {"score": 99.0})
    # A legacy checkpoint (no run id) that names another trial.
    storage.persist_checkpoint(Checkpoint(source_dir), 2,
                               {"metrics": {"score": 50.0}, "trial_name": "other-trial"})
    for v in [2.0, 3.0]:
        save(m, storage, source_dir, {"score": v})
    m.close()
    m2 = CheckpointManager(CheckpointConfig(1, "score", "max", keep_latest=False), make_storage())
    assert m2.foreign_dir_names == ["checkpoint_000001", "checkpoint_000002"]
    assert m2.best_checkpoints[0][1]["score"] == 3.0  # foreign scores are not ranked
    save(m2, storage, source_dir, {"score": 4.0})
    assert committed_names(storage) == ["checkpoint_000001", "checkpoint_000002",
                                        "checkpoint_000005"]
    m2.close()


@FAST
def test_uncommitted_directories_are_never_deleted(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(1), storage)
    save(m, storage, source_dir, {})
    stray = posixpath.join(storage.trial_path, "checkpoint_000001")
    _fsutil.ensure_dir(storage.filesystem, stray, storage.backend.capabilities)
    with storage.filesystem.open_output_stream(posixpath.join(stray, "partial.bin")) as f:
        f.write(b"half an upload")
    m.close()
    m2 = CheckpointManager(CheckpointConfig(1), make_storage())
    assert m2.uncommitted_dir_names == ["checkpoint_000001"]
    assert m2.next_index == 2  # the stray directory's index is not reused
    for _ in range(2):
        save(m2, storage, source_dir, {})
    assert _fsutil.exists(storage.filesystem, posixpath.join(stray, "partial.bin"))
    assert committed_names(storage) == ["checkpoint_000003"]
    m2.close()


# -- order: internal index, never mtimes or names ------------------------------------------


class _SkewedClockHandler(pafs.FSSpecHandler):
    """Memory storage whose modification times are all equal, or run backwards."""

    def __init__(self, mode: str):
        from fsspec.implementations.memory import MemoryFileSystem

        super().__init__(MemoryFileSystem())
        self.mode = mode
        self.calls = 0

    def _skew(self, infos):
        out = []
        for i in infos:
            self.calls += 1
            if self.mode == "equal":
                when = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
            else:
                when = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc) - dt.timedelta(
                    seconds=self.calls)
            if i.type == pafs.FileType.NotFound:
                out.append(i)
            else:
                out.append(pafs.FileInfo(i.path, i.type, size=i.size, mtime=when))
        return out

    def get_file_info(self, paths):
        return self._skew(super().get_file_info(paths))

    def get_file_info_selector(self, selector):
        return self._skew(super().get_file_info_selector(selector))


@pytest.mark.parametrize("mode", ["equal", "backwards"])
def test_modification_times_do_not_change_the_latest(source_dir, mode):
    handler = _SkewedClockHandler(mode)
    backend = Backend(pafs.PyFileSystem(handler), scheme="memory",
                      capabilities=MEMORY_CAPABILITIES, name="skewed memory")
    root = f"/skew-{uuid.uuid4().hex}"

    def storage():
        return StorageContext.from_backend(backend, root, "exp", "t", fsync=False)

    cfg = CheckpointConfig(2, "score", "max")
    s = storage()
    m = CheckpointManager(cfg, s)
    for v in [0.9, 0.1, 0.2, 0.3]:
        save(m, s, source_dir, {"score": v})
    assert posixpath.basename(m.latest_checkpoint.path) == "checkpoint_000003"
    m.close()
    _fsutil.delete_file(s.filesystem, posixpath.join(s.trial_path, MANAGER_STATE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        m2 = CheckpointManager(cfg, storage())
    assert posixpath.basename(m2.latest_checkpoint.path) == "checkpoint_000003"
    assert scores_of(m2, "score") == [0.9, 0.3]
    m2.close()
    _fsutil.delete_dir(s.filesystem, root)


def test_local_mtimes_backwards(tmp_path, source_dir):
    storage = StorageContext(str(tmp_path), "exp", "t", fsync=False)
    m = CheckpointManager(CheckpointConfig(None), storage)
    for _ in range(3):
        save(m, storage, source_dir, {})
    m.close()
    for i, name in enumerate(["checkpoint_000000", "checkpoint_000001", "checkpoint_000002"]):
        os.utime(os.path.join(storage.trial_path, name), (2e9 - i * 1000, 2e9 - i * 1000))
    os.remove(os.path.join(storage.trial_path, MANAGER_STATE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        m2 = CheckpointManager(CheckpointConfig(1), storage)
    assert posixpath.basename(m2.latest_checkpoint.path) == "checkpoint_000002"
    assert committed_names(storage) == ["checkpoint_000002"]
    m2.close()


@FAST
def test_index_order_beyond_six_digits_is_numeric(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(1), storage)
    save(m, storage, source_dir, {}, index=999_999)
    save(m, storage, source_dir, {}, index=1_000_000)
    # "checkpoint_1000000" < "checkpoint_999999" as strings; the index decides.
    assert m.kept_dir_names == ["checkpoint_1000000"]
    m.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        m2 = CheckpointManager(CheckpointConfig(None), make_storage())
    assert posixpath.basename(m2.latest_checkpoint.path) == "checkpoint_1000000"
    assert m2.next_index == 1_000_001
    m2.close()


# -- movable trees ------------------------------------------------------------------------------


def _fill_local_trial(tmp_path, source_dir):
    storage = StorageContext(str(tmp_path / "src-root"), "exp", "t", fsync=False)
    m = CheckpointManager(K2MAX, storage)
    for v in [0.4, 0.8, 0.2, 0.6]:
        save(m, storage, source_dir, {"score": v})
    return storage, m


def _check_moved(dest: StorageContext, run_id: str, tmp_path) -> None:
    m = CheckpointManager(K2MAX, dest)  # the source's lease was copied too: ignored
    assert m.run_id == run_id
    assert scores_of(m, "score") == [0.8, 0.6]
    best = m.best_checkpoint
    assert best.uri.startswith(dest.uri(dest.trial_path))
    out = best.to_directory(str(tmp_path / f"dl-{uuid.uuid4().hex}"))  # verified download
    with open(os.path.join(out, "model.bin"), "rb") as f:
        assert f.read() == b"weights" * 4
    save(m, dest, out, {"score": 0.9})
    assert scores_of(m, "score") == [0.8, 0.9]
    assert committed_names(dest) == m.kept_dir_names
    m.close()


def test_move_trial_local_to_memory(tmp_path, source_dir):
    src, m = _fill_local_trial(tmp_path, source_dir)  # m still open: its lease is live
    dest = StorageContext(f"memory://moved-{uuid.uuid4().hex}", "exp", "t")
    _fsutil.ensure_dir(dest.filesystem, dest.trial_path, dest.backend.capabilities)
    pafs.copy_files(src.trial_path, dest.trial_path, source_filesystem=src.filesystem,
                    destination_filesystem=dest.filesystem)
    _check_moved(dest, m.run_id, tmp_path)
    m.close()
    _fsutil.delete_dir(dest.filesystem, dest.storage_path)


def test_move_trial_local_to_s3(tmp_path, source_dir, s3_location):
    src, m = _fill_local_trial(tmp_path, source_dir)
    m.close()
    dest = StorageContext(s3_location.uri, "exp", "t",
                          storage_options=dict(s3_location.storage_options))
    for fi in src.filesystem.get_file_info(pafs.FileSelector(src.trial_path, recursive=True)):
        if fi.type == pafs.FileType.File:
            rel = fi.path[len(src.trial_path) + 1:]
            data = _fsutil.read_bytes(src.filesystem, fi.path)
            with dest.filesystem.open_output_stream(posixpath.join(dest.trial_path, rel)) as f:
                f.write(data)
    _check_moved(dest, m.run_id, tmp_path)


@FAST
def test_state_write_failure_postpones_deletes_and_never_fails_report(
    make_storage, source_dir, monkeypatch
):
    from checkpoint_store._util import fs as _fsutil

    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(1, "score", "max", keep_latest=False), storage)
    save(m, storage, source_dir, {"score": 1.0})
    real = _fsutil.write_bytes

    def refuse_state(fs, path, *a, **kw):
        if path.endswith(MANAGER_STATE) or "/.cs_state-" in path:  # snapshot or log
            raise OSError("injected: state not writable")
        return real(fs, path, *a, **kw)

    monkeypatch.setattr(_fsutil, "write_bytes", refuse_state)
    save(m, storage, source_dir, {"score": 2.0})  # evicts index 0, but the state is stale
    assert m.kept_dir_names == ["checkpoint_000001"]
    assert committed_names(storage) == ["checkpoint_000000", "checkpoint_000001"]
    monkeypatch.setattr(_fsutil, "write_bytes", real)
    save(m, storage, source_dir, {"score": 0.5})
    assert committed_names(storage) == ["checkpoint_000001"]
    assert _read_state(storage)["pending_deletes"] == []
    m.close()
