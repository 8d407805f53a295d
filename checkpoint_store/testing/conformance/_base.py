"""What every conformance check stands on: the fixtures a plugin provides or
inherits (:class:`BackendFixtures`) and the sample trees the checks upload
(:data:`SAMPLE_TREE`, :func:`make_tree`, :func:`read_tree`)."""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from checkpoint_store.backends.base import Backend
from checkpoint_store.registry import local_path_from_uri, resolve
from checkpoint_store.storage import StorageContext
from checkpoint_store.testing.servers import StorageLocation

__all__ = ["SAMPLE_TREE", "BackendFixtures", "make_tree", "read_tree"]

_MiB = 1024 * 1024

# Relative path -> size in bytes (contents are seeded pseudo-random bytes).
SAMPLE_TREE: dict[str, int] = {
    "model.bin": 3 * _MiB + 17,  # several transfer chunks on small-chunk backends
    "empty.txt": 0,
    "nested/deeper/optim.pt": 4096,
    "nested/zero.bin": 0,
    "with space/ünïcödé 名前.txt": 33,
    "pct%41 #hash.txt": 5,
}


def make_tree(root: str | os.PathLike[str], spec: Mapping[str, int] = SAMPLE_TREE,
              seed: int = 0) -> dict[str, bytes]:
    """Write ``spec`` (relative path -> size) under ``root``; return path -> bytes."""
    rng = random.Random(seed)
    out: dict[str, bytes] = {}
    for rel, size in spec.items():
        data = rng.randbytes(size)
        path = Path(root, *rel.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        out[rel] = data
    return out


def read_tree(root: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every file under local ``root`` as relative posix path -> bytes."""
    out: dict[str, bytes] = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, root).replace(os.sep, "/")] = Path(full).read_bytes()
    return out


class BackendFixtures:
    """The fixtures and helpers every topic of the suite uses.

    Fixtures a subclass provides:
        storage_location: a fresh, empty :class:`StorageLocation` per test (required).
        raw_objects: ``() -> {path: size}`` listing the store behind the
            backend's back, or None (the default) to skip those checks.
        raw_placeholder: ``(directory path) -> None`` writing another tool's
            directory placeholder behind the backend's back.
        raw_object: ``(path, data) -> None`` writing an object behind the
            backend's back.
    """

    @pytest.fixture
    def storage_location(self) -> StorageLocation:
        raise NotImplementedError(
            "subclasses of BackendTests must define a `storage_location` fixture"
        )

    @pytest.fixture
    def raw_objects(self) -> Callable[[], Mapping[str, int]] | None:
        return None

    @pytest.fixture
    def raw_placeholder(self, backend: Backend) -> Callable[[str], None] | None:
        """``(directory path) -> None``: mark a directory the way other tools
        do on this store, behind the backend's back (S3 and GCS: an empty
        ``path/`` object; Azure: a zero-byte blob ``path`` with metadata
        ``hdi_isfolder=true``). By default, on a store with real
        directories, an empty directory; else None (those checks skip)."""
        if not backend.capabilities.directories:
            return None
        return lambda path: backend.filesystem.create_dir(path, recursive=True)

    @pytest.fixture
    def raw_object(self) -> Callable[[str, bytes], None] | None:
        """``(path, data) -> None``: write an object behind the backend's back,
        also where ``path/...`` already holds objects (a key both an object
        and a prefix); None (the default) skips those checks."""
        return None

    @pytest.fixture
    def resolved(self, storage_location: StorageLocation) -> tuple[Backend, str]:
        return resolve(storage_location.uri, storage_options=dict(storage_location.storage_options))

    @pytest.fixture
    def backend(self, resolved: tuple[Backend, str]) -> Backend:
        return resolved[0]

    @pytest.fixture(autouse=True)
    def _declared_unstorable(self, backend: Backend) -> None:
        # Names holding these are checked for refusal, and left out elsewhere.
        self._unstorable = set(backend.capabilities.unsupported_name_characters)

    def _storable(self, name: str) -> str:
        """``name`` without the characters the backend declares it cannot store."""
        return "".join(c for c in name if c not in self._unstorable)

    @pytest.fixture
    def root(self, resolved: tuple[Backend, str]) -> str:
        return resolved[1]

    @staticmethod
    def _base_uri(loc: StorageLocation) -> str:
        """The URI the store prints for ``loc``: a plain local path becomes ``file://``,
        with ``%`` escaped as ``%25`` (file URIs are percent-decoded when read back)."""
        if loc.uri.startswith(("file://", "local://")):
            path = local_path_from_uri(loc.uri)
        elif "://" in loc.uri:
            return loc.uri.rstrip("/")
        else:
            path = os.path.abspath(loc.uri)
        return "file://" + path.rstrip("/").replace("%", "%25")

    def _context(self, loc: StorageLocation, uri: str | None = None,
                 trial: str = "trial") -> StorageContext:
        return StorageContext(uri or loc.uri, "exp", trial,
                              storage_options=dict(loc.storage_options))


    def _src(self, tmp_path: Path, spec: Mapping[str, int] = SAMPLE_TREE,
             name: str = "src") -> str:
        src = tmp_path / f"{name}-{uuid.uuid4().hex[:6]}"
        make_tree(src, {rel: size for rel, size in spec.items()
                        if not set(rel) & self._unstorable})
        return str(src)
