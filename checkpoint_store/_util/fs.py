"""Small helpers over ``pyarrow.fs.FileSystem`` used by every layer above backends.

Each helper that touches storage retries transient errors (see
:mod:`checkpoint_store._util.retry`); ``retry=None`` means the default policy
from the environment. A missing path is an answer, not an error, wherever
the docstring says so.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import filelock
import pyarrow.fs as pafs

try:
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - not POSIX
    _fcntl = None  # type: ignore[assignment]

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import temp_file_name
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.liveness import writer_tag
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Capabilities
from checkpoint_store.backends.clients import writer_of
from checkpoint_store.backends.handlers import (
    folder_blobs_as_directories,
    placeholders_as_directories,
)


def info(fs: pafs.FileSystem, path: str, *, retry: RetryPolicy | None = None) -> pafs.FileInfo:
    return _retry.call(lambda: fs.get_file_info(path), policy=retry, store=fs, what=f"stat {path}")


def exists(fs: pafs.FileSystem, path: str, *, retry: RetryPolicy | None = None) -> bool:
    return info(fs, path, retry=retry).type != pafs.FileType.NotFound


def kind(fs: pafs.FileSystem, path: str, *, retry: RetryPolicy | None = None
         ) -> pafs.FileType:
    """What ``path`` is, as a listing of its parent says (:func:`list_dir`).

    A name that is both an object and a prefix (an object ``dir`` beside
    ``dir/...`` on an object store) is a directory: its object is another
    tool's directory placeholder, never a file of ours. A stat answers
    "file" for it, so a file off the local disk costs one listing more.
    """
    fi = info(fs, path, retry=retry)
    if fi.type != pafs.FileType.File or local_path(fs, path) is not None:
        return fi.type
    try:
        children = list_dir(fs, path, retry=retry)
    except OSError:  # listing a plain file fails on some stores
        return fi.type
    return pafs.FileType.Directory if children else fi.type


def is_dir(fs: pafs.FileSystem, path: str, *, retry: RetryPolicy | None = None) -> bool:
    """Whether ``path`` is a directory (also one beside an object of its name, see :func:`kind`)."""
    return kind(fs, path, retry=retry) == pafs.FileType.Directory


def is_file(fs: pafs.FileSystem, path: str, *, retry: RetryPolicy | None = None) -> bool:
    return info(fs, path, retry=retry).type == pafs.FileType.File


def read_bytes(fs: pafs.FileSystem, path: str, *, retry: RetryPolicy | None = None) -> bytes:
    """The whole file. Raises FileNotFoundError (not retried) when it is absent."""

    def _read() -> bytes:
        with fs.open_input_stream(path) as f:
            return f.read()

    return _retry.call(_read, policy=retry, store=fs, what=f"read {path}")


#: Reads, in all, of a control file that does not parse, and the pauses
#: between them (0.75 s in all); the first is short: a file read the same
#: after it is not being written.
CONTROL_READS = 5
_CONTROL_PAUSES_S = (0.02, 0.08, 0.2, 0.45)


class UnparsableFileError(ValueError):
    """A control file that stayed unparsable for every read of
    :func:`read_control` (or read the same twice): cut short or empty, by a
    writer that died (or is still stuck) half way, or not ours.

    Attributes:
        path: the file, as the filesystem spells it.
        raw: the bytes of the last read.
    """

    def __init__(self, path: str, raw: bytes, cause: ValueError, reads: int = CONTROL_READS):
        super().__init__(f"{path} is not readable as JSON after {reads} read(s) "
                         f"({len(raw)} bytes; {cause})")
        self.path = path
        self.raw = raw


def read_control(
    fs: pafs.FileSystem,
    path: str,
    parse: Callable[[bytes], Any] = _json.loads,
    *,
    retry: RetryPolicy | None = None,
) -> Any:
    """``parse`` of the file ``path``, a small control file that other
    processes rewrite in place (a lease, a state root, user metadata).

    A store may show such a file torn while it is rewritten: S3, GCS and
    Azure through pyarrow stat an object and then read ranges of it (the
    new version cut at the old length); pyarrow's Azure client makes the
    blob empty as it opens it for writing; fsspec filesystems over
    directories (``DirFileSystem``, sftp, webdav) write in place. So a body
    that ``parse`` refuses (``ValueError``, which ``UnicodeDecodeError`` is)
    is read again, up to :data:`CONTROL_READS` times in all within about
    0.75 s, for as long as a write may be under way: while it is empty, or
    changed since the read before. The same bytes twice (20 ms apart at the
    first try) are no write in flight but a file cut short for good (a
    writer killed half way, a damaged file): unparsable at once. A body
    that parses at the first read costs nothing more.

    Raises:
        FileNotFoundError: the file is absent (also when it was deleted
            between two reads): not retried.
        UnparsableFileError: every read was refused by ``parse``; the
            caller decides what an unreadable file means.
        OSError: as :func:`read_bytes`.
    """
    before: bytes | None = None
    for n in range(CONTROL_READS):
        if n:
            time.sleep(_CONTROL_PAUSES_S[n - 1])
        raw = read_bytes(fs, path, retry=retry)
        try:
            return parse(raw)
        except ValueError as exc:
            refused = exc
        if raw and raw == before:
            break  # not moving: no write in flight
        before = raw
    raise UnparsableFileError(path, raw, refused, n + 1) from refused


def list_dir(
    fs: pafs.FileSystem, path: str, *, retry: RetryPolicy | None = None
) -> list[pafs.FileInfo]:
    """Direct children of ``path``; an empty list when it does not exist.
    Directory placeholders of other tools are directories
    (:func:`~checkpoint_store.backends.handlers.placeholders_as_directories`),
    whichever filesystem lists them.

    Raises:
        PermanentBackendError: the listing names its entries in another form
            than ``path`` (see :func:`_under`).
    """
    sel = pafs.FileSelector(path, allow_not_found=True, recursive=False)
    infos = _retry.call(lambda: fs.get_file_info(sel), policy=retry, store=fs, what=f"list {path}")
    return _under(fs, path, _as_tree(fs, path, infos))


def list_tree(
    fs: pafs.FileSystem, root: str, *, retry: RetryPolicy | None = None
) -> list[pafs.FileInfo]:
    """Every entry under ``root`` (one recursive listing: one request series on
    object stores); empty when it does not exist. Placeholders are
    directories, as in :func:`list_dir`.

    Raises:
        PermanentBackendError: as :func:`list_dir`.
    """
    sel = pafs.FileSelector(root, allow_not_found=True, recursive=True)
    infos = _retry.call(lambda: fs.get_file_info(sel), policy=retry, store=fs, what=f"list {root}")
    return _under(fs, root, _as_tree(fs, root, infos))


def _as_tree(fs: pafs.FileSystem, base: str, infos: list[pafs.FileInfo]) -> list[pafs.FileInfo]:
    """A listing with other tools' directory placeholders as directories,
    also those of a pyarrow ``AzureFileSystem`` passed in as it is."""
    return placeholders_as_directories(base, folder_blobs_as_directories(fs, infos))


def _under(fs: pafs.FileSystem, root: str, infos: list[pafs.FileInfo]) -> list[pafs.FileInfo]:
    """``infos``, each checked to lie under ``root`` as spelled.

    Paths are normalised once where they enter (``Backend.normalize_path``),
    so a listing in another spelling means a backend whose ``normalize_path``
    does not match its listings. Read on, it would turn names into paths
    outside the directory (a manifest of absolute paths, a checkpoint that
    reads as uncommitted): stop with the two spellings instead.
    """
    prefix = root.rstrip("/") + "/"
    for fi in infos:
        if not fi.path.startswith(prefix):
            from checkpoint_store.errors import PermanentBackendError

            raise PermanentBackendError(
                f"listing {root!r} on {fs.type_name} returned {fi.path!r}, which is not "
                "spelled under it; the backend's normalize_path must give paths as its "
                "listings spell them"
            )
    return infos


def relative(root: str, path: str) -> str:
    """``path`` relative to ``root`` (``path`` must lie under it, as listings
    from :func:`list_tree` do)."""
    prefix = root.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else path


def walk_files(
    fs: pafs.FileSystem, root: str, *, retry: RetryPolicy | None = None
) -> Iterator[tuple[str, int]]:
    """``(relative posix path, size in bytes)`` of every file under ``root``."""
    for fi in list_tree(fs, root, retry=retry):
        if fi.type == pafs.FileType.File:
            yield relative(root, fi.path), fi.size


def ensure_dir(
    fs: pafs.FileSystem, path: str, caps: Capabilities, *, retry: RetryPolicy | None = None
) -> None:
    """Create ``path`` where the store has real directories; a no-op on object
    stores, where a directory marker would cost a request and a zero-byte object.

    Raises:
        PermanentBackendError: it cannot be created: a directory above it
            takes no new entries (``/proc``, ``/sys``: "No such file or
            directory" for a name that is not there), is a file, or is not
            writable; the message names ``path``.
    """
    if not caps.directories:
        return
    try:
        _retry.call(lambda: fs.create_dir(path, recursive=True), policy=retry, store=fs,
                    what=f"create directory {path}")
    except FileNotFoundError as exc:
        # Creating never misses a path it makes itself: a parent that
        # cannot hold new directories (a pseudo filesystem, a dangling link).
        from checkpoint_store.errors import PermanentBackendError

        raise PermanentBackendError(
            f"cannot create the directory {path!r}: {exc}. A directory above it takes no new "
            "entries (a pseudo filesystem such as /proc or /sys, or a broken symlink on the "
            "way); choose a location you can write to",
            cause=exc,
        ) from exc


#: Schemes whose paths start with a bucket or container (``bucket/key``).
BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})
_BUCKET_WORD = {"az": "container", "abfs": "container", "abfss": "container",
                "adl": "container"}


def missing_bucket(fs: pafs.FileSystem, path: str, scheme: str | None) -> str | None:
    """The bucket (or container) ``path`` lies in when the store says it does
    not exist, else None. One request (a stat of the bucket); None too when
    ``scheme`` has no buckets or the store does not answer that stat (no
    permission on the bucket itself, any error): only a plain "not found"
    counts."""
    if scheme not in BUCKET_SCHEMES:
        return None
    bucket = path.lstrip("/").split("/", 1)[0]
    if not bucket:
        return None
    try:
        found = fs.get_file_info(bucket)
    except Exception:  # noqa: BLE001 - unknown: the caller's own error stands
        return None
    return bucket if found.type == pafs.FileType.NotFound else None


def missing_bucket_message(scheme: str, bucket: str, uri: str) -> str:
    """"The bucket X does not exist" and how to create it, for ``uri``."""
    word = _BUCKET_WORD.get(scheme, "bucket")
    how = {"s3": f"`aws s3 mb s3://{bucket}`", "s3a": f"`aws s3 mb s3://{bucket}`",
           "gs": f"`gcloud storage buckets create gs://{bucket}`",
           "gcs": f"`gcloud storage buckets create gs://{bucket}`"}.get(
        scheme, f"`az storage container create --name {bucket}`")
    return (f"the {word} {bucket!r} of {uri} does not exist: create it first ({how}, or in "
            f"the console), or fix its name")


def delete_dir(fs: pafs.FileSystem, path: str, *, retry: RetryPolicy | None = None) -> None:
    """Delete ``path`` and everything under it; nothing happens if it is absent.
    An object of the directory's own name (another tool's placeholder, see
    :func:`kind`) goes with it.

    Raises:
        PermanentBackendError: the filesystem reported success but ``path``
            is still there (see :func:`_check_gone`).
    """

    def _delete() -> None:
        # A name both an object and a prefix stats as the one, then the other.
        for _ in range(2):
            try:
                fi = fs.get_file_info(path)
                if fi.type == pafs.FileType.NotFound:
                    return
                if fi.type == pafs.FileType.File:
                    fs.delete_file(path)
                else:
                    fs.delete_dir(path)
            except FileNotFoundError:
                pass
        _check_gone(fs, path)

    _retry.call(_delete, policy=retry, store=fs, what=f"delete {path}")


def delete_file(fs: pafs.FileSystem, path: str, *, retry: RetryPolicy | None = None) -> None:
    """Delete one file; nothing happens if it is absent.

    Raises:
        PermanentBackendError: as :func:`delete_dir`.
    """

    def _delete() -> None:
        try:
            fs.delete_file(path)
        except FileNotFoundError:
            pass
        except OSError:
            if fs.get_file_info(path).type != pafs.FileType.NotFound:
                raise
            return
        _check_gone(fs, path)

    _retry.call(_delete, policy=retry, store=fs, what=f"delete {path}")


def _check_gone(fs: pafs.FileSystem, path: str) -> None:
    """Raise unless ``path`` is gone: a delete that removed nothing where a
    listing showed something is a failure, never a success. (fsspec reads
    ``[``, ``*``, ``?`` as glob patterns, and some clients swallow per-key
    errors of a bulk delete: both "succeed" and leave the path in place.)"""
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        from checkpoint_store.errors import PermanentBackendError

        raise PermanentBackendError(
            f"deleting {path!r} on {fs.type_name} reported success but it is still there; "
            "nothing was counted as deleted. Check the store's permissions, or whether its "
            "client reads [, * or ? in names as patterns"
        )


def move(fs: pafs.FileSystem, src: str, dst: str, *, retry: RetryPolicy | None = None) -> None:
    """Rename ``src`` to ``dst`` (atomic for directories on local disks)."""
    _retry.call(lambda: fs.move(src, dst), policy=retry, store=fs, what=f"rename {src} to {dst}")


def local_path(fs: pafs.FileSystem, path: str) -> str | None:
    """The OS path when ``fs`` is the local disk (so os-level calls like fsync apply)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return path
    if isinstance(fs, pafs.SubTreeFileSystem) and isinstance(fs.base_fs, pafs.LocalFileSystem):
        return posixpath.join(fs.base_path, path.lstrip("/"))
    return None


def link_target(fs: pafs.FileSystem, path: str) -> str | None:
    """Where ``path`` leads when it is a symbolic link on the local disk (as
    stored, relative or not), else None: listings and reads follow links, and
    only an ``lstat`` tells one from the directory it names. Object stores and
    memory have no links (always None)."""
    local = local_path(fs, path)
    if local is None:
        return None
    try:
        return os.readlink(local.rstrip("/") or "/")
    except (OSError, ValueError):  # not a link, absent, or a name the OS refuses
        return None


def fsync_dir(path: str) -> None:
    """fsync a directory so the entries created in it survive a machine crash.

    Best effort: some filesystems refuse to open or fsync directories, and
    there is nothing better to do on those.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(
    fs: pafs.FileSystem,
    path: str,
    data: bytes,
    caps: Capabilities,
    *,
    fsync: bool = True,
    retry: RetryPolicy | None = None,
) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new bytes, never a mix.

    On a local disk: a temporary sibling named ``.cs_tmp-...`` (an internal
    name, so listings and manifests ignore it), fsynced, renamed over
    ``path``, then the directory fsynced. On object stores a single PUT
    already is atomic; it is retried on transient errors.
    """
    parent = posixpath.dirname(path)
    ensure_dir(fs, parent, caps, retry=retry)
    osp = local_path(fs, path)
    if osp is not None:
        base = os.path.basename(osp)
        tmp = os.path.join(
            os.path.dirname(osp), temp_file_name(base, writer_tag(), uuid.uuid4().hex[:8])
        )
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if fsync and caps.needs_fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, osp)
        except BaseException as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            # A full disk says so (StorageFullError), as a copy that fails does.
            typed = _retry.typed_permanent(exc, f"write {osp}")
            if typed is exc:
                raise
            raise typed from exc
        if fsync and caps.needs_fsync:
            fsync_dir(os.path.dirname(osp))
        return

    def _put() -> None:
        # One PUT, not a multipart upload of three requests, through a
        # pyarrow S3FileSystem the user passed in (see writer_of).
        out = writer_of(fs).open_output_stream(path)
        try:
            out.write(data)
        except BaseException:
            # Not closed, as a ``with`` block would: a store that publishes
            # a write as its writer closes (the memory backend) then keeps
            # the old bytes where a signal's exception cut the write, not
            # an empty or half file. Dropped here, so that it goes now.
            del out
            raise
        out.close()

    _retry.call(_put, policy=retry, store=fs, what=f"write {path}")


