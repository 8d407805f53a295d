"""A lease read while it is rewritten is not "no lease".

Stores show a small file torn while it is rewritten in place: pyarrow's S3,
GCS and Azure clients read the new version cut at the old length, its Azure
client makes the blob empty as it opens it for writing, and fsspec
filesystems over directories (``DirFileSystem``, sftp, webdav) write in
place. A second job's take-over that read such a lease as absent took the
trial from a live run.
"""

from __future__ import annotations

import os
import posixpath
import socket
import threading
import time

import pytest

from checkpoint_store import CheckpointConfig, CheckpointManager, StorageContext
from checkpoint_store._util import clock as _clock
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.liveness import process_token
from checkpoint_store.errors import TrialInUseError
from checkpoint_store.registry import resolve
from checkpoint_store.retention import LEASE_FILE
from checkpoint_store.retention.lease import Lease
from checkpoint_store.testing.faults import faulty_backend
from tests.stores import make_store, pyarrow_azure

#: Every form of store the suite builds cheaply: URIs of each backend, a
#: pyarrow AzureFileSystem passed in, an fsspec DirFileSystem passed in.
_KINDS = ["local", "memory", "s3", "azure", "gcs", "azure-pyarrow", "dirfs"]
#: Stores that record no modification times: an unreadable lease cannot age.
_NO_MTIMES = {"memory"}


def _backend(kind, request, tmp_path):
    if kind == "azure-pyarrow":
        fs = pyarrow_azure(request.getfixturevalue("azure_server"))
        return resolve(f"{request.getfixturevalue('azure_container')}/ckpt", filesystem=fs)
    if kind == "dirfs":
        return _dirfs(tmp_path)
    s = make_store(kind, request, tmp_path)
    return resolve(s.uri, storage_options=s.options or None)


def _dirfs(tmp_path):
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    (tmp_path / "dirfs").mkdir()
    return resolve("runs", filesystem=DirFileSystem(path=str(tmp_path / "dirfs"),
                                                    fs=LocalFileSystem()))


def _storage(backend, root) -> StorageContext:
    return StorageContext.from_backend(backend, root, "exp", "t")


@pytest.mark.parametrize("kind", _KINDS)
def test_a_live_lease_read_torn_refuses_the_second_job(kind, request, tmp_path):
    backend, root = _backend(kind, request, tmp_path)
    first = CheckpointManager(CheckpointConfig(1), _storage(backend, root))
    try:
        torn = faulty_backend(backend, torn_reads=LEASE_FILE, torn_read_count=2)
        with pytest.raises(TrialInUseError, match=f"pid {os.getpid()}"):
            CheckpointManager(CheckpointConfig(1), _storage(torn, root))
        assert torn.filesystem.handler.injected["torn"] == 2
        assert first._lease is not None and first._lease.check(), "the first job lost its lease"
    finally:
        first.close()


def _truncated_lease(storage: StorageContext) -> str:
    """A lease cut short, as a holder killed mid-write leaves it on a store
    that writes in place."""
    storage.ensure_trial_dir()
    path = posixpath.join(storage.trial_path, LEASE_FILE)
    with storage.filesystem.open_output_stream(path) as f:
        f.write(b'{"kind": "checkpoint_manager_lease", "format_version": 1, "hol')
    return path


@pytest.mark.parametrize("kind", _KINDS)
def test_a_lease_left_cut_short_is_live_for_a_ttl_then_taken_over(kind, request, tmp_path,
                                                                  monkeypatch):
    backend, root = _backend(kind, request, tmp_path)
    path = _truncated_lease(_storage(backend, root))
    with pytest.raises(TrialInUseError, match="cannot be read as a lease") as info:
        CheckpointManager(CheckpointConfig(1), _storage(backend, root), lease_ttl_s=30.0)
    assert "delete the file if no run holds this trial" in str(info.value)
    assert _fsutil.exists(backend.filesystem, path), "a refused acquire deleted the lease"
    # The ttl passes on the storage's clock (its seam), not by sleeping.
    real = _clock.storage_now
    monkeypatch.setattr(_clock, "storage_now", lambda *a, **k: (real(*a, **k) or 0.0) + 40.0)
    monkeypatch.setattr(_clock, "local_time", lambda: time.time() + 40.0)
    if kind in _NO_MTIMES:
        with pytest.raises(TrialInUseError, match="cannot be read as a lease"):
            CheckpointManager(CheckpointConfig(1), _storage(backend, root), lease_ttl_s=30.0)
        return
    with CheckpointManager(CheckpointConfig(1), _storage(backend, root),
                           lease_ttl_s=30.0) as m:
        assert not m.read_only


def test_live_lease_counts_a_young_unreadable_lease_as_live(tmp_path):
    from checkpoint_store.retention import live_lease

    backend, root = resolve(str(tmp_path / "runs"))
    storage = _storage(backend, root)
    _truncated_lease(storage)
    got = live_lease(storage)
    assert got is not None and got["expires_at"] > time.time() + 30


def _live_body(storage: StorageContext, pad: int) -> bytes:
    from checkpoint_store._format import jsonrules as _json

    now = time.time()
    return _json.dumps({
        "kind": "checkpoint_manager_lease", "holder": "the-other-job",
        "host": socket.gethostname(), "pid": os.getpid(), "proc": process_token(),
        "trial": storage.canonical_uri(storage.trial_path), "ttl_s": 60.0,
        "renewed_at": now, "expires_at": now + 60.0, "pad": "x" * pad,
    })


def test_a_lease_rewritten_in_place_beside_a_reader_always_reads_live(tmp_path):
    """No fault layer: fsspec's DirFileSystem over a local folder writes in
    place, so the reader meets the lease empty or half written."""
    backend, root = _dirfs(tmp_path)
    storage = _storage(backend, root)
    storage.ensure_trial_dir()
    path = posixpath.join(storage.trial_path, LEASE_FILE)
    body = _live_body(storage, pad=256 * 1024)
    _fsutil.write_bytes(backend.filesystem, path, body, backend.capabilities)
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            _fsutil.write_bytes(backend.filesystem, path, body, backend.capabilities,
                                fsync=False)
            time.sleep(0.002)

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    reader = Lease(storage, ttl_s=60.0)
    misses = reads = 0
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            reads += 1
            if reader._live_other() is None:
                misses += 1
    finally:
        stop.set()
        writer.join(timeout=10)
    assert misses == 0, f"{misses} of {reads} reads saw no live lease"
