"""The Checkpoint: a directory on some filesystem, plus its two metadata files.

A :class:`Checkpoint` is only a reference, ``(filesystem, path)``; creating
one copies nothing. It reads and writes the user's ``.user_metadata.json``,
exposes our ``.internal_metadata.json`` read-only, and downloads the user's
files. Same surface as Ray Train's ``ray.train.Checkpoint``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import filelock
import google_crc32c
import pyarrow.fs as pafs

from checkpoint_store._chunks.files import chunked_entries
from checkpoint_store._chunks.read import download_checkpoint, verify_checkpoint
from checkpoint_store._commit.download_target import check_lock_creatable as _check_lock_creatable
from checkpoint_store._commit.download_target import inside as _inside
from checkpoint_store._commit.download_target import new_sibling_dir as _new_sibling_dir
from checkpoint_store._commit.download_target import owned_files as _owned_files
from checkpoint_store._commit.download_target import read_download_marker as _read_download_marker
from checkpoint_store._commit.download_target import recover_interrupted as _recover_interrupted
from checkpoint_store._commit.download_target import remove_tree as _remove_tree
from checkpoint_store._commit.download_target import sizes_match as _sizes_match
from checkpoint_store._commit.download_target import (
    write_download_marker as _write_download_marker,
)
from checkpoint_store._commit.nesting import refuse_local_store_target
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    INTERNAL_METADATA,
    USER_METADATA,
    check_name_length,
    download_lock_name,
    download_marker_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import transferlog as _transferlog
from checkpoint_store._util.inspect import (
    Inspection,
    inspect_checkpoint,
    read_internal_metadata,
)
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidConfigError,
    UnsafePathError,
)
from checkpoint_store.registry import local_path_argument as _local_path_arg
from checkpoint_store.registry import resolve

logger = logging.getLogger(__name__)


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

    # The marker the commit that made this object wrote (see _from_backend).
    _written: Mapping[str, Any] | None = None

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
        self._on_corrupt: Callable[[CheckpointCorruptError], None] | None = None

    @classmethod
    def _from_backend(cls, backend: Backend, path: str,
                      written: Mapping[str, Any] | None = None) -> Checkpoint:
        """A checkpoint at ``path`` of ``backend``; ``written``: the marker a
        commit just wrote there, which retention registers without reading
        it back (:func:`written_metadata`)."""
        self = cls.__new__(cls)
        self._backend = backend
        self.path = path
        if written is not None:
            self._written = types.MappingProxyType(dict(written))
        self._on_corrupt = None
        return self

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """A checkpoint of an existing local directory (not copied).

        Raises:
            InvalidConfigError: ``path`` is not a str or PathLike, is empty,
                holds a NUL byte, or is a URI (``Checkpoint(uri)`` names one).
            CheckpointNotFoundError: ``path`` is not an existing directory.
        """
        local = _local_path_arg(path, "Checkpoint.from_directory(path)")
        if not os.path.isdir(local):
            raise CheckpointNotFoundError(
                f"{local!r} is not an existing directory; create it and write your "
                "checkpoint files into it first"
            )
        return cls(local)

    @classmethod
    def from_state(cls, state: Any, directory: str | os.PathLike[str] | None = None, *,
                   shard_bytes: int | None = None) -> Checkpoint:
        """A checkpoint of a state tree written into a local directory now
        (synchronously): safetensors shards for the tensors, ``state.json``
        for the rest (docs/state.md). Report it like any directory; read it
        back with :meth:`load_state`.

        Args:
            state: nested dicts (string or int keys), lists, tuples; leaves torch
                tensors, numpy arrays or JSON values
                (:func:`checkpoint_store.state.flatten_state`).
            directory: where to write (created; must not hold a state yet);
                None: a new temporary directory, which is the caller's to
                remove (``shutil.rmtree(checkpoint.path)``) once reported.
            shard_bytes: largest tensor data per safetensors file, in bytes
                (default 1 GiB, :data:`checkpoint_store.state.DEFAULT_SHARD_BYTES`).

        Raises:
            UnsupportedStateError: the tree cannot be stored (a non-string
                key, an unsupported leaf or dtype, overlapping views); names
                the key; nothing written.
            InvalidConfigError: ``shard_bytes`` <= 0, ``directory`` holds a
                state already, or it (or a directory above it) is a file, or
                it is no local path (see :meth:`from_directory`).
            StorageFullError: the disk is full (``PermanentBackendError``
                for another disk error), as ``report(state=...)`` raises it;
                the files written are removed.
        """
        from checkpoint_store import state as _state

        local = (tempfile.mkdtemp(prefix="checkpoint-state-") if directory is None
                 else _local_path_arg(directory, "Checkpoint.from_state(directory=)"))
        try:
            _state.write_state(state, local, shard_bytes=_state.DEFAULT_SHARD_BYTES
                               if shard_bytes is None else shard_bytes)
        except BaseException as exc:
            if directory is None:
                _remove_tree(local)
            if isinstance(exc, OSError):
                from checkpoint_store._util.retry import typed_permanent

                typed = typed_permanent(exc, f"write the state into {local}")
                if typed is not exc:  # a full disk: as report(state=...) says it
                    raise typed from exc
            raise
        return cls.from_directory(local)

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
        self._on_corrupt = None

    def _report_corrupt_to(self, callback: Callable[[CheckpointCorruptError], None]) -> Checkpoint:
        """Have ``callback`` told when :meth:`verify` or :meth:`to_directory` find
        this checkpoint damaged (a file missing, added, or not matching its
        manifest), before the error is raised: how the retention manager that
        handed it out learns of it. Returns ``self``."""
        self._on_corrupt = callback
        return self

    @contextlib.contextmanager
    def _reporting_corruption(self) -> Iterator[None]:
        try:
            yield
        except UnsafePathError:
            raise  # a bad target, or an entry escaping it: not damage to the files
        except CheckpointCorruptError as exc:
            callback = getattr(self, "_on_corrupt", None)  # None: built another way
            if callback is not None:
                callback(exc)
            raise

    # -- metadata -------------------------------------------------------------

    def get_metadata(self) -> dict[str, Any]:
        """The user metadata dict (``{}`` when none was set).

        Raises:
            CheckpointCorruptError: the file exists but is not a JSON object.
        """
        path = posixpath.join(self.path, USER_METADATA)
        try:
            # Read again while torn: set/update_metadata rewrite it in place.
            value = _fsutil.read_control(self.filesystem, path)
        except FileNotFoundError:
            return {}
        except ValueError as exc:  # it stayed unparsable
            from checkpoint_store.errors import CheckpointCorruptError

            raise CheckpointCorruptError(
                f"{self.uri}/{USER_METADATA} is not valid JSON ({exc})",
                path=self.path, file=USER_METADATA,
            ) from None
        except OSError:
            if not _fsutil.exists(self.filesystem, path):
                return {}
            raise
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

    def verify(self) -> None:
        """Check every file against the manifest: presence, size and CRC32C.

        Reads every byte once (in parallel, ``capabilities.concurrency`` files
        at a time). Same role as Orbax's checkpoint validation, with the
        checksum object stores compute natively.

        Raises:
            CheckpointNotFoundError: the directory does not exist, or is not a
                committed checkpoint (no ``.internal_metadata.json``).
            CheckpointCorruptError: a file is missing, has another size or
                checksum, or the metadata is unreadable; ``.file`` names the
                file (relative to the checkpoint) and the message says which.
        """
        with self._reporting_corruption():
            self._verify()

    def _verify(self) -> None:
        insp = inspect_checkpoint(self.filesystem, self.path)
        if insp.state == "missing":
            raise CheckpointNotFoundError(f"checkpoint {self.uri} does not exist")
        if insp.state == "absent":
            raise CheckpointNotFoundError(
                f"{self.uri} is not a committed checkpoint (no {INTERNAL_METADATA}); it may be "
                "an interrupted upload, or a directory copied in by hand "
                "(StorageContext.adopt() turns a complete one into a checkpoint)"
            )
        if insp.state == "invalid":
            raise CheckpointCorruptError(
                f"checkpoint {self.uri} is corrupt: {insp.reason}", path=self.path, file=insp.file
            )
        assert insp.meta is not None
        caps = self._backend.capabilities
        try:
            verify_checkpoint(self.filesystem, self.path, insp.meta,
                              chunk_size=caps.chunk_size, concurrency=max(caps.concurrency, 1))
        except CheckpointCorruptError as exc:
            from checkpoint_store.state import name_corrupt_tensor

            name_corrupt_tensor(self.filesystem, self.path, insp.meta, insp.files, exc)
            raise

    def load_state(self, keys: str | Iterable[str] | None = None, *, mmap: bool = False,
                   into: Any = None, verify: bool = True,
                   progress: Callable[[int, int], None] | None = None) -> Any:
        """The state saved in this checkpoint (``report(state=...)``,
        :meth:`from_state`), as the tree it was saved: see
        :func:`checkpoint_store.state.load_state` and docs/state.md.

        Args:
            keys: None (all), or names and globs over the flattened keys
                (``"model"``: that subtree; ``"model/*.bias"``); only those
                tensors' bytes are read (ranged reads on object stores).
            mmap: on a local disk, memory-mapped tensors (no copy;
                copy-on-write); elsewhere ignored.
            into: a tree of existing tensors (``{"model": model.state_dict()}``)
                filled in place; its leaves say what is read.
            verify: check each tensor's CRC32C (default True).
            progress: ``progress(done_bytes, total_bytes)`` of the tensor
                bytes asked for, 0 first and ``(total, total)`` last (from
                reader threads, one call at a time): drive a ``tqdm`` or
                ``rich`` bar with it.

        Raises:
            CheckpointNotFoundError: no checkpoint here, or it holds no state,
                or a file of it was deleted while it was read.
            StateKeyError: a key or glob matches nothing, or ``into`` names a
                key the state lacks; nothing read.
            StateMismatchError: an ``into`` tensor's dtype or shape differs,
                or it cannot be written in place, or two overlap in memory
                without being the same view; nothing changed.
            InvalidConfigError: ``keys`` is not a string or strings, ``mmap``
                or ``verify`` is not a bool, ``progress`` is not callable;
                nothing read.
            TensorCorruptError: a tensor fails its checksum (``.tensor``).
            CheckpointCorruptError: the checkpoint's metadata is damaged.
        """
        from checkpoint_store import state as _state

        caps = self._backend.capabilities
        started = time.monotonic()
        with self._reporting_corruption():
            loaded = _state.load_state(self.filesystem, self.path, keys=keys, mmap=mmap,
                                       into=into, verify=verify,
                                       concurrency=max(caps.concurrency, 1),
                                       progress=progress)
        _transferlog.log_if_long(logger, f"load_state {self.uri}",
                                 lambda: _transferlog.tree_bytes(loaded),
                                 time.monotonic() - started)
        return loaded

    def to_directory(
        self, path: str | os.PathLike[str] | None = None, *, verify: bool = True,
        progress: Callable[[int, int], None] | None = None,
    ) -> str:
        """Copy the user's files and ``.user_metadata.json`` into a local directory.

        Safe to call from many processes with the same ``path``: a file lock
        (``.<name>.cs_lock`` next to ``path``) lets exactly one download; the
        others wait and return once the data is complete, which a completion
        marker next to it (``.<name>.cs_download.json``) records, with the
        list of files it wrote. A download that fails (or fails
        verification) leaves ``path`` as it was: the files go to a staging
        sibling first, and the staged directory replaces ``path`` whole only
        after every file arrived and verified. Afterwards ``path`` holds
        exactly this checkpoint's files, none left from an earlier download.

        Args:
            path: target directory (created if needed): new, empty, or one an
                earlier ``to_directory`` filled; a new temporary directory
                when None.
            verify: check each file's size and CRC32C against the manifest of
                a committed checkpoint (default True; False skips the check,
                not the download).
            progress: ``progress(done_bytes, total_bytes)``, called with 0
                first, then as each part of the transfer ends (a batch of
                small files, a part of a large one; from worker threads, one
                call at a time): drive a ``tqdm`` or ``rich`` bar with it. A
                ``path`` already holding this checkpoint calls it once with
                ``(total, total)``. Not called on a failure.

        Returns:
            The local directory path.

        Raises:
            CheckpointNotFoundError: the checkpoint directory does not exist.
            CheckpointConflictError: ``path`` holds files no earlier download
                wrote (names one); nothing was changed.
            InvalidConfigError: ``path`` is not a str or PathLike (or is
                empty, holds a NUL byte, or is a URI other than ``file://``),
                ``verify`` is not a bool, ``path`` is an existing file, its
                name is longer than 255 bytes, or its parent is not writable;
                raised before anything is written.
            UnsafePathError: an entry would escape the target (``..``,
                absolute path, symlink out of the checkpoint), or ``path``
                lies inside the checkpoint itself (or holds it); nothing was
                written.
            CheckpointCorruptError: its metadata is invalid, or ``verify``
                and a file fails its check; names the file.
        """
        if not isinstance(verify, bool):
            raise InvalidConfigError(f"to_directory(verify=) must be True or False, got "
                                     f"{verify!r}")
        target = None if path is None else _local_path_arg(path, "to_directory(path)")
        if progress is not None and not callable(progress):
            raise InvalidConfigError(f"to_directory(progress=) must be a callable (done_bytes, "
                                     f"total_bytes), got {type(progress).__name__}")
        started = time.monotonic()
        with self._reporting_corruption():
            local = self._to_directory(target, verify, progress)
        _transferlog.log_if_long(logger, f"download {self.uri} to {local}",
                                 lambda: _transferlog.local_tree_bytes(local),
                                 time.monotonic() - started)
        return local

    def _to_directory(self, target: str | None, verify: bool,
                      progress: Callable[[int, int], None] | None = None) -> str:
        insp = self._inspect_for_download()
        manifest = insp.meta["manifest"] if insp.meta else None
        if target is None:
            return self._download_to_temp(insp.meta, verify, insp.files, progress)
        parent, base = os.path.split(target)
        # Every refusal below comes before the first write (the lock included).
        self._refuse_target(target, base)
        os.makedirs(parent, exist_ok=True)
        identity = self._download_identity(insp.meta)
        # Beside the target, not in it: the user's directory holds only their files.
        marker = os.path.join(parent, download_marker_name(base))
        lock_path = os.path.join(parent, download_lock_name(base))
        # Someone else's files: refused before the lock file exists (and again
        # under the lock, where it counts). Where the lock file exists already,
        # a download may be swapping its directory in right now (its files in
        # place, its marker not yet written): only the check under the lock
        # can tell, so it decides.
        try:
            _owned_files(target, _read_download_marker(marker))
        except CheckpointConflictError:
            if not os.path.exists(lock_path):
                raise
        _check_lock_creatable(lock_path, target)
        with filelock.FileLock(lock_path):
            _recover_interrupted(parent, base, target)
            previous = _read_download_marker(marker)
            if (
                identity is not None
                and manifest is not None
                and previous.get("identity") == identity
                and _sizes_match(target, manifest)
            ):
                if progress is not None:  # nothing to move: done already
                    size = sum(int(e.get("size", 0)) for e in manifest)
                    progress(size, size)
                return target
            self._download_and_swap(target, marker, identity, _owned_files(target, previous),
                                    insp.meta, verify, insp.files, progress)
        return target

    def _inspect_for_download(self) -> Inspection:
        """The checkpoint's inspection; refuses a missing or corrupt one."""
        insp = inspect_checkpoint(self.filesystem, self.path)
        if insp.state == "missing":
            raise CheckpointNotFoundError(f"checkpoint {self.uri} does not exist")
        if insp.state == "invalid":
            raise CheckpointCorruptError(
                f"checkpoint {self.uri} is corrupt: {insp.reason}", path=self.path, file=insp.file
            )
        return insp

    def _download_to_temp(self, meta: Mapping[str, Any] | None, verify: bool,
                          listed: Mapping[str, int] | None,
                          progress: Callable[[int, int], None] | None = None) -> str:
        """Download into a new temporary directory (removed again on failure)."""
        tmp = _download_dir()
        try:
            download_checkpoint(self.filesystem, self.path, self._backend.capabilities, tmp,
                                meta=meta, verify=verify, listed=listed, progress=progress)
        except BaseException:
            _remove_tree(tmp)
            raise
        return tmp

    def _refuse_target(self, target: str, base: str) -> None:
        """Refuse a download target that is too long a name, a file, or overlaps us."""
        check_name_length(base, "download directory name")
        if os.path.lexists(target) and not os.path.isdir(target):
            raise InvalidConfigError(
                f"cannot download into {target!r}: it exists and is not a directory; "
                "choose a directory path"
            )
        self._refuse_target_overlap(target)
        refuse_local_store_target(target, "download directory")

    def _download_and_swap(
        self, target: str, marker: str, identity: dict[str, Any] | None, old_files: list[str],
        meta: Mapping[str, Any] | None, verify: bool, listed: Mapping[str, int] | None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Under the target's lock: download into a staging sibling, then swap it in."""
        parent, base = os.path.split(target)
        staging = _new_sibling_dir(parent, "download", base)
        try:
            written = download_checkpoint(self.filesystem, self.path,
                                          self._backend.capabilities, staging, meta=meta,
                                          verify=verify, listed=listed, progress=progress)
            _swap_in(staging, target, marker, identity, old_files, written)
        finally:
            _remove_tree(staging)
        logger.info("downloaded %s to %s (%d files)", self.uri, target, len(written))

    def _refuse_target_overlap(self, target: str) -> None:
        """A download into the checkpoint itself would change it (it would no
        longer match its manifest); one into a directory holding it would
        replace it."""
        local = _fsutil.local_path(self.filesystem, self.path)
        if local is None:
            return
        real_ck, real_target = os.path.realpath(local), os.path.realpath(target)
        if _inside(real_target, real_ck) or _inside(real_ck, real_target):
            raise UnsafePathError(
                f"cannot download checkpoint {self.uri} into {target!r}: the target "
                f"{'is inside' if _inside(real_target, real_ck) else 'holds'} the checkpoint "
                "itself; choose a directory outside it", path=self.path,
            )

    def _download_identity(self, meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """What a completion marker must match: this checkpoint's URI and the
        exact manifest (None for a directory that is not committed)."""
        if meta is None:
            return None
        digest = google_crc32c.value(_json.dumps(meta["manifest"]))
        return {"uri": self.uri, "index": meta.get("index"), "created_at": meta.get("created_at"),
                "manifest_crc32c": f"{digest:08x}"}

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """Yield a local directory holding the checkpoint's files.

        A local checkpoint yields its own directory: read it, never write to
        it. A remote one, or a local one with files stored as chunks (format
        version 3: they are not in its directory), is downloaded (and
        verified) into a temporary directory that is removed when the block
        exits, also when it raises.
        """
        local = _fsutil.local_path(self.filesystem, self.path)
        if local is not None and not _has_chunks(local):
            if not os.path.isdir(local):
                raise CheckpointNotFoundError(f"checkpoint {self.uri} does not exist")
            yield local
            return
        tmp = _download_dir()
        try:
            self.to_directory(tmp)
            yield tmp
        finally:
            _remove_tree(tmp)


def written_metadata(checkpoint: Checkpoint) -> Mapping[str, Any]:
    """The internal metadata of ``checkpoint``: the marker its commit wrote
    when this object came from that commit (no storage call: a commit that
    landed stands even if the store cannot be read right after it), else
    :attr:`Checkpoint.internal_metadata` read from storage."""
    known = checkpoint._written
    return known if known is not None else checkpoint.internal_metadata


def _has_chunks(local: str) -> bool:
    """True when the local checkpoint ``local``'s marker lists chunked files
    (one small read; False without a readable marker)."""
    try:
        with open(os.path.join(local, INTERNAL_METADATA), "rb") as f:
            meta = _json.loads(f.read())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(meta, dict) and bool(chunked_entries(meta))


def _download_dir() -> str:
    """A new temporary directory for a download, in the staging root and named
    after this process: a kill mid-download leaves it to the next session's
    sweep (:func:`~checkpoint_store.state.sweep_staging_root`)."""
    from checkpoint_store._format.layout import DOWNLOAD_PREFIX
    from checkpoint_store.state._staging_dir import scratch_dir

    return scratch_dir(DOWNLOAD_PREFIX)


def _swap_in(staging: str, target: str, marker: str, identity: dict[str, Any] | None,
             old_files: list[str], written: list[str]) -> None:
    """Make ``target`` hold exactly the files of ``staging``.

    The marker lists the files of both downloads while the directories are
    swapped, so a crash at any step leaves a target that is recognisably
    ours and never one that looks complete. A crash between the two renames
    leaves no ``target`` at all; the next download into it moves the old one
    back first (:func:`~checkpoint_store._commit.download_target.recover_interrupted`).
    """
    _write_download_marker(marker, None, sorted(set(old_files) | set(written)))
    trash = None
    if os.path.lexists(target):
        trash = _new_sibling_dir(os.path.dirname(target), "download_old", os.path.basename(target))
        os.rename(target, os.path.join(trash, "d"))
    os.rename(staging, target)
    _write_download_marker(marker, identity, written)
    if trash is not None:
        _remove_tree(trash)


def _require_checkpoint(value: Any) -> Checkpoint:
    if not isinstance(value, Checkpoint):
        raise InvalidConfigError(
            f"expected a checkpoint_store.Checkpoint, got {type(value).__name__}; "
            "build one with Checkpoint.from_directory(path)"
        )
    return value
