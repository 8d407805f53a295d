"""torch.distributed.checkpoint (DCP) on any checkpoint-store backend.

Two ways, both without a second copy of the checkpoint:

1. DCP writes where the checkpoint will live; the session commits it in place::

       import torch.distributed.checkpoint as dcp
       from checkpoint_store import Checkpoint, session

       with session.start(storage_path="/mnt/ckpt", experiment_name="llm") as s:
           ...
           where = s.next_checkpoint_dir()            # same on every rank
           dcp.save(state, checkpoint_id=where)
           s.report({"loss": loss}, checkpoint=Checkpoint(where))

   ``report`` builds the manifest from the files DCP wrote (sizes, CRC32C),
   writes the commit marker last, and copies nothing. A ``dcp.save`` that
   failed (no ``.metadata``) is never committed.

2. For stores DCP cannot reach by itself (Azure with our credentials, our
   retries, any plugin backend), :class:`StorageWriter` and
   :class:`StorageReader` are DCP's ``FileSystemWriter``/``FileSystemReader``
   on our filesystem::

       where = s.next_checkpoint_dir()                 # az://container/...
       dcp.save(state, storage_writer=StorageWriter(where, storage_options=opts))
       s.report({"loss": loss}, checkpoint=Checkpoint(where, storage_options=opts))
       dcp.load(state, storage_reader=StorageReader(where, storage_options=opts))

   The writer computes each file's CRC32C on the bytes as they are written
   and leaves them in a ``.cs_written-*.json`` record, so the commit reads
   nothing back.

Requires ``pip install 'checkpoint-store[torch]'`` (with the torch build you
want on the same command line, e.g. ``torch==2.13.0``).
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import threading
from collections.abc import Generator, Mapping
from typing import Any

import google_crc32c
import pyarrow as pa

from checkpoint_store._commit.nesting import refuse_inside_checkpoint
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import written_record_name
from checkpoint_store._format.manifest import is_chunked
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import read_internal_metadata
from checkpoint_store.backends.base import Backend
from checkpoint_store.backends.clients import writer_of
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.registry import resolve

try:
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import (
        FileSystemBase,
        FileSystemReader,
        FileSystemWriter,
    )
except ImportError:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "checkpoint_store.integrations.torch needs PyTorch: pip install "
        "'checkpoint-store[torch]' torch==<the version you use>"
    ) from None

__all__ = ["StorageReader", "StorageWriter"]


class _CrcStream(io.RawIOBase):
    """A write-only stream over a backend output stream: counts bytes and
    extends a CRC32C on each write; reports both on close."""

    def __init__(self, inner: Any, on_close: Any):
        self._inner = inner
        self._on_close = on_close
        self._crc = 0
        self._size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        # A pyarrow buffer: zero-copy, and what google_crc32c takes (no memoryview).
        buf = pa.py_buffer(b)
        self._inner.write(buf)
        self._crc = google_crc32c.extend(self._crc, buf)
        self._size += buf.size
        return buf.size

    def tell(self) -> int:
        # DCP records item offsets with tell(); only ever appended to.
        return self._size

    def close(self) -> None:
        if self.closed:
            return
        self._inner.close()
        super().close()
        self._on_close(self._size, f"{self._crc:08x}")


class _BackendFileSystem(FileSystemBase):
    """DCP's filesystem interface over a checkpoint-store backend. Paths are
    strings inside the backend's filesystem."""

    def __init__(self, backend: Backend, to_path: Any):
        self.backend = backend
        self._to_path = to_path
        # {path: (size, crc32c)} of files written through this instance.
        self.written: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        fs, p = self.backend.filesystem, str(path)
        if mode == "wb":

            def record(size: int, crc: str) -> None:
                with self._lock:
                    self.written[p] = (size, crc)

            stream = _CrcStream(writer_of(fs).open_output_stream(p), record)
            try:
                yield stream  # type: ignore[misc]
            except BaseException:
                # An aborted write is no file of the checkpoint: never record it.
                stream._on_close = lambda size, crc: None
                stream.close()
                raise
            stream.close()
        elif mode == "rb":
            with fs.open_input_file(p) as f:
                yield f  # type: ignore[misc]
        else:
            raise ValueError(f"unsupported mode {mode!r} (DCP uses 'wb' and 'rb')")

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return posixpath.join(str(path), suffix)

    def init_path(self, path: str | os.PathLike) -> str:
        return self._to_path(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        _fsutil.move(self.backend.filesystem, str(path), str(new_path))
        with self._lock:
            if str(path) in self.written:
                self.written[str(new_path)] = self.written.pop(str(path))

    def mkdir(self, path: str | os.PathLike) -> None:
        _fsutil.ensure_dir(self.backend.filesystem, str(path), self.backend.capabilities)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # only ever chosen explicitly, never by DCP's auto-detection

    def exists(self, path: str | os.PathLike) -> bool:
        return _fsutil.exists(self.backend.filesystem, str(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        _fsutil.delete_file(self.backend.filesystem, str(path))


def _backend_for(
    location: str | os.PathLike[str], filesystem: Any, storage_options: Mapping[str, Any] | None
) -> _BackendFileSystem:
    """Our filesystem for ``location``; later ``checkpoint_id``s (``dcp.save(...,
    checkpoint_id=...)`` resets the writer) resolve the same way and must be
    on the same store."""
    backend, _ = resolve(location, filesystem=filesystem, storage_options=storage_options)

    def to_path(where: str | os.PathLike[str]) -> str:
        other, path = resolve(where, filesystem=filesystem, storage_options=storage_options)
        if other.scheme != backend.scheme:
            raise InvalidConfigError(
                f"checkpoint_id {os.fspath(where)!r} is on {other.scheme!r} storage, this "
                f"StorageWriter/StorageReader on {backend.scheme!r}; build another one for it"
            )
        return path

    return _BackendFileSystem(backend, to_path)


class StorageWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` writing through a checkpoint-store backend.

    Args:
        path: the checkpoint directory: a local path or URI (``az://...``),
            typically ``session.next_checkpoint_dir()``; or with
            ``filesystem`` a path inside it.
        filesystem: a pyarrow or fsspec filesystem for all I/O.
        storage_options: backend options for a URI (credentials, endpoint).
        single_file_per_rank, thread_count, per_thread_copy_ahead, overwrite:
            as for ``FileSystemWriter``.

    Files go to the store as DCP writes them (one stream per file, through
    our backend and its credentials). Each rank, once its files are written
    (``write_data``), stores their sizes and CRC32Cs in
    ``.cs_written-rank<r>.json``; the coordinator does the same for
    ``.metadata`` in ``finish``. ``session.report(...,
    checkpoint=Checkpoint(path))`` then commits without reading them back.
    DCP's ``sync_files`` is off: on local disks the commit fsyncs every
    file before the marker; elsewhere a closed upload is durable.

    Raises:
        InvalidConfigError, UnknownSchemeError, BackendUnavailableError: the
            location cannot be resolved; a later ``checkpoint_id`` is on
            another store.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        filesystem: Any = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        single_file_per_rank: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        overwrite: bool = True,
    ):
        super().__init__(
            "", single_file_per_rank=single_file_per_rank, sync_files=False,
            thread_count=thread_count, per_thread_copy_ahead=per_thread_copy_ahead,
            overwrite=overwrite,
        )
        self._store_fs = _backend_for(path, filesystem, storage_options)
        # DCP's own code needs only FileSystemBase, but the base __init__'s
        # `self.fs = FileSystem()` makes mypy infer the narrower local class.
        self.fs = self._store_fs  # type: ignore[assignment]
        self.path = self._store_fs.init_path(path)
        _refuse_chunked(self._store_fs.backend, str(self.path))

    def _record_part(self) -> str:
        rank = getattr(self, "rank", None)
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return f"rank{int(rank)}"

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every rank, before writing: drop this rank's record of an earlier
        save into the same directory, so a stale one can never vouch for files."""
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        # The checkpoint directory itself is ours to fill; one above it that
        # is committed would be corrupted by these files.
        refuse_inside_checkpoint(self._store_fs.backend, posixpath.dirname(str(self.path)),
                                 "the parent of the DCP checkpoint directory")
        self._store_fs.written.clear()
        stale = posixpath.join(str(self.path), written_record_name(self._record_part()))
        if _fsutil.exists(self._store_fs.backend.filesystem, stale):
            _fsutil.delete_file(self._store_fs.backend.filesystem, stale)

    def write_data(self, plan: Any, planner: Any) -> Any:
        """Every rank: write its files (DCP), then the record of their checksums."""
        fut = super().write_data(plan, planner)
        fut.wait()  # FileSystemWriter writes synchronously; this only surfaces its error
        self._write_record(self._record_part())
        return fut

    def finish(self, metadata: Any, results: Any) -> None:
        """The coordinator, after every rank wrote: ``.metadata`` (DCP's own
        marker, written last), then its record."""
        before = set(self._store_fs.written)
        super().finish(metadata, results)
        self._write_record("metadata", only=set(self._store_fs.written) - before)

    def _write_record(self, part: str, only: set[str] | None = None) -> None:
        root = str(self.path)
        files = [
            {"path": _fsutil.relative(root, p), "size": size, "crc32c": crc}
            for p, (size, crc) in sorted(self._store_fs.written.items())
            if (only is None or p in only) and p.startswith(root.rstrip("/") + "/")
        ]
        backend = self._store_fs.backend
        _fsutil.write_bytes(backend.filesystem, posixpath.join(root, written_record_name(part)),
                            _json.dumps({"files": files}), backend.capabilities)


def _refuse_chunked(backend: Backend, path: str) -> None:
    """Raise when the checkpoint at ``path`` keeps files as chunks (saved with
    dedup): DCP reads its files in place, and those are not there."""
    meta = read_internal_metadata(backend.filesystem, path)
    if meta and any(is_chunked(e) for e in meta.get("manifest") or ()):
        raise InvalidConfigError(
            f"{backend.uri_for(path)} keeps its large files as chunks (it was saved with "
            "dedup), which DCP cannot read in place: load it from a local copy, "
            "`with Checkpoint(uri).as_directory() as d: dcp.load(state, checkpoint_id=d)`")


class StorageReader(FileSystemReader):
    """DCP's ``FileSystemReader`` reading through a checkpoint-store backend.

    Args:
        path: the checkpoint directory (local path or URI, e.g. a committed
            ``Checkpoint.uri``); or with ``filesystem`` a path inside it.
        filesystem: a pyarrow or fsspec filesystem for all I/O.
        storage_options: backend options for a URI.

    Reads only what ``dcp.load`` asks for (ranged reads on object stores).
    Use ``Checkpoint.verify()`` first to check every file's CRC32C.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        filesystem: Any = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
    ):
        super().__init__("")
        self._store_fs = _backend_for(path, filesystem, storage_options)
        # DCP's own code needs only FileSystemBase, but the base __init__'s
        # `self.fs = FileSystem()` makes mypy infer the narrower local class.
        self.fs = self._store_fs  # type: ignore[assignment]
        self.path = self._store_fs.init_path(path)
        _refuse_chunked(self._store_fs.backend, str(self.path))
