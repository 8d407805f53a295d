"""The chunk store of one experiment: objects, intents, condemned lists.

Layout under the root (``<experiment>/.cs_chunks``; docs/format.md, "Chunks")::

    <root>/<name[:2]>/<name>                 one chunk object (codec.py)
    <root>/.intents/<writer>-<uuid>.json     {"writer", "created_at", "chunks"}
    <root>/.condemned/<gc id>.json           {"created_at", "chunks"}

An object's name is its chunk's name (64 hex of BLAKE3), or that name plus
``.`` and 8 random hex digits: a fresh copy uploaded while the canonical
object was condemned by a running gc. A writer announces the chunks it
will reference (its intent) before it looks at what exists; a gc condemns
its candidates before its last look at intents and refs (gc.py). Between
the two, no object a committed or in-flight checkpoint uses is deleted.
"""

from __future__ import annotations

import json
import posixpath
import re
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._chunks.codec import SIZE_HEAD_BYTES, min_object_size, object_size
from checkpoint_store._format.layout import CHUNK_DIR, CHUNK_ROOT
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Capabilities
from checkpoint_store.errors import CheckpointCorruptError, UnsafePathError
from checkpoint_store.registry import backend_for_filesystem

__all__ = [
    "resolve_root",
    "CONDEMNED_DIR",
    "INTENTS_DIR",
    "LISTING_THRESHOLD",
    "ChunkStore",
    "ChunkWrite",
    "ControlFile",
    "base_name",
    "check_object_name",
]

INTENTS_DIR = ".intents"
CONDEMNED_DIR = ".condemned"

LISTING_THRESHOLD = 64
"""From this many names on, a writer's existence check lists the needed
``<xx>/`` prefixes instead of one HEAD per name (measured on moto S3,
docs/format.md "Chunks")."""

_OBJECT_RE = re.compile(r"^[0-9a-f]{64}(\.[0-9a-f]{8})?$")
_WRITER_RE = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


def check_object_name(name: str) -> str:
    """``name`` if it is an object name (64 lowercase hex, optionally ``.`` +
    8 hex); else ValueError."""
    if not isinstance(name, str) or not _OBJECT_RE.match(name):
        raise ValueError(f"{name!r} is not a chunk object name (64 lowercase hex digits, "
                         "optionally '.' and 8 hex digits)")
    return name


def base_name(object_name: str) -> str:
    """The chunk name (content hash) an object name stores."""
    return object_name.split(".", 1)[0]


@dataclass(frozen=True)
class ControlFile:
    """One intent or condemned file as read back.

    ``chunks`` is None when the file did not parse (it then protects or
    condemns everything until it is ``age_s`` old, by its mtime).
    """

    path: str
    created_at: float
    chunks: frozenset[str] | None


def resolve_root(checkpoint_path: str, chunk_root: object) -> str:
    """The chunk root a checkpoint's marker names (``chunk_root``, relative to
    the checkpoint dir), as a path of the checkpoint's filesystem.

    Raises:
        UnsafePathError: ``chunk_root`` is absolute, not a string, or leads
            anywhere but the ``.cs_chunks`` directory of the checkpoint's
            experiment dir (the parent of its trial dir); ``.path`` is the
            checkpoint, ``.file`` the root.
    """
    ckpt = checkpoint_path.rstrip("/")
    experiment = posixpath.dirname(posixpath.dirname(ckpt))
    resolved = (posixpath.normpath(posixpath.join(ckpt, chunk_root))
                if isinstance(chunk_root, str) and chunk_root else "")
    if (not isinstance(chunk_root, str) or not chunk_root or chunk_root.startswith("/")
            or "\\" in chunk_root or not experiment
            or resolved != posixpath.join(experiment, CHUNK_DIR)):
        raise UnsafePathError(
            f"checkpoint {ckpt!r} names chunk root {chunk_root!r}, which is not the "
            f"{CHUNK_DIR} directory of its experiment dir {experiment!r}; the marker is "
            "damaged or was not written by checkpoint-store", path=ckpt, file=str(chunk_root))
    return resolved


