"""Evicted checkpoints are deleted off the training loop, and a kill mid-delete is safe.

A session's retention records an eviction in its state, then deletes on a
background thread (checkpoint_store/retention/deletes.py): ``report()`` never
waits for a delete, ``session.wait()`` and the end of the session do, and a
process killed mid-delete leaves nothing that lists as a checkpoint; the next
session finishes the removal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import fsspec
import pyarrow.fs as pafs
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointManager,
    StorageContext,
    session,
)
from checkpoint_store.backends.base import LOCAL_CAPABILITIES, MEMORY_CAPABILITIES, Backend
from checkpoint_store.backends.forwarding import ForwardingHandler
from checkpoint_store.backends.handlers import wrap_fsspec
from checkpoint_store.session import Session

CHILD = os.path.join(os.path.dirname(__file__), "_kill_mid_delete_child.py")


def _gated_path(path: str) -> bool:
    """A delete of a checkpoint's data (or of a renamed-away checkpoint), not of a
    commit's claims, staging, the state or the results."""
    path = str(path)
    own = "/.cs_" in path and "/.cs_deleting" not in path
    return "checkpoint_" in path and not own and not path.endswith((".json", ".tmp"))


class GatedDeletes(ForwardingHandler):
    """A real filesystem whose deletes inside checkpoint directories wait for ``gate``
    (a store that is slow to delete); ``entered`` is set by the first one waiting."""

    def __init__(self, inner: pafs.FileSystem):
        super().__init__(inner)
        self.gate, self.entered = threading.Event(), threading.Event()

    def _wait(self, path: str) -> None:
        if _gated_path(path):
            self.entered.set()
            assert self.gate.wait(60), "the gate was never opened"

    def delete_dir(self, path: str) -> None:
        self._wait(path)
        self.inner.delete_dir(path)

    def delete_file(self, path: str) -> None:
        self._wait(path)
        self.inner.delete_file(path)


class GatedFSSpecMemory(MemoryFileSystem):
    """fsspec's memory filesystem whose deletes of checkpoint files wait for ``gate``
    (an fsspec filesystem passed in as it is)."""

    cachable = False
    gate = threading.Event()
    entered = threading.Event()

    def rm_file(self, path):  # noqa: ANN001, ANN201 - fsspec's signature
        if _gated_path(path):
            self.entered.set()
            assert self.gate.wait(60)
        return super().rm_file(path)

    def rm(self, path, recursive=False, maxdepth=None):  # noqa: ANN001, ANN201
        if _gated_path(path):
            self.entered.set()
            assert self.gate.wait(60)
        return super().rm(path, recursive=recursive, maxdepth=maxdepth)


def _source(tmp_path, n: int = 30) -> str:
    src = tmp_path / "src"
    for i in range(n):
        sub = src / f"shard{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.bin").write_bytes(os.urandom(256))
    return str(src)


def _gated(form: str, tmp_path):
    """``(session storage, gate, entered)`` for a gated store of ``form``."""
    if form == "pyarrow-local":
        handler = GatedDeletes(pafs.LocalFileSystem())
        # The local disk's own protocol (atomic rename): a Backend with its capabilities.
        backend = Backend(pafs.PyFileSystem(handler), scheme="file",
                          capabilities=LOCAL_CAPABILITIES, name="local")
        root = str(tmp_path / "runs")
        return StorageContext.from_backend(backend, root, "exp", "t"), handler.gate, \
            handler.entered
    if form == "pyarrow-memory":
        handler = GatedDeletes(wrap_fsspec(MemoryFileSystem()))
        backend = Backend(pafs.PyFileSystem(handler), scheme="memory",
                          capabilities=MEMORY_CAPABILITIES, name="memory")
        root = f"/gated-{uuid.uuid4().hex}"
        return StorageContext.from_backend(backend, root, "exp", "t"), handler.gate, \
            handler.entered
    assert form == "fsspec"
    GatedFSSpecMemory.gate, GatedFSSpecMemory.entered = threading.Event(), threading.Event()
    fs = GatedFSSpecMemory()
    storage = StorageContext(f"/gated-{uuid.uuid4().hex}", "exp", "t", storage_filesystem=fs)
    return storage, GatedFSSpecMemory.gate, GatedFSSpecMemory.entered


