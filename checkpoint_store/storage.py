"""Where a trial's files live: ``<storage_path>/<experiment>/<trial>/``.

:class:`StorageContext` turns the user's ``storage_path`` (plus an optional
filesystem instance or storage options) into a backend and owns the layout
documented in docs/format.md. It persists local checkpoints into the trial
directory and lists the committed ones. It knows nothing of scores or
sessions.
"""

from __future__ import annotations

import os
import posixpath
import time
from collections.abc import Mapping
from typing import Any

from checkpoint_store import _fsutil, _json
from checkpoint_store._layout import (
    PARAMS_FILE,
    RESULT_FILE,
    checkpoint_dir_name,
    parse_checkpoint_dir_name,
    validate_component,
)
from checkpoint_store.backends.base import Backend
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.registry import resolve
from checkpoint_store.transfer import commit_checkpoint, read_internal_metadata


class StorageContext:
    """Resolves ``storage_path`` and owns the experiment/trial layout.

    Args:
        storage_path: local path (relative paths made absolute, ``~``
            expanded) or URI (``file://``, ``memory://``, ``s3://`` ...). With
            ``storage_filesystem``, a path inside that filesystem, used as given
            apart from a trailing ``/``.
        experiment_name, trial_name: one path component each (no ``/``,
            ``\\``, ``.`` or ``..``).
        storage_filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem
            used for every I/O instead of resolving the URI.
        storage_options: options for the backend factory (credentials ...).
        fsync: on local disks, fsync before each commit (default True);
            turning it off trades crash durability for speed.

    Raises:
        InvalidConfigError: bad names or location. Nothing is written at
            construction.
    """

    def __init__(
        self,
        storage_path: str | os.PathLike[str],
        experiment_name: str,
        trial_name: str,
        *,
        storage_filesystem: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        fsync: bool = True,
    ):
        self.experiment_name = validate_component(experiment_name, "experiment_name")
        self.trial_name = validate_component(trial_name, "trial_name")
        self.backend, self.storage_path = resolve(
            storage_path, filesystem=storage_filesystem, storage_options=storage_options
        )
        self.fsync = fsync

    @classmethod
    def from_backend(
        cls, backend: Backend, storage_path: str, experiment_name: str, trial_name: str,
        *, fsync: bool = True,
    ) -> StorageContext:
        self = cls.__new__(cls)
        self.experiment_name = validate_component(experiment_name, "experiment_name")
        self.trial_name = validate_component(trial_name, "trial_name")
        self.backend = backend
        self.storage_path = storage_path
        self.fsync = fsync
        return self

    def __repr__(self) -> str:
        return (
            f"StorageContext({self.backend.uri_for(self.trial_path)!r}, "
            f"backend={self.backend.name or self.backend.scheme})"
        )

    @property
    def filesystem(self):  # -> pafs.FileSystem
        return self.backend.filesystem

    @property
    def experiment_path(self) -> str:
        return posixpath.join(self.storage_path, self.experiment_name)

    @property
    def trial_path(self) -> str:
        return posixpath.join(self.experiment_path, self.trial_name)

    def uri(self, path: str) -> str:
        return self.backend.uri_for(path)

    def checkpoint_path(self, index: int) -> str:
        return posixpath.join(self.trial_path, checkpoint_dir_name(index))

    def checkpoint(self, dir_name: str) -> Checkpoint:
        """A Checkpoint for ``dir_name`` in this trial (not checked on storage)."""
        return Checkpoint._from_backend(self.backend, posixpath.join(self.trial_path, dir_name))

    def ensure_trial_dir(self) -> None:
        _fsutil.ensure_dir(self.filesystem, self.trial_path, self.backend.capabilities)

    # -- checkpoints ------------------------------------------------------------

    def checkpoint_dirs(self) -> list[tuple[int, str]]:
        """``(index, dir name)`` of every ``checkpoint_NNNNNN`` directory, committed
        or not, sorted by index."""
        found = []
        for fi in _fsutil.list_dir(self.filesystem, self.trial_path):
            name = posixpath.basename(fi.path.rstrip("/"))
            index = parse_checkpoint_dir_name(name)
            if index is not None and fi.type != _fsutil.pafs.FileType.File:
                found.append((index, name))
        return sorted(found)

    def committed_checkpoints(self) -> list[tuple[Checkpoint, dict[str, Any]]]:
        """Every committed checkpoint with its internal metadata, oldest first.

        Order is the index recorded in the internal metadata, never names or
        modification times. Directories without valid internal metadata are
        not checkpoints and are skipped.
        """
        out = []
        for _, name in self.checkpoint_dirs():
            path = posixpath.join(self.trial_path, name)
            meta = read_internal_metadata(self.filesystem, path)
            if meta is not None:
                out.append((Checkpoint._from_backend(self.backend, path), meta))
        out.sort(key=lambda cm: cm[1]["index"])
        return out

    def next_checkpoint_index(self) -> int:
        """One past the highest index of any checkpoint directory present."""
        dirs = self.checkpoint_dirs()
        return dirs[-1][0] + 1 if dirs else 0

    def persist_checkpoint(
        self, checkpoint: Checkpoint, index: int, internal: Mapping[str, Any]
    ) -> Checkpoint:
        """Upload ``checkpoint`` as ``checkpoint_<index>`` of this trial and commit it.

        Args:
            checkpoint: where the files are (any filesystem, usually local).
            index: the checkpoint index (>= 0).
            internal: extra fields for the internal metadata (metrics ...).

        Returns:
            The committed Checkpoint on this storage.

        Raises:
            CheckpointConflictError: that index is already committed.
            CheckpointNotFoundError: the source directory is gone.
        """
        dest = self.checkpoint_path(index)
        meta = {
            "index": index,
            "experiment_name": self.experiment_name,
            "trial_name": self.trial_name,
            "created_at": time.time(),
            **internal,
        }
        self.ensure_trial_dir()
        commit_checkpoint(
            checkpoint.filesystem, checkpoint.path, self.backend, dest, meta, fsync=self.fsync
        )
        return Checkpoint._from_backend(self.backend, dest)

    def delete_checkpoint(self, dir_name: str) -> None:
        """Delete a checkpoint directory of this trial; absent is fine.

        The commit marker goes first, so an interrupted delete never leaves a
        directory that still lists as a committed checkpoint.
        """
        from checkpoint_store._layout import INTERNAL_METADATA

        path = posixpath.join(self.trial_path, dir_name)
        _fsutil.delete_file(self.filesystem, posixpath.join(path, INTERNAL_METADATA))
        _fsutil.delete_dir(self.filesystem, path)

    # -- trial files --------------------------------------------------------------

    def write_params(self, config: Mapping[str, Any]) -> None:
        data = _json.dumps(_json.to_json_object(config, "config"))
        _fsutil.write_bytes(
            self.filesystem, posixpath.join(self.trial_path, PARAMS_FILE), data,
            self.backend.capabilities,
        )

    def read_results(self) -> list[dict[str, Any]]:
        """Rows of ``result.json`` (one JSON object per line); ``[]`` if absent.
        A torn last line (a crash mid-append) is ignored."""
        path = posixpath.join(self.trial_path, RESULT_FILE)
        try:
            raw = _fsutil.read_bytes(self.filesystem, path)
        except (FileNotFoundError, OSError):
            return []
        rows = []
        for line in raw.decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                row = _json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows


class ResultLog:
    """Appends rows to a trial's ``result.json``.

    Local disks append in place. Object stores cannot append, so the rows
    written so far are kept and the whole file is rewritten with one PUT per
    row (a reader always sees a whole file).
    """

    def __init__(self, storage: StorageContext, existing: list[dict[str, Any]] | None = None):
        self._storage = storage
        self._path = posixpath.join(storage.trial_path, RESULT_FILE)
        self._local = _fsutil.local_path(storage.filesystem, self._path)
        self._lines: list[bytes] | None = None
        if self._local is None:
            rows = existing if existing is not None else storage.read_results()
            self._lines = [_json.dumps_line(r) for r in rows]

    def append(self, row: Mapping[str, Any]) -> None:
        line = _json.dumps_line(row)
        if self._local is not None:
            os.makedirs(os.path.dirname(self._local), exist_ok=True)
            with open(self._local, "ab") as f:
                f.write(line)
            return
        assert self._lines is not None
        self._lines.append(line)
        _fsutil.write_bytes(
            self._storage.filesystem, self._path, b"".join(self._lines),
            self._storage.backend.capabilities,
        )