class ChunkStore:
    """The chunk objects under ``root`` on ``filesystem``.

    Args:
        filesystem: any ``pyarrow.fs.FileSystem`` (paths without a scheme).
        root: the chunk root, usually ``<experiment dir>/.cs_chunks``.
        retry: retry policy for every call (None: from the environment).
        workers: requests in flight at once for reads, HEADs and uploads.
    """

    def __init__(self, filesystem: pafs.FileSystem, root: str, *,
                 retry: RetryPolicy | None = None, workers: int = 16,
                 capabilities: Capabilities | None = None):
        self.filesystem = filesystem
        self.root = root.rstrip("/")
        self.retry = retry
        self.workers = max(1, int(workers))
        # The backend's own when the caller has it: a filesystem wrapped in a
        # PyFileSystem (a local disk handed in through fsspec) tells nothing.
        self._caps = capabilities or backend_for_filesystem(filesystem).capabilities

    def __repr__(self) -> str:
        return f"ChunkStore({self.root!r} on {self.filesystem.type_name})"

    @classmethod
    def for_checkpoint(cls, filesystem: pafs.FileSystem, checkpoint_path: str, *,
                       chunk_root: str = CHUNK_ROOT, retry: RetryPolicy | None = None,
                       capabilities: Capabilities | None = None) -> ChunkStore:
        """The store a checkpoint's marker names (``chunk_root``, relative to
        the checkpoint dir; see :func:`resolve_root`).

        Raises:
            UnsafePathError: as :func:`resolve_root`.
        """
        return cls(filesystem, resolve_root(checkpoint_path, chunk_root), retry=retry,
                   capabilities=capabilities)

    # -- objects ---------------------------------------------------------------

    def object_path(self, name: str) -> str:
        """``<root>/<name[:2]>/<name>``. Raises ValueError for a bad name."""
        check_object_name(name)
        return f"{self.root}/{name[:2]}/{name}"

    def read(self, name: str) -> bytes:
        """The stored object ``name`` (a chunk object, still encoded).

        Raises:
            CheckpointCorruptError: the object is missing (``.path`` is its path).
            TransientBackendError, PermanentBackendError: storage failures.
        """
        path = self.object_path(name)
        try:
            return _fsutil.read_bytes(self.filesystem, path, retry=self.retry)
        except FileNotFoundError:
            raise CheckpointCorruptError(
                f"chunk {name} is missing from {self.root!r}: the checkpoint is missing a "
                "chunk and cannot be read; resume from an earlier checkpoint",
                path=path) from None

    def read_many(self, names: Iterable[str]) -> Iterator[tuple[str, bytes]]:
        """``(name, stored object)`` for each of ``names``, in their order, read
        ``workers`` at a time (at most ``2 * workers`` objects held at once).

        Raises:
            As :meth:`read`, for the first name that fails in order.
        """
        todo = iter(list(names))
        with ThreadPoolExecutor(self.workers, thread_name_prefix="cs-chunk-read") as pool:
            window: list[tuple[str, Any]] = []
            for name in todo:
                window.append((name, pool.submit(self.read, name)))
                if len(window) >= 2 * self.workers:
                    n, fut = window.pop(0)
                    yield n, fut.result()
            for n, fut in window:
                yield n, fut.result()

    def list_objects(self) -> dict[str, int]:
        """``{object name: stored size in bytes}`` of every object (one
        recursive listing; control files and foreign names left out)."""
        out: dict[str, int] = {}
        for fi in _fsutil.list_tree(self.filesystem, self.root, retry=self.retry):
            name = posixpath.basename(fi.path)
            if (fi.type == pafs.FileType.File and _OBJECT_RE.match(name)
                    and fi.path == f"{self.root}/{name[:2]}/{name}"):
                out[name] = fi.size
        return out

    def stat_objects(self, names: Iterable[str]) -> dict[str, int]:
        """``{name: stored size}`` of those of ``names`` that exist: one HEAD
        each in parallel, or one listing of each needed prefix from
        :data:`LISTING_THRESHOLD` names on."""
        wanted = {check_object_name(n) for n in names}
        if len(wanted) >= LISTING_THRESHOLD:
            prefixes = sorted({n[:2] for n in wanted})
            found: dict[str, int] = {}
            for listing in self._parallel(
                    lambda p: _fsutil.list_dir(self.filesystem, f"{self.root}/{p}",
                                               retry=self.retry), prefixes):
                for fi in listing:
                    base = posixpath.basename(fi.path)
                    if base in wanted and fi.type == pafs.FileType.File:
                        found[base] = fi.size
            return found
        order = sorted(wanted)
        infos = self._parallel(
            lambda n: _fsutil.info(self.filesystem, self.object_path(n), retry=self.retry), order)
        return {n: fi.size for n, fi in zip(order, infos, strict=True)
                if fi.type == pafs.FileType.File}

    def writes_in_place(self) -> bool:
        """Whether an object being written shows under its name before it is
        whole, so a writer killed meanwhile leaves it torn: fsspec
        filesystems over directories (``DirFileSystem``, sftp, webdav) and
        other stores with directories that are neither the local disk
        (written aside and renamed) nor the in-process memory store
        (published on close). Object stores put an object whole."""
        return (self._caps.directories and _fsutil.local_path(self.filesystem, self.root) is None
                and not _fsutil.in_process_store(self.filesystem))

    def torn_objects(self, present: Mapping[str, int], logical: Mapping[str, int]) -> set[str]:
        """Those of ``present`` (``{object name: stored size}``, from
        :meth:`stat_objects`) that are not whole: shorter than any object of
        their chunk's ``logical`` bytes can be (an object created empty, as
        pyarrow's Azure client does on open), or, where the store
        :meth:`writes_in_place`, of another size than their own header says
        (one more small read each)."""
        torn = {n for n, size in present.items()
                if n in logical and size < min_object_size(logical[n])}
        if not self.writes_in_place():
            return torn
        rest = sorted(n for n in present if n not in torn)
        sizes = self._parallel(self._whole_size, rest)
        return torn | {n for n, whole in zip(rest, sizes, strict=True) if whole != present[n]}

    def _whole_size(self, name: str) -> int | None:
        path = self.object_path(name)

        def head() -> bytes:
            with self.filesystem.open_input_file(path) as f:
                return f.read(SIZE_HEAD_BYTES)

        try:
            return object_size(_retry.call(head, policy=self.retry, store=self.filesystem,
                                           what=f"read {path}"), where=path)
        except (FileNotFoundError, CheckpointCorruptError):
            return None

    def delete_object(self, name: str) -> None:
        """Delete one object; nothing happens if it is absent."""
        _fsutil.delete_file(self.filesystem, self.object_path(name), retry=self.retry)

    def write_object(self, name: str, blob: bytes) -> None:
        """Write one object whole (readers see all of it or nothing)."""
        _fsutil.write_bytes(self.filesystem, self.object_path(name), blob, self._caps,
                            retry=self.retry)

    # -- control files ---------------------------------------------------------

    def control_dir(self, kind: str) -> str:
        """``<root>/.intents`` or ``<root>/.condemned``."""
        assert kind in (INTENTS_DIR, CONDEMNED_DIR), kind
        return f"{self.root}/{kind}"

    def write_control(self, kind: str, stem: str, chunks: Iterable[str], created_at: float,
                      **extra: Any) -> str:
        """Write ``<root>/<kind>/<stem>.json`` and return its path."""
        path = f"{self.control_dir(kind)}/{stem}.json"
        body = {**extra, "created_at": created_at, "chunks": sorted(set(chunks))}
        _fsutil.write_bytes(self.filesystem, path, json.dumps(body).encode(), self._caps,
                            retry=self.retry)
        return path

    def read_controls(self, kind: str) -> list[ControlFile]:
        """Every control file of ``kind`` (one listing, then the reads in
        parallel). A file gone between listing and read is left out; one
        read torn is read again (:func:`~checkpoint_store._util.fs.read_control`);
        one that still does not parse comes back with ``chunks=None`` and
        its mtime."""
        infos = [fi for fi in _fsutil.list_dir(self.filesystem, self.control_dir(kind),
                                               retry=self.retry)
                 if fi.type == pafs.FileType.File and fi.path.endswith(".json")]
        read = self._parallel(self._read_control, infos)
        return [c for c in read if c is not None]

    def _read_control(self, fi: pafs.FileInfo) -> ControlFile | None:
        mtime = fi.mtime.timestamp() if fi.mtime is not None else 0.0
        try:
            # Read again while torn: a file seen while it is written in
            # place (fsspec filesystems over directories) reads empty or
            # cut short, and an intent or condemned file taken for
            # unparsable protects or condemns everything (a writer then
            # uploads every chunk afresh).
            body = _fsutil.read_control(self.filesystem, fi.path, json.loads, retry=self.retry)
        except FileNotFoundError:
            return None
        except ValueError:
            return ControlFile(fi.path, mtime, None)
        try:
            created = float(body["created_at"])
            chunks = frozenset(check_object_name(n) for n in body["chunks"])
        except (ValueError, TypeError, KeyError):
            return ControlFile(fi.path, mtime, None)
        return ControlFile(fi.path, created, chunks)

    def delete_path(self, path: str) -> None:
        """Delete a control file; nothing happens if it is absent."""
        _fsutil.delete_file(self.filesystem, path, retry=self.retry)

    # -- writers ---------------------------------------------------------------

    def prepare(self, names: Iterable[str], *, writer: str,
                now: Callable[[], float] = time.time,
                sizes: Mapping[str, int] | None = None) -> ChunkWrite:
        """A write of ``names`` that has not started: run :meth:`ChunkWrite.steps`
        (the protocol one step at a time; state machines do) or use :meth:`begin`.
        ``sizes``: logical bytes of each chunk, where known (see :meth:`begin`)."""
        if not _WRITER_RE.match(writer):
            raise ValueError(f"writer {writer!r}: use 1 to 100 of A-Z a-z 0-9 _ . -")
        return ChunkWrite(self, sorted({check_object_name(n) for n in names}), writer, now,
                          logical=dict(sizes or {}))

    def begin(self, names: Iterable[str], *, writer: str,
              now: Callable[[], float] = time.time,
              sizes: Mapping[str, int] | None = None) -> ChunkWrite:
        """Start writing a checkpoint whose files reference the chunks ``names``
        (docs/format.md, "Chunks"): write the intent, read every condemned
        file, check which objects exist and are whole (``sizes``, the logical
        bytes of each chunk, lets the check find torn objects: see
        :meth:`torn_objects`). Then upload :attr:`ChunkWrite.missing`
        with :meth:`ChunkWrite.upload`, commit the marker referencing
        :attr:`ChunkWrite.object_names`, and :meth:`ChunkWrite.finish`.

        Raises:
            ValueError: a bad chunk name or writer.
            TransientBackendError, PermanentBackendError: storage failures
                (the intent, if written, is deleted again where possible).
        """
        w = self.prepare(names, writer=writer, now=now, sizes=sizes)
        try:
            for _ in w.steps():
                pass
        except BaseException:
            w.finish(quiet=True)
            raise
        return w

    def _parallel(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        if len(items) <= 1:
            return [fn(i) for i in items]
        with ThreadPoolExecutor(min(self.workers, len(items)),
                                thread_name_prefix="cs-chunk") as pool:
            return list(pool.map(fn, items))


@dataclass
class ChunkWrite:
    """One writer's use of the store, from its intent to :meth:`finish`.

    Attributes:
        object_names: ``{chunk name: object name to reference}``: the chunk
            name itself, or a fresh ``<name>.<8 hex>`` when a gc condemned it.
        missing: object names the caller must :meth:`upload` before its commit.
        stored_sizes: ``{object name: stored bytes}`` of the objects found present.
        intent_path: the intent file (None before the first step).
        created_at: the intent's time (seconds since the epoch; by ``now``).
    """

    store: ChunkStore
    names: list[str]
    writer: str
    now: Callable[[], float]
    logical: dict[str, int] = field(default_factory=dict)
    object_names: dict[str, str] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    stored_sizes: dict[str, int] = field(default_factory=dict)
    intent_path: str | None = None
    created_at: float = 0.0
    _condemned: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _done: bool = False

    def steps(self) -> Generator[str, None, None]:
        """The protocol's steps before the uploads, yielding after each:
        ``"intent"`` (written before any existence check), ``"condemned"``
        (every condemned file read), ``"checked"`` (``missing`` known)."""
        self.created_at = self.now()
        self.intent_path = self.store.write_control(
            INTENTS_DIR, f"{self.writer}-{uuid.uuid4().hex}", self.names, self.created_at,
            writer=self.writer)
        yield "intent"
        for c in self.store.read_controls(CONDEMNED_DIR):
            # A condemned file that does not parse condemns everything.
            self._condemned |= set(self.names) if c.chunks is None else \
                {base_name(n) for n in c.chunks}
        yield "condemned"
        rest = [n for n in self.names if n not in self._condemned]
        present = self.store.stat_objects(rest)
        # A torn object (a writer killed while writing it in place) is not
        # trusted, nor written over where others may be reading it: a fresh
        # copy goes under a new name, as for a condemned chunk.
        torn = self.store.torn_objects(present, self.logical)
        for n in self.names:
            if n in self._condemned or n in torn:
                fresh = f"{n}.{uuid.uuid4().hex[:8]}"
                self.object_names[n] = fresh
                self.missing.add(fresh)
        self.stored_sizes = {n: s for n, s in present.items() if n not in torn}
        for n in rest:
            if n in torn:
                continue
            self.object_names[n] = n
            if n not in present:
                self.missing.add(n)
        yield "checked"

    def upload(self, object_name: str, blob: bytes) -> None:
        """Write one object of :attr:`missing` whole (``blob`` from
        ``encode_chunk``). Safe to call from several threads at once.

        Raises:
            ValueError: ``object_name`` is not one this write references.
            TransientBackendError, PermanentBackendError, StorageFullError.
        """
        if object_name not in self.missing:
            raise ValueError(f"{object_name!r} is not one of this write's missing objects")
        self.store.write_object(object_name, blob)

    def finish(self, *, quiet: bool = False) -> None:
        """Delete the intent (after the commit, or after a failure). A second
        call does nothing. With ``quiet``, storage errors are swallowed: the
        intent then expires after the gc's ``intent_ttl_s``."""
        with self._lock:
            if self._done or self.intent_path is None:
                self._done = True
                return
            self._done = True
        try:
            self.store.delete_path(self.intent_path)
        except OSError:
            if not quiet:
                raise

    def __enter__(self) -> ChunkWrite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish(quiet=exc[0] is not None)
