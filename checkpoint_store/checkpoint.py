"""The Checkpoint: a directory on some filesystem, plus its two metadata files.

A :class:`Checkpoint` is only a reference, ``(filesystem, path)``; creating
one copies nothing. It reads and writes the user's ``.user_metadata.json``,
exposes our ``.internal_metadata.json`` read-only, and downloads the user's
files. Same surface as Ray Train's ``ray.train.Checkpoint``.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
import types
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store import _fsutil, _json
from checkpoint_store._layout import USER_METADATA
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import CheckpointNotFoundError, InvalidConfigError
from checkpoint_store.registry import resolve
from checkpoint_store.transfer import download_tree, read_internal_metadata


class Checkpoint:
    """A reference to a checkpoint directory on any storage.

    Args:
        path: a local path, a URI (``s3://bucket/run/checkpoint_000003``), or
            with ``filesystem`` a path inside that filesystem.
        filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem; every
            I/O of this checkpoint then goes through it.
        storage_options: backend options for a URI (endpoint, credentials).

    Raises:
        InvalidConfigError, UnknownSchemeError, BackendUnavailableError: the
            location cannot be resolved (see :func:`checkpoint_store.registry.resolve`).

    Nothing is checked on storage at construction: use :meth:`from_directory`
    for a local directory that must exist.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        filesystem: Any = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
    ):
        backend, fs_path = resolve(path, filesystem=filesystem, storage_options=storage_options)
        self._backend = backend
        self.path: str = fs_path

    @classmethod
    def _from_backend(cls, backend: Backend, path: str) -> Checkpoint:
        self = cls.__new__(cls)
        self._backend = backend
        self.path = path
        return self

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """A checkpoint of an existing local directory (not copied).

        Raises:
            CheckpointNotFoundError: ``path`` is not an existing directory.
        """
        local = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if not os.path.isdir(local):
            raise CheckpointNotFoundError(
                f"{local!r} is not an existing directory; create it and write your "
                "checkpoint files into it first"
            )
        return cls(local)

    # -- identity -------------------------------------------------------------

    @property
    def filesystem(self) -> pafs.FileSystem:
        """The ``pyarrow.fs.FileSystem`` every I/O of this checkpoint goes through."""
        return self._backend.filesystem

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def uri(self) -> str:
        """A URI for this checkpoint (``file:///...``, ``s3://...``)."""
        return self._backend.uri_for(self.path)

    @property
    def is_local(self) -> bool:
        """True when the checkpoint is on this machine's disk."""
        return _fsutil.local_path(self.filesystem, self.path) is not None

    def __repr__(self) -> str:
        return f"Checkpoint(filesystem={self.filesystem.type_name}, path={self.path})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Checkpoint):
            return NotImplemented
        return self.path == other.path and self.filesystem.equals(other.filesystem)

    def __hash__(self) -> int:
        return hash((self.filesystem.type_name, self.path))

    def __fspath__(self) -> str:
        raise TypeError(
            "a Checkpoint is not a local path (it may live on remote storage); use "
            "checkpoint.to_directory() to get a local copy, or "
            "`with checkpoint.as_directory() as d:` for a temporary one"
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"backend": self._backend, "path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._backend = state["backend"]
        self.path = state["path"]

    # -- metadata -------------------------------------------------------------

    def get_metadata(self) -> dict[str, Any]:
        """The user metadata dict (``{}`` when none was set).

        Raises:
            CheckpointCorruptError: the file exists but is not a JSON object.
        """
        path = posixpath.join(self.path, USER_METADATA)
        try:
            raw = _fsutil.read_bytes(self.filesystem, path)
        except FileNotFoundError:
            return {}
        except OSError:
            if not _fsutil.exists(self.filesystem, path):
                return {}
            raise
        try:
            value = _json.loads(raw)
        except ValueError as exc:
            from checkpoint_store.errors import CheckpointCorruptError

            raise CheckpointCorruptError(
                f"{self.uri}/{USER_METADATA} is not valid JSON ({exc})",
                path=self.path, file=USER_METADATA,
            ) from None
        return value if isinstance(value, dict) else {}

    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Replace the user metadata with ``metadata`` (a JSON object).

        Raises:
            MetadataError: not a dict, or a value is not JSON-serialisable
                (the message names the key); the stored file is unchanged.
        """
        data = _json.dumps(_json.to_json_object(metadata, "metadata"))
        _fsutil.write_bytes(
            self.filesystem, posixpath.join(self.path, USER_METADATA), data,
            self._backend.capabilities,
        )

    def update_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Merge ``metadata`` into the user metadata (top-level keys replaced).

        Raises:
            MetadataError: as :meth:`set_metadata`; the stored file is unchanged.
        """
        update = _json.to_json_object(metadata, "metadata")
        merged = self.get_metadata()
        merged.update(update)
        self.set_metadata(merged)

    @property
    def internal_metadata(self) -> Mapping[str, Any]:
        """Our ``.internal_metadata.json`` as a read-only mapping.

        Keys: ``format_version``, ``index``, ``metrics``, ``created_at`` (Unix
        seconds), ``manifest`` (list of ``{path, size, crc32c}``), and the
        trial/run fields described in docs/format.md. Empty when the directory
        is not a committed checkpoint (e.g. a local directory not yet reported).
        """
        meta = read_internal_metadata(self.filesystem, self.path)
        return types.MappingProxyType(meta or {})

    @property
    def is_committed(self) -> bool:
        """True when ``.internal_metadata.json`` is present and valid."""
        return read_internal_metadata(self.filesystem, self.path) is not None

    # -- data -----------------------------------------------------------------

    def to_directory(self, path: str | os.PathLike[str] | None = None, *, verify: bool = True) -> str:
        """Copy the user's files and ``.user_metadata.json`` into a local directory.

        Args:
            path: target directory (created if needed); a new temporary
                directory when None.
            verify: check each file's size and CRC32C against the manifest of
                a committed checkpoint.

        Returns:
            The local directory path.

        Raises:
            CheckpointNotFoundError: the checkpoint directory does not exist.
            CheckpointCorruptError: ``verify`` and a file fails its check.
        """
        target = (
            tempfile.mkdtemp(prefix="checkpoint-")
            if path is None
            else os.path.abspath(os.path.expanduser(os.fspath(path)))
        )
        if not _fsutil.is_dir(self.filesystem, self.path):
            raise CheckpointNotFoundError(f"checkpoint {self.uri} does not exist")
        meta = read_internal_metadata(self.filesystem, self.path)
        manifest = meta["manifest"] if meta else None
        download_tree(
            self.filesystem, self.path, self._backend.capabilities, target,
            manifest=manifest, verify=verify,
        )
        return target

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """Yield a local directory holding the checkpoint's files.

        A local checkpoint yields its own directory: read it, never write to
        it. A remote one is downloaded into a temporary directory that is
        removed when the block exits, also when it raises.
        """
        local = _fsutil.local_path(self.filesystem, self.path)
        if local is not None:
            if not os.path.isdir(local):
                raise CheckpointNotFoundError(f"checkpoint {self.uri} does not exist")
            yield local
            return
        tmp = tempfile.mkdtemp(prefix="checkpoint-")
        try:
            self.to_directory(tmp)
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _require_checkpoint(value: Any) -> Checkpoint:
    if not isinstance(value, Checkpoint):
        raise InvalidConfigError(
            f"expected a checkpoint_store.Checkpoint, got {type(value).__name__}; "
            "build one with Checkpoint.from_directory(path)"
        )
    return value