def _dirs(storage: StorageContext) -> list[str]:
    return sorted(n for _, n in storage.checkpoint_dirs())


@pytest.mark.parametrize("form", ["pyarrow-local", "pyarrow-memory", "fsspec"])
def test_a_stalled_delete_does_not_block_report(form, tmp_path):
    storage, gate, entered = _gated(form, tmp_path)
    src = Checkpoint.from_directory(_source(tmp_path))
    s = Session(storage, CheckpointConfig(num_to_keep=1))
    try:
        s.report({"step": 0}, checkpoint=src)
        s.report({"step": 1}, checkpoint=src)  # evicts checkpoint_000000
        assert entered.wait(30), "the eviction's delete never started"
        t0 = time.monotonic()
        s.report({"step": 2}, checkpoint=src)  # returns while that delete is stuck
        assert time.monotonic() - t0 < 30
        assert not gate.is_set()
        assert s.manager.kept_dir_names == ["checkpoint_000002"]
        assert sorted(s.manager.pending_deletes) == ["checkpoint_000000", "checkpoint_000001"]
        assert s.get_checkpoint().path.endswith("checkpoint_000002")
        # Mid-delete, the half-deleted directory never lists as committed, and
        # what does list verifies.
        committed = {c.path.rsplit("/", 1)[-1]: c for c, _ in storage.committed_checkpoints()}
        assert "checkpoint_000000" not in committed
        for c in committed.values():
            c.verify()
        with pytest.raises(TimeoutError, match="deletes of evicted checkpoints"):
            s.wait(timeout=0.2)
        gate.set()
        s.wait(timeout=60)
        assert s.manager.pending_deletes == []
        assert _dirs(storage) == ["checkpoint_000002"]
    finally:
        gate.set()
        s.close()
    # The state says so too: a new manager has nothing left to delete.
    with CheckpointManager(CheckpointConfig(num_to_keep=1), storage, read_only=True) as m:
        assert m.pending_deletes == [] and m.kept_dir_names == ["checkpoint_000002"]