def fsync_tree(fs: pafs.FileSystem, root: str, files: Iterable[str]) -> None:
    """fsync each file and each directory under ``root`` (local disks only):
    a writer in place may not have, and the marker must not outlive its data."""
    root_os = local_path(fs, root)
    if root_os is None:
        return
    dirs = {""}
    for rel in files:
        fd = os.open(os.path.join(root_os, rel), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.add(posixpath.dirname(rel))
    for d in sorted(dirs):
        fsync_dir(os.path.join(root_os, d))


_thread_locks: dict[tuple[int | str, str], threading.Lock] = {}
_thread_locks_guard = threading.Lock()


def in_process_store(fs: pafs.FileSystem) -> bool:
    """Whether ``fs`` is fsspec's memory store: every client of it in this
    process reads and writes one store, which no other process sees (so a
    lock of this process is a lock of every writer)."""
    if not isinstance(fs, pafs.PyFileSystem):
        return False
    from fsspec.implementations.memory import MemoryFileSystem

    # Exactly the class: a subclass may keep a store of its own.
    return type(getattr(fs.handler, "fs", None)) is MemoryFileSystem


@contextlib.contextmanager
def dir_lock(fs: pafs.FileSystem, parent: str, lock_name: str) -> Iterator[None]:
    """Hold ``parent``'s lock: across threads always (of one client, or of
    every client of the in-process memory store, :func:`in_process_store`),
    across processes with a file lock ``parent/lock_name`` when ``parent`` is
    on the local disk. The lock file exists only while the lock is held
    (removed before release, see :func:`_acquire_removable`), so none is left
    beside the checkpoints.

    Raises:
        PermanentBackendError: the lock file cannot be opened (a directory
            or another non-file took its name, or ``parent`` is not
            writable); the message names it and what to do.
    """
    key = ("memory" if in_process_store(fs) else id(fs), parent)
    with _thread_locks_guard:
        tlock = _thread_locks.setdefault(key, threading.Lock())
    with tlock:
        parent_os = local_path(fs, parent)
        if parent_os is None:
            yield
            return
        lock_path = os.path.join(parent_os, lock_name)
        if _fcntl is None:  # pragma: no cover - not POSIX: filelock's own, file kept
            lock = filelock.FileLock(lock_path)
            try:
                lock.acquire()
            except OSError as exc:
                raise _lock_error(lock_path, exc) from exc
            try:
                yield
            finally:
                lock.release()
            return
        fd = _acquire_removable(lock_path)
        try:
            yield
        finally:
            # Removed while still held, so no lock file is left behind: a
            # waiter that locked this file finds it gone and takes a new one.
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
            os.close(fd)


def _acquire_removable(lock_path: str) -> int:
    """An ``flock``-ed descriptor of the file now at ``lock_path``, which its
    holder removes before it lets go (:func:`dir_lock`): a lock taken on a
    file that was removed (or replaced) meanwhile is dropped and taken again
    on the new one, so two holders never lock different files."""
    assert _fcntl is not None
    while True:
        try:
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                # The directory is not there yet (filelock made it too).
                os.makedirs(os.path.dirname(lock_path), exist_ok=True)
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _lock_error(lock_path, exc) from exc
        try:
            _fcntl.flock(fd, _fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                now = os.stat(lock_path)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev):
            return fd
        os.close(fd)


def _lock_error(lock_path: str, exc: OSError) -> OSError:
    """The typed error for a lock file that cannot be opened."""
    from checkpoint_store.errors import PermanentBackendError

    if os.path.isdir(lock_path) or (os.path.lexists(lock_path)
                                    and not os.path.isfile(lock_path)):
        return PermanentBackendError(
            f"cannot take the lock {lock_path!r}: it is not a file ({exc.strerror or exc}). "
            "checkpoint-store keeps a lock file of that name there: move away or remove what "
            "took its name, and try again; nothing was committed",
            cause=exc,
        )
    typed = _retry.typed_permanent(exc, f"take the lock {lock_path}")
    return typed if isinstance(typed, OSError) else exc

