"""The backend as a filesystem: the factory's result, secrets kept out of
every repr, plain writes, reads, listings and deletes, and that each
declared :class:`~checkpoint_store.backends.Capabilities` flag holds, also
from many threads at once."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from checkpoint_store._util import fs as _fsutil
from checkpoint_store.backends.base import Backend, Capabilities
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import CheckpointNotFoundError
from checkpoint_store.testing.conformance._base import BackendFixtures
from checkpoint_store.testing.servers import StorageLocation

__all__ = ["FilesystemTests"]

_SECRET_HINTS = ("secret", "key", "token", "password", "sas", "connection_string", "credential")


def _secret_values(options: Mapping[str, Any]) -> list[str]:
    found = []
    for k, v in options.items():
        if isinstance(v, str) and len(v) >= 6 and any(h in k.lower() for h in _SECRET_HINTS):
            found.append(v)
    return found


class FilesystemTests(BackendFixtures):
    """The backend object, plain filesystem operations and declared capabilities."""

    # -- the backend object --------------------------------------------------------------

    def test_factory_returns_a_backend(self, backend: Backend, root: str) -> None:
        assert isinstance(backend, Backend)
        assert isinstance(backend.filesystem, pafs.FileSystem)
        assert isinstance(backend.capabilities, Capabilities)
        assert backend.capabilities.chunk_size > 0
        assert backend.capabilities.concurrency >= 1
        assert root and not root.endswith("/")

    def test_repr_hides_secrets(self, backend: Backend, storage_location: StorageLocation,
                                tmp_path: Path) -> None:
        secrets = _secret_values(storage_location.storage_options)
        ctx = self._context(storage_location)
        ckpt = ctx.persist_checkpoint(
            Checkpoint.from_directory(self._src(tmp_path, {"a.txt": 3})), 0, {}
        )
        for text in (repr(backend), str(backend), repr(ctx), repr(ckpt), ckpt.uri,
                     repr(storage_location)):
            for secret in secrets:
                assert secret not in text

    # -- plain filesystem operations ---------------------------------------------------------

    def test_write_read_overwrite(self, backend: Backend, root: str) -> None:
        fs, caps = backend.filesystem, backend.capabilities
        path = posixpath.join(root, "dir", "file.bin")
        _fsutil.write_bytes(fs, path, b"first", caps)
        assert _fsutil.read_bytes(fs, path) == b"first"
        _fsutil.write_bytes(fs, path, b"second, longer", caps)
        assert _fsutil.read_bytes(fs, path) == b"second, longer"
        info = fs.get_file_info(path)
        assert info.type == pafs.FileType.File
        assert info.size == len(b"second, longer")

    def test_listing(self, backend: Backend, root: str) -> None:
        fs, caps = backend.filesystem, backend.capabilities
        for rel in ("top/a.txt", "top/sub/b.txt", "top/sub/deeper/c.txt"):
            _fsutil.write_bytes(fs, posixpath.join(root, rel), rel.encode(), caps)
        top = posixpath.join(root, "top")
        children = {
            posixpath.basename(fi.path.rstrip("/")): fi.type for fi in _fsutil.list_dir(fs, top)
        }
        assert children == {"a.txt": pafs.FileType.File, "sub": pafs.FileType.Directory}
        assert dict(_fsutil.walk_files(fs, top)) == {
            "a.txt": len("top/a.txt"),
            "sub/b.txt": len("top/sub/b.txt"),
            "sub/deeper/c.txt": len("top/sub/deeper/c.txt"),
        }
        assert _fsutil.is_dir(fs, posixpath.join(top, "sub"))
        assert _fsutil.list_dir(fs, posixpath.join(root, "absent")) == []

    def test_not_found(self, backend: Backend, root: str,
                       storage_location: StorageLocation) -> None:
        fs = backend.filesystem
        missing = posixpath.join(root, "nope", "missing.bin")
        assert fs.get_file_info(missing).type == pafs.FileType.NotFound
        with pytest.raises((FileNotFoundError, OSError)):
            _fsutil.read_bytes(fs, missing)
        ckpt = Checkpoint(storage_location.uri.rstrip("/") + "/checkpoint_000042",
                          storage_options=dict(storage_location.storage_options))
        assert not ckpt.is_committed
        assert ckpt.internal_metadata == {}
        with pytest.raises(CheckpointNotFoundError):
            ckpt.to_directory()

    def test_delete_is_idempotent(self, backend: Backend, root: str) -> None:
        fs, caps = backend.filesystem, backend.capabilities
        f = posixpath.join(root, "d", "x.bin")
        _fsutil.write_bytes(fs, f, b"x", caps)
        _fsutil.write_bytes(fs, posixpath.join(root, "d", "sub", "y.bin"), b"y", caps)
        _fsutil.delete_file(fs, f)
        _fsutil.delete_file(fs, f)
        assert not _fsutil.exists(fs, f)
        d = posixpath.join(root, "d")
        _fsutil.delete_dir(fs, d)
        _fsutil.delete_dir(fs, d)
        assert dict(_fsutil.walk_files(fs, d)) == {}
        _fsutil.delete_dir(fs, posixpath.join(root, "never-existed"))

    # -- capabilities -------------------------------------------------------------------

    def test_declared_capabilities_hold(self, backend: Backend, root: str) -> None:
        fs, caps = backend.filesystem, backend.capabilities
        a = posixpath.join(root, "cap", "a")
        _fsutil.write_bytes(fs, posixpath.join(a, "f.bin"), b"payload", caps)
        if caps.strong_listing:
            names = [posixpath.basename(fi.path) for fi in _fsutil.list_dir(fs, a)]
            assert names == ["f.bin"]
        if caps.server_side_copy:
            fs.copy_file(posixpath.join(a, "f.bin"), posixpath.join(a, "g.bin"))
            assert _fsutil.read_bytes(fs, posixpath.join(a, "g.bin")) == b"payload"
        if caps.atomic_rename:
            b = posixpath.join(root, "cap", "b")
            fs.move(a, b)
            assert not _fsutil.exists(fs, a)
            assert _fsutil.read_bytes(fs, posixpath.join(b, "f.bin")) == b"payload"
            # Renaming onto a non-empty directory must fail, never merge or replace:
            # that is what makes rename-into-place a safe commit.
            c = posixpath.join(root, "cap", "c")
            _fsutil.write_bytes(fs, posixpath.join(c, "other.bin"), b"other", caps)
            with pytest.raises(OSError):
                fs.move(b, c)
            assert _fsutil.read_bytes(fs, posixpath.join(c, "other.bin")) == b"other"
        if caps.directories:
            d = posixpath.join(root, "cap", "empty-dir")
            fs.create_dir(d, recursive=True)
            assert _fsutil.is_dir(fs, d)

    def test_concurrent_use_from_threads(self, backend: Backend, root: str) -> None:
        """Transfers share one filesystem object across ``capabilities.concurrency``
        threads: concurrent writes, reads and listings must not interfere."""
        fs, caps = backend.filesystem, backend.capabilities
        workers = max(2, min(caps.concurrency, 8))
        payloads = {f"t/{i:02d}/f.bin": bytes([i]) * (1000 + i) for i in range(2 * workers)}

        def put(item: tuple[str, bytes]) -> None:
            _fsutil.write_bytes(fs, posixpath.join(root, item[0]), item[1], caps)

        def get(rel: str) -> bytes:
            return _fsutil.read_bytes(fs, posixpath.join(root, rel))

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(put, payloads.items()))
            got = dict(zip(payloads, pool.map(get, payloads), strict=True))
        assert got == payloads
        assert dict(_fsutil.walk_files(fs, posixpath.join(root, "t"))) == {
            rel[2:]: len(data) for rel, data in payloads.items()
        }
        if caps.strong_listing:
            victim = posixpath.join(root, "t", "00")
            _fsutil.delete_dir(fs, victim)
            names = {posixpath.basename(fi.path.rstrip("/"))
                     for fi in _fsutil.list_dir(fs, posixpath.join(root, "t"))}
            assert "00" not in names and "01" in names