def test_close_waits_for_the_background_deletes(tmp_path):
    storage, gate, entered = _gated("pyarrow-local", tmp_path)
    src = Checkpoint.from_directory(_source(tmp_path))
    s = Session(storage, CheckpointConfig(num_to_keep=1))
    s.report({"step": 0}, checkpoint=src)
    s.report({"step": 1}, checkpoint=src)
    assert entered.wait(30)
    closer = threading.Thread(target=s.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() returned before the delete it scheduled"
    gate.set()
    closer.join(60)
    assert not closer.is_alive()
    assert _dirs(storage) == ["checkpoint_000001"]


@pytest.mark.parametrize("form", ["uri", "pyarrow", "fsspec"])
def test_evicted_checkpoints_are_gone_after_wait(form, tmp_path):
    root = str(tmp_path / "runs")
    kwargs: dict = {"storage_path": root}
    if form == "pyarrow":
        kwargs["storage_filesystem"] = pafs.LocalFileSystem()
    elif form == "fsspec":
        kwargs = {"storage_path": f"/bg-{uuid.uuid4().hex}",
                  "storage_filesystem": fsspec.filesystem("memory")}
    src = Checkpoint.from_directory(_source(tmp_path, 12))
    with session.start(experiment_name="exp", trial_name="t",
                       checkpoint_config=CheckpointConfig(num_to_keep=2), **kwargs) as s:
        for step in range(5):
            s.report({"step": step}, checkpoint=src)
        s.wait()
        assert s.manager.pending_deletes == []
        storage = s.storage
        assert _dirs(storage) == ["checkpoint_000003", "checkpoint_000004"]
        assert s.manager._deleter is not None and s.manager._deleter.rounds >= 1


def test_a_failed_background_delete_is_logged_and_retried(tmp_path, caplog):
    class RefuseDeletes(ForwardingHandler):
        refuse = True

        def move(self, src: str, dest: str) -> None:
            if self.refuse and ".cs_deleting" in dest:
                raise PermissionError(f"injected: access denied ({src})")
            self.inner.move(src, dest)

    handler = RefuseDeletes(pafs.LocalFileSystem())
    backend = Backend(pafs.PyFileSystem(handler), scheme="file",
                      capabilities=LOCAL_CAPABILITIES, name="local")
    storage = StorageContext.from_backend(backend, str(tmp_path / "runs"), "exp", "t")
    src = Checkpoint.from_directory(_source(tmp_path, 6))
    s = Session(storage, CheckpointConfig(num_to_keep=1))
    try:
        s.report({"step": 0}, checkpoint=src)
        with caplog.at_level("WARNING"):
            s.report({"step": 1}, checkpoint=src)
            s.wait()  # a failed delete is never raised
        assert "could not delete checkpoint_000000" in caplog.text
        assert s.manager.pending_deletes == ["checkpoint_000000"]
        handler.refuse = False
        s.report({"step": 2}, checkpoint=src)  # the next registration retries
        s.wait()
        assert s.manager.pending_deletes == []
        assert _dirs(storage) == ["checkpoint_000002"]
    finally:
        s.close()


def _kill_mid_delete(storage_path: str, tmp_path, opts: dict | None = None,
                     env: dict | None = None) -> None:
    src = _source(tmp_path, 40)
    ready = str(tmp_path / "ready")
    args = [sys.executable, CHILD, storage_path, ready, src]
    if opts is not None:
        args.append(json.dumps(opts))
    child = subprocess.Popen(args, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            assert child.poll() is None, "the child ended before its delete was half done"
            assert time.monotonic() < deadline, "the child never reached the delete"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    storage = StorageContext(storage_path, "exp", "t", storage_options=opts)
    # Nothing half-deleted lists as a checkpoint: what lists, verifies.
    listed = storage.committed_checkpoints()
    for ckpt, _ in listed:
        ckpt.verify()
    names = [c.path.rsplit("/", 1)[-1] for c, _ in listed]
    assert "checkpoint_000000" not in names
    # What a reader (ls, the web page) is told: the newest only; the evictions pending.
    with CheckpointManager(CheckpointConfig(num_to_keep=1), storage, read_only=True) as m:
        assert m.kept_dir_names == ["checkpoint_000002"]
        assert set(m.pending_deletes) <= {"checkpoint_000000", "checkpoint_000001"}
    # The next session finishes the removal: pending deletes, the half-deleted rest.
    with session.start(storage_path=storage_path, storage_options=opts, experiment_name="exp",
                       trial_name="t", checkpoint_config=CheckpointConfig(num_to_keep=1)) as s:
        assert s.get_checkpoint().path.endswith("checkpoint_000002")
        s.get_checkpoint().verify()
        s.wait()
        assert s.manager.pending_deletes == []
    assert _dirs(storage) == ["checkpoint_000002"]
    found = storage.scan()
    assert found.uncommitted == [] and found.foreign == []
    trial_files = [fi.path for fi in storage.filesystem.get_file_info(
        pafs.FileSelector(storage.trial_path, recursive=True))]
    assert not [p for p in trial_files if ".cs_deleting" in p], trial_files


def test_a_kill_mid_delete_on_local_disk_is_finished_by_the_next_session(tmp_path):
    _kill_mid_delete(str(tmp_path / "runs"), tmp_path)


def test_a_kill_mid_delete_on_s3_is_finished_by_the_next_session(s3_location, tmp_path):
    _kill_mid_delete(s3_location.uri, tmp_path, dict(s3_location.storage_options),
                     dict(s3_location.env))
