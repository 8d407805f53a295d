"""upload_mode="async": report() stages and returns, uploads run in the
background in report order, with backpressure, and errors surface later.

Real files, real local storage (and a moto S3 bucket); slowness and failures
come from checkpoint_store.testing.faults wrapped around the real local disk.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext
from checkpoint_store.backends.local import local_backend
from checkpoint_store.errors import CheckpointStoreError, InvalidConfigError
from checkpoint_store.session import Session
from checkpoint_store.testing import session_internals
from checkpoint_store.testing.faults import FaultPlan, faulty_backend


def _write_ckpt(d: str, i: int) -> dict[str, bytes]:
    files = {"model.bin": bytes([i % 256]) * (100_000 + i), "sub/opt.bin": os.urandom(5000)}
    for rel, data in files.items():
        p = os.path.join(d, *rel.split("/"))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
    return files


def _read_back(ckpt: Checkpoint, tmp: str) -> dict[str, bytes]:
    out = ckpt.to_directory(tmp)
    got = {}
    for dirpath, _, names in os.walk(out):
        for n in names:
            p = os.path.join(dirpath, n)
            got[os.path.relpath(p, out).replace(os.sep, "/")] = open(p, "rb").read()
    return got


def _observer(root: str) -> StorageContext:
    """A second view of the same trial, without injected faults."""
    return StorageContext(root, "exp", "t")


def _indices(storage: StorageContext) -> list[int]:
    return [meta["index"] for _, meta in storage.committed_checkpoints()]


def _slow_session(root: str, latency: float = 0.03, **config) -> Session:
    backend = faulty_backend(local_backend("file://", {}), FaultPlan(latency=latency))
    storage = StorageContext.from_backend(backend, root, "exp", "t")
    return Session(storage, CheckpointConfig(upload_mode="async", **config))


def test_temporary_directory_deleted_right_after_report_is_uploaded(tmp_path) -> None:
    root = str(tmp_path / "store")
    s = Session(StorageContext(root, "exp", "t"), CheckpointConfig(upload_mode="async"))
    written = []
    for i in range(3):
        with tempfile.TemporaryDirectory() as d:
            written.append(_write_ckpt(d, i))
            row = s.report({"step": i}, checkpoint=Checkpoint.from_directory(d))
            assert row["checkpoint_dir_name"] == f"checkpoint_{i:06d}"
        assert not os.path.exists(d)
    s.wait()
    committed = s.storage.committed_checkpoints()
    assert [m["index"] for _, m in committed] == [0, 1, 2]
    for (ckpt, meta), want in zip(committed, written, strict=True):
        assert _read_back(ckpt, str(tmp_path / f"dl{meta['index']}")) == want
        assert meta["metrics"]["step"] == meta["index"]
    s.close()
    # No staged copy is left behind.
    assert session_internals(s).uploader is not None
    assert session_internals(s).uploader.pending == 0


@pytest.mark.slow
def test_async_upload_to_s3_from_a_deleted_temporary_directory(tmp_path, s3_location) -> None:
    storage = StorageContext(s3_location.uri, "exp", "t",
                             storage_options=s3_location.storage_options)
    s = Session(storage, CheckpointConfig(upload_mode="async", num_to_keep=2))
    written = {}
    for i in range(3):
        with tempfile.TemporaryDirectory() as d:
            written[i] = _write_ckpt(d, i)
            s.report({"step": i}, checkpoint=Checkpoint.from_directory(d))
    s.close()  # the end of the session waits for the uploads
    committed = storage.committed_checkpoints()
    assert [m["index"] for _, m in committed] == [1, 2]
    for ckpt, meta in committed:
        assert _read_back(ckpt, str(tmp_path / f"dl{meta['index']}")) == written[meta["index"]]


def test_report_blocks_while_max_pending_uploads_are_pending(tmp_path) -> None:
    root = str(tmp_path / "store")
    s = _slow_session(root, latency=0.05, max_pending_uploads=1)
    obs = _observer(root)
    with tempfile.TemporaryDirectory() as d:
        _write_ckpt(d, 0)
        t0 = time.perf_counter()
        s.report({"step": 0}, checkpoint=Checkpoint.from_directory(d))
        first = time.perf_counter() - t0
    # report() returned while the upload (many slow storage calls) still runs.
    assert session_internals(s).uploader.pending == 1
    assert _indices(obs) == []
    with tempfile.TemporaryDirectory() as d:
        _write_ckpt(d, 1)
        s.report({"step": 1}, checkpoint=Checkpoint.from_directory(d))
    # The second report had to wait for the first upload to commit.
    assert _indices(obs) == [0]
    assert session_internals(s).uploader.blocked_s > 0
    assert first < session_internals(s).uploader.blocked_s + 5  # sanity: the first did not block
    s.wait()
    assert _indices(obs) == [0, 1]
    s.close()


def test_commits_follow_report_order_and_retention_always_keeps_one(tmp_path) -> None:
    root = str(tmp_path / "store")
    s = _slow_session(root, latency=0.01, max_pending_uploads=3, num_to_keep=1)
    obs = _observer(root)
    seen: list[list[int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(_indices(obs))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(5):
            with tempfile.TemporaryDirectory() as d:
                _write_ckpt(d, i)
                s.report({"step": i}, checkpoint=Checkpoint.from_directory(d))
        s.wait()
    finally:
        stop.set()
        watcher.join()
    s.close()
    assert _indices(obs) == [4]
    metas = [m for _, m in s.storage.committed_checkpoints()]
    assert metas[0]["metrics"]["step"] == 4
    # Once a checkpoint was committed, one always existed; the newest
    # committed index never went backwards (commits in report order).
    first = next(i for i, v in enumerate(seen) if v)
    assert all(v for v in seen[first:]), seen
    newest = [max(v) for v in seen[first:]]
    assert newest == sorted(newest)
    assert set(newest) <= {0, 1, 2, 3, 4}


def test_upload_error_is_raised_at_the_next_report_then_cleared(tmp_path) -> None:
    root = str(tmp_path / "store")
    plan = FaultPlan(permanent={"write": "no_space"}, path_contains="checkpoint_000001")
    backend = faulty_backend(local_backend("file://", {}), plan)
    s = Session(StorageContext.from_backend(backend, root, "exp", "t"),
                CheckpointConfig(upload_mode="async"))
    for i in range(2):
        with tempfile.TemporaryDirectory() as d:
            _write_ckpt(d, i)
            s.report({"step": i}, checkpoint=Checkpoint.from_directory(d))
    session_internals(s).uploader.wait()  # let the failing upload finish, without raising
    with pytest.raises(OSError, match="No space left"):
        s.report({"step": 2})
    # Raised once; the session goes on.
    s.report({"step": 3})
    with tempfile.TemporaryDirectory() as d:
        _write_ckpt(d, 4)
        row = s.report({"step": 4}, checkpoint=Checkpoint.from_directory(d))
    s.wait()
    s.close()
    assert row["checkpoint_dir_name"] == "checkpoint_000002"
    assert _indices(_observer(root)) == [0, 2]


def test_upload_error_is_raised_by_wait_and_at_session_end(tmp_path) -> None:
    root = str(tmp_path / "store")
    plan = FaultPlan(permanent={"write": "access_denied"}, path_contains="checkpoint_")
    backend = faulty_backend(local_backend("file://", {}), plan)
    s = Session(StorageContext.from_backend(backend, root, "exp", "t"),
                CheckpointConfig(upload_mode="async"))
    with tempfile.TemporaryDirectory() as d:
        _write_ckpt(d, 0)
        s.report({"step": 0}, checkpoint=Checkpoint.from_directory(d))
    with pytest.raises((OSError, CheckpointStoreError), match="ACCESS_DENIED"):
        s.wait()
    with tempfile.TemporaryDirectory() as d:
        _write_ckpt(d, 1)
        s.report({"step": 1}, checkpoint=Checkpoint.from_directory(d))
    with pytest.raises((OSError, CheckpointStoreError), match="ACCESS_DENIED"):
        s.close()
    assert _indices(_observer(root)) == []


def test_sync_report_after_async_ones_commits_after_them(tmp_path) -> None:
    root = str(tmp_path / "store")
    s = _slow_session(root, latency=0.02, max_pending_uploads=2)
    with tempfile.TemporaryDirectory() as d:
        _write_ckpt(d, 0)
        s.report({"step": 0}, checkpoint=Checkpoint.from_directory(d))
        _write_ckpt(d, 1)
        s.report({"step": 1}, checkpoint=Checkpoint.from_directory(d), upload_mode="sync")
    # Returned after its own commit, and the earlier async one came first.
    metas = [m for _, m in s.storage.committed_checkpoints()]
    assert [m["index"] for m in metas] == [0, 1]
    assert metas[0]["created_at"] <= metas[1]["created_at"]
    s.close()


@pytest.mark.parametrize("staging", ["hardlink", "move"])
def test_hardlink_and_move_staging(tmp_path, staging) -> None:
    root = str(tmp_path / "store")
    s = Session(StorageContext(root, "exp", "t"),
                CheckpointConfig(upload_mode="async", staging=staging))
    src = tmp_path / "ckpt"
    src.mkdir()
    want = _write_ckpt(str(src), 7)
    s.report({"step": 0}, checkpoint=Checkpoint.from_directory(str(src)))
    if staging == "move":
        assert src.is_dir() and list(src.iterdir()) == []  # emptied, not removed
    else:
        assert (src / "model.bin").read_bytes() == want["model.bin"]
    s.wait()
    (ckpt, _), = s.storage.committed_checkpoints()
    assert _read_back(ckpt, str(tmp_path / "dl")) == want
    s.close()


def test_invalid_async_settings_are_refused() -> None:
    with pytest.raises(InvalidConfigError, match="upload_mode"):
        CheckpointConfig(upload_mode="later")
    with pytest.raises(InvalidConfigError, match="max_pending_uploads"):
        CheckpointConfig(upload_mode="async", max_pending_uploads=0)
    with pytest.raises(InvalidConfigError, match="staging"):
        CheckpointConfig(staging="symlink")


def test_per_report_upload_mode_is_checked(tmp_path) -> None:
    s = Session(StorageContext(str(tmp_path / "store"), "exp", "t"))
    d = tmp_path / "c"
    d.mkdir()
    (d / "x").write_bytes(b"x")
    with pytest.raises(InvalidConfigError, match="upload_mode"):
        s.report({"a": 1}, checkpoint=Checkpoint.from_directory(str(d)), upload_mode="fast")
    with pytest.raises(InvalidConfigError, match="staging"):
        s.report({"a": 1}, checkpoint=Checkpoint.from_directory(str(d)), upload_mode="async",
                 staging="symlink")
    assert s.storage.committed_checkpoints() == []
    s.close()
